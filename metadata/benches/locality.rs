//! Locality and Assign at scheduler scale, in process, on a real RocksDB catalogue:
//! 1,000 nodes (racks of 40, 4 zones), one version of 10,000 shards with two replicas
//! each; then Assign of those shards over 512 ranks on 128 nodes. Locality answers every
//! node's row, without labels.
//!
//!     cargo bench -p locus-metadata --bench locality
//!     LOCUS_BENCH_NODES=10000 LOCUS_BENCH_SHARDS=1000 cargo bench -p locus-metadata --bench locality
//!
//! Prints p50/p99/max of many calls. Targets: Locality p99 ≤ 2 ms, Assign ≤ 200 ms.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_metadata::catalog::{NodeRegistration, ShardSpec};
use locus_metadata::store::RocksStore;
use locus_metadata::{Catalog, CatalogConfig, SystemClock};
use locus_proto::manifest::{BlobHash, Entry, EntryKind, RelPath};
use locus_proto::{DatasetName, DatasetRef, NodeId};

fn pct(mut v: Vec<Duration>) -> String {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    format!(
        "p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms ({} calls)",
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        v.last().unwrap().as_secs_f64() * 1e3,
        v.len()
    )
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("locality: bench");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RocksStore::open(&dir.path().join("db")).unwrap());
    let cat = Catalog::open(store, Arc::new(SystemClock), CatalogConfig::default()).unwrap();
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let nodes = env("LOCUS_BENCH_NODES", 1000);
    for i in 0..nodes {
        cat.register_node(NodeRegistration {
            id: NodeId::try_from(format!("gpu{i:04}").as_str()).unwrap(),
            address: format!("10.0.{}.{}:7500", i / 250, i % 250),
            labels: HashMap::from([
                ("host".to_string(), format!("gpu{i:04}")),
                ("rack".to_string(), format!("r{}", i / 40)),
                ("zone".to_string(), format!("z{}", i / nodes.div_ceil(4))),
            ]),
            capacity: 1 << 44,
            free: 1 << 43,
            instance: String::new(),
            used: 0,
        })
        .unwrap();
    }
    let shards = env("LOCUS_BENCH_SHARDS", 10_000) as u32;
    let name = DatasetName::try_from("bench").unwrap();
    let (s, chunk_size) = cat.begin_version(&name, 0, "", 2, false, "bench").unwrap();
    let mut entries = vec![Entry {
        path: RelPath::try_from("d").unwrap(),
        kind: EntryKind::Dir,
        mode: 0o755,
        mtime_ns: 1,
    }];
    let mut specs = Vec::new();
    for i in 0..shards {
        let size = 1_000_000 + u64::from(i % 97) * 10_000;
        let p = format!("d/f{i:06}");
        entries.push(Entry {
            path: RelPath::try_from(p.as_str()).unwrap(),
            kind: EntryKind::File {
                size,
                blob: BlobHash::of(p.as_bytes()),
                chunks: vec![BlobHash::of(&i.to_le_bytes())],
                shard: i,
            },
            mode: 0o644,
            mtime_ns: 1,
        });
        let a = (i as usize * 7919) % nodes;
        let b = (a + 1 + (i as usize * 104_729) % (nodes - 1)) % nodes;
        specs.push(ShardSpec {
            id: i,
            bytes: size,
            files: 1,
            replicas: [a, b]
                .iter()
                .map(|n| NodeId::try_from(format!("gpu{n:04}").as_str()).unwrap())
                .collect(),
        });
    }
    for (page, chunk) in entries.chunks(5_000).enumerate() {
        cat.put_entries(s, page as u64, chunk.to_vec()).unwrap();
    }
    for (page, chunk) in specs.chunks(5_000).enumerate() {
        cat.put_shards(s, page as u64, chunk.to_vec()).unwrap();
    }
    // The sealed namespace an importer would send with the commit.
    let (sealed, hash) = locus_proto::sealed::seal(entries, chunk_size, "bench", cat.cluster_id()).unwrap();
    cat.commit(s, "bench", Some((hash, sealed.len() as u64))).unwrap();
    let r: DatasetRef = "bench@1".parse().unwrap();

    // Warm up, then measure whole-version locality over every live node.
    for _ in 0..20 {
        cat.locality(
            std::slice::from_ref(&r),
            None,
            &[],
            &[],
            &HashMap::new(),
            (usize::MAX, false),
        )
        .unwrap();
    }
    let mut times = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        let out = cat
            .locality(
                std::slice::from_ref(&r),
                None,
                &[],
                &[],
                &HashMap::new(),
                (usize::MAX, false),
            )
            .unwrap();
        times.push(t.elapsed());
        assert_eq!(out.nodes.len(), nodes);
    }
    let locality = pct(times);
    let mut t1 = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let _ = cat.locality_shards(std::slice::from_ref(&r), None, &[]).unwrap();
        t1.push(t.elapsed());
    }
    // The computation alone, on a topology built once (as the catalogue keeps it).
    let nodes_pb = cat.list_nodes().unwrap();
    let topo = locus_metadata::locality::Topology::new(nodes_pb.iter().map(|n| {
        (
            n.id.as_str(),
            n.labels["host"].as_str(),
            n.labels["rack"].as_str(),
            n.labels["zone"].as_str(),
        )
    }));
    let live = vec![true; topo.len()];
    let (_, sets) = cat.locality_shards(std::slice::from_ref(&r), None, &[]).unwrap();
    let all: Vec<usize> = (0..topo.len()).collect();
    let mut t3 = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let _ = locus_metadata::locality::compute_on(
            sets.iter().flat_map(|s| s.iter()),
            &topo,
            &live,
            &all,
            &Default::default(),
            usize::MAX,
        );
        t3.push(t.elapsed());
    }
    // ListNodes, for comparison: every node's record, liveness and figures.
    let mut t2 = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let _ = cat.list_nodes().unwrap();
        t2.push(t.elapsed());
    }
    let breakdown = [
        ("of which: the version's shards (cached)", pct(t1)),
        (
            "of which: the computation (sums per host/rack/zone, ranking)",
            pct(t3),
        ),
        (
            "ListNodes (every node's record, liveness and figures), for comparison",
            pct(t2),
        ),
    ];

    let rank_nodes: Vec<String> = (0..128)
        .flat_map(|n| std::iter::repeat_n(format!("gpu{:04}", n * 7), 4))
        .collect();
    let mut times = Vec::new();
    let mut local = 0.0;
    for _ in 0..20 {
        let t = Instant::now();
        let out = cat.assign(&r, &rank_nodes, false).unwrap();
        times.push(t.elapsed());
        local = out.local_fraction;
        assert_eq!(out.ranks.len(), 512);
    }
    let assign = pct(times);

    println!();
    println!("locality bench: {nodes} nodes, {shards} shards × 2 replicas, RocksDB catalogue, one thread");
    println!("| call | latency | target |");
    println!("|---|---|---|");
    println!("| Locality, whole version, all {nodes} nodes ranked | {locality} | p99 ≤ 2 ms |");
    for (what, t) in &breakdown {
        println!("| {what} | {t} | |");
    }
    println!(
        "| Assign, {shards} shards over 512 ranks on 128 nodes ({:.1}% local) | {assign} | ≤ 200 ms |",
        local * 100.0
    );
}
