//! Backup throughput: a full `locus backup run` of a dataset against the raw PUT
//! throughput of the same S3 server measured in the same run, then an incremental run of
//! the unchanged dataset (bytes uploaded, time).
//!
//!     cargo bench --bench backup
//!     LOCUS_BENCH_BACKUP_MIB=512 LOCUS_BENCH_FILE_MIB=8 cargo bench --bench backup
//!
//! The server is SeaweedFS (`weed`, installed by scripts/setup-debian.sh): one process on
//! this host, data on this disk. The cluster is a metadata service and three cache nodes on
//! the same host, dataset imported with one replica (each node uploads its third). The raw
//! reference PUTs the same files from the bench process through object_store with as
//! many uploads in flight as the three nodes use together (3 × 4), without hashing; its
//! objects are deleted before the backup runs. Everything is in the page cache, so both
//! sides are bound by the server, not by reading.

use locus_testkit as support;

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};
use support::*;

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

async fn raw_put(store: Arc<dyn ObjectStore>, files: &[std::path::PathBuf], in_flight: usize) -> (u64, f64) {
    let t = Instant::now();
    let mut puts = futures_util::stream::iter(files.iter().enumerate().map(|(i, p)| {
        let store = store.clone();
        let p = p.clone();
        async move {
            let data = bytes::Bytes::from(std::fs::read(&p).unwrap());
            let n = data.len() as u64;
            let key = object_store::path::Path::from(format!("raw/{i:05}"));
            let up = store.put_multipart(&key).await.unwrap();
            let mut w = WriteMultipart::new_with_chunk_size(up, 8 << 20);
            w.put(data);
            w.finish().await.unwrap();
            n
        }
    }))
    .buffer_unordered(in_flight);
    let mut bytes = 0;
    while let Some(n) = puts.next().await {
        bytes += n;
    }
    (bytes, t.elapsed().as_secs_f64())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("backup: bench");
        return;
    }
    let total_mib = env_usize("LOCUS_BENCH_BACKUP_MIB", 2048);
    let file_mib = env_usize("LOCUS_BENCH_FILE_MIB", 16).max(1);
    let h = Harness::new("bench-backup");
    let weed = h.start_weed().await;
    for (k, v) in weed.env() {
        std::env::set_var(k, v);
    }
    let (m, _nodes) = cluster(&h, 3, |i| NodeOpts {
        capacity: "64GiB",
        ..NodeOpts::host(i)
    })
    .await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let n = (total_mib / file_mib).max(1);
    let mut files = Vec::new();
    for i in 0..n {
        let p = src.join(format!("part-{i:05}.bin"));
        std::fs::write(&p, pseudo_random(i as u64, file_mib << 20)).unwrap();
        files.push(p);
    }
    let t = Instant::now();
    let o = m.cli(&[
        "dataset",
        "import",
        "bench",
        src.to_str().unwrap(),
        "--replicas",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    eprintln!(
        "imported {} MiB in {:.1}s",
        n * file_mib,
        t.elapsed().as_secs_f64()
    );

    let bucket = weed.bucket();
    let (raw_bytes, raw_s) = raw_put(bucket.clone(), &files, 12).await;
    let raw: Vec<_> = bucket
        .list(Some(&object_store::path::Path::from("raw")))
        .map(|m| m.unwrap().location)
        .collect()
        .await;
    for k in raw {
        bucket.delete(&k).await.unwrap();
    }

    let run = |what: &str| {
        let o = m.cli(&["backup", "run", "--to", "s3://locus/bench", "--json"]);
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v
    };
    let full = run("full");
    let incr = run("incremental");
    let gbs = |b: u64, s: f64| b as f64 / s / 1e9;
    let raw_gbs = gbs(raw_bytes, raw_s);
    let full_s = full["duration_s"].as_f64().unwrap();
    let full_b = full["bytes_uploaded"].as_u64().unwrap();
    let full_gbs = gbs(full_b, full_s);
    println!();
    println!(
        "backup: {} files of {} MiB ({:.2} GiB), 3 nodes, one replica; S3 server: SeaweedFS on this host",
        n,
        file_mib,
        (n * file_mib) as f64 / 1024.0
    );
    println!("| run | bytes uploaded | time | throughput |");
    println!("|---|---:|---:|---:|");
    println!(
        "| raw PUT, object_store, 12 in flight | {} | {:.2} s | {:.3} GB/s |",
        raw_bytes, raw_s, raw_gbs
    );
    println!(
        "| locus backup run (full) | {} | {:.2} s | {:.3} GB/s ({:.2}× raw) |",
        full_b,
        full_s,
        full_gbs,
        full_gbs / raw_gbs
    );
    println!(
        "| locus backup run (unchanged, incremental) | {} | {:.2} s | - |",
        incr["bytes_uploaded"].as_u64().unwrap(),
        incr["duration_s"].as_f64().unwrap()
    );
    assert_eq!(incr["bytes_uploaded"].as_u64(), Some(0));
}
