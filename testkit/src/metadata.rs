//! `locus metadata serve` as a test starts it: tokens, TLS, options, and the CLI against it.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

use locus_proto::client::{ClientOptions, MetadataClient};
use locus_proto::pb;

use super::*;

/// A token the harness configures, with its role.
#[derive(Clone, Debug)]
pub struct Token {
    pub name: &'static str,
    pub role: &'static str,
    pub secret: String,
}

/// One token per role ("ops" admin, "gpu-node" node, "trainer" reader), and a node token
/// of its own for each of nodes n1..n6 (a node acts only for the id its token is named
/// after). A group's members get `member_token()` too.
pub fn tokens() -> Vec<Token> {
    let mut t: Vec<Token> = ["admin", "node", "reader"]
        .iter()
        .map(|role| Token {
            name: match *role {
                "admin" => "ops",
                "node" => "gpu-node",
                "member" => "group",
                _ => "trainer",
            },
            role,
            secret: format!("{role}-secret-0123456789abcdef"),
        })
        .collect();
    for name in ["n1", "n2", "n3", "n4", "n5", "n6"] {
        t.push(Token {
            name,
            role: "node",
            secret: format!("{name}-node-secret-0123456789"),
        });
    }
    t
}

/// The secret group members present on each other's raft ports (role member).
pub fn member_token() -> Token {
    Token {
        name: "group",
        role: "member",
        secret: "member-secret-0123456789abcdef".into(),
    }
}

#[derive(Clone, Debug, Default)]
pub struct MetadataOpts {
    pub tokens: Vec<Token>,
    /// TLS on its gRPC and HTTP ports, with a cluster CA made by `locus tls` in its dir.
    pub tls: bool,
    /// Mutual TLS: callers must present a certificate of that CA (implies `tls`).
    pub mtls: bool,
    pub liveness_timeout: Option<&'static str>,
    pub session_timeout: Option<&'static str>,
    pub extra: Vec<String>,
    /// Listen on this address (a test bed's gateway) instead of loopback.
    pub ip: Option<std::net::Ipv4Addr>,
    /// More `[[token]]` tables for the service's tokens file only (scoped tokens, say).
    pub more_tokens: String,
}

impl MetadataOpts {
    /// The usual secured service: `tokens()`, nothing else changed.
    pub fn with_tokens() -> Self {
        MetadataOpts {
            tokens: tokens(),
            ..Default::default()
        }
    }
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
    pub dir: PathBuf,
    /// The URL clients are given instead of its own (a proxy in front of it).
    pub public_url: Option<String>,
    /// A group member's raft port, once it listens.
    pub raft: Option<SocketAddr>,
}

impl Harness {
    /// Starts a metadata service on free loopback ports and waits until it answers.
    pub async fn start_metadata(&self, name: &str, opts: MetadataOpts) -> Metadata {
        let mut m = self.prepare_metadata(name, opts, &[]);
        m.start_on_free_ports().await;
        m
    }

    /// A replicated metadata group of `n` members (`NAME-m1`…, member names m1…) on
    /// loopback, started together (a member's port opens only once a majority is up).
    /// Every member's `url()` is the whole group's comma-separated list, so clients, nodes
    /// and the CLI started against any of them reach whichever members are alive.
    pub async fn start_group(&self, name: &str, n: usize, opts: MetadataOpts) -> Vec<Metadata> {
        launch_group(self.prepare_group(name, n, opts)).await
    }

