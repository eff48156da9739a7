//! Locality over HTTP/JSON from a second process: a real `locus metadata serve` with
//! 1,000 registered nodes and a version of 10,000 shards (two replicas each), asked
//! `POST /v1/locality` for the whole version, and `POST /k8s/prioritize` for 1,000 node
//! names, over a kept-alive connection.
//!
//!     cargo bench --bench locality_http
//!
//! Targets: locality p99 ≤ 5 ms; extender prioritize over 1,000 node names p99 ≤ 10 ms.

use locus_testkit as support;

use std::collections::HashMap;

use locus_proto::pb;
use support::*;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("locality_http: bench");
        return;
    }
    let h = Harness::new("bench-locality-http");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("1h"),
                ..Default::default()
            },
        )
        .await;
    let mut c = m.client(None).await;
    let nodes = 1000;
    for i in 0..nodes {
        c.register_node(pb::RegisterNodeRequest {
            id: format!("gpu{i:04}"),
            address: format!("10.0.{}.{}:7500", i / 250, i % 250),
            labels: HashMap::from([
                ("host".to_string(), format!("gpu{i:04}")),
                ("rack".to_string(), format!("r{}", i / 40)),
                ("zone".to_string(), format!("z{}", i / 250)),
            ]),
            capacity_bytes: 1 << 44,
            free_bytes: 1 << 43,
            used_bytes: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let shards = 10_000;
    let (entries, mut specs) = synthetic_manifest("h", shards, 1000, 1, 1 << 22);
    for (i, s) in specs.iter_mut().enumerate() {
        let a = (i * 7919) % nodes;
        let b = (a + 1 + (i * 104_729) % (nodes - 1)) % nodes;
        s.replicas = vec![format!("gpu{a:04}"), format!("gpu{b:04}")];
    }
    commit(&mut c, "bench", 1 << 22, entries, specs).await.unwrap();

    let body = r#"{"datasets":["bench@1"]}"#;
    let names: Vec<String> = (0..nodes).map(|i| format!("\"gpu{i:04}\"")).collect();
    let extender_body = format!(
        r#"{{"Pod":{{"metadata":{{"name":"trainer-0","annotations":{{"locus.io/dataset":"bench@1"}}}}}},"Nodes":null,"NodeNames":[{}]}}"#,
        names.join(",")
    );
    let requests = [
        (
            "POST /v1/locality, whole version, 1,000 nodes ranked",
            KeptAlive::post("/v1/locality", body),
            "p99 ≤ 5 ms",
        ),
        (
            "POST /k8s/prioritize, 1,000 node names (nodeCacheCapable)",
            KeptAlive::post("/k8s/prioritize", &extender_body),
            "p99 ≤ 10 ms",
        ),
    ];
    let mut conn = KeptAlive::connect(m.http).await;
    let mut rows = Vec::new();
    for (what, req, target) in &requests {
        for _ in 0..20 {
            conn.ask(req).await;
        }
        let mut times = Vec::new();
        let mut size = 0;
        for _ in 0..500 {
            let (d, n) = conn.ask(req).await;
            times.push(d);
            size = n;
        }
        times.sort();
        let at = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
        rows.push(format!(
            "| {what} ({size} B answer, 500 calls, one connection) | {:.2} ms | {:.2} ms | {:.2} ms | {target} |",
            at(0.5),
            at(0.99),
            at(1.0)
        ));
    }
    println!();
    println!("locality_http: {nodes} nodes, {shards} shards × 2 replicas");
    println!("| call | p50 | p99 | max | target |");
    println!("|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}
