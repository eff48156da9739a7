//! `locus node serve` as a test starts it: one host per node (labels), its data dir and sockets.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use locus_proto::pb;

use super::*;

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
    /// More environment (an object store's endpoint and credentials, for origin reads).
    pub env: Vec<(String, String)>,
    /// The test-bed host it runs on (its own network namespace and address), or loopback.
    pub on: Option<Host>,
    /// Serve TLS with a certificate of the metadata service's CA (which must have one);
    /// mutual TLS when the service demands it.
    pub tls: bool,
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
            env: Vec::new(),
            on: None,
            tls: false,
        }
    }

    /// A node on test-bed host `h`: listening on its address, labelled with its name and rack.
    pub fn on(h: &Host) -> Self {
        NodeOpts {
            rack: format!("r{}", h.rack),
            host: h.name.clone(),
            on: Some(h.clone()),
            ..NodeOpts::host(0)
        }
    }

    /// The same with room for `capacity` (benches hold more than a test's 1 GiB).
    pub fn with_capacity(mut self, capacity: &'static str) -> Self {
        self.capacity = capacity;
        self
    }

    /// Where it listens: the host's address, or loopback; port chosen by the kernel.
    fn listen(&self) -> SocketAddr {
        let ip: std::net::IpAddr = match &self.on {
            Some(h) => h.addr.into(),
            None => [127, 0, 0, 1].into(),
        };
        SocketAddr::new(ip, 0)
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
    pub metadata_url: String,
    pub dir: PathBuf,
    pub tokens_file: Option<PathBuf>,
    /// The cluster CA, when the metadata service has one.
    pub ca_cert: Option<PathBuf>,
    /// Its certificate and key, when it serves TLS; and the CA it demands of callers.
    pub tls: Option<(PathBuf, PathBuf, Option<PathBuf>)>,
}

impl Harness {
    /// Starts a cache node registered with `meta` and waits until it is listed as up.
    pub async fn start_node(&self, id: &str, meta: &Metadata, opts: NodeOpts) -> Node {
        self.start_node_in(id, id, meta, opts).await
    }

    /// `start_node` with its files under `name` rather than its id: a second process
    /// claiming an id, with its own data dir.
    pub async fn start_node_in(&self, name: &str, id: &str, meta: &Metadata, opts: NodeOpts) -> Node {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut env = opts.env.clone();
        if let Some(t) = meta.node_token(id) {
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
        let tokens_file = (!meta.opts.tokens.is_empty()).then(|| meta.dir.join("node-tokens.toml"));
        let tls = opts.tls.then(|| {
            let host = opts
                .on
                .as_ref()
                .map_or("127.0.0.1".to_string(), |h| h.addr.to_string());
            let (c, k) = meta.issue_cert(id, &host, &dir);
            (c, k, meta.opts.mtls.then(|| meta.dir.join("ca.pem")))
        });
        let mut daemon = Daemon::new(name, self.path(&format!("{name}.log")), dir.join("addr"), env);
        daemon.netns = opts.on.as_ref().map(|h| h.netns.clone());
        let mut n = Node {
            tokens_file,
            id: id.to_string(),
            daemon,
            data_dir: dir.join("data"),
            grpc: opts.listen(),
            http: opts.listen(),
            socket: dir.join("node.sock"),
            opts,
            metadata_url: meta.url(),
            dir,
            ca_cert: meta.opts.tls.then(|| meta.dir.join("ca.pem")),
            tls,
        };
        n.start().await;
        meta.wait_node_up(id, &format!("node {id} to register")).await;
        n
    }
}

impl Metadata {
    /// Waits (30 s at most) until the service lists node `id` as up; `what` names the wait.
    pub async fn wait_node_up(&self, id: &str, what: &str) {
        let c = self.client(self.opts.tokens.first().map(|t| t.role)).await;
        wait_until(what, Duration::from_secs(30), || {
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
                    .any(|n| n.id == id && n.state == pb::NodeState::Up as i32 && !n.unheard)
                    .then_some(())
            }
        })
        .await;
    }
}

