//! What TLS on every hop costs a remote read: the same cold read through a mount with no
//! local node, from a plaintext cluster and from a TLS cluster (mutual TLS, tokens),
//! alternated round by round in one run on the multi-host test bed.
//!
//! Host h0 runs one cache node of each cluster (both holding every blob), h1 the mounts;
//! both metadata services sit on the bed's gateway. Each round drops the page cache and
//! reads every file once through a fresh mount (one sequential reader, 1 MiB reads) three
//! ways: plaintext (bulk path), TLS (bulk path inside TLS) and TLS over gRPC
//! (`LOCUS_BULK=off`, how a TLS cluster read before the bulk path served TLS). Figures:
//! MiB/s, and CPU per MiB of the node and the mount (from /proc; both ends' CPU is what
//! the data path costs, whatever the core count); TLS / plaintext of the same round, on
//! the unshaped veth (where CPU, not the link, bounds the read: the worst case for TLS)
//! and with h1's link shaped to `LOCUS_BENCH_LINK_MBIT` (default 2000; 0 skips it).
//!
//!     cargo bench --bench tls_overhead
//!     LOCUS_BENCH_MIB=2048 LOCUS_BENCH_ROUNDS=3 cargo bench --bench tls_overhead
//!
//! Needs root (namespaces, dropping caches).

use locus_testkit as support;

use std::path::PathBuf;

use support::*;

/// One way to read: its name, the cluster, its node, the mount's extra environment.
type Way<'a> = (&'a str, &'a Metadata, &'a Node, &'a [(&'a str, &'a str)]);

#[tokio::main]
async fn main() {
    if !bed_bench_starts("tls_overhead") {
        return;
    }
    // Memory freed by one read must not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
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
    println!("| link | round | read | MiB/s | CPU ms/MiB: node | mount | both | × plaintext (CPU) | × plaintext (MiB/s) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let links: &[u64] = if shaped == 0 { &[0] } else { &[0, shaped] };
    // (link, read, CPU ratio, throughput ratio) of every round.
    let mut ratios: Vec<(u64, &str, f64, f64)> = Vec::new();
    let ways: [Way; 3] = [
        ("plaintext, bulk", &plain, &n_plain, &[]),
        ("TLS, bulk", &tls, &n_tls, &[]),
        (
            "TLS, gRPC",
            &tls,
            &n_tls,
            &[(locus_proto::bulk::ENV_SWITCH, "off")],
        ),
    ];
    for &mbit in links {
        bed.shape_host(1, mbit).unwrap();
        let name = if mbit == 0 {
            "veth, unshaped".to_string()
        } else {
            format!("tbf {mbit} Mbit/s")
        };
        for round in 1..=rounds {
            let mut base = None;
            for (i, (what, m, n, env)) in ways.iter().enumerate() {
                drop_caches();
                let mnt =
                    m.mount_on_with_env(&bed.hosts[1], &format!("r{i}-{mbit}-{round}"), "ds@1", &[], env);
                let paths: Vec<PathBuf> = (0..files)
                    .map(|i| mnt.path.join(format!("part-{i:03}.bin")))
                    .collect();
                let (np, mp) = (n.daemon.pid(), mnt.server_pid());
                let (n0, m0) = (cpu_seconds(np), cpu_seconds(mp));
                let (b, t) = read_sequentially(&paths);
                assert_eq!(b, total);
                let (nc, mc) = (cpu_seconds(np) - n0, cpu_seconds(mp) - m0);
                drop(mnt);
                let per = |c: f64| c * 1000.0 / (total >> 20) as f64;
                let (rate, both) = (mbs(b, t), per(nc + mc));
                let (cpu_x, rate_x) = match base {
                    None => {
                        base = Some((both, rate));
                        (1.0, 1.0)
                    }
                    Some((c, r)) => (both / c, rate / r),
                };
                ratios.push((mbit, what, cpu_x, rate_x));
                println!(
                    "| {name} | {round} | {what} | {rate:.0} | {:.3} | {:.3} | {both:.3} | {cpu_x:.2}× | {rate_x:.2}× |",
                    per(nc),
                    per(mc)
                );
            }
        }
    }
    println!();
    for &mbit in links {
        for (what, ..) in &ways[1..] {
            let pick = |f: fn(&(u64, &str, f64, f64)) -> f64| {
                let mut r: Vec<f64> = ratios
                    .iter()
                    .filter(|x| x.0 == mbit && x.1 == *what)
                    .map(f)
                    .collect();
                r.sort_by(f64::total_cmp);
                (r[0], r[r.len() / 2], r[r.len() - 1])
            };
            let (c, t) = (pick(|x| x.2), pick(|x| x.3));
            println!(
                "link {}, {what} / plaintext: CPU min {:.2}× median {:.2}× max {:.2}×; MiB/s min {:.2}× median {:.2}× max {:.2}×",
                if mbit == 0 {
                    "unshaped".to_string()
                } else {
                    format!("{mbit} Mbit/s")
                },
                c.0,
                c.1,
                c.2,
                t.0,
                t.1,
                t.2
            );
        }
    }
    drop(n_plain);
    drop(n_tls);
}
