//! One bulk connection as the node's thread sees it: plain TCP, where blob files go to
//! the socket by `sendfile`, or TLS (rustls over the same blocking socket), where they
//! are read into a buffer and encrypted, since this kernel has no TLS of its own (no
//! kTLS: `setsockopt(TCP_ULP, "tls")` answers ENOENT). With kTLS the TLS arm would hand
//! the session's keys to the socket after the handshake and keep `sendfile`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::tls::rustls;

pub(super) enum Conn {
    Plain(TcpStream),
    Tls(Box<Tls>),
}

pub(super) struct Tls {
    stream: rustls::StreamOwned<rustls::ServerConnection, TcpStream>,
    /// Blob bytes on their way to the cipher, kept for the connection's next answer (a
    /// fresh megabyte per answer cost a memset of it: 5% of a TLS node's CPU).
    buf: Vec<u8>,
}

/// Bytes of a blob file read per TLS write: whole TLS records (16 KiB) and few system
/// calls.
const TLS_PIECE: usize = 1 << 20;

impl Conn {
    /// A TLS connection over `s`, whose client has sent `MAGIC_TLS` (already taken); the
    /// handshake runs on the first read, within the socket's timeouts.
    pub(super) fn tls(s: TcpStream, cfg: &Arc<rustls::ServerConfig>) -> std::io::Result<Conn> {
        let mut c = rustls::ServerConnection::new(cfg.clone()).map_err(std::io::Error::other)?;
        // Room for a whole piece of records between writes to the socket.
        c.set_buffer_limit(Some(TLS_PIECE + (64 << 10)));
        Ok(Conn::Tls(Box::new(Tls {
            stream: rustls::StreamOwned::new(c, s),
            buf: Vec::new(),
        })))
    }

    pub(super) fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::Tls(t) => &t.stream.sock,
        }
    }

    pub(super) fn set_read_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.tcp().set_read_timeout(Some(d))
    }

    /// An OK answer's head, followed by `n` bytes from this end. Plain: sent with
    /// MSG_MORE so it leaves in one segment with the first of them.
    pub(super) fn head(&mut self, n: u64) -> std::io::Result<()> {
        self.ok(n, n > 0)
    }

    /// An OK answer carrying `n` with nothing after it from this end (WRITE's "send
    /// them" and its verdict): never held back for more.
    pub(super) fn answer(&mut self, n: u64) -> std::io::Result<()> {
        self.ok(n, false)?;
        self.flush()
    }

    fn ok(&mut self, n: u64, more: bool) -> std::io::Result<()> {
        let mut b = [0u8; 9];
        b[1..].copy_from_slice(&n.to_le_bytes());
        let s = match self {
            Conn::Plain(s) => s,
            Conn::Tls(_) => return self.write_all(&b),
        };
        use nix::sys::socket::{send, MsgFlags};
        // nix names no MSG_MORE; the bit is the kernel's. Held back (up to 200 ms) until
        // the bytes that follow are sent: only when some do.
        let flags = if more {
            MsgFlags::from_bits_retain(libc::MSG_MORE)
        } else {
            MsgFlags::empty()
        };
        let mut at = 0;
        while at < b.len() {
            match send(s.as_raw_fd(), &b[at..], flags) {
                Ok(k) => at += k,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// `n` bytes of `file` from `at`: by the kernel on plain TCP, through a buffer and
    /// the cipher on TLS. The socket's send timeout bounds every wait for a slow reader.
    pub(super) fn send_file(&mut self, file: &std::fs::File, at: u64, n: u64) -> std::io::Result<()> {
        match self {
            Conn::Plain(s) => sendfile(s, file, at, n),
            Conn::Tls(t) => {
                use std::os::unix::fs::FileExt;
                let piece = TLS_PIECE.min(n as usize);
                if t.buf.len() < piece {
                    t.buf.resize(piece, 0);
                }
                let (mut off, end) = (at, at + n);
                while off < end {
                    let want = ((end - off) as usize).min(piece);
                    let got = file.read_at(&mut t.buf[..want], off)?;
                    if got == 0 {
                        return Err(short());
                    }
                    t.stream.write_all(&t.buf[..got])?;
                    off += got as u64;
                }
                t.stream.flush()
            }
        }
    }

    /// Ends a connection after a refusal so the client reads the answer: closing a
    /// socket with unread bytes in it sends a reset, which can destroy the answer before
    /// the client reads it. What the client sent is read and dropped for at most a
    /// second.
    pub(super) fn close_gently(&mut self) {
        if let Conn::Tls(t) = self {
            t.stream.conn.send_close_notify();
            let _ = t.stream.flush();
        }
        let s = self.tcp();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut sink = [0u8; 4096];
        let mut left = 1 << 20;
        let mut s = s;
        while left > 0 {
            match s.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n.min(left),
            }
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            Conn::Tls(t) => t.stream.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Plain(s) => s.write(buf),
            Conn::Tls(t) => t.stream.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Plain(s) => s.flush(),
            Conn::Tls(t) => t.stream.flush(),
        }
    }
}

fn short() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "the blob file is shorter than its record",
    )
}

/// `n` bytes of `file` from `at` to the socket, by the kernel.
fn sendfile(s: &TcpStream, file: &std::fs::File, at: u64, n: u64) -> std::io::Result<()> {
    let mut off = at as libc::off_t;
    let end = at + n;
    while (off as u64) < end {
        let count = ((end - off as u64).min(1 << 30)) as usize;
        match nix::sys::sendfile::sendfile(s, file, Some(&mut off), count) {
            Ok(0) => return Err(short()),
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the reader took nothing within the idle timeout",
                ))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
