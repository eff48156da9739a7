//! TLS on every TCP hop: the server side of the gRPC and HTTP ports of both daemons, and
//! the client side every process uses to reach the metadata service and the nodes.
//!
//! A cluster has one CA. Each daemon serves with a certificate it signed; with
//! `--tls-client-ca` it also demands a client certificate signed by that CA (mutual TLS),
//! so a stolen token alone no longer reaches the API from a machine without a
//! certificate. A node serving TLS registers its address as `https://HOST:PORT`, which is
//! how every caller knows to speak TLS to it; a plain node registers `HOST:PORT`.
//!
//! The client side is one setting per process ([`set_client`]), not a parameter of every
//! connect: a node dials peers, the metadata service and object stores from a dozen
//! places, and each must present the same certificate and trust the same CA. Bearer
//! tokens are refused over plaintext to any address that is not loopback unless the
//! process was told `--insecure` ([`check_plaintext`]): a token sent in clear across a
//! network is a token given away.

use std::path::Path;
use std::sync::OnceLock;

/// The TLS library, for crates that serve over it (the node's bulk path).
pub use tokio_rustls::rustls;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// How this process connects as a client.
#[derive(Clone, Default)]
pub struct ClientTls {
    /// The cluster CA (PEM): what `https://` servers' certificates must chain to.
    pub ca_pem: Option<Vec<u8>>,
    /// Certificate chain and key (PEM) presented to servers that ask (mutual TLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Bearer tokens may cross plaintext to non-loopback addresses.
    pub insecure: bool,
}

static CLIENT: OnceLock<ClientTls> = OnceLock::new();

/// aws-lc-rs with AES-128-GCM preferred over AES-256-GCM (rustls' default order puts
/// 256 first). Bulk data is what TLS costs Locus: every blob byte is encrypted by one end
/// and decrypted by the other, and AES-128 does that with 10 rounds instead of 14, at a
/// security margin no one questions for session keys. Installed as the process default
/// (`install_provider`) so tonic's own TLS configs use it too.
pub fn provider() -> tokio_rustls::rustls::crypto::CryptoProvider {
    use tokio_rustls::rustls::crypto::aws_lc_rs;
    use tokio_rustls::rustls::CipherSuite;
    let mut p = aws_lc_rs::default_provider();
    let rank = |s: CipherSuite| match s {
        CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    };
    // Stable: the TLS 1.2 suites keep their order after the TLS 1.3 ones.
    p.cipher_suites.sort_by_key(|s| rank(s.suite()));
    p
}

/// Makes [`provider`] this process's default, before any TLS is set up. Idempotent.
pub fn install_provider() {
    let _ = provider().install_default();
}

/// Sets this process's client TLS, once, before the first connection. A second call is
/// ignored (the first setting wins), so a library cannot change it under a running client.
pub fn set_client(c: ClientTls) {
    let _ = CLIENT.set(c);
}

/// This process's client TLS (empty until set).
pub fn client() -> &'static ClientTls {
    static EMPTY: OnceLock<ClientTls> = OnceLock::new();
    CLIENT
        .get()
        .unwrap_or_else(|| EMPTY.get_or_init(ClientTls::default))
}

/// The tonic client config for an `https://` endpoint: the given CA, else the process's,
/// and the process's client certificate when it has one.
pub fn client_config(ca_pem: Option<&[u8]>) -> Result<ClientTlsConfig, crate::client::ClientError> {
    let c = client();
    let ca = ca_pem
        .or(c.ca_pem.as_deref())
        .ok_or(crate::client::ClientError::MissingCa)?;
    let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    if let Some((cert, key)) = &c.identity {
        cfg = cfg.identity(Identity::from_pem(cert, key));
    }
    Ok(cfg)
}

/// Refuses to send a bearer token over plaintext (`http://` or a bare `HOST:PORT`) to a
/// host that is not loopback, unless this process was told `--insecure`.
pub fn check_plaintext(url: &str, has_token: bool) -> Result<(), crate::client::ClientError> {
    if !has_token || client().insecure || url.starts_with("https://") {
        return Ok(());
    }
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => h,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        return Ok(());
    }
    Err(crate::client::ClientError::PlaintextToken(url.to_string()))
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_pem_bytes", &self.ca_pem.as_ref().map(|p| p.len()))
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<certificate and redacted key>"),
            )
            .field("insecure", &self.insecure)
            .finish()
    }
}

/// A daemon's TLS: its certificate and key, and the CA client certificates must chain to
/// when mutual TLS is on.
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The private key never: Debug output ends up in logs.
        f.debug_struct("ServerTls")
            .field("cert_pem_bytes", &self.cert_pem.len())
            .field("key_pem", &"<redacted>")
            .field("mutual", &self.client_ca_pem.is_some())
            .finish()
    }
}

