//! `locus webhook` as the Kubernetes API server calls it: AdmissionReview v1 bodies over
//! HTTPS to a real webhook process in front of a real metadata service and two nodes. A
//! pod using a Locus volume gets preferred affinity to the hosts holding its bytes, in
//! order of the share each holds (as `locus locality` reports it); re-admission changes
//! nothing; a pod without Locus data is untouched; malformed and oversized bodies are
//! refused; with the metadata service gone, pods are admitted unchanged in time.

use locus_testkit as support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use support::*;

/// POSTs `body` to the webhook over HTTPS (curl, the cluster CA); (status, answer). HTTP/1.1:
/// over HTTP/2 a refused oversized body ends in a stream reset, which curl reports as an
/// error rather than the 413 status it carries.
fn post(url: &str, ca: &Path, body: &[u8]) -> (u16, String) {
    post_with(url, ca, body, &[])
}

/// `post` with extra curl arguments.
fn post_with(url: &str, ca: &Path, body: &[u8], extra: &[&str]) -> (u16, String) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("body");
    std::fs::write(&f, body).unwrap();
    let out = Command::new("curl")
        .args([
            "-sS",
            "--http1.1",
            "--max-time",
            "20",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(ca)
        .args(extra)
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", f.display()))
        .arg(url)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (answer, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    let answer = if answer.is_empty() {
        String::from_utf8_lossy(&out.stderr).into_owned()
    } else {
        answer.to_string()
    };
    (code.trim().parse().unwrap_or(0), answer)
}

/// `locus webhook` on a free loopback port with `--timeout timeout` and `extra`
/// arguments, in front of `m`, once it listens; its log is `webhook.log`.
async fn start_webhook(
    h: &Harness,
    m: &Metadata,
    timeout: &str,
    extra: &[std::ffi::OsString],
) -> (std::process::Child, u16) {
    let port = free_low_port();
    let log = std::fs::File::create(h.path("webhook.log")).unwrap();
    let mut cmd = Command::new(locus());
    let ca = m.dir.join("ca.pem");
    if ca.exists() {
        cmd.env("LOCUS_CA_CERT", ca);
    }
    let hook = cmd
        .args([
            "webhook",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--timeout",
            timeout,
        ])
        .args(extra)
        .env("LOCUS_METADATA", m.url())
        .env_remove("LOCUS_TOKEN")
        .env_remove("LOCUS_CONFIG")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start locus webhook");
    wait_until("the webhook to listen", Duration::from_secs(20), || {
        let ok = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        async move { ok.then_some(()) }
    })
    .await;
    (hook, port)
}

fn review(uid: &str, pod: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "training",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": pod,
            "dryRun": false
        }
    }))
    .unwrap()
}

fn pod(annotations: Value, volumes: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trainer-0", "namespace": "training", "annotations": annotations},
        "spec": {"containers": [{"name": "t", "image": "pytorch"}], "volumes": volumes}
    })
}

/// Applies JSON Patch `add` operations (all the webhook emits) to `doc`.
fn apply(doc: &mut Value, ops: &[Value]) {
    for op in ops {
        assert_eq!(op["op"], "add", "{op}");
        let path = op["path"].as_str().unwrap();
        let parts: Vec<String> = path[1..]
            .split('/')
            .map(|p| p.replace("~1", "/").replace("~0", "~"))
            .collect();
        let (last, parents) = parts.split_last().unwrap();
        let mut at = &mut *doc;
        for p in parents {
            at = at.get_mut(p.as_str()).unwrap_or_else(|| panic!("{path}: no {p}"));
        }
        if last == "-" {
            at.as_array_mut().unwrap().push(op["value"].clone());
        } else {
            at.as_object_mut()
                .unwrap_or_else(|| panic!("{path}: not an object"))
                .insert(last.clone(), op["value"].clone());
        }
    }
}

