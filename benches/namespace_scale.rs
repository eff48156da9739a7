//! The scale a GPU cluster's datasets have: a version of ten million entries built through
//! the real API, then mounted — once, and by many mounts at once. What it shows is that a
//! mount's start, its memory and the metadata service's work per mount do not grow with
//! the number of files (the sealed namespace is fetched from a node and used in place).
//!
//!     cargo bench --bench namespace_scale                       # 10,000,000 files, 64 mounts
//!     LOCUS_SCALE_FILES=1000000 LOCUS_SCALE_MOUNTS=8 cargo bench --bench namespace_scale
//!
//! Every file points at one real 1 KiB blob (so any file reads back), in directories of
//! 1,000. Steps and what each measures:
//! - build: the client seals the manifest as an importer does (streamed to a file) and
//!   stores the namespace on the node; upload in pages; commit (the service checks the
//!   whole manifest and seals it again); RocksDB bytes per entry;
//! - one mount with the local node: `locus mount` until ready; a `find` over the whole
//!   tree; the mount server's RssAnon after it; `stat` of random files, first touch and
//!   again (p50/p99 of the second pass, the kernel's cached answer);
//! - the reference (up to 2M files): the same tree of empty files on the local file
//!   system, walked by `find` (names; then `-printf %s`, every entry's attributes) cold
//!   (caches dropped) and warm, against a fresh mount walked cold and warm, with each
//!   `--readdirplus` policy;
//! - N mounts started at once, each its own `locus mount` process talking to the metadata
//!   service through a counting TCP proxy: until all are ready, the service's CPU time per
//!   mount (from /proc) and bytes it sent per mount (the proxy's count).
//!
//! Prints one table; record it in bench/RESULTS.md with the machine and date.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::manifest::{BlobHash, Entry, EntryKind, RelPath};
use locus_proto::{nodepb, pb};
use locus_testkit::*;

const PER_DIR: usize = 1000;
const FILES_PER_SHARD: usize = 100_000;
const CHUNK: u32 = 4 << 20;
const BLOB: usize = 1024;
const MTIME: i64 = 1_700_000_000_000_000_000;

/// The `--readdirplus` policies the walks are run with, the default first.
const POLICIES: [&str; 3] = ["adaptive", "auto", "all"];

fn dir(path: &str) -> Entry {
    Entry {
        path: RelPath::try_from(path).unwrap(),
        kind: EntryKind::Dir,
        mode: 0o755,
        mtime_ns: MTIME,
    }
}

fn file(i: usize, blob: BlobHash) -> Entry {
    Entry {
        path: RelPath::try_from(format!("top/d{:05}/f{i:08}.jpg", i / PER_DIR)).unwrap(),
        kind: EntryKind::File {
            size: BLOB as u64,
            blob,
            chunks: vec![blob],
            shard: (i / FILES_PER_SHARD) as u32,
        },
        mode: 0o644,
        mtime_ns: MTIME + i as i64,
    }
}

/// The manifest in the sealed namespace's order (parent directory, then name): the root's
/// `top`, the directories under it, then each directory's files.
fn entries(files: usize, blob: BlobHash) -> impl Iterator<Item = Entry> {
    let dirs = files.div_ceil(PER_DIR);
    std::iter::once(dir("top"))
        .chain((0..dirs).map(|d| dir(&format!("top/d{d:05}"))))
        .chain((0..files).map(move |i| file(i, blob)))
}

fn status_kib(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

fn dir_bytes(p: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        let m = e.metadata().unwrap();
        total += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
    }
    total
}

/// A TCP proxy that counts the bytes the server sends back: what the metadata service
/// sent the mounts, on the wire (HTTP/2 and gRPC framing included).
async fn counting_proxy(to: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let s = sent.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
                // Counted as it passes: a mount keeps its connection open.
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            s.fetch_add(n as u64, Ordering::Relaxed);
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
                up.abort();
            });
        }
    });
    (addr, sent)
}

