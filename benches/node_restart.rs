//! A node holding millions of blobs: how long until it serves again after a restart,
//! and what the store takes small blobs at: packed, group-committed files, one by one.
//!
//! 1. Fills a node's data dir with N small blobs (`LOCUS_BENCH_BLOBS`, default 1,000,000;
//!    80 bytes each, cached, not pinned) through the store's own write paths: the first
//!    2,000 one by one (`finish`), the next 20,000 a file each with group commit
//!    (`finish_staged` + `commit_batch`, 1,000 a batch), the rest in packs of 4,096
//!    (`write_packed`, what a `WriteBlobs` call of an import becomes); two writer threads
//!    for the batched ways.
//! 2. Starts a metadata service and `locus node serve` on that dir, stops the node,
//!    drops the page cache (cold; needs root, else says warm), and restarts it.
//! 3. From the restart: when the node listens, and when its first read is answered — a
//!    random blob through the local socket (`EnsureLocal`, then the file read and
//!    compared), as a mount's first read. Then how long the background walk of the blob
//!    directories took (the node's log), which is what a restart paid before it served.
//!
//! Run: `cargo bench --bench node_restart`, or `LOCUS_BENCH_BLOBS=10000000 cargo bench
//! --bench node_restart` (packed: about 1 GB of packs and 2 GB of index).

use locus_testkit as support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_cache_node::store::{BlobStore, StoreConfig};
use locus_proto::{nodepb, BlobHash};
use support::*;

const BATCH: usize = 1000;
/// Blobs per pack: the most one `WriteBlobs` call carries.
const PACK: usize = 4096;
/// Blobs written a file each with group commit, as the reference for packs.
const GROUPED: u64 = 20_000;

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

/// Writes blobs `from..to` in packs from two threads; blobs per second.
fn packed(s: &Arc<BlobStore>, from: u64, to: u64) -> f64 {
    let t = Instant::now();
    let next = std::sync::atomic::AtomicU64::new(from);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| loop {
                let start = next.fetch_add(PACK as u64, std::sync::atomic::Ordering::Relaxed);
                if start >= to {
                    break;
                }
                let data: Vec<Vec<u8>> = (start..(start + PACK as u64).min(to)).map(blob).collect();
                let refs: Vec<(BlobHash, &[u8])> = data.iter().map(|d| (BlobHash::of(d), &d[..])).collect();
                s.write_packed(&refs, 1 << 16, false).unwrap();
                if start % 1_000_000 < PACK as u64 {
                    eprintln!("  {start} blobs written, {:.0}s", t.elapsed().as_secs_f64());
                }
            });
        }
    });
    (to - from) as f64 / t.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_u64("LOCUS_BENCH_BLOBS", 1_000_000);
    let h = Harness::new("bench-node-restart");
    let data = h.path("n1").join("data");
    std::fs::create_dir_all(&data).unwrap();
    println!("node restart with {n} blobs of {} bytes", blob(0).len());

    assert!(
        n > 2000 + GROUPED,
        "LOCUS_BENCH_BLOBS: more than {}",
        2000 + GROUPED
    );
    let (single, grouped, packs) = {
        let s = open(&data);
        let single = one_by_one(&s, 0, 2000);
        let grouped = batched(&s, 2000, 2000 + GROUPED);
        let packs = packed(&s, 2000 + GROUPED, n);
        (single, grouped, packs)
    };
    println!(
        "  writing: one by one (finish) {single:.0} blobs/s; a file each with group commit of \
         {BATCH} (finish_staged + commit_batch, 2 threads) {grouped:.0} blobs/s ({:.1}x); packs \
         of {PACK} (write_packed, 2 threads) {packs:.0} blobs/s ({:.1}x)",
        grouped / single,
        packs / single
    );

    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut node = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("1TiB"))
        .await;
    node.daemon.terminate().await;
    let index: u64 = std::fs::read_dir(data.join("index"))
        .unwrap()
        .flatten()
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "  index on disk: {:.0} MiB ({:.0} B per blob)",
        index as f64 / (1 << 20) as f64,
        index as f64 / n as f64
    );
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
                packed_ok: true,
            })
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(e) if t.elapsed() < Duration::from_secs(600) => {
                if e.code() != tonic::Code::Unavailable {
                    panic!("first read: {e}");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("no answer in 10 minutes: {e}"),
        }
    };
    let mut got = vec![0u8; want.len()];
    std::os::unix::fs::FileExt::read_exact_at(
        &std::fs::File::open(&path.path).unwrap(),
        &mut got,
        path.offset,
    )
    .unwrap();
    assert_eq!(got, want, "the first read is the blob's bytes");
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
