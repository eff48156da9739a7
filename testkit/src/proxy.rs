//! A TCP proxy that can lie: what a peer with a bad NIC, bad RAM or bad intent looks like
//! from the other end. A node started with `--advertise` at the proxy is reached only
//! through it; once `corrupt` is set, the proxy flips one byte in every 256 KiB that
//! the node sends back (past each connection's first 64 KiB, where HTTP/2's settings and
//! headers are), so the HTTP/2 framing survives and the damage lands in blob bytes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bytes between two flipped bytes of one connection's server-to-client stream.
const EVERY: u64 = 256 << 10;
/// Bytes of each connection's server-to-client stream left alone.
const CLEAN_START: u64 = 64 << 10;

pub struct LyingProxy {
    /// Where clients connect (what the node advertises).
    pub addr: SocketAddr,
    target: Arc<Mutex<Option<SocketAddr>>>,
    corrupt: Arc<AtomicBool>,
    flipped: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl LyingProxy {
    /// Listens on a free loopback port; connections wait for `forward_to`.
    pub async fn start() -> LyingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let corrupt = Arc::new(AtomicBool::new(false));
        let flipped = Arc::new(AtomicU64::new(0));
        let (t, c, f) = (target.clone(), corrupt.clone(), flipped.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Some(to) = *t.lock().unwrap() else {
                    continue;
                };
                let (c, f) = (c.clone(), f.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(to).await {
                        pump(client, server, c, f).await;
                    }
                });
            }
        });
        LyingProxy {
            addr,
            target,
            corrupt,
            flipped,
            task,
        }
    }

    pub fn forward_to(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = Some(to);
    }

    /// From now on (on every connection, open or new), the server's bytes are damaged.
    pub fn corrupt(&self, on: bool) {
        self.corrupt.store(on, Ordering::SeqCst);
    }

    /// Bytes flipped so far.
    pub fn flipped(&self) -> u64 {
        self.flipped.load(Ordering::SeqCst)
    }
}

