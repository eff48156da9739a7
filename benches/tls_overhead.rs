//! What TLS on every hop costs a remote read: the same cold read through a mount with no
//! local node, from a plaintext cluster and from a TLS cluster (mutual TLS, tokens),
//! alternated round by round in one run on the multi-host test bed.
//!
//! Host h0 runs one cache node of each cluster (both holding every blob), h1 the mounts;
//! both metadata services sit on the bed's gateway. Each round drops the page cache,
//! reads every file once through a fresh plaintext mount, drops it again and reads through
//! a fresh TLS mount (one sequential reader, 1 MiB reads). The figure is TLS / plaintext
//! of the same round, on the unshaped veth (where CPU, not the link, bounds the read: the
//! worst case for TLS) and with h1's link shaped to `LOCUS_BENCH_LINK_MBIT` (default 2000;
//! 0 skips it).
//!
//!     cargo bench --bench tls_overhead
//!     LOCUS_BENCH_MIB=2048 LOCUS_BENCH_ROUNDS=3 cargo bench --bench tls_overhead
//!
//! Needs root (namespaces, dropping caches).

use locus_testkit as support;

use std::path::PathBuf;

use support::*;

#[tokio::main]
async fn main() {
    if !bed_bench_starts("tls_overhead") {
        return;
    }
    let mib = env_u64("LOCUS_BENCH_MIB", 1024);
    let rounds = env_u64("LOCUS_BENCH_ROUNDS", 3);
    let shaped = env_u64("LOCUS_BENCH_LINK_MBIT", 2000);
    let files = 4usize;
    let each = ((mib as usize) << 20) / files;

    let bed = Netbed::new(&[2]).expect("the test bed");
    let h = Harness::new("bench-tls-overhead");
    let src = h.path("src");
    write_random_files(&src, "part-", files, each, 9100);

    let plain = h
        .start_metadata(
            "meta-plain",
            MetadataOpts {
                ip: Some(bed.gateway()),
                ..Default::default()
            },
        )
        .await;
    let tls = h
        .start_metadata(
            "meta-tls",
            MetadataOpts {
                ip: Some(bed.gateway()),
                tokens: tokens(),
                mtls: true,
                ..Default::default()
            },
        )
        .await;
    let on_h0 = |tls: bool| {
        let mut o = NodeOpts::on(&bed.hosts[0]).with_capacity("64GiB");
        o.tls = tls;
        o
    };
    let n_plain = h.start_node_in("np", "n1", &plain, on_h0(false)).await;
    let n_tls = h.start_node_in("nt", "n1", &tls, on_h0(true)).await;
    for m in [&plain, &tls] {
        let out = m.cli(&[
            "dataset",
            "import",
            "ds",
            src.to_str().unwrap(),
            "--replicas",
            "1",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let total = (each * files) as u64;
    let cold = drop_caches();
    println!(
        "\ntls_overhead: {} MiB in {files} files, one sequential reader, 1 MiB reads, mount with no local node; page cache {}",
        total >> 20,
        if cold { "dropped before each read" } else { "NOT dropped (not root)" }
    );
    println!("TLS cluster: TLS 1.3 (rustls, aws-lc-rs) on node and metadata hops, mutual TLS, tokens\n");
    println!("| link | round | plaintext MiB/s | TLS MiB/s | TLS / plaintext |");
    println!("|---|---|---|---|---|");
    let links: &[u64] = if shaped == 0 { &[0] } else { &[0, shaped] };
    let mut ratios = Vec::new();
    for &mbit in links {
        bed.shape_host(1, mbit).unwrap();
        let name = if mbit == 0 {
            "veth, unshaped".to_string()
        } else {
            format!("tbf {mbit} Mbit/s")
        };
        for round in 1..=rounds {
            let rate = |m: &Metadata, what: &str| {
                drop_caches();
                let mnt = m.mount_on(
                    &bed.hosts[1],
                    &format!("{what}-{mbit}-{round}"),
                    "ds@1",
                    None,
                    &[],
                );
                let paths: Vec<PathBuf> = (0..files)
                    .map(|i| mnt.path.join(format!("part-{i:03}.bin")))
                    .collect();
                let (b, t) = read_sequentially(&paths);
                assert_eq!(b, total);
                drop(mnt);
                mbs(b, t)
            };
            let p = rate(&plain, "plain");
            let t = rate(&tls, "tls");
            ratios.push((mbit, t / p));
            println!("| {name} | {round} | {p:.0} | {t:.0} | {:.2}× |", t / p);
        }
    }
    for &mbit in links {
        let mut r: Vec<f64> = ratios.iter().filter(|x| x.0 == mbit).map(|x| x.1).collect();
        r.sort_by(f64::total_cmp);
        println!(
            "link {}: TLS / plaintext min {:.2}× median {:.2}× max {:.2}×",
            if mbit == 0 {
                "unshaped".to_string()
            } else {
                format!("{mbit} Mbit/s")
            },
            r[0],
            r[r.len() / 2],
            r[r.len() - 1]
        );
    }
    drop(n_plain);
    drop(n_tls);
}