    /// The members of a new group of `n`, ready to `spawn` (ports chosen, files written),
    /// none running; `launch_group` starts them all.
    pub fn prepare_group(&self, name: &str, n: usize, opts: MetadataOpts) -> Vec<Metadata> {
        let mut opts = opts;
        if !opts.tokens.is_empty() && !opts.tokens.iter().any(|t| t.role == "member") {
            opts.tokens.push(member_token());
        }
        let mut taken = Vec::new();
        let mut raft = Vec::new();
        for _ in 0..n {
            let p = free_low_port_on(std::net::Ipv4Addr::LOCALHOST, &taken);
            taken.push(p);
            raft.push(p);
        }
        let cluster: Vec<String> = raft
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{}=127.0.0.1:{p}", i + 1))
            .collect();
        let mut members: Vec<Metadata> = Vec::new();
        for i in 0..n {
            let o = as_member(&opts, i, &cluster);
            let mut m = self.prepare_metadata(&format!("{name}-m{}", i + 1), o, &taken);
            taken.extend([m.grpc.port(), m.http.port()]);
            if let Some(first) = members.first() {
                if m.opts.tls {
                    // One cluster CA for the whole group: members verify each other with it,
                    // and a certificate issued through any member chains to it.
                    for f in [
                        "ca.pem",
                        "ca.key",
                        "server.pem",
                        "server.key",
                        "admin.pem",
                        "admin.key",
                    ] {
                        std::fs::copy(first.dir.join(f), m.dir.join(f)).unwrap();
                    }
                    m.ca_pem = first.ca_pem.clone();
                }
            }
            members.push(m);
        }
        members
    }

