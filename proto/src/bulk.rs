//! The bulk path for blob bytes: a plain framed protocol beside gRPC, on the node's own
//! port, so the sender can hand a blob file to the socket with `sendfile` and the
//! receiver can read it straight into the buffer it verifies and keeps. gRPC stays the
//! control plane; this carries only "send me bytes [offset, offset+len) of blob H".
//!
//! Why not gRPC for the bytes: every 2 MiB went through a user-space read on the node,
//! protobuf framing, HTTP/2 framing and a copy out of the decoder on the receiver —
//! about twice the CPU per byte of a plain TCP copy (docs/architecture.md, "The bulk
//! path").
//!
//! The wire (integers little-endian):
//!
//! ```text
//! [to a TLS node: MAGIC_TLS(8) in clear, then a TLS handshake; all below inside TLS]
//! client hello   MAGIC(8) grant_len(u16) grant(grant_len)      grant: "" when none
//! server hello   MAGIC(8) code(u8) [msg_len(u16) msg]           msg only when code != OK
//! request        op(u8)=READ hash(32) offset(u64) len(u64)      len 0: to the blob's end
//!                op(u8)=RANGE hash(32) chunk_offset(u64) chunk_len(u64) start(u64) end(u64)
//! answer         code(u8) then OK: n(u64) and exactly n bytes; else msg_len(u16) msg
//!                RANGE's n bytes: proof_len(u32) proof data
//! ```
//!
//! RANGE asks for bytes `[start, end)` of one chunk (the chunk is `[chunk_offset,
//! chunk_offset + chunk_len)` of the blob; `start`/`end` are within it and whole
//! verification groups, see `outboard::rounded`) with the proof that checks them
//! against the chunk's hash (`outboard::verify`): a random reader moves the groups it
//! reads, not the whole chunk. A node that predates RANGE answers INVALID; the client
//! then reads whole chunks from it ([`Pool::range`]).
//!
//! Requests on one connection are served one after another; the client keeps
//! connections per node and reuses them. Nothing the node sends is trusted: the caller
//! verifies every byte against the manifest's hashes, as for gRPC. A node that does not
//! speak this (an older build) answers the hello with something other than MAGIC, and
//! the client goes back to gRPC for that node ([`BulkError::Unsupported`]).
//!
//! The transport sits behind this module's small surface (`Pool::open` and a `Reading`
//! that yields verified-later buffers), which is the seam an RDMA implementation would
//! fill (docs/architecture.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncReadExt;

use crate::BlobHash;

mod buffers;
mod stream;
mod wire;
mod write;

use buffers::{buffers, Pooled};
use stream::Stream;
pub use wire::*;
pub use write::{Body, WriteRequest};

/// Why a bulk read gave no bytes, sorted by whose fault it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BulkError {
    /// The node does not serve the bulk path (an older build, a TLS node this process
    /// has no CA for, or it is busy): ask it over gRPC.
    #[error("the node does not serve the bulk path: {0}")]
    Unsupported(String),
    /// Not reachable, silent, or it broke the protocol.
    #[error("{0}")]
    Unreachable(String),
    /// It does not hold the blob, or not that range.
    #[error("does not hold it: {0}")]
    Missing(String),
    /// It refused the grant presented (or there was none).
    #[error("grant: {0}")]
    Grant(String),
    /// Its copy is corrupt (it quarantined it).
    #[error("its copy is corrupt: {0}")]
    DataLoss(String),
    /// It has no room for the blob (WRITE).
    #[error("no room: {0}")]
    Full(String),
    /// It refused the request (malformed, internal error).
    #[error("{0}")]
    Refused(String),
}

