//! Socket setup shared by every daemon.

use std::net::SocketAddr;

/// Raises this process's soft open-file limit to its hard limit (as far as it is
/// allowed). The usual soft limit of 1,024 is too few for a daemon: the metadata service
/// holds a connection per node (thousands), a node one per peer and reader, a mount a
/// descriptor per recently verified local file; a bench plays thousands of clients.
/// Returns whether the limit is now the hard one.
pub fn raise_open_file_limit() -> bool {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok(),
        Ok(_) => true,
        Err(_) => false,
    }
}

/// Binds a listening TCP socket with SO_REUSEADDR, so a restarted daemon gets its port
/// back while the previous process's connections sit in TIME_WAIT.
pub fn bind_tcp(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }?;
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(1024)
}

/// Runs a server future to completion, but gives up `grace` after `stop` turns true: a
/// clean shutdown lets in-flight calls finish, a stuck client cannot hold the process.
/// Returns None when the grace period ran out.
pub async fn serve_with_grace<T>(
    serve: impl std::future::Future<Output = T>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    grace: std::time::Duration,
) -> Option<T> {
    let deadline = async move {
        let _ = stop.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        r = serve => Some(r),
        _ = deadline => None,
    }
}

/// Bytes moved by a transfer, watched by [`until_idle`].
pub type Progress = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// How long a transfer with a peer (a node or an object store) may move no bytes before
/// clients give up on it: `LOCUS_PEER_TIMEOUT` (e.g. "30s"), else 60 s. A value that is
/// not a duration is refused by the CLI at start (`peer_idle_setting`); here it falls back
/// to the default with a warning.
pub fn peer_idle() -> std::time::Duration {
    peer_idle_setting().unwrap_or_else(|e| {
        tracing::warn!("{}; using 60s", e.reason);
        DEFAULT_PEER_IDLE
    })
}

const DEFAULT_PEER_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// `LOCUS_PEER_TIMEOUT` checked: unset is the default, anything else must be a non-zero
/// duration.
pub fn peer_idle_setting() -> Result<std::time::Duration, crate::InvalidInput> {
    let Ok(v) = std::env::var("LOCUS_PEER_TIMEOUT") else {
        return Ok(DEFAULT_PEER_IDLE);
    };
    match crate::human::parse_duration(&v) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err(crate::InvalidInput::new(
            "LOCUS_PEER_TIMEOUT",
            "must be longer than 0s",
        )),
        Err(e) => Err(crate::InvalidInput::new(
            "LOCUS_PEER_TIMEOUT",
            format!("{v:?} is not a duration such as 30s: {}", e.reason),
        )),
    }
}

/// Runs `fut` until it completes, or until `progress` has not moved for `idle`: a peer
/// that hangs (stopped, wedged, partitioned without resets) costs one idle timeout, while
/// a slow one that keeps moving bytes may take as long as it needs. Err(()) on idle.
pub async fn until_idle<T>(
    fut: impl std::future::Future<Output = T>,
    progress: &Progress,
    idle: std::time::Duration,
) -> Result<T, ()> {
    use std::sync::atomic::Ordering;
    let watch = async {
        let tick = (idle / 4).max(std::time::Duration::from_millis(50));
        let mut seen = progress.load(Ordering::Relaxed);
        let mut since = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(tick).await;
            let now = progress.load(Ordering::Relaxed);
            if now != seen {
                seen = now;
                since = tokio::time::Instant::now();
            } else if since.elapsed() >= idle {
                return;
            }
        }
    };
    tokio::select! {
        r = fut => Ok(r),
        _ = watch => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    #[tokio::test]
    async fn a_transfer_that_keeps_moving_is_not_cut_but_a_silent_one_is() {
        let p = Progress::default();
        let p2 = p.clone();
        let moving = async move {
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                p2.fetch_add(1, Ordering::Relaxed);
            }
            7
        };
        // Longer in all than the idle timeout, never idle for it.
        assert_eq!(until_idle(moving, &p, Duration::from_millis(500)).await, Ok(7));
        let silent = std::future::pending::<()>();
        assert_eq!(until_idle(silent, &p, Duration::from_millis(500)).await, Err(()));
    }
}

/// Bounds for a daemon's HTTP port, which schedulers reach without a token.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections served at once; more wait in the kernel's accept backlog, costing
    /// this process nothing.
    pub max_connections: usize,
    /// A client must send a request's headers within this (a client that trickles them,
    /// or opens a connection and says nothing, is cut off).
    pub header_timeout: std::time::Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 1024,
            header_timeout: std::time::Duration::from_secs(10),
        }
    }
}

/// Serves HTTP/1.1 and HTTP/2 (over TLS when `tls` is given) on `listener` within
/// `limits` until `stop` completes (connections in flight then finish on their own).
pub async fn serve_http<S, B>(
    listener: tokio::net::TcpListener,
    svc: S,
    limits: HttpLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stop: impl std::future::Future<Output = ()>,
) where
    S: tower::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut stop => return,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors, say: back off rather than spin.
                    tracing::warn!("HTTP accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => return,
        };
        let svc = svc.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = permit;
            let mut b = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            b.http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let svc = hyper_util::service::TowerToHyperService::new(svc);
            let served = match tls {
                Some(acceptor) => {
                    // The handshake gets the header deadline too: a client that opens a
                    // connection and never finishes its hello is cut off like one that
                    // never finishes its headers.
                    let stream =
                        match tokio::time::timeout(limits.header_timeout, acceptor.accept(stream)).await {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!("TLS handshake failed on the HTTP port: {e}");
                                return;
                            }
                            Err(_) => return,
                        };
                    let io = hyper_util::rt::TokioIo::new(stream);
                    b.serve_connection_with_upgrades(io, svc).await
                }
                None => {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    b.serve_connection_with_upgrades(io, svc).await
                }
            };
            if let Err(e) = served {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
}
