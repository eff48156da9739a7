//! Pod placement by admission: what `locus webhook` does to a pod, as pure functions over
//! the Kubernetes API server's AdmissionReview (v1) and a locality answer, so it is tested
//! without either.
//!
//! A pod uses Locus data when a volume is an inline CSI volume of `csi.locus.io` (its
//! `volumeAttributes.dataset`), or it carries the annotation `locus.io/dataset` (several,
//! comma-separated; what the scheduler extender reads too). Such a pod gets preferred node
//! affinity to the hosts holding its bytes (`kubernetes.io/hostname`), one term per host,
//! weighted 1–100 by the share of the bytes already there, best first; with
//! `locus.io/locality: required`, also a required term: hosts holding at least
//! `locus.io/min-fraction` (default 0.5) of them, ANDed into any required terms the pod
//! has. The pod is annotated with what the affinity was computed for, and a pod that
//! already carries that annotation is left alone (re-admission changes nothing).
//! A PersistentVolumeClaim is followed when the webhook can read the Kubernetes API
//! ([`claim_dataset`]): to its bound PersistentVolume of `csi.locus.io` (the version it
//! was provisioned with), or, while unbound, to its Locus StorageClass's parameters.

use std::collections::BTreeSet;

use serde_json::{json, Map, Value};

pub use super::csi::DRIVER as CSI_DRIVER;
pub const DATASET_ANNOTATION: &str = "locus.io/dataset";
pub const LOCALITY_ANNOTATION: &str = "locus.io/locality";
pub const MIN_FRACTION_ANNOTATION: &str = "locus.io/min-fraction";
/// Set on a pod the webhook placed: the datasets its affinity was computed for.
pub const PLACED_ANNOTATION: &str = "locus.io/placed-for";
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// Hosts named in the preferred terms, best first.
pub const MAX_TERMS: usize = 16;

/// What a review asks about one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRequest {
    pub uid: String,
    pub pod: Value,
    /// `NAME@VERSION` (or `NAME`, the latest), sorted, without repeats; empty: the pod
    /// uses no Locus data.
    pub datasets: Vec<String>,
    pub required: bool,
    pub min_fraction: f64,
    /// The pod was already placed for exactly these datasets.
    pub already_placed: bool,
    /// The namespace the pod is created in (where its claims are).
    pub namespace: String,
    /// Names of the PersistentVolumeClaims its volumes use, sorted, without repeats; each
    /// may be a Locus volume ([`claim_dataset`]).
    pub claims: Vec<String>,
}

impl PodRequest {
    /// Adds datasets found behind the pod's claims, and decides again whether the pod
    /// was placed for exactly what it uses.
    pub fn add_datasets(&mut self, more: impl IntoIterator<Item = String>) {
        let all: BTreeSet<String> = self.datasets.drain(..).chain(more).collect();
        self.datasets = all.into_iter().collect();
        self.already_placed = !self.datasets.is_empty()
            && self.pod["metadata"]["annotations"][PLACED_ANNOTATION].as_str()
                == Some(&self.datasets.join(","));
    }
}