impl Drop for LyingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(client: TcpStream, server: TcpStream, corrupt: Arc<AtomicBool>, flipped: Arc<AtomicU64>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
        let _ = sw.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 64 << 10];
        let mut pos = 0u64;
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if corrupt.load(Ordering::SeqCst) {
                for (i, b) in buf[..n].iter_mut().enumerate() {
                    let at = pos + i as u64;
                    if at >= CLEAN_START && at % EVERY == EVERY / 2 {
                        *b ^= 0x5a;
                        flipped.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            pos += n as u64;
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(up, down);
}

/// A node that answers every ReadBlob with 1 MiB messages, forever: a peer gone wrong (or
/// hostile) that would fill its caller's memory if the caller kept taking. Every other
/// call is UNIMPLEMENTED.
pub struct EndlessPeer {
    pub addr: SocketAddr,
    /// Messages sent so far, over all streams.
    pub sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl EndlessPeer {
    pub async fn start() -> EndlessPeer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(AtomicU64::new(0));
        let svc = Endless { sent: sent.clone() };
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(locus_proto::nodepb::node_server::NodeServer::new(svc))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        EndlessPeer { addr, sent, task }
    }
}

impl Drop for EndlessPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Endless {
    sent: Arc<AtomicU64>,
}

type Res<T> = Result<tonic::Response<T>, tonic::Status>;

fn unimplemented<T>() -> Res<T> {
    Err(tonic::Status::unimplemented("an endless peer only streams"))
}

#[tonic::async_trait]
impl locus_proto::nodepb::node_server::Node for Endless {
    type ReadBlobStream =
        tokio_stream::wrappers::ReceiverStream<Result<locus_proto::nodepb::BlobData, tonic::Status>>;
    type UploadBlobsStream =
        tokio_stream::wrappers::ReceiverStream<Result<locus_proto::nodepb::UploadProgress, tonic::Status>>;

    async fn read_blob(
        &self,
        _r: tonic::Request<locus_proto::nodepb::ReadBlobRequest>,
    ) -> Res<Self::ReadBlobStream> {
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let sent = self.sent.clone();
        tokio::spawn(async move {
            let piece = bytes::Bytes::from(vec![7u8; 1 << 20]);
            loop {
                let m = locus_proto::nodepb::BlobData { data: piece.clone() };
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
                sent.fetch_add(1, Ordering::SeqCst);
            }
        });
        Ok(tonic::Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }
    async fn write_blob(
        &self,
        _r: tonic::Request<tonic::Streaming<locus_proto::nodepb::WriteBlobMessage>>,
    ) -> Res<locus_proto::nodepb::WriteBlobResponse> {
        unimplemented()
    }
    async fn write_blobs(
        &self,
        _r: tonic::Request<locus_proto::nodepb::WriteBlobsRequest>,
    ) -> Res<locus_proto::nodepb::WriteBlobsResponse> {
        unimplemented()
    }
    async fn have_blobs(
        &self,
        _r: tonic::Request<locus_proto::nodepb::HaveBlobsRequest>,
    ) -> Res<locus_proto::nodepb::HaveBlobsResponse> {
        unimplemented()
    }
    async fn fetch_blobs(
        &self,
        _r: tonic::Request<locus_proto::nodepb::FetchBlobsRequest>,
    ) -> Res<locus_proto::nodepb::FetchBlobsResponse> {
        unimplemented()
    }
    async fn fetch_chunks(
        &self,
        _r: tonic::Request<locus_proto::nodepb::FetchChunksRequest>,
    ) -> Res<locus_proto::nodepb::FetchChunksResponse> {
        unimplemented()
    }
    async fn ensure_local(
        &self,
        _r: tonic::Request<locus_proto::nodepb::EnsureLocalRequest>,
    ) -> Res<locus_proto::nodepb::EnsureLocalResponse> {
        unimplemented()
    }
    async fn local_paths(
        &self,
        _r: tonic::Request<locus_proto::nodepb::LocalPathsRequest>,
    ) -> Res<locus_proto::nodepb::LocalPathsResponse> {
        unimplemented()
    }
    async fn upload_blobs(
        &self,
        _r: tonic::Request<locus_proto::nodepb::UploadBlobsRequest>,
    ) -> Res<Self::UploadBlobsStream> {
        unimplemented()
    }
    async fn import_object(
        &self,
        _r: tonic::Request<locus_proto::nodepb::ImportObjectRequest>,
    ) -> Res<locus_proto::nodepb::ImportObjectResponse> {
        unimplemented()
    }
    async fn get_node_status(
        &self,
        _r: tonic::Request<locus_proto::nodepb::GetNodeStatusRequest>,
    ) -> Res<locus_proto::nodepb::NodeStatus> {
        unimplemented()
    }
}

/// A TCP proxy that lets only TLS through and watches what crosses it: put one in front of
/// each daemon (nodes `--advertise` it, clients get its URL) and every hop of a test
/// cluster is on the record. A connection whose first bytes are not a TLS handshake record
/// (after the bulk path's `MAGIC_TLS`, for a bulk connection) is refused (counted, closed, never forwarded), so a hop that would have gone in clear
/// fails the operation; both directions of every forwarded connection are scanned for the
/// cluster's token secrets and for HTTP/2's cleartext preface.
pub struct WireTap {
    pub addr: SocketAddr,
    target: Arc<Mutex<Option<SocketAddr>>>,
    pub stats: Arc<TapStats>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default, Debug)]
pub struct TapStats {
    /// Connections that began with a TLS handshake and were forwarded.
    pub tls_connections: AtomicU64,
    /// Of those, bulk-path connections: `MAGIC_TLS` in clear, then the TLS handshake.
    pub bulk_tls_connections: AtomicU64,
    /// Connections refused for not beginning with one.
    pub plaintext_refused: AtomicU64,
    /// Bytes forwarded, both directions.
    pub bytes: AtomicU64,
    /// Times a secret (or the cleartext HTTP/2 preface) was seen in forwarded bytes.
    pub secrets_seen: AtomicU64,
}

/// What begins every cleartext HTTP/2 connection (gRPC without TLS).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

impl WireTap {
    /// Listens on a free loopback port; connections wait for `forward_to`.
    pub async fn start(secrets: Vec<String>) -> WireTap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let stats = Arc::new(TapStats::default());
        let mut needles: Vec<Vec<u8>> = secrets.into_iter().map(String::into_bytes).collect();
        needles.push(H2_PREFACE.to_vec());
        let needles = Arc::new(needles);
        let (t, st) = (target.clone(), stats.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Some(to) = *t.lock().unwrap() else {
                    continue;
                };
                let (st, needles) = (st.clone(), needles.clone());
                tokio::spawn(async move { tap(client, to, st, needles).await });
            }
        });
        WireTap {
            addr,
            target,
            stats,
            task,
        }
    }

    pub fn forward_to(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = Some(to);
    }

    pub fn get(&self, f: impl Fn(&TapStats) -> &AtomicU64) -> u64 {
        f(&self.stats).load(Ordering::SeqCst)
    }
}

