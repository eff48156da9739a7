//! The cluster test harness (shared by the end-to-end tests and the benches): starts real `locus` processes on loopback, each with its own
//! directory, log file and ports, waits for readiness by polling, offers fault injection
//! (kill -9, SIGSTOP/SIGCONT, SIGTERM), and cleans up everything it started. When a test
//! fails, the run directory with every daemon's log is kept and its path printed.
//!
//! One file per thing it starts: `daemon` (any `locus` process), `metadata`, `node`,
//! `cluster` (a service with nodes, and catalogue helpers), `objstore` (moto, SeaweedFS),
//! `mount`, `data` (datasets on disk), and `proxy` (a peer that lies). Everything is re-exported here.

mod cluster;
mod daemon;
mod data;
mod emulators;
mod measure;
mod metadata;
mod mount;
mod netbed;
mod node;
mod objstore;
mod proxy;
mod slow_disk;
mod slurm;

pub use cluster::*;
pub use daemon::*;
pub use data::*;
pub use emulators::*;
pub use measure::*;
pub use metadata::*;
pub use mount::*;
pub use netbed::*;
pub use node::*;
pub use objstore::*;
pub use proxy::*;
pub use slow_disk::*;
pub use slurm::*;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The `locus` binary under test. Cargo builds it beside every integration test and
/// bench, one directory above their own (`target/<profile>/deps/…` → `target/<profile>/`);
/// `LOCUS_BIN` names another.
pub fn locus() -> &'static Path {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("LOCUS_BIN") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().expect("the test's own path");
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .map(|d| d.join("locus"))
            .expect("tests run from target/<profile>/deps");
        assert!(
            bin.exists(),
            "{} is missing: run the tests through cargo, or set LOCUS_BIN",
            bin.display()
        );
        bin
    })
}

/// Where test runs keep their directories: `target/tmp`, as cargo's CARGO_TARGET_TMPDIR.
fn target_tmp() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.ancestors()
        .nth(3)
        .map(|t| t.join("tmp"))
        .unwrap_or_else(std::env::temp_dir)
}

static RUN: AtomicUsize = AtomicUsize::new(0);

/// One test's run directory. Keeps it (and says where) if the test panics.
pub struct Harness {
    pub root: PathBuf,
}

impl Harness {
    pub fn new(test: &str) -> Self {
        let n = RUN.fetch_add(1, Ordering::SeqCst);
        let root = target_tmp()
            .join("runs")
            .join(format!("{test}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the test run directory");
        Harness { root }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test failed: logs and data kept in {}", self.root.display());
            for e in std::fs::read_dir(&self.root).into_iter().flatten().flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "log") {
                    let text = std::fs::read_to_string(&p).unwrap_or_default();
                    let tail: Vec<_> = text.lines().rev().take(40).collect();
                    eprintln!("--- last lines of {} ---", p.display());
                    for l in tail.iter().rev() {
                        eprintln!("{l}");
                    }
                }
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// Sends `sig` to a child this process spawned and has not reaped (so the pid is its).
pub fn signal(child: &Child, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig);
}

/// A port that is free now, from 5000–11999: below the kernel's ephemeral range (32768 and
/// up), where no port-0 bind or outgoing connection of another test can take it, and below
/// the range `free_port_pair` uses for SeaweedFS. For daemons that restart on their port.
pub fn free_low_port() -> u16 {
    free_low_port_on(std::net::Ipv4Addr::LOCALHOST, &[])
}

/// Like `free_low_port`, free on `ip` (the address the daemon will listen on: a port free
/// on loopback may be taken on a test bed's bridge address) and not one of `taken` (ports
/// chosen for the same daemon, not yet bound).
pub fn free_low_port_on(ip: std::net::Ipv4Addr, taken: &[u16]) -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    loop {
        h.write_u32(std::process::id());
        let p = 5_000 + (h.finish() % 7_000) as u16;
        if taken.contains(&p) {
            continue;
        }
        let free = |ip: std::net::Ipv4Addr| std::net::TcpListener::bind((ip, p)).is_ok();
        if free(ip) && (ip.is_loopback() || free(std::net::Ipv4Addr::LOCALHOST)) {
            return p;
        }
    }
}

/// Polls `f` until it returns Some, or panics after `timeout` with `what`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A minimal HTTP/1.1 GET, enough for /metrics and /healthz; panics unless 200.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    let (code, body) = http_request(addr, "GET", path, &[], "").await;
    assert_eq!(code, 200, "{body}");
    body
}

/// A counter (or gauge) in a plaintext node's /metrics; panics when it is not there.
pub async fn counter(n: &Node, name: &str) -> u64 {
    let text = http_get(n.http, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} is not in the node's metrics"))
}

/// A minimal HTTP/1.1 request: (status code, body).
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    try_http_request(addr, method, path, headers, body)
        .await
        .unwrap_or_else(|| panic!("{method} http://{addr}{path}: no answer"))
}

/// `http_request`, None when the connection fails (for waiting on a server to start).
pub async fn try_http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let code = buf.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((code, body))
}
