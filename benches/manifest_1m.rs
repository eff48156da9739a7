//! Whole-system benchmark of the metadata service with a 1,000,000-entry manifest:
//! upload (paged), commit, full listing in pages, one directory listing, RocksDB size,
//! the service's peak memory. Runs the release `locus` binary as a real process. (Mounting
//! a version this size, and many of them at once: `benches/namespace_scale.rs`.)
//!
//!     cargo bench --bench manifest_1m            # 1,000,000 files
//!     LOCUS_SCALE_FILES=200000 cargo bench --bench manifest_1m
//!
//! Prints one table; record it in bench/RESULTS.md with the machine and date.

use locus_testkit as support;

use std::time::Instant;

use locus_proto::pb;
use support::*;

/// Bytes of the files in `p` whose names end with `suffix` (RocksDB's tables: `.sst`;
/// its write-ahead log: `.log`).
fn bytes_ending(p: &std::path::Path, suffix: &str) -> u64 {
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum()
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        let m = e.metadata().unwrap();
        total += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
    }
    total
}

fn peak_rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        // `cargo bench -- --list` and test-runner probes expect a quick answer.
        println!("manifest_1m: bench");
        return;
    }
    let files: usize = std::env::var("LOCUS_SCALE_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let h = Harness::new("bench-manifest");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;

    let t = Instant::now();
    let (entries, shards) = synthetic_manifest("b", files, 1000, 10_000, 1 << 22);
    let gen = t.elapsed();
    let total = entries.len();
    let chunk_hashes: usize = entries.iter().map(|e| e.chunks.len()).sum();

    // What an importer sends with the commit (built before the clock starts: the
    // importer's work, not the service's).
    let (sealed, hash) = locus_testkit::seal_manifest(&mut c, "big", 1 << 22, &entries)
        .await
        .expect("cluster info");
    let t = Instant::now();
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "big".into(),
            chunk_size: 1 << 22,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    locus_proto::client::put_entries_paged(&mut c, s.session_id, entries)
        .await
        .unwrap();
    locus_proto::client::put_shards_paged(&mut c, s.session_id, shards)
        .await
        .unwrap();
    let upload = t.elapsed();
    let t = Instant::now();
    let v = c
        .commit_version(pb::CommitVersionRequest {
            session_id: s.session_id,
            namespace_blob: hash.0.to_vec(),
            namespace_size: sealed.len() as u64,
        })
        .await
        .unwrap()
        .into_inner()
        .version
        .unwrap();
    let commit = t.elapsed();
    assert_eq!(v.files as usize, files);

    let r = pb::VersionRef {
        dataset: "big".into(),
        version: v.version,
    };
    let list = |without_chunks: bool| {
        let r = r.clone();
        let mut c = c.clone();
        async move {
            let t = Instant::now();
            let mut token = Vec::new();
            let mut n = 0;
            let mut pages = 0;
            loop {
                let resp = c
                    .list_entries(pb::ListEntriesRequest {
                        r#ref: Some(r.clone()),
                        directory: None,
                        page_token: token,
                        limit: 10_000,
                        without_chunks,
                    })
                    .await
                    .unwrap()
                    .into_inner();
                n += resp.entries.len();
                pages += 1;
                if resp.next_page_token.is_empty() {
                    break;
                }
                token = resp.next_page_token;
            }
            assert_eq!(n, total);
            (t.elapsed(), pages)
        }
    };
    let (list_tree, pages) = list(true).await;
    let (list_full, _) = list(false).await;

    let t = Instant::now();
    let rounds = 200;
    for i in 0..rounds {
        let d = format!("top/d{:05}", (i * 7) % (files / 1000).max(1));
        let (_, e) = locus_proto::client::list_all_entries(&mut c, r.clone(), Some(d), true)
            .await
            .unwrap();
        assert!(!e.is_empty());
    }
    let dir_each = t.elapsed() / rounds as u32;
    let db = dir_bytes(&m.data_dir.join("db"));
    let (sst, wal) = (
        bytes_ending(&m.data_dir.join("db"), ".sst"),
        bytes_ending(&m.data_dir.join("db"), ".log"),
    );
    let rss = peak_rss_mib(m_pid(&m));

    // Backups: the catalogue export (one RocksDB snapshot, streamed over gRPC), the plan a
    // backup run derives from it, and a restore into a fresh RocksDB.
    let t = Instant::now();
    let mut export = Vec::new();
    let mut s = c
        .export_catalog(pb::ExportCatalogRequest {})
        .await
        .unwrap()
        .into_inner();
    {
        use futures_util::StreamExt;
        while let Some(chunk) = s.next().await {
            export.extend_from_slice(&chunk.unwrap().data);
        }
    }
    let export_time = t.elapsed();
    let t = Instant::now();
    let plan = locus_metadata::snapshot::plan(&export[..]).unwrap();
    let plan_time = t.elapsed();
    assert!(plan.datasets.contains_key("big"));
    let restore_dir = h.path("restored");
    let t = Instant::now();
    {
        let store = locus_metadata::store::RocksStore::open(&restore_dir).unwrap();
        locus_metadata::snapshot::restore(&export[..], &store, "file:///bench", "bench", None).unwrap();
    }
    let restore_time = t.elapsed();

    println!();
    println!(
        "manifest_1m: {files} files + {} dirs = {total} entries, {chunk_hashes} chunk hashes",
        total - files
    );
    println!("| step | time | rate |");
    println!("|---|---|---|");
    let rate = |d: std::time::Duration| format!("{:.0} entries/s", total as f64 / d.as_secs_f64());
    println!(
        "| generate manifest (client, in memory) | {:.2} s | {} |",
        gen.as_secs_f64(),
        rate(gen)
    );
    println!(
        "| upload in pages (begin + PutEntries + PutShards) | {:.2} s | {} |",
        upload.as_secs_f64(),
        rate(upload)
    );
    println!(
        "| commit (whole-manifest check + atomic write) | {:.2} s | {} |",
        commit.as_secs_f64(),
        rate(commit)
    );
    println!(
        "| list all, {pages} pages of 10,000, no chunk hashes | {:.2} s | {} |",
        list_tree.as_secs_f64(),
        rate(list_tree)
    );
    println!(
        "| list all, with chunk hashes | {:.2} s | {} |",
        list_full.as_secs_f64(),
        rate(list_full)
    );
    println!(
        "| list one 1,000-entry directory | {:.2} ms | |",
        dir_each.as_secs_f64() * 1000.0
    );
    println!(
        "| RocksDB directory size | {:.1} MiB | {:.0} B/entry |",
        db as f64 / 1048576.0,
        db as f64 / total as f64
    );
    println!(
        "| of which tables (.sst) / write-ahead log (.log) | {:.1} / {:.1} MiB | {:.0} / {:.0} B/entry |",
        sst as f64 / 1048576.0,
        wal as f64 / 1048576.0,
        sst as f64 / total as f64,
        wal as f64 / total as f64
    );
    println!("| metadata service peak RSS | {rss:.0} MiB | |");
    println!(
        "| backup: export the catalogue over gRPC ({:.1} MiB) | {:.2} s | {} |",
        export.len() as f64 / 1048576.0,
        export_time.as_secs_f64(),
        rate(export_time)
    );
    println!(
        "| backup: plan (every blob and its first replica) | {:.2} s | {} |",
        plan_time.as_secs_f64(),
        rate(plan_time)
    );
    println!(
        "| restore: the export into a fresh RocksDB | {:.2} s | {} |",
        restore_time.as_secs_f64(),
        rate(restore_time)
    );
}

fn m_pid(m: &Metadata) -> u32 {
    m.pid()
}
