//! Remote reads across hosts: a mount with no local node reading cold, on the multi-host
//! test bed, against the two bounds it cannot beat, measured in the same run.
//!
//! Hosts h0 (cache node n0, holding every blob) and h1 (the mount, no node), each its own
//! network namespace; the metadata service on the bed's gateway. For each link setting
//! (unshaped veth, then h1's link shaped with tbf to `LOCUS_BENCH_LINK_MBIT`, default 2000):
//! - link: one TCP stream h0 → h1 (this binary at both ends);
//! - source disk: n0's blob files read cold by one sequential reader (what n0's disk
//!   gives; page cache dropped first);
//! - Locus: the page cache dropped, a fresh mount on h1 (empty chunk cache), every file
//!   read once in 1 MiB reads by one sequential reader.
//!
//! Disk and Locus alternate over `LOCUS_BENCH_ROUNDS` rounds (default 2) so both see the
//! same state of the host's cache beneath this machine; each round's ratio is against the
//! disk read of the same round. The bound for the mount is min(link, disk).
//!
//!     cargo bench --bench remote_read
//!     LOCUS_BENCH_MIB=2048 LOCUS_BENCH_LINK_MBIT=2000 cargo bench --bench remote_read
//!     LOCUS_BENCH_MOUNT_ARGS="--readahead 128MiB" cargo bench --bench remote_read
//!     LOCUS_BENCH_PERF=/tmp LOCUS_BENCH_LINK_MBIT=0 cargo bench --bench remote_read
//!
//! Needs root (namespaces, dropping caches).

use locus_testkit as support;

use std::path::PathBuf;

use support::*;

#[tokio::main]
async fn main() {
    if !bed_bench_starts("remote_read") {
        return;
    }
    // Memory freed by one part must not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
    let mib = env_u64("LOCUS_BENCH_MIB", 1024);
    let rounds = env_u64("LOCUS_BENCH_ROUNDS", 2);
    let shaped = env_u64("LOCUS_BENCH_LINK_MBIT", 2000);
    let mount_args_s = std::env::var("LOCUS_BENCH_MOUNT_ARGS").unwrap_or_default();
    let mount_args: Vec<&str> = mount_args_s.split_whitespace().collect();
    let files = 4usize;
    let each = ((mib as usize) << 20) / files;

    let bed = Netbed::new(&[2]).expect("the test bed");
    let h = Harness::new("bench-remote-read");
    let src = h.path("src");
    write_random_files(&src, "part-", files, each, 9000);
    let m = h.start_metadata_on(&bed, MetadataOpts::default()).await;
    let n0 = h
        .start_node("n0", &m, NodeOpts::on(&bed.hosts[0]).with_capacity("64GiB"))
        .await;
    let out = m.cli(&[
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Large files: each blob a file of its own, read whole as the disk reference.
    // The data files' blobs (the version's namespace is a blob too).
    let blob_files: Vec<PathBuf> = n0
        .blob_files()
        .into_values()
        .filter(|b| b.size == each as u64)
        .map(|b| {
            assert!(!b.packed, "a large blob in a pack");
            b.path
        })
        .collect();
    let total: u64 = blob_files
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(total, (each * files) as u64);
    let cold = drop_caches();

    println!(
        "\nremote_read: {} MiB in {files} files, one sequential reader, 1 MiB reads; page cache {}",
        total >> 20,
        if cold {
            "dropped before each read"
        } else {
            "NOT dropped (not root): warm figures"
        }
    );
    println!("mount flags: {mount_args:?}\n");
    println!("| link | link TCP MiB/s | round | disk cold MiB/s | Locus MiB/s | Locus / min(link, disk) |");
    println!("|---|---|---|---|---|---|");
    // LOCUS_BENCH_LINK_MBIT=0: the unshaped link only.
    let links: &[u64] = if shaped == 0 { &[0] } else { &[0, shaped] };
    for &mbit in links {
        bed.shape_host(1, mbit).unwrap();
        let link_bytes = if mbit == 0 {
            4u64 << 30
        } else {
            (mbit << 20) / 8 * 3
        };
        let link = tcp_rate(&bed.hosts[0], &bed.hosts[1], link_bytes);
        let name = if mbit == 0 {
            "veth, unshaped".to_string()
        } else {
            format!("tbf {mbit} Mbit/s")
        };
        for round in 1..=rounds {
            drop_caches();
            let (b, t) = read_sequentially(&blob_files);
            let disk = mbs(b, t);

            drop_caches();
            let mnt = m.mount_on(
                &bed.hosts[1],
                &format!("r{mbit}-{round}"),
                "ds@1",
                None,
                &mount_args,
            );
            let paths: Vec<PathBuf> = (0..files)
                .map(|i| mnt.path.join(format!("part-{i:03}.bin")))
                .collect();
            let perf = profile(&format!("remote-{mbit}-{round}"));
            let (b, t) = read_sequentially(&paths);
            stop_profile(perf);
            assert_eq!(b, total);
            let locus = mbs(b, t);
            drop(mnt);
            println!(
                "| {name} | {link:.0} | {round} | {disk:.0} | {locus:.0} | {:.2}× |",
                locus / link.min(disk)
            );
        }
    }
    drop(n0);
    drop(m);
}
