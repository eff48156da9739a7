//! `locus metadata serve` and `locus metadata members`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::config::{duration_arg, Resolved};

#[derive(Subcommand, Debug)]
pub enum MetadataCmd {
    /// Run the metadata service until SIGTERM or SIGINT.
    ///
    /// Without --tokens-file every caller may do everything, so the service then only
    /// listens on loopback addresses unless --insecure is given.
    #[command(after_help = "\
Examples:
  # One service, tokens required
  locus metadata serve --data-dir /var/lib/locus/metadata --listen 0.0.0.0:7400 --tokens-file /etc/locus/tokens.toml
  # Member m1 of a group of three
  locus metadata serve --id m1 --cluster m1=10.0.0.1:7410,m2=10.0.0.2:7410,m3=10.0.0.3:7410 --data-dir /var/lib/locus/metadata")]
    Serve(Box<ServeArgs>),
    /// List or change the members of a replicated metadata group (admin).
    ///
    /// To grow a group: start the new member with --id NEW and --cluster listing the
    /// existing members and itself, `add-learner NEW HOST:PORT` (it catches up from a
    /// snapshot and the log), then `promote NEW` (it votes from then on).
    #[command(subcommand)]
    Members(MembersCmd),
    /// Read the service's audit log: who mounted which version from which host, what
    /// was imported, deleted, granted or refused, filtered by dataset, principal, action
    /// and age. Run on the service's host (the log is a file there).
    Audit(crate::cmd::audit::AuditArgs),
    /// List or rotate the keys grants are signed with (admin).
    ///
    /// A rotated key is published to every node at once (heartbeat answers carry the
    /// keys) and signs after --publish-delay; the old key keeps verifying until the
    /// grants it signed have expired (at most an hour). If a key may have leaked, rotate
    /// with --revoke: older keys stop verifying at once (clients get new grants).
    ///
    /// Example: locus metadata grant-keys rotate --publish-delay 2m
    #[command(subcommand)]
    GrantKeys(GrantKeysCmd),
}

