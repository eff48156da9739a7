//! `locus node …`: the cluster's cache nodes as the metadata service sees them.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use locus_proto::pb;

use crate::config::{duration_arg, size_arg, Resolved};
use crate::output::{self, StatusExt};

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Run a cache node on this host until SIGTERM or SIGINT: registers with the metadata
    /// service, stores verified blobs in the data dirs, serves peers, repairs and scrubs.
    #[command(after_help = "\
Examples:
  # A node with 3.5 TiB of one NVMe, known to schedulers by its host and rack
  locus node serve --id gpu-01 --data-dir /nvme/locus --capacity 3.5TiB --labels host=gpu-01,rack=r1 --local-socket /run/locus/node.sock
  # Two nodes on one test host need distinct hosts for replicas to count
  locus node serve --id n2 --data-dir /tmp/n2 --capacity 10GiB --labels host=n2 --listen 127.0.0.1:7501")]
    Serve(Box<ServeArgs>),
    /// List registered nodes with state, labels and space.
    #[command(after_help = "\
Examples:
  # Every node: state, last heartbeat, space, labels
  locus node list")]
    List,
    /// Move a node's replicas to other nodes before maintenance (placement then avoids
    /// it). `--undo` returns it to service.
    #[command(after_help = "\
Examples:
  # Move gpu-07's replicas elsewhere before maintenance
  locus node drain gpu-07
  # Take it back into placement afterwards
  locus node drain gpu-07 --undo")]
    Drain {
        /// The node's id, as `locus node list` shows it.
        node: String,
        /// End the drain: the node takes new replicas again.
        #[arg(long)]
        undo: bool,
    },
    /// Forget a node that is gone for good (a dead host, a decommissioned one): it is
    /// dropped from every shard it held a replica of (repair keeps those at their
    /// replication from the other replicas) and its registration is deleted. Refused
    /// while the node is up, and while it holds the last replica of anything (nothing is
    /// changed then). A node that comes back later registers as new.
    #[command(after_help = "\