impl Drop for WireTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TLS record carrying a handshake message: type 22, version 3.x.
fn is_tls_hello(first: &[u8]) -> bool {
    first.len() >= 3 && first[0] == 0x16 && first[1] == 0x03 && first[2] <= 0x04
}

async fn tap(mut client: TcpStream, to: SocketAddr, st: Arc<TapStats>, needles: Arc<Vec<Vec<u8>>>) {
    let mut first = vec![0u8; 3];
    if client.read_exact(&mut first).await.is_err() {
        return;
    }
    // A bulk connection to a TLS node names itself in clear, then starts TLS.
    let magic = &locus_proto::bulk::MAGIC_TLS;
    let bulk = first[..] == magic[..3];
    if bulk {
        let mut rest = vec![0u8; magic.len()];
        if client.read_exact(&mut rest).await.is_err() {
            return;
        }
        first.extend_from_slice(&rest);
        if first[..magic.len()] != magic[..] {
            st.plaintext_refused.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
    if !is_tls_hello(&first[first.len() - 3..]) {
        st.plaintext_refused.fetch_add(1, Ordering::SeqCst);
        return;
    }
    let Ok(mut server) = TcpStream::connect(to).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    if server.write_all(&first).await.is_err() {
        return;
    }
    st.tls_connections.fetch_add(1, Ordering::SeqCst);
    if bulk {
        st.bulk_tls_connections.fetch_add(1, Ordering::SeqCst);
    }
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = scan_copy(&mut cr, &mut sw, &st, &needles);
    let down = scan_copy(&mut sr, &mut cw, &st, &needles);
    tokio::join!(up, down);
}

/// Copies until EOF, counting bytes and needle sightings, also across read boundaries.
async fn scan_copy(
    r: &mut tokio::net::tcp::OwnedReadHalf,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    st: &TapStats,
    needles: &[Vec<u8>],
) {
    let keep = needles.iter().map(Vec::len).max().unwrap_or(1).saturating_sub(1);
    let mut buf = vec![0u8; 64 << 10];
    let mut window: Vec<u8> = Vec::new();
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        st.bytes.fetch_add(n as u64, Ordering::SeqCst);
        window.extend_from_slice(&buf[..n]);
        for nd in needles {
            if window.windows(nd.len()).any(|w| w == nd.as_slice()) {
                st.secrets_seen.fetch_add(1, Ordering::SeqCst);
            }
        }
        let cut = window.len().saturating_sub(keep);
        window.drain(..cut);
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

/// What a stranger's server saw: the credentials each call carried, by method.
#[derive(Default, Debug)]
pub struct Heard {
    /// (gRPC method, the `authorization` header's value if any), in arrival order.
    pub calls: Mutex<Vec<(String, Option<String>)>>,
}

impl Heard {
    pub fn calls(&self) -> Vec<(String, Option<String>)> {
        self.calls.lock().unwrap().clone()
    }
}

/// Records each call's method and `authorization` header before the service sees it.
#[derive(Clone)]
struct Ear<S> {
    inner: S,
    heard: Arc<Heard>,
}

impl<S, B> tower::Service<http::Request<B>> for Ear<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, req: http::Request<B>) -> S::Future {
        let method = req
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let auth = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.heard.calls.lock().unwrap().push((method, auth));
        self.inner.call(req)
    }
}

#[derive(Clone)]
struct EarLayer(Arc<Heard>);

impl<S> tower::Layer<S> for EarLayer {
    type Service = Ear<S>;
    fn layer(&self, inner: S) -> Ear<S> {
        Ear {
            inner,
            heard: self.0.clone(),
        }
    }
}

/// A node API that anyone could run and register (or that a compromised node is): it
/// answers nothing but records what each caller presented, so a test can show that no
/// token reaches it.
pub struct ListeningPeer {
    pub addr: SocketAddr,
    pub heard: Arc<Heard>,
    task: tokio::task::JoinHandle<()>,
}

impl ListeningPeer {
    pub async fn start() -> ListeningPeer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heard = Arc::new(Heard::default());
        let svc = Endless {
            sent: Arc::new(AtomicU64::new(0)),
        };
        let layer = EarLayer(heard.clone());
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .layer(layer)
                .add_service(locus_proto::nodepb::node_server::NodeServer::new(svc))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        ListeningPeer { addr, heard, task }
    }
}

