//! Import of many small files, end to end: `locus dataset import` of N files of 1 KiB
//! from a local directory onto two nodes with two replicas (two hosts by label, one
//! machine), every blob durable on both before the commit.
//!
//! Measured in the same run: files per second of the import; the CPU seconds of every
//! process involved (the CLI, both nodes, the metadata service) per thousand files; and
//! the import's own split (hashing, sending, commit) from its JSON report. Reference in
//! the same run: the same files written and fsynced one by one into a directory on the
//! same disk (a node's cost per file before group commit: a file fsync and a directory
//! fsync each), over the first 2,000 files; and the bound on the reading side: the source
//! tree read cold (page cache dropped, as before the import), every directory listed,
//! every file stat'ed and read whole, by as many threads as the import reads with (8),
//! with the CPU that took. An import cannot beat that read: its own reading is the same.
//! Then the same tree is imported again, unchanged, as a new version: nothing is sent, and
//! the nodes pin the blobs they already hold for it (`HaveBlobs` with `pin`).
//!
//! Run: `cargo bench --bench import_small` (200,000 files), or
//! `LOCUS_BENCH_FILES=1000000 cargo bench --bench import_small`; with `LOCUS_BENCH_PERF=DIR`
//! a system-wide profile of the import lands in `DIR/import-small.data`.

use locus_testkit as support;

use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use support::*;

/// Threads the reference reads the tree with: the import's readers.
const READERS: usize = 8;

/// Reads every file under `root` (one level of directories, as generated) whole, after
/// listing and stat'ing it, from `READERS` threads; files read.
fn read_tree(root: &Path) -> usize {
    let dirs: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|d| d.path())
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..READERS)
            .map(|_| {
                sc.spawn(|| {
                    let (mut files, mut buf) = (0, Vec::with_capacity(4096));
                    while let Some(d) = dirs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        for e in std::fs::read_dir(d).unwrap().flatten() {
                            let p = e.path();
                            let _ = std::fs::symlink_metadata(&p).unwrap();
                            buf.clear();
                            std::fs::File::open(&p).unwrap().read_to_end(&mut buf).unwrap();
                            files += 1;
                        }
                    }
                    files
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

/// CPU seconds this process has used (user + system).
fn own_cpu() -> f64 {
    cpu_seconds(std::process::id())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_u64("LOCUS_BENCH_FILES", 200_000) as usize;
    let h = Harness::new("bench-import-small");
    let src = h.path("src");
    for d in 0..(n / 1000).max(1) {
        std::fs::create_dir_all(src.join(format!("d{d:04}"))).unwrap();
    }
    for i in 0..n {
        let mut body = format!("file {i:09}\n").into_bytes();
        body.resize(1024, b'.');
        std::fs::write(src.join(format!("d{:04}/f{i:09}", i / 1000)), body).unwrap();
    }
    println!("import of {n} files of 1 KiB, R=2 on two nodes (one machine)");

    // Reference: one by one, file fsync + directory fsync, as a node did per blob.
    let refdir = h.path("fsync-ref");
    std::fs::create_dir_all(&refdir).unwrap();
    let t = Instant::now();
    let k = n.min(2000);
    for i in 0..k {
        let p = refdir.join(format!("f{i}"));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&[7u8; 1024]).unwrap();
        f.sync_all().unwrap();
        std::fs::File::open(&refdir).unwrap().sync_all().unwrap();
    }
    let fsync_rate = k as f64 / t.elapsed().as_secs_f64();
    println!("  reference: a file and its directory fsynced one by one: {fsync_rate:.0} files/s");

    // The reading bound, cold like the import's source.
    drop_caches();
    let (t, c) = (Instant::now(), own_cpu());
    assert_eq!(read_tree(&src), n);
    let (read_took, read_cpu) = (t.elapsed().as_secs_f64(), own_cpu() - c);
    let read_rate = n as f64 / read_took;
    println!(
        "  reference: the source read cold ({READERS} threads: list, stat, read): {read_rate:.0} files/s, \
         {:.3}s CPU per 1,000 files",
        read_cpu / n as f64 * 1000.0
    );

    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("64GiB"))
        .await;
    let n2 = h
        .start_node("n2", &m, NodeOpts::host(2).with_capacity("64GiB"))
        .await;
    let pids = [m.daemon.pid(), n1.daemon.pid(), n2.daemon.pid()];
    // LOCUS_BENCH_PERF=DIR: where every process spent its CPU during the import.
    let perf = profile("import-small");
    let first = import(&m, &src, &pids, n);
    stop_profile(perf);
    let r = &first.report;
    println!(
        "  import: {:.1}s, {:.0} files/s ({:.1}x the one-by-one fsync reference, {:.2}x the cold \
         read of the source); hashing {:.1}s, sending {:.1}s",
        first.took,
        n as f64 / first.took,
        n as f64 / first.took / fsync_rate,
        n as f64 / first.took / read_rate,
        r["hash_seconds"].as_f64().unwrap_or(0.0),
        r["upload_seconds"].as_f64().unwrap_or(0.0),
    );
    for p in r["phases"].as_array().into_iter().flatten() {
        println!(
            "    {}: {:.1}s",
            p["phase"].as_str().unwrap_or("?"),
            p["seconds"].as_f64().unwrap_or(0.0)
        );
    }
    first.print_cpu(n);

    // The same tree again, unchanged: the nodes hold every blob, so nothing is sent, and
    // what is left is reading and hashing the source, asking the nodes (which pin what
    // they hold for the import) and the manifest.
    let again = import(&m, &src, &pids, n);
    println!(
        "  import again, unchanged: {:.1}s, {:.0} files/s; sent {} bytes",
        again.took,
        n as f64 / again.took,
        again.report["uploaded_bytes"].as_u64().unwrap_or(0),
    );
    again.print_cpu(n);
}

/// One `locus dataset import` of the tree: its time, the CPU of the CLI and of each
/// process in `pids` (metadata, node, node), and its JSON report.
struct Imported {
    took: f64,
    cli_cpu: f64,
    cpu: Vec<f64>,
    report: serde_json::Value,
}

impl Imported {
    fn print_cpu(&self, n: usize) {
        let per_k = |s: f64| s / n as f64 * 1000.0;
        println!(
            "  CPU per 1,000 files: CLI {:.3}s (at least; sampled every 50 ms), nodes {:.3}s + {:.3}s, metadata {:.3}s",
            per_k(self.cli_cpu),
            per_k(self.cpu[1]),
            per_k(self.cpu[2]),
            per_k(self.cpu[0])
        );
    }
}

/// Imports `src` as a new version of dataset "small" with the page cache dropped first.
fn import(m: &Metadata, src: &Path, pids: &[u32; 3], n: usize) -> Imported {
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    drop_caches();
    let t = Instant::now();
    let mut cmd = m.cli_command(
        &[
            "dataset",
            "import",
            "small",
            src.to_str().unwrap(),
            "--replicas",
            "2",
            "--json",
        ],
        &[],
    );
    let child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let cli_pid = child.id();
    // The CLI's CPU is read just before it is reaped.
    let mut cli_cpu = 0.0;
    let out = {
        let mut child = child;
        loop {
            if let Some(_status) = child.try_wait().unwrap() {
                break child.wait_with_output().unwrap();
            }
            cli_cpu = cpu_seconds(cli_pid).max(cli_cpu);
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let took = t.elapsed().as_secs_f64();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["files"].as_u64(), Some(n as u64), "{report}");
    let after: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    Imported {
        took,
        cli_cpu,
        cpu: after.iter().zip(&before).map(|(a, b)| a - b).collect(),
        report,
    }
}
