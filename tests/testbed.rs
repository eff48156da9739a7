//! The cluster on the multi-host test bed: every cache node and mount in its own network
//! namespace with its own address, the metadata service and the CLI in the root namespace
//! (the bed's gateway). What loopback cannot show: nodes reached only at the addresses
//! they advertise, bytes that really cross a host's link, a link pulled mid-read, and a
//! node that vanishes from the network while its process lives on.
//!
//! Needs root (namespaces, bridges, tc); skipped with a note elsewhere.

use locus_testkit as support;

use std::io::Read;
use std::time::{Duration, Instant};

use locus_proto::pb;
use support::*;

/// The bed and a metadata service on its gateway; a machine that cannot build the bed
/// fails the test, saying why.
async fn bed(h: &Harness, per_rack: &[usize], liveness: &'static str) -> (Netbed, Metadata) {
    // A test that cannot have its hosts fails, loudly: it never passes untried.
    if let Some(why) = Netbed::unavailable() {
        panic!("this test needs the multi-host test bed (run as root): {why}");
    }
    let bed = Netbed::new(per_rack).unwrap_or_else(|e| panic!("building the test bed: {e}"));
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some(liveness),
                extra: vec!["--repair-interval".into(), "500ms".into()],
                ip: Some(bed.gateway()),
                ..Default::default()
            },
        )
        .await;
    (bed, m)
}