/// The answer's response, its JSON Patch decoded (empty when none).
fn response(answer: &str, uid: &str) -> (Value, Vec<Value>) {
    let v: Value = serde_json::from_str(answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert_eq!(v["kind"], "AdmissionReview");
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
    let r = v["response"].clone();
    assert_eq!(r["uid"], uid, "the answer names the request");
    assert_eq!(r["allowed"], true, "a pod is never refused");
    let ops = match r["patch"].as_str() {
        Some(p) => {
            assert_eq!(r["patchType"], "JSONPatch");
            serde_json::from_slice(&base64::engine::general_purpose::STANDARD.decode(p).unwrap()).unwrap()
        }
        None => Vec::new(),
    };
    (r, ops)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_using_locus_volumes_get_affinity_to_their_data_and_are_never_held_up() {
    let h = Harness::new("webhook");
    let mut m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tls: true,
                ..Default::default()
            },
        )
        .await;
    let _n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let _n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let src = h.path("src");
    make_tree(&src, 80);
    let out = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The webhook, over TLS with a certificate from the cluster CA.
    let dir = h.path("webhook");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = m.issue_cert("webhook", "127.0.0.1", &dir);
    let tls = [
        "--tls-cert".into(),
        cert.into_os_string(),
        "--tls-key".into(),
        key.into_os_string(),
    ];
    let (mut hook, port) = start_webhook(&h, &m, "2s", &tls).await;
    let ca = m.dir.join("ca.pem");
    let url = format!("https://127.0.0.1:{port}/mutate");

    // Where the bytes are, as the operator's CLI sees it.
    let o = m.cli(&["locality", "ds@1", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let loc: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let expected: Vec<(String, i64)> = loc["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["resident_fraction"].as_f64().unwrap() > 0.0)
        .map(|n| {
            (
                n["labels"]["host"].as_str().unwrap().to_string(),
                ((n["resident_fraction"].as_f64().unwrap() * 100.0).round() as i64).clamp(1, 100),
            )
        })
        .collect();
    assert_eq!(expected.len(), 2, "both nodes hold part of ds@1: {loc}");

    // A pod with an inline Locus volume: preferred affinity, best host first.
    let volumes = json!([
        {"name": "data", "csi": {"driver": "csi.locus.io", "readOnly": true, "volumeAttributes": {"dataset": "ds@1"}}},
        {"name": "cache", "emptyDir": {}}
    ]);
    let p = pod(json!({"team": "vision"}), volumes.clone());
    let (code, answer) = post(&url, &ca, &review("u-1", &p));
    assert_eq!(code, 200, "{answer}");
    let (r, ops) = response(&answer, "u-1");
    assert!(r["warnings"].is_null(), "{r}");
    let mut placed = p.clone();
    apply(&mut placed, &ops);
    let terms = placed["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .unwrap()
        .clone();
    let got: Vec<(String, i64)> = terms
        .iter()
        .map(|t| {
            let e = &t["preference"]["matchExpressions"][0];
            assert_eq!(e["key"], "kubernetes.io/hostname");
            (
                e["values"][0].as_str().unwrap().to_string(),
                t["weight"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, expected, "hosts in order of the share of bytes each holds");
    assert!(
        placed["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            .is_null()
    );
    assert_eq!(
        placed["metadata"]["annotations"]["team"], "vision",
        "the pod's own annotations stay"
    );
    assert_eq!(placed["metadata"]["annotations"]["locus.io/placed-for"], "ds@1");

    // Re-admission of the placed pod: nothing more.
    let (_, again) = post(&url, &ca, &review("u-2", &placed));
    assert!(response(&again, "u-2").1.is_empty(), "re-admission adds nothing");

    // A pod without Locus data: untouched.
    let plain = pod(json!({}), json!([{"name": "cache", "emptyDir": {}}]));
    let (_, a) = post(&url, &ca, &review("u-3", &plain));
    assert!(response(&a, "u-3").1.is_empty());

    // Required by annotation: only hosts with at least min-fraction of the bytes.
    let req = pod(
        json!({"locus.io/locality": "required", "locus.io/min-fraction": "0.01"}),
        volumes.clone(),
    );
    let (_, a) = post(&url, &ca, &review("u-4", &req));
    let mut placed = req.clone();
    apply(&mut placed, &response(&a, "u-4").1);
    let must = &placed["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let hosts: Vec<&str> = must[0]["matchExpressions"][0]["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let mut want: Vec<&str> = expected.iter().map(|(h, _)| h.as_str()).collect();
    want.sort_unstable();
    let mut hosts_sorted = hosts.clone();
    hosts_sorted.sort_unstable();
    assert_eq!(hosts_sorted, want);

    // Bad input: not a review, a review without a uid, a body of 1 MiB.
    for body in [
        &b"{not json"[..],
        br#"{"kind":"AdmissionReview","request":{"object":{}}}"#,
    ] {
        let (code, text) = post(&url, &ca, body);
        assert_eq!(code, 400, "{text}");
        assert!(!text.is_empty(), "a 400 says why");
    }
    let big = vec![b' '; 1 << 20];
    // As the API server would (and so the refusal comes before the body is sent, not as
    // a broken pipe halfway through it): the size first, the body once allowed.
    let (code, text) = post_with(&url, &ca, &big, &["-H", "Expect: 100-continue"]);
    assert_eq!(code, 413, "a 1 MiB body is refused: {text}");

    // An unknown dataset: admitted unchanged, with a warning that says why.
    let unknown = pod(json!({"locus.io/dataset": "nosuch@1"}), json!([]));
    let (_, a) = post(&url, &ca, &review("u-5", &unknown));
    let (r, ops) = response(&a, "u-5");
    assert!(ops.is_empty());
    assert!(r["warnings"][0].as_str().unwrap_or("").contains("nosuch"), "{r}");

    // The metadata service gone: every pod admitted unchanged, within the timeout.
    m.kill9();
    let fresh = pod(json!({}), volumes);
    let t = Instant::now();
    let (code, a) = post(&url, &ca, &review("u-6", &fresh));
    let took = t.elapsed();
    assert_eq!(code, 200, "{a}");
    let (r, ops) = response(&a, "u-6");
    assert!(ops.is_empty(), "admitted unchanged");
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap_or("")
            .contains("without placement"),
        "{r}"
    );
    assert!(
        took < Duration::from_secs(10),
        "answered in {took:?} with a 2 s timeout"
    );
    let _ = hook.kill();
    let _ = hook.wait();
}

/// A stand-in for the Kubernetes API server's read side (no API server runs here): the
/// objects a pod's claims lead to, served only with the right bearer token; every
/// request's path is recorded.
async fn kube_api(
    objects: Value,
    token: &'static str,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::http::{HeaderMap, StatusCode, Uri};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
        let (objects, log) = (objects.clone(), log.clone());
        async move {
            log.lock().unwrap().push(uri.path().to_string());
            let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
            if auth != Some(&format!("Bearer {token}")) {
                return (StatusCode::UNAUTHORIZED, "Unauthorized".to_string());
            }
            match &objects[uri.path()] {
                Value::Null => (
                    StatusCode::NOT_FOUND,
                    r#"{"kind":"Status","code":404}"#.to_string(),
                ),
                Value::String(s) if s == "forbidden" => (StatusCode::FORBIDDEN, "forbidden".to_string()),
                o => (StatusCode::OK, o.to_string()),
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// A pod whose data comes through a PersistentVolumeClaim: the webhook reads the claim,
/// its bound Locus volume (the version it was provisioned with) or, unbound, its Locus
/// StorageClass, with the service account's token, and places the pod as it places one
/// with an inline volume. Claims of other drivers and missing claims change nothing; an
/// API that refuses leaves the pod unchanged with a warning saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_using_a_claim_of_a_locus_storage_class_are_placed_near_its_version() {
    let h = Harness::new("webhook-claims");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let _n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 10);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    let ns = "/api/v1/namespaces/training/persistentvolumeclaims";
    let objects = json!({
        format!("{ns}/bound"): {"metadata": {"name": "bound"}, "spec": {"volumeName": "pv-bound", "storageClassName": "locus-ds"}},
        "/api/v1/persistentvolumes/pv-bound": {"spec": {"csi": {"driver": "csi.locus.io", "volumeHandle": "ds@1:0123456789abcdef", "volumeAttributes": {"dataset": "ds@1"}}}},
        format!("{ns}/pending"): {"metadata": {"name": "pending"}, "spec": {"storageClassName": "locus-ds"}},
        "/apis/storage.k8s.io/v1/storageclasses/locus-ds": {"provisioner": "csi.locus.io", "parameters": {"dataset": "ds"}},
        format!("{ns}/ebs"): {"metadata": {"name": "ebs"}, "spec": {"volumeName": "pv-ebs"}},
        "/api/v1/persistentvolumes/pv-ebs": {"spec": {"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}}},
        format!("{ns}/secret"): "forbidden",
    });
    let (api, seen) = kube_api(objects, "sa-token").await;
    let token_file = h.path("token");
    std::fs::write(&token_file, "sa-token\n").unwrap();

    let kube = [
        "--kube-api".into(),
        api.into(),
        "--kube-token-file".into(),
        token_file.into_os_string(),
    ];
    let (mut hook, port) = start_webhook(&h, &m, "3s", &kube).await;
    let url = format!("http://127.0.0.1:{port}/mutate");
    let no_ca = h.path("no-ca.pem");
    let claim_pod = |claim: &str| {
        pod(
            json!({}),
            json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}]),
        )
    };

    // Bound: placed for the version its volume was provisioned with.
    // Unbound: for what its StorageClass will provision (the latest).
    for (claim, placed_for) in [("bound", "ds@1"), ("pending", "ds@latest")] {
        let p = claim_pod(claim);
        let (code, a) = post(&url, &no_ca, &review(claim, &p));
        assert_eq!(code, 200, "{a}");
        let (r, ops) = response(&a, claim);
        assert!(r["warnings"].is_null(), "{claim}: {r}");
        let mut placed = p.clone();
        apply(&mut placed, &ops);
        assert_eq!(
            placed["metadata"]["annotations"]["locus.io/placed-for"], placed_for,
            "{claim}"
        );
        let terms =
            &placed["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"];
        assert_eq!(
            terms[0]["preference"]["matchExpressions"][0]["values"][0], "h1",
            "{claim}: {placed}"
        );
        // Re-admission of the placed pod adds nothing.
        let (_, again) = post(&url, &no_ca, &review("again", &placed));
        assert!(
            response(&again, "again").1.is_empty(),
            "{claim}: re-admission adds nothing"
        );
    }

    // Another driver's claim, and a claim that does not exist: untouched, no warning.
    for claim in ["ebs", "missing"] {
        let (_, a) = post(&url, &no_ca, &review(claim, &claim_pod(claim)));
        let (r, ops) = response(&a, claim);
        assert!(ops.is_empty() && r["warnings"].is_null(), "{claim}: {r}");
    }
    // The API refuses: admitted unchanged, and told why.
    let (_, a) = post(&url, &no_ca, &review("secret", &claim_pod("secret")));
    let (r, ops) = response(&a, "secret");
    assert!(ops.is_empty(), "{r}");
    let w = r["warnings"][0].as_str().unwrap_or("");
    assert!(w.contains("claims were not followed") && w.contains("403"), "{r}");

    let paths = seen.lock().unwrap().clone();
    assert!(
        paths.contains(&format!("{ns}/bound"))
            && paths.contains(&"/api/v1/persistentvolumes/pv-bound".to_string()),
        "{paths:?}"
    );
    // The class is read for the unbound claim only (its admission and re-admission).
    let class_reads = paths.iter().filter(|p| p.contains("/storageclasses/")).count();
    assert_eq!(class_reads, 2, "a bound claim's class is not read: {paths:?}");
    let _ = hook.kill();
    let _ = hook.wait();
}
