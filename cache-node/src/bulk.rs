//! The node's end of the bulk path (`locus_proto::bulk`): blob bytes sent from the file
//! to the socket with `sendfile`, no user-space copy, on the same TCP port as gRPC.
//!
//! The port's accept loop peeks at each connection's first bytes: the bulk MAGIC goes
//! here, anything else (HTTP/2, a TLS hello) to gRPC. A node with TLS on serves the bulk
//! path only inside TLS: its clients open with MAGIC_TLS, then a TLS handshake with the
//! node's certificate (and theirs, where mutual TLS is on), then the bulk path as over
//! plaintext; a plaintext MAGIC goes to gRPC, whose TLS refuses it (`conn`).
//!
//! Each bulk connection has a thread of its own with blocking I/O: `sendfile` of a file
//! that is not in the page cache blocks on the disk, which must not stall the async
//! runtime, and a blocking socket with send/receive timeouts gives the idle rules for
//! free. Connections are few (a handful per mount and per peer) and bounded by
//! `MAX_CONNECTIONS`; beyond it a client is answered BUSY and uses gRPC.
//!
//! What is sent: a complete blob whose file is unchanged since its last whole-blob check
//! goes out by `sendfile` unhashed (the receiver verifies every byte, and bit rot under
//! an unchanged stamp is the scrub's to find, as for gRPC reads and same-host clients);
//! anything else (a partial blob, a file changed since its check) goes through the
//! store's verified reader, and a range whose first chunk fails is answered DATA_LOSS.
//! A RANGE (a few verification groups of one chunk, with their proof) is read from the
//! file and checked against the chunk's outboard (`crate::ranges`) before it is sent.
//! A WRITE (an import handing the node a blob, under an import grant) is received into
//! the store's write blocks (`write`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use locus_proto::bulk::{self, Code};
use locus_proto::{outboard, BlobHash};

use crate::ranges::Outboards;
use crate::store::{BlobStore, StoreError};

mod conn;
mod write;

use conn::Conn;

/// Bulk connections served at once.
const MAX_CONNECTIONS: usize = 4096;
/// A connection with no request for this long is closed (clients keep theirs ≤ 60 s).
const IDLE_CLOSE: Duration = Duration::from_secs(120);

pub(crate) struct BulkServer {
    pub(crate) store: Arc<BlobStore>,
    pub(crate) peers: Arc<crate::Peers>,
    /// Whether a grant is required (as for the node's gRPC calls).
    pub(crate) require_grants: bool,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    /// A client that takes nothing for this long loses its connection.
    pub(crate) idle: Duration,
    /// Outboards of the chunks clients asked ranges of.
    outboards: Outboards,
    /// The node's TLS, when it serves TLS: then bulk connections are TLS only.
    tls: Option<Arc<locus_proto::tls::rustls::ServerConfig>>,
    live: AtomicUsize,
    /// Every live connection, to be shut down when the node stops.
    conns: Mutex<Vec<(u64, TcpStream)>>,
    next: std::sync::atomic::AtomicU64,
    /// The node's runtime, for the metadata call a read grant narrowed to versions needs
    /// (connections are served on plain threads).
    runtime: Option<tokio::runtime::Handle>,
}

