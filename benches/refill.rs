//! Refill of a wiped node, against a plain peer copy of the same bytes in the same run.
//!
//! Three nodes; a dataset with two replicas on n1 and n2. References, each with the page
//! cache dropped first:
//! - raw read: n2's blob files read cold by one reader (the disk the copies read from);
//! - peer copy: n3 copies every blob from n2 (FetchBlobs, four at a time, verified and
//!   fsynced) — what the data path gives a node-to-node copy;
//! - serial refill: n1 is wiped and restarted with `--refill-parallel 1` (one blob at a
//!   time, as pin sync used to refetch).
//!
//! Then the measured case: n1 wiped and restarted with the default refill workers. During
//! each refill the bench polls `ListNodes` and counts how often n1 was reported down
//! (liveness timeout 4 s, or `LOCUS_BENCH_LIVENESS`, e.g. 30s for the default), and checks
//! afterwards that no shard was re-placed.
//!
//! Run: `cargo bench --bench refill` (1 GiB in 64 files), or with `LOCUS_BENCH_MIB=2048`.
//! Dropping the page cache needs root; without it the figures are warm and say so.

use locus_testkit as support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use locus_proto::{nodepb, pb};
use support::*;

fn replicas(s: &[pb::Shard]) -> BTreeMap<u32, BTreeSet<String>> {
    s.iter()
        .map(|s| (s.id, s.replicas.iter().cloned().collect()))
        .collect()
}

/// What one refill measured.
struct Refilled {
    /// From the restart until every blob was back.
    total: Duration,
    /// From the first heartbeat that reported a refill until every blob was back, and
    /// the bytes that report said were to go: the copy rate without the restart.
    copying: Duration,
    first_bytes: u64,
    /// Polls that found n1 down once it was back.
    down: u32,
}