    /// A metadata service ready to `spawn` or `start` (ports chosen, files written), not running.
    pub fn prepare_metadata(&self, name: &str, opts: MetadataOpts, taken: &[u16]) -> Metadata {
        let dir = self.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut opts = opts;
        opts.tls |= opts.mtls;
        let ca_pem = if opts.tls {
            let ip = opts.ip.map(|i| i.to_string());
            let pem = make_pki(&dir, ip.as_deref());
            // This test process's own clients (of the service and of TLS nodes) trust the
            // cluster CA and present the admin's certificate.
            locus_proto::tls::set_client(locus_proto::tls::ClientTls {
                ca_pem: Some(pem.clone()),
                identity: Some((
                    std::fs::read(dir.join("admin.pem")).unwrap(),
                    std::fs::read(dir.join("admin.key")).unwrap(),
                )),
                insecure: false,
            });
            Some(pem)
        } else {
            None
        };
        if !opts.tokens.is_empty() {
            // Nodes get every token but the admin's: clients present grants to nodes, so
            // a node needs no admin token, and every test with tokens shows it.
            for (file, admin) in [("tokens.toml", true), ("node-tokens.toml", false)] {
                let mut t = String::new();
                for tok in opts.tokens.iter().filter(|t| admin || t.role != "admin") {
                    t.push_str(&format!(
                        "[[token]]\nname = \"{}\"\nrole = \"{}\"\ntoken = \"{}\"\n",
                        tok.name, tok.role, tok.secret
                    ));
                }
                if admin {
                    t.push_str(&opts.more_tokens);
                }
                std::fs::write(dir.join(file), t).unwrap();
                // Plain tokens: the services refuse a file others may read.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(dir.join(file), std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        }
        let log = self.path(&format!("{name}.log"));
        // Group members present the member secret on each other's raft ports.
        let mut env = Vec::new();
        if let Some(t) = opts.tokens.iter().find(|t| t.role == "member") {
            env.push(("LOCUS_METADATA_MEMBER_TOKEN".to_string(), t.secret.clone()));
        }
        env.push(("RUST_LOG".to_string(), "info,openraft=warn".to_string()));
        let ip = opts.ip.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
        let grpc_port = free_low_port_on(ip, taken);
        let mut with_grpc = taken.to_vec();
        with_grpc.push(grpc_port);
        Metadata {
            daemon: Daemon::new(name, log.clone(), dir.join("addr"), env),
            data_dir: dir.join("data"),
            log,
            // Below the kernel's ephemeral range: a restart on the same ports (nodes and
            // clients hold the URL) cannot find one taken by another test's connection.
            grpc: SocketAddr::from((ip, grpc_port)),
            http: SocketAddr::from((ip, free_low_port_on(ip, &with_grpc))),
            opts,
            ca_pem,
            dir,
            public_url: None,
            raft: None,
        }
    }
}

impl Metadata {
    pub fn args(&self) -> Vec<OsString> {
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
        } else if self.opts.ip.is_some() {
            a.push("--insecure".into());
        }
        if self.opts.tls {
            a.push("--tls-cert".into());
            a.push(self.dir.join("server.pem").into());
            a.push("--tls-key".into());
            a.push(self.dir.join("server.key").into());
        }
        if self.opts.mtls {
            a.push("--tls-client-ca".into());
            a.push(self.dir.join("ca.pem").into());
        }
        if self.opts.tls {
            // For its calls to TLS nodes (repair).
            a.push("--ca-cert".into());
            a.push(self.dir.join("ca.pem").into());
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

    pub async fn start(&mut self) {
        self.spawn();
        self.wait_ready().await;
    }

    pub fn spawn(&mut self) {
        let args = self.args();
        self.daemon.spawn(&args);
    }

    /// A first start. The ports were chosen free, but another test running alongside
    /// may bind one before the service does; a start that finds its port taken moves to
    /// new free ports (a few times) instead of failing the test. Restarts keep their
    /// ports: nodes and clients hold the URL.
    pub async fn start_on_free_ports(&mut self) {
        for attempt in 0.. {
            self.spawn();
            match self.daemon.try_wait_addrs().await {
                Ok(addrs) => return self.ready_at(addrs).await,
                Err(why) if attempt < 5 && why.contains("Address already in use") => {
                    self.daemon.reap();
                    let std::net::IpAddr::V4(ip) = self.grpc.ip() else {
                        panic!("{why}")
                    };
                    let old = [self.grpc.port(), self.http.port()];
                    let grpc = free_low_port_on(ip, &old);
                    let http = free_low_port_on(ip, &[old[0], old[1], grpc]);
                    eprintln!(
                        "{}: a port was taken before it listened; ports {grpc} and {http} now",
                        self.daemon.name
                    );
                    self.grpc.set_port(grpc);
                    self.http.set_port(http);
                }
                Err(why) => panic!("{why}"),
            }
        }
    }

    /// Waits until its port is open and it answers (its own answer, not a group's).
    pub async fn wait_ready(&mut self) {
        let addrs = self.daemon.wait_addrs().await;
        self.ready_at(addrs).await
    }

    async fn ready_at(&mut self, addrs: Vec<(String, SocketAddr)>) {
        self.grpc = addr_of(&addrs, "grpc");
        self.http = addr_of(&addrs, "http");
        self.raft = addrs.iter().find(|(k, _)| k == "raft").map(|(_, a)| *a);
        let token = self.opts.tokens.first().map(|t| t.secret.clone());
        let mut opts = self.client_options(token);
        opts.url = self.own_url();
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
        if let Some(u) = &self.public_url {
            return u.clone();
        }
        self.own_url()
    }

    /// This process's own gRPC URL, whatever clients are given.
    pub fn own_url(&self) -> String {
        if self.opts.tls {
            // The certificate names localhost and the address it listens on off loopback.
            match self.opts.ip {
                Some(ip) => format!("https://{ip}:{}", self.grpc.port()),
                None => format!("https://localhost:{}", self.grpc.port()),
            }
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

    /// The secret of the token named `name`.
    pub fn named_token(&self, name: &str) -> Option<String> {
        self.opts
            .tokens
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.secret.clone())
    }

    /// The token node `id` presents: its own when one is named after it, else the first
    /// node-role token.
    pub fn node_token(&self, id: &str) -> Option<String> {
        self.opts
            .tokens
            .iter()
            .find(|t| t.name == id && t.role == "node")
            .map(|t| t.secret.clone())
            .or_else(|| self.token("node"))
    }

    /// A client presenting the token named `name`.
    pub async fn client_named(&self, name: &str) -> MetadataClient {
        let token = self
            .named_token(name)
            .unwrap_or_else(|| panic!("no token named {name}"));
        locus_proto::client::connect(&self.client_options(Some(token)))
            .await
            .expect("connect to the metadata service")
    }

    /// A client with the token of `role` ("admin", "node", "reader"), or none.
    /// A grant for `operation` ("read", "import", …) on node `node` ("*": every node),
    /// issued to the admin.
    pub async fn grant(&self, operation: &str, node: &str) -> String {
        self.client(Some("admin"))
            .await
            .issue_grant(pb::IssueGrantRequest {
                node: node.into(),
                operation: operation.into(),
                target: String::new(),
                ttl_ms: 0,
            })
            .await
            .expect("IssueGrant")
            .into_inner()
            .grant
    }

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

    /// `cli_env` that must finish within `deadline` (a command that would hang on a stopped
    /// peer fails the test instead of stalling it). Runs off the async threads.
    pub async fn cli_within(&self, deadline: Duration, args: &[&str], env: &[(&str, String)]) -> Output {
        let mut cmd = self.cli_command(args, env);
        let what = args.join(" ");
        tokio::time::timeout(
            deadline,
            tokio::task::spawn_blocking(move || cmd.output().expect("run locus")),
        )
        .await
        .unwrap_or_else(|_| panic!("`locus {what}` did not finish within {deadline:?}"))
        .expect("the command's thread")
    }

    /// `cli` with extra environment variables (PATH for stand-in tools, say).
    pub fn cli_env(&self, args: &[&str], env: &[(&str, String)]) -> Output {
        self.cli_command(args, env).output().expect("run locus")
    }

    /// `locus ARGS` against this service with the token `secret` instead of the admin's.
    pub fn cli_as(&self, secret: &str, args: &[&str]) -> Output {
        let mut cmd = self.cli_command(args, &[]);
        cmd.env("LOCUS_TOKEN", secret);
        cmd.output().expect("run locus")
    }

    /// A client presenting the token `secret`.
    pub async fn client_as(&self, secret: &str) -> MetadataClient {
        locus_proto::client::connect(&self.client_options(Some(secret.to_string())))
            .await
            .expect("connect to the metadata service")
    }

    /// `locus ARGS` against this service, as its admin, with no config file; `env` first,
    /// so the service's address and token win over it.
    pub fn cli_command(&self, args: &[&str], env: &[(&str, String)]) -> Command {
        let mut cmd = Command::new(locus());
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
        if self.opts.mtls {
            cmd.env("LOCUS_CLIENT_CERT", self.dir.join("admin.pem"))
                .env("LOCUS_CLIENT_KEY", self.dir.join("admin.key"));
        }
        cmd
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

/// A cluster CA in `dir` made with `locus tls ca`, the service's certificate
/// (`server.pem`, for localhost, 127.0.0.1 and `ip`) and an admin client certificate
/// (`admin.pem`); the CA's PEM.
pub fn make_pki(dir: &Path, ip: Option<&str>) -> Vec<u8> {
    let run = |args: &[&str]| {
        let out = Command::new(locus()).args(args).output().expect("run locus tls");
        assert!(
            out.status.success(),
            "locus {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let d = dir.to_str().unwrap();
    run(&["tls", "ca", "--dir", d]);
    let mut hosts = "localhost,127.0.0.1".to_string();
    if let Some(ip) = ip {
        hosts.push(',');
        hosts.push_str(ip);
    }
    run(&["tls", "cert", "--ca-dir", d, "--name", "server", "--host", &hosts]);
    run(&[
        "tls",
        "cert",
        "--ca-dir",
        d,
        "--name",
        "admin",
        "--host",
        "localhost",
    ]);
    std::fs::read(dir.join("ca.pem")).unwrap()
}

impl Metadata {
    /// A certificate of the cluster CA for `name` and `hosts`, written to `out` (reused
    /// when already there); its cert and key paths.
    pub fn issue_cert(&self, name: &str, hosts: &str, out: &Path) -> (PathBuf, PathBuf) {
        assert!(self.opts.tls, "the service has no CA: start it with tls");
        let (c, k) = (out.join(format!("{name}.pem")), out.join(format!("{name}.key")));
        if !c.exists() {
            let st = Command::new(locus())
                .args(["tls", "cert", "--ca-dir"])
                .arg(&self.dir)
                .args(["--name", name, "--host", hosts, "--out"])
                .arg(out)
                .output()
                .expect("run locus tls cert");
            assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
        }
        (c, k)
    }
}

impl Metadata {
    /// A client of this process alone (not the group's URL list), with the admin token if
    /// the service has tokens.
    pub async fn own_client(&self) -> MetadataClient {
        let mut o = self.client_options(self.token("admin"));
        o.url = self.own_url();
        locus_proto::client::connect(&o)
            .await
            .expect("connect to one member")
    }
}

/// The index in `ms` (a group from `start_group`) of the leader, as the running members
/// report it; waits up to 30 s for one.
pub async fn group_leader(ms: &[Metadata]) -> usize {
    wait_until("the group to have a leader", Duration::from_secs(30), || async {
        for m in ms.iter().filter(|m| m.daemon.is_running()) {
            let mut o = m.client_options(m.token("admin"));
            o.url = m.own_url();
            let Ok(mut c) = locus_proto::client::connect(&o).await else {
                continue;
            };
            let Ok(i) = c.get_cluster_info(pb::GetClusterInfoRequest {}).await else {
                continue;
            };
            let l = i.into_inner().leader;
            let idx = ms
                .iter()
                .position(|m| m.data_dir.to_string_lossy().contains(&format!("-{l}/")));
            if let Some(idx) = idx.filter(|i| ms[*i].daemon.is_running()) {
                return Some(idx);
            }
        }
        None
    })
    .await
}

/// Waits until every member of `ms` reports a leader and the same applied log index.
pub async fn group_settled(ms: &[Metadata], within: Duration) {
    wait_until("the members to apply the same log", within, || async {
        let mut applied = std::collections::BTreeSet::new();
        for m in ms {
            let mut c = m.own_client().await;
            let i = c
                .get_cluster_info(pb::GetClusterInfoRequest {})
                .await
                .ok()?
                .into_inner();
            if i.leader.is_empty() {
                return None;
            }
            applied.insert(i.applied_index);
        }
        (applied.len() == 1).then_some(())
    })
    .await;
}

/// A group member's options: `opts` with its `--id mI` and the group's `--cluster`, and the
/// harness's election timeout unless `opts` names one. Tests share two cores with
/// everything they start: a longer timeout than the default keeps a busy moment from
/// looking like a dead leader.
pub(crate) fn as_member(opts: &MetadataOpts, i: usize, cluster: &[String]) -> MetadataOpts {
    let mut o = opts.clone();
    if !o.extra.iter().any(|a| a == "--election-timeout") {
        o.extra
            .extend(["--election-timeout".to_string(), "1s".to_string()]);
    }
    o.extra.extend([
        "--id".to_string(),
        format!("m{}", i + 1),
        "--cluster".to_string(),
        cluster.join(","),
    ]);
    o
}

/// Starts prepared members together (a member's port opens only once a majority is up),
/// waits for each, and gives each the group's URL list.
pub async fn launch_group(mut members: Vec<Metadata>) -> Vec<Metadata> {
    for m in members.iter_mut() {
        m.spawn();
    }
    for m in members.iter_mut() {
        m.wait_ready().await;
    }
    let urls: Vec<String> = members.iter().map(|m| m.url()).collect();
    for m in members.iter_mut() {
        m.public_url = Some(urls.join(","));
    }
    members
}
