//! A kube-scheduler extender (v1 JSON): `POST /k8s/prioritize` and `POST /k8s/filter`
//! on the metadata service's HTTP port.
//!
//! A pod names its data with the annotation `locus.io/dataset: imagenet@3` (several,
//! comma-separated). Prioritize scores every candidate node 0–10 by the locality
//! ranking (10 for the cheapest to feed, 0 for the dearest, linear in transfer cost in
//! between). Filter removes nodes only when the pod also says `locus.io/locality:
//! required` and a node holds less than `locus.io/min-fraction` (default 0.5) of the
//! data. A pod without the annotation gets equal scores and passes the filter; a
//! request that is not JSON is a 400 with a message.
//!
//! Wire details: kube-scheduler's `ExtenderArgs` has `pod`, `nodes` (a NodeList, when
//! the extender is not `nodeCacheCapable`) and `nodenames` (when it is); older versions
//! and other senders use PascalCase (`Pod`, `Nodes`, `NodeNames`) and `null` for unset
//! pointers. Keys are matched case-insensitively and nulls accepted. Answers use
//! PascalCase field names, which Go's decoder accepts either way: `HostPriorityList` =
//! `[{"Host", "Score"}]`, `ExtenderFilterResult` = `{Nodes | NodeNames, FailedNodes,
//! FailedAndUnresolvableNodes, Error}`. Kubernetes node names are matched to Locus
//! nodes by node id, else by the `host` label; nodes Locus does not know hold nothing.
//!
//! With tokens configured, the scheduler presents a reader token: kube-scheduler's
//! extender config names a URL but cannot add a header, so the token may be the URL's
//! path segment (`urlPrefix: https://meta:7401/k8s/TOKEN`, over TLS so it does not cross
//! the network in clear; `http_api::authorize_extender`). Scores name which nodes hold a
//! dataset's bytes, so nobody without a token gets them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use locus_proto::{pb, DatasetRef};
use serde_json::{json, Value};

use crate::auth::Principal;
use crate::catalog::Catalog;

pub const DATASET_ANNOTATION: &str = "locus.io/dataset";
pub const LOCALITY_ANNOTATION: &str = "locus.io/locality";
pub const MIN_FRACTION_ANNOTATION: &str = "locus.io/min-fraction";
pub const MAX_SCORE: i64 = 10;

/// A field of a JSON object, whatever the case of its key; JSON null counts as absent.
fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    let o = v.as_object()?;
    o.get(name)
        .or_else(|| {
            o.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })
        .filter(|v| !v.is_null())
}

/// The candidates as sent: names, and the node objects when the scheduler sent them.
pub struct Candidates {
    names: Vec<String>,
    /// Some when the request carried a NodeList (not nodeCacheCapable).
    objects: Option<Vec<Value>>,
}

/// The datasets a pod's annotations ask for.
pub struct PodWants {
    refs: Vec<DatasetRef>,
    required: bool,
    min_fraction: f64,
}

fn bad(msg: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({ "Error": msg.into() })),
    )
        .into_response()
}

/// An extender request (ExtenderArgs) checked and bounded before anything is looked up.
/// Public for the fuzz target (`fuzz/`): it is what anyone who reaches the port controls.
pub fn parse(body: &[u8]) -> Result<(Option<PodWants>, Candidates), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("malformed extender request: {e}"))?;
    if !v.is_object() {
        return Err("malformed extender request: expected a JSON object (ExtenderArgs)".into());
    }
    let objects = match field(&v, "nodes") {
        Some(list) => {
            let items = field(list, "items").map_or(Ok(Vec::new()), |i| {
                i.as_array().cloned().ok_or("nodes.items must be an array")
            })?;
            Some(items)
        }
        None => None,
    };
    let names = match (&objects, field(&v, "nodenames")) {
        (Some(items), _) => items
            .iter()
            .map(|n| {
                field(n, "metadata")
                    .and_then(|m| field(m, "name"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| "every node in nodes.items needs metadata.name".to_string())
            })
            .collect::<Result<Vec<_>, _>>()?,
        (None, Some(n)) => n
            .as_array()
            .ok_or("nodenames must be an array of strings")?
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or("nodenames must be an array of strings")
            })
            .collect::<Result<Vec<_>, _>>()?,
        (None, None) => Vec::new(),
    };
    if names.len() > crate::locality::MAX_NODES {
        return Err(format!(
            "{} candidate nodes; at most {} per request",
            names.len(),
            crate::locality::MAX_NODES
        ));
    }
    let annotations = field(&v, "pod")
        .and_then(|p| field(p, "metadata"))
        .and_then(|m| field(m, "annotations"))
        .and_then(Value::as_object);
    let get = |k: &str| annotations.and_then(|a| a.get(k)).and_then(Value::as_str);
    let wants = match get(DATASET_ANNOTATION).map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(list) => {
            // Counted before anything is parsed or looked up.
            let asked = list.split(',').count();
            if asked > crate::locality::MAX_REFS {
                return Err(format!(
                    "annotation {DATASET_ANNOTATION}: {asked} datasets; at most {} per pod",
                    crate::locality::MAX_REFS
                ));
            }
            let refs = list
                .split(',')
                .map(|d| d.trim().parse::<DatasetRef>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("annotation {DATASET_ANNOTATION}: {e}"))?;
            let min_fraction = match get(MIN_FRACTION_ANNOTATION) {
                None => 0.5,
                Some(s) => s
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|f| (0.0..=1.0).contains(f))
                    .ok_or_else(|| {
                        format!("annotation {MIN_FRACTION_ANNOTATION}: {s:?} is not a number from 0 to 1")
                    })?,
            };
            Some(PodWants {
                refs,
                required: get(LOCALITY_ANNOTATION).is_some_and(|s| s.trim().eq_ignore_ascii_case("required")),
                min_fraction,
            })
        }
    };
    Ok((wants, Candidates { names, objects }))
}

