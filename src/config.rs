//! Configuration: command-line flags, then `LOCUS_*` environment variables (clap reads
//! both, flags first), then the TOML config file, then built-in defaults.
//!
//! The config file is `--config`/`LOCUS_CONFIG`, else `~/.config/locus/locus.toml` or
//! `/etc/locus/locus.toml` when present. Example:
//!
//! ```toml
//! metadata = "https://meta.example:7400"
//! token = "..."               # the file must then be mode 0600
//! ca_cert = "/etc/locus/ca.pem"
//!
//! [metadata_server]
//! data_dir = "/var/lib/locus/metadata"
//! listen = "0.0.0.0:7400"
//! http_listen = "0.0.0.0:7401"
//! tokens_file = "/etc/locus/tokens.toml"
//! liveness_timeout = "30s"
//! session_timeout = "1h"
//!
//! [[metadata_server.team]]      # a quota: what team A's datasets may pin on nodes
//! name = "team-a"
//! datasets = ["a-*"]
//! pinned = "20TiB"
//! cache = "25%"                 # its readers' share of each node's cache room
//! ```

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::Deserialize;

pub const DEFAULT_METADATA_URL: &str = "http://127.0.0.1:7400";

/// Shown under their own heading in every command's `--help`, after the command's own.
#[derive(Args, Clone)]
#[command(next_help_heading = "Connection and output (every command)")]
pub struct GlobalArgs {
    /// Metadata service URL (http://HOST:PORT, or https:// with TLS).
    #[arg(long, global = true, env = "LOCUS_METADATA", value_name = "URL")]
    pub metadata: Option<String>,
    /// Refused: a secret on the command line is visible to every user in the process
    /// list. The token comes from LOCUS_TOKEN, --token-file or the config file.
    #[arg(long, global = true, hide = true, value_name = "TOKEN")]
    pub token: Option<String>,
    /// Read the bearer token from this file (the whole file, one line; mode 0600 or
    /// stricter): a Kubernetes Secret mounted as files (defaultMode: 0400), or a file only
    /// its service account can read. The environment's LOCUS_TOKEN is the other way.
    #[arg(long, global = true, env = "LOCUS_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The cluster CA (PEM; `locus tls ca`): the metadata service's and TLS nodes'
    /// certificates must chain to it.
    #[arg(long, global = true, env = "LOCUS_CA_CERT", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
    /// Client certificate (PEM) presented to servers that demand one (mutual TLS); needs
    /// --client-key. Daemons present their own --tls-cert unless this is given.
    #[arg(
        long,
        global = true,
        env = "LOCUS_CLIENT_CERT",
        value_name = "FILE",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,
    /// Key of --client-cert (PEM).
    #[arg(
        long,
        global = true,
        env = "LOCUS_CLIENT_KEY",
        value_name = "FILE",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,
    /// Accept what a trusted network makes safe: send tokens over plaintext to
    /// non-loopback addresses, and (daemons) serve without tokens on them.
    #[arg(long, global = true, env = "LOCUS_INSECURE")]
    pub insecure: bool,
    /// Config file (TOML).
    #[arg(long, global = true, env = "LOCUS_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Log format of daemons: text or json.
    #[arg(long, global = true, env = "LOCUS_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<String>,
}

impl std::fmt::Debug for GlobalArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token: Debug output ends up in logs and panics.
        f.debug_struct("GlobalArgs")
            .field("metadata", &self.metadata)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_file", &self.token_file)
            .field("ca_cert", &self.ca_cert)
            .field("insecure", &self.insecure)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A secret read from a file named by a flag or variable: `what` names it in errors.
pub fn secret_file(what: &str, p: &Path) -> anyhow::Result<String> {
    locus_proto::keyfile::read_secret(p).map_err(|e| anyhow::anyhow!("{what} {}: {e}", p.display()))
}

