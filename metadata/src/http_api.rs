//! HTTP/JSON on the metadata service's HTTP port, for schedulers that do not speak gRPC.
//!
//! `POST /v1/locality` takes
//!
//! ```json
//! {"datasets": ["imagenet@3"], "paths": ["train"], "shards": [0, 1],
//!  "nodes": ["gpu17"], "where": "gpu=h100,zone=z1", "limit": 8, "labels": true}
//! ```
//!
//! (only `datasets` is required) and answers with the same figures as the gRPC
//! `Locality` call. With tokens configured it needs `Authorization: Bearer TOKEN` of a
//! role that may read. Bad input is a 400 with a one-line `error`, never a panic.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use locus_proto::auth::{Access, Principal, TokenSet};
use locus_proto::DatasetRef;
use serde::Deserialize;

use crate::catalog::{Catalog, CatalogError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityBody {
    datasets: Vec<String>,
    #[serde(default)]
    paths: Vec<String>,
    #[serde(default)]
    shards: Vec<u32>,
    #[serde(default)]
    nodes: Vec<String>,
    #[serde(default, rename = "where")]
    selector: Option<String>,
    /// Include each node's labels in the answer.
    #[serde(default)]
    labels: bool,
    /// Only the best this many nodes.
    #[serde(default)]
    limit: Option<usize>,
}

#[derive(serde::Serialize)]
struct NodeOut<'a> {
    node: &'a str,
    rank: u32,
    live: bool,
    resident_bytes: u64,
    resident_fraction: f64,
    transfer_cost: f64,
    same_host_bytes: u64,
    same_rack_bytes: u64,
    same_zone_bytes: u64,
    other_zone_bytes: u64,
    origin_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    labels: Option<&'a HashMap<String, String>>,
}

#[derive(serde::Serialize)]
struct LocalityOut<'a> {
    datasets: Vec<String>,
    total_bytes: u64,
    nodes: Vec<NodeOut<'a>>,
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, axum::Json(serde_json::json!({ "error": msg.into() }))).into_response()
}

/// `k=v,k=v` into a map.
/// A checked `/v1/locality` body: the request, its dataset references and its selector.
pub type LocalityQuestion = (LocalityBody, Vec<DatasetRef>, HashMap<String, String>);

/// A `/v1/locality` body checked and bounded (the same caps as the gRPC call) before
/// anything is looked up: the request, its dataset references and its label selector.
/// Public for the fuzz target (`fuzz/`).
pub fn parse_locality(body: &[u8]) -> Result<LocalityQuestion, String> {
    let q: LocalityBody = serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))?;
    if q.datasets.is_empty() {
        return Err("datasets: name at least one dataset version".into());
    }
    crate::locality::check_request(q.datasets.len(), q.paths.len(), q.shards.len(), q.nodes.len())?;
    let refs = q
        .datasets
        .iter()
        .map(|d| d.parse::<DatasetRef>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("datasets: {e}"))?;
    for p in &q.paths {
        locus_proto::RelPath::check_dir(p.trim_end_matches('/')).map_err(|e| format!("paths: {e}"))?;
    }
    let selector = match q.selector.as_deref().map(parse_selector).transpose() {
        Ok(s) => s.unwrap_or_default(),
        Err(e) => return Err(format!("where: {e}")),
    };
    Ok((q, refs, selector))
}

pub fn parse_selector(s: &str) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("selector term {kv:?} is not KEY=VALUE"))?;
        out.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(out)
}

/// The scheduler extender's caller: with tokens configured, a reader (or stronger) token
/// as `Authorization: Bearer …` or as the URL's path segment (`/k8s/TOKEN/prioritize`:
/// kube-scheduler's extender config can name a URL but not a header). Without one the
/// scores would tell anyone which datasets exist and which nodes hold them.
pub fn authorize_extender(
    tokens: Option<&TokenSet>,
    headers: &HeaderMap,
    path_token: Option<&str>,
) -> Result<Principal, Box<Response>> {
    match path_token {
        Some(t) if headers.get("authorization").is_none() => {
            let bearer = format!("Bearer {t}");
            let auth = Some(bearer.as_bytes());
            match locus_proto::auth::check(tokens, "Extender", Some(Access::Read), auth, None) {
                Ok(p) => Ok(p),
                Err((status, _)) => Err(Box::new(error(StatusCode::FORBIDDEN, status.message()))),
            }
        }
        _ => authorize(tokens, headers, "Extender").map_err(|r| {
            if tokens.is_some() && headers.get("authorization").is_none() {
                Box::new(error(
                    StatusCode::UNAUTHORIZED,
                    "this service has tokens: give the scheduler extender a reader token in its \
                     URL (urlPrefix: https://HOST:PORT/k8s/TOKEN) or an Authorization header",
                ))
            } else {
                r
            }
        }),
    }
}