impl ServerTls {
    /// Reads the PEM files; the error names the file.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let s = ServerTls {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
            client_ca_pem: client_ca.map(read).transpose()?,
        };
        // Parse now, so a wrong file is reported at start and by name, not at the first
        // handshake.
        s.rustls()
            .map_err(|e| format!("{} / {}: {e}", cert.display(), key.display()))?;
        Ok(s)
    }

    /// When the serving certificate (the first in its file) expires, Unix seconds.
    pub fn not_after(&self) -> Option<i64> {
        certificates_not_after(&self.cert_pem).ok()?.first().copied()
    }

    /// For the gRPC ports.
    pub fn tonic(&self) -> ServerTlsConfig {
        let mut c = ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem));
        if let Some(ca) = &self.client_ca_pem {
            c = c.client_ca_root(Certificate::from_pem(ca));
        }
        c
    }

    /// For the HTTP ports (schedulers, Prometheus). These never ask for a client
    /// certificate: kube-scheduler's extender client and most scrapers cannot present
    /// one, and what they reach is read-only and bounded.
    pub fn http_acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, String> {
        let mut cfg = self.rustls()?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)))
    }

    /// For the bulk path's TLS connections (`crate::bulk`): the node's certificate, and
    /// with mutual TLS on, a client certificate of the cluster CA demanded as on gRPC, so
    /// the bulk path is no way around it.
    pub fn bulk_config(&self) -> Result<std::sync::Arc<tokio_rustls::rustls::ServerConfig>, String> {
        use tokio_rustls::rustls;
        let Some(ca) = &self.client_ca_pem else {
            return self.rustls().map(std::sync::Arc::new);
        };
        let provider = std::sync::Arc::new(provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            std::sync::Arc::new(roots(ca)?),
            provider.clone(),
        )
        .build()
        .map_err(|e| format!("client CA: {e}"))?;
        let (certs, key) = chain_and_key(&self.cert_pem, &self.key_pem)?;
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map(std::sync::Arc::new)
            .map_err(|e| e.to_string())
    }

    fn rustls(&self) -> Result<tokio_rustls::rustls::ServerConfig, String> {
        use tokio_rustls::rustls;
        let (certs, key) = chain_and_key(&self.cert_pem, &self.key_pem)?;
        let provider = std::sync::Arc::new(provider());
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| e.to_string())
    }
}

type ChainAndKey = (
    Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
    tokio_rustls::rustls::pki_types::PrivateKeyDer<'static>,
);

/// A certificate chain and its key, from PEM.
fn chain_and_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<ChainAndKey, String> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    if certs.is_empty() {
        return Err("no certificate in the certificate file".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("key: {e}"))?;
    Ok((certs, key))
}

/// The certificates of a CA file (PEM) as trust roots.
fn roots(ca_pem: &[u8]) -> Result<tokio_rustls::rustls::RootCertStore, String> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(c.map_err(|e| format!("CA: {e}"))?)
            .map_err(|e| format!("CA: {e}"))?;
    }
    if roots.is_empty() {
        return Err("no certificate in the CA file".into());
    }
    Ok(roots)
}

/// The client side of the bulk path's TLS, from this process's client TLS
/// ([`client`]): its CA, and its certificate when it has one. None without a CA: an
/// `https://` node is then asked over gRPC, whose error says what is missing.
pub fn bulk_client_config() -> Result<Option<std::sync::Arc<tokio_rustls::rustls::ClientConfig>>, String> {
    use tokio_rustls::rustls;
    let c = client();
    let Some(ca) = &c.ca_pem else {
        return Ok(None);
    };
    let b = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca)?);
    let cfg = match &c.identity {
        Some((cert, key)) => {
            let (certs, key) = chain_and_key(cert, key)?;
            b.with_client_auth_cert(certs, key).map_err(|e| e.to_string())?
        }
        None => b.with_no_client_auth(),
    };
    Ok(Some(std::sync::Arc::new(cfg)))
}

/// When each certificate in a PEM file stops being valid (its notAfter), as Unix
/// seconds, in file order: for `locus doctor`, which warns before a daemon's or a
/// client's certificate runs out.
pub fn certificates_not_after(pem: &[u8]) -> Result<Vec<i64>, String> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no certificate in it".into());
    }
    certs
        .iter()
        .map(|c| not_after(c.as_ref()).ok_or_else(|| "not an X.509 certificate".to_string()))
        .collect()
}

