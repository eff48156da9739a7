//! The metadata service under a cluster's worth of nodes: 10,000 nodes registered over
//! gRPC, each heartbeating at the default interval (2 s) on a connection of its own, as
//! real nodes do (a bench client plays them all); and a scheduler asking Locality for a
//! whole version over all of them while the heartbeats go on.
//!
//!     cargo bench --bench heartbeat_scale
//!     LOCUS_BENCH_NODES=1000 cargo bench --bench heartbeat_scale     # a smaller cluster
//!
//! Settings: LOCUS_BENCH_NODES (10,000), LOCUS_BENCH_CONNECTIONS (one per node),
//! LOCUS_BENCH_SHARDS (1,000: what `locus dataset import` makes of ten million files of
//! about 110 KiB with its default 1 GiB shards; whole-version Locality reads shard records
//! only, so the files themselves are not uploaded here), LOCUS_BENCH_WINDOW (30 s).
//!
//! Measures, on a real `locus metadata serve` process:
//! - the service's CPU (its /proc/PID/stat) over a window of heartbeats alone, in cores;
//! - heartbeat round trips as the client saw them (p50/p99), and that every node is Up at
//!   the end (a heartbeat that falls behind the liveness timeout would show as Down);
//! - Locality over gRPC for the whole version, every node ranked (without, then with
//!   labels), and the best 16, p50/p99 and the service's CPU per call, with the heartbeats
//!   still running; the same over HTTP (`POST /v1/locality`), whole answer and the best 16.
//!
//! Targets (issue 26): CPU under one core; Locality p99 ≤ 5 ms.

use locus_testkit as support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use locus_proto::pb;
use prost::Message;
use support::*;

const INTERVAL: Duration = Duration::from_secs(2);

fn node_name(i: usize) -> String {
    format!("gpu{i:05}")
}

fn registration(i: usize) -> pb::RegisterNodeRequest {
    pb::RegisterNodeRequest {
        id: node_name(i),
        address: format!("10.{}.{}.{}:7500", i / 62_500, (i / 250) % 250, i % 250),
        labels: HashMap::from([
            ("host".to_string(), node_name(i)),
            ("rack".to_string(), format!("r{}", i / 40)),
            ("zone".to_string(), format!("z{}", i / 2500)),
        ]),
        capacity_bytes: 1 << 44,
        free_bytes: 1 << 43,
        used_bytes: 0,
        ..Default::default()
    }
}