Examples:
  # Forget a node that is gone for good (refused while it is up or holds a last replica)
  locus node rm gpu-07")]
    Rm {
        /// The node's id, as `locus node list` shows it.
        node: String,
    },
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Node id [default: the host name].
    #[arg(long, env = "LOCUS_NODE_ID")]
    pub id: Option<String>,
    /// Data directories, comma-separated (one per NVMe device).
    #[arg(
        long,
        env = "LOCUS_NODE_DATA_DIR",
        value_name = "DIR[,DIR...]",
        value_delimiter = ',',
        required = true
    )]
    pub data_dir: Vec<PathBuf>,
    /// Most bytes of blobs to keep, e.g. 3TiB.
    #[arg(long, env = "LOCUS_NODE_CAPACITY", value_name = "SIZE")]
    pub capacity: String,
    /// Free space to leave on each data dir's filesystem.
    #[arg(long, env = "LOCUS_NODE_RESERVE", value_name = "SIZE", default_value = "1GiB")]
    pub reserve: String,
    /// Topology labels: zone=…,rack=…,host=… (host defaults to the host name).
    #[arg(
        long,
        env = "LOCUS_NODE_LABELS",
        value_name = "K=V,...",
        default_value = "",
        hide_default_value = true
    )]
    pub labels: String,
    /// Node API listen address: gRPC, and on the same port the bulk path that carries
    /// blob bytes to mounts and peers (sendfile; plaintext only: with --tls-cert, blob
    /// bytes go over gRPC). Clients turn the bulk path off with LOCUS_BULK=off.
    #[arg(
        long,
        env = "LOCUS_NODE_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:7500"
    )]
    pub listen: String,
    /// HTTP address for /metrics and /healthz; "off" disables.
    #[arg(
        long,
        env = "LOCUS_NODE_HTTP_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:7501"
    )]
    pub http_listen: String,
    /// Address peers use to reach this node [default: the listen address].
    #[arg(long, env = "LOCUS_NODE_ADVERTISE", value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// Unix socket for same-host clients (the mount). Created with mode 0660; root, the
    /// node's user and the group below may connect. It serves reads, EnsureLocal and
    /// LocalPaths, nothing that writes or fetches. Beside it, PATH.open hands any host
    /// user a blob as an open descriptor under a read grant that opens it (what mounts of
    /// users outside the group use: teams sharing a host).
    #[arg(long, env = "LOCUS_NODE_SOCKET", value_name = "PATH")]
    pub local_socket: Option<PathBuf>,
    /// Group (name or number) whose members may use the local socket, e.g. the group
    /// training jobs run as [default: the node's own group].
    #[arg(long, value_name = "GROUP")]
    pub local_socket_group: Option<String>,
    /// A host user narrowed to datasets on the open socket (LOCAL_SOCKET.open), for
    /// teams sharing hosts: USER=PATTERN[,PATTERN...] (a user name or uid; `*` in a pattern
    /// is any run of characters). That user is handed only blobs of versions of matching
    /// datasets, under grants that name them, whatever its token could read elsewhere.
    /// Repeat for more users. Keep such users out of --local-socket-group.
    #[arg(long, value_name = "USER=PATTERNS")]
    pub socket_scope: Vec<String>,
    /// How often to tell the metadata service this node is alive, with its space and
    /// counters; it declares the node down after its --liveness-timeout without one.
    #[arg(long, value_name = "DURATION", default_value = "2s")]
    pub heartbeat_interval: String,
    /// How often to re-read which blobs this node must hold.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    pub pin_sync_interval: String,
    /// Blobs an import wrote stay pinned while the import is open, though no version
    /// names them yet. This is how far this host's clock may be behind the metadata
    /// service's without such a blob being unpinned early.
    #[arg(long, value_name = "DURATION", default_value = "60s")]
    pub write_pin_grace: String,
    /// A peer silent this long during a transfer is given up on (the copy is retried
    /// from another replica).
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    pub peer_timeout: String,
    /// Blobs this node must hold but lacks (after a disk swap, a wipe, a quarantine) are
    /// copied back by this many workers at once, from live replicas, else backups.
    #[arg(
        long,
        env = "LOCUS_NODE_REFILL_PARALLEL",
        value_name = "N",
        default_value_t = 8
    )]
    pub refill_parallel: usize,
    /// Most bytes per second all refill copies take together, e.g. 500MiB, so a refill
    /// leaves bandwidth for training reads; 0 = no limit.
    #[arg(
        long,
        env = "LOCUS_NODE_REFILL_RATE",
        value_name = "SIZE",
        default_value = "0"
    )]
    pub refill_rate: String,
    /// A local directory this node may read as a `file://` origin: imports of it that
    /// the node reads itself, and repairs of its versions when no replica is left.
    /// Repeat for several. Without it the node reads no local directory for anyone (a
    /// caller with an import grant could otherwise have it read /etc/shadow). Object
    /// stores are not affected.
    #[arg(
        long,
        env = "LOCUS_NODE_ORIGIN_ROOTS",
        value_name = "DIR",
        value_delimiter = ','
    )]
    pub origin_root: Vec<PathBuf>,
    /// Background re-verification rate per second (0 disables).
    #[arg(
        long,
        env = "LOCUS_NODE_SCRUB_RATE",
        value_name = "SIZE",
        default_value = "64MiB"
    )]
    pub scrub_rate: String,
    /// Not needed any more: a node accepts no token from callers, only grants the
    /// metadata service signs (importers, backups, mounts, peers and the service's own
    /// copy orders all present one), and it checks them as soon as it has a token of its
    /// own (LOCUS_TOKEN or --token-file, role node, named after its id). A file given
    /// here is still checked, and also turns grant checks on.
    #[arg(long, env = "LOCUS_NODE_TOKENS_FILE", value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Write the bound address (grpc=…) here once listening.
    #[arg(long, value_name = "FILE")]
    pub addr_file: Option<PathBuf>,
    // Last: clap puts every option after a flattened group under its heading.
    #[command(flatten)]
    pub tls: crate::config::ServerTlsArgs,
}