/// What a claim's objects say about it: the dataset version of its bound Locus volume,
/// or (unbound) what its Locus StorageClass will provision; None when it is not Locus's.
/// `pv` is the bound PersistentVolume, `class` the claim's StorageClass, each when read.
pub fn claim_dataset(
    pvc: &Value,
    pv: Option<&Value>,
    class: Option<&Value>,
) -> Result<Option<String>, String> {
    if let Some(pv) = pv {
        let csi = &pv["spec"]["csi"];
        if csi["driver"] != CSI_DRIVER {
            return Ok(None);
        }
        return Ok(csi["volumeAttributes"]["dataset"].as_str().map(str::to_string));
    }
    let Some(class) = class else { return Ok(None) };
    if class["provisioner"] != CSI_DRIVER {
        return Ok(None);
    }
    let params: std::collections::HashMap<String, String> = class["parameters"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect();
    let name = pvc["metadata"]["name"].as_str().unwrap_or("?");
    super::csi::dataset_of(&params)
        .map(|r| Some(r.to_string()))
        .map_err(|e| format!("claim {name}: {}", e.message()))
}

/// Reads an AdmissionReview; an error says what is wrong with it (the caller answers
/// 400, and the API server's failurePolicy decides).
pub fn read_review(body: &[u8]) -> Result<PodRequest, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    if v["kind"] != "AdmissionReview" {
        return Err("not an AdmissionReview (kind)".into());
    }
    let req = v
        .get("request")
        .filter(|r| r.is_object())
        .ok_or("an AdmissionReview without a request")?;
    let uid = req["uid"]
        .as_str()
        .filter(|u| !u.is_empty())
        .ok_or("request.uid is missing")?
        .to_string();
    let pod = req
        .get("object")
        .filter(|o| o.is_object())
        .cloned()
        .unwrap_or(Value::Null);
    let namespace = req["namespace"]
        .as_str()
        .or(pod["metadata"]["namespace"].as_str())
        .unwrap_or("default")
        .to_string();
    let is_pod = req["kind"]["kind"] == "Pod" || pod["kind"] == "Pod";
    if !is_pod || pod.is_null() {
        // Not ours to place (the configuration should send only pods): allowed as is.
        return Ok(PodRequest {
            uid,
            pod,
            datasets: Vec::new(),
            required: false,
            min_fraction: 0.5,
            already_placed: false,
            namespace,
            claims: Vec::new(),
        });
    }
    let annotations = &pod["metadata"]["annotations"];
    let mut datasets = BTreeSet::new();
    if let Some(a) = annotations[DATASET_ANNOTATION].as_str() {
        datasets.extend(
            a.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
    }
    let mut claims = BTreeSet::new();
    for vol in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        if let Some(c) = vol["persistentVolumeClaim"]["claimName"].as_str() {
            claims.insert(c.to_string());
        }
        let csi = &vol["csi"];
        if csi["driver"] == CSI_DRIVER {
            if let Some(d) = csi["volumeAttributes"]["dataset"].as_str() {
                datasets.insert(d.trim().to_string());
            }
        }
    }
    let min_fraction = annotations[MIN_FRACTION_ANNOTATION]
        .as_str()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|f| (0.0..=1.0).contains(f))
        .unwrap_or(0.5);
    let mut r = PodRequest {
        uid,
        already_placed: false,
        required: annotations[LOCALITY_ANNOTATION].as_str() == Some("required"),
        min_fraction,
        pod,
        datasets: Vec::new(),
        namespace,
        claims: claims.into_iter().collect(),
    };
    r.add_datasets(datasets);
    Ok(r)
}

/// JSON Patch operations that place `req`'s pod near `hosts` — (host name, share of the
/// pod's bytes on it), best first — and warnings for the person creating the pod.
pub fn placement(req: &PodRequest, hosts: &[(String, f64)]) -> (Vec<Value>, Vec<String>) {
    let mut warnings = Vec::new();
    let holding: Vec<&(String, f64)> = hosts.iter().filter(|(_, f)| *f > 0.0).take(MAX_TERMS).collect();
    let preferred: Vec<Value> = holding
        .iter()
        .map(|(h, f)| {
            json!({
                "weight": ((f * 100.0).round() as i64).clamp(1, 100),
                "preference": {"matchExpressions": [
                    {"key": HOSTNAME_LABEL, "operator": "In", "values": [h]}
                ]}
            })
        })
        .collect();
    let spec = &req.pod["spec"];
    let mut affinity: Map<String, Value> = spec["affinity"]["nodeAffinity"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    if !preferred.is_empty() {
        let key = "preferredDuringSchedulingIgnoredDuringExecution";
        let mut all = affinity
            .get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        all.extend(preferred);
        affinity.insert(key.into(), Value::Array(all));
    }
    if req.required {
        let enough: Vec<&str> = hosts
            .iter()
            .filter(|(_, f)| *f >= req.min_fraction)
            .map(|(h, _)| h.as_str())
            .collect();
        if enough.is_empty() {
            warnings.push(format!(
                "locus: no node holds {} of {} yet; the pod is not restricted (locus.io/locality: \
                 required would leave it unschedulable). `locus warm` can place the data first",
                req.min_fraction,
                req.datasets.join(",")
            ));
        } else {
            let ours = json!({"key": HOSTNAME_LABEL, "operator": "In", "values": enough});
            let key = "requiredDuringSchedulingIgnoredDuringExecution";
            let mut req_sel = affinity
                .get(key)
                .cloned()
                .unwrap_or_else(|| json!({"nodeSelectorTerms": []}));
            let terms = req_sel["nodeSelectorTerms"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            // Terms are ORed: ours is ANDed into each, or is the only one.
            let terms: Vec<Value> = if terms.is_empty() {
                vec![json!({"matchExpressions": [ours]})]
            } else {
                terms
                    .into_iter()
                    .map(|mut t| {
                        let mut exprs = t["matchExpressions"].as_array().cloned().unwrap_or_default();
                        exprs.push(ours.clone());
                        t["matchExpressions"] = Value::Array(exprs);
                        t
                    })
                    .collect()
            };
            req_sel["nodeSelectorTerms"] = Value::Array(terms);
            affinity.insert(key.into(), req_sel);
        }
    }
    if holding.is_empty() {
        warnings.push(format!(
            "locus: no live node holds any of {} yet; the pod is placed anywhere",
            req.datasets.join(",")
        ));
    }
    let mut ops = Vec::new();
    if !affinity.is_empty() {
        if spec["affinity"].is_object() {
            ops.push(
                json!({"op": "add", "path": "/spec/affinity/nodeAffinity", "value": Value::Object(affinity)}),
            );
        } else {
            ops.push(json!({"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": Value::Object(affinity)}}));
        }
    }
    let mark = Value::String(req.datasets.join(","));
    if req.pod["metadata"]["annotations"].is_object() {
        ops.push(json!({
            "op": "add",
            "path": format!("/metadata/annotations/{}", PLACED_ANNOTATION.replace('~', "~0").replace('/', "~1")),
            "value": mark,
        }));
    } else {
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {PLACED_ANNOTATION: mark}}));
    }
    (ops, warnings)
}