/// p50 / p99 / max in ms.
fn pcts(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
    (at(0.5), at(0.99), at(1.0))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("heartbeat_scale: bench");
        return;
    }
    let nodes = env_u64("LOCUS_BENCH_NODES", 10_000) as usize;
    let conns = (env_u64("LOCUS_BENCH_CONNECTIONS", nodes as u64) as usize).clamp(1, nodes);
    let shards = env_u64("LOCUS_BENCH_SHARDS", 1000) as usize;
    let window = Duration::from_secs(env_u64("LOCUS_BENCH_WINDOW", 30));
    // A node per connection: more descriptors than the usual soft limit, here and in the
    // service (which raises its own).
    locus_proto::net::raise_open_file_limit();

    let h = Harness::new("bench-heartbeat-scale");
    // The default liveness timeout: a heartbeat that falls behind it marks its node Down.
    let m = h.start_metadata("meta", MetadataOpts::default()).await;

    // Connections first (each its own TCP connection and HTTP/2 session).
    let t = Instant::now();
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        clients.push(m.client(None).await);
    }
    let connect_time = t.elapsed();

    // Every node registers, then heartbeats every INTERVAL from a random phase, on its
    // connection, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let lat: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let measuring = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::with_capacity(nodes);
    let (reg_tx, mut reg_rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..nodes {
        let mut c = clients[i % conns].clone();
        let (stop, lat, measuring, failures, reg_tx) = (
            stop.clone(),
            lat.clone(),
            measuring.clone(),
            failures.clone(),
            reg_tx.clone(),
        );
        tasks.push(tokio::spawn(async move {
            c.register_node(registration(i)).await.expect("register");
            let _ = reg_tx.send(());
            let phase = INTERVAL.mul_f64(((i as u64 * 2_654_435_761) % 1000) as f64 / 1000.0);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let t = Instant::now();
                let r = c
                    .heartbeat(pb::HeartbeatRequest {
                        id: node_name(i),
                        free_bytes: 1 << 43,
                        used_bytes: 1 << 30,
                        blobs: 1000,
                        ..Default::default()
                    })
                    .await;
                if r.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                if measuring.load(Ordering::Relaxed) {
                    lat.lock().unwrap().push(t.elapsed());
                }
            }
        }));
    }
    drop(reg_tx);
    for _ in 0..nodes {
        reg_rx.recv().await.expect("every node registers");
    }
    let register_time = t.elapsed();

    // A version with the shard count of a ten-million-file import, two replicas each.
    let mut c = m.client(None).await;
    let (entries, mut specs) = synthetic_manifest("h", shards * 2, 1000, 2, 1 << 22);
    for (i, s) in specs.iter_mut().enumerate() {
        let a = (i * 7919) % nodes;
        let b = (a + 1 + (i * 104_729) % (nodes - 1)) % nodes;
        s.replicas = vec![node_name(a), node_name(b)];
    }
    commit(&mut c, "bench", 1 << 22, entries, specs).await.unwrap();

    // Let every node's heartbeat come round once, then the window of heartbeats alone.
    tokio::time::sleep(INTERVAL * 2).await;
    measuring.store(true, Ordering::Relaxed);
    let cpu0 = cpu_seconds(m.pid());
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let cpu = cpu_seconds(m.pid()) - cpu0;
    let elapsed = t.elapsed();
    measuring.store(false, Ordering::Relaxed);
    let beats = std::mem::take(&mut *lat.lock().unwrap());
    let beat_rate = beats.len() as f64 / elapsed.as_secs_f64();
    let (hb50, hb99, hbmax) = pcts(beats);

    // Locality over gRPC while the heartbeats go on: every node's row (without and with
    // labels), then the best 16.
    let mut grpc_rows = Vec::new();
    for (limit, labels) in [(0u32, false), (0, true), (16, false)] {
        let req = pb::LocalityRequest {
            refs: vec![pb::VersionRef {
                dataset: "bench".into(),
                version: 1,
            }],
            limit,
            labels,
            ..Default::default()
        };
        let mut times = Vec::new();
        let mut answer = 0;
        let cpu0 = cpu_seconds(m.pid());
        let t0 = Instant::now();
        for i in 0..520 {
            let t = Instant::now();
            let r = c.locality(req.clone()).await.unwrap().into_inner();
            if i >= 20 {
                times.push(t.elapsed());
            }
            let want = if limit == 0 { nodes } else { limit as usize };
            assert_eq!(r.nodes.len(), want, "every live node is ranked");
            answer = r.encoded_len();
        }
        // The service's CPU per call, less what the heartbeats cost it meanwhile.
        let beats_share = cpu * t0.elapsed().as_secs_f64() / elapsed.as_secs_f64();
        let per_call = (cpu_seconds(m.pid()) - cpu0 - beats_share) / 520.0;
        grpc_rows.push((limit, labels, answer, pcts(times), per_call));
    }

    // The same over HTTP, the whole answer and the best 16.
    let mut conn = KeptAlive::connect(m.http).await;
    let mut http_rows = Vec::new();
    for (what, body) in [
        ("whole answer", r#"{"datasets":["bench@1"]}"#.to_string()),
        ("best 16", r#"{"datasets":["bench@1"],"limit":16}"#.to_string()),
    ] {
        let req = KeptAlive::post("/v1/locality", &body);
        let mut times = Vec::new();
        let mut size = 0;
        for i in 0..220 {
            let (d, n) = conn.ask(&req).await;
            if i >= 20 {
                times.push(d);
            }
            size = n;
        }
        http_rows.push((what, size, pcts(times)));
    }

    stop.store(true, Ordering::Relaxed);
    let listed = c
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    let up = listed
        .iter()
        .filter(|n| n.state == pb::NodeState::Up as i32)
        .count();
    let rss = std::fs::read_to_string(format!("/proc/{}/status", m.pid()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").map(|v| v.trim().to_string()))
        .unwrap_or_default();
    for t in tasks {
        t.abort();
    }

    println!();
    println!(
        "heartbeat_scale: {nodes} nodes on {conns} connections, heartbeat every {INTERVAL:?}; \
         a version of {shards} shards × 2 replicas; window {window:?}"
    );
    println!("| what | measured | target |");
    println!("|---|---|---|");
    println!(
        "| connect {conns} clients / register {nodes} nodes | {:.1} s / {:.1} s | |",
        connect_time.as_secs_f64(),
        register_time.as_secs_f64()
    );
    println!(
        "| heartbeats answered in the window | {beat_rate:.0}/s (expected {:.0}/s); {} failed in the whole run | |",
        nodes as f64 / INTERVAL.as_secs_f64(),
        failures.load(Ordering::Relaxed)
    );
    println!(
        "| **metadata service CPU, heartbeats alone** | **{:.3} cores** ({:.1} µs per heartbeat) | < 1 core |",
        cpu / elapsed.as_secs_f64(),
        cpu * 1e6 / (beat_rate * elapsed.as_secs_f64()).max(1.0)
    );
    println!(
        "| heartbeat round trip at the client, p50 / p99 / max | {hb50:.2} / {hb99:.2} / {hbmax:.2} ms | |"
    );
    println!("| nodes Up at the end | {up} of {nodes} | all |");
    println!("| metadata service RSS at the end | {rss} | |");
    for (limit, labels, answer, (a, b, c), per_call) in grpc_rows {
        let what = match (limit, labels) {
            (0, false) => format!("all {nodes} nodes ranked"),
            (0, true) => format!("all {nodes} nodes ranked, with labels"),
            _ => format!("the best {limit} (limit)"),
        };
        println!(
            "| **Locality (gRPC), whole version, {what} ({answer} B), p50 / p99 / max** | {a:.2} / **{b:.2}** / {c:.2} ms (service CPU {:.2} ms per call) | p99 ≤ 5 ms |",
            per_call * 1e3
        );
    }
    for (what, size, (a, b, c)) in http_rows {
        println!("| POST /v1/locality, {what} ({size} B), p50 / p99 / max | {a:.2} / {b:.2} / {c:.2} ms | |");
    }
    assert_eq!(up, nodes, "every heartbeating node stays Up");
}
