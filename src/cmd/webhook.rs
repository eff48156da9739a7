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

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use clap::Args;
use locus_proto::pb;

use crate::config::{Resolved, ServerTlsArgs};
use locus::ops::admission;

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
    #[command(flatten)]
    pub tls: ServerTlsArgs,
}

struct Hook {
    cfg: Resolved,
    timeout: Duration,
    /// A client once one connected; dropped after a failure, so the next pod tries again.
    client: tokio::sync::Mutex<Option<locus_proto::client::MetadataClient>>,
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
    let hook = Arc::new(Hook {
        cfg: cfg.clone(),
        timeout,
        client: tokio::sync::Mutex::new(None),
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
        let req = match admission::read_review(&body) {
            Ok(r) => r,
            Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
        };
        let name = req.pod["metadata"]["name"]
            .as_str()
            .or(req.pod["metadata"]["generateName"].as_str())
            .unwrap_or("")
            .to_string();
        let (ops, warnings) = if req.datasets.is_empty() || req.already_placed {
            (Vec::new(), Vec::new())
        } else {
            match tokio::time::timeout(self.timeout, self.hosts(&req.datasets)).await {
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
        (
            Vec::new(),
            vec![format!(
                "locus: {} admitted without placement near its data: {why}",
                if pod.is_empty() { "pod" } else { pod }
            )],
        )
    }

    /// The hosts holding the datasets' bytes, best first, with the share on each.
    async fn hosts(&self, datasets: &[String]) -> anyhow::Result<Vec<(String, f64)>> {
        let refs = datasets
            .iter()
            .map(|d| {
                let r: locus_proto::DatasetRef =
                    d.parse().map_err(|e| anyhow::anyhow!("dataset {d:?}: {e}"))?;
                Ok(pb::VersionRef::from(&r))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut guard = self.client.lock().await;
        if guard.is_none() {
            *guard = Some(self.cfg.connect().await?);
        }
        let mut c = guard.clone().expect("connected above");
        drop(guard);
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
