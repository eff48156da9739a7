//! Whether locality pays off: the same 8-reader epoch run on the nodes `locus locality`
//! ranks best and on the nodes it ranks worst, on the multi-host test bed.
//!
//! Four hosts in two racks (h0, h1 in rack 0; h2, h3 in rack 1), a cache node on each.
//! Host links are shaped to `LOCUS_BENCH_HOST_MBIT` (default 2000) and the uplink between
//! the racks to `LOCUS_BENCH_UPLINK_MBIT` (default 500), as in a real fabric where racks
//! share less than their hosts have. The dataset (`LOCUS_BENCH_MIB`, default 512, in 8 MiB
//! files and 32 MiB shards, two replicas) was imported while only rack 0's nodes were
//! up, so rack 1 holds none of it.
//!
//! A job of two nodes × four readers: `locus assign --nodes A,B --ranks-per-node 4
//! --with-files` splits the files among the eight ranks; each rank's reader reads its files
//! through a mount on its node's host that uses that host's cache node. The page cache is
//! dropped before each epoch. Reported per placement: epoch time, and bytes that crossed
//! the rack uplink (counted on the uplink itself) against the bytes read.
//!
//!     cargo bench --bench locality_epoch
//!
//! Needs root (namespaces, shaping, dropping caches).

use locus_testkit as support;

use std::path::PathBuf;
use std::time::Instant;

use support::*;

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("JSON output")
}

struct Epoch {
    secs: f64,
    bytes: u64,
    crossed: u64,
    local_fraction: f64,
}

/// One epoch on `chosen` (two node indexes): assign, mount on each host, 8 readers.
fn epoch(bed: &Netbed, m: &Metadata, nodes: &[Node], chosen: [usize; 2], tag: &str) -> Epoch {
    let names = format!("{},{}", nodes[chosen[0]].id, nodes[chosen[1]].id);
    let a = json(&m.cli(&[
        "assign",
        "ds@1",
        "--nodes",
        &names,
        "--ranks-per-node",
        "4",
        "--with-files",
        "--json",
    ]));
    let mounts: Vec<Mount> = chosen
        .iter()
        .map(|&k| m.mount_on(&bed.hosts[k], &format!("{tag}-{k}"), "ds@1", Some(&nodes[k]), &[]))
        .collect();
    let mut work: Vec<Vec<PathBuf>> = Vec::new();
    for r in a["ranks"].as_array().unwrap() {
        let node = r["node"].as_str().unwrap();
        let at = chosen.iter().position(|&k| nodes[k].id == node).unwrap();
        let files = r["files"].as_array().unwrap();
        work.push(
            files
                .iter()
                .map(|f| mounts[at].path.join(f.as_str().unwrap()))
                .collect(),
        );
    }
    assert_eq!(work.len(), 8);
    drop_caches();
    let before = bed.uplink_bytes(1);
    let t = Instant::now();
    let handles: Vec<_> = work
        .into_iter()
        .map(|files| std::thread::spawn(move || read_sequentially(&files).0))
        .collect();
    let bytes: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let secs = t.elapsed().as_secs_f64();
    let crossed = bed.uplink_bytes(1) - before;
    drop(mounts);
    Epoch {
        secs,
        bytes,
        crossed,
        local_fraction: a["local_fraction"].as_f64().unwrap_or(0.0),
    }
}

#[tokio::main]
async fn main() {
    if !bed_bench_starts("locality_epoch") {
        return;
    }
    let mib = env_u64("LOCUS_BENCH_MIB", 512);
    let host_mbit = env_u64("LOCUS_BENCH_HOST_MBIT", 2000);
    let uplink_mbit = env_u64("LOCUS_BENCH_UPLINK_MBIT", 500);
    let files = (mib / 8) as usize;

    let bed = Netbed::new(&[2, 2]).expect("the test bed");
    let h = Harness::new("bench-locality-epoch");
    let src = h.path("src");
    write_random_files(&src, "f", files, 8 << 20, 500);
    let m = h.start_metadata_on(&bed, MetadataOpts::default()).await;
    let opts = |k: usize| NodeOpts::on(&bed.hosts[k]).with_capacity("64GiB");
    let mut nodes = Vec::new();
    for k in 0..2 {
        nodes.push(h.start_node(&format!("n{k}"), &m, opts(k)).await);
    }
    let out = m.cli(&[
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "2",
        "--shard-size",
        "32MiB",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    for k in 2..4 {
        nodes.push(h.start_node(&format!("n{k}"), &m, opts(k)).await);
    }
    for k in 0..4 {
        bed.shape_host(k, host_mbit).unwrap();
    }
    bed.shape_uplink(1, uplink_mbit).unwrap();
    let uplink = tcp_rate(&bed.hosts[0], &bed.hosts[2], (uplink_mbit << 20) / 8 * 2);
    let host_link = tcp_rate(&bed.hosts[0], &bed.hosts[1], (host_mbit << 20) / 8 * 2);

    // Best and worst by the service's own ranking.
    let loc = json(&m.cli(&["locality", "ds@1", "--json"]));
    let ranked: Vec<usize> = loc["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let id = n["node"].as_str().unwrap();
            nodes.iter().position(|x| x.id == id).unwrap()
        })
        .collect();
    assert_eq!(ranked.len(), 4);
    let best = [ranked[0], ranked[1]];
    let worst = [ranked[3], ranked[2]];

    let b = epoch(&bed, &m, &nodes, best, "best");
    let w = epoch(&bed, &m, &nodes, worst, "worst");
    println!(
        "\nlocality_epoch: {} MiB in {files} files, R=2 in rack 0; host links {host_mbit} Mbit/s \
         (one TCP stream {host_link:.0} MiB/s), rack uplink {uplink_mbit} Mbit/s (one stream \
         {uplink:.0} MiB/s); 2 nodes × 4 readers; page cache dropped before each epoch\n",
        mib
    );
    println!("| placement | nodes | assign's local fraction | epoch s | MiB/s | bytes over the uplink / bytes read | in-rack share |");
    println!("|---|---|---|---|---|---|---|");
    for (name, chosen, e) in [("locality's best", best, &b), ("locality's worst", worst, &w)] {
        println!(
            "| {name} | {}, {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.1}% |",
            nodes[chosen[0]].id,
            nodes[chosen[1]].id,
            e.local_fraction,
            e.secs,
            mbs(e.bytes, std::time::Duration::from_secs_f64(e.secs)),
            e.crossed as f64 / e.bytes as f64,
            100.0 * (1.0 - (e.crossed as f64 / e.bytes as f64).min(1.0)),
        );
    }
    println!("\nbest epoch {:.1}× faster than the worst", w.secs / b.secs);
    drop(nodes);
    drop(m);
}