impl BulkServer {
    pub(crate) fn new(
        store: Arc<BlobStore>,
        peers: Arc<crate::Peers>,
        require_grants: bool,
        metrics: Arc<crate::metrics::Metrics>,
        idle: Duration,
        tls: Option<Arc<locus_proto::tls::rustls::ServerConfig>>,
    ) -> Arc<Self> {
        Arc::new(BulkServer {
            store,
            peers,
            require_grants,
            metrics,
            idle,
            tls,
            outboards: Outboards::new(crate::ranges::OUTBOARDS_KEPT),
            live: AtomicUsize::new(0),
            conns: Mutex::new(Vec::new()),
            next: Default::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Takes a connection whose first bytes are the bulk MAGIC (MAGIC_TLS on a TLS node).
    pub(crate) fn serve(self: &Arc<Self>, s: tokio::net::TcpStream) {
        let s = match s.into_std().and_then(|s| s.set_nonblocking(false).map(|_| s)) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("bulk connection: {e}");
                return;
            }
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = s.try_clone() {
            self.conns.lock().unwrap().push((id, c));
        }
        let busy = self.live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS;
        self.metrics.bulk_connections.inc();
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("bulk".into()).spawn(move || {
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            if let Err(e) = me.connection(s, busy) {
                tracing::debug!(%peer, "bulk connection closed: {e}");
            }
            me.live.fetch_sub(1, Ordering::SeqCst);
            me.metrics.bulk_connections.dec();
            me.conns.lock().unwrap().retain(|(i, _)| *i != id);
        });
        if spawned.is_err() {
            self.live.fetch_sub(1, Ordering::SeqCst);
            self.metrics.bulk_connections.dec();
            self.conns.lock().unwrap().retain(|(i, _)| *i != id);
        }
    }

    /// What a bulk connection to this node opens with: MAGIC_TLS when it serves TLS (a
    /// plaintext bulk hello then goes to gRPC, whose TLS refuses it).
    fn magic(&self) -> &'static [u8; 8] {
        match self.tls {
            Some(_) => &bulk::MAGIC_TLS,
            None => &bulk::MAGIC,
        }
    }

    /// Ends every connection (the node is stopping).
    pub(crate) fn stop(&self) {
        for (_, c) in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    fn connection(&self, mut tcp: TcpStream, busy: bool) -> std::io::Result<()> {
        tcp.set_read_timeout(Some(self.idle))?;
        tcp.set_write_timeout(Some(self.idle))?;
        let mut magic = [0u8; 8];
        let mut s = match &self.tls {
            None => Conn::Plain(tcp),
            Some(cfg) => {
                tcp.read_exact(&mut magic)?;
                Conn::tls(tcp, cfg)?
            }
        };
        s.read_exact(&mut magic)?;
        if magic != bulk::MAGIC {
            return Err(std::io::Error::other("no bulk hello"));
        }
        let mut n = [0u8; 2];
        s.read_exact(&mut n)?;
        let n = u16::from_le_bytes(n) as usize;
        if n > bulk::MAX_GRANT {
            return hello(
                &mut s,
                Code::Invalid,
                &format!("a grant of {n} bytes is too long"),
            );
        }
        let mut grant = vec![0u8; n];
        s.read_exact(&mut grant)?;
        if busy {
            return hello(&mut s, Code::Busy, "too many bulk connections; use gRPC");
        }
        // The grant's end (requests after it are refused and the client fetches a new
        // one), and what it opens: reads (a read grant) or writes (an import grant).
        let (until, reads, writes, narrowed) = if self.require_grants {
            use locus_proto::grant::GrantError;
            let (g, now) = (&self.peers.grants, locus_proto::grant::now_ms());
            let checked = match g.verify(&grant, bulk::GRANT_METHOD, now) {
                Ok((_, r)) => Ok((r.expires_unix_ms, true, false, r.scoped.then_some(r))),
                Err(GrantError::WrongMethod { .. }) => g
                    .verify(&grant, bulk::WRITE_GRANT_METHOD, now)
                    .map(|(_, w)| (w.expires_unix_ms, false, true, None)),
                Err(e) => Err(e),
            };
            match checked {
                Ok((until, r, w, n)) => (Some(until), r, w, n),
                Err(e) => {
                    tracing::warn!(peer = ?s.tcp().peer_addr().ok(), "bulk connection refused: {e}");
                    let code = match e {
                        GrantError::WrongMethod { .. } => Code::PermissionDenied,
                        _ => Code::Unauthenticated,
                    };
                    return hello(&mut s, code, &e.to_string());
                }
            }
        } else {
            (None, true, true, None)
        };
        hello(&mut s, Code::Ok, "")?;
        s.set_read_timeout(IDLE_CLOSE)?;
        loop {
            let mut op = [0u8; 1];
            match s.read(&mut op)? {
                0 => return Ok(()),
                _ if ![bulk::OP_READ, bulk::OP_RANGE, bulk::OP_WRITE].contains(&op[0]) => {
                    s.write_all(&bulk::encode_error(
                        Code::Invalid,
                        &format!("unknown operation {}", op[0]),
                    ))?;
                    s.close_gently();
                    return Ok(());
                }
                _ => {}
            }
            let mut body = [0u8; bulk::RANGE_BODY];
            let body = match op[0] {
                bulk::OP_READ => &mut body[..bulk::REQUEST_BODY],
                bulk::OP_WRITE => &mut body[..bulk::WRITE_BODY],
                _ => &mut body[..],
            };
            s.set_read_timeout(self.idle)?;
            s.read_exact(body)?;
            s.set_read_timeout(IDLE_CLOSE)?;
            if until.is_some_and(|u| u <= locus_proto::grant::now_ms()) {
                s.write_all(&bulk::encode_error(
                    Code::Unauthenticated,
                    "the grant has expired; present a fresh one",
                ))?;
                s.close_gently();
                return Ok(());
            }
            let allowed = if op[0] == bulk::OP_WRITE { writes } else { reads };
            if !allowed {
                let what = if writes {
                    "reads (a read grant)"
                } else {
                    "writes (an import grant)"
                };
                s.write_all(&bulk::encode_error(
                    Code::PermissionDenied,
                    &format!("the grant presented does not allow {what}"),
                ))?;
                s.close_gently();
                return Ok(());
            }
            if op[0] == bulk::OP_WRITE {
                let (h, size, chunk_size, pin) =
                    bulk::decode_write((&*body).try_into().expect("sized by op"));
                s.set_read_timeout(self.idle)?;
                self.write(&mut s, h, size, chunk_size, pin)?;
                s.set_read_timeout(IDLE_CLOSE)?;
                continue;
            }
            if op[0] == bulk::OP_RANGE {
                let r = bulk::RangeRequest::decode((&*body).try_into().expect("sized by op"));
                if self.opens(&mut s, narrowed.as_ref(), &r.hash)? {
                    self.range(&mut s, &r)?;
                }
                continue;
            }
            let (h, offset, len) = bulk::decode_read((&*body).try_into().expect("sized by op"));
            if self.opens(&mut s, narrowed.as_ref(), &h)? {
                self.read(&mut s, h, offset, len)?;
            }
        }
    }

    /// Whether a read grant narrowed to versions opens blob `h` (`Peers::grant_opens`);
    /// when not, the client is told the node does not have it, as for any absent blob.
    fn opens(
        &self,
        s: &mut Conn,
        narrowed: Option<&locus_proto::grant::GrantBody>,
        h: &BlobHash,
    ) -> std::io::Result<bool> {
        let Some(g) = narrowed else { return Ok(true) };
        let Some(rt) = &self.runtime else {
            s.write_all(&bulk::encode_error(
                Code::Busy,
                "this node cannot check a read grant narrowed to versions here; use gRPC",
            ))?;
            return Ok(false);
        };
        match rt.block_on(self.peers.grant_opens(g, h)) {
            Ok(()) => Ok(true),
            Err(st) if st.code() == tonic::Code::NotFound => {
                refuse(s, h, StoreError::NotFound(*h))?;
                Ok(false)
            }
            Err(st) => {
                // The metadata service did not answer: gRPC asks it again, on its own time.
                s.write_all(&bulk::encode_error(Code::Busy, st.message()))?;
                Ok(false)
            }
        }
    }

    /// Answers one RANGE: the proof from the chunk's outboard, then the bytes, which are
    /// checked against it first (a node never sends bytes of a range it knows are
    /// wrong; the client checks them again, since nothing a node sends is trusted).
    fn range(&self, s: &mut Conn, r: &bulk::RangeRequest) -> std::io::Result<()> {
        let Some(size) = self.store.size_of(&r.hash) else {
            return refuse(s, &r.hash, StoreError::NotFound(r.hash));
        };
        if let Some(why) = r.invalid(size) {
            return s.write_all(&bulk::encode_error(Code::Invalid, &why));
        }
        let (at, n) = (r.chunk_offset + r.start, r.end - r.start);
        // A range of the whole blob, whose outboard the store keeps: the proof is a few
        // pages of that file, and the bytes are checked against the blob's own name.
        let whole = r.chunk_offset == 0 && r.chunk_len == size;
        if let Some(proof) = whole
            .then(|| self.store.kept_proof(&r.hash, r.start, r.end))
            .flatten()
        {
            let data = match self
                .store
                .open_reader(&r.hash, at, n)
                .and_then(|mut rd| rd.unchecked_rest())
            {
                Ok(d) => d,
                Err(e) => return refuse(s, &r.hash, e),
            };
            if outboard::verify(&r.hash, size, r.start, r.end, &data, &proof).is_ok() {
                self.metrics.outboards_kept_used.inc();
                return self.send_range(s, &proof, &data);
            }
            // The kept outboard or the bytes are wrong: which one, the blob's verified
            // bytes say below (the outboard computed from them); never blame the blob
            // for a damaged outboard.
            tracing::warn!(blob = %r.hash, "a range did not match the kept outboard; computing it again");
            self.store.drop_outboard(&r.hash);
            self.outboards.forget(r);
        }
        if let Some(why) = r.too_dear_to_compute() {
            return s.write_all(&bulk::encode_error(Code::Invalid, &why));
        }
        let ob = match self.outboards.of(&self.store, r) {
            Ok((o, computed)) => {
                if computed {
                    self.metrics.outboards_computed.inc();
                }
                o
            }
            Err(e) => return refuse(s, &r.hash, e),
        };
        let Some(proof) = outboard::proof(&ob.pairs, r.chunk_len, r.start, r.end) else {
            return refuse(s, &r.hash, StoreError::Io("an outboard of the wrong size".into()));
        };
        let data = match self.store.open_reader(&r.hash, at, n).and_then(|mut rd| {
            let data = rd.unchecked_rest()?;
            match outboard::verify(&ob.root, r.chunk_len, r.start, r.end, &data, &proof) {
                Ok(()) => Ok(data),
                Err(e) => Err(rd.reject(format!("bytes {at}..{} do not match the tree: {e}", at + n))),
            }
        }) {
            Ok(d) => d,
            Err(e) => return refuse(s, &r.hash, e),
        };
        self.send_range(s, &proof, &data)
    }

    fn send_range(&self, s: &mut Conn, proof: &[u8], data: &[u8]) -> std::io::Result<()> {
        let n = data.len() as u64;
        let total = 4 + proof.len() as u64 + n;
        self.metrics.read_bytes.inc_by(n);
        self.metrics.bulk_bytes.inc_by(total);
        s.head(total)?;
        s.write_all(&(proof.len() as u32).to_le_bytes())?;
        s.write_all(proof)?;
        s.write_all(data)?;
        s.flush()
    }

    /// Answers one read. An error that leaves the connection in an unknown state (the
    /// answer's head was sent and its bytes were not) is returned and closes it.
    fn read(&self, s: &mut Conn, h: BlobHash, offset: u64, len: u64) -> std::io::Result<()> {
        let refuse = |s: &mut Conn, e: StoreError| refuse(s, &h, e);
        let Some(size) = self.store.size_of(&h) else {
            return refuse(s, StoreError::NotFound(h));
        };
        if offset > size {
            return s.write_all(&bulk::encode_error(
                Code::Invalid,
                &format!("offset {offset} is past the blob's end ({size} bytes)"),
            ));
        }
        let mut r = match self.store.open_reader(&h, offset, len) {
            Ok(r) => r,
            Err(e) => return refuse(s, e),
        };
        let n = r.remaining();
        self.metrics.read_bytes.inc_by(n);
        self.metrics.bulk_bytes.inc_by(n);
        if let Some((file, at)) = r.trusted_span() {
            // Each request opens the file afresh, so its read-ahead would start small:
            // say the file is read sequentially (a wider window at once). Not WILLNEED:
            // that allocates the range's page cache a page at a time, synchronously,
            // where read-ahead takes large folios (measured: the node's CPU per MiB
            // 0.44–0.49 with SEQUENTIAL, 0.51–0.56 with no advice, 0.64–0.75 with
            // WILLNEED; data_plane, reads only).
            advise_sequential(file, at, n);
            s.head(n)?;
            s.send_file(file, at, n)?;
            if let Err(e) = r.finish_span() {
                // The bytes sent may not be the blob's: the receiver's check throws them
                // away; the connection ends so nothing after them is trusted either.
                return Err(std::io::Error::other(e.to_string()));
            }
            return Ok(());
        }
        // Hashed on the way out: the first piece before the answer's head, so a range
        // that fails in its first chunk (every one-chunk read) gets a clean DATA_LOSS.
        let first = match r.next_piece() {
            Ok(p) => p,
            Err(e) => return refuse(s, e),
        };
        s.head(n)?;
        let mut piece = first;
        while let Some(p) = piece {
            s.write_all(&p)?;
            piece = r.next_piece().map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        s.flush()
    }
}

/// Answers a request with the store's reason for not serving it.
fn refuse(s: &mut Conn, h: &BlobHash, e: StoreError) -> std::io::Result<()> {
    let code = match &e {
        StoreError::NotFound(_) => Code::NotFound,
        StoreError::NotPresent { .. } => Code::NotPresent,
        StoreError::Corrupt { .. } => Code::DataLoss,
        StoreError::Mismatch { .. } => Code::Invalid,
        StoreError::Full { .. } => Code::Full,
        _ => {
            tracing::error!("bulk read of {h}: {e}");
            Code::Internal
        }
    };
    s.write_all(&bulk::encode_error(code, &e.to_string()))?;
    s.flush()
}

fn hello(s: &mut Conn, code: Code, msg: &str) -> std::io::Result<()> {
    let mut out = bulk::MAGIC.to_vec();
    if code == Code::Ok {
        out.push(Code::Ok as u8);
        s.write_all(&out)?;
        return s.flush();
    }
    out.extend_from_slice(&bulk::encode_error(code, msg));
    s.write_all(&out)?;
    s.close_gently();
    Ok(())
}

/// Tells the kernel `[at, at+n)` of `file` is about to be read front to back.
fn advise_sequential(file: &std::fs::File, at: u64, n: u64) {
    if n < (256 << 10) {
        return;
    }
    // Advice only: a kernel that ignores it reads as it would have anyway.
    let _ = nix::fcntl::posix_fadvise(
        file,
        at as libc::off_t,
        n as libc::off_t,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
    );
}

/// The node's TCP connections, sorted: the bulk path's to `bulk`, the rest handed on for
/// gRPC. A connection that sends nothing is handed on after a few seconds (gRPC's own
/// timeouts then apply).
pub(crate) fn incoming(
    listener: tokio::net::TcpListener,
    bulk: Option<Arc<BulkServer>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::net::TcpStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|s| *s) => break,
            };
            let s = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors and the like: a moment, then on.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = s.set_nodelay(true);
            let Some(b) = bulk.clone() else {
                if tx.send(Ok(s)).await.is_err() {
                    break;
                }
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                if opens_with(&s, b.magic()).await {
                    b.serve(s);
                } else {
                    let _ = tx.send(Ok(s)).await;
                }
            });
        }
        if let Some(b) = bulk {
            b.stop();
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Whether a connection opens with `magic` (looked at, not taken).
async fn opens_with(s: &tokio::net::TcpStream, magic: &[u8; 8]) -> bool {
    let mut buf = [0u8; 8];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let n = match tokio::time::timeout_at(deadline, s.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            _ => return false,
        };
        if n == 0 || buf[..n] != magic[..n] {
            return false;
        }
        if n == buf.len() {
            return true;
        }
        // Part of the magic so far; peek returns at once while those bytes wait.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