/// Longest wait for a connection to open (as for gRPC node connections).
const CONNECT: Duration = Duration::from_secs(3);
/// How long an address that did not speak the bulk path is asked over gRPC only.
const UNSUPPORTED_FOR: Duration = Duration::from_secs(600);
/// Idle connections kept per node.
const KEEP_PER_NODE: usize = 8;
/// Requests in flight to one node at once, from one client. Eight 4 MiB requests keep a
/// 100 Gbit/s link with a millisecond of delay full; more would only cost the node
/// threads.
const IN_USE_PER_NODE: usize = 8;
/// An idle connection older than this is closed rather than reused (the node closes
/// its end after two minutes without a request).
const KEEP_IDLE: Duration = Duration::from_secs(60);

struct Idle {
    grant: Option<String>,
    stream: Stream,
    since: Instant,
}

/// Bulk connections to nodes, kept and reused: what every reader of remote blob bytes
/// holds one of.
#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<String, Vec<Idle>>>,
    /// Addresses that did not speak the bulk path, and until when they are not asked.
    unsupported: Mutex<HashMap<String, Instant>>,
    /// Room for connections in use, per node: a client never has more than
    /// `IN_USE_PER_NODE` requests on one node at once (each costs the node a thread),
    /// the rest wait their turn.
    slots: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// When a request to each node last failed on the connection (not a refusal): a
    /// request that waited for room finds out at once that its node went bad meanwhile,
    /// instead of queueing behind timeouts (a pulled cable costs one timeout, not one
    /// per request in the queue).
    failed: Mutex<HashMap<String, Instant>>,
    /// Addresses that answered RANGE as an unknown operation.
    no_ranges: Lacking,
    /// Addresses that answered WRITE as an unknown operation.
    no_writes: Lacking,
    /// `LOCUS_BULK=off` in the environment: every node is asked over gRPC (to compare
    /// the two paths, or to go around a fault in this one).
    off: bool,
    /// The client side of TLS to `https://` nodes, made from the process's client TLS
    /// on first use (None: no CA, so TLS nodes are asked over gRPC).
    tls: std::sync::OnceLock<Option<Arc<tokio_rustls::rustls::ClientConfig>>>,
}

/// Nodes that answered an operation as unknown (an older build), each remembered for
/// `UNSUPPORTED_FOR` so the next request goes the old way at once.
#[derive(Default)]
struct Lacking(Mutex<HashMap<String, Instant>>);

impl Lacking {
    fn lacks(&self, addr: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .get(addr)
            .is_some_and(|until| *until > Instant::now())
    }

    fn remember(&self, addr: &str) {
        self.0
            .lock()
            .unwrap()
            .insert(addr.to_string(), Instant::now() + UNSUPPORTED_FOR);
    }
}

/// The environment variable that turns the bulk path off in a client (`off`).
pub const ENV_SWITCH: &str = "LOCUS_BULK";

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("bulk::Pool").finish_non_exhaustive()
    }
}

impl Pool {
    pub fn new() -> Arc<Pool> {
        Arc::new(Pool {
            off: std::env::var(ENV_SWITCH).is_ok_and(|v| v == "off"),
            ..Pool::default()
        })
    }

    /// Whether to try the bulk path with the node at `addr`: a plaintext address
    /// (`HOST:PORT`), or a TLS one (`https://HOST:PORT`) when this process has a CA to
    /// check it with, not known to lack it.
    pub fn speaks(&self, addr: &str) -> bool {
        if self.off {
            return false;
        }
        match addr.split_once("://") {
            None => {}
            Some(("https", _)) if self.tls().is_some() => {}
            Some(_) => return false,
        }
        let mut u = self.unsupported.lock().unwrap();
        match u.get(addr) {
            Some(until) if *until > Instant::now() => false,
            Some(_) => {
                u.remove(addr);
                true
            }
            None => true,
        }
    }

    /// Drops every idle connection to `addr` (it failed), and fails the requests
    /// waiting for room on it.
    pub fn forget(&self, addr: &str) {
        self.idle.lock().unwrap().remove(addr);
        self.failed(addr);
    }

