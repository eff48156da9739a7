//! `locus webhook`: a mutating admission webhook (AdmissionReview v1, `POST /mutate`) that
//! gives pods using Locus data preferred node affinity to the hosts holding their bytes
//! (`ops::admission` says what it does to a pod).
//!
//! It never stands between a pod and the cluster: whatever goes wrong — the metadata
//! service down or slow, an unknown dataset — the pod is admitted unchanged, with a
//! warning for whoever created it and a line in this log, within `--timeout`. Bodies over
//! `MAX_BODY` are refused before they are read whole. The API server only calls webhooks
//! over HTTPS: serve with --tls-cert/--tls-key (a certificate for the Service's DNS name),
//! and register it with deploy/kubernetes/webhook.yaml (failurePolicy: Ignore).
//!
//! PersistentVolumeClaims are followed through the Kubernetes API (in-cluster: the pod's
//! service account, which needs get on persistentvolumeclaims, persistentvolumes and
//! storageclasses; or `--kube-api`). Without it, pods using claims are admitted as they
//! come, and the log says so once at start.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use clap::Args;
use locus_proto::pb;

use crate::config::{Resolved, ServerTlsArgs};
use locus::ops::admission;
use locus::ops::kube::{is_object_name, KubeApi};

/// Largest AdmissionReview read: a pod with every field filled is tens of KiB.
pub const MAX_BODY: usize = 256 << 10;

#[derive(Args, Debug)]
pub struct WebhookArgs {
    /// Address to serve the webhook on (HTTPS with --tls-cert).
    #[arg(long, default_value = "0.0.0.0:8443", value_name = "ADDR")]
    pub listen: String,
    /// How long a pod's admission may wait for the metadata service before it is admitted
    /// unchanged. Keep it under the webhook's timeoutSeconds (at most 30 s; deploy/ sets 5).
    #[arg(long, default_value = "2s", value_name = "DURATION")]
    pub timeout: String,
    /// The Kubernetes API, to follow pods' PersistentVolumeClaims to Locus volumes.
    /// Default: the cluster this runs in (its service account), when it runs in one.
    /// `http://127.0.0.1:8001` reads through `kubectl proxy`.
    #[arg(long, value_name = "URL")]
    pub kube_api: Option<String>,
    /// Bearer token for --kube-api (a file, re-read at each call).
    #[arg(long, value_name = "FILE", requires = "kube_api")]
    pub kube_token_file: Option<std::path::PathBuf>,
    /// CA certificate (PEM) for an https --kube-api.
    #[arg(long, value_name = "FILE", requires = "kube_api")]
    pub kube_ca: Option<std::path::PathBuf>,
    /// Teams sharing the cluster: a TOML file (mode 0600) with a `[namespaces]` table
    /// mapping a Kubernetes namespace to its team's Locus token (a reader token narrowed
    /// to the team's datasets). A pod of a listed namespace is placed by what that token
    /// may read: another team's dataset is, to it, one that does not exist, and the pod is
    /// admitted unplaced with that warning. Pods of other namespaces are placed with the
    /// webhook's own token.
    #[arg(long, value_name = "FILE")]
    pub namespace_tokens: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub tls: ServerTlsArgs,
}

struct Hook {
    cfg: Resolved,
    timeout: Duration,
    /// A client once one connected; dropped after a failure, so the next pod tries again.
    client: tokio::sync::Mutex<Option<locus_proto::client::MetadataClient>>,
    /// Where claims are read; None: they are not followed.
    kube: Option<KubeApi>,
    /// Namespace → its team's token (`--namespace-tokens`).
    ns_tokens: std::collections::HashMap<String, String>,
    /// Clients of those tokens, by namespace, once connected.
    ns_clients: tokio::sync::Mutex<std::collections::HashMap<String, locus_proto::client::MetadataClient>>,
}

/// `--namespace-tokens`: `[namespaces]` of namespace = "token", from a file only its owner
/// may read (it holds secrets).
fn namespace_tokens(p: &std::path::Path) -> anyhow::Result<std::collections::HashMap<String, String>> {
    use std::os::unix::fs::PermissionsExt;
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        namespaces: std::collections::HashMap<String, String>,
    }
    let text =
        std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("--namespace-tokens {}: {e}", p.display()))?;
    let mode = std::fs::metadata(p)?.permissions().mode();
    if mode & 0o077 != 0 {
        anyhow::bail!(
            "--namespace-tokens {}: it holds tokens but other users may read it (mode {:o}); chmod 600 it \
             (a Kubernetes Secret: defaultMode 0400)",
            p.display(),
            mode & 0o777
        );
    }
    let f: File = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("--namespace-tokens {}: {}", p.display(), e.message()))?;
    for (ns, t) in &f.namespaces {
        anyhow::ensure!(
            is_object_name(ns),
            "--namespace-tokens: {ns:?} is not a namespace name"
        );
        anyhow::ensure!(
            !t.trim().is_empty(),
            "--namespace-tokens: namespace {ns} has an empty token"
        );
    }
    Ok(f.namespaces)
}