pub async fn run(cmd: NodeCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Serve(a) => serve(*a, cfg).await,
        NodeCmd::List => list(cfg).await,
        NodeCmd::Drain { node, undo } => drain(cfg, &node, !undo).await,
        NodeCmd::Rm { node } => rm(cfg, &node).await,
    }
}

/// `--socket-scope USER=PATTERN[,PATTERN...]`: the user's uid (a number, or a name in
/// /etc/passwd) and the datasets it is narrowed to.
fn socket_scope(s: &str) -> anyhow::Result<(u32, locus_proto::auth::Scope)> {
    let (user, patterns) = s.split_once('=').ok_or_else(|| {
        anyhow::anyhow!("--socket-scope {s:?}: USER=PATTERN[,PATTERN...], e.g. alice=team-a-*")
    })?;
    let uid = match user.parse() {
        Ok(n) => n,
        Err(_) => std::fs::read_to_string("/etc/passwd")
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                let mut f = l.split(':');
                (f.next() == Some(user)).then(|| f.nth(1).and_then(|id| id.parse().ok()))?
            })
            .ok_or_else(|| anyhow::anyhow!("--socket-scope {s:?}: no user {user:?} in /etc/passwd"))?,
    };
    let rules = patterns
        .split(',')
        .map(|p| (p.trim().to_string(), vec![locus_proto::auth::Action::Read]))
        .collect();
    let scope =
        locus_proto::auth::Scope::new(rules).map_err(|e| anyhow::anyhow!("--socket-scope {s:?}: {e}"))?;
    Ok((uid, scope))
}

/// A group's id from its number or its name (/etc/group).
fn group_id(g: &str) -> anyhow::Result<u32> {
    if let Ok(n) = g.parse() {
        return Ok(n);
    }
    let groups = std::fs::read_to_string("/etc/group").unwrap_or_default();
    groups
        .lines()
        .find_map(|l| {
            let mut f = l.split(':');
            (f.next() == Some(g)).then(|| f.nth(1).and_then(|id| id.parse().ok()))?
        })
        .ok_or_else(|| anyhow::anyhow!("--local-socket-group {g}: no such group in /etc/group"))
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_ascii_lowercase())
        .unwrap_or_else(|_| "localhost".into())
}

pub fn parse_labels(s: &str) -> anyhow::Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("label {kv:?} is not KEY=VALUE"))?;
        locus_proto::names::check_label(k, v).map_err(|e| anyhow::anyhow!("{}", e.reason))?;
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