    /// The client TLS config for `https://` nodes (see `tls`).
    fn tls(&self) -> Option<&Arc<tokio_rustls::rustls::ClientConfig>> {
        self.tls
            .get_or_init(|| {
                crate::tls::bulk_client_config().unwrap_or_else(|e| {
                    tracing::warn!("TLS nodes are read over gRPC: the client TLS settings: {e}");
                    None
                })
            })
            .as_ref()
    }

    fn failed(&self, addr: &str) {
        self.failed
            .lock()
            .unwrap()
            .insert(addr.to_string(), Instant::now());
    }

    fn take(&self, addr: &str, grant: Option<&str>) -> Option<Stream> {
        let mut idle = self.idle.lock().unwrap();
        let list = idle.get_mut(addr)?;
        while let Some(c) = list.pop() {
            if c.grant.as_deref() == grant && c.since.elapsed() < KEEP_IDLE {
                return Some(c.stream);
            }
        }
        None
    }

    fn give_back(&self, addr: &str, grant: Option<String>, stream: Stream) {
        let mut idle = self.idle.lock().unwrap();
        let list = idle.entry(addr.to_string()).or_default();
        if list.len() < KEEP_PER_NODE {
            list.push(Idle {
                grant,
                stream,
                since: Instant::now(),
            });
        }
    }

    /// Asks the node at `addr` for bytes `[offset, offset+len)` of blob `h` (`len` 0: to
    /// its end), presenting `grant`. A node silent for `idle` at any step is given up
    /// on. The answer's bytes are read with [`Reading::next`] or [`Reading::all`].
    pub async fn open(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        h: &BlobHash,
        offset: u64,
        len: u64,
        idle: Duration,
    ) -> Result<Reading, BulkError> {
        self.request(addr, grant, &encode_read(h, offset, len), len, idle)
            .await
    }

    /// Asks the node at `addr` for a verified range (see [`RangeRequest`]); the answer is
    /// not checked here. A node that does not serve ranges (an older build) is
    /// remembered, and its answer is `Unsupported`: read the whole chunk from it.
    pub async fn range(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        r: &RangeRequest,
        idle: Duration,
    ) -> Result<Ranged, BulkError> {
        if self.no_ranges.lacks(addr) {
            return Err(BulkError::Unsupported(format!("{addr} serves no ranges")));
        }
        let answer = match self.request(addr, grant, &r.encode(), r.answer_max(), idle).await {
            Ok(reading) => reading.all().await?,
            Err(BulkError::Refused(m)) if m.contains("unknown operation") => {
                self.no_ranges.remember(addr);
                return Err(BulkError::Unsupported(m));
            }
            Err(e) => return Err(e),
        };
        let bad = || BulkError::Unreachable("the node's range answer is malformed".into());
        let n = u32::from_le_bytes(answer.get(..4).ok_or_else(bad)?.try_into().unwrap()) as usize;
        if answer.len() < 4 + n {
            return Err(bad());
        }
        Ok(Ranged {
            proof: answer.slice(4..4 + n),
            data: answer.slice(4 + n..),
        })
    }

