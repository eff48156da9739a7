//! A `locus` daemon process: its log, its address file, signals, and a clean stop.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::*;

/// A `locus` daemon process: its arguments, log and address file, with fault injection.
pub struct Daemon {
    pub name: String,
    pub log: PathBuf,
    pub addr_file: PathBuf,
    pub env: Vec<(String, String)>,
    /// The network namespace it runs in (a test-bed host), or the root one.
    pub netns: Option<String>,
    pub child: Option<Child>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Daemon {
    pub fn new(name: &str, log: PathBuf, addr_file: PathBuf, env: Vec<(String, String)>) -> Self {
        Daemon {
            name: name.to_string(),
            log,
            addr_file,
            env,
            netns: None,
            child: None,
        }
    }

    pub fn spawn(&mut self, args: &[OsString]) {
        let _ = std::fs::remove_file(&self.addr_file);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the daemon log");
        let mut cmd = match &self.netns {
            // nsenter execs the program: the child is the daemon itself, so signals reach it.
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/var/run/netns/{ns}")).arg(locus());
                c
            }
            None => Command::new(locus()),
        };
        cmd.args(args)
            .env("RUST_LOG", "info")
            .env_remove("LOCUS_TOKEN")
            .env_remove("LOCUS_METADATA")
            .env_remove("LOCUS_CONFIG");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(
            cmd.stdin(Stdio::null())
                .stdout(out.try_clone().expect("clone log handle"))
                .stderr(out)
                .spawn()
                .expect("spawn locus"),
        );
    }

    /// Waits for the address file's `key=addr` lines; panics with the log if the process
    /// exits first.
    pub async fn wait_addrs(&mut self) -> Vec<(String, SocketAddr)> {
        match self.try_wait_addrs().await {
            Ok(a) => a,
            Err(why) => panic!("{why}"),
        }
    }

    /// `wait_addrs`, but an exit before listening is returned (with the log) instead.
    pub async fn try_wait_addrs(&mut self) -> Result<Vec<(String, SocketAddr)>, String> {
        let addr_file = self.addr_file.clone();
        let log = self.log.clone();
        let name = self.name.clone();
        let mut child = self.child.take().expect("spawned");
        let addrs = wait_until(&format!("{name} to listen"), Duration::from_secs(30), || {
            let exited = child.try_wait().ok().flatten();
            let addr_file = addr_file.clone();
            let log = log.clone();
            let name = name.clone();
            async move {
                if let Some(st) = exited {
                    return Some(Err(format!(
                        "{name} exited with {st} before listening:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    )));
                }
                let s = std::fs::read_to_string(&addr_file).ok()?;
                let v: Vec<(String, SocketAddr)> = s
                    .lines()
                    .filter_map(|l| l.split_once('='))
                    .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
                    .collect();
                (!v.is_empty()).then_some(Ok(v))
            }
        })
        .await;
        self.child = Some(child);
        addrs
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Whether the process has exited by itself (it is reaped then).
    pub fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(c) => c.try_wait().ok().flatten().is_some(),
            None => true,
        }
    }

    /// Forgets a process that exited by itself, so it can be started again.
    pub fn reap(&mut self) {
        if self.exited() {
            self.child = None;
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill -9");
            c.wait().expect("reap");
        }
    }

    pub fn sigstop(&self) {
        signal(
            self.child.as_ref().expect("running"),
            nix::sys::signal::Signal::SIGSTOP,
        );
    }

    pub fn sigcont(&self) {
        signal(
            self.child.as_ref().expect("running"),
            nix::sys::signal::Signal::SIGCONT,
        );
    }

    /// SIGTERM, then waits for the exit status (panics after 30 s). Async so that the
    /// test's own client connections keep running and can answer the server's GOAWAY.
    pub async fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        signal(&c, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = c.try_wait().expect("wait") {
                return st;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("{} did not stop within 30 s of SIGTERM", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub fn addr_of(addrs: &[(String, SocketAddr)], key: &str) -> SocketAddr {
    addrs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, a)| *a)
        .unwrap_or_else(|| panic!("no {key} address reported"))
}
