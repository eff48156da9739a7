//! `locus tls …`: the cluster CA and the certificates its daemons serve with.
//!
//! One CA per cluster signs every daemon's certificate; clients trust that CA alone
//! (`--ca-cert`). A certificate is good for serving and as a client certificate (mutual
//! TLS), so a node uses one for both. Keys are ECDSA P-256, written mode 0600, and never
//! overwritten: a key in use replaced by accident would take a host off the cluster.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Subcommand;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

#[derive(Subcommand, Debug)]
pub enum TlsCmd {
    /// Create the cluster CA: DIR/ca.pem (give it to every host) and DIR/ca.key (keep it
    /// offline; it signs certificates only).
    #[command(after_help = "\
Examples:
  # The cluster CA, once
  locus tls ca --dir /etc/locus/ca")]
    Ca {
        /// Directory to write ca.pem and ca.key into (created if missing).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// Issue a certificate for a host's daemon, signed by the CA: OUT/NAME.pem and
    /// OUT/NAME.key, for --tls-cert/--tls-key (and as a client certificate).
    #[command(after_help = "\
Examples:
  # The metadata service's certificate, for its names and address
  locus tls cert --ca-dir /etc/locus/ca --name meta --host meta.example,10.0.0.5
  # A node's
  locus tls cert --ca-dir /etc/locus/ca --name gpu-01 --host gpu-01.example --out /etc/locus/gpu-01")]
    Cert {
        /// Directory holding ca.pem and ca.key.
        #[arg(long, value_name = "DIR")]
        ca_dir: PathBuf,
        /// Name of the certificate (its common name and file names), e.g. the node id.
        #[arg(long)]
        name: String,
        /// Host names and IP addresses clients use to reach it, comma-separated: every
        /// address a node advertises or the metadata URL names must be one of them.
        #[arg(long, value_name = "HOST[,HOST...]", value_delimiter = ',', required = true)]
        host: Vec<String>,
        /// Directory to write into [default: --ca-dir].
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Validity in days.
        #[arg(long, default_value_t = 397)]
        days: u32,
    },
}

pub fn run(cmd: TlsCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        TlsCmd::Ca { dir, days } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
            let key = KeyPair::generate().context("cannot generate a key")?;
            let mut p = ca_params();
            validity(&mut p, days)?;
            let cert = p.self_signed(&key).context("cannot make the CA certificate")?;
            let (cp, kp) = (dir.join("ca.pem"), dir.join("ca.key"));
            neither_exists(&cp, &kp)?;
            write_new(&kp, key.serialize_pem().as_bytes(), 0o600)?;
            write_new(&cp, cert.pem().as_bytes(), 0o644)?;
            report(json, &cp, &kp)
        }
        TlsCmd::Cert {
            ca_dir,
            name,
            host,
            out,
            days,
        } => {
            check_name(&name)?;
            let ca_key_pem = std::fs::read_to_string(ca_dir.join("ca.key"))
                .with_context(|| format!("cannot read the CA key {}", ca_dir.join("ca.key").display()))?;
            let ca_key = KeyPair::from_pem(&ca_key_pem).context("ca.key is not a PEM private key")?;
            if !ca_dir.join("ca.pem").is_file() {
                bail!(
                    "{} is missing: is {} a CA made by `locus tls ca`?",
                    ca_dir.join("ca.pem").display(),
                    ca_dir.display()
                );
            }
            // The issuer is the CA's name and key; ca.pem was made from the same fixed
            // name, so what this signs chains to it.
            let issuer = Issuer::new(ca_params(), ca_key);
            let mut p = CertificateParams::default();
            p.distinguished_name.push(DnType::CommonName, name.as_str());
            for h in &host {
                let h = h.trim();
                if h.is_empty() {
                    continue;
                }
                p.subject_alt_names.push(match h.parse::<std::net::IpAddr>() {
                    Ok(ip) => SanType::IpAddress(ip),
                    Err(_) => SanType::DnsName(h.to_string().try_into().map_err(|_| {
                        anyhow::anyhow!("--host {h:?} is neither an IP address nor a DNS name")
                    })?),
                });
            }
            if p.subject_alt_names.is_empty() {
                bail!("--host names no host");
            }
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            p.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            p.use_authority_key_identifier_extension = true;
            validity(&mut p, days)?;
            let key = KeyPair::generate().context("cannot generate a key")?;
            let cert = p
                .signed_by(&key, &issuer)
                .context("cannot sign the certificate")?;
            let out = out.unwrap_or(ca_dir);
            std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
            let (cp, kp) = (out.join(format!("{name}.pem")), out.join(format!("{name}.key")));
            neither_exists(&cp, &kp)?;
            write_new(&kp, key.serialize_pem().as_bytes(), 0o600)?;
            write_new(&cp, cert.pem().as_bytes(), 0o644)?;
            report(json, &cp, &kp)
        }
    }
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::OrganizationName, "Locus");
    p.distinguished_name.push(DnType::CommonName, "Locus cluster CA");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p
}

/// From an hour ago (clocks differ a little between hosts) for `days`.
fn validity(p: &mut CertificateParams, days: u32) -> anyhow::Result<()> {
    if days == 0 {
        bail!("--days must be at least 1");
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the clock is before 1970")?
        .as_secs() as i64;
    let at = |t: i64| rcgen::date_time_ymd(1970, 1, 1) + std::time::Duration::from_secs(t as u64);
    p.not_before = at(now - 3600);
    p.not_after = at(now + i64::from(days) * 86_400);
    Ok(())
}

fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if !ok {
        bail!("--name {name:?}: use 1–64 letters, digits, '-', '_' or '.' (it names files)");
    }
    Ok(())
}

/// Checked before either is written, so a refusal leaves no half pair behind.
fn neither_exists(a: &Path, b: &Path) -> anyhow::Result<()> {
    for p in [a, b] {
        if p.exists() {
            bail!("{} exists; not overwriting it (move it away first)", p.display());
        }
    }
    Ok(())
}

/// Writes a file that must not exist yet, with `mode`.
fn write_new(p: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(p)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                anyhow::anyhow!("{} exists; not overwriting it (move it away first)", p.display())
            }
            _ => anyhow::anyhow!("cannot create {}: {e}", p.display()),
        })?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("cannot write {}", p.display()))
}

fn report(json: bool, cert: &Path, key: &Path) -> anyhow::Result<()> {
    if json {
        return crate::output::json(&serde_json::json!({"cert": cert, "key": key}));
    }
    println!(
        "wrote {} and {} (the key mode 0600)",
        cert.display(),
        key.display()
    );
    Ok(())
}
