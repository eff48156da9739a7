//! End-to-end tests of locality: a real cluster after a real import, the answers checked
//! against the blobs actually on each node's disk, over gRPC (CLI) and HTTP/JSON.

use locus_testkit as support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use support::*;

/// Files with distinct contents (so each file is its own blob) in a few directories.
fn unique_tree(root: &Path, files: usize) {
    for i in 0..files {
        let d = root.join(format!("part{}", i % 4));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join(format!("f{i:04}.bin")),
            pseudo_random(i as u64 + 7, 20_000 + i * 97),
        )
        .unwrap();
    }
}

/// A cluster of three nodes (one zone, racks r1..r3) with `files` distinct files imported
/// as `ds` at `replicas` replicas: the service, the nodes, the source dir and its bytes.
async fn imported(
    h: &Harness,
    files: usize,
    replicas: &str,
) -> (Metadata, Vec<Node>, std::path::PathBuf, u64) {
    let (m, nodes) = cluster(h, 3, NodeOpts::host).await;
    let src = h.path("src");
    unique_tree(&src, files);
    let out = import(
        &m,
        "ds",
        &src,
        &["--replicas", replicas, "--shard-size", "256KiB"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let total = (0..files as u64).map(|i| 20_000 + i * 97).sum();
    (m, nodes, src, total)
}

/// Per node: the bytes of the source files whose blob is on that node's disk.
fn bytes_on_disk(src: &Path, nodes: &[&Node]) -> HashMap<String, u64> {
    let mut by_hash: BTreeMap<String, u64> = BTreeMap::new();
    for d in std::fs::read_dir(src).unwrap() {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            let data = std::fs::read(f.unwrap().path()).unwrap();
            by_hash.insert(blake3::hash(&data).to_hex().to_string(), data.len() as u64);
        }
    }
    nodes
        .iter()
        .map(|n| {
            let on = n.blob_files();
            let b = by_hash
                .iter()
                .filter(|(h, _)| on.contains_key(*h))
                .map(|(_, b)| *b)
                .sum();
            (n.id.clone(), b)
        })
        .collect()
}

fn locality_json(m: &Metadata, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["locality"];
    a.extend_from_slice(args);
    a.push("--json");
    let out = m.cli(&a);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap()
}

fn resident(j: &serde_json::Value) -> HashMap<String, u64> {
    j["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["node"].as_str().unwrap().to_string(),
                n["resident_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locality_matches_the_disks_and_follows_repair() {
    let h = Harness::new("locality");
    let (m, mut nodes, src, total) = imported(&h, 120, "2").await;

    let j = locality_json(&m, &["ds@1"]);
    assert_eq!(j["total_bytes"], total);
    let disk = bytes_on_disk(&src, &nodes.iter().collect::<Vec<_>>());
    assert_eq!(resident(&j), disk, "locality = bytes on each node's disk");
    assert_eq!(
        disk.values().sum::<u64>(),
        2 * total,
        "two replicas of everything"
    );
    // Ranked: most resident first (all nodes are in one zone, distinct racks).
    let ranks: Vec<u64> = j["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["resident_bytes"].as_u64().unwrap())
        .collect();
    assert!(ranks.windows(2).all(|w| w[0] >= w[1]), "{ranks:?}");
    for n in j["nodes"].as_array().unwrap() {
        let rest = total - n["resident_bytes"].as_u64().unwrap();
        assert_eq!(n["same_zone_bytes"].as_u64().unwrap(), rest, "{n}");
        assert_eq!(n["origin_bytes"], 0);
        let f = n["resident_fraction"].as_f64().unwrap();
        assert!((f - n["resident_bytes"].as_u64().unwrap() as f64 / total as f64).abs() < 1e-9);
    }

    // The best N: the full ranking's head, same figures. Over gRPC, labels come only
    // when asked (the CLI asks).
    let best = locality_json(&m, &["ds@1", "--limit", "2"]);
    assert_eq!(
        best["nodes"].as_array().unwrap()[..],
        j["nodes"].as_array().unwrap()[..2]
    );
    assert_eq!(best["total_bytes"], j["total_bytes"]);
    assert!(j["nodes"][0]["labels"]["rack"].is_string(), "{}", j["nodes"][0]);
    let mut c = m.client(None).await;
    let ask = |limit: u32, labels: bool| locus_proto::pb::LocalityRequest {
        refs: vec![locus_proto::pb::VersionRef {
            dataset: "ds".into(),
            version: 1,
        }],
        limit,
        labels,
        ..Default::default()
    };
    let bare = c.locality(ask(1, false)).await.unwrap().into_inner();
    let full = c.locality(ask(0, true)).await.unwrap().into_inner();
    assert_eq!(bare.nodes.len(), 1);
    assert!(bare.nodes[0].labels.is_empty(), "no labels unless asked");
    assert_eq!(full.nodes.len(), 3);
    assert_eq!(bare.nodes[0].node, full.nodes[0].node);
    assert_eq!(
        full.nodes[0].labels.get("rack").map(String::as_str),
        j["nodes"][0]["labels"]["rack"].as_str()
    );

    // Subsets: one shard, a path prefix, a label selector, named candidates.
    let one = locality_json(&m, &["ds@1", "--shards", "0"]);
    let shard0 = one["total_bytes"].as_u64().unwrap();
    assert!(shard0 > 0 && shard0 < total);
    assert_eq!(
        one["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["resident_fraction"] == 1.0)
            .count(),
        2
    );
    let part0: u64 = (0..120u64).filter(|i| i % 4 == 0).map(|i| 20_000 + i * 97).sum();
    assert_eq!(
        locality_json(&m, &["ds", "--path", "part0"])["total_bytes"],
        part0
    );
    let sel = locality_json(&m, &["ds@1", "--where", "rack=r2"]);
    assert_eq!(sel["nodes"].as_array().unwrap().len(), 1);
    assert_eq!(sel["nodes"][0]["node"], "n2");
    let named = locality_json(&m, &["ds@1", "--nodes", "n3,n1"]);
    assert_eq!(named["nodes"].as_array().unwrap().len(), 2);

    // The same over HTTP/JSON, and bad requests get a 400 or 404 with a message.
    let (code, body) = http_request(m.http, "POST", "/v1/locality", &[], r#"{"datasets":["ds@1"]}"#).await;
    assert_eq!(code, 200, "{body}");
    let hj: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(resident(&hj), disk);
    for (body, want) in [
        ("{not json", 400),
        (r#"{"datasets":[]}"#, 400),
        (r#"{"datasets":["../x"]}"#, 400),
        (r#"{"datasets":["ds@1"],"paths":["../etc"]}"#, 400),
        (r#"{"datasets":["ds@1"],"where":"gpu"}"#, 400),
        (r#"{"datasets":["ds@1"],"bogus":1}"#, 400),
        (r#"{"datasets":["nope@1"]}"#, 404),
        (r#"{"datasets":["ds@1"],"nodes":["nope"]}"#, 404),
        (r#"{"datasets":["ds@1"],"shards":[99999]}"#, 404),
    ] {
        let (code, text) = http_request(m.http, "POST", "/v1/locality", &[], body).await;
        assert_eq!(code, want, "{body} → {text}");
        assert!(text.contains("\"error\""), "{text}");
    }

    // Assign: 6 ranks on the three nodes (plus one on a host without data).
    let out = m.cli(&[
        "assign",
        "ds@1",
        "--rank-nodes",
        "n1,n1,n2,n2,n3,n3,gpu99",
        "--with-files",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let a: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let ranks = a["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 7);
    let mut got: Vec<u64> = ranks
        .iter()
        .flat_map(|r| {
            r["shards"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_u64().unwrap())
        })
        .collect();
    got.sort_unstable();
    let mut c = m.client(None).await;
    let want: Vec<u64> = shards(&mut c, "ds", 1)
        .await
        .iter()
        .map(|s| u64::from(s.id))
        .collect();
    assert_eq!(got, want, "every shard exactly once");
    let mut files: Vec<String> = ranks
        .iter()
        .flat_map(|r| {
            r["files"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_string())
        })
        .collect();
    files.sort();
    assert_eq!(files.len(), 120);
    files.dedup();
    assert_eq!(files.len(), 120, "every file exactly once");
    for r in ranks {
        if r["node"] == "gpu99" {
            assert_eq!(r["local_bytes"], 0, "{r}");
        } else {
            assert_eq!(
                r["local_bytes"], r["bytes"],
                "ranks on data nodes read locally: {a}"
            );
        }
    }
    let c2 = m.cli(&["assign", "ds@1"]);
    assert!(!c2.status.success());
    assert!(stderr(&c2).contains("--nodes"), "{}", stderr(&c2));

    // kill -9 n1: once repair has restored two live replicas, locality moves with it.
    nodes[0].daemon.kill9();
    wait_moved_off(&m, "ds", "n1").await;
    let j = locality_json(&m, &["ds@1"]);
    let after = resident(&j);
    assert!(!after.contains_key("n1"), "a down node is not a candidate: {j}");
    let disk = bytes_on_disk(&src, &[&nodes[1], &nodes[2]]);
    assert_eq!(after, disk);
    assert_eq!(after.values().sum::<u64>(), 2 * total);
    assert_eq!(after["n2"], total, "two live nodes hold everything");
    let dead = locality_json(&m, &["ds@1", "--nodes", "n1"]);
    assert_eq!(dead["nodes"][0]["resident_bytes"], 0);
    assert_eq!(dead["nodes"][0]["live"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_extender_scores_and_filters_in_kube_schedulers_shapes() {
    let h = Harness::new("k8s-extender");
    let (m, _nodes, _src, _total) = imported(&h, 60, "2").await;
    let loc = locality_json(&m, &["ds@1"]);
    let best = loc["nodes"][0]["node"].as_str().unwrap().to_string();
    let post = |path: &'static str, body: String| {
        let addr = m.http;
        async move {
            let (code, text) =
                http_request(addr, "POST", path, &[("Content-Type", "application/json")], &body).await;
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
            (code, v)
        }
    };
    let pod = |ann: &str| {
        format!(
            r#"{{"metadata":{{"name":"trainer-0","namespace":"ml","annotations":{{{ann}}}}},"spec":{{}}}}"#
        )
    };
    let wants = r#""locus.io/dataset":"ds@1""#;

    // nodeCacheCapable: true, Go's PascalCase with nulls for unset pointers.
    let (code, v) = post(
        "/k8s/prioritize",
        format!(
            r#"{{"Pod":{},"Nodes":null,"NodeNames":["n1","n2","n3","gpu99"]}}"#,
            pod(wants)
        ),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    let scores: HashMap<String, i64> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["Host"].as_str().unwrap().to_string(),
                e["Score"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(scores.len(), 4);
    assert!(scores.values().all(|s| (0..=10).contains(s)), "{v}");
    assert_eq!(scores["gpu99"], 0, "a node Locus does not know holds nothing");
    assert_eq!(scores[&best], 10, "the best-ranked node gets the top score: {v}");

    // nodeCacheCapable: false, lowercase names, whole Node objects.
    let node = |n: &str| {
        format!(
            r#"{{"metadata":{{"name":"{n}","labels":{{"kubernetes.io/hostname":"{n}"}}}},"status":{{"capacity":{{"cpu":"8"}}}}}}"#
        )
    };
    let list = format!(
        r#"{{"kind":"NodeList","items":[{},{},{}]}}"#,
        node("n1"),
        node("n2"),
        node("gpu99")
    );
    let (code, v) = post(
        "/k8s/prioritize",
        format!(r#"{{"pod":{},"nodes":{list}}}"#, pod(wants)),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v.as_array().unwrap().len(), 3);

    // No annotation: equal scores, never an error.
    let (code, v) = post(
        "/k8s/prioritize",
        format!(r#"{{"Pod":{},"NodeNames":["n1","n2"]}}"#, pod("")),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(
        v.as_array().unwrap().iter().all(|e| e["Score"] == v[0]["Score"]),
        "{v}"
    );

    // Filter: only with locality required, and only below the minimum fraction.
    let (code, v) = post(
        "/k8s/filter",
        format!(r#"{{"Pod":{},"NodeNames":["n1","gpu99"]}}"#, pod(wants)),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        v["NodeNames"],
        serde_json::json!(["n1", "gpu99"]),
        "a preference filters nothing"
    );
    assert_eq!(v["FailedNodes"], serde_json::json!({}));
    let required =
        r#""locus.io/dataset":"ds@1","locus.io/locality":"required","locus.io/min-fraction":"0.1""#;
    let (code, v) = post(
        "/k8s/filter",
        format!(
            r#"{{"Pod":{},"Nodes":null,"NodeNames":["n1","n2","n3","gpu99"]}}"#,
            pod(required)
        ),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["NodeNames"], serde_json::json!(["n1", "n2", "n3"]), "{v}");
    assert!(
        v["FailedNodes"]["gpu99"].as_str().unwrap().contains("ds@1"),
        "{v}"
    );
    assert_eq!(v["Error"], "");
    assert!(v["FailedAndUnresolvableNodes"].is_object());
    let (code, v) = post(
        "/k8s/filter",
        format!(r#"{{"pod":{},"nodes":{list}}}"#, pod(required)),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    let kept = v["Nodes"]["items"].as_array().unwrap();
    assert_eq!(kept.len(), 2, "{v}");
    assert_eq!(
        kept[0]["status"]["capacity"]["cpu"], "8",
        "node objects come back whole"
    );
    assert!(v["NodeNames"].is_null());

    // Bad input: 400 with a message, and the service keeps answering.
    for body in [
        "{not json".to_string(),
        "[1,2]".to_string(),
        r#"{"NodeNames":"n1"}"#.to_string(),
        format!(
            r#"{{"Pod":{},"NodeNames":["n1"]}}"#,
            pod(r#""locus.io/dataset":"../../etc""#)
        ),
    ] {
        let (code, v) = post("/k8s/prioritize", body.clone()).await;
        assert_eq!(code, 400, "{body} → {v}");
        assert!(!v["Error"].as_str().unwrap().is_empty());
    }
    // An unknown dataset: no preference (equal scores) rather than a failed cycle.
    let (code, v) = post(
        "/k8s/prioritize",
        format!(
            r#"{{"Pod":{},"NodeNames":["n1","n2"]}}"#,
            pod(r#""locus.io/dataset":"nope@1""#)
        ),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(v.as_array().unwrap().iter().all(|e| e["Score"] == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_copies_a_version_onto_chosen_nodes_and_a_rerun_copies_nothing() {
    let h = Harness::new("warm");
    let (m, mut nodes, src, total) = imported(&h, 80, "1").await;

    let out = m.cli(&["warm", "ds@1", "--nodes", "n1,n2", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let w: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(w["failed"], 0, "{w}");
    assert!(w["copied"].as_u64().unwrap() > 0, "{w}");
    assert_eq!(
        w["bytes_copied"].as_u64().unwrap() + w["bytes_already_present"].as_u64().unwrap(),
        2 * total,
        "{w}"
    );
    let j = locality_json(&m, &["ds@1", "--nodes", "n1,n2"]);
    for n in j["nodes"].as_array().unwrap() {
        assert_eq!(n["resident_fraction"], 1.0, "{n}");
    }
    let disk = bytes_on_disk(&src, &[&nodes[0], &nodes[1]]);
    assert_eq!(disk["n1"], total, "the warmed node holds every byte on its disk");
    assert_eq!(disk["n2"], total);

    // Idempotent: a second run copies nothing.
    let out = m.cli(&["warm", "ds@1", "--nodes", "n1,n2", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let w: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(w["copied"], 0, "{w}");
    assert_eq!(w["bytes_already_present"], 2 * total);

    // Refusals: unknown and down nodes, and shards no live node holds.
    let out = m.cli(&["warm", "ds@1", "--nodes", "nope"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no node named nope"), "{}", stderr(&out));
    nodes[2].daemon.kill9();
    wait_node_down(&m, "n3").await;
    let out = m.cli(&["warm", "ds@1", "--nodes", "n3"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("n3 is down"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_features_touch_only_locus_features_and_nodelist_names_the_best_nodes() {
    let h = Harness::new("slurm");
    let (m, _nodes, _src, _total) = imported(&h, 40, "1").await;
    let out = m.cli(&["warm", "ds@1", "--nodes", "n2"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // No Slurm on this machine: a stand-in scontrol that reports features a site already
    // uses (and a stale Locus one) and records every update it is asked for.
    let bin = h.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = h.path("scontrol.log");
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = show ]; then\n  echo \"NodeName=$3 Arch=x86_64 AvailableFeatures=h100,ib,locus_stale_1 ActiveFeatures=h100,locus_stale_1 Gres=gpu:8\"\nelse\n  echo \"$@\" >> {}\nfi\n",
        log.display()
    );
    std::fs::write(bin.join("scontrol"), script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(bin.join("scontrol"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());

    let dry = m.cli_env(&["slurm", "features", "--dry-run"], &[("PATH", path.clone())]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = stdout(&dry);
    assert!(
        text.contains(
            "scontrol update NodeName=n2 AvailableFeatures=h100,ib,locus_ds_1 ActiveFeatures=h100,locus_ds_1"
        ),
        "{text}"
    );
    assert!(!std::fs::exists(&log).unwrap(), "a dry run changes nothing");

    let run = m.cli_env(&["slurm", "features"], &[("PATH", path)]);
    assert!(run.status.success(), "{}", stderr(&run));
    let calls = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), 3, "{calls}");
    assert!(
        lines.contains(
            &"update NodeName=n2 AvailableFeatures=h100,ib,locus_ds_1 ActiveFeatures=h100,locus_ds_1"
        ),
        "{calls}"
    );
    // Nodes below the threshold lose only the stale Locus feature.
    assert!(
        lines.contains(&"update NodeName=n1 AvailableFeatures=h100,ib ActiveFeatures=h100"),
        "{calls}"
    );

    let nl = m.cli(&["slurm", "nodelist", "ds@1", "-N", "1"]);
    assert!(nl.status.success(), "{}", stderr(&nl));
    assert_eq!(
        stdout(&nl).trim(),
        "n2",
        "the node holding everything comes first"
    );
    let nl = m.cli(&["slurm", "nodelist", "ds@1", "-N", "3"]);
    assert_eq!(stdout(&nl).trim(), "n[1-3]");
    let nl = m.cli(&["slurm", "nodelist", "ds@1", "-N", "9"]);
    assert!(!nl.status.success());
    assert!(stderr(&nl).contains("only 3"), "{}", stderr(&nl));
}

/// Shards no live node holds come from the version's origin (here the directory it was
/// imported from) when warm is allowed that many bytes, and only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_reads_shards_no_live_node_holds_from_the_origin_within_its_budget() {
    let h = Harness::new("warm-origin");
    // No repair loop to race with: only warm copies here.
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("2s"),
                extra: vec!["--repair-interval".into(), "1h".into()],
                ..Default::default()
            },
        )
        .await;
    let src = h.path("src");
    let mut nodes = Vec::new();
    for i in 1..=2 {
        // The nodes may read the version's origin, the directory it came from.
        let mut o = NodeOpts::host(i);
        o.extra = vec!["--origin-root".into(), src.display().to_string()];
        nodes.push(h.start_node(&format!("n{i}"), &m, o).await);
    }
    unique_tree(&src, 40);
    let out = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "256KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let total: u64 = (0..40u64).map(|i| 20_000 + i * 97).sum();
    let mut c = m.client(None).await;
    let lost: u64 = shards(&mut c, "ds", 1)
        .await
        .iter()
        .filter(|s| s.replicas == ["n1"])
        .map(|s| s.bytes)
        .sum();
    assert!(lost > 0 && lost < total, "n1 holds some shards alone: {lost}");
    nodes[0].daemon.kill9();
    wait_node_down(&m, "n1").await;

    // Without a budget, and with one a byte short, warm refuses and says what it needs.
    for budget in ["0".to_string(), (lost - 1).to_string()] {
        let out = m.cli(&["warm", "ds@1", "--nodes", "n2", "--max-origin-bytes", &budget]);
        assert!(!out.status.success(), "budget {budget}: {}", stdout(&out));
        let err = stderr(&out);
        assert!(
            err.contains("--max-origin-bytes") && err.contains(&format!("({lost} bytes)")),
            "{err}"
        );
    }
    assert_eq!(
        bytes_on_disk(&src, &[&nodes[1]])["n2"],
        total - lost,
        "nothing was copied"
    );

    let budget = lost.to_string();
    let out = m.cli(&[
        "warm",
        "ds@1",
        "--nodes",
        "n2",
        "--max-origin-bytes",
        &budget,
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let w: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(w["failed"], 0, "{w}");
    assert_eq!(w["bytes_copied"], lost, "{w}");
    assert_eq!(
        bytes_on_disk(&src, &[&nodes[1]])["n2"],
        total,
        "n2 holds every byte"
    );
    assert!(nodes[1].logged("copied a blob from the version's origin"));
    let j = locality_json(&m, &["ds@1", "--nodes", "n2"]);
    assert_eq!(j["nodes"][0]["resident_fraction"], 1.0, "{j}");
    let mnt = m.mount("after", "ds@1", Some(&nodes[1]), &[]);
    assert_same_tree(&src, &mnt.path);
}

/// The extender takes no token, so its input is bounded: a pod naming 100,000 datasets is
/// refused by the count alone (nothing is parsed or looked up), as is a /v1/locality
/// question over the caps, and ordinary requests keep answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_extender_and_locality_requests_are_refused_by_their_size() {
    let h = Harness::new("k8s-bounds");
    let (m, _nodes, _src, _total) = imported(&h, 20, "1").await;
    let post = |path: &'static str, body: String| {
        let addr = m.http;
        async move { http_request(addr, "POST", path, &[("Content-Type", "application/json")], &body).await }
    };
    let many: Vec<String> = (0..100_000).map(|i| format!("ds{i}@1")).collect();
    let body = format!(
        r#"{{"Pod":{{"metadata":{{"name":"p","annotations":{{"locus.io/dataset":"{}"}}}}}},"NodeNames":["n1"]}}"#,
        many.join(",")
    );
    let normal = r#"{"Pod":{"metadata":{"name":"p","annotations":{"locus.io/dataset":"ds@1"}}},"NodeNames":["n1","n2"]}"#;
    let (code, _) = post("/k8s/prioritize", normal.to_string()).await;
    assert_eq!(code, 200);
    let (code, text) = post("/k8s/prioritize", body).await;
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("100000 datasets; at most 64"), "{text}");
    let (code, text) = post(
        "/v1/locality",
        serde_json::json!({ "datasets": ["ds@1"], "shards": (0..100_001).collect::<Vec<u32>>() }).to_string(),
    )
    .await;
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("100000 shards"), "{text}");
    let (code, _) = post("/k8s/prioritize", normal.to_string()).await;
    assert_eq!(code, 200);
}