/// Locality of each named Kubernetes node for the pod's data: name → (fraction, cost);
/// None for nodes Locus does not know.
fn locality_of(
    catalog: &Catalog,
    who: &Principal,
    wants: &PodWants,
    names: &[String],
) -> Result<HashMap<String, Option<(f64, f64)>>, String> {
    // A dataset outside the extender token's scope is answered as one that does not
    // exist, in the catalogue's words.
    if let Some(r) = wants.refs.iter().find(|r| !who.sees(r.name.as_str())) {
        return Err(format!("no dataset named {}", r.name));
    }
    let nodes = catalog.list_nodes().map_err(|e| e.to_string())?;
    let by_host: HashMap<&str, &str> = nodes
        .iter()
        .filter_map(|n| n.labels.get("host").map(|h| (h.as_str(), n.id.as_str())))
        .collect();
    let ids: std::collections::HashSet<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    let locus_id = |k: &str| -> Option<String> {
        if ids.contains(k) {
            Some(k.to_string())
        } else {
            by_host.get(k).map(|s| s.to_string())
        }
    };
    let mapped: Vec<(String, Option<String>)> = names.iter().map(|k| (k.clone(), locus_id(k))).collect();
    let mut wanted: Vec<String> = mapped.iter().filter_map(|(_, id)| id.clone()).collect();
    wanted.sort();
    wanted.dedup();
    let out = if wanted.is_empty() {
        pb::LocalityResponse::default()
    } else {
        catalog
            .locality(
                &wants.refs,
                None,
                &[],
                &wanted,
                &HashMap::new(),
                (usize::MAX, false),
            )
            .map_err(|e| e.to_string())?
    };
    let by_id: HashMap<&str, &pb::NodeLocality> = out.nodes.iter().map(|n| (n.node.as_str(), n)).collect();
    Ok(mapped
        .into_iter()
        .map(|(k, id)| {
            let l = id
                .as_deref()
                .and_then(|i| by_id.get(i))
                .map(|l| (l.resident_fraction, l.transfer_cost));
            (k, l)
        })
        .collect())
}

pub async fn prioritize(catalog: Arc<Catalog>, who: Principal, body: Bytes) -> Response {
    let (wants, cands) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return bad(e),
    };
    let equal = |names: &[String]| -> Response {
        axum::Json(
            names
                .iter()
                .map(|n| json!({ "Host": n, "Score": 0 }))
                .collect::<Vec<_>>(),
        )
        .into_response()
    };
    let Some(wants) = wants else {
        return equal(&cands.names);
    };
    let names = cands.names.clone();
    let r = tokio::task::spawn_blocking(move || locality_of(&catalog, &who, &wants, &names)).await;
    let loc = match r {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            // Unknown dataset and the like: no preference rather than a failed
            // scheduling cycle.
            tracing::warn!("extender prioritize: {e}; scoring all nodes equally");
            return equal(&cands.names);
        }
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("task failed: {e}")).into_response(),
    };
    let costs: Vec<f64> = loc.values().filter_map(|l| l.map(|x| x.1)).collect();
    let (lo, hi) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), c| {
            (a.min(*c), b.max(*c))
        });
    let scores: Vec<Value> = cands
        .names
        .iter()
        .map(|n| {
            let score = match loc.get(n).copied().flatten() {
                None => 0,
                Some((_, _)) if hi <= lo => MAX_SCORE,
                Some((_, cost)) => (MAX_SCORE as f64 * (hi - cost) / (hi - lo)).round() as i64,
            };
            json!({ "Host": n, "Score": score.clamp(0, MAX_SCORE) })
        })
        .collect();
    axum::Json(scores).into_response()
}

