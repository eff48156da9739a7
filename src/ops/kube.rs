//! A reader of the Kubernetes API, as much as `locus webhook` needs to follow a pod's
//! PersistentVolumeClaims to the Locus volumes behind them: GET of one object, JSON, with
//! the pod's service-account token and the cluster CA (in-cluster), or any API URL given
//! (`kubectl proxy`). It never writes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

/// Where a pod finds its service account's credentials.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

pub struct KubeApi {
    base: String,
    /// Read at every call: kubelet rotates bound service-account tokens in place.
    token_file: Option<PathBuf>,
    http: reqwest::Client,
}

impl KubeApi {
    /// The API server at `base` (`https://host:port`, or `http://` for a local proxy),
    /// trusting `ca` (PEM) when given, with the bearer token in `token_file` when given.
    pub fn new(base: &str, token_file: Option<&Path>, ca: Option<&Path>) -> anyhow::Result<KubeApi> {
        let mut b = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5));
        if let Some(ca) = ca {
            let pem = std::fs::read(ca).map_err(|e| anyhow::anyhow!("{}: {e}", ca.display()))?;
            let cert =
                reqwest::Certificate::from_pem(&pem).map_err(|e| anyhow::anyhow!("{}: {e}", ca.display()))?;
            b = b.tls_certs_only([cert]);
        }
        Ok(KubeApi {
            base: base.trim_end_matches('/').to_string(),
            token_file: token_file.map(Path::to_path_buf),
            http: b.build()?,
        })
    }

    /// The API of the cluster this process runs in (its service account), if it runs in
    /// one.
    pub fn in_cluster() -> Option<anyhow::Result<KubeApi>> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let sa = Path::new(SERVICE_ACCOUNT);
        Some(KubeApi::new(
            &format!("https://{host}:{port}"),
            Some(&sa.join("token")),
            Some(&sa.join("ca.crt")),
        ))
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The object at `path` (`/api/v1/...`), or None when the API says it does not exist.
    pub async fn get(&self, path: &str) -> anyhow::Result<Option<Value>> {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(f) = &self.token_file {
            let token = std::fs::read_to_string(f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
            req = req.bearer_auth(token.trim());
        }
        let resp = req
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("the Kubernetes API at {}: {e}", self.base))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let body = resp.bytes().await?;
        if !status.is_success() {
            anyhow::bail!(
                "the Kubernetes API answered {status} for {path}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
            );
        }
        Ok(Some(
            serde_json::from_slice(&body).map_err(|e| anyhow::anyhow!("{path}: not JSON: {e}"))?,
        ))
    }
}

/// Whether `s` is a Kubernetes object name (a DNS subdomain: lower-case letters, digits,
/// `-` and `.`, at most 253), so it can go into an API path as it is.
pub fn is_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
}