/// A daemon's TLS, the same flags for the metadata service and the nodes.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Serving TLS")]
pub struct ServerTlsArgs {
    /// Certificate chain (PEM) this daemon serves gRPC and HTTP with, signed by the
    /// cluster CA (`locus tls cert`); needs --tls-key. A node with TLS registers its
    /// address as https://HOST:PORT, so callers know to use TLS.
    #[arg(long, env = "LOCUS_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "LOCUS_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: every gRPC caller must present a client certificate signed by this CA
    /// (usually the cluster CA). The HTTP port (schedulers, metrics) does not ask.
    #[arg(long, env = "LOCUS_TLS_CLIENT_CA", value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// Loads the files named, the config file's settings filling in what no flag gave.
    pub fn load(
        &self,
        file: Option<&MetadataServerFile>,
    ) -> anyhow::Result<Option<locus_proto::tls::ServerTls>> {
        let cert = self.tls_cert.clone().or(file.and_then(|f| f.tls_cert.clone()));
        let key = self.tls_key.clone().or(file.and_then(|f| f.tls_key.clone()));
        let ca = self
            .tls_client_ca
            .clone()
            .or(file.and_then(|f| f.tls_client_ca.clone()));
        match (cert, key) {
            (Some(c), Some(k)) => Ok(Some(
                locus_proto::tls::ServerTls::load(&c, &k, ca.as_deref())
                    .map_err(|e| anyhow::anyhow!("TLS: {e}"))?,
            )),
            (None, None) if ca.is_some() => bail!("--tls-client-ca needs --tls-cert and --tls-key"),
            (None, None) => Ok(None),
            _ => bail!("TLS needs both a certificate and a key"),
        }
    }
}

/// The TOML config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub metadata: Option<String>,
    pub token: Option<String>,
    pub ca_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub insecure: Option<bool>,
    pub log_format: Option<String>,
    #[serde(default)]
    pub metadata_server: MetadataServerFile,
    #[serde(default)]
    pub backup: BackupFile,
}