/// A caller who may read, or the response refusing them.
fn authorize(
    tokens: Option<&TokenSet>,
    headers: &HeaderMap,
    method: &str,
) -> Result<Principal, Box<Response>> {
    let auth = headers.get("authorization").map(|v| v.as_bytes());
    locus_proto::auth::check(tokens, method, Some(Access::Read), auth, None).map_err(|(status, _)| {
        let code = match status.code() {
            tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            _ => StatusCode::FORBIDDEN,
        };
        Box::new(error(code, status.message()))
    })
}

/// A dataset outside the caller's scope is answered as one that does not exist.
fn in_scope<'a>(who: &Principal, mut names: impl Iterator<Item = &'a str>) -> Result<(), Box<Response>> {
    match names.find(|n| !who.sees(n)) {
        Some(n) => Err(Box::new(error(
            StatusCode::NOT_FOUND,
            format!("no dataset named {n}"),
        ))),
        None => Ok(()),
    }
}

/// The overview page's check: a reader token as `Authorization: Bearer`, or as the
/// password of HTTP Basic auth (what a browser sends once asked by `WWW-Authenticate`).
pub fn authorize_page(tokens: Option<&TokenSet>, headers: &HeaderMap) -> Result<(), Box<Response>> {
    use base64::Engine as _;
    let given = headers.get("authorization").map(|v| v.as_bytes().to_vec());
    let bearer = match given.as_deref().and_then(|v| v.strip_prefix(b"Basic ")) {
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64.trim_ascii())
            .ok()
            .and_then(|userpass| {
                let at = userpass.iter().position(|b| *b == b':')?;
                Some([b"Bearer ".as_slice(), &userpass[at + 1..]].concat())
            }),
        None => given,
    };
    match locus_proto::auth::check(tokens, "Overview", Some(Access::Read), bearer.as_deref(), None) {
        // The page shows every dataset and node: it is not for a token narrowed to some.
        Ok(p) if p.is_scoped() => Err(Box::new(error(
            StatusCode::FORBIDDEN,
            format!(
                "{} is narrowed to datasets; the overview page is for unscoped tokens",
                p.name
            ),
        ))),
        Ok(_) => Ok(()),
        Err((status, _)) => {
            let mut r = (
                StatusCode::UNAUTHORIZED,
                format!("{}: give a reader token as the password\n", status.message()),
            )
                .into_response();
            r.headers_mut().insert(
                "www-authenticate",
                http::HeaderValue::from_static("Basic realm=\"locus\", charset=\"UTF-8\""),
            );
            Err(Box::new(r))
        }
    }
}

/// `POST /v1/assign` body: which shards each rank of a job should read, for samplers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignBody {
    /// `DATASET@VERSION` (or `DATASET` for the latest).
    dataset: String,
    /// The node each rank runs on: rank i is `rank_nodes[i]`.
    rank_nodes: Vec<String>,
    /// Also list every shard's files (paths, in manifest order).
    #[serde(default)]
    files: bool,
}

