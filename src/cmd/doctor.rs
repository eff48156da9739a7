//! `locus doctor`: checks this host and the cluster and says what to fix.
//!
//! The checks are `locus::ops::doctor`'s; this command picks them from its arguments and
//! prints them. Cluster checks are skipped with `--local`. Any failure makes the exit
//! status non-zero, so the command can gate a node's start or a cron job's alert.

use std::path::PathBuf;

use anyhow::bail;
use clap::Args;
use locus::ops::doctor::{self, Verdict};

use crate::config::Resolved;
use crate::output;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The cache node's Unix socket on this host [default: /run/locus/node.sock if it
    /// exists].
    #[arg(long, value_name = "PATH")]
    pub node_socket: Option<PathBuf>,
    /// The cache node's data dirs (as given to `locus node serve`): filesystem and free
    /// space.
    #[arg(long, value_delimiter = ',', value_name = "DIR,...")]
    pub data_dir: Vec<PathBuf>,
    /// More PEM certificates to check for expiry (a daemon's --tls-cert); the CLI's
    /// --ca-cert and --client-cert are always checked.
    #[arg(long = "cert", value_delimiter = ',', value_name = "FILE,...")]
    pub certs: Vec<PathBuf>,
    /// A certificate expiring within this warns.
    #[arg(long, default_value = "14d")]
    pub cert_warn: String,
    /// The last committed backup older than this fails (nightly backups: 36 hours).
    #[arg(long, default_value = "36h")]
    pub backup_max_age: String,
    /// Check this host only; do not contact the metadata service.
    #[arg(long)]
    pub local: bool,
}
pub async fn run(a: DoctorArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let cert_warn = locus_proto::human::parse_duration(&a.cert_warn)
        .map_err(|e| anyhow::anyhow!("--cert-warn: {}", e.reason))?;
    let backup_max_age = locus_proto::human::parse_duration(&a.backup_max_age)
        .map_err(|e| anyhow::anyhow!("--backup-max-age: {}", e.reason))?;
    let mut checks = doctor::host();
    checks.extend(doctor::node_socket(a.node_socket.as_deref()).await);
    checks.extend(a.data_dir.iter().map(|d| doctor::data_dir(d)));
    let mut certs: Vec<PathBuf> = cfg.ca_cert.iter().cloned().collect();
    certs.extend(cfg.client_cert.iter().map(|(c, _)| c.clone()));
    certs.extend(a.certs.iter().cloned());
    checks.extend(certs.iter().map(|c| doctor::certificate(c, cert_warn)));
    if !a.local {
        checks.extend(doctor::cluster(&cfg.metadata_url, cfg.connect(), backup_max_age).await);
    }
    let worst = checks.iter().map(|c| c.verdict).max().unwrap_or(Verdict::Pass);
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    if cfg.json {
        output::json(&serde_json::json!({"verdict": worst, "checks": checks}))?;
    } else {
        for c in &checks {
            let v = match c.verdict {
                Verdict::Pass => "ok  ",
                Verdict::Warn => "WARN",
                Verdict::Fail => "FAIL",
            };
            println!("{v}  {:<22} {}", c.name, c.detail);
            if let Some(f) = &c.fix {
                println!("      {:<22} fix: {f}", "");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}
