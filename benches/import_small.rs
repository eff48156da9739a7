//! Import of many small files, end to end: `locus dataset import` of N files of 1 KiB
//! from a local directory onto two nodes with two replicas (two hosts by label, one
//! machine), every blob durable on both before the commit.
//!
//! Measured in the same run: files per second of the import; the CPU seconds of every
//! process involved (the CLI, both nodes, the metadata service) per thousand files; and
//! the import's own split (hashing, sending, commit) from its JSON report. Reference in
//! the same run: the same files written and fsynced one by one into a directory on the
//! same disk (a node's cost per file before group commit: a file fsync and a directory
//! fsync each), over the first 2,000 files.
//!
//! Run: `cargo bench --bench import_small` (200,000 files), or
//! `LOCUS_BENCH_FILES=1000000 cargo bench --bench import_small`.

use locus_testkit as support;

use std::io::Write;
use std::time::Instant;

use support::*;

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

    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("64GiB"))
        .await;
    let n2 = h
        .start_node("n2", &m, NodeOpts::host(2).with_capacity("64GiB"))
        .await;
    let pids = [m.daemon.pid(), n1.daemon.pid(), n2.daemon.pid()];
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
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["files"].as_u64(), Some(n as u64), "{r}");
    let after: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    let cpu: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let per_k = |s: f64| s / n as f64 * 1000.0;
    println!(
        "  import: {took:.1}s, {:.0} files/s ({:.1}x the one-by-one fsync reference); hashing {:.1}s, sending {:.1}s",
        n as f64 / took,
        n as f64 / took / fsync_rate,
        r["hash_seconds"].as_f64().unwrap_or(0.0),
        r["upload_seconds"].as_f64().unwrap_or(0.0),
    );
    println!(
        "  CPU per 1,000 files: CLI {:.3}s (at least; sampled every 50 ms), nodes {:.3}s + {:.3}s, metadata {:.3}s",
        per_k(cli_cpu),
        per_k(cpu[1]),
        per_k(cpu[2]),
        per_k(cpu[0])
    );
}
