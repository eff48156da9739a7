//! Import from an S3-compatible server (SeaweedFS, a real one, data on this disk) against
//! the raw parallel GET throughput of the same server for the same objects, measured in
//! the same run under the same cache state.
//!
//! `LOCUS_BENCH_MIB` (default 1024) in 64 objects; one metadata service and two cache
//! nodes on loopback; `locus dataset import ds s3://locus/ds --replicas 1`. Reference: every
//! object GET with 8 in flight (the import's default parallelism), bytes received and
//! dropped. The page cache is dropped before each (the server reads its disk), and the
//! reference runs both before and after the import so a drifting server shows.
//!
//!     cargo bench --bench s3_import
//!     LOCUS_BENCH_IMPORT_ARGS="--parallel 16" cargo bench --bench s3_import
//!
//! Needs `weed` (scripts/setup-debian.sh installs it) and root to drop caches.

use locus_testkit as support;

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use support::*;

async fn parallel_get(
    store: &Arc<dyn object_store::ObjectStore>,
    keys: &[object_store::path::Path],
) -> (u64, f64) {
    let t = Instant::now();
    let total: u64 = futures_util::stream::iter(keys.iter().cloned().map(|k| {
        let store = store.clone();
        async move {
            let mut s = store.get(&k).await.unwrap().into_stream();
            let mut n = 0u64;
            while let Some(b) = s.next().await {
                n += b.unwrap().len() as u64;
            }
            n
        }
    }))
    .buffer_unordered(8)
    .fold(0u64, |a, n| async move { a + n })
    .await;
    (total, t.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("s3_import: bench");
        return;
    }
    let mib = env_u64("LOCUS_BENCH_MIB", 1024) as usize;
    let objects = 64usize;
    let each = (mib << 20) / objects;
    let h = Harness::new("bench-s3-import");
    let weed = h.start_weed().await;
    for (k, v) in weed.env() {
        std::env::set_var(k, v);
    }
    let bucket = weed.bucket();
    let mut keys = Vec::new();
    for i in 0..objects {
        let k = object_store::path::Path::from(format!("ds/part-{i:03}.bin"));
        bucket
            .put(&k, pseudo_random(4000 + i as u64, each).into())
            .await
            .unwrap();
        keys.push(k);
    }
    let total = (each * objects) as u64;
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut nodes = Vec::new();
    for i in 1..=2 {
        let mut o = NodeOpts::host(i);
        o.capacity = "64GiB";
        nodes.push(h.start_node(&format!("n{i}"), &m, o).await);
    }

    let cold = drop_caches();
    let (b, before) = parallel_get(&bucket, &keys).await;
    assert_eq!(b, total);
    drop_caches();
    let t = Instant::now();
    let extra = std::env::var("LOCUS_BENCH_IMPORT_ARGS").unwrap_or_default();
    let mut args = vec![
        "dataset",
        "import",
        "ds",
        "s3://locus/ds",
        "--replicas",
        "1",
        "--json",
    ];
    args.extend(extra.split_whitespace());
    let perf = profile("s3-import");
    let out = m.cli(&args);
    stop_profile(perf);
    let took = t.elapsed().as_secs_f64();
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    drop_caches();
    let (_, after) = parallel_get(&bucket, &keys).await;
    let mibs = |secs: f64| total as f64 / secs / (1 << 20) as f64;
    let reference = mibs(before).min(mibs(after));
    println!(
        "\ns3_import: {} MiB in {objects} objects on SeaweedFS (loopback); page cache {}\n",
        total >> 20,
        if cold {
            "dropped before each"
        } else {
            "NOT dropped (not root)"
        }
    );
    println!("| measure | MiB/s |");
    println!("|---|---|");
    println!(
        "| raw parallel GET, 8 in flight, before the import | {:.0} |",
        mibs(before)
    );
    println!(
        "| raw parallel GET, 8 in flight, after the import | {:.0} |",
        mibs(after)
    );
    println!(
        "| locus dataset import, R=1, whole command | {:.0} ({:.2}× the slower GET) |",
        mibs(took),
        mibs(took) / reference
    );
    println!("\nimport report: {report}");
    drop(nodes);
    drop(m);
}