impl Harness {
    /// Runs `locus node serve --id ID` as a second, unmanaged process would (its own data
    /// dir under `name`, loopback, `token` as its LOCUS_TOKEN, the metadata's tokens file)
    /// and waits up to `within` for it to exit on its own: its exit status and log. None
    /// if it was still running (it is killed then).
    pub fn node_until_exit(
        &self,
        name: &str,
        id: &str,
        meta: &Metadata,
        token: Option<String>,
        within: Duration,
    ) -> Option<(std::process::ExitStatus, String)> {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        let mut cmd = Command::new(locus());
        cmd.args([
            "--metadata",
            &meta.url(),
            "node",
            "serve",
            "--id",
            id,
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--http-listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args([
            "--capacity",
            "1GiB",
            "--reserve",
            "0",
            "--heartbeat-interval",
            "300ms",
        ])
        .env_remove("LOCUS_TOKEN")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap());
        if !meta.opts.tokens.is_empty() {
            cmd.arg("--tokens-file").arg(meta.dir.join("node-tokens.toml"));
        }
        if let Some(t) = token {
            cmd.env("LOCUS_TOKEN", t);
        }
        let mut child = cmd.spawn().expect("start locus node serve");
        let until = std::time::Instant::now() + within;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if std::time::Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default()
            + &std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
        status.map(|st| (st, text))
    }
}

impl Node {
    pub fn args(&self) -> Vec<OsString> {
        let o = &self.opts;
        let mut a: Vec<OsString> = vec!["--metadata".into(), self.metadata_url.clone().into()];
        if let Some(ca) = &self.ca_cert {
            a.push("--ca-cert".into());
            a.push(ca.clone().into());
        }
        a.extend(["node", "serve"].map(OsString::from));
        if let Some((cert, key, client_ca)) = &self.tls {
            a.extend([
                "--tls-cert".into(),
                cert.clone().into(),
                "--tls-key".into(),
                key.clone().into(),
            ]);
            if let Some(ca) = client_ca {
                a.push("--tls-client-ca".into());
                a.push(ca.clone().into());
            }
        }
        a.push("--id".into());
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
        } else if o.on.is_some() {
            // Off loopback without tokens: allowed only when asked for.
            a.push("--insecure".into());
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
            // One host, one clock: a writer's pin is dropped as soon as it may be.
            ("--write-pin-grace", "0s".to_string()),
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

    pub async fn start(&mut self) {
        let args = self.args();
        self.daemon.spawn(&args);
        let addrs = self.daemon.wait_addrs().await;
        self.grpc = addr_of(&addrs, "grpc");
        self.http = addr_of(&addrs, "http");
    }

    /// Starts it again on the same data dir, and on the same ports unless another test's
    /// process took one meanwhile (ports freed by a stopped node are fair game for the
    /// kernel's ephemeral ports): then on fresh ones, which the node registers as its new
    /// address.
    pub async fn restart(&mut self) {
        assert!(!self.daemon.is_running(), "stop it first");
        let args = self.args();
        self.daemon.spawn(&args);
        let addrs = match self.daemon.try_wait_addrs().await {
            Ok(a) => a,
            Err(why) if why.contains("Address already in use") => {
                self.grpc = self.opts.listen();
                self.http = self.opts.listen();
                let args = self.args();
                self.daemon.spawn(&args);
                self.daemon.wait_addrs().await
            }
            Err(why) => panic!("{why}"),
        };
        self.grpc = addr_of(&addrs, "grpc");
        self.http = addr_of(&addrs, "http");
    }

    pub async fn client(&self) -> locus_proto::client::NodeClient {
        self.client_with(None).await
    }

    pub async fn client_with(&self, token: Option<&str>) -> locus_proto::client::NodeClient {
        locus_proto::client::connect_node(&self.address(), token, Duration::from_secs(5))
            .await
            .expect("connect to the node")
    }

    /// Its own listening address as a client dials it (`https://` when it serves TLS).
    pub fn address(&self) -> String {
        match self.tls {
            Some(_) => format!("https://{}", self.grpc),
            None => self.grpc.to_string(),
        }
    }

    /// Every blob the node's index names whose bytes are on disk — in a file of its own
    /// or a range of a pack — by hash (hex). Read from the index read-only, so it works
    /// while the node runs and after it died.
    pub fn blob_files(&self) -> std::collections::BTreeMap<String, OnDisk> {
        locus_cache_node::store::indexed_blobs(std::slice::from_ref(&self.data_dir))
            .unwrap_or_else(|e| panic!("{}'s blob index: {e}", self.id))
            .into_iter()
            .map(|(h, at, size)| {
                let d = OnDisk {
                    path: at.path,
                    offset: at.offset,
                    size,
                    packed: at.packed,
                };
                (h.to_hex(), d)
            })
            .collect()
    }

    /// Whether the node's log says `text` (its log file read whole).
    pub fn logged(&self, text: &str) -> bool {
        std::fs::read_to_string(&self.daemon.log).is_ok_and(|l| l.contains(text))
    }

    pub fn quarantined(&self) -> usize {
        std::fs::read_dir(self.data_dir.join("quarantine")).map_or(0, |d| d.count())
    }
}

/// Where a node keeps one blob: a file of its own, or a range of a pack of small blobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnDisk {
    pub path: PathBuf,
    pub offset: u64,
    pub size: u64,
    pub packed: bool,
}

impl OnDisk {
    /// The blob's bytes as they are on disk now.
    pub fn read(&self) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; self.size as usize];
        std::fs::File::open(&self.path)
            .and_then(|f| f.read_exact_at(&mut buf, self.offset))
            .unwrap_or_else(|e| panic!("reading {}: {e}", self.path.display()));
        buf
    }

    /// Flips the byte at `at` in the blob, in place (the file's size is unchanged, as
    /// when bits rot).
    pub fn flip(&self, at: u64) {
        use std::os::unix::fs::FileExt;
        assert!(at < self.size, "byte {at} of a {}-byte blob", self.size);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, self.offset + at).unwrap();
        f.write_all_at(&[b[0] ^ 0xff], self.offset + at).unwrap();
    }
}