pub async fn filter(catalog: Arc<Catalog>, who: Principal, body: Bytes) -> Response {
    let (wants, cands) = match parse(&body) {
        Ok(x) => x,
        Err(e) => return bad(e),
    };
    let answer = |keep: &[bool], failed: BTreeMap<String, String>, error: String| -> Response {
        let mut out = serde_json::Map::new();
        match &cands.objects {
            Some(objs) => {
                let items: Vec<Value> = objs
                    .iter()
                    .zip(keep)
                    .filter(|(_, k)| **k)
                    .map(|(o, _)| o.clone())
                    .collect();
                out.insert("Nodes".into(), json!({ "items": items }));
                out.insert("NodeNames".into(), Value::Null);
            }
            None => {
                let names: Vec<&String> = cands
                    .names
                    .iter()
                    .zip(keep)
                    .filter(|(_, k)| **k)
                    .map(|(n, _)| n)
                    .collect();
                out.insert("Nodes".into(), Value::Null);
                out.insert("NodeNames".into(), json!(names));
            }
        }
        out.insert("FailedNodes".into(), json!(failed));
        out.insert("FailedAndUnresolvableNodes".into(), json!({}));
        out.insert("Error".into(), json!(error));
        axum::Json(Value::Object(out)).into_response()
    };
    let all = vec![true; cands.names.len()];
    let wants = match wants {
        Some(w) if w.required => w,
        // Locality is a preference unless the pod says otherwise.
        _ => return answer(&all, BTreeMap::new(), String::new()),
    };
    let names = cands.names.clone();
    let min = wants.min_fraction;
    let what: Vec<String> = wants.refs.iter().map(|r| r.to_string()).collect();
    let r = tokio::task::spawn_blocking(move || locality_of(&catalog, &who, &wants, &names)).await;
    let loc = match r {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => return answer(&all, BTreeMap::new(), format!("locus: {e}")),
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("task failed: {e}")).into_response(),
    };
    let mut failed = BTreeMap::new();
    let keep: Vec<bool> = cands
        .names
        .iter()
        .map(|n| {
            let f = loc.get(n).copied().flatten().map_or(0.0, |l| l.0);
            if f + 1e-12 < min {
                failed.insert(
                    n.clone(),
                    format!(
                        "holds {:.0}% of {}, the pod requires {:.0}% ({LOCALITY_ANNOTATION}: required)",
                        f * 100.0,
                        what.join(" + "),
                        min * 100.0
                    ),
                );
                false
            } else {
                true
            }
        })
        .collect();
    answer(&keep, failed, String::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_casings_and_nulls() {
        let go = br#"{"Pod":{"metadata":{"name":"p","annotations":{"locus.io/dataset":"ds@1, other"}}},
                      "Nodes":null,"NodeNames":["a","b"]}"#;
        let (w, c) = parse(go).unwrap();
        assert_eq!(c.names, ["a", "b"]);
        assert!(c.objects.is_none());
        let w = w.unwrap();
        assert_eq!(w.refs.len(), 2);
        assert!(!w.required);
        assert_eq!(w.min_fraction, 0.5);

        let lower = br#"{"pod":{"metadata":{"annotations":{"locus.io/dataset":"ds","locus.io/locality":"Required",
                         "locus.io/min-fraction":"0.8"}}},"nodes":{"items":[{"metadata":{"name":"x"}}]},"nodenames":null}"#;
        let (w, c) = parse(lower).unwrap();
        assert_eq!(c.names, ["x"]);
        assert_eq!(c.objects.unwrap().len(), 1);
        let w = w.unwrap();
        assert!(w.required);
        assert_eq!(w.min_fraction, 0.8);

        let (w, c) = parse(br#"{"Pod":{"metadata":{}},"NodeNames":["a"]}"#).unwrap();
        assert!(w.is_none());
        assert_eq!(c.names, ["a"]);
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        assert!(parse(b"{").is_err());
        assert!(parse(b"[]").is_err());
        assert!(parse(br#"{"NodeNames":"a"}"#).is_err());
        assert!(parse(br#"{"Nodes":{"items":[{"metadata":{}}]}}"#).is_err());
        assert!(parse(br#"{"Pod":{"metadata":{"annotations":{"locus.io/dataset":"../x"}}}}"#).is_err());
        assert!(parse(
            br#"{"Pod":{"metadata":{"annotations":{"locus.io/dataset":"d","locus.io/min-fraction":"2"}}}}"#
        )
        .is_err());
    }
}