/// The AdmissionReview answer: always allowed (placement is a preference, never a
/// reason to refuse a pod), with the patch when there is one.
pub fn answer(uid: &str, ops: &[Value], warnings: &[String]) -> Value {
    use base64::Engine as _;
    let mut response = json!({"uid": uid, "allowed": true});
    if !ops.is_empty() {
        let patch = serde_json::to_vec(ops).expect("JSON values serialize");
        response["patchType"] = "JSONPatch".into();
        response["patch"] = base64::engine::general_purpose::STANDARD.encode(patch).into();
    }
    if !warnings.is_empty() {
        response["warnings"] = json!(warnings);
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(pod: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod}
        }))
        .unwrap()
    }

    fn pod_with_volume(dataset: &str) -> Value {
        json!({"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [], "volumes": [
            {"name": "data", "csi": {"driver": CSI_DRIVER, "volumeAttributes": {"dataset": dataset}}},
            {"name": "scratch", "emptyDir": {}}
        ]}})
    }

    #[test]
    fn a_claim_leads_to_its_bound_locus_volume_or_its_storage_class() {
        let mut pod = pod_with_volume("imagenet@3");
        pod["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "c", "persistentVolumeClaim": {"claimName": "captions", "readOnly": true}}));
        let mut r = read_review(&review(pod)).unwrap();
        assert_eq!(r.claims, vec!["captions"]);
        assert_eq!(r.namespace, "default");
        let pvc = json!({"metadata": {"name": "captions"}, "spec": {"volumeName": "pv-1"}});
        let bound = json!({"spec": {"csi": {"driver": CSI_DRIVER, "volumeHandle": "captions@2:00", "volumeAttributes": {"dataset": "captions@2"}}}});
        assert_eq!(
            claim_dataset(&pvc, Some(&bound), None),
            Ok(Some("captions@2".into()))
        );
        let other = json!({"spec": {"csi": {"driver": "ebs.csi.aws.com"}}});
        assert_eq!(claim_dataset(&pvc, Some(&other), None), Ok(None));
        let class = json!({"provisioner": CSI_DRIVER, "parameters": {"dataset": "captions"}});
        assert_eq!(
            claim_dataset(&pvc, None, Some(&class)),
            Ok(Some("captions@latest".into()))
        );
        let bad = json!({"provisioner": CSI_DRIVER, "parameters": {"datset": "captions"}});
        assert!(claim_dataset(&pvc, None, Some(&bad))
            .unwrap_err()
            .contains("claim captions"));
        let foreign = json!({"provisioner": "ebs.csi.aws.com", "parameters": {"dataset": "x"}});
        assert_eq!(claim_dataset(&pvc, None, Some(&foreign)), Ok(None));
        // Placed for what the claims add too: re-admission sees the whole set.
        r.add_datasets(["captions@2".to_string()]);
        assert_eq!(r.datasets, vec!["captions@2", "imagenet@3"]);
        assert!(!r.already_placed);
        r.pod["metadata"]["annotations"] = json!({PLACED_ANNOTATION: "captions@2,imagenet@3"});
        r.add_datasets([]);
        assert!(r.already_placed);
    }

    #[test]
    fn datasets_come_from_csi_volumes_and_the_annotation() {
        let mut pod = pod_with_volume("imagenet@3");
        pod["metadata"]["annotations"] = json!({DATASET_ANNOTATION: "captions@1, imagenet@3"});
        let r = read_review(&review(pod)).unwrap();
        assert_eq!(r.datasets, vec!["captions@1", "imagenet@3"]);
        assert_eq!(r.uid, "u-1");
        assert!(!r.required && !r.already_placed);
        let plain = json!({"kind": "Pod", "metadata": {}, "spec": {"volumes": [{"name": "x", "csi": {"driver": "other.io", "volumeAttributes": {"dataset": "a@1"}}}]}});
        assert!(read_review(&review(plain)).unwrap().datasets.is_empty());
    }

    #[test]
    fn malformed_reviews_are_refused_with_the_reason() {
        assert!(read_review(b"{").unwrap_err().contains("not JSON"));
        assert!(read_review(b"[]").unwrap_err().contains("AdmissionReview"));
        let no_uid = br#"{"kind":"AdmissionReview","request":{"object":{}}}"#;
        assert!(read_review(no_uid).unwrap_err().contains("uid"));
        let no_req = br#"{"kind":"AdmissionReview"}"#;
        assert!(read_review(no_req).unwrap_err().contains("request"));
    }

    #[test]
    fn preferred_terms_follow_the_share_of_bytes_and_required_is_anded() {
        let mut pod = pod_with_volume("ds@1");
        pod["metadata"]["annotations"] = json!({LOCALITY_ANNOTATION: "required"});
        pod["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}});
        let r = read_review(&review(pod)).unwrap();
        let hosts = vec![("h1".to_string(), 0.9), ("h2".into(), 0.4), ("h3".into(), 0.0)];
        let (ops, warnings) = placement(&r, &hosts);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(ops[0]["path"], "/spec/affinity/nodeAffinity");
        let na = &ops[0]["value"];
        let pref = na["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .unwrap();
        assert_eq!(pref.len(), 2, "hosts holding nothing are not preferred");
        assert_eq!(pref[0]["weight"], 90);
        assert_eq!(pref[0]["preference"]["matchExpressions"][0]["values"][0], "h1");
        assert_eq!(pref[1]["weight"], 40);
        let terms = na["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            .as_array()
            .unwrap();
        assert_eq!(
            terms.len(),
            1,
            "ANDed into the pod's own term, not ORed beside it"
        );
        let exprs = terms[0]["matchExpressions"].as_array().unwrap();
        assert_eq!(exprs[0]["key"], "gpu");
        assert_eq!(
            exprs[1]["values"],
            json!(["h1"]),
            "only hosts with ≥ 0.5 of the bytes"
        );
        assert_eq!(ops[1]["path"], "/metadata/annotations/locus.io~1placed-for");
    }

    #[test]
    fn a_placed_pod_is_recognised_and_nowhere_to_go_is_a_warning_not_a_refusal() {
        let mut pod = pod_with_volume("ds@1");
        pod["metadata"]["annotations"] = json!({PLACED_ANNOTATION: "ds@1", LOCALITY_ANNOTATION: "required"});
        let r = read_review(&review(pod)).unwrap();
        assert!(r.already_placed);
        let (ops, warnings) = placement(&r, &[("h1".into(), 0.0)]);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            ops.iter().all(|o| o["path"] != "/spec/affinity"),
            "no empty affinity"
        );
        let a = answer("u", &ops, &warnings);
        assert_eq!(a["response"]["allowed"], true);
        assert_eq!(a["response"]["uid"], "u");
    }
}