    /// Sends one request (`req`, encoded) to `addr`; at most `most` bytes may answer it
    /// (0: any).
    async fn request(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        req: &[u8],
        most: u64,
        idle: Duration,
    ) -> Result<Reading, BulkError> {
        let slots = self
            .slots
            .lock()
            .unwrap()
            .entry(addr.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(IN_USE_PER_NODE)))
            .clone();
        let asked = Instant::now();
        let slot = slots.acquire_owned().await.expect("never closed");
        if let Some(at) = self.failed.lock().unwrap().get(addr) {
            if *at >= asked {
                return Err(BulkError::Unreachable(format!(
                    "{addr} failed while this request waited its turn"
                )));
            }
        }
        let r = self.ask_on(addr, grant, req, most, idle, slot).await;
        if matches!(r, Err(BulkError::Unreachable(_))) {
            self.failed(addr);
        }
        r
    }

    async fn ask_on(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        req: &[u8],
        len: u64,
        idle: Duration,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<Reading, BulkError> {
        // A kept connection the node has closed since fails at once; one fresh try.
        if let Some(mut s) = self.take(addr, grant) {
            match ask(&mut s, req, idle).await {
                Ok(Some(n)) => return self.reading(addr, grant, s, n, len, idle, slot),
                Err(e) if !matches!(e, BulkError::Unreachable(_)) => {
                    if keeps_connection(&e) {
                        self.give_back(addr, grant.map(str::to_string), s);
                    }
                    return Err(e);
                }
                _ => {}
            }
        }
        let mut s = connect(addr, self.tls(), grant, idle).await.inspect_err(|e| {
            if matches!(e, BulkError::Unsupported(_)) {
                self.unsupported
                    .lock()
                    .unwrap()
                    .insert(addr.to_string(), Instant::now() + UNSUPPORTED_FOR);
            }
        })?;
        match ask(&mut s, req, idle).await {
            Ok(Some(n)) => self.reading(addr, grant, s, n, len, idle, slot),
            Ok(None) => Err(BulkError::Unreachable("the node closed the connection".into())),
            Err(e) => {
                if keeps_connection(&e) {
                    self.give_back(addr, grant.map(str::to_string), s);
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reading(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        stream: Stream,
        n: u64,
        asked: u64,
        idle: Duration,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<Reading, BulkError> {
        if asked != 0 && n > asked {
            return Err(BulkError::Unreachable(format!(
                "the node offered {n} bytes, {asked} were asked for"
            )));
        }
        Ok(Reading {
            pool: self.clone(),
            addr: addr.to_string(),
            grant: grant.map(str::to_string),
            stream: Some(stream),
            left: n,
            len: n,
            idle,
            slot: Some(slot),
        })
    }
}

/// Whether the node goes on serving a connection after answering with this error: it
/// does after "not here" and "corrupt"; after a refused grant or a request it does not
/// understand it closes its end.
fn keeps_connection(e: &BulkError) -> bool {
    matches!(e, BulkError::Missing(_) | BulkError::DataLoss(_))
}

/// Opens a connection and says hello.
async fn connect(
    addr: &str,
    tls: Option<&Arc<tokio_rustls::rustls::ClientConfig>>,
    grant: Option<&str>,
    idle: Duration,
) -> Result<Stream, BulkError> {
    let g = grant.unwrap_or("").as_bytes();
    if g.len() > MAX_GRANT {
        return Err(BulkError::Refused(format!(
            "a grant of {} bytes is too long",
            g.len()
        )));
    }
    let mut s = stream::open(addr, tls, idle.min(CONNECT)).await?;
    let mut hello = Vec::with_capacity(10 + g.len());
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&(g.len() as u16).to_le_bytes());
    hello.extend_from_slice(g);
    within(idle, s.send(&hello)).await?;
    let mut back = [0u8; 9];
    match within(idle, s.read_exact(&mut back)).await {
        Ok(_) => {}
        // An older node's gRPC server hangs up on a connection that is not HTTP/2.
        Err(BulkError::Unreachable(_)) => {
            return Err(BulkError::Unsupported(format!("{addr} closed the hello")))
        }
        Err(e) => return Err(e),
    }
    if back[..8] != MAGIC {
        return Err(BulkError::Unsupported(format!("{addr} answered something else")));
    }
    match Code::from_u8(back[8]) {
        Some(Code::Ok) => Ok(s),
        Some(Code::Busy) => Err(BulkError::Unsupported(format!("{addr} is busy"))),
        Some(c) => Err(error_of(c, read_message(&mut s, idle).await?)),
        None => Err(BulkError::Unreachable(format!(
            "{addr}: unknown answer {}",
            back[8]
        ))),
    }
}

/// Sends a request and reads the answer's head: Some(n) for n bytes to follow, None
/// when the connection was closed before any answer (a kept connection the node timed
/// out); an error answer as its error.
async fn ask(s: &mut Stream, req: &[u8], idle: Duration) -> Result<Option<u64>, BulkError> {
    if s.send(req).await.is_err() {
        return Ok(None);
    }
    let mut code = [0u8; 1];
    match within(idle, s.read_exact(&mut code)).await {
        Ok(_) => {}
        Err(BulkError::Unreachable(_)) => return Ok(None),
        Err(e) => return Err(e),
    }
    match Code::from_u8(code[0]) {
        Some(Code::Ok) => {
            let mut n = [0u8; 8];
            within(idle, s.read_exact(&mut n)).await?;
            Ok(Some(u64::from_le_bytes(n)))
        }
        Some(c) => Err(error_of(c, read_message(s, idle).await?)),
        None => Err(BulkError::Unreachable(format!("unknown answer {}", code[0]))),
    }
}

async fn read_message(s: &mut Stream, idle: Duration) -> Result<String, BulkError> {
    let mut n = [0u8; 2];
    within(idle, s.read_exact(&mut n)).await?;
    let mut m = vec![0u8; u16::from_le_bytes(n) as usize];
    within(idle, s.read_exact(&mut m)).await?;
    Ok(String::from_utf8_lossy(&m).into_owned())
}

fn error_of(c: Code, m: String) -> BulkError {
    match c {
        Code::NotFound | Code::NotPresent => BulkError::Missing(m),
        Code::Unauthenticated | Code::PermissionDenied => BulkError::Grant(m),
        Code::DataLoss => BulkError::DataLoss(m),
        Code::Busy => BulkError::Unsupported(m),
        Code::Full => BulkError::Full(m),
        Code::Invalid | Code::Internal | Code::Ok => BulkError::Refused(m),
    }
}

async fn within<T>(
    idle: Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, BulkError> {
    match tokio::time::timeout(idle, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(BulkError::Unreachable(e.to_string())),
        Err(_) => Err(BulkError::Unreachable(format!(
            "the node sent nothing for {idle:?}"
        ))),
    }
}

/// The bytes of one answer, as they arrive. Reading them all gives the connection back
/// to the pool; dropping it early closes the connection.
pub struct Reading {
    pool: Arc<Pool>,
    addr: String,
    grant: Option<String>,
    stream: Option<Stream>,
    left: u64,
    len: u64,
    idle: Duration,
    /// Its room among the requests in flight to this node, given back at the end.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Reading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("bulk::Reading")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("left", &self.left)
            .finish()
    }
}

impl Reading {
    /// Bytes the node said it sends.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The next `max` bytes (fewer only at the end), received straight into one buffer;
    /// None once all were read.
    pub async fn next(&mut self, max: usize) -> Result<Option<Bytes>, BulkError> {
        if self.left == 0 {
            self.done();
            return Ok(None);
        }
        let n = (max as u64).min(self.left) as usize;
        let mut buf = buffers().take(n);
        while buf.len() < n {
            let Some(s) = self.stream.as_mut() else {
                return Err(BulkError::Unreachable("the connection failed earlier".into()));
            };
            // Never past this piece: the buffer's capacity may be larger (a size class),
            // and what follows on the connection is the next piece of this answer.
            let want = n - buf.len();
            let got =
                tokio::time::timeout(self.idle, s.read_buf(&mut bytes::BufMut::limit(&mut buf, want))).await;
            self.took(got, buf.len() as u64)?;
        }
        self.left -= n as u64;
        if self.left == 0 {
            self.done();
        }
        Ok(Some(Bytes::from_owner(Pooled(buf))))
    }

    /// Receives the next bytes of the answer straight into `buf` (what one read of the
    /// socket gives, at most `buf.len()`, never past the answer's end): for a caller
    /// that keeps them in a buffer of its own, such as the store's aligned write buffer.
    /// 0 once all were read.
    pub async fn read_into(&mut self, buf: &mut [u8]) -> Result<usize, BulkError> {
        if self.left == 0 {
            self.done();
            return Ok(0);
        }
        let want = (buf.len() as u64).min(self.left) as usize;
        let Some(s) = self.stream.as_mut() else {
            return Err(BulkError::Unreachable("the connection failed earlier".into()));
        };
        let got = tokio::time::timeout(self.idle, s.read(&mut buf[..want])).await;
        let n = self.took(got, 0)?;
        self.left -= n as u64;
        if self.left == 0 {
            self.done();
        }
        Ok(n)
    }

    /// What one read of the socket gave: the bytes it moved, or the error that ends this
    /// answer and its connection (`had`: bytes of the current piece already received,
    /// for the message).
    fn took(
        &mut self,
        got: Result<std::io::Result<usize>, tokio::time::error::Elapsed>,
        had: u64,
    ) -> Result<usize, BulkError> {
        if !matches!(got, Ok(Ok(n)) if n > 0) {
            self.pool.failed(&self.addr);
            self.stream = None;
        }
        match got {
            Ok(Ok(0)) => Err(BulkError::Unreachable(format!(
                "the node stopped after {} of {} bytes",
                self.len - self.left + had,
                self.len
            ))),
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(BulkError::Unreachable(e.to_string())),
            Err(_) => Err(BulkError::Unreachable(format!(
                "the node sent nothing for {:?}",
                self.idle
            ))),
        }
    }

    /// Every byte of the answer in one buffer.
    pub async fn all(mut self) -> Result<Bytes, BulkError> {
        let n = usize::try_from(self.left).map_err(|_| BulkError::Refused("too long to hold".into()))?;
        Ok(self.next(n).await?.unwrap_or_default())
    }

    fn done(&mut self) {
        if let Some(s) = self.stream.take() {
            self.pool.give_back(&self.addr, self.grant.take(), s);
        }
        self.slot = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_decodes_to_what_was_encoded() {
        let h = BlobHash([7; 32]);
        let r = encode_read(&h, 1 << 40, 65536);
        assert_eq!(r[0], OP_READ);
        let body: [u8; REQUEST_BODY] = r[1..].try_into().unwrap();
        assert_eq!(decode_read(&body), (h, 1 << 40, 65536));
    }

    #[test]
    fn an_error_message_is_cut_to_fit_its_length() {
        let e = encode_error(Code::NotFound, &"x".repeat(5000));
        assert_eq!(e[0], Code::NotFound as u8);
        assert_eq!(u16::from_le_bytes([e[1], e[2]]) as usize, e.len() - 3);
        assert_eq!(e.len(), 3 + 1024);
    }

    #[test]
    fn tls_addresses_are_asked_over_the_bulk_path_only_with_a_ca_to_check_them() {
        let p = Pool::new();
        assert!(p.speaks("10.0.0.1:7070"));
        // This test process has no client TLS: no CA, so a TLS node is asked over gRPC.
        assert!(!p.speaks("https://10.0.0.1:7070"));
        let with_ca = Pool::new();
        let cfg = tokio_rustls::rustls::ClientConfig::builder_with_provider(Arc::new(crate::tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(tokio_rustls::rustls::RootCertStore::empty())
            .with_no_client_auth();
        with_ca.tls.set(Some(Arc::new(cfg))).unwrap();
        assert!(with_ca.speaks("https://10.0.0.1:7070"));
        assert!(
            !with_ca.speaks("http://10.0.0.1:7070"),
            "a scheme it does not know"
        );
        p.unsupported
            .lock()
            .unwrap()
            .insert("10.0.0.1:7070".into(), Instant::now() + Duration::from_secs(5));
        assert!(!p.speaks("10.0.0.1:7070"));
    }
}