/// One DER element at the start of `b`: (tag, contents, the rest).
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&l0, mut b) = b.split_first()?;
    let len = if l0 < 0x80 {
        l0 as usize
    } else {
        let n = (l0 & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, &x| (a << 8) | x as usize);
        b = &b[n..];
        len
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

/// Certificate → tbsCertificate → validity → notAfter (RFC 5280 4.1).
fn not_after(cert: &[u8]) -> Option<i64> {
    let (0x30, c, _) = der(cert)? else { return None };
    let (0x30, mut tbs, _) = der(c)? else { return None };
    // [0] version (optional), serial, signature algorithm, issuer, then validity.
    if tbs.first() == Some(&0xa0) {
        tbs = der(tbs)?.2;
    }
    for _ in 0..3 {
        tbs = der(tbs)?.2;
    }
    let (0x30, validity, _) = der(tbs)? else {
        return None;
    };
    let (_, _, rest) = der(validity)?;
    let (tag, t, _) = der(rest)?;
    let t = std::str::from_utf8(t).ok()?.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 if t.len() == 12 => {
            // UTCTime: two-digit years mean 1950–2049.
            let yy: i64 = t[..2].parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &t[2..])
        }
        0x18 if t.len() == 14 => (t[..4].parse().ok()?, &t[4..]),
        _ => return None,
    };
    let n = |i: usize| rest.get(i..i + 2)?.parse::<i64>().ok();
    let days = crate::human::days_from_civil(year, u32::try_from(n(0)?).ok()?, u32::try_from(n(2)?).ok()?)?;
    Some(days * 86_400 + n(4)? * 3600 + n(6)? * 60 + n(8)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 1 certificate made by OpenSSL 3.0 (`openssl x509 -req -signkey`, no
    /// extensions, so no version field): notAfter 2036-11-30 18:26:20 UTC.
    const FOREIGN_V1: &str = "-----BEGIN CERTIFICATE-----
MIIBLzCB1QIUMee2pPySPhgxDoAWOYBbocBBT8QwCgYIKoZIzj0EAwIwGjEYMBYG
A1UEAwwPZm9yZWlnbi5leGFtcGxlMB4XDTI2MTIwMzE4MjYyMFoXDTM2MTEzMDE4
MjYyMFowGjEYMBYGA1UEAwwPZm9yZWlnbi5leGFtcGxlMFkwEwYHKoZIzj0CAQYI
KoZIzj0DAQcDQgAEWjXtj47fl4iouKmZNH83yJQA6uyAOCXG1VVSk0opegWfKvLc
K+QYEf9+zBEhtazShf1X0dtjKz7XbOFvrGAd3DAKBggqhkjOPQQDAgNJADBGAiEA
wrteUrJxpgvMI+4Gy03N3w6MXZXIviKoeFR8h33Rci4CIQDSZH+CCOyvGiVwEeT0
FF8/c35+Ql1F+85BauOVu+4jfQ==
-----END CERTIFICATE-----
";

    /// A self-signed certificate whose notAfter is midnight UTC of the given day.
    fn ending(y: i32, m: u8, d: u8) -> String {
        let mut p = rcgen::CertificateParams::new(vec!["x.example".into()]).unwrap();
        p.not_before = rcgen::date_time_ymd(2000, 1, 1);
        p.not_after = rcgen::date_time_ymd(y, m, d);
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn certificate_expiry_is_read_from_utc_and_generalized_times_and_from_foreign_certificates() {
        // RFC 5280 4.1.2.5: UTCTime through 2049, GeneralizedTime from 2050.
        assert_eq!(
            certificates_not_after(ending(2030, 6, 7).as_bytes()).unwrap(),
            vec![1_907_020_800]
        );
        assert_eq!(
            certificates_not_after(ending(2051, 1, 2).as_bytes()).unwrap(),
            vec![2_556_230_400]
        );
        // An expired certificate reads as a time in the past, not as an error: the doctor
        // must say "expired", not "unreadable".
        assert_eq!(
            certificates_not_after(ending(2001, 2, 3).as_bytes()).unwrap(),
            vec![981_158_400]
        );
        // A certificate with no version field, not made by `locus tls`, in a chain file
        // with another: both read, in file order.
        let chain = format!("{FOREIGN_V1}{}", ending(2030, 6, 7));
        assert_eq!(
            certificates_not_after(chain.as_bytes()).unwrap(),
            vec![2_111_682_380, 1_907_020_800]
        );
        // Not a certificate, and no certificate at all.
        let junk = "-----BEGIN CERTIFICATE-----\nMAMCAQA=\n-----END CERTIFICATE-----\n";
        assert!(certificates_not_after(junk.as_bytes()).is_err());
        assert!(certificates_not_after(b"hello").is_err());
    }

    #[test]
    fn tokens_are_refused_over_plaintext_off_loopback_only() {
        for ok in [
            "http://127.0.0.1:7400",
            "127.0.0.1:7500",
            "http://localhost:7400",
            "http://[::1]:7400",
            "https://10.0.0.5:7400",
            "https://meta.example:7400",
        ] {
            assert!(check_plaintext(ok, true).is_ok(), "{ok}");
        }
        for bad in [
            "http://10.0.0.5:7400",
            "10.251.0.11:7500",
            "http://meta.example:7400",
        ] {
            let e = check_plaintext(bad, true).unwrap_err().to_string();
            assert!(e.contains("--insecure") && e.contains(bad), "{e}");
            // No token, nothing to give away.
            assert!(check_plaintext(bad, false).is_ok());
        }
    }
}