/// `find DIR` printing one byte per entry (or, with `stat`, each entry's size, which
/// needs its attributes): (time, entries seen).
fn walk(dir: &Path, stat: bool) -> (Duration, usize) {
    let t = Instant::now();
    let out = Command::new("find")
        .arg(dir)
        .args(["-printf", if stat { "%s\n" } else { "." }])
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(out.status.success(), "find {}", dir.display());
    let n = if stat {
        out.stdout.iter().filter(|b| **b == b'\n').count()
    } else {
        out.stdout.len()
    };
    (took, n)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("namespace_scale: bench");
        return;
    }
    let files = env_u64("LOCUS_SCALE_FILES", 10_000_000) as usize;
    let mounts = env_u64("LOCUS_SCALE_MOUNTS", 64) as usize;
    let h = Harness::new("bench-namespace");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let node = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("64GiB"))
        .await;
    let mut c = m.client(None).await;
    let cluster = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .cluster_id;

    // The one real blob every file points at.
    let data = pseudo_random(7, BLOB);
    let blob = BlobHash::of(&data);
    write_blob(&node, blob, std::io::Cursor::new(data.clone()), BLOB as u64).await;

    // The importer's part: the sealed namespace, streamed to a file, stored on the node.
    let t = Instant::now();
    let ns_file = h.path("namespace");
    let out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&ns_file).unwrap());
    let mut w = locus_proto::sealed::Writer::new(out, CHUNK).unwrap();
    for e in entries(files, blob) {
        w.push(&e).unwrap();
    }
    let sealed = w.finish("big", &cluster).unwrap();
    let seal_time = t.elapsed();
    let t = Instant::now();
    write_blob(
        &node,
        sealed.hash,
        std::fs::File::open(&ns_file).unwrap(),
        sealed.size,
    )
    .await;
    let store_time = t.elapsed();
    // Entries of the manifest: `top`, its directories, the files.
    let total = files + files.div_ceil(PER_DIR) + 1;

    // Upload in pages, then the commit.
    let t = Instant::now();
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "big".into(),
            chunk_size: CHUNK,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    locus_proto::client::put_entries_paged(&mut c, s.session_id, entries(files, blob).map(pb::Entry::from))
        .await
        .unwrap();
    let shards = (0..files.div_ceil(FILES_PER_SHARD))
        .map(|id| {
            let n = FILES_PER_SHARD.min(files - id * FILES_PER_SHARD) as u64;
            pb::Shard {
                id: id as u32,
                files: n,
                bytes: n * BLOB as u64,
                replicas: vec!["n1".into()],
            }
        })
        .collect();
    locus_proto::client::put_shards_paged(&mut c, s.session_id, shards)
        .await
        .unwrap();
    let upload = t.elapsed();
    let t = Instant::now();
    let v = c
        .commit_version(pb::CommitVersionRequest {
            session_id: s.session_id,
            namespace_blob: sealed.hash.0.to_vec(),
            namespace_size: sealed.size,
        })
        .await
        .unwrap()
        .into_inner()
        .version
        .unwrap();
    let commit = t.elapsed();
    assert_eq!(v.files as usize, files);
    let db = dir_bytes(&m.data_dir.join("db"));
    let target = format!("big@{}", v.version);

    // One mount, with the local node.
    let t = Instant::now();
    let mnt = m.mount("mnt", &target, Some(&node), &[]);
    let ready = t.elapsed();
    let server = mnt.server_pid();
    let anon_ready = status_kib(server, "RssAnon:");
    let (find_time, found) = walk(&mnt.path, false);
    assert_eq!(found, total + 1, "find saw the root and every entry");
    let anon_find = status_kib(server, "RssAnon:");
    // stat of random files: once after the find (which listed them with readdirplus), then
    // the same paths again.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let picks: Vec<_> = (0..10_000)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % files as u64) as usize;
            mnt.path.join(format!("top/d{:05}/f{i:08}.jpg", i / PER_DIR))
        })
        .collect();
    let stat_all = |picks: &[std::path::PathBuf]| {
        let mut lat: Vec<Duration> = picks
            .iter()
            .map(|p| {
                let t = Instant::now();
                let md = std::fs::metadata(p).unwrap();
                let d = t.elapsed();
                assert_eq!(md.len(), BLOB as u64);
                d
            })
            .collect();
        lat.sort_unstable();
        lat
    };
    let first = stat_all(&picks);
    let again = stat_all(&picks);
    // One file's bytes, through the mount.
    assert_eq!(std::fs::read(&picks[0]).unwrap(), data);
    drop(mnt);

    // The same walks over the same tree on the local file system (empty files: a walk
    // reads names and attributes only), cold (page, dentry and inode caches dropped) and
    // warm, against a fresh mount cold and then warm. Skipped above 2M files (making the
    // tree would take longer than the rest) or with LOCUS_SCALE_REFERENCE=0.
    let reference = env_u64("LOCUS_SCALE_REFERENCE", 1) == 1 && files <= 2_000_000;
    let mut walks = Vec::new();
    if reference {
        let local = h.path("local");
        for d in 0..files.div_ceil(PER_DIR) {
            std::fs::create_dir_all(local.join(format!("top/d{d:05}"))).unwrap();
        }
        for i in 0..files {
            std::fs::File::create(local.join(format!("top/d{:05}/f{i:08}.jpg", i / PER_DIR))).unwrap();
        }
        assert!(drop_caches(), "dropping the caches needs root");
        for (what, stat) in [
            ("find (names)", false),
            ("find -printf %s (stat of every entry)", true),
        ] {
            assert!(drop_caches());
            let (ext4_cold, n1) = walk(&local, stat);
            let (ext4_warm, _) = walk(&local, stat);
            let mut row = vec![ext4_cold, ext4_warm];
            for policy in POLICIES {
                // A fresh mount each time: the kernel holds none of its entries.
                let mnt = m.mount(
                    &format!("cold-{stat}-{policy}"),
                    &target,
                    Some(&node),
                    &["--readdirplus", policy],
                );
                assert!(drop_caches());
                let (mount_cold, n2) = walk(&mnt.path, stat);
                let (mount_warm, _) = walk(&mnt.path, stat);
                assert_eq!(n1, n2, "the same tree");
                row.extend([mount_cold, mount_warm]);
            }
            walks.push((what, row));
        }
    }

    // N mounts at once, through the counting proxy.
    let (proxy, sent) = counting_proxy(m.grpc).await;
    let url = format!("http://{proxy}");
    let meta_pid = m.pid();
    let cpu_before = cpu_seconds(meta_pid);
    let sent_before = sent.load(Ordering::Relaxed);
    let t = Instant::now();
    let runtime = h.path("many-runtime");
    let outs: Vec<_> = (0..mounts)
        .map(|i| {
            let path = h.path(&format!("many/{i}"));
            std::fs::create_dir_all(&path).unwrap();
            let log = h.path(&format!("many/{i}.log"));
            Command::new(locus())
                .arg("mount")
                .arg(&target)
                .arg(&path)
                .arg("--node-socket")
                .arg(&node.socket)
                .arg("--log-file")
                .arg(&log)
                .env("LOCUS_METADATA", &url)
                .env("LOCUS_RUNTIME_DIR", &runtime)
                .env_remove("LOCUS_TOKEN")
                .env_remove("LOCUS_CONFIG")
                .spawn()
                .unwrap()
        })
        .collect();
    for mut o in outs {
        assert!(o.wait().unwrap().success(), "a mount failed");
    }
    let all_ready = t.elapsed();
    let cpu = cpu_seconds(meta_pid) - cpu_before;
    let bytes = sent.load(Ordering::Relaxed) - sent_before;
    for i in 0..mounts {
        let p = h.path(&format!("many/{i}"));
        assert!(p.join("top").is_dir(), "mount {i} serves the tree");
        let _ = Command::new(locus())
            .arg("umount")
            .arg(&p)
            .env("LOCUS_RUNTIME_DIR", &runtime)
            .status();
    }

    println!();
    println!(
        "namespace_scale: {files} files in {} directories = {total} entries; namespace {:.1} MiB ({:.0} B/entry)",
        files.div_ceil(PER_DIR),
        sealed.size as f64 / 1048576.0,
        sealed.size as f64 / total as f64
    );
    println!("| step | figure |");
    println!("|---|---|");
    let rate = |d: Duration| {
        format!(
            "{:.2} s ({:.0} entries/s)",
            d.as_secs_f64(),
            total as f64 / d.as_secs_f64()
        )
    };
    println!(
        "| seal the manifest (client, streamed to a file) | {} |",
        rate(seal_time)
    );
    println!(
        "| store the namespace on the node (WriteBlob) | {:.2} s |",
        store_time.as_secs_f64()
    );
    println!(
        "| upload in pages (begin + PutEntries + PutShards) | {} |",
        rate(upload)
    );
    println!(
        "| commit (whole-manifest check, sealed again, atomic write) | {} |",
        rate(commit)
    );
    println!(
        "| RocksDB directory after commit | {:.1} MiB ({:.0} B/entry) |",
        db as f64 / 1048576.0,
        db as f64 / total as f64
    );
    println!(
        "| `locus mount` until ready (local node) | {:.3} s |",
        ready.as_secs_f64()
    );
    println!(
        "| mount server RssAnon when ready | {:.1} MiB |",
        anon_ready / 1024.0
    );
    println!("| `find` over the whole tree | {} |", rate(find_time));
    println!(
        "| mount server RssAnon after the find | {:.1} MiB |",
        anon_find / 1024.0
    );
    println!(
        "| stat of 10,000 random files after the find: p50 / p99 | {:.1} / {:.1} µs |",
        pct(&first, 0.5),
        pct(&first, 0.99)
    );
    println!(
        "| the same again: p50 / p99 | {:.1} / {:.1} µs |",
        pct(&again, 0.5),
        pct(&again, 0.99)
    );
    for (what, row) in &walks {
        let r = |d: &Duration| total as f64 / d.as_secs_f64();
        for (state, at) in [("cold", 0), ("warm", 1)] {
            let ext4 = row[at];
            let mounts: Vec<String> = POLICIES
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    let d = row[2 + 2 * i + at];
                    format!("{:.0} ({:.2}×)", r(&d), ext4.as_secs_f64() / d.as_secs_f64())
                })
                .collect();
            println!(
                "| {what}, {state}: local ext4 / mount --readdirplus {} | {:.0} / {} entries/s |",
                POLICIES.join(" / "),
                r(&ext4),
                mounts.join(" / ")
            );
        }
    }
    println!(
        "| {mounts} mounts started at once: all ready | {:.2} s |",
        all_ready.as_secs_f64()
    );
    println!(
        "| metadata service CPU per mount | {:.2} ms |",
        cpu * 1000.0 / mounts as f64
    );
    println!(
        "| metadata service bytes sent per mount (on the wire) | {:.1} KiB |",
        bytes as f64 / 1024.0 / mounts as f64
    );
}

/// Stores `size` bytes from `r` as blob `hash` on `node`, pinned, in 1 MiB messages.
async fn write_blob(node: &Node, hash: BlobHash, mut r: impl std::io::Read + Send + 'static, size: u64) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let header = nodepb::WriteBlobMessage {
        msg: Some(nodepb::write_blob_message::Msg::Header(nodepb::WriteBlobHeader {
            hash: hash.0.to_vec(),
            size,
            chunk_size: CHUNK,
            pin: true,
        })),
    };
    tx.send(header).await.unwrap();
    let reader = tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            let m = nodepb::WriteBlobMessage {
                msg: Some(nodepb::write_blob_message::Msg::Data(buf[..n].to_vec().into())),
            };
            if tx.blocking_send(m).is_err() {
                break;
            }
        }
    });
    node.client()
        .await
        .write_blob(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap();
    reader.await.unwrap();
    let _ = std::io::stdout().flush();
}
