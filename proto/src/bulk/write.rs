//! WRITE, the client's end: an import hands a node a blob from a local file, or bytes it
//! holds (an object it read from a store), over the bulk path instead of a WriteBlob
//! stream (see the node's `bulk/write.rs` for the exchange). On plain TCP a file goes to
//! the socket by `sendfile` (the import has just hashed it, so it is in the page cache
//! and no byte passes through this process), bytes by `write`; inside TLS both are
//! encrypted from a buffer.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stream::Stream;
use super::{encode_write, error_of, read_message, within, BulkError, Code, Pool};
use crate::BlobHash;

/// Bytes read from the file per write inside TLS.
const TLS_PIECE: usize = 1 << 20;

/// Where a WRITE's bytes come from.
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    /// A file, read from its start.
    File(&'a std::fs::File),
    /// Bytes in memory.
    Bytes(&'a bytes::Bytes),
}

/// What a WRITE is for: the blob, its chunking, and whether the node pins it.
#[derive(Debug, Clone, Copy)]
pub struct WriteRequest {
    pub hash: BlobHash,
    pub size: u64,
    pub chunk_size: u32,
    pub pin: bool,
}

impl Pool {
    /// Has the node at `addr` store blob `w.hash` from `body`, presenting `grant` (an
    /// import grant). True once the node has verified, stored and
    /// synced it; false if it had it already (it sent nothing). `sent` is told of bytes
    /// as they go out. A node silent for `idle` at any step is given up on. A node that
    /// does not serve WRITE (an older build) answers `Unsupported`: use WriteBlob.
    pub async fn write(
        self: &Arc<Self>,
        addr: &str,
        grant: Option<&str>,
        w: WriteRequest,
        body: Body<'_>,
        idle: Duration,
        sent: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<bool, BulkError> {
        if self.no_writes.lacks(addr) {
            return Err(BulkError::Unsupported(format!("{addr} takes no bulk writes")));
        }
        let req = encode_write(&w.hash, w.size, w.chunk_size, w.pin);
        let mut r = match self.request(addr, grant, &req, w.size, idle).await {
            Ok(r) => r,
            Err(BulkError::Refused(m)) if m.contains("unknown operation") => {
                self.no_writes.remember(addr);
                return Err(BulkError::Unsupported(m));
            }
            Err(e) => return Err(e),
        };
        if r.len == 0 {
            r.done();
            return Ok(false);
        }
        if r.len != w.size {
            return Err(BulkError::Unreachable(format!(
                "{addr} asked for {} bytes of a {}-byte blob",
                r.len, w.size
            )));
        }
        let mut s = r.stream.take().expect("a fresh answer has its connection");
        let slot = r.slot.take();
        let sending = match body {
            Body::File(file) => send(&mut s, file, w.size, idle, sent).await,
            Body::Bytes(b) => send_bytes(&mut s, b, w.size, idle, sent).await,
        };
        // The verdict, also after a failed send: a node that stopped taking bytes says
        // why (no room, a failed disk) before it closes.
        let verdict = verdict(&mut s, idle).await;
        let out = match (sending, verdict) {
            (_, Ok(())) => Ok(true),
            (Err(e), Err(BulkError::Unreachable(_))) => Err(e),
            (_, Err(e)) => Err(e),
        };
        match &out {
            Ok(_) => self.give_back(addr, grant.map(str::to_string), s),
            Err(BulkError::Unreachable(_)) => self.failed(addr),
            Err(_) => {}
        }
        drop(slot);
        out
    }
}

/// The node's answer once it has all the bytes: OK with nothing after it, or an error.
async fn verdict(s: &mut Stream, idle: Duration) -> Result<(), BulkError> {
    let mut code = [0u8; 1];
    // Verifying and syncing a large blob takes the node a while after the last byte.
    let wait = idle.max(Duration::from_secs(30));
    within(wait, s.read_exact(&mut code)).await?;
    match Code::from_u8(code[0]) {
        Some(Code::Ok) => {
            let mut n = [0u8; 8];
            within(idle, s.read_exact(&mut n)).await?;
            match u64::from_le_bytes(n) {
                0 => Ok(()),
                n => Err(BulkError::Unreachable(format!(
                    "the node's verdict announced {n} bytes"
                ))),
            }
        }
        Some(c) => Err(error_of(c, read_message(s, idle).await?)),
        None => Err(BulkError::Unreachable(format!("unknown answer {}", code[0]))),
    }
}

/// `n` bytes of `file` from its start to the node.
async fn send(
    s: &mut Stream,
    file: &std::fs::File,
    n: u64,
    idle: Duration,
    sent: &(dyn Fn(u64) + Send + Sync),
) -> Result<(), BulkError> {
    let short = || BulkError::Refused("the file is shorter than the blob it was hashed as".into());
    match s {
        Stream::Plain(tcp) => {
            let mut off: i64 = 0;
            while (off as u64) < n {
                let count = ((n - off as u64).min(1 << 30)) as usize;
                within(idle, tcp.writable()).await?;
                match tcp.try_io(tokio::io::Interest::WRITABLE, || {
                    sendfile(tcp_fd(tcp), file, &mut off, count)
                }) {
                    Ok(0) => return Err(short()),
                    Ok(k) => sent(k as u64),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(BulkError::Unreachable(e.to_string())),
                }
            }
            Ok(())
        }
        Stream::Tls(t) => {
            // Read off the async threads (a cold page waits for the disk), from the start.
            use tokio::io::AsyncSeekExt;
            let reading = |e: std::io::Error| BulkError::Refused(format!("reading the file: {e}"));
            let mut f = tokio::fs::File::from_std(file.try_clone().map_err(reading)?);
            f.seek(std::io::SeekFrom::Start(0)).await.map_err(reading)?;
            let mut buf = vec![0u8; TLS_PIECE.min(n as usize)];
            let mut off = 0u64;
            while off < n {
                let want = ((n - off) as usize).min(buf.len());
                let got = f.read(&mut buf[..want]).await.map_err(reading)?;
                if got == 0 {
                    return Err(short());
                }
                within(idle, t.write_all(&buf[..got])).await?;
                off += got as u64;
                sent(got as u64);
            }
            within(idle, t.flush()).await
        }
    }
}

/// `n` bytes held in memory to the node, in pieces so progress is told as they go.
async fn send_bytes(
    s: &mut Stream,
    b: &bytes::Bytes,
    n: u64,
    idle: Duration,
    sent: &(dyn Fn(u64) + Send + Sync),
) -> Result<(), BulkError> {
    if b.len() as u64 != n {
        return Err(BulkError::Refused(format!(
            "{} bytes in hand for a blob of {n}",
            b.len()
        )));
    }
    for piece in b.chunks(TLS_PIECE) {
        match s {
            Stream::Plain(tcp) => within(idle, tcp.write_all(piece)).await?,
            Stream::Tls(t) => within(idle, t.write_all(piece)).await?,
        }
        sent(piece.len() as u64);
    }
    match s {
        Stream::Plain(_) => Ok(()),
        Stream::Tls(t) => within(idle, t.flush()).await,
    }
}

fn tcp_fd(s: &tokio::net::TcpStream) -> std::os::fd::RawFd {
    std::os::fd::AsRawFd::as_raw_fd(s)
}

/// One `sendfile(2)` from `file` at `*off` to the socket `out` (non-blocking: WouldBlock
/// when its buffer is full); advances `*off`.
#[allow(unsafe_code)]
fn sendfile(
    out: std::os::fd::RawFd,
    file: &std::fs::File,
    off: &mut i64,
    count: usize,
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut o: libc::off_t = *off;
    // SAFETY: both descriptors are open for the call (the socket is borrowed by the
    // caller, the file by reference); the kernel reads and writes only `o`, a local.
    let r = unsafe { libc::sendfile(out, file.as_raw_fd(), &mut o, count) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    *off = o;
    Ok(r as usize)
}