impl Drop for ListeningPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A raft port that claims to be group member `name` but holds no member secret: what a
/// host an attacker controls looks like when an operator is talked into `members
/// add-learner` naming it. Hello answers with the name and no proof; every other call is
/// refused; every call's credentials are recorded.
pub struct ImpostorMember {
    pub addr: SocketAddr,
    pub heard: Arc<Heard>,
    task: tokio::task::JoinHandle<()>,
}

impl ImpostorMember {
    pub async fn start(name: &str) -> ImpostorMember {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heard = Arc::new(Heard::default());
        let svc = Impostor { name: name.into() };
        let layer = EarLayer(heard.clone());
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .layer(layer)
                .add_service(locus_proto::pb::raft_server::RaftServer::new(svc))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        ImpostorMember { addr, heard, task }
    }
}

impl Drop for ImpostorMember {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Impostor {
    name: String,
}

#[tonic::async_trait]
impl locus_proto::pb::raft_server::Raft for Impostor {
    async fn append(
        &self,
        _r: tonic::Request<locus_proto::pb::RaftMessage>,
    ) -> Res<locus_proto::pb::RaftMessage> {
        Err(tonic::Status::unavailable("an impostor keeps what it is sent"))
    }
    async fn vote(
        &self,
        _r: tonic::Request<locus_proto::pb::RaftMessage>,
    ) -> Res<locus_proto::pb::RaftMessage> {
        Err(tonic::Status::unavailable("an impostor keeps what it is sent"))
    }
    async fn install_snapshot(
        &self,
        _r: tonic::Request<locus_proto::pb::RaftMessage>,
    ) -> Res<locus_proto::pb::RaftMessage> {
        Err(tonic::Status::unavailable("an impostor keeps what it is sent"))
    }
    async fn hello(
        &self,
        _r: tonic::Request<locus_proto::pb::RaftHelloRequest>,
    ) -> Res<locus_proto::pb::RaftHello> {
        Ok(tonic::Response::new(locus_proto::pb::RaftHello {
            name: self.name.clone(),
            api_url: "http://127.0.0.1:1".into(),
            ..Default::default()
        }))
    }
    async fn liveness(
        &self,
        _r: tonic::Request<locus_proto::pb::RaftHelloRequest>,
    ) -> Res<locus_proto::pb::RaftMessage> {
        Err(tonic::Status::unavailable("an impostor keeps what it is sent"))
    }
}