fn file_hash(p: &std::path::Path) -> blake3::Hash {
    let mut f = std::fs::File::open(p).unwrap();
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return h.finalize();
        }
        h.update(&buf[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_their_own_hosts_are_reached_at_their_advertised_addresses_and_serve_a_remote_mount() {
    let h = Harness::new("bed-mount");
    let (bed, m) = bed(&h, &[2, 1], "5s").await;
    let n0 = h.start_node("n0", &m, NodeOpts::on(&bed.hosts[0])).await;
    let n1 = h.start_node("n1", &m, NodeOpts::on(&bed.hosts[1])).await;
    let src = h.path("src");
    make_tree(&src, 300);
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "1MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Each node registered the address of its own host, nothing on loopback.
    let nodes = m
        .client(None)
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    for (n, host) in [(&n0, &bed.hosts[0]), (&n1, &bed.hosts[1])] {
        let listed = nodes.iter().find(|x| x.id == n.id).unwrap();
        assert_eq!(listed.address, n.grpc.to_string());
        assert!(
            listed.address.starts_with(&format!("{}:", host.addr)),
            "{listed:?}"
        );
        assert_eq!(listed.labels["rack"], format!("r{}", host.rack));
    }

    // A mount on the third host, which has no node: every byte crosses its link.
    let (_, rx_before) = bed.link_bytes(2);
    let mnt = m.mount_on(&bed.hosts[2], "remote", "mixed@1", None, &[]);
    assert_same_tree(&src, &mnt.path);
    let (_, rx_after) = bed.link_bytes(2);
    let content: u64 = files_of(&src)
        .iter()
        .map(|(p, _)| std::fs::metadata(src.join(p)).unwrap().len())
        .sum();
    assert!(
        rx_after - rx_before >= content,
        "the mount host received {} bytes for {content} bytes of files",
        rx_after - rx_before
    );
    mnt.status_when("the mount to count its remote reads", |s| {
        s["totals"]["bytes_remote"].as_u64() > Some(0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_pulled_mid_read_fails_over_to_the_other_replica_with_every_byte_right() {
    let h = Harness::new("bed-link-cut");
    let (bed, m) = bed(&h, &[3], "60s").await;
    let _n0 = h.start_node("n0", &m, NodeOpts::on(&bed.hosts[0])).await;
    let _n1 = h.start_node("n1", &m, NodeOpts::on(&bed.hosts[1])).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("big.bin"), pseudo_random(7, 48 << 20)).unwrap();
    let out = import(&m, "big", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let want = file_hash(&src.join("big.bin"));

    // The reader's host at 200 Mbit/s: the read takes about two seconds, long enough to
    // pull the serving node's cable in the middle of it.
    bed.shape_host(2, 200).unwrap();
    let mnt = m.mount_on(&bed.hosts[2], "remote", "big@1", None, &[]);
    let path = mnt.path.join("big.bin");
    let reader = std::thread::spawn(move || {
        let t = Instant::now();
        let r = std::fs::read(&path);
        (r, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let sent = |k: usize| bed.link_bytes(k).0;
    let serving = if sent(0) >= sent(1) { 0 } else { 1 };
    assert!(sent(serving) > 1 << 20, "a node was serving the read");
    bed.set_link(serving, false).unwrap();
    let (r, took) = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    let got = r.expect("the read completes from the other replica");
    assert_eq!(got.len(), 48 << 20);
    assert_eq!(blake3::hash(&got), want, "every byte is right");
    let other = 1 - serving;
    assert!(sent(other) > 8 << 20, "the other replica served the rest");
    eprintln!("read with a pulled link took {took:?}");
    mnt.status_when("the mount to count its failover", |s| {
        s["totals"]["failovers"].as_u64() > Some(0)
    })
    .await;
    bed.set_link(serving, true).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_the_network_is_declared_down_repaired_around_and_returns_when_its_link_does() {
    let h = Harness::new("bed-partition");
    let (bed, m) = bed(&h, &[3], "3s").await;
    let mut nodes = Vec::new();
    for k in 0..3 {
        nodes.push(
            h.start_node(&format!("n{k}"), &m, NodeOpts::on(&bed.hosts[k]))
                .await,
        );
    }
    let src = h.path("src");
    make_tree(&src, 120);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut c = m.client(None).await;
    let on_n0 = shards(&mut c, "ds", 1)
        .await
        .iter()
        .filter(|s| s.replicas.iter().any(|r| r == "n0"))
        .count();
    assert!(on_n0 > 0, "n0 holds some shards");

    // The process lives on; only its link is gone.
    bed.set_link(0, false).unwrap();
    wait_node_down(&m, "n0").await;
    assert!(nodes[0].daemon.is_running());
    wait_moved_off(&m, "ds", "n0").await;
    for s in shards(&mut c, "ds", 1).await {
        assert_eq!(
            s.replicas.len(),
            2,
            "shard {} is back to two replicas: {s:?}",
            s.id
        );
    }
    // A mount on the gateway reads everything from n1 and n2.
    let mnt = m.mount("after", "ds@1", None, &[]);
    assert_same_tree(&src, &mnt.path);

    bed.set_link(0, true).unwrap();
    m.wait_node_up("n0", "n0 to be up again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_backup_and_restore_cross_hosts_with_every_node_at_its_own_address() {
    let h = Harness::new("bed-backup");
    let (bed, m) = bed(&h, &[2, 1], "5s").await;
    let mut nodes = Vec::new();
    for k in 0..3 {
        nodes.push(
            h.start_node(&format!("n{k}"), &m, NodeOpts::on(&bed.hosts[k]))
                .await,
        );
    }
    // Rack 1's uplink is slow, as between real racks; nothing may depend on its speed.
    bed.shape_uplink(1, 400).unwrap();
    let src = h.path("src");
    make_tree(&src, 80);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Nodes upload the backup themselves, each from its own host.
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let o = m.cli(&["backup", "run", "--to", &url, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["committed"], true, "{r}");
    // Every distinct blob went up once, from a node (a file:// target is written where
    // each node runs, so no link would show it: the nodes' own counters do), and the
    // nodes uploaded all the run counted (the files' blobs and the version's sealed
    // namespace, itself a blob).
    let mut blobs = std::collections::BTreeMap::new();
    for f in files_under(&src) {
        let data = std::fs::read(&f).unwrap();
        blobs.insert(*blake3::hash(&data).as_bytes(), data.len() as u64);
    }
    let want: u64 = blobs.values().sum();
    let mut uploaded = 0;
    for n in &nodes {
        uploaded += counter(n, "locus_node_backup_uploaded_bytes_total").await;
    }
    assert_eq!(
        r["bytes_uploaded"], uploaded,
        "the nodes uploaded what the run counted: {r}"
    );
    let namespace = uploaded.checked_sub(want);
    assert!(
        namespace.is_some_and(|n| n > 0 && n < want / 10),
        "{uploaded} bytes uploaded for {want} bytes of distinct files and one namespace"
    );
    let v = m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]);
    assert!(v.status.success(), "{}", stderr(&v));
    // The dataset deleted, then brought back from the backup into the running cluster,
    // and read through a mount on a host of the other rack.
    let o = m.cli(&["dataset", "rm", "ds", "--all-versions"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "ds@1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mnt = m.mount_on(&bed.hosts[2], "restored", "ds@2", None, &[]);
    assert_same_tree(&src, &mnt.path);
}