/// `POST /v1/assign`: the `Assign` call over HTTP for data-loader samplers (the Python
/// `locus_sampler`), which also want each shard's files to map them to sample indices:
///
/// ```json
/// {"dataset": "imagenet@3", "rank_nodes": ["gpu17", "gpu17", "gpu18"], "files": true}
/// → {"dataset": "imagenet@3", "total_bytes": …, "local_fraction": 0.98,
///    "ranks": [{"rank": 0, "node": "gpu17", "shards": [4, 0], "bytes": …,
///               "local_bytes": …, "local_fraction": 1.0}, …],
///    "shards": [{"id": 0, "files": ["train/a.jpg", …], "sizes": [112640, …]}, …]}
/// ```
pub async fn assign(
    catalog: Arc<Catalog>,
    tokens: Option<Arc<TokenSet>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let who = match authorize(tokens.as_deref(), &headers, "Assign") {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let q: AssignBody = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("malformed request: {e}")),
    };
    let r: DatasetRef = match q.dataset.parse() {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("dataset: {e}")),
    };
    if let Err(resp) = in_scope(&who, std::iter::once(r.name.as_str())) {
        return *resp;
    }
    let out = tokio::task::spawn_blocking(move || {
        let a = catalog.assign(&r, &q.rank_nodes, false)?;
        let version = a.r#ref.as_ref().map_or(0, |v| v.version);
        let files = if q.files {
            Some(catalog.files_by_shard(&r, version)?)
        } else {
            None
        };
        Ok::<_, CatalogError>((a, files))
    })
    .await;
    let (a, files) = match out {
        Ok(Ok(x)) => x,
        Ok(Err(CatalogError::NotFound(m))) => return error(StatusCode::NOT_FOUND, m),
        Ok(Err(CatalogError::Invalid(e))) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("task failed: {e}")),
    };
    let v = a.r#ref.unwrap_or_default();
    let mut shards: Vec<_> = files.unwrap_or_default().into_iter().collect();
    shards.sort_by_key(|(id, _)| *id);
    let answer = serde_json::json!({
        "dataset": format!("{}@{}", v.dataset, v.version),
        "total_bytes": a.total_bytes,
        "local_fraction": a.local_fraction,
        "ranks": a.ranks.iter().map(|r| serde_json::json!({
            "rank": r.rank, "node": r.node, "shards": r.shards, "bytes": r.bytes,
            "local_bytes": r.local_bytes, "local_fraction": r.local_fraction,
        })).collect::<Vec<_>>(),
        "shards": shards.into_iter().map(|(id, files)| {
            let (paths, sizes): (Vec<_>, Vec<_>) = files.into_iter().unzip();
            serde_json::json!({"id": id, "files": paths, "sizes": sizes})
        }).collect::<Vec<_>>(),
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        answer.to_string(),
    )
        .into_response()
}

pub async fn locality(
    catalog: Arc<Catalog>,
    tokens: Option<Arc<TokenSet>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let who = match authorize(tokens.as_deref(), &headers, "Locality") {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let (q, refs, selector) = match parse_locality(&body) {
        Ok(x) => x,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    if let Err(resp) = in_scope(&who, refs.iter().map(|r| r.name.as_str())) {
        return *resp;
    }
    let shards: Option<HashSet<u32>> = (!q.shards.is_empty()).then(|| q.shards.iter().copied().collect());
    let (with_labels, limit) = (q.labels, q.limit.unwrap_or(usize::MAX));
    let r = tokio::task::spawn_blocking(move || {
        catalog.locality(
            &refs,
            shards.as_ref(),
            &q.paths,
            &q.nodes,
            &selector,
            (limit, with_labels),
        )
    })
    .await;
    let out = match r {
        Ok(Ok(out)) => out,
        Ok(Err(CatalogError::NotFound(m))) => return error(StatusCode::NOT_FOUND, m),
        Ok(Err(CatalogError::Invalid(e))) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("task failed: {e}")),
    };
    let answer = LocalityOut {
        datasets: out
            .refs
            .iter()
            .map(|r| format!("{}@{}", r.dataset, r.version))
            .collect(),
        total_bytes: out.total_bytes,
        nodes: out
            .nodes
            .iter()
            .map(|n| NodeOut {
                node: &n.node,
                rank: n.rank,
                live: n.live,
                resident_bytes: n.resident_bytes,
                resident_fraction: n.resident_fraction,
                transfer_cost: n.transfer_cost,
                same_host_bytes: n.same_host_bytes,
                same_rack_bytes: n.same_rack_bytes,
                same_zone_bytes: n.same_zone_bytes,
                other_zone_bytes: n.other_zone_bytes,
                origin_bytes: n.origin_bytes,
                labels: with_labels.then_some(&n.labels),
            })
            .collect(),
    };
    match serde_json::to_vec(&answer) {
        Ok(b) => ([(axum::http::header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the answer: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn selectors() {
        let s = super::parse_selector("gpu=h100, zone=z1").unwrap();
        assert_eq!(s["gpu"], "h100");
        assert_eq!(s["zone"], "z1");
        assert!(super::parse_selector("gpu").is_err());
        assert!(super::parse_selector("").unwrap().is_empty());
    }
}