#[derive(Subcommand, Debug)]
pub enum GrantKeysCmd {
    /// The keys, their state (signing, next, verifying) and when they sign from.
    #[command(after_help = "\
Examples:
  # The keys grants are signed and checked with
  locus metadata grant-keys list")]
    List,
    /// Makes a new key; see `grant-keys --help`.
    #[command(after_help = "\
Examples:
  # A new signing key, published to nodes a minute before it signs
  locus metadata grant-keys rotate
  # A key that leaked: every older key stops verifying at once
  locus metadata grant-keys rotate --revoke")]
    Rotate {
        /// How long the new key is published before it signs.
        #[arg(long, value_name = "DURATION", default_value = "60s")]
        publish_delay: String,
        /// Older keys stop verifying now (a key that leaked).
        #[arg(long)]
        revoke: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum MembersCmd {
    /// The members, their roles and the leader, as the member asked sees them.
    #[command(after_help = "\
Examples:
  # The group's members, their roles and the leader
  locus metadata members list")]
    List,
    /// Adds a member that receives the log but does not vote yet; answers once it has
    /// caught up.
    #[command(after_help = "\
Examples:
  # Add m4; it receives the log but does not vote yet
  locus metadata members add-learner m4 10.0.0.4:7410")]
    AddLearner {
        /// The new member's name (its --id).
        name: String,
        /// Its raft address (HOST:PORT), as in --cluster.
        raft_address: String,
    },
    /// Makes learners voters.
    #[command(after_help = "\
Examples:
  # Make m4 a voter once it has caught up
  locus metadata members promote m4")]
    Promote {
        /// The learners' names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Removes members (stop them first; the leader cannot remove itself).
    #[command(after_help = "\
Examples:
  # Take m2 out of the group
  locus metadata members remove m2")]
    Remove {
        /// The members' names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Directory for the RocksDB store and the audit log [default: ./locus-metadata].
    #[arg(long, env = "LOCUS_METADATA_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:7400].
    #[arg(long, env = "LOCUS_METADATA_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// HTTP address for /metrics and /healthz [default: 127.0.0.1:7401]; "off" disables.
    #[arg(long, env = "LOCUS_METADATA_HTTP_LISTEN", value_name = "ADDR")]
    pub http_listen: Option<String>,
    /// Connections the HTTP port serves at once (the scheduler extender and
    /// /v1/locality take no token); more wait in the kernel's backlog.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub http_max_connections: usize,
    /// An HTTP client must send a request's headers within this.
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    pub http_header_timeout: String,
    /// TOML file of [[token]] entries (name, role = admin|node|reader, token or blake3). A
    /// token is narrowed to some datasets by [[token.scope]] tables under it (datasets =
    /// ["team-a-*"], actions = ["read", "import", "delete", "warm"]; default: all its role
    /// may do): to it, every other dataset does not exist. See README "Teams".
    #[arg(long, env = "LOCUS_METADATA_TOKENS_FILE", value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// A node silent this long is down [default: 30s].
    #[arg(long, env = "LOCUS_LIVENESS_TIMEOUT", value_name = "DURATION")]
    pub liveness_timeout: Option<String>,
    /// An import session idle this long is discarded [default: 1h].
    #[arg(long, env = "LOCUS_SESSION_TIMEOUT", value_name = "DURATION")]
    pub session_timeout: Option<String>,
    /// How often under-replicated shards are looked for and repaired [default: 10s].
    #[arg(long, env = "LOCUS_REPAIR_INTERVAL", value_name = "DURATION")]
    pub repair_interval: Option<String>,
    /// Audit log file [default: DATA_DIR/audit.log].
    #[arg(long, env = "LOCUS_METADATA_AUDIT_LOG", value_name = "FILE")]
    pub audit_log: Option<PathBuf>,
    /// Write the bound addresses (grpc=…, http=…) to this file once listening; useful with
    /// port 0.
    #[arg(long, value_name = "FILE")]
    pub addr_file: Option<PathBuf>,
    /// This member's name in a replicated group (with --cluster).
    #[arg(long, env = "LOCUS_METADATA_ID", value_name = "NAME", requires = "cluster")]
    pub id: Option<String>,
    /// Run as a member of a replicated group: every member's name and raft address,
    /// NAME=HOST:PORT,... (the same list on every member; 3 or 5 members survive the loss
    /// of 1 or 2). Clients may then be given every member's gRPC URL, comma-separated.
    /// Without it the service runs alone.
    #[arg(long, env = "LOCUS_METADATA_CLUSTER", value_name = "MEMBERS", requires = "id")]
    pub cluster: Option<String>,
    /// File holding the group's member secret (mode 0600): a token of role "member" in
    /// the tokens file, the same on every member. Members present it on each other's raft
    /// ports, only after the other proved it holds it too; it opens nothing else. Or give
    /// it in LOCUS_METADATA_MEMBER_TOKEN.
    #[arg(long, env = "LOCUS_METADATA_MEMBER_TOKEN_FILE", value_name = "FILE")]
    pub member_token_file: Option<PathBuf>,
    /// A group member without a heartbeat from the leader for this long (randomised up
    /// to twice it) starts an election.
    #[arg(long, value_name = "DURATION", default_value = "500ms")]
    pub election_timeout: String,
    /// A group member snapshots its catalogue after this many log entries; a member that
    /// falls further behind (or is new, or was wiped) catches up from a snapshot.
    #[arg(long, value_name = "ENTRIES", default_value_t = 5000)]
    pub snapshot_every: u64,
    /// This member's data is gone (a replaced disk, a new machine) and it rejoins a
    /// running group: the leader sends it a snapshot and the log. Without it, a member
    /// with no data refuses to start while other members hold the group's log.
    #[arg(long, requires = "cluster")]
    pub join: bool,
    // Last: clap puts every option after a flattened group under its heading.
    #[command(flatten)]
    pub tls: crate::config::ServerTlsArgs,
}

pub async fn run(cmd: MetadataCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        MetadataCmd::Serve(a) => serve(*a, cfg).await,
        MetadataCmd::Members(m) => members(m, cfg).await,
        MetadataCmd::GrantKeys(k) => grant_keys(k, cfg).await,
        MetadataCmd::Audit(a) => crate::cmd::audit::run(a, cfg.json),
    }
}

async fn grant_keys(cmd: GrantKeysCmd, cfg: &Resolved) -> anyhow::Result<()> {
    use crate::output::StatusExt;
    use locus_proto::pb;
    let mut c = cfg.connect().await?;
    let req = match cmd {
        GrantKeysCmd::List => pb::GrantKeysRequest {
            op: "list".into(),
            ..Default::default()
        },
        GrantKeysCmd::Rotate {
            publish_delay,
            revoke,
        } => pb::GrantKeysRequest {
            op: "rotate".into(),
            publish_delay_ms: duration_arg("--publish-delay", &publish_delay)?.as_millis() as u64,
            revoke,
        },
    };
    let keys = c.grant_keys(req).await.or_status()?.keys;
    if cfg.json {
        return crate::output::json(&serde_json::json!(keys
            .iter()
            .map(|k| serde_json::json!({
                "public_key": locus_proto::hex::encode(&k.public_key),
                "state": k.state,
                "created_unix_ms": k.created_unix_ms,
                "signs_from_unix_ms": k.signs_from_unix_ms,
                "retired_unix_ms": k.retired_unix_ms,
            }))
            .collect::<Vec<_>>()));
    }
    println!("{:<66} {:<10} SIGNS FROM", "PUBLIC KEY", "STATE");
    for k in &keys {
        println!(
            "{:<66} {:<10} {}",
            locus_proto::hex::encode(&k.public_key),
            k.state,
            crate::output::time(k.signs_from_unix_ms as i64)
        );
    }
    Ok(())
}

async fn members(cmd: MembersCmd, cfg: &Resolved) -> anyhow::Result<()> {
    use crate::output::StatusExt;
    use locus_proto::pb;
    let mut c = cfg.connect().await?;
    let (req, json) = match cmd {
        MembersCmd::List => (None, cfg.json),
        MembersCmd::AddLearner { name, raft_address } => (
            Some(pb::ChangeMembersRequest {
                op: "add-learner".into(),
                names: vec![name],
                raft_address,
            }),
            cfg.json,
        ),
        MembersCmd::Promote { names } => (
            Some(pb::ChangeMembersRequest {
                op: "promote".into(),
                names,
                ..Default::default()
            }),
            cfg.json,
        ),
        MembersCmd::Remove { names } => (
            Some(pb::ChangeMembersRequest {
                op: "remove".into(),
                names,
                ..Default::default()
            }),
            cfg.json,
        ),
    };
    let info = match req {
        None => c
            .get_cluster_info(pb::GetClusterInfoRequest {})
            .await
            .or_status()?,
        Some(r) => c.change_members(r).await.or_status()?,
    };
    if info.members.is_empty() {
        anyhow::bail!(
            "the metadata service at {} runs alone, not as a group (start members with --id and --cluster)",
            cfg.metadata_url
        );
    }
    if json {
        return crate::output::json(&serde_json::json!({
            "leader": (!info.leader.is_empty()).then_some(&info.leader),
            "answered_by": info.member,
            "members": info.members.iter().map(|m| serde_json::json!({
                "name": m.name, "raft_address": m.raft_address, "role": m.role,
                "leader": m.name == info.leader,
            })).collect::<Vec<_>>(),
        }));
    }
    println!("{:<16} {:<24} {:<8} LEADER", "NAME", "RAFT ADDRESS", "ROLE");
    for m in &info.members {
        let l = if m.name == info.leader { "yes" } else { "" };
        println!("{:<16} {:<24} {:<8} {l}", m.name, m.raft_address, m.role);
    }
    if info.leader.is_empty() {
        println!("(no leader right now: is a majority of the members running?)");
    }
    Ok(())
}

/// The member secret: from its file, else LOCUS_METADATA_MEMBER_TOKEN (never a flag).
fn member_secret(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let env = std::env::var("LOCUS_METADATA_MEMBER_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty());
    match (file, env) {
        (Some(_), Some(_)) => anyhow::bail!(
            "both --member-token-file and LOCUS_METADATA_MEMBER_TOKEN give the member secret; give one"
        ),
        (Some(p), None) => Ok(Some(crate::config::secret_file("--member-token-file", p)?)),
        (None, env) => Ok(env),
    }
}

fn addr(what: &str, s: &str) -> anyhow::Result<SocketAddr> {
    s.parse()
        .with_context(|| format!("{what} {s:?} is not an address such as 127.0.0.1:7400"))
}

fn flag_duration(what: &str, v: Option<String>, default: &str) -> anyhow::Result<std::time::Duration> {
    duration_arg(what, v.as_deref().unwrap_or(default))
}

async fn serve(a: ServeArgs, cfg: &Resolved) -> anyhow::Result<()> {
    super::raise_open_file_limit();
    let f = cfg.server_file.clone();
    let tls = a.tls.load(Some(&f))?;
    // As a client (the repair loop ordering nodes to copy), the service presents its own
    // certificate to nodes that demand one.
    let own = tls.as_ref().and(a.tls.tls_cert.clone().or(f.tls_cert.clone()));
    let own_key = a.tls.tls_key.clone().or(f.tls_key.clone());
    let own_ca = a.tls.tls_client_ca.clone().or(f.tls_client_ca.clone());
    cfg.init_client_tls(own.as_deref().zip(own_key.as_deref()), own_ca.as_deref())?;
    let data_dir = crate::absolute(
        a.data_dir
            .or(f.data_dir)
            .unwrap_or_else(|| PathBuf::from("locus-metadata")),
    );
    let listen = addr(
        "--listen",
        &a.listen
            .or(f.listen.clone())
            .unwrap_or_else(|| "127.0.0.1:7400".into()),
    )?;
    let http_listen = match a.http_listen.or(f.http_listen.clone()).as_deref() {
        Some("off") => None,
        Some(s) => Some(addr("--http-listen", s)?),
        None => Some(addr("--http-listen", "127.0.0.1:7401")?),
    };
    let config = locus_metadata::ServerConfig {
        data_dir,
        listen,
        http_listen,
        tokens_file: a.tokens_file.or(f.tokens_file),
        http_limits: locus_proto::net::HttpLimits {
            max_connections: a.http_max_connections,
            header_timeout: flag_duration("--http-header-timeout", Some(a.http_header_timeout), "10s")?,
        },
        tls,
        insecure: cfg.insecure || f.insecure.unwrap_or(false),
        catalog: locus_metadata::CatalogConfig {
            liveness_timeout: flag_duration(
                "--liveness-timeout",
                a.liveness_timeout.or(f.liveness_timeout),
                "30s",
            )?,
            session_timeout: flag_duration(
                "--session-timeout",
                a.session_timeout.or(f.session_timeout),
                "1h",
            )?,
            repair_interval: flag_duration(
                "--repair-interval",
                a.repair_interval.or(f.repair_interval),
                "10s",
            )?,
            cost: {
                let c = f.cost.unwrap_or_default();
                c.check()
                    .map_err(|e| anyhow::anyhow!("[metadata_server.cost]: {e}"))?;
                c
            },
            teams: f
                .team
                .iter()
                .map(|t| {
                    let limit = crate::config::size_arg(&format!("team {}: pinned", t.name), &t.pinned)?;
                    let cache = match &t.cache {
                        Some(c) => locus_metadata::quota::parse_share(c).map_err(|e| {
                            anyhow::anyhow!("[[metadata_server.team]] {}: cache: {e}", t.name)
                        })?,
                        None => 0,
                    };
                    locus_metadata::quota::Team::new(&t.name, t.datasets.clone(), limit)
                        .map(|team| team.with_cache_share(cache))
                        .map_err(|e| anyhow::anyhow!("[[metadata_server.team]]: {e}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()
                .and_then(|teams| {
                    let total: u32 = teams.iter().map(|t| t.cache_permille).sum();
                    anyhow::ensure!(
                        total <= 1000,
                        "[[metadata_server.team]]: the teams' cache shares add up to {}%; at most 100%",
                        f64::from(total) / 10.0
                    );
                    Ok(teams)
                })?,
        },
        addr_file: a.addr_file,
        audit_log: a.audit_log.or(f.audit_log),
        group: match (a.id, a.cluster) {
            (Some(me), Some(cluster)) => Some(locus_metadata::group::GroupConfig {
                me,
                members: locus_metadata::group::parse_cluster(&cluster)
                    .map_err(|e| anyhow::anyhow!("--cluster: {e}"))?,
                raft_listen: None,
                token: member_secret(a.member_token_file.as_deref())?,
                insecure: false,
                election_timeout: flag_duration("--election-timeout", Some(a.election_timeout), "500ms")?,
                snapshot_every: a.snapshot_every,
                join: a.join,
                // Set by the service from its own TLS.
                tls: false,
            }),
            _ => None,
        },
    };
    locus_metadata::serve(config, super::shutdown_signal()).await?;
    Ok(())
}