/// `[backup]`: what a nightly `locus backup run` (cron, systemd timer) uses when no flag
/// says otherwise. Object-store credentials are not read from here: they come from the
/// usual AWS_* environment (for systemd, an EnvironmentFile readable by root only).
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct BackupFile {
    /// The backup target URL (file:///dir or s3://bucket/prefix).
    pub to: Option<String>,
    pub keep_last: Option<u32>,
    pub keep_daily: Option<u32>,
    pub keep_weekly: Option<u32>,
    /// The Ed25519 key backup runs sign their snapshots with.
    pub signing_key: Option<PathBuf>,
    /// Public keys (hex, or files holding them) restore and verify trust.
    #[serde(default)]
    pub trusted_keys: Vec<String>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct MetadataServerFile {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub http_listen: Option<String>,
    pub tokens_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub insecure: Option<bool>,
    pub liveness_timeout: Option<String>,
    pub session_timeout: Option<String>,
    pub repair_interval: Option<String>,
    pub audit_log: Option<PathBuf>,
    /// Locality's price per GiB by source (see locus_metadata::locality for defaults):
    /// `[metadata_server.cost]` with same_host, same_rack, same_zone, other_zone,
    /// object_store.
    pub cost: Option<locus_metadata::locality::CostWeights>,
    /// Teams' quotas: `[[metadata_server.team]]` with name, datasets (patterns, `*` for
    /// any run of characters) and pinned (`10TiB`: the most bytes times replicas its
    /// datasets' versions may keep on nodes; an import over it is refused before it
    /// sends a byte), and optionally cache (`"25%"`: the share of each node's cache room
    /// — what replicas leave — that the team's cached bytes keep against other teams'
    /// reads; the shares add up to at most 100%).
    #[serde(default)]
    pub team: Vec<TeamFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamFile {
    pub name: String,
    pub datasets: Vec<String>,
    pub pinned: String,
    /// Share of every node's cache room (`"25%"`) its readers' cached bytes keep against
    /// other teams' reads; none by default.
    pub cache: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Settings after precedence has been applied.
#[derive(Clone)]
pub struct Resolved {
    pub metadata_url: String,
    pub token: Option<String>,
    pub ca_cert: Option<PathBuf>,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    pub insecure: bool,
    pub json: bool,
    pub log_format: LogFormat,
    pub server_file: MetadataServerFile,
    pub backup: BackupFile,
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("metadata_url", &self.metadata_url)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("ca_cert", &self.ca_cert)
            .field("insecure", &self.insecure)
            .finish_non_exhaustive()
    }
}

impl Resolved {
    pub fn load(args: &GlobalArgs) -> anyhow::Result<Self> {
        if args.token.is_some() {
            bail!(
                "--token is not accepted: a secret on the command line is visible to every user \
                 of this host in the process list. Put it in LOCUS_TOKEN, or in a file only you \
                 can read (chmod 600) given as --token-file"
            );
        }
        let file = match &args.config {
            Some(p) => read_config(p)?,
            None => match default_config_path() {
                Some(p) => read_config(&p)?,
                None => ConfigFile::default(),
            },
        };
        let log_format = match args.log_format.as_deref().or(file.log_format.as_deref()) {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => bail!("log format {other:?} is neither text nor json"),
        };
        let from_file = match &args.token_file {
            Some(p) => Some(secret_file("--token-file", p)?),
            None => None,
        };
        let from_env = std::env::var("LOCUS_TOKEN").ok().filter(|t| !t.trim().is_empty());
        if from_file.is_some() && from_env.is_some() {
            bail!("both LOCUS_TOKEN and --token-file (LOCUS_TOKEN_FILE) give a token; give one");
        }
        Ok(Resolved {
            metadata_url: args
                .metadata
                .clone()
                .or(file.metadata)
                .unwrap_or_else(|| DEFAULT_METADATA_URL.to_string()),
            token: from_file.or(from_env).or(file.token).filter(|t| !t.is_empty()),
            ca_cert: args.ca_cert.clone().or(file.ca_cert),
            client_cert: match (args.client_cert.clone(), args.client_key.clone()) {
                (Some(c), Some(k)) => Some((c, k)),
                _ => match (file.client_cert, file.client_key) {
                    (Some(c), Some(k)) => Some((c, k)),
                    (None, None) => None,
                    _ => bail!("client_cert and client_key go together in the config file"),
                },
            },
            insecure: args.insecure || file.insecure.unwrap_or(false),
            json: args.json,
            log_format,
            server_file: file.metadata_server,
            backup: file.backup,
        })
    }

    /// Sets this process's client TLS (`locus_proto::tls`): the cluster CA (else
    /// `own_ca`, the CA a daemon demands of its callers: in one cluster the same), the
    /// client certificate (else `own`, a daemon's serving certificate), and --insecure.
    /// Called once, before the first connection.
    pub fn init_client_tls(&self, own: Option<(&Path, &Path)>, own_ca: Option<&Path>) -> anyhow::Result<()> {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
        let identity = match (&self.client_cert, own) {
            (Some((c, k)), _) => Some((read(c)?, read(k)?)),
            (None, Some((c, k))) => Some((read(c)?, read(k)?)),
            (None, None) => None,
        };
        locus_proto::tls::set_client(locus_proto::tls::ClientTls {
            ca_pem: self.ca_cert.as_deref().or(own_ca).map(read).transpose()?,
            identity,
            insecure: self.insecure,
        });
        Ok(())
    }

    /// Connects to the metadata service with the resolved URL, token and CA.
    pub async fn connect(&self) -> anyhow::Result<locus_proto::client::MetadataClient> {
        let mut opts =
            locus_proto::client::ClientOptions::new(&self.metadata_url).with_token(self.token.clone());
        if let Some(ca) = &self.ca_cert {
            opts.ca_cert_pem = Some(
                std::fs::read(ca).with_context(|| format!("cannot read CA certificate {}", ca.display()))?,
            );
        }
        Ok(locus_proto::client::connect(&opts).await?)
    }
}

fn default_config_path() -> Option<PathBuf> {
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/locus/locus.toml"));
    [home, Some(PathBuf::from("/etc/locus/locus.toml"))]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

fn read_config(path: &Path) -> anyhow::Result<ConfigFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let file: ConfigFile = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("config file {}: {}", path.display(), e.message()))?;
    if file.token.is_some() {
        locus_proto::keyfile::check_private(path)
            .map_err(|e| anyhow::anyhow!("config file {} holds a token, but {e}", path.display()))?;
    }
    Ok(file)
}

/// Logs go to stderr. Daemons log at info, commands at warn, unless RUST_LOG says more.
pub fn init_logging(cfg: &Resolved, daemon: bool) {
    // openraft narrates every vote and append at info; its warnings are what an operator
    // needs (a member unreachable, an election lost).
    let default = if daemon { "info,openraft=warn" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal; log files and journald get plain text.
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Parses a size flag (`4MiB`, `2TB`), naming the flag in the error.
pub fn size_arg(what: &str, s: &str) -> anyhow::Result<u64> {
    locus_proto::human::parse_size(s).map_err(|e| anyhow::anyhow!("{what}: {}", e.reason))
}

/// Parses a positive duration flag (`30s`, `5m`), naming the flag in the error.
pub fn duration_arg(what: &str, s: &str) -> anyhow::Result<std::time::Duration> {
    let d = locus_proto::human::parse_duration(s).map_err(|e| anyhow::anyhow!("{what}: {}", e.reason))?;
    if d.is_zero() {
        bail!("{what} must be more than zero");
    }
    Ok(d)
}