async fn serve(a: ServeArgs, cfg: &Resolved) -> anyhow::Result<()> {
    super::raise_open_file_limit();
    let id_s = a.id.unwrap_or_else(hostname);
    let id = locus_proto::NodeId::try_from(id_s.as_str())
        .map_err(|e| anyhow::anyhow!("node id {id_s:?}: {} (use --id)", e.reason))?;
    let mut labels = parse_labels(&a.labels)?;
    labels.entry("host".into()).or_insert_with(hostname);
    let listen = a
        .listen
        .parse()
        .with_context(|| format!("--listen {:?} is not an address such as 127.0.0.1:7500", a.listen))?;
    let tls = a.tls.load(None)?;
    // To peers and the metadata service the node presents its own certificate (mutual
    // TLS) unless --client-cert names another.
    cfg.init_client_tls(
        a.tls.tls_cert.as_deref().zip(a.tls.tls_key.as_deref()),
        a.tls.tls_client_ca.as_deref(),
    )?;
    let mut metadata =
        locus_proto::client::ClientOptions::new(&cfg.metadata_url).with_token(cfg.token.clone());
    if let Some(ca) = &cfg.ca_cert {
        metadata.ca_cert_pem =
            Some(std::fs::read(ca).with_context(|| format!("cannot read {}", ca.display()))?);
    }
    let http_listen = match a.http_listen.as_str() {
        "off" => None,
        s => Some(
            s.parse()
                .with_context(|| format!("--http-listen {s:?} is not an address such as 127.0.0.1:7501"))?,
        ),
    };
    let local_socket_gid = a.local_socket_group.as_deref().map(group_id).transpose()?;
    // Whoever may use the local socket may read the blob files it hands out; no one else.
    let readers_gid = a
        .local_socket
        .as_ref()
        .map(|_| local_socket_gid.unwrap_or_else(|| nix::unistd::getegid().as_raw()));
    let socket_scopes = a
        .socket_scope
        .iter()
        .map(|s| socket_scope(s))
        .collect::<anyhow::Result<std::collections::HashMap<_, _>>>()?;
    let config = locus_cache_node::NodeConfig {
        id,
        metadata,
        listen,
        http_listen,
        advertise: a.advertise,
        local_socket: a.local_socket.map(crate::absolute),
        local_socket_gid,
        store: locus_cache_node::store::StoreConfig {
            dirs: a.data_dir.into_iter().map(crate::absolute).collect(),
            capacity: size_arg("--capacity", &a.capacity)?,
            reserve: size_arg("--reserve", &a.reserve)?,
            readers_gid,
        },
        labels,
        heartbeat_interval: duration_arg("--heartbeat-interval", &a.heartbeat_interval)?,
        pin_sync_interval: duration_arg("--pin-sync-interval", &a.pin_sync_interval)?,
        // Zero is meaningful here: one clock (every process on one host).
        write_pin_grace: locus_proto::human::parse_duration(&a.write_pin_grace)
            .map_err(|e| anyhow::anyhow!("--write-pin-grace: {}", e.reason))?,
        scrub_rate: size_arg("--scrub-rate", &a.scrub_rate)?,
        addr_file: a.addr_file,
        require_grants: {
            if let Some(p) = &a.tokens_file {
                locus_proto::auth::TokenSet::load(p)?;
            }
            a.tokens_file.is_some() || cfg.token.is_some()
        },
        insecure: cfg.insecure,
        tls,
        peer_idle: duration_arg("--peer-timeout", &a.peer_timeout)?,
        refill_parallel: match a.refill_parallel {
            0 => anyhow::bail!("--refill-parallel must be at least 1"),
            n => n.min(256),
        },
        refill_rate: size_arg("--refill-rate", &a.refill_rate)?,
        origin_roots: a.origin_root.into_iter().map(crate::absolute).collect(),
        socket_scopes,
    };
    locus_cache_node::serve(config, super::shutdown_signal()).await?;
    Ok(())
}

async fn drain(cfg: &Resolved, node: &str, drain: bool) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let r = c
        .drain_node(pb::DrainNodeRequest {
            id: node.to_string(),
            drain,
        })
        .await
        .or_status()?;
    if cfg.json {
        return output::json(
            &serde_json::json!({"node": node, "draining": drain, "shards_remaining": r.shards_remaining}),
        );
    }
    if drain {
        println!(
            "{node} is draining: {} shard replica(s) will move to other nodes; `locus node list` shows progress",
            r.shards_remaining
        );
    } else {
        println!("{node} is back in service");
    }
    Ok(())
}

async fn rm(cfg: &Resolved, node: &str) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let r = c
        .remove_node(pb::RemoveNodeRequest { id: node.to_string() })
        .await
        .or_status()?;
    if cfg.json {
        return output::json(
            &serde_json::json!({"node": node, "removed": true, "shards_released": r.shards_released}),
        );
    }
    println!(
        "{node} removed: dropped from {} shard replica list(s); repair keeps them at their replication",
        r.shards_released
    );
    Ok(())
}

