//! Socket setup shared by every daemon.

use std::net::SocketAddr;

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