/// Wipes n1, restarts it and waits until it holds every blob again.
async fn refill(m: &Metadata, n1: &mut Node, want: &BTreeSet<String>) -> Refilled {
    n1.daemon.terminate().await;
    std::fs::remove_dir_all(&n1.data_dir).unwrap();
    drop_caches();
    let t = Instant::now();
    n1.restart().await;
    let mut c = m.client(None).await;
    let mut down = 0u32;
    let mut first: Option<(Instant, u64)> = None;
    loop {
        let nodes = c
            .list_nodes(pb::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        let n = nodes.iter().find(|n| n.id == n1.id).unwrap();
        // Before it registers again it may be down for real (it was stopped).
        if n.state != pb::NodeState::Up as i32 && t.elapsed() > Duration::from_secs(3) {
            down += 1;
        }
        if std::env::var_os("LOCUS_BENCH_TRACE").is_some() {
            eprintln!(
                "{:>6.2}s state={} seen={}ms ago to_go={} MiB blobs={}",
                t.elapsed().as_secs_f64(),
                n.state,
                n.last_seen_ms_ago,
                n.refill_bytes >> 20,
                n.refill_blobs
            );
        }
        if first.is_none() && n.refill_bytes > 0 {
            first = Some((Instant::now(), n.refill_bytes));
        }
        let have: BTreeSet<String> = n1.blob_files().into_keys().collect();
        if &have == want {
            let (since, first_bytes) = first.unwrap_or((t, 0));
            let r = Refilled {
                total: t.elapsed(),
                copying: since.elapsed(),
                first_bytes,
                down,
            };
            // Until n1's heartbeat says so too: otherwise the next refill's first look
            // would find this one's last report.
            while c
                .list_nodes(pb::ListNodesRequest {})
                .await
                .unwrap()
                .into_inner()
                .nodes
                .iter()
                .any(|n| n.id == n1.id && n.refill_blobs > 0)
            {
                assert!(
                    t.elapsed() < Duration::from_secs(1800),
                    "refill never reported done"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return r;
        }
        assert!(t.elapsed() < Duration::from_secs(1800), "refill did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("refill: bench");
        return;
    }
    // Memory freed by one part must not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
    let mib = env_u64("LOCUS_BENCH_MIB", 1024) as usize;
    let files = 64;
    let each = (mib << 20) / files;
    let liveness: &'static str = std::env::var("LOCUS_BENCH_LIVENESS")
        .map(|v| &*Box::leak(v.into_boxed_str()))
        .unwrap_or("4s");
    let h = Harness::new("bench-refill");
    let src = h.path("src");
    write_random_files(&src, "part-", files, each, 7000);
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some(liveness),
                extra: vec!["--repair-interval".into(), "1s".into()],
                ..Default::default()
            },
        )
        .await;
    let mut nodes = Vec::new();
    let opts = |i| {
        let mut o = NodeOpts::host(i);
        o.capacity = "64GiB";
        o.extra = vec!["--peer-timeout".into(), "30s".into()];
        o
    };
    // Two replicas on n1 and n2; n3 joins after the import and holds none.
    for i in 1..=2 {
        nodes.push(h.start_node(&format!("n{i}"), &m, opts(i)).await);
    }
    let out = m.cli(&[
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    nodes.push(h.start_node("n3", &m, opts(3)).await);
    let mut c = m.client(None).await;
    let before = replicas(&shards(&mut c, "ds", 1).await);
    let want: BTreeSet<String> = nodes[1].blob_files().into_keys().collect();
    let bytes: u64 = nodes[1].blob_files().values().map(|b| b.size).sum();

    // Physical reference: n2's blob files read cold, one after another, from the disk the
    // copies read them from.
    drop_caches();
    let t = Instant::now();
    let mut raw_bytes = 0u64;
    for b in nodes[1].blob_files().values() {
        raw_bytes += b.read().len() as u64;
    }
    let raw = t.elapsed();

    // Reference: a peer copy of the same blobs, n2 -> n3.
    let blobs: Vec<nodepb::BlobRef> = nodes[1]
        .blob_files()
        .iter()
        .map(|(name, b)| nodepb::BlobRef {
            hash: blake3::Hash::from_hex(name).unwrap().as_bytes().to_vec(),
            size: b.size,
            ..Default::default()
        })
        .collect();
    let cold = drop_caches();
    let mut n3 = nodes[2].client().await;
    let t = Instant::now();
    let r = n3
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: nodes[1].grpc.to_string(),
            blobs,
            pin: false,
            chunk_size: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let peer = t.elapsed();
    assert_eq!(r.bytes, bytes);

    // Reference: the refill one blob at a time.
    nodes[0].opts.extra = vec![
        "--peer-timeout".into(),
        "30s".into(),
        "--refill-parallel".into(),
        "1".into(),
    ];
    let serial = refill(&m, &mut nodes[0], &want).await;
    // Measured: the default workers.
    nodes[0].opts.extra = vec!["--peer-timeout".into(), "30s".into()];
    let par = refill(&m, &mut nodes[0], &want).await;
    let after = replicas(&shards(&mut c, "ds", 1).await);

    println!();
    println!(
        "refill: {} files of {} MiB ({} MiB), 3 nodes on one host, liveness timeout {}, {}",
        files,
        each >> 20,
        bytes >> 20,
        liveness,
        if cold {
            "page cache dropped before each"
        } else {
            "WARM (not root: caches not dropped)"
        }
    );
    println!("| copy | time | MiB/s | ratio to peer copy | copying only (from first report) | seen down |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| raw cold read of n2's blob files (one reader, no network, no write) | {:.2}s | {:.0} | {:.2}× | - | - |",
        raw.as_secs_f64(),
        mbs(raw_bytes, raw),
        peer.as_secs_f64() / raw.as_secs_f64()
    );
    println!(
        "| peer copy n2 -> n3 (FetchBlobs, 4 at a time) | {:.2}s | {:.0} | 1.00× | - | - |",
        peer.as_secs_f64(),
        mbs(bytes, peer)
    );
    for (what, r) in [("--refill-parallel 1", &serial), ("default workers (8)", &par)] {
        let copy_rate = mbs(r.first_bytes, r.copying);
        println!(
            "| refill of wiped n1, {what} | {:.2}s | {:.0} | {:.2}× | {:.0} MiB/s ({:.2}×) | {} |",
            r.total.as_secs_f64(),
            mbs(bytes, r.total),
            peer.as_secs_f64() / r.total.as_secs_f64(),
            copy_rate,
            copy_rate / mbs(bytes, peer),
            r.down
        );
    }
    println!(
        "shards re-placed: {}",
        before.iter().filter(|(k, v)| after.get(k) != Some(v)).count()
    );
    println!("(\"time\" runs from n1's restart: process start, store open, registration, first pin sync)");
}