pub fn state_of(n: &pb::Node) -> &'static str {
    match (state_name(n.state), n.draining, n.refill_blobs > 0) {
        // Counted up for a grace period after the service started, but not heard from
        // since: it may be gone (and takes no new replica until it is heard).
        ("up", _, _) if n.unheard => "unheard",
        ("up", true, _) => "draining",
        ("up", false, true) => "refilling",
        (s, _, _) => s,
    }
}

/// "1.2 GiB to go at 210 MiB/s, ~6s" for a refilling node; None otherwise.
pub fn refill_summary(n: &pb::Node) -> Option<String> {
    if n.refill_blobs == 0 {
        return None;
    }
    let mut s = format!(
        "{} in {} blob(s) to go",
        output::size(n.refill_bytes),
        n.refill_blobs
    );
    if n.refill_rate > 0 {
        s.push_str(&format!(
            " at {}/s, ~{}s",
            output::size(n.refill_rate),
            n.refill_bytes.div_ceil(n.refill_rate)
        ));
    }
    if n.refill_failing > 0 {
        s.push_str(&format!(", {} failing (retrying)", n.refill_failing));
    }
    Some(s)
}

pub fn state_name(state: i32) -> &'static str {
    match pb::NodeState::try_from(state) {
        Ok(pb::NodeState::Up) => "up",
        Ok(pb::NodeState::Down) => "down",
        _ => "unknown",
    }
}

pub fn node_json(n: &pb::Node) -> serde_json::Value {
    serde_json::json!({
        "id": n.id,
        "address": n.address,
        "state": if n.unheard { "unheard" } else { state_name(n.state) },
        "draining": n.draining,
        "labels": n.labels,
        "capacity_bytes": n.capacity_bytes,
        "used_bytes": n.used_bytes,
        "free_bytes": n.free_bytes,
        "pinned_bytes": n.pinned_bytes,
        "cached_bytes": n.cached_bytes,
        "blobs": n.blobs,
        "quarantined": n.quarantined,
        "refill": {
            "blobs": n.refill_blobs,
            "bytes": n.refill_bytes,
            "rate_bytes_per_second": n.refill_rate,
            "failing": n.refill_failing,
            "eta_seconds": (n.refill_rate > 0).then(|| n.refill_bytes.div_ceil(n.refill_rate)),
        },
        "last_seen_ms_ago": n.last_seen_ms_ago,
        "heard_since_restart": !n.unheard,
        "registered_at": output::time(n.registered_at_ms),
    })
}

async fn list(cfg: &Resolved) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let mut nodes = c.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
    nodes.sort_by(|a, b| a.id.cmp(&b.id));
    if cfg.json {
        return output::json(&nodes.iter().map(node_json).collect::<Vec<_>>());
    }
    let label = |n: &pb::Node, k: &str| n.labels.get(k).cloned().unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            vec![
                n.id.clone(),
                state_of(n).into(),
                n.address.clone(),
                label(n, "zone"),
                label(n, "rack"),
                label(n, "host"),
                output::size(n.capacity_bytes),
                output::size(n.used_bytes),
                output::size(n.pinned_bytes),
                output::size(n.cached_bytes),
                output::size(n.free_bytes),
                if n.unheard {
                    "not since restart".into()
                } else {
                    format!("{:.1}s ago", n.last_seen_ms_ago as f64 / 1000.0)
                },
            ]
        })
        .collect();
    output::table(
        &[
            "NODE", "STATE", "ADDRESS", "ZONE", "RACK", "HOST", "CAPACITY", "USED", "PINNED", "CACHED",
            "FREE", "SEEN",
        ],
        &rows,
    );
    for n in &nodes {
        if let Some(r) = refill_summary(n) {
            println!("{}: refilling, {r}", n.id);
        }
    }
    Ok(())
}
