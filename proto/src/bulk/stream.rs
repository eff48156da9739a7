//! The client's connection to a node's bulk port: plain TCP to a plaintext node
//! (`HOST:PORT`), TLS to a node that serves it (`https://HOST:PORT`).
//!
//! TLS is not in the kernel here (no kTLS on these kernels), so a TLS connection costs
//! the cipher on both ends and rustls' copy of each record; the receive side reads the
//! socket through a 256 KiB buffer, since rustls asks its socket for at most 4 KiB at a
//! time (as for gRPC to nodes, `client::buffered_tcp`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

use super::{BulkError, MAGIC_TLS};

/// One connection to a node's bulk port.
pub(super) enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<BufReader<TcpStream>>>),
}

/// Longest wait for a TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// The buffer under a TLS connection's reads.
const TLS_READ_BUFFER: usize = 256 << 10;

/// How to reach `addr`: its `HOST:PORT`, and whether with TLS.
pub(super) fn target(addr: &str) -> (&str, bool) {
    match addr.strip_prefix("https://") {
        Some(rest) => (rest.trim_end_matches('/'), true),
        None => (addr, false),
    }
}

/// Opens a TCP connection to `addr` within `wait`, and for an `https://` node, TLS over
/// it with `tls` (the CA and client certificate of this process). A TLS node of an older
/// build does not know [`MAGIC_TLS`] and fails the handshake: that is `Unsupported`
/// (read it over gRPC, whose error tells a real TLS fault).
pub(super) async fn open(
    addr: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
    wait: Duration,
) -> Result<Stream, BulkError> {
    let (hostport, secure) = target(addr);
    let s = tokio::time::timeout(wait, TcpStream::connect(hostport))
        .await
        .map_err(|_| BulkError::Unreachable(format!("{addr}: no connection within {wait:?}")))?
        .map_err(|e| BulkError::Unreachable(format!("{addr}: {e}")))?;
    let _ = s.set_nodelay(true);
    if !secure {
        return Ok(Stream::Plain(s));
    }
    let Some(cfg) = tls else {
        return Err(BulkError::Unsupported(format!("{addr}: no CA to check it with")));
    };
    let host = hostport
        .rsplit_once(':')
        .map_or(hostport, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| BulkError::Refused(format!("{addr}: not a server name: {e}")))?;
    let mut s = s;
    tokio::time::timeout(wait, s.write_all(&MAGIC_TLS))
        .await
        .map_err(|_| BulkError::Unreachable(format!("{addr}: nothing taken within {wait:?}")))?
        .map_err(|e| BulkError::Unreachable(format!("{addr}: {e}")))?;
    let connector = tokio_rustls::TlsConnector::from(cfg.clone());
    let handshake = connector.connect(name, BufReader::with_capacity(TLS_READ_BUFFER, s));
    match tokio::time::timeout(HANDSHAKE.max(wait), handshake).await {
        Ok(Ok(t)) => Ok(Stream::Tls(Box::new(t))),
        Ok(Err(e)) => Err(BulkError::Unsupported(format!("{addr}: TLS handshake: {e}"))),
        Err(_) => Err(BulkError::Unreachable(format!(
            "{addr}: no TLS handshake within {HANDSHAKE:?}"
        ))),
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Stream {
    /// Writes all of `b` and sends it: a TLS stream may hold the last record until
    /// flushed.
    pub(super) async fn send(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.write_all(b).await?;
        self.flush().await
    }
}
