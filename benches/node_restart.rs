//! A node holding millions of blobs: how long until it serves again after a restart,
//! and what the store's group commit takes for small blobs against one-by-one writes.
//!
//! 1. Fills a node's data dir with N small blobs (`LOCUS_BENCH_BLOBS`, default 1,000,000;
//!    80 bytes each, cached, not pinned) through the store's own write path:
//!    `finish_staged` + `commit_batch`, 1,000 blobs a batch, two writer threads. The first
//!    2,000 are written one by one with `finish` as the reference in the same run.
//! 2. Starts a metadata service and `locus node serve` on that dir, stops the node,
//!    drops the page cache (cold; needs root, else says warm), and restarts it.
//! 3. From the restart: when the node listens, and when its first read is answered — a
//!    random blob through the local socket (`EnsureLocal`, then the file read and
//!    compared), as a mount's first read. Then how long the background walk of the blob
//!    directories took (the node's log), which is what a restart paid before it served.
//!
//! Run: `cargo bench --bench node_restart`, or `LOCUS_BENCH_BLOBS=10000000 cargo bench
//! --bench node_restart` (about 40 GB of disk and 10M inodes: one 4 KiB block each).

use locus_testkit as support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_cache_node::store::{BlobStore, StoreConfig};
use locus_proto::{nodepb, BlobHash};
use support::*;

const BATCH: usize = 1000;

fn blob(i: u64) -> Vec<u8> {
    format!("blob {i:012} of the node-restart bench, eighty bytes long with padding.......\n").into_bytes()
}

fn open(dir: &Path) -> Arc<BlobStore> {
    BlobStore::open(StoreConfig {
        dirs: vec![dir.to_path_buf()],
        capacity: 1 << 40,
        reserve: 0,
        readers_gid: None,
    })
    .expect("open the store")
    .0
}

/// Writes blobs `from..to` one by one; blobs per second.
fn one_by_one(s: &Arc<BlobStore>, from: u64, to: u64) -> f64 {
    let t = Instant::now();
    for i in from..to {
        let data = blob(i);
        if let Some(mut w) = s
            .begin_write(BlobHash::of(&data), data.len() as u64, 1 << 16, false)
            .unwrap()
        {
            w.write(&data).unwrap();
            w.finish().unwrap();
        }
    }
    (to - from) as f64 / t.elapsed().as_secs_f64()
}

/// Writes blobs `from..to` in batches from two threads; blobs per second.
fn batched(s: &Arc<BlobStore>, from: u64, to: u64) -> f64 {
    let t = Instant::now();
    let next = std::sync::atomic::AtomicU64::new(from);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| loop {
                let start = next.fetch_add(BATCH as u64, std::sync::atomic::Ordering::Relaxed);
                if start >= to {
                    break;
                }
                let mut staged = Vec::with_capacity(BATCH);
                for i in start..(start + BATCH as u64).min(to) {
                    let data = blob(i);
                    if let Some(mut w) = s
                        .begin_write(BlobHash::of(&data), data.len() as u64, 1 << 16, false)
                        .unwrap()
                    {
                        w.write(&data).unwrap();
                        staged.push(w.finish_staged().unwrap());
                    }
                }
                s.commit_batch(staged).unwrap();
                if start % 1_000_000 < BATCH as u64 {
                    eprintln!("  {start} blobs written, {:.0}s", t.elapsed().as_secs_f64());
                }
            });
        }
    });
    (to - from) as f64 / t.elapsed().as_secs_f64()
}

fn rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_u64("LOCUS_BENCH_BLOBS", 1_000_000);
    let h = Harness::new("bench-node-restart");
    let data = h.path("n1").join("data");
    std::fs::create_dir_all(&data).unwrap();
    println!("node restart with {n} blobs of {} bytes", blob(0).len());

    let (single, grouped) = {
        let s = open(&data);
        let single = one_by_one(&s, 0, 2000);
        let grouped = batched(&s, 2000, n);
        (single, grouped)
    };
    println!(
        "  writing: one by one (finish) {single:.0} blobs/s; group commit of {BATCH} \
         (finish_staged + commit_batch, 2 threads) {grouped:.0} blobs/s ({:.1}x)",
        grouped / single
    );

    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut node = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("1TiB"))
        .await;
    node.daemon.terminate().await;
    let cold = drop_caches();
    let pick = n / 2 + 7;
    let want = blob(pick);
    let hash = BlobHash::of(&want);

    let t = Instant::now();
    node.restart().await;
    let listening = t.elapsed();
    let mut local = locus_proto::client::connect_local_node(&node.socket);
    let path = loop {
        match local
            .ensure_local(nodepb::EnsureLocalRequest {
                hash: hash.0.to_vec(),
                size: want.len() as u64,
                chunk_size: 1 << 16,
            })
            .await
        {
            Ok(r) => break r.into_inner().path,
            Err(e) if t.elapsed() < Duration::from_secs(600) => {
                if e.code() != tonic::Code::Unavailable {
                    panic!("first read: {e}");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("no answer in 10 minutes: {e}"),
        }
    };
    assert_eq!(
        std::fs::read(&path).unwrap(),
        want,
        "the first read is the blob's bytes"
    );
    let first_read = t.elapsed();
    let rss = rss_mib(node.daemon.pid());
    println!(
        "  restart ({}): listening after {:.2}s, first read answered after {:.2}s; node RSS {rss:.0} MiB",
        if cold {
            "page cache dropped"
        } else {
            "WARM: not root, the page cache was not dropped"
        },
        listening.as_secs_f64(),
        first_read.as_secs_f64()
    );

    // The walk of the blob directories, now beside serving: what a restart waited for.
    let walked = loop {
        let log = std::fs::read_to_string(&node.daemon.log).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains("blob directories checked")) {
            break l.to_string();
        }
        assert!(t.elapsed() < Duration::from_secs(3600), "the walk never finished");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let secs = walked
        .split(" in ")
        .nth(1)
        .and_then(|x| {
            x.trim_end_matches('s')
                .split_whitespace()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default();
    println!("  background walk of the blob directories: {secs} (no longer before serving)");
    node.daemon.terminate().await;
}
