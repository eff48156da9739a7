//! Peer copies across hosts: `locus warm` (node-to-node FetchBlobs, each blob verified and
//! fsynced by the receiver) on the multi-host test bed, against min(link, the receiving
//! disk's fsynced write rate) measured in the same run.
//!
//! Hosts h0 (n0, holding the whole dataset, `LOCUS_BENCH_MIB` MiB in 16 files), h1 (n1,
//! unshaped link) and h2 (n2, link shaped to `LOCUS_BENCH_LINK_MBIT`, default 2000). Warm
//! copies the dataset onto n1, then onto n2. References, each taken just before its copy:
//! one TCP stream from h0 to the receiving host, and a file of the same size written in
//! 4 MiB writes and fsynced on the filesystem the receiver writes to. The page cache is
//! dropped before each copy (the source reads cold).
//!
//!     cargo bench --bench peer_copy
//!
//! Needs root (namespaces, shaping, dropping caches).

use locus_testkit as support;

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use support::*;

/// MiB/s of writing `bytes` into a new file under `dir` in 4 MiB writes, then fsync.
fn fsync_write_rate(dir: &Path, bytes: u64) -> f64 {
    let p = dir.join("write-reference.tmp");
    let buf = pseudo_random(77, 4 << 20);
    drop_caches();
    let t = Instant::now();
    let mut f = std::fs::File::create(&p).unwrap();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    f.sync_all().unwrap();
    let r = mbs(bytes, t.elapsed());
    drop(f);
    std::fs::remove_file(&p).unwrap();
    // The deleted file's blocks are freed in the background; let that settle before the
    // measured copy.
    let _ = std::process::Command::new("sync").status();
    r
}

#[tokio::main]
async fn main() {
    if !bed_bench_starts("peer_copy") {
        return;
    }
    // Memory freed by one part must not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
    let mib = env_u64("LOCUS_BENCH_MIB", 1024);
    let shaped = env_u64("LOCUS_BENCH_LINK_MBIT", 2000);
    let files = 16usize;
    let each = ((mib as usize) << 20) / files;
    let total = (each * files) as u64;

    let bed = Netbed::new(&[3]).expect("the test bed");
    let h = Harness::new("bench-peer-copy");
    let src = h.path("src");
    write_random_files(&src, "part-", files, each, 300);
    let m = h.start_metadata_on(&bed, MetadataOpts::default()).await;
    let opts = |k: usize| NodeOpts::on(&bed.hosts[k]).with_capacity("64GiB");
    let n0 = h.start_node("n0", &m, opts(0)).await;
    let out = m.cli(&[
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let n1 = h.start_node("n1", &m, opts(1)).await;
    let n2 = h.start_node("n2", &m, opts(2)).await;
    bed.shape_host(2, shaped).unwrap();

    println!(
        "\npeer_copy: {} MiB in {files} files, `locus warm` from n0 (h0); page cache dropped before each copy\n",
        total >> 20
    );
    println!("| receiver | link | link TCP MiB/s | receiving disk, write+fsync MiB/s | warm MiB/s | warm / min(link, disk) |");
    println!("|---|---|---|---|---|---|");
    // LOCUS_BENCH_LINK_MBIT=0: the unshaped receiver only.
    let receivers = [
        (1usize, &n1, "veth, unshaped".to_string()),
        (2, &n2, format!("tbf {shaped} Mbit/s")),
    ];
    for (k, node, link_name) in receivers.into_iter().take(if shaped == 0 { 1 } else { 2 }) {
        let link_bytes = if k == 1 {
            4u64 << 30
        } else {
            (shaped << 20) / 8 * 3
        };
        let link = tcp_rate(&bed.hosts[0], &bed.hosts[k], link_bytes);
        let disk = fsync_write_rate(&node.data_dir, total);
        drop_caches();
        let t = Instant::now();
        let out = m.cli(&["warm", "ds@1", "--nodes", &node.id, "--json"]);
        let took = t.elapsed();
        assert!(out.status.success(), "warm: {}", stderr(&out));
        let held: u64 = node.blob_files().values().map(|b| b.size).sum();
        assert_eq!(held, total, "{} holds every byte", node.id);
        let rate = mbs(total, took);
        println!(
            "| {} ({}) | {link_name} | {link:.0} | {disk:.0} | {rate:.0} | {:.2}× |",
            node.id,
            bed.hosts[k].name,
            rate / link.min(disk)
        );
    }
    drop((n0, n1, n2));
    drop(m);
}
