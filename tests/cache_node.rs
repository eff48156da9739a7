//! End-to-end tests of cache nodes: a real metadata service and real `locus node serve`
//! processes on loopback, data imported with the real `locus dataset import`.
//!
//! Longer than our ~700-line guide on purpose: every file under `tests/` is its own binary
//! that links the whole workspace (seconds each on two cores), so end-to-end tests of one
//! component share one file. Helpers belong in `testkit/`, not here.

use locus_testkit as support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

use locus_proto::{nodepb, pb, BlobHash};
use support::*;
use tokio_stream::StreamExt;

fn rehash_ok(b: &OnDisk, name: &str) -> bool {
    blake3::hash(&b.read()).to_hex().as_str() == name
}

/// shard id → its distinct blob hashes (hex), from the manifest.
fn blobs_by_shard(entries: &[pb::Entry]) -> BTreeMap<u32, BTreeSet<String>> {
    let mut out: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    for e in entries.iter().filter(|e| e.kind == pb::EntryKind::File as i32) {
        out.entry(e.shard).or_default().insert(
            blake3::Hash::from_bytes(e.blob.clone().try_into().unwrap())
                .to_hex()
                .to_string(),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_places_two_replicas_and_nodes_hold_exactly_their_blobs() {
    let h = Harness::new("import");
    let (m, nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 1_000);
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "2MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["version"], 1);
    assert_eq!(report["files"], 1_000);
    assert_eq!(report["symlinks"], 6);
    assert!(report["shards"].as_u64().unwrap() >= 5, "{report}");

    let mut c = m.client(None).await;
    let entries = all_entries(&mut c, "mixed", 1).await;
    // The manifest matches the source tree.
    for e in &entries {
        let p = src.join(&e.path);
        let meta = std::fs::symlink_metadata(&p).unwrap();
        match pb::EntryKind::try_from(e.kind).unwrap() {
            pb::EntryKind::File => {
                assert_eq!(meta.len(), e.size, "{}", e.path);
                let want = blake3::hash(&std::fs::read(&p).unwrap());
                assert_eq!(e.blob, want.as_bytes().to_vec(), "{}", e.path);
            }
            pb::EntryKind::Dir => assert!(meta.is_dir()),
            pb::EntryKind::Symlink => {
                assert_eq!(
                    std::fs::read_link(&p).unwrap().to_str().unwrap(),
                    e.symlink_target
                )
            }
            _ => panic!("unexpected kind"),
        }
    }
    assert!(entries.iter().any(|e| e.path == "empty/nested"));

    let mut by_shard = blobs_by_shard(&entries);
    // The version's sealed namespace is a blob of its first shard: its replicas hold it.
    let v = c
        .get_version(pb::GetVersionRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "mixed".into(),
                version: 1,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let ns = blake3::Hash::from_bytes(v.namespace_blob.clone().try_into().unwrap())
        .to_hex()
        .to_string();
    by_shard.first_entry().unwrap().get_mut().insert(ns);
    let shards = shards(&mut c, "mixed", 1).await;
    assert_eq!(shards.len(), by_shard.len());
    let mut expect: HashMap<String, BTreeSet<String>> = HashMap::new();
    for s in &shards {
        assert_eq!(s.replicas.len(), 2, "shard {}", s.id);
        assert_ne!(s.replicas[0], s.replicas[1]);
        for r in &s.replicas {
            expect
                .entry(r.clone())
                .or_default()
                .extend(by_shard[&s.id].iter().cloned());
        }
    }
    for n in &nodes {
        let on_disk = n.blob_files();
        let want = expect.remove(&n.id).unwrap_or_default();
        assert_eq!(
            on_disk.keys().cloned().collect::<BTreeSet<_>>(),
            want,
            "blobs on {}",
            n.id
        );
        for (name, path) in &on_disk {
            assert!(
                rehash_ok(path, name),
                "{} on {} does not hash to its name",
                name,
                n.id
            );
        }
    }

    // Importing the same tree again sends nothing: every blob is already placed.
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "2MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let again: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(again["version"], 2);
    assert_eq!(again["uploaded_bytes"], 0, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_repaired_peer_to_peer_and_counters_follow() {
    let h = Harness::new("repair");
    let (m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 300);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "512KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut c = m.client(None).await;
    let before = shards(&mut c, "ds", 1).await;
    let victim = before[0].replicas[0].clone();
    let vi = nodes.iter().position(|n| n.id == victim).unwrap();
    nodes[vi].daemon.kill9();

    // Every shard gets back to two replicas, none on the dead node.
    let opts = m.client_options(None);
    let victim2 = victim.clone();
    let after = wait_until(
        "repair to restore two live replicas",
        Duration::from_secs(60),
        || {
            let opts = opts.clone();
            let victim = victim2.clone();
            async move {
                let mut c = locus_proto::client::connect(&opts).await.ok()?;
                let s = shards(&mut c, "ds", 1).await;
                s.iter()
                    .all(|s| s.replicas.len() == 2 && !s.replicas.contains(&victim))
                    .then_some(s)
            }
        },
    )
    .await;
    assert_eq!(after.len(), before.len());

    // Resident counters equal the bytes of the shards each node holds, and those blobs
    // are on its disk.
    let entries = all_entries(&mut c, "ds", 1).await;
    let by_shard = blobs_by_shard(&entries);
    let v = c
        .get_version(pb::GetVersionRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "ds".into(),
                version: 1,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let resident: HashMap<String, u64> = v.resident.into_iter().map(|r| (r.node, r.bytes)).collect();
    for n in nodes.iter().filter(|n| n.id != victim) {
        let held: Vec<&pb::Shard> = after.iter().filter(|s| s.replicas.contains(&n.id)).collect();
        let bytes: u64 = held.iter().map(|s| s.bytes).sum();
        assert_eq!(
            resident.get(&n.id).copied().unwrap_or(0),
            bytes,
            "resident bytes of {}",
            n.id
        );
        let disk = n.blob_files();
        for s in held {
            for b in &by_shard[&s.id] {
                assert!(disk.contains_key(b), "{} lacks {b} of shard {}", n.id, s.id);
                assert!(rehash_ok(&disk[b], b));
            }
        }
    }
    assert!(!resident.contains_key(&victim), "the dead node no longer counts");

    // The node comes back: it re-registers, and its pin sync unpins what it no longer
    // replicates (the bytes stay as evictable cache).
    nodes[vi].restart().await;
    wait_until("the returned node to reconcile", Duration::from_secs(30), || {
        let m = &m;
        let victim = victim.clone();
        async move {
            let list = m.cli(&["node", "list", "--json"]);
            let j: serde_json::Value = serde_json::from_str(&stdout(&list)).ok()?;
            let n = j.as_array()?.iter().find(|n| n["id"] == victim.as_str())?.clone();
            (n["state"] == "up" && n["pinned_bytes"] == 0 && n["cached_bytes"].as_u64()? > 0).then_some(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_quarantined_never_served_and_restored() {
    let h = Harness::new("corrupt");
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 60);
    let out = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let n = &nodes[0];
    // A blob of more than one chunk; damage its last chunk.
    let (name, blob) = n
        .blob_files()
        .into_iter()
        .find(|(_, b)| b.size > 140_000)
        .expect("a multi-chunk blob");
    let good = blob.read();
    blob.flip(blob.size - 10);

    // Reading it never yields the damaged bytes: the stream fails with DATA_LOSS.
    let mut client = n.client().await;
    let mut stream = client
        .read_blob(nodepb::ReadBlobRequest {
            hash: blake3::Hash::from_hex(&name).unwrap().as_bytes().to_vec(),
            offset: 0,
            length: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    let mut err = None;
    while let Some(m) = stream.next().await {
        match m {
            Ok(d) => got.extend(d.data),
            Err(s) => {
                err = Some(s);
                break;
            }
        }
    }
    let err = err.expect("the corrupt blob must not stream to the end");
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");
    assert!(got.len() < good.len());
    assert_eq!(
        &got[..],
        &good[..got.len()],
        "what was sent before the bad chunk is correct"
    );
    assert!(n.quarantined() >= 1);

    // The node refetches it from the other replica.
    wait_until(
        "the quarantined blob to be restored",
        Duration::from_secs(30),
        || {
            let back = n.blob_files().get(&name).map(OnDisk::read);
            let good = good.clone();
            async move { (back? == good).then_some(()) }
        },
    )
    .await;
    // And serves it whole again.
    let again = read_all(&mut client, blake3::Hash::from_hex(&name).unwrap().as_bytes()).await;
    assert_eq!(again.unwrap(), good);

    // The metadata service heard about it with the next heartbeat.
    wait_until("the quarantine to be reported", Duration::from_secs(10), || {
        let m = &m;
        let id = n.id.clone();
        async move {
            let list = m.cli(&["node", "list", "--json"]);
            let j: serde_json::Value = serde_json::from_str(&stdout(&list)).ok()?;
            let q = j.as_array()?.iter().find(|x| x["id"] == id.as_str())?["quarantined"].as_u64()?;
            (q == 1).then_some(())
        }
    })
    .await;
    // And the node counted it.
    let body = http_get(n.http, "/metrics").await;
    assert!(body.contains("locus_node_corrupt_total 1"), "{body}");
    assert!(
        body.contains("locus_node_blobs_written_total{kind=\"peer\"} 1"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_finds_corruption_nobody_read() {
    let h = Harness::new("scrub");
    let (m, nodes) = cluster(&h, 2, |i| NodeOpts {
        scrub_rate: "64MiB",
        ..NodeOpts::host(i)
    })
    .await;
    let src = h.path("src");
    make_tree(&src, 40);
    let out = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let n = &nodes[1];
    let (name, blob) = n.blob_files().into_iter().find(|(_, b)| b.size > 1000).unwrap();
    let good = blob.read();
    blob.flip(0);
    wait_until(
        "scrub to quarantine the blob",
        Duration::from_secs(30),
        || async { (n.quarantined() >= 1).then_some(()) },
    )
    .await;
    wait_until("the blob to be restored", Duration::from_secs(30), || {
        let back = n.blob_files().get(&name).map(OnDisk::read);
        let good = good.clone();
        async move { (back? == good).then_some(()) }
    })
    .await;
    // The scrub keeps going over every blob, pass after pass, and says how far it got.
    wait_until("a complete scrub pass", Duration::from_secs(30), || async {
        let m = http_get(n.http, "/metrics").await;
        let passes = m
            .lines()
            .find(|l| l.starts_with("locus_node_scrub_passes_total "))?
            .rsplit(' ')
            .next()?
            .parse::<u64>()
            .ok()?;
        (passes >= 1).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_that_does_not_fit_says_which_shards_and_commits_nothing() {
    let h = Harness::new("full");
    let (m, nodes) = cluster(&h, 3, |i| NodeOpts {
        capacity: "1MiB",
        ..NodeOpts::host(i)
    })
    .await;
    let src = h.path("src");
    make_tree(&src, 200); // ~5 MiB
    let out = import(&m, "big", &src, &["--replicas", "2", "--shard-size", "512KiB"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("could not be placed; nothing was committed"),
        "{err}"
    );
    assert!(err.contains("shard "), "{err}");
    let list = m.cli(&["dataset", "list", "--json"]);
    assert_eq!(stdout(&list).trim(), "[]");
    let info = m
        .client(None)
        .await
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.open_sessions, 0, "the failed import's session was aborted");
    for n in &nodes {
        assert!(n.blob_files().is_empty(), "nothing was sent to {}", n.id);
    }
    // A node that is full refuses a blob cleanly.
    let mut c = nodes[0].client().await;
    let e = c
        .write_blob(tokio_stream::iter(write_msgs(vec![7u8; 2 << 20])))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(nodes[0].blob_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_moves_replicas_off_a_node() {
    let h = Harness::new("drain");
    let (m, nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 120);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = m.cli(&["node", "drain", "n1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_moved_off(&m, "ds", "n1").await;
    let list = m.cli(&["node", "list", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&list)).unwrap();
    let n1 = j.as_array().unwrap().iter().find(|n| n["id"] == "n1").unwrap();
    assert_eq!(n1["draining"], true);
    // Its blobs are no longer pinned once it syncs; they stay as evictable cache.
    wait_until("n1 to unpin", Duration::from_secs(30), || {
        let m = &m;
        async move {
            let list = m.cli(&["node", "list", "--json"]);
            let j: serde_json::Value = serde_json::from_str(&stdout(&list)).ok()?;
            let n1 = j.as_array()?.iter().find(|n| n["id"] == "n1")?.clone();
            (n1["pinned_bytes"] == 0).then_some(())
        }
    })
    .await;
    drop(nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_cleanly_and_keeps_serving() {
    let h = Harness::new("disk-full");
    // The node believes it has 1 GiB, but its disk is a 3 MiB tmpfs.
    let (m, nodes) = cluster(&h, 1, |i| NodeOpts {
        tmpfs: Some("3m"),
        ..NodeOpts::host(i)
    })
    .await;
    let n = &nodes[0];
    let mut c = n.client().await;
    let small = vec![1u8; 100_000];
    c.write_blob(tokio_stream::iter(write_msgs(small.clone())))
        .await
        .unwrap();
    let e = c
        .write_blob(tokio_stream::iter(write_msgs(vec![2u8; 4 << 20])))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("disk"), "{}", e.message());
    assert_eq!(n.blob_files().len(), 1, "nothing half-written is visible");
    assert_eq!(std::fs::read_dir(n.data_dir.join("tmp")).unwrap().count(), 0);
    // The node reports the real room it has, so placement will not over-fill it.
    let list = m.cli(&["node", "list", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&list)).unwrap();
    assert!(j[0]["free_bytes"].as_u64().unwrap() < 3 << 20, "{j}");
    // And it still serves what it has.
    let got = read_all(&mut c, blake3::hash(&small).as_bytes()).await;
    assert_eq!(got.unwrap(), small);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_import_leaves_no_version_and_a_rerun_completes_it() {
    let h = Harness::new("interrupt");
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 1_500);
    let mut args: Vec<String> = [
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "2",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["--chunk-size", "64KiB", "--parallel", "1"].map(String::from));
    let mut import = std::process::Command::new(locus())
        .args(&args)
        .env("LOCUS_METADATA", m.url())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it as soon as the first blobs have landed.
    wait_until("the import to start sending", Duration::from_secs(60), || {
        let n = nodes[0].blob_files().len() + nodes[1].blob_files().len();
        async move { (n >= 5).then_some(()) }
    })
    .await;
    import.kill().unwrap();
    import.wait().unwrap();
    let list = m.cli(&["dataset", "list", "--json"]);
    assert_eq!(stdout(&list).trim(), "[]", "no version from the killed import");

    let out = import_cmd(&m, &src);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["version"], 1);
    assert_eq!(j["files"], 1_500);
    assert!(
        j["skipped_bytes"].as_u64().unwrap() > 0,
        "blobs sent before the kill are not sent again: {j}"
    );
    let mut c = m.client(None).await;
    for s in shards(&mut c, "ds", 1).await {
        assert_eq!(s.replicas.len(), 2);
    }
}

/// A node killed (kill -9) in the middle of an import of small files keeps every blob it
/// had taken, whole and verified; the import fails and commits nothing; the same command
/// rerun once the node is back completes it without sending those blobs again, and both
/// replicas then hold every blob of every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_import_keeps_what_it_took_and_a_rerun_completes_the_import() {
    let h = Harness::new("import-node-killed");
    let (m, mut nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    for i in 0..12_000usize {
        let d = src.join(format!("d{:02}", i / 1000));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("f{i:05}")), pseudo_random(i as u64, 1024)).unwrap();
    }
    let args = [
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "2",
        "--json",
    ];
    let import = m
        .cli_command(&args, &[])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the node once its first batches are in, while the import still sends.
    wait_until("the node to take a first batch", Duration::from_secs(120), || {
        let n = nodes[0].blob_files().len();
        async move { (n >= 1000).then_some(()) }
    })
    .await;
    nodes[0].daemon.kill9();
    let taken = nodes[0].blob_files();
    let out = import.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "the import finished before the node was killed; the test needs more files"
    );
    assert!(stderr(&out).contains("nothing was committed"), "{}", stderr(&out));
    let list = m.cli(&["dataset", "list", "--json"]);
    assert_eq!(stdout(&list).trim(), "[]", "no version from the failed import");

    nodes[0].restart().await;
    // Files and packs renamed into place by a batch the kill cut short (never
    // acknowledged) are adopted: packs before the node serves, files by the check that
    // runs after: wait for it.
    let log = nodes[0].daemon.log.clone();
    wait_until("the restarted node's blob check", Duration::from_secs(60), || {
        let checks = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("blob directories checked against the index")
            .count();
        async move { (checks >= 2).then_some(()) }
    })
    .await;
    let mut c = nodes[0].client().await;
    for name in taken.keys() {
        let hash = blake3::Hash::from_hex(name).unwrap();
        let got = read_all(&mut c, hash.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("blob {name}, on disk at the kill, lost: {e}"));
        assert_eq!(blake3::hash(&got), hash, "blob {name} read back whole");
    }

    let out = m.cli(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["version"], 1);
    assert_eq!(j["files"], 12_000);
    assert!(
        j["skipped_bytes"].as_u64().unwrap() >= 1024 * taken.len() as u64,
        "what the node kept is not sent again ({} blobs): {j}",
        taken.len()
    );
    let mut meta = m.client(None).await;
    let by_shard = blobs_by_shard(&all_entries(&mut meta, "ds", 1).await);
    for s in shards(&mut meta, "ds", 1).await {
        assert_eq!(s.replicas.len(), 2, "shard {}", s.id);
        let want: Vec<Vec<u8>> = by_shard[&s.id]
            .iter()
            .map(|x| blake3::Hash::from_hex(x).unwrap().as_bytes().to_vec())
            .collect();
        for n in &nodes {
            let have = n
                .client()
                .await
                .have_blobs(nodepb::HaveBlobsRequest {
                    hashes: want.clone(),
                    pin: false,
                })
                .await
                .unwrap()
                .into_inner()
                .present;
            assert!(
                have.iter().all(|p| *p),
                "{} holds every blob of shard {}",
                n.id,
                s.id
            );
        }
    }
}

fn import_cmd(m: &Metadata, src: &Path) -> std::process::Output {
    import(m, "ds", src, &["--replicas", "2"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_from_a_real_s3_server() {
    use object_store::ObjectStoreExt;
    let h = Harness::new("s3-import");
    let s3 = h.start_s3().await;
    let bucket = s3.bucket("datasets").await;
    let src = h.path("src");
    make_tree(&src, 200);
    // Upload the regular files under a prefix (object stores have no symlinks or empty
    // directories).
    let mut files = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let ft = std::fs::symlink_metadata(e.path()).unwrap().file_type();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let rel = e.path().strip_prefix(&src).unwrap().to_str().unwrap().to_string();
                let data = std::fs::read(e.path()).unwrap();
                // Keys as an S3 client writes them (raw UTF-8, not percent-encoded).
                let key = object_store::path::Path::parse(format!("train/v1/{rel}")).unwrap();
                bucket.put(&key, data.clone().into()).await.unwrap();
                files.push((rel, data));
            }
        }
    }
    // Nodes get the store's endpoint and credentials: they read the origin in repairs.
    let env: Vec<(String, String)> = s3.env().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let (m, mut nodes) = cluster(&h, 3, |i| NodeOpts {
        env: env.clone(),
        ..NodeOpts::host(i)
    })
    .await;
    let mut cmd = std::process::Command::new(locus());
    cmd.args([
        "dataset",
        "import",
        "froms3",
        "s3://datasets/train/v1",
        "--replicas",
        "2",
        "--chunk-size",
        "64KiB",
        "--shard-size",
        "256KiB",
        "--json",
    ])
    .env("LOCUS_METADATA", m.url());
    for (k, v) in s3.env() {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["files"].as_u64().unwrap() as usize, files.len());
    assert!(!stderr(&out).contains(S3_SECRET), "credentials are never printed");

    let mut c = m.client(None).await;
    let entries = all_entries(&mut c, "froms3", 1).await;
    let by_path: HashMap<&str, &pb::Entry> = entries.iter().map(|e| (e.path.as_str(), e)).collect();
    for (rel, data) in &files {
        let e = by_path
            .get(rel.as_str())
            .unwrap_or_else(|| panic!("{rel} missing"));
        assert_eq!(e.size as usize, data.len(), "{rel}");
        assert_eq!(e.blob, blake3::hash(data).as_bytes().to_vec(), "{rel}");
        assert_eq!(e.chunks.len(), data.len().div_ceil(65536), "{rel}");
    }
    // Every shard on two nodes, and the bytes really there.
    for s in shards(&mut c, "froms3", 1).await {
        assert_eq!(s.replicas.len(), 2);
    }
    // Read by the nodes (they have the store's credentials): each object on its first
    // replica, the other replica copying it from there.
    for n in &nodes {
        let m = http_get(n.http, "/metrics").await;
        assert!(
            m.lines()
                .any(|l| l.starts_with("locus_node_blobs_written_total{kind=\"origin\"}")),
            "{} read nothing from the origin:\n{m}",
            n.id
        );
    }
    let held: Vec<_> = nodes.iter().map(|n| n.blob_files()).collect();
    for (rel, d) in &files {
        let b = blake3::hash(d).to_hex().to_string();
        let on = held.iter().filter(|h| h.contains_key(&b)).count();
        assert!(on >= 2, "{rel}: its blob is on {on} nodes");
    }

    // n1 and n2 are lost with their disks: the shards only they held come back onto n3
    // from the origin bucket, verified.
    let both: usize = shards(&mut c, "froms3", 1)
        .await
        .iter()
        .filter(|s| !s.replicas.contains(&"n3".to_string()))
        .count();
    assert!(both > 0, "some shards live on n1 and n2 only");
    for n in &mut nodes[..2] {
        n.daemon.kill9();
        std::fs::remove_dir_all(&n.data_dir).unwrap();
    }
    wait_until("n3 to hold every shard", Duration::from_secs(90), || {
        let mut c = c.clone();
        async move {
            let s = shards(&mut c, "froms3", 1).await;
            s.iter()
                .all(|s| s.replicas.contains(&"n3".to_string()))
                .then_some(())
        }
    })
    .await;
    assert!(nodes[2].logged("copied a blob from the version's origin"));
    assert!(!nodes[2].logged(S3_SECRET), "credentials are never logged");
    let mnt = m.mount("after", "froms3@1", Some(&nodes[2]), &[]);
    for (rel, data) in &files {
        let got = std::fs::read(mnt.path.join(rel)).unwrap();
        assert!(got == *data, "{rel}: wrong bytes");
    }
    drop(mnt);

    // A source that does not answer gives a clear error and leaves nothing behind.
    drop(s3);
    let mut cmd = std::process::Command::new(locus());
    cmd.args(["dataset", "import", "gone", "s3://datasets/train/v1"])
        .env("LOCUS_METADATA", m.url())
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", S3_KEY)
        .env("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        .env("AWS_REGION", "us-east-1");
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("listing the source failed"),
        "{}",
        stderr(&out)
    );
    let list = m.cli(&["dataset", "list", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&list)).unwrap();
    assert_eq!(j.as_array().unwrap().len(), 1);
}

/// A `WriteBlobs` call storing `blobs` pinned, each named by its hash.
fn pinned_batch(blobs: impl Iterator<Item = Vec<u8>>) -> nodepb::WriteBlobsRequest {
    nodepb::WriteBlobsRequest {
        blobs: blobs
            .map(|b| nodepb::SmallBlob {
                hash: blake3::hash(&b).as_bytes().to_vec(),
                data: b.into(),
            })
            .collect(),
        chunk_size: 0,
        pin: true,
    }
}

fn write_msgs(data: Vec<u8>) -> Vec<nodepb::WriteBlobMessage> {
    let hash = blake3::hash(&data);
    vec![
        nodepb::WriteBlobMessage {
            msg: Some(nodepb::write_blob_message::Msg::Header(nodepb::WriteBlobHeader {
                hash: hash.as_bytes().to_vec(),
                size: data.len() as u64,
                chunk_size: 0,
                pin: true,
            })),
        },
        nodepb::WriteBlobMessage {
            msg: Some(nodepb::write_blob_message::Msg::Data(data.into())),
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_nodes_check_callers_and_repair_still_works() {
    let h = Harness::new("node-auth");
    let (m, mut nodes) = cluster_with(&h, MetadataOpts::with_tokens(), 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 100);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(
        out.status.success(),
        "import with the admin token: {}",
        stderr(&out)
    );

    // No token opens a node, whatever its role — a reader's, the node's own, a peer's:
    // a token sent to a node reaches whoever registered its address. Only grants do.
    let refused = |who: &str, e: tonic::Status| {
        assert!(
            matches!(
                e.code(),
                tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
            ),
            "{who}: {e:?}"
        );
    };
    for (who, t) in [
        ("reader", m.token("reader").unwrap()),
        ("the node's own", m.node_token("n1").unwrap()),
        ("a peer's", m.node_token("n2").unwrap()),
    ] {
        let mut c = nodes[0].client_with(Some(&t)).await;
        let have = c
            .have_blobs(nodepb::HaveBlobsRequest {
                hashes: vec![],
                pin: false,
            })
            .await;
        refused(who, have.expect_err(who));
        let write = c
            .write_blob(tokio_stream::iter(write_msgs(vec![1u8; 1000])))
            .await;
        refused(who, write.expect_err(who));
    }
    let mut anonymous = nodes[0].client().await;
    let e = anonymous
        .have_blobs(nodepb::HaveBlobsRequest {
            hashes: vec![],
            pin: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);

    // Repair between nodes that check grants: the metadata service signs the target's
    // copy order itself, and the target reads its source under a read grant.
    let mut c = m.client(Some("admin")).await;
    let victim = shards(&mut c, "ds", 1).await[0].replicas[0].clone();
    let vi = nodes.iter().position(|n| n.id == victim).unwrap();
    nodes[vi].daemon.kill9();
    let opts = m.client_options(m.token("admin"));
    wait_until("repair with tokens", Duration::from_secs(60), || {
        let opts = opts.clone();
        let victim = victim.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let s = shards(&mut c, "ds", 1).await;
            s.iter()
                .all(|s| s.replicas.len() == 2 && !s.replicas.contains(&victim))
                .then_some(())
        }
    })
    .await;
}

#[test]
fn a_node_without_tokens_refuses_to_listen_beyond_loopback() {
    let h = Harness::new("node-insecure");
    let out = std::process::Command::new(locus())
        .args([
            "node",
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--capacity",
            "1GiB",
            "--data-dir",
        ])
        .arg(h.path("data"))
        .env_remove("LOCUS_NODE_TOKENS_FILE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("refusing to serve") && err.contains("--tokens-file"),
        "{err}"
    );
    assert!(!h.path("data/blobs").exists(), "nothing was created");
}

/// Reads a whole blob from a node.
async fn read_all(c: &mut locus_proto::client::NodeClient, hash: &[u8]) -> Result<Vec<u8>, tonic::Status> {
    read_range(c, hash, 0, 0).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_can_arrive_chunk_by_chunk_and_serves_only_what_is_there() {
    let h = Harness::new("partial");
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let data: Vec<u8> = (0..(9u32 << 20) + 12345).map(|i| (i % 251) as u8).collect();
    let hash = blake3::hash(&data);
    let cs = 4u64 << 20;
    let chunk_hashes: Vec<Vec<u8>> = data
        .chunks(cs as usize)
        .map(|c| blake3::hash(c).as_bytes().to_vec())
        .collect();
    // A node takes a partial blob's size from a committed manifest only.
    let mut c = m.client(None).await;
    commit_blob(
        &mut c,
        "partial",
        hash.as_bytes(),
        data.len() as u64,
        cs as u32,
        chunk_hashes.clone(),
    )
    .await
    .unwrap();
    let mut n1 = nodes[0].client().await;
    n1.write_blob(tokio_stream::iter(write_msgs(data.clone())))
        .await
        .unwrap();

    let mut n2 = nodes[1].client().await;
    let req = |chunks: Vec<u32>| nodepb::FetchChunksRequest {
        source: nodes[0].grpc.to_string(),
        hash: hash.as_bytes().to_vec(),
        size: data.len() as u64,
        chunk_size: cs as u32,
        chunk_hashes: chunk_hashes.clone(),
        chunks,
        pin: false,
        tree_chunks: false,
    };
    let r = n2.fetch_chunks(req(vec![1])).await.unwrap().into_inner();
    assert_eq!((r.fetched, r.complete, r.missing.clone()), (1, false, vec![0, 2]));
    // Only the present chunk's range is served; the blob is not "here" for HaveBlobs.
    let mid = read_range(&mut n2, hash.as_bytes(), cs + 100, 1000)
        .await
        .unwrap();
    assert_eq!(mid, data[(cs + 100) as usize..(cs + 1100) as usize]);
    let e = read_range(&mut n2, hash.as_bytes(), 0, 10).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let have = n2
        .have_blobs(nodepb::HaveBlobsRequest {
            hashes: vec![hash.as_bytes().to_vec()],
            pin: false,
        })
        .await
        .unwrap()
        .into_inner()
        .present;
    assert_eq!(have, vec![false]);
    assert!(nodes[1].blob_files().is_empty());

    // A chunk list that does not match the blob is refused; so is a size the manifest
    // does not give it, and a blob no committed version holds.
    let mut bad = req(vec![]);
    bad.chunk_hashes.pop();
    bad.hash = blake3::hash(b"another blob").as_bytes().to_vec();
    let e = n2.fetch_chunks(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let mut bigger = req(vec![]);
    bigger.size = 1 << 40;
    let e = n2.fetch_chunks(bigger).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("the manifest says"), "{e:?}");
    // Chunk hashes said to be tree chunk hashes must merge to the blob's hash: these are
    // plain ones, refused before anything is reserved.
    let mut not_tree = req(vec![]);
    not_tree.tree_chunks = true;
    let e = n2.fetch_chunks(not_tree).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("not the tree chunk hashes"), "{e:?}");

    // The rest completes it: whole, verified, visible.
    let r = n2.fetch_chunks(req(vec![])).await.unwrap().into_inner();
    assert_eq!((r.fetched, r.complete), (2, true));
    assert_eq!(read_all(&mut n2, hash.as_bytes()).await.unwrap(), data);
    let files = nodes[1].blob_files();
    assert!(rehash_ok(&files[&hash.to_hex().to_string()], &hash.to_hex()));
}

async fn read_range(
    c: &mut locus_proto::client::NodeClient,
    hash: &[u8],
    offset: u64,
    length: u64,
) -> Result<Vec<u8>, tonic::Status> {
    let mut s = c
        .read_blob(nodepb::ReadBlobRequest {
            hash: hash.to_vec(),
            offset,
            length,
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.next().await {
        out.extend(m?.data);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_peer_fails_transfers_quickly_and_repair_goes_around_it() {
    let h = Harness::new("hung");
    let (m, nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 80);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut c = m.client(None).await;
    let shards0 = shards(&mut c, "ds", 1).await;
    let stopped = shards0[0].replicas[0].clone();
    let si = nodes.iter().position(|n| n.id == stopped).unwrap();
    let other = nodes
        .iter()
        .position(|n| !shards0[0].replicas.contains(&n.id))
        .unwrap();
    let entries = all_entries(&mut c, "ds", 1).await;
    let blobs: Vec<nodepb::BlobRef> = entries
        .iter()
        .filter(|e| e.kind == pb::EntryKind::File as i32 && e.shard == shards0[0].id)
        .map(|e| nodepb::BlobRef {
            hash: e.blob.clone(),
            size: e.size,
            ..Default::default()
        })
        .collect();

    // The source hangs (SIGSTOP: its socket accepts, nothing answers).
    nodes[si].daemon.sigstop();
    let mut target = nodes[other].client().await;
    let started = std::time::Instant::now();
    let e = target
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: nodes[si].grpc.to_string(),
            blobs,
            pin: false,
            chunk_size: 65536,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "gave up after {:?}",
        started.elapsed()
    );

    // The stopped node falls silent, is declared down, and repair copies from the others.
    let opts = m.client_options(None);
    wait_until("repair around the hung node", Duration::from_secs(60), || {
        let opts = opts.clone();
        let stopped = stopped.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let s = shards(&mut c, "ds", 1).await;
            s.iter()
                .all(|s| s.replicas.len() == 2 && !s.replicas.contains(&stopped))
                .then_some(())
        }
    })
    .await;
    nodes[si].daemon.sigcont();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_client_gets_a_verified_local_path_over_the_unix_socket() {
    let h = Harness::new("ensure-local");
    let (_m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    // A blob n1 replicates (so the metadata service can locate it) and n2 lacks.
    let src = h.path("src");
    make_tree(&src, 30);
    let out = import(&_m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (holder, other) = if nodes[0].blob_files().is_empty() {
        (1, 0)
    } else {
        (0, 1)
    };
    // The import sent the holder its small files as one batch, which it keeps as a pack.
    let (name, row) = nodes[holder]
        .blob_files()
        .into_iter()
        .find(|(_, b)| b.packed && b.size > 1000)
        .expect("the small files are kept packed");
    let data = row.read();
    let chunk_size = 64 * 1024;
    let req = nodepb::EnsureLocalRequest {
        hash: blake3::Hash::from_hex(&name).unwrap().as_bytes().to_vec(),
        size: data.len() as u64,
        chunk_size,
        packed_ok: true,
    };

    // On the holder, the blob is a range of its pack: a client that reads whole files is
    // refused it, one that reads ranges gets the pack, the offset, and the blob's bytes.
    let mut at_holder = locus_proto::client::connect_local_node(&nodes[holder].socket);
    let whole_only = nodepb::EnsureLocalRequest {
        packed_ok: false,
        ..req.clone()
    };
    let e = at_holder.ensure_local(whole_only).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("packed"), "{e:?}");
    let got = at_holder.ensure_local(req.clone()).await.unwrap().into_inner();
    assert!(got.packed);
    assert_eq!(got.offset, row.offset);
    let mut range = vec![0u8; data.len()];
    std::os::unix::fs::FileExt::read_exact_at(
        &std::fs::File::open(&got.path).unwrap(),
        &mut range,
        got.offset,
    )
    .unwrap();
    assert_eq!(range, data, "the blob's range of the pack");

    // Over TCP the call is refused: only same-host clients may ask for paths.
    let e = nodes[other]
        .client()
        .await
        .ensure_local(req.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied);

    let mut local = locus_proto::client::connect_local_node(&nodes[other].socket);
    let got = local.ensure_local(req.clone()).await.unwrap().into_inner().path;
    assert!(got.starts_with(nodes[other].data_dir.to_str().unwrap()), "{got}");
    assert_eq!(
        std::fs::read(&got).unwrap(),
        data,
        "fetched from the peer, verified, local"
    );
    // A blob nobody has is a clear NOT_FOUND, never an empty file.
    let mut missing = req;
    missing.hash = blake3::hash(b"nobody has this").as_bytes().to_vec();
    let e = local.ensure_local(missing).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    // Whoever reaches the socket cannot make the node read a URL of their choosing with
    // the node's credentials.
    let e = local
        .import_object(nodepb::ImportObjectRequest {
            origin: format!("file://{}", h.path("").display()),
            path: "n1.log".into(),
            size: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("Unix socket"), "{e:?}");
}

/// Files of `mib` MiB each, `n` of them, different contents.
fn make_big_files(root: &Path, n: usize, mib: usize) {
    std::fs::create_dir_all(root).unwrap();
    for i in 0..n {
        std::fs::write(
            root.join(format!("f{i:03}.bin")),
            pseudo_random(1000 + i as u64, mib << 20),
        )
        .unwrap();
    }
}

async fn node_info(c: &mut locus_proto::client::MetadataClient, id: &str) -> pb::Node {
    c.list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes
        .into_iter()
        .find(|n| n.id == id)
        .unwrap()
}

/// LocateBlobs calls the metadata service has answered so far.
async fn locate_calls(m: &Metadata) -> u64 {
    http_get(m.http, "/metrics")
        .await
        .lines()
        .filter(|l| l.contains("rpc_requests_total") && l.contains("method=\"LocateBlobs\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn replica_map(s: &[pb::Shard]) -> BTreeMap<u32, BTreeSet<String>> {
    s.iter()
        .map(|s| (s.id, s.replicas.iter().cloned().collect()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refilling_node_stays_up_serves_mounts_and_nothing_is_re_placed() {
    let h = Harness::new("refill");
    // A 2 s liveness timeout, and a refill held to 3 MiB/s so that refilling 24 MiB takes
    // several liveness windows.
    let (m, mut nodes) = cluster(&h, 2, |i| NodeOpts {
        extra: vec!["--refill-rate".into(), "3MiB".into()],
        ..NodeOpts::host(i)
    })
    .await;
    let src = h.path("src");
    make_big_files(&src, 24, 1);
    let out = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "4MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut c = m.client(None).await;
    let before = replica_map(&shards(&mut c, "ds", 1).await);
    let want: BTreeSet<String> = nodes[1].blob_files().into_keys().collect();
    assert_eq!(
        nodes[0].blob_files().len(),
        want.len(),
        "both nodes hold every blob"
    );

    let locates_before = locate_calls(&m).await;
    // The disk of n1 is replaced: stop it, wipe its data dir, start it again.
    nodes[0].daemon.terminate().await;
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    nodes[0].restart().await;

    // Back: registered, pins synced, the missing blobs queued.
    let opts = m.client_options(None);
    wait_until("n1 to start refilling", Duration::from_secs(30), || {
        let opts = opts.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let n = node_info(&mut c, "n1").await;
            (n.state == pb::NodeState::Up as i32 && n.refill_blobs > 0).then_some(())
        }
    })
    .await;
    let started = std::time::Instant::now();
    let mut saw_refilling = None;
    let mut mounted = None;
    loop {
        let n = node_info(&mut c, "n1").await;
        assert_eq!(
            n.state,
            pb::NodeState::Up as i32,
            "n1 was taken for dead {:?} into its refill: {n:?}",
            started.elapsed()
        );
        if n.refill_blobs > 0 && saw_refilling.is_none() {
            // At most the 24 MiB of files and the version's sealed namespace (a few KiB).
            assert!(
                n.refill_bytes > 0 && n.refill_bytes <= (24 << 20) + (64 << 10),
                "{n:?}"
            );
            saw_refilling = Some(n.clone());
            // The operator sees it: the node is listed as refilling, with what is left.
            let list = stdout(&m.cli(&["node", "list"]));
            assert!(list.contains("refilling") && list.contains("to go"), "{list}");
            let status = stdout(&m.cli(&["status"]));
            assert!(status.contains("refilling: n1"), "{status}");
            // The node serves a mount while it refills: files it lacks are fetched for
            // the reader at once (not at the refill's rate) and read back intact.
            let mnt = m.mount("mnt", "ds@latest", Some(&nodes[0]), &[]);
            for i in [3usize, 11, 20] {
                let name = format!("f{i:03}.bin");
                let got = std::fs::read(mnt.path.join(&name)).unwrap();
                assert!(got == std::fs::read(src.join(&name)).unwrap(), "{name} differs");
            }
            mounted = Some(mnt);
        }
        if saw_refilling.is_some() && n.refill_blobs == 0 {
            let have: BTreeSet<String> = nodes[0].blob_files().into_keys().collect();
            if have == want {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the refill did not finish: {n:?}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let first = saw_refilling.expect("the refill was seen in node list");
    drop(mounted);
    // It took several liveness windows, during which n1 never went down.
    assert!(
        started.elapsed() > Duration::from_secs(4),
        "the refill was too quick ({:?}) to prove anything",
        started.elapsed()
    );
    assert_eq!(
        replica_map(&shards(&mut c, "ds", 1).await),
        before,
        "no shard was re-placed"
    );
    for (name, p) in nodes[0].blob_files() {
        assert!(rehash_ok(&p, &name), "{name} refilled wrong");
    }
    // Blobs are located in batches, not one LocateBlobs call per blob (which would be 24,
    // plus the mount's three reads that ask for theirs on their own). How many batches
    // depends on how pin sync's passes split the missing blobs, which load on the machine
    // moves (12 was seen once in a loaded full run, with no copy failing): the bound is
    // one per blob, not a batch count.
    let locates = locate_calls(&m).await - locates_before;
    assert!(
        (1..24).contains(&locates),
        "{locates} LocateBlobs calls to refill 24 blobs"
    );
    let metrics = http_get(nodes[0].http, "/metrics").await;
    assert!(
        metrics.contains("locus_node_refill_bytes_total"),
        "refill metrics are served"
    );
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refill_gives_up_on_a_hung_peer_and_copies_from_another() {
    let h = Harness::new("refill-hung");
    // The stopped node still counts as up and is offered as a source: only the copy's
    // idle timeout (2 s) can save the refill.
    let (m, mut nodes) = patient_cluster(&h, 3).await;
    let src = h.path("src");
    make_big_files(&src, 12, 1);
    let out = import(&m, "ds", &src, &["--replicas", "3", "--shard-size", "1MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let want: BTreeSet<String> = nodes[1].blob_files().into_keys().collect();

    nodes[0].daemon.terminate().await;
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    nodes[1].daemon.sigstop();
    nodes[0].restart().await;
    let n1 = &nodes[0];
    wait_until(
        "n1 to refill around the hung n2",
        Duration::from_secs(90),
        || async {
            let have: BTreeSet<String> = n1.blob_files().into_keys().collect();
            (have == want).then_some(())
        },
    )
    .await;
    nodes[1].daemon.sigcont();
    let log = std::fs::read_to_string(h.path("n1.log")).unwrap();
    assert!(
        log.contains("peer=n2")
            && ["sent nothing", "did not answer", "cannot connect"]
                .iter()
                .any(|m| log.contains(m)),
        "the hung peer was tried and given up on: {log}"
    );
    for (name, p) in nodes[0].blob_files() {
        assert!(rehash_ok(&p, &name));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_unread_streams_leave_writes_heartbeats_and_readers_working() {
    let h = Harness::new("unread");
    let (m, nodes) = cluster(&h, 1, |i| NodeOpts {
        // Long enough that no stalled stream is closed during the test.
        extra: vec!["--peer-timeout".into(), "120s".into()],
        ..NodeOpts::host(i)
    })
    .await;
    let src = h.path("src");
    make_big_files(&src, 1, 4);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The file's blob (the node holds the version's sealed namespace too).
    let data = std::fs::read(src.join("f000.bin")).unwrap();
    let hash = blake3::hash(&data).as_bytes().to_vec();
    assert!(nodes[0]
        .blob_files()
        .contains_key(&blake3::hash(&data).to_hex().to_string()));

    // 3 connections × 200 streams (the server's per-connection limit), none ever read:
    // once each connection's flow-control window is full, every further stream waits on
    // its reader.
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = nodes[0].client().await;
        for _ in 0..200 {
            let s = tokio::time::timeout(
                Duration::from_secs(20),
                c.read_blob(nodepb::ReadBlobRequest {
                    hash: hash.clone(),
                    offset: 0,
                    length: 0,
                }),
            )
            .await
            .expect("a stream opens")
            .unwrap();
            held.push(s.into_inner());
        }
    }
    assert_eq!(held.len(), 600);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // A fresh reader gets the whole blob.
    let mut fresh = nodes[0].client().await;
    let got = tokio::time::timeout(Duration::from_secs(20), read_all(&mut fresh, &hash))
        .await
        .expect("a fresh reader is served")
        .unwrap();
    assert!(got == data, "the fresh reader got the right bytes");

    // A write lands.
    let new = pseudo_random(77, 3 << 20);
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        fresh.write_blob(tokio_stream::iter(write_msgs(new.clone()))),
    )
    .await
    .expect("a write is served")
    .unwrap();
    assert!(r.into_inner().stored);

    // Heartbeats go on: after more than a liveness timeout (2 s) the node is up and was
    // seen recently.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut c = m.client(None).await;
    let n = node_info(&mut c, "n1").await;
    assert_eq!(n.state, pb::NodeState::Up as i32, "{n:?}");
    assert!(n.last_seen_ms_ago < 2000, "{n:?}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_to_a_hung_node_gives_up_after_the_peer_timeout_and_commits_nothing() {
    let h = Harness::new("import-hung");
    // The stopped node still counts as up, so placement sends it shards.
    let (m, nodes) = patient_cluster(&h, 2).await;
    let src = h.path("src");
    make_big_files(&src, 8, 1);
    nodes[1].daemon.sigstop();
    let args = [
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "1",
        "--shard-size",
        "1MiB",
    ];
    // Longer than the ten seconds between progress lines in a log, so the stall shows.
    let out = m
        .cli_within(
            Duration::from_secs(120),
            &args,
            &[("LOCUS_PEER_TIMEOUT", "13s".to_string())],
        )
        .await;
    nodes[1].daemon.sigcont();
    assert!(!out.status.success(), "the import cannot have succeeded");
    let err = stderr(&out);
    assert!(
        ["no bytes reached the node", "did not answer", "cannot reach"]
            .iter()
            .any(|m| err.contains(m)),
        "says why: {err}"
    );
    assert!(
        err.contains("nothing moved for"),
        "the stall was shown while it lasted: {err}"
    );
    assert!(
        err.contains("nothing was committed") && err.contains("Rerun the same command"),
        "says what was left and what to do: {err}"
    );
    let show = m.cli(&["dataset", "show", "ds", "--json"]);
    let versions = stdout(&show);
    assert!(
        !show.status.success() || !versions.contains("\"version\": 1"),
        "nothing was committed: {versions}"
    );
    // As the message says: the same command, once the node answers, commits.
    let out = m.cli_within(Duration::from_secs(120), &args, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
}

/// With no backup, a shard whose every replica is gone is copied back from the version's
/// origin (the directory it was imported from) — except a file changed there since the
/// import: its shard stays lost and a read of it fails, never returns the new bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_every_replica_is_gone_is_repaired_from_the_origin_unless_the_file_changed() {
    let h = Harness::new("repair-from-origin");
    let src = h.path("src");
    // The nodes may read the directory the version came from (and nothing else local).
    let root = src.display().to_string();
    let (m, mut nodes) = cluster(&h, 3, |i| {
        let mut o = NodeOpts::host(i);
        o.extra = vec!["--origin-root".into(), root.clone()];
        o
    })
    .await;
    make_tree(&src, 60);
    let o = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "128KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = m.client(None).await;
    let alone: BTreeSet<u32> = shards(&mut c, "ds", 1)
        .await
        .iter()
        .filter(|s| s.replicas == ["n1"])
        .map(|s| s.id)
        .collect();
    assert!(alone.len() >= 2, "n1 holds some shards alone: {alone:?}");
    // One file of one of n1's shards changes at the origin (same size, new bytes).
    let entries = all_entries(&mut c, "ds", 1).await;
    let changed = entries
        .iter()
        .find(|e| e.kind == pb::EntryKind::File as i32 && e.size > 0 && alone.contains(&e.shard))
        .expect("a file on n1 alone");
    let bad_shard = changed.shard;
    let path = src.join(&changed.path);
    let before = std::fs::read(&path).unwrap();
    std::fs::write(&path, before.iter().map(|b| b ^ 0xff).collect::<Vec<_>>()).unwrap();

    // n1 and its disk are gone for good.
    nodes[0].daemon.kill9();
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    wait_until(
        "every shard but the changed file's to have its replica back",
        Duration::from_secs(60),
        || {
            let mut c = c.clone();
            async move {
                let s = shards(&mut c, "ds", 1).await;
                s.iter()
                    .all(|s| s.replicas.len() == 1 && (s.id == bad_shard) == (s.replicas[0] == "n1"))
                    .then_some(())
            }
        },
    )
    .await;
    let from_origin = nodes[1..]
        .iter()
        .any(|n| n.logged("copied a blob from the version's origin"));
    assert!(from_origin, "no node logged a copy from the origin");

    // Every other file reads back as imported; the changed one fails with EIO.
    std::fs::write(&path, &before).unwrap();
    let want = files_of(&src);
    std::fs::write(&path, before.iter().map(|b| b ^ 0xff).collect::<Vec<_>>()).unwrap();
    // A caller cannot point a node at an origin of its choosing: only the one the version
    // recorded.
    let e = nodes[1]
        .client()
        .await
        .fetch_blobs(nodepb::FetchBlobsRequest {
            blobs: vec![nodepb::BlobRef {
                hash: blake3::hash(b"x").as_bytes().to_vec(),
                size: 1,
                origin_path: "passwd".into(),
            }],
            origin: "file:///etc".into(),
            origin_dataset: "ds".into(),
            origin_version: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not the recorded origin of ds@1"), "{e:?}");
    let mnt = m.mount("after", "ds@1", None, &[]);
    for (rel, hash) in &want {
        let got = std::fs::read(mnt.path.join(rel));
        if rel.as_path() == Path::new(&changed.path) {
            let e = got.expect_err("the changed file must not read");
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        } else {
            let got = got.unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
            assert_eq!(blake3::hash(&got).to_hex().as_str(), hash, "{}", rel.display());
        }
    }
}

/// A process holding node n2's token claims n1 at another address: refused at start with
/// a message that says whose token it is, and n1 keeps its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_with_another_nodes_token_is_refused_and_the_victims_address_is_unchanged() {
    let h = Harness::new("impostor");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                liveness_timeout: Some("2s"),
                ..Default::default()
            },
        )
        .await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let _n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let address = |id: &'static str| {
        let m = &m;
        async move { node_address(m, id).await }
    };
    assert_eq!(address("n1").await, n1.grpc.to_string());

    let run = h.node_until_exit("impostor", "n1", &m, m.named_token("n2"), Duration::from_secs(20));
    let (status, log) = run.expect("the impostor must not keep running");
    assert!(!status.success(), "{log}");
    assert!(log.contains("node n1 must present its own"), "{log}");
    assert_eq!(
        address("n1").await,
        n1.grpc.to_string(),
        "n1's address is unchanged"
    );
    // Nor can the real n2 speak for n1 directly.
    let mut as_n2 = m.client_named("n2").await;
    let e = as_n2
        .heartbeat(pb::HeartbeatRequest {
            id: "n1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
}

/// Two processes started with one id (on one host, as two hosts left at the default id
/// would be): the second is refused at start while the first is up. Once the first is
/// down, a new identity takes the id over, and the old process, back from its pause, is
/// told to stop and does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_a_registered_id_is_refused_until_the_first_is_down() {
    let h = Harness::new("duplicate-id");
    let (m, mut nodes) = cluster(&h, 1, NodeOpts::host).await;
    let first = nodes[0].grpc.to_string();

    let (status, log) = h
        .node_until_exit("dup", "n1", &m, None, Duration::from_secs(30))
        .expect("the duplicate must give up");
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("held by another running process") && log.contains("its own --id"),
        "{log}"
    );
    assert_eq!(node_address(&m, "n1").await, first);

    // The first pauses (a hung host) and is declared down: a new process (its own data
    // dir, so its own identity) takes n1 over.
    nodes[0].daemon.sigstop();
    wait_node_down(&m, "n1").await;
    let replacement = h.start_node_in("n1-new", "n1", &m, NodeOpts::host(1)).await;
    assert_eq!(node_address(&m, "n1").await, replacement.grpc.to_string());
    // The old process comes back: its heartbeat is refused and it stops on its own.
    nodes[0].daemon.sigcont();
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !nodes[0].daemon.exited() {
        assert!(
            std::time::Instant::now() < until,
            "the replaced process is still running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(&nodes[0].daemon.log).unwrap();
    assert!(log.contains("was taken over by another process"), "{log}");
    assert_eq!(node_address(&m, "n1").await, replacement.grpc.to_string());
}

async fn node_address(m: &Metadata, id: &str) -> String {
    let mut c = m.client(m.opts.tokens.first().map(|_| "admin")).await;
    node_info(&mut c, id).await.address
}

/// Runs a small Python client as user nobody that connects to `sock`, sends the HTTP/2
/// preface and reads: "refused" (connect not permitted), "closed" (the node hung up),
/// or "answered".
fn connect_as_nobody(sock: &Path) -> String {
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused"); sys.exit(0)
s.settimeout(5)
try:
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    print("answered" if s.recv(100) else "closed")
except (ConnectionResetError, BrokenPipeError):
    print("closed")
"#;
    let out = std::process::Command::new("setpriv")
        // Debian's python: a per-user one (pyenv under /root) is not runnable by nobody.
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .arg(sock)
        .output()
        .expect("setpriv and python3");
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).trim().to_string()
}

/// The node's Unix socket: mode 0660, so another user cannot connect; with its mode
/// loosened, the node still hangs up on a caller who is not root, its user or its group;
/// and a permitted caller gets reads, not writes or fetches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_socket_admits_only_its_users_and_serves_them_no_writes_or_fetches() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new("local-socket");
    let (_m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let sock = &nodes[0].socket;
    let mode = std::fs::metadata(sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "{mode:o}");
    assert_eq!(connect_as_nobody(sock), "refused");
    std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(connect_as_nobody(sock), "closed");
    let log = std::fs::read_to_string(&nodes[0].daemon.log).unwrap();
    assert!(log.contains("refused a connection on the local socket"), "{log}");

    let mut local = locus_proto::client::connect_local_node(sock);
    let e = local
        .write_blob(tokio_stream::iter(write_msgs(b"x".repeat(1000))))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("not served on the node's Unix socket"),
        "{e:?}"
    );
    let e = local
        .fetch_blobs(nodepb::FetchBlobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // What a mount needs still works.
    local
        .get_node_status(nodepb::GetNodeStatusRequest {})
        .await
        .expect("status over the socket");
}

/// A peer that streams without end, whatever it was asked for, is cut off as soon as it
/// sends more than was asked — a chunk (FetchChunks) or a blob (FetchBlobs) — and the
/// node keeps nothing from it. An address that is no registered node's is refused as a
/// source outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_streaming_endlessly_is_cut_off_at_what_was_asked() {
    let h = Harness::new("endless-peer");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let peer = EndlessPeer::start().await;
    let mut c = nodes[0].client().await;
    // Only a registered node's address may be named as a source: the endless peer is
    // registered first (as a broken node would be).
    let e = c
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: peer.addr.to_string(),
            blobs: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not a registered node's address"), "{e:?}");
    m.client(None)
        .await
        .register_node(pb::RegisterNodeRequest {
            id: "endless".into(),
            address: peer.addr.to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    // The node re-reads the node list on a miss at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let blob = blake3::hash(b"a blob the peer pretends to have")
        .as_bytes()
        .to_vec();
    let size = 4u64 << 20;
    let chunk = 1u32 << 20;
    let chunks: Vec<Vec<u8>> = (0..4u8).map(|i| blake3::hash(&[i]).as_bytes().to_vec()).collect();
    commit_blob(&mut m.client(None).await, "pretend", &blob, size, chunk, chunks)
        .await
        .unwrap();
    let e = c
        .fetch_chunks(nodepb::FetchChunksRequest {
            source: peer.addr.to_string(),
            hash: blob.clone(),
            size,
            chunk_size: chunk,
            chunk_hashes: (0..4u8).map(|i| blake3::hash(&[i]).as_bytes().to_vec()).collect(),
            chunks: vec![0],
            pin: false,
            tree_chunks: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DataLoss, "{e:?}");
    assert!(
        e.message()
            .contains("sent more than the 1048576 bytes of chunk 0"),
        "{e:?}"
    );
    let e = c
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: peer.addr.to_string(),
            blobs: vec![nodepb::BlobRef {
                hash: blob.clone(),
                size,
                ..Default::default()
            }],
            chunk_size: chunk,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("more bytes than announced"), "{e:?}");
    // A handful of 1 MiB messages in flight, not the endless stream.
    let sent = peer.sent.load(std::sync::atomic::Ordering::SeqCst);
    assert!(sent < 64, "the node kept taking: {sent} MiB");
    assert!(nodes[0].blob_files().is_empty());
}

/// `WriteBlobs`: small blobs stored in one group commit, acknowledged only once durable
/// (a kill -9 right after the answer loses none); a blob whose bytes do not match its
/// name fails the whole call and none of the batch becomes visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_small_blobs_is_stored_together_and_a_bad_one_fails_it_whole() {
    let h = Harness::new("write-blobs");
    let (_m, mut nodes) = cluster(&h, 1, NodeOpts::host).await;
    let blob = |i: usize| format!("small file number {i}, a few bytes").into_bytes();
    let req = |range: std::ops::Range<usize>| pinned_batch(range.map(blob));
    let mut c = nodes[0].client().await;
    let r = c.write_blobs(req(0..100)).await.unwrap().into_inner();
    assert_eq!((r.stored, r.already_present), (100, 0));
    let r = c.write_blobs(req(50..150)).await.unwrap().into_inner();
    assert_eq!(
        (r.stored, r.already_present),
        (50, 50),
        "held ones are not written again"
    );

    // One bad blob in a batch: refused by name, and nothing of the batch is visible.
    let mut bad = req(200..210);
    let wrong = blake3::hash(b"what the name claims").as_bytes().to_vec();
    bad.blobs.push(nodepb::SmallBlob {
        hash: wrong.clone(),
        data: b"other bytes".to_vec().into(),
    });
    let e = c.write_blobs(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains(&BlobHash::from_slice("h", &wrong).unwrap().to_string()),
        "{}",
        e.message()
    );
    let have = c
        .have_blobs(nodepb::HaveBlobsRequest {
            hashes: (200..210)
                .map(|i| blake3::hash(&blob(i)).as_bytes().to_vec())
                .collect(),
            pin: false,
        })
        .await
        .unwrap()
        .into_inner()
        .present;
    assert!(
        have.iter().all(|p| !p),
        "none of the failed batch is visible: {have:?}"
    );
    assert_eq!(
        std::fs::read_dir(nodes[0].data_dir.join("tmp")).unwrap().count(),
        0
    );
    // Too large for a batch: refused, saying which call takes it.
    let big = vec![3u8; 2 << 20];
    let e = c
        .write_blobs(nodepb::WriteBlobsRequest {
            blobs: vec![nodepb::SmallBlob {
                hash: blake3::hash(&big).as_bytes().to_vec(),
                data: big.into(),
            }],
            chunk_size: 0,
            pin: true,
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("WriteBlob takes any"), "{}", e.message());

    // Acknowledged means durable: kill -9, restart, every blob is there and reads back.
    nodes[0].daemon.kill9();
    nodes[0].restart().await;
    let mut c = nodes[0].client().await;
    for i in 0..150 {
        let got = read_all(&mut c, blake3::hash(&blob(i)).as_bytes()).await.unwrap();
        assert_eq!(got, blob(i));
    }
}

/// An import's blobs are in no listing of what a node must hold until the import
/// commits: pin sync keeps them pinned while its session is open (unpinned, a full node
/// could evict blobs the importer was told are stored), and lets them go once the
/// session is aborted. The same holds for blobs an import skips because the node holds
/// them already (cached unpinned): HaveBlobs with `pin` pins them for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_written_or_found_held_for_an_open_import_stay_pinned_across_pin_syncs_until_it_ends() {
    let h = Harness::new("open-import-pins");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let n = &nodes[0];
    let mut meta = m.client(None).await;
    let blob = |i: usize| format!("file {i} of an import still under way").into_bytes();
    let bytes: u64 = (0..40).map(|i| blob(i).len() as u64).sum();

    // Three pin syncs while the session is open (one a second here): each would have
    // unpinned the blobs, as no version names them. Then the import is given up: the next
    // syncs unpin them, and they stay as cache.
    let kept_until_aborted = |meta: &mut locus_proto::client::MetadataClient, session: u64| {
        let mut meta = meta.clone();
        async move {
            let synced = counter(n, "locus_node_pin_syncs_total").await;
            wait_until("three pin syncs", Duration::from_secs(30), || async {
                (counter(n, "locus_node_pin_syncs_total").await >= synced + 3).then_some(())
            })
            .await;
            assert_eq!(counter(n, "locus_node_pinned_bytes").await, bytes);
            assert_eq!(counter(n, "locus_node_open_import_pinned_blobs").await, 40);
            meta.abort_version(pb::AbortVersionRequest { session_id: session })
                .await
                .unwrap();
            wait_until("the blobs to be unpinned", Duration::from_secs(30), || async {
                (counter(n, "locus_node_pinned_bytes").await == 0).then_some(())
            })
            .await;
            assert_eq!(counter(n, "locus_node_open_import_pinned_blobs").await, 0);
            assert_eq!(
                counter(n, "locus_node_used_bytes").await,
                bytes,
                "unpinned, not deleted"
            );
        }
    };

    let s = begin_import(&mut meta).await;
    let r = n
        .client()
        .await
        .write_blobs(pinned_batch((0..40).map(blob)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.stored, 40);
    kept_until_aborted(&mut meta, s).await;

    // A second import of the same files finds them held and sends nothing. Asking
    // without `pin` leaves them evictable; asking as an import does pin them, and they
    // stay pinned across syncs until that import ends too.
    let s2 = begin_import(&mut meta).await;
    let mut asked: Vec<Vec<u8>> = (0..40)
        .map(|i| blake3::hash(&blob(i)).as_bytes().to_vec())
        .collect();
    asked.push(blake3::hash(b"never written").as_bytes().to_vec());
    let mut c = n.client().await;
    for pin in [false, true] {
        let present = c
            .have_blobs(nodepb::HaveBlobsRequest {
                hashes: asked.clone(),
                pin,
            })
            .await
            .unwrap()
            .into_inner()
            .present;
        assert_eq!(present, [vec![true; 40], vec![false]].concat());
        let pinned = counter(n, "locus_node_pinned_bytes").await;
        assert_eq!(pinned, if pin { bytes } else { 0 }, "pin: {pin}");
    }
    kept_until_aborted(&mut meta, s2).await;
}

/// Opens an import session of one replica for dataset "ds"; its id.
async fn begin_import(meta: &mut locus_proto::client::MetadataClient) -> u64 {
    meta.begin_version(pb::BeginVersionRequest {
        dataset: "ds".into(),
        replication: 1,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .session_id
}