pub async fn run(a: WebhookArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let timeout = crate::config::duration_arg("--timeout", &a.timeout)?;
    let tls = a.tls.load(None)?;
    if tls.is_none() {
        tracing::warn!(
            "serving without TLS: the API server calls webhooks only over HTTPS (give --tls-cert/--tls-key)"
        );
    }
    let addr: std::net::SocketAddr = a
        .listen
        .parse()
        .map_err(|e| anyhow::anyhow!("--listen {}: {e}", a.listen))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let kube = match &a.kube_api {
        Some(url) => Some(KubeApi::new(
            url,
            a.kube_token_file.as_deref(),
            a.kube_ca.as_deref(),
        )?),
        None => KubeApi::in_cluster().transpose()?,
    };
    match &kube {
        Some(k) => tracing::info!(api = %k.base(), "PersistentVolumeClaims are followed through the Kubernetes API"),
        None => tracing::warn!(
            "not in a Kubernetes cluster and no --kube-api: pods using PersistentVolumeClaims are admitted unplaced \
             (inline CSI volumes and the locus.io/dataset annotation still work)"
        ),
    }
    let hook = Arc::new(Hook {
        cfg: cfg.clone(),
        timeout,
        client: tokio::sync::Mutex::new(None),
        kube,
        ns_tokens: match &a.namespace_tokens {
            Some(p) => namespace_tokens(p)?,
            None => Default::default(),
        },
        ns_clients: Default::default(),
    });
    let app = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/mutate",
            axum::routing::post(move |body: Bytes| {
                let hook = hook.clone();
                async move { hook.mutate(body).await }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        // A declared size over the limit is refused before any of the body is read (and
        // before `100 Continue`), so the sender learns it at once rather than as a reset
        // connection halfway through its upload.
        .layer(axum::middleware::from_fn(
            |req: axum::extract::Request, next: axum::middleware::Next| async move {
                let declared = req
                    .headers()
                    .get(axum::http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<usize>().ok());
                if declared.is_some_and(|n| n > MAX_BODY) {
                    return (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("an AdmissionReview is at most {MAX_BODY} bytes\n"),
                    )
                        .into_response();
                }
                next.run(req).await
            },
        ));
    let acceptor = tls
        .as_ref()
        .map(|t| t.http_acceptor())
        .transpose()
        .map_err(|e| anyhow::anyhow!("TLS: {e}"))?;
    tracing::info!(listen = %bound, tls = acceptor.is_some(), metadata = %cfg.metadata_url, "admission webhook ready");
    locus_proto::net::serve_http(
        listener,
        app,
        Default::default(),
        acceptor,
        super::shutdown_signal(),
    )
    .await;
    Ok(())
}

impl Hook {
    async fn mutate(&self, body: Bytes) -> Response {
        let mut req = match admission::read_review(&body) {
            Ok(r) => r,
            Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
        };
        let name = req.pod["metadata"]["name"]
            .as_str()
            .or(req.pod["metadata"]["generateName"].as_str())
            .unwrap_or("")
            .to_string();
        // One time budget for the claims and the placement together.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut claim_trouble = None;
        if let (false, Some(kube)) = (req.claims.is_empty(), &self.kube) {
            match tokio::time::timeout_at(deadline, claim_datasets(kube, &req.namespace, &req.claims)).await {
                Ok(Ok(found)) => req.add_datasets(found),
                Ok(Err(e)) => claim_trouble = Some(e.to_string()),
                Err(_) => {
                    claim_trouble = Some(format!(
                        "the Kubernetes API did not answer within {:?}",
                        self.timeout
                    ))
                }
            }
        }
        let (ops, mut warnings) = if req.datasets.is_empty() || req.already_placed {
            (Vec::new(), Vec::new())
        } else {
            match tokio::time::timeout_at(deadline, self.hosts(&req.namespace, &req.datasets)).await {
                Ok(Ok(hosts)) => {
                    let out = admission::placement(&req, &hosts);
                    tracing::info!(pod = %name, datasets = %req.datasets.join(","), hosts = hosts.len(), "placed");
                    out
                }
                Ok(Err(e)) => self.unchanged(&name, &req, &e.to_string()).await,
                Err(_) => {
                    let why = format!("the metadata service did not answer within {:?}", self.timeout);
                    self.unchanged(&name, &req, &why).await
                }
            }
        };
        if let Some(why) = claim_trouble {
            tracing::warn!(pod = %name, claims = %req.claims.join(","), "claims not followed: {why}");
            warnings.push(format!("locus: the pod's claims were not followed: {why}"));
        }
        axum::Json(admission::answer(&req.uid, &ops, &warnings)).into_response()
    }

    /// Fail open: the pod goes in as it came, the reason logged and shown to its creator.
    async fn unchanged(
        &self,
        pod: &str,
        req: &admission::PodRequest,
        why: &str,
    ) -> (Vec<serde_json::Value>, Vec<String>) {
        tracing::warn!(pod, datasets = %req.datasets.join(","), "admitted without placement: {why}");
        *self.client.lock().await = None;
        self.ns_clients.lock().await.remove(&req.namespace);
        (
            Vec::new(),
            vec![format!(
                "locus: {} admitted without placement near its data: {why}",
                if pod.is_empty() { "pod" } else { pod }
            )],
        )
    }

    /// The hosts holding the datasets' bytes, best first, with the share on each; asked
    /// with the namespace's own token when it has one.
    async fn hosts(&self, namespace: &str, datasets: &[String]) -> anyhow::Result<Vec<(String, f64)>> {
        let refs = datasets
            .iter()
            .map(|d| {
                let r: locus_proto::DatasetRef =
                    d.parse().map_err(|e| anyhow::anyhow!("dataset {d:?}: {e}"))?;
                Ok(pb::VersionRef::from(&r))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut c = match self.ns_tokens.get(namespace) {
            Some(token) => {
                let mut clients = self.ns_clients.lock().await;
                match clients.get(namespace) {
                    Some(c) => c.clone(),
                    None => {
                        let mut as_team = self.cfg.clone();
                        as_team.token = Some(token.clone());
                        let c = as_team.connect().await?;
                        clients.insert(namespace.to_string(), c.clone());
                        c
                    }
                }
            }
            None => {
                let mut guard = self.client.lock().await;
                if guard.is_none() {
                    *guard = Some(self.cfg.connect().await?);
                }
                guard.clone().expect("connected above")
            }
        };
        let out = c
            .locality(pb::LocalityRequest {
                refs,
                limit: admission::MAX_TERMS as u32,
                labels: true,
                ..Default::default()
            })
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        // Kubernetes names nodes by host: the node's `host` label (its host name by
        // default), else its id.
        Ok(out
            .nodes
            .iter()
            .map(|n| {
                let host = n.labels.get("host").cloned().unwrap_or_else(|| n.node.clone());
                (host, n.resident_fraction)
            })
            .collect())
    }
}

/// The datasets behind `claims` in `namespace` (claims that are not Locus volumes, or do
/// not exist yet, add none).
async fn claim_datasets(kube: &KubeApi, namespace: &str, claims: &[String]) -> anyhow::Result<Vec<String>> {
    anyhow::ensure!(
        is_object_name(namespace),
        "namespace {namespace:?} is not an object name"
    );
    let mut out = Vec::new();
    for claim in claims {
        anyhow::ensure!(is_object_name(claim), "claim {claim:?} is not an object name");
        let Some(pvc) = kube
            .get(&format!(
                "/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}"
            ))
            .await?
        else {
            continue;
        };
        let pv = match pvc["spec"]["volumeName"].as_str().filter(|v| !v.is_empty()) {
            Some(v) if is_object_name(v) => kube.get(&format!("/api/v1/persistentvolumes/{v}")).await?,
            _ => None,
        };
        let class = match (&pv, pvc["spec"]["storageClassName"].as_str()) {
            (None, Some(c)) if is_object_name(c) => {
                kube.get(&format!("/apis/storage.k8s.io/v1/storageclasses/{c}"))
                    .await?
            }
            _ => None,
        };
        if let Some(d) =
            admission::claim_dataset(&pvc, pv.as_ref(), class.as_ref()).map_err(anyhow::Error::msg)?
        {
            out.push(d);
        }
    }
    Ok(out)
}
