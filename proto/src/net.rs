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
