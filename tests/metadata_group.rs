//! A replicated metadata group of three real `locus metadata serve` processes: what a
//! client acknowledged survives the leader's `kill -9`, numbering stays exact, a minority
//! refuses writes, and followers forward what they cannot answer.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::pb;
use locus_testkit::*;

async fn versions(c: &mut locus_proto::client::MetadataClient, ds: &str) -> Vec<u64> {
    c.get_dataset(pb::GetDatasetRequest { name: ds.into() })
        .await
        .map(|d| d.into_inner().versions.iter().map(|v| v.version).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_commit_survives_kill9_of_the_leader_and_numbers_stay_consecutive() {
    let h = Harness::new("group-kill");
    let mut ms = h.start_group("meta", 3, MetadataOpts::with_tokens()).await;

    // A session begun and filled but never committed: it must never become a version.
    let mut c = ms[0].client(Some("admin")).await;
    let (orphan, _) = synthetic_manifest("orphan", 30, 10, 10, 1 << 16);
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "shared".into(),
            replication: 1,
            chunk_size: 1 << 16,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    locus_proto::client::put_entries_paged(&mut c, s.session_id, orphan)
        .await
        .unwrap();

    // Two writers commit in a loop through the whole group's URL list, keeping what was
    // acknowledged; a failed call (the leader died under it) is retried with a new session.
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2 {
        let m_url = ms[0].client_options(ms[0].token("admin"));
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut acked: Vec<(u64, Vec<pb::Entry>)> = Vec::new();
            let mut failures = 0u32;
            let mut round = 0;
            while !stop.load(Ordering::SeqCst) {
                round += 1;
                let Ok(mut c) = locus_proto::client::connect(&m_url).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let (e, s) = synthetic_manifest(&format!("w{w}r{round}"), 20 + round % 7, 10, 10, 1 << 16);
                match commit(&mut c, "shared", 1 << 16, e.clone(), s).await {
                    Ok(v) => acked.push((v.version, e)),
                    Err(_) => {
                        failures += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            (acked, failures)
        }));
    }
    let c0 = ms[0].client(Some("admin")).await;
    wait_until("six commits before the kill", Duration::from_secs(60), || {
        let mut c = c0.clone();
        async move { (versions(&mut c, "shared").await.len() >= 6).then_some(()) }
    })
    .await;
    let old = group_leader(&ms).await;
    let killed_at = Instant::now();
    ms[old].kill9();
    let survivor = (old + 1) % 3;
    let before = {
        let c = ms[survivor].own_client().await;
        wait_until("a commit after the kill", Duration::from_secs(30), || {
            let mut c = c.clone();
            async move {
                let n = versions(&mut c, "shared").await.len();
                (n > 0).then_some(n)
            }
        })
        .await
    };
    let c = ms[survivor].own_client().await;
    wait_until("six more commits after failover", Duration::from_secs(60), || {
        let mut c = c.clone();
        async move { (versions(&mut c, "shared").await.len() >= before + 6).then_some(()) }
    })
    .await;
    let failover = killed_at.elapsed();
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for w in writers {
        let (a, _failures) = w.await.unwrap();
        acked.extend(a);
    }
    // The killed member comes back and catches up from the log.
    ms[old].restart().await;
    let new = group_leader(&ms).await;
    assert_ne!(new, old, "a new leader was elected while the old one was dead");

    let mut c = ms[0].client(Some("admin")).await;
    let listed = versions(&mut c, "shared").await;
    let n = listed.len() as u64;
    assert_eq!(
        listed,
        (1..=n).collect::<Vec<_>>(),
        "version numbers are consecutive from 1 with no gap or duplicate"
    );
    let numbers: BTreeSet<u64> = acked.iter().map(|(v, _)| *v).collect();
    assert_eq!(numbers.len(), acked.len(), "no number was acknowledged twice");
    for (v, entries) in &acked {
        assert!(
            listed.contains(v),
            "acknowledged version {v} is present after failover"
        );
        assert_eq!(
            all_entries(&mut c, "shared", *v).await,
            sorted(entries.clone()),
            "version {v} holds the manifest that was acknowledged for it"
        );
    }
    for v in &listed {
        let names: Vec<String> = all_entries(&mut c, "shared", *v)
            .await
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert!(
            !names.iter().any(|p| p.contains("orphan-")),
            "the uncommitted session's entries never became version {v}"
        );
    }
    // Every member, the restarted one included, applies the same log: the same last
    // applied entry on all three (reads are the leader's, so the members' own state is
    // compared by what they report applying).
    group_settled(&ms, Duration::from_secs(30)).await;
    eprintln!(
        "acknowledged {} commits, {} versions in all; leader killed to six commits after it: {failover:?}",
        acked.len(),
        n
    );
    // Members apply entries without RocksDB's own log, so the killed leader lost what it
    // had applied since its last flush and replayed it from the Raft log: each member's
    // catalogue on disk, read directly, holds the same rows.
    for m in &mut ms {
        m.terminate().await;
    }
    let catalogue = |m: &Metadata| {
        use locus_metadata::store::{KvStore, RocksStore, Table};
        let db = RocksStore::open(&m.data_dir.join("db")).unwrap();
        [Table::Datasets, Table::Versions, Table::Entries, Table::Sessions]
            .into_iter()
            .flat_map(|t| {
                db.scan(t, b"", None)
                    .map(|kv| kv.unwrap())
                    .map(move |(k, v)| (t.name(), k.to_vec(), v.to_vec()))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    let rows: Vec<_> = ms.iter().map(catalogue).collect();
    let versions = rows[old].iter().filter(|r| r.0 == "versions").count() as u64;
    assert_eq!(
        versions, n,
        "the restarted member's own catalogue holds every version"
    );
    for (i, r) in rows.iter().enumerate() {
        assert!(
            r == &rows[old],
            "member {} and the restarted member {} hold the same catalogue",
            i + 1,
            old + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_starts_while_the_group_has_no_leader_waits_and_serves_once_it_has_one() {
    let h = Harness::new("group-late");
    let mut ms = h.prepare_group("meta", 3, MetadataOpts::default());
    let mut late = ms.remove(0);
    // m2 and m3 are a quorum: they elect a leader and set the catalogue up.
    let others = launch_group(ms).await;
    group_leader(&others).await;
    // Then both freeze, and m1 starts: no catalogue in its state yet, no leader to ask.
    // It must wait for one, not set the catalogue up itself (a follower's write is
    // refused: a member restarted before it applied that entry, while the group had no
    // leader, once exited with "has to forward request to: None").
    for o in &others {
        o.daemon.sigstop();
    }
    late.spawn();
    // Past its start's greetings to the frozen members (a few seconds) to the catalogue.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let exited = late.daemon.exited();
    for o in &others {
        o.daemon.sigcont();
    }
    assert!(
        !exited,
        "m1 exited while the group had no leader: {}",
        std::fs::read_to_string(&late.log).unwrap_or_default()
    );
    late.wait_ready().await;
    let mut ms = vec![late];
    ms.extend(others);
    let l = group_leader(&ms).await;
    let mut c = ms[l].own_client().await;
    let (e, s) = synthetic_manifest("together", 10, 10, 10, 1 << 16);
    assert_eq!(commit(&mut c, "ds", 1 << 16, e, s).await.unwrap().version, 1);
    let c1 = ms[0].own_client().await;
    wait_until(
        "m1 to serve the committed version",
        Duration::from_secs(30),
        || {
            let mut c = c1.clone();
            async move { (versions(&mut c, "ds").await == vec![1]).then_some(()) }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_refuses_writes_and_the_majority_goes_on() {
    let h = Harness::new("group-minority");
    let ms = h.start_group("meta", 3, MetadataOpts::default()).await;
    let l = group_leader(&ms).await;
    let followers: Vec<usize> = (0..3).filter(|i| *i != l).collect();
    // Freeze the two followers: the leader is a minority of one.
    for &f in &followers {
        ms[f].daemon.sigstop();
    }
    let mut c = ms[l].own_client().await;
    let (e, s) = synthetic_manifest("alone", 10, 10, 10, 1 << 16);
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(40), commit(&mut c, "ds", 1 << 16, e, s)).await;
    match r {
        Ok(Ok(v)) => panic!("a minority committed version {}", v.version),
        Ok(Err(status)) => assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "refused as unavailable, not as bad input: {status:?}"
        ),
        Err(_) => panic!("the minority neither committed nor refused within 40 s"),
    }
    eprintln!("minority refused after {:?}", started.elapsed());
    // Locality is answered by a leader from its own catalogue only while a quorum has
    // acknowledged it within 2 s: this one has heard from nobody for longer, so it refuses
    // rather than answering from a view of the nodes that is going stale.
    let loc = c
        .locality(pb::LocalityRequest {
            refs: vec![pb::VersionRef {
                dataset: "ds".into(),
                version: 1,
            }],
            ..Default::default()
        })
        .await
        .expect_err("a leader cut off from its quorum answered locality");
    assert_eq!(loc.code(), tonic::Code::Unavailable, "{loc:?}");
    // The leader alone is frozen now, the two others resume and elect one of themselves.
    ms[l].daemon.sigstop();
    for &f in &followers {
        ms[f].daemon.sigcont();
    }
    let c = ms[followers[0]].own_client().await;
    let (e, s) = synthetic_manifest("majority", 10, 10, 10, 1 << 16);
    let v = wait_until("the majority to commit", Duration::from_secs(30), || {
        let (mut c, e, s) = (c.clone(), e.clone(), s.clone());
        async move { commit(&mut c, "ds", 1 << 16, e, s).await.ok() }
    })
    .await;
    assert_eq!(v.version, 1, "the refused commit left no version behind");
    // Healing: the old leader resumes, steps down and learns the version.
    ms[l].daemon.sigcont();
    let mut c = ms[l].own_client().await;
    wait_until(
        "the old leader to serve the majority's version",
        Duration::from_secs(30),
        || {
            let mut c = c.clone();
            async move { (versions(&mut c, "ds").await == vec![1]).then_some(()) }
        },
    )
    .await;
    let info = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_ne!(info.leader, info.member, "the healed old leader stepped down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_rejoins_from_a_snapshot_and_holds_the_whole_catalogue() {
    let h = Harness::new("group-rejoin");
    let opts = MetadataOpts {
        extra: vec!["--snapshot-every".into(), "8".into()],
        ..Default::default()
    };
    let mut ms = h.start_group("meta", 3, opts).await;
    let mut c = ms[0].client(None).await;
    // A large manifest (its pages are many log entries) and a few small versions.
    // (The bench rejoins a member holding 1,000,000 entries; 60,000 keep this test short.)
    let (big, big_shards) = synthetic_manifest("big", 60_000, 1000, 1000, 1 << 20);
    let started = Instant::now();
    commit(&mut c, "big", 1 << 20, big.clone(), big_shards)
        .await
        .unwrap();
    eprintln!(
        "60,000-entry manifest committed on the group in {:?}",
        started.elapsed()
    );
    let mut small = Vec::new();
    for i in 0..10 {
        let (e, s) = synthetic_manifest(&format!("s{i}"), 20, 10, 10, 1 << 16);
        commit(&mut c, "small", 1 << 16, e.clone(), s).await.unwrap();
        small.push(e);
    }
    // The member that is not leading is stopped and loses everything it had.
    let l = group_leader(&ms).await;
    let w = (l + 1) % 3;
    ms[w].terminate().await;
    std::fs::remove_dir_all(&ms[w].data_dir).unwrap();
    // More writes while it is away: the log it missed is long gone behind a snapshot.
    for i in 10..20 {
        let (e, s) = synthetic_manifest(&format!("s{i}"), 20, 10, 10, 1 << 16);
        commit(&mut c, "small", 1 << 16, e.clone(), s).await.unwrap();
        small.push(e);
    }
    // Started as before, it refuses: it holds nothing while the others hold the group's log.
    ms[w].spawn();
    let refused = ms[w]
        .daemon
        .try_wait_addrs()
        .await
        .expect_err("the wiped member exits instead of serving");
    assert!(
        refused.contains("its data was lost") && refused.contains("--join"),
        "the refusal says why and how to rejoin: {refused}"
    );
    ms[w].daemon.reap();
    ms[w].opts.extra.push("--join".into());
    let started = Instant::now();
    ms[w].restart().await;
    group_settled(&ms, Duration::from_secs(120)).await;
    eprintln!("wiped member caught up in {:?}", started.elapsed());
    assert!(
        ms[w].data_dir.join("raft-snapshots/current.meta").exists(),
        "the wiped member caught up by installing a snapshot"
    );
    // It called no election while it was behind (one would unseat the leader that was
    // sending it the snapshot), and takes part in elections once it caught up.
    let log = h.path(&format!("meta-m{}.log", w + 1));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("calls no election until it has caught up"),
        "the rejoining member stays out of elections: {log:?}"
    );
    wait_until(
        "the rejoined member to take part in elections again",
        Duration::from_secs(30),
        || {
            let log = log.clone();
            async move {
                std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .contains("takes part in elections again")
                    .then_some(())
            }
        },
    )
    .await;
    assert_eq!(
        group_leader(&ms).await,
        l,
        "the rejoin cost the group no election"
    );
    // Its own store, read alone (the group stopped, the member's data dir served as a
    // single service), holds every version with its whole manifest.
    for m in ms.iter_mut() {
        m.terminate().await;
    }
    let m = &mut ms[w];
    m.opts.extra.clear();
    m.public_url = None;
    m.restart().await;
    let mut c = m.client(None).await;
    assert_eq!(
        all_entries(&mut c, "big", 1).await,
        sorted(big),
        "the large manifest arrived whole"
    );
    assert_eq!(versions(&mut c, "small").await, (1..=20).collect::<Vec<_>>());
    for (i, e) in small.into_iter().enumerate() {
        assert_eq!(
            all_entries(&mut c, "small", i as u64 + 1).await,
            sorted(e),
            "small version {}",
            i + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounts_nodes_and_locality_carry_on_through_a_leader_failover() {
    let h = Harness::new("group-failover");
    let opts = MetadataOpts {
        liveness_timeout: Some("3s"),
        extra: vec!["--repair-interval".into(), "500ms".into()],
        ..Default::default()
    };
    let mut ms = h.start_group("meta", 3, opts).await;
    let mut nodes = Vec::new();
    for i in 1..=3 {
        nodes.push(h.start_node(&format!("n{i}"), &ms[0], NodeOpts::host(i)).await);
    }
    let src = h.path("src");
    make_tree(&src, 200);
    let out = import(
        &ms[0],
        "mixed",
        &src,
        &["--replicas", "2", "--shard-size", "1MiB"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let local = ms[0].mount(
        "local",
        "mixed@1",
        Some(&nodes[0]),
        &["--opens", "mount", "--no-passthrough"],
    );
    let remote = ms[0].mount("remote", "mixed@1", None, &["--cache-size", "256KiB"]);
    let files = Arc::new(files_of(&src));
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let roots = [local.path.clone(), remote.path.clone()];
    let readers = spawn_verifying_readers(&roots, files.clone(), 4, stop.clone(), reads.clone());
    wait_until("readers to get going", Duration::from_secs(30), || async {
        (reads.load(Ordering::Relaxed) > 100).then_some(())
    })
    .await;

    // A follower answers locality itself from the leader's liveness view, which it pulls:
    // with the leader frozen it still answers at once, counting every node (its own
    // start-up grace has run out by now, so without the pulled view they would be down).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let l0 = group_leader(&ms).await;
    let mut fc = ms[(l0 + 1) % 3].own_client().await;
    ms[l0].daemon.sigstop();
    let asked = fc.locality(pb::LocalityRequest {
        refs: vec![pb::VersionRef {
            dataset: "mixed".into(),
            version: 1,
        }],
        ..Default::default()
    });
    let answered = tokio::time::timeout(Duration::from_secs(1), asked).await;
    ms[l0].daemon.sigcont();
    let answered = answered
        .expect("a follower answers locality without the leader")
        .expect("locality from a follower")
        .into_inner();
    assert_eq!(
        answered.nodes.len(),
        3,
        "every node counts as up at the follower: {answered:?}"
    );

    let old = group_leader(&ms).await;
    let survivor = (old + 1) % 3;
    let killed = Instant::now();
    ms[old].kill9();
    let at_kill = reads.load(Ordering::Relaxed);
    // Locality answers again through a surviving member once a leader is elected.
    let mut c = ms[survivor].own_client().await;
    let locality = wait_until(
        "locality to answer after the kill",
        Duration::from_secs(30),
        || {
            let mut c = c.clone();
            async move {
                let r = c
                    .locality(pb::LocalityRequest {
                        refs: vec![pb::VersionRef {
                            dataset: "mixed".into(),
                            version: 1,
                        }],
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                (r.total_bytes > 0).then_some(r)
            }
        },
    )
    .await;
    let resumed = killed.elapsed();
    assert_eq!(
        locality.nodes.len(),
        3,
        "every node is still a candidate: {locality:?}"
    );
    // The new leader serves (a node listing is linearizable: only a leader answers it).
    wait_until("a new leader to answer", Duration::from_secs(30), || {
        let mut c = c.clone();
        async move { c.list_nodes(pb::ListNodesRequest {}).await.ok() }
    })
    .await;
    let served = killed.elapsed();
    // For two liveness timeouts after the new leader took over, no node is ever down:
    // they heartbeat to it through the surviving members.
    let watch_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < watch_until {
        let listed = c
            .list_nodes(pb::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        for n in &listed {
            assert_eq!(
                n.state,
                pb::NodeState::Up as i32,
                "node {} went down across the failover",
                n.id
            );
        }
        assert_eq!(listed.len(), 3);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    wait_until(
        "readers to continue after the failover",
        Duration::from_secs(60),
        || async { (reads.load(Ordering::Relaxed) > at_kill + 300).then_some(()) },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap().unwrap();
    }
    for m in [&local, &remote] {
        let s = m.status_when("the mount's counters", |_| true).await;
        assert_eq!(s["totals"]["read_errors"], 0, "{s}");
    }
    eprintln!(
        "leader killed; locality answered again after {resumed:?}, the new leader served after {served:?}"
    );
}

/// Acknowledged commits, their manifests, from writers that run until told to stop.
type Acked = Vec<(u64, Vec<pb::Entry>)>;

fn spawn_writers(m: &Metadata, n: usize, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<Acked>> {
    (0..n)
        .map(|w| {
            let opts = m.client_options(m.token("admin"));
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut round = 0;
                while !stop.load(Ordering::SeqCst) {
                    round += 1;
                    let Ok(mut c) = locus_proto::client::connect(&opts).await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let (e, s) =
                        synthetic_manifest(&format!("w{w}r{round}"), 10 + round % 5, 10, 10, 1 << 16);
                    // A call stuck on a frozen member is given up on like a failed one.
                    match tokio::time::timeout(
                        Duration::from_secs(10),
                        commit(&mut c, "shared", 1 << 16, e.clone(), s),
                    )
                    .await
                    {
                        Ok(Ok(v)) => acked.push((v.version, e)),
                        _ => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
                acked
            })
        })
        .collect()
}

/// The history check: versions numbered 1..=n with no gap or duplicate, every
/// acknowledged commit present with the manifest acknowledged for it.
async fn check_history(c: &mut locus_proto::client::MetadataClient, acked: &Acked) -> u64 {
    let listed = versions(c, "shared").await;
    let n = listed.len() as u64;
    assert_eq!(
        listed,
        (1..=n).collect::<Vec<_>>(),
        "consecutive from 1, no gap or duplicate"
    );
    let numbers: BTreeSet<u64> = acked.iter().map(|(v, _)| *v).collect();
    assert_eq!(numbers.len(), acked.len(), "no number acknowledged twice");
    for (v, entries) in acked {
        assert!(listed.contains(v), "acknowledged version {v} is present");
        assert_eq!(
            all_entries(c, "shared", *v).await,
            sorted(entries.clone()),
            "version {v}'s manifest"
        );
    }
    n
}

/// Kills, freezes and restarts members at random (never more than one out at a time, so a
/// majority stays) while two clients commit; then checks the acknowledged history. Rounds:
/// `LOCUS_FAULT_ROUNDS` (default 6); seed: `LOCUS_FAULT_SEED` (printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_kills_freezes_and_restarts_keep_the_acknowledged_history_exact() {
    let rounds: u32 = std::env::var("LOCUS_FAULT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let seed: u64 = std::env::var("LOCUS_FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("fault test: {rounds} rounds, LOCUS_FAULT_SEED={seed}");
    let mut rng = seed | 1;
    let mut next = move |n: u64| {
        // xorshift64
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let h = Harness::new("group-faults");
    let mut ms = h.start_group("meta", 3, MetadataOpts::with_tokens()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&ms[0], 2, stop.clone());
    let mut down: Option<usize> = None;
    let mut actions = Vec::new();
    for _ in 0..rounds {
        match down {
            Some(d) => {
                ms[d].restart().await;
                actions.push(format!("restart m{}", d + 1));
                down = None;
            }
            None => {
                let target = if next(2) == 0 {
                    group_leader(&ms).await
                } else {
                    next(3) as usize
                };
                if next(2) == 0 {
                    ms[target].kill9();
                    actions.push(format!("kill -9 m{}", target + 1));
                    down = Some(target);
                } else {
                    ms[target].daemon.sigstop();
                    tokio::time::sleep(Duration::from_millis(500 + next(1500))).await;
                    ms[target].daemon.sigcont();
                    actions.push(format!("freeze m{}", target + 1));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(1000 + next(1000))).await;
    }
    if let Some(d) = down {
        ms[d].restart().await;
    }
    // Commits still go through once every member is back.
    let mut c = ms[0].own_client().await;
    let before = versions(&mut c, "shared").await.len();
    wait_until("commits after the faults", Duration::from_secs(60), || {
        let mut c = c.clone();
        async move { (versions(&mut c, "shared").await.len() >= before + 2).then_some(()) }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await.unwrap());
    }
    let mut c = ms[0].client(Some("admin")).await;
    let n = check_history(&mut c, &acked).await;
    assert!(
        acked.len() >= 4,
        "the writers made progress through the faults: {}",
        acked.len()
    );
    eprintln!(
        "fault test passed: {rounds} rounds ({}), {} acknowledged commits, {n} versions",
        actions.join(", "),
        acked.len()
    );
}

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// A group is backed up like a single service; its restore starts a group of one, which
/// grows with `members add-learner` and `promote`: the new member receives the restored
/// catalogue as a snapshot (no log entry holds it). Status and `members` show the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_backup_restores_into_a_member_that_others_join() {
    let h = Harness::new("group-restore");
    let ms = h.start_group("meta", 3, MetadataOpts::default()).await;
    let st = json(&ms[1].cli(&["status", "--json"]));
    let g = &st["metadata"]["group"];
    assert_eq!(g["members"].as_array().map(Vec::len), Some(3), "{st}");
    assert!(g["leader"].as_str().is_some_and(|l| l.starts_with('m')), "{st}");
    let node = h.start_node("n1", &ms[0], NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 40);
    let o = import(&ms[0], "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let url = format!("file://{}", h.path("backup").display());
    let r = json(&ms[0].cli(&["backup", "run", "--to", &url, "--json"]));
    assert_eq!(r["committed"], true, "{r}");
    drop(node);

    // The restore: a new data dir, started as a group of one.
    let mut r1 = h.prepare_metadata("restored", MetadataOpts::default(), &[]);
    let o = ms[0].cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--data-dir",
        r1.data_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let taken = [r1.grpc.port(), r1.http.port()];
    let p1 = free_low_port_on(std::net::Ipv4Addr::LOCALHOST, &taken);
    let p2 = free_low_port_on(std::net::Ipv4Addr::LOCALHOST, &[taken[0], taken[1], p1]);
    // Started over a catalogue with more than itself in --cluster, it refuses.
    r1.opts.extra = vec![
        "--id".into(),
        "r1".into(),
        "--cluster".into(),
        format!("r1=127.0.0.1:{p1},r2=127.0.0.1:{p2}"),
    ];
    r1.spawn();
    let refused = r1
        .daemon
        .try_wait_addrs()
        .await
        .expect_err("a group of two over a restored catalogue");
    assert!(refused.contains("group of one"), "{refused}");
    r1.daemon.reap();
    r1.opts.extra = vec![
        "--id".into(),
        "r1".into(),
        "--cluster".into(),
        format!("r1=127.0.0.1:{p1}"),
    ];
    r1.start().await;
    let mut c = r1.own_client().await;
    assert_eq!(
        versions(&mut c, "ds").await,
        vec![1],
        "the restored member serves the backup's catalogue"
    );
    let want = all_entries(&mut c, "ds", 1).await;
    assert!(want.len() > 40);

    // r2 joins empty; the leader sends it the restored catalogue.
    let mut r2 = h.prepare_metadata("joined", MetadataOpts::default(), &[taken[0], taken[1], p1, p2]);
    r2.opts.extra = vec![
        "--id".into(),
        "r2".into(),
        "--cluster".into(),
        format!("r1=127.0.0.1:{p1},r2=127.0.0.1:{p2}"),
        "--join".into(),
    ];
    r2.spawn();
    let list = json(&r1.cli(&[
        "metadata",
        "members",
        "add-learner",
        "r2",
        &format!("127.0.0.1:{p2}"),
        "--json",
    ]));
    let roles: Vec<(String, String)> = list["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["role"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        vec![("r1".into(), "voter".into()), ("r2".into(), "learner".into())]
    );
    r2.wait_ready().await;
    let list = json(&r1.cli(&["metadata", "members", "promote", "r2", "--json"]));
    assert!(
        list["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["role"] == "voter"),
        "{list}"
    );
    let o = r1.cli(&["metadata", "members", "promote", "nobody"]);
    assert!(
        !o.status.success() && stderr(&o).contains("not a member"),
        "{}",
        stderr(&o)
    );
    let pair = [r1, r2];
    group_settled(&pair, Duration::from_secs(60)).await;
    // r2's own store holds the restored version: stopped, its data dir served alone.
    let [mut r1, mut r2] = pair;
    r1.terminate().await;
    r2.terminate().await;
    r2.opts.extra.clear();
    r2.start().await;
    let mut c = r2.own_client().await;
    assert_eq!(
        versions(&mut c, "ds").await,
        vec![1],
        "the joined member received the restored catalogue"
    );
    assert_eq!(all_entries(&mut c, "ds", 1).await, want, "the whole manifest");
}

/// The same on the multi-host test bed with a real partition: each member on a host of its
/// own, the leader's link taken down. Asked on its own host, the cut-off leader refuses a
/// write; the majority elects a leader and commits; once the link is back, the old leader
/// follows and serves the majority's history (its refused write never happened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_refuses_writes_while_the_majority_commits_and_healing_converges() {
    if let Some(why) = Netbed::unavailable() {
        panic!("this test needs the multi-host test bed (run as root): {why}");
    }
    let bed = Netbed::new(&[3]).unwrap_or_else(|e| panic!("building the test bed: {e}"));
    let h = Harness::new("group-partition");
    let ms = h.start_group_on(&bed, "meta", MetadataOpts::default()).await;
    let mut c = ms[0].client(None).await;
    let (e, s) = synthetic_manifest("before", 10, 10, 10, 1 << 16);
    assert_eq!(commit(&mut c, "ds", 1 << 16, e, s).await.unwrap().version, 1);
    let l = group_leader(&ms).await;
    let majority: Vec<usize> = (0..3).filter(|i| *i != l).collect();

    bed.set_link(l, false).unwrap();
    let out = bed.hosts[l]
        .command(locus())
        .args(["--metadata", &ms[l].own_url(), "dataset", "rm", "ds@1"])
        .env_remove("LOCUS_TOKEN")
        .env_remove("LOCUS_CONFIG")
        .env("HOME", h.path("home"))
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "the cut-off leader deleted a version");
    assert!(
        err.contains("unavailable") && (err.contains("quorum") || err.contains("leader")),
        "refused for want of a quorum: {err}"
    );

    let c = ms[majority[0]].own_client().await;
    let (e, s) = synthetic_manifest("majority", 10, 10, 10, 1 << 16);
    let v = wait_until("the majority to commit", Duration::from_secs(30), || {
        let (mut c, e, s) = (c.clone(), e.clone(), s.clone());
        async move { commit(&mut c, "ds", 1 << 16, e, s).await.ok() }
    })
    .await;
    assert_eq!(v.version, 2);

    bed.set_link(l, true).unwrap();
    group_settled(&ms, Duration::from_secs(60)).await;
    let mut c = ms[l].own_client().await;
    assert_eq!(
        versions(&mut c, "ds").await,
        vec![1, 2],
        "the old leader serves the majority's history"
    );
    let info = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_ne!(info.leader, info.member, "the old leader follows");
}

/// With TLS and tokens the raft ports speak TLS too and take only an admin token: members
/// replicate and forward over TLS, and a caller without TLS, or with TLS and no token, is
/// refused on a raft port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_and_tokens_members_talk_tls_and_raft_ports_refuse_others() {
    let h = Harness::new("group-tls");
    let ms = h
        .start_group(
            "meta",
            3,
            MetadataOpts {
                tls: true,
                ..MetadataOpts::with_tokens()
            },
        )
        .await;
    let l = group_leader(&ms).await;
    let f = (l + 1) % 3;
    // Through a follower: forwarded to the leader over TLS, replicated over TLS.
    let mut c = ms[f].own_client().await;
    let (e, s) = synthetic_manifest("tls", 10, 10, 10, 1 << 16);
    assert_eq!(commit(&mut c, "ds", 1 << 16, e, s).await.unwrap().version, 1);
    group_settled(&ms, Duration::from_secs(30)).await;

    let raft = ms[l].raft.expect("the leader's raft port");
    // Liveness: a member-only call, answered by the leader.
    let ask = |ep: tonic::transport::Endpoint, token: Option<String>| async move {
        let ch = ep
            .connect()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut c = locus_proto::pb::raft_client::RaftClient::new(ch);
        let mut req = tonic::Request::new(pb::RaftHelloRequest::default());
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        c.liveness(req).await.map(|_| ())
    };
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{raft}")).unwrap();
    assert!(
        ask(plain, Some(member_token().secret)).await.is_err(),
        "plaintext on a TLS raft port"
    );
    let tls = tonic::transport::Endpoint::from_shared(format!("https://localhost:{}", raft.port()))
        .unwrap()
        .tls_config(locus_proto::tls::client_config(ms[l].ca_pem.as_deref()).unwrap())
        .unwrap();
    let err = ask(tls.clone(), None)
        .await
        .expect_err("a raft call without a token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    for role in ["reader", "admin"] {
        let err = ask(tls.clone(), ms[l].token(role))
            .await
            .expect_err("a raft call with a token that is not the member's");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{role}: {err:?}");
    }
    ask(tls, Some(member_token().secret))
        .await
        .expect("the member token over TLS");
}

/// A member that accepts connections but never answers (frozen) costs a client one call:
/// that call fails within the client's answer timeout, and later calls go to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_member_costs_a_client_one_call_then_the_others_answer() {
    let h = Harness::new("group-frozen");
    let ms = h.start_group("meta", 3, MetadataOpts::default()).await;
    let mut c = ms[0].client(None).await;
    // The client is talking to m1, the first of its URLs.
    c.list_datasets(pb::ListDatasetsRequest {}).await.unwrap();
    ms[0].daemon.sigstop();
    let t = Instant::now();
    let first = c.list_datasets(pb::ListDatasetsRequest {}).await;
    let waited = t.elapsed();
    let frozen_err = first.expect_err("the frozen member answered");
    assert!(
        frozen_err.message().contains("did not answer") || frozen_err.message().contains("not answering"),
        "the call failed because m1 did not answer: {frozen_err:?}"
    );
    assert!(
        waited < locus_proto::client::MEMBER_ANSWER_TIMEOUT + Duration::from_secs(5),
        "{waited:?}"
    );
    // Later calls go to the other members (after a new election if m1 led).
    let t = Instant::now();
    wait_until("the other members to answer", Duration::from_secs(30), || {
        let mut c = c.clone();
        async move { c.list_datasets(pb::ListDatasetsRequest {}).await.ok() }
    })
    .await;
    let recovered = t.elapsed();
    ms[0].daemon.sigcont();
    // (Were later calls still sent to m1, every one would time out and this never pass.)
    eprintln!(
        "frozen member: the call it held failed after {waited:?}; the others answered {recovered:?} later"
    );
}

/// With one member down, the leader's quorum is itself and the other follower: a call that
/// arrives while that follower is stalled (here SIGSTOP for half an election timeout, as a
/// disk busy writing a snapshot does) waits for it and is served, instead of being refused
/// after one heartbeat round that the follower answered late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_member_down_a_call_during_a_followers_brief_stall_is_served_not_refused() {
    let h = Harness::new("group-stall");
    let mut ms = h.start_group("meta", 3, MetadataOpts::default()).await;
    let l = group_leader(&ms).await;
    let (down, stalled) = ((l + 1) % 3, (l + 2) % 3);
    ms[down].terminate().await;
    let mut c = ms[l].own_client().await;
    let (e, s) = synthetic_manifest("before", 10, 10, 10, 1 << 16);
    commit(&mut c, "ds", 1 << 16, e, s)
        .await
        .expect("two of three commit");
    // The harness's election timeout is 1 s: heartbeats every 333 ms, and a follower
    // stalled for 500 ms does not start an election when it resumes.
    let stall = Duration::from_millis(500);
    ms[stalled].daemon.sigstop();
    let started = Instant::now();
    let (e, s) = synthetic_manifest("during", 10, 10, 10, 1 << 16);
    let (r, ()) = tokio::join!(commit(&mut c, "ds", 1 << 16, e, s), async {
        tokio::time::sleep(stall).await;
        ms[stalled].daemon.sigcont();
    });
    let took = started.elapsed();
    let v = r.expect("the call made during the follower's stall is served once it resumes");
    assert_eq!(v.version, 2);
    assert!(
        took >= stall - Duration::from_millis(50),
        "the call waited for the stalled follower ({took:?}), so the stall was real"
    );
    assert_eq!(versions(&mut c, "ds").await, vec![1, 2]);
    assert_eq!(
        group_leader(&ms).await,
        l,
        "the stall cost no election: the leader is the one that served the call"
    );
}

/// A version's delete names its blob → shard rows (8 bytes in the log) and every member
/// computes them from its own copy: after it, no member's catalogue on disk holds a row
/// of the deleted version's blobs, and each still holds the other version's, the same on
/// all three. (The deleted version has enough blobs that a member writes its tombstones
/// as a table file.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_versions_index_rows_are_gone_from_every_member_and_others_stay() {
    let h = Harness::new("group-delete");
    let mut ms = h.start_group("meta", 3, MetadataOpts::default()).await;
    let mut c = ms[0].client(None).await;
    let (gone, s) = synthetic_manifest("gone", 10_000, 1000, 2500, 1 << 20);
    commit(&mut c, "gone", 1 << 20, gone.clone(), s).await.unwrap();
    let (kept, s) = synthetic_manifest("kept", 300, 100, 100, 1 << 20);
    commit(&mut c, "kept", 1 << 20, kept.clone(), s).await.unwrap();
    c.delete_version(pb::DeleteVersionRequest {
        dataset: "gone".into(),
        version: 1,
        force: false,
    })
    .await
    .expect("the delete is committed");
    assert!(versions(&mut c, "gone").await.is_empty());
    group_settled(&ms, Duration::from_secs(60)).await;
    for m in &mut ms {
        m.terminate().await;
    }
    let blobs = |e: &[pb::Entry]| -> BTreeSet<Vec<u8>> {
        e.iter().filter(|e| e.size > 0).map(|e| e.blob.clone()).collect()
    };
    let (gone, kept) = (blobs(&gone), blobs(&kept));
    assert!(gone.len() > 4096, "enough rows for a table file of tombstones");
    let mut held = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        use locus_metadata::store::{KvStore, RocksStore, Table};
        let db = RocksStore::open(&m.data_dir.join("db")).unwrap();
        let rows: BTreeSet<Vec<u8>> = db
            .scan(Table::BlobShards, b"", None)
            .map(|kv| kv.unwrap().0[..32].to_vec())
            .collect();
        assert!(
            rows.is_disjoint(&gone),
            "member {} still indexes {} blobs of the deleted version",
            i + 1,
            rows.intersection(&gone).count()
        );
        assert!(
            kept.is_subset(&rows),
            "member {} lost rows of the kept version",
            i + 1
        );
        held.push(rows);
    }
    assert!(
        held.iter().all(|r| r == &held[0]),
        "the members hold the same index"
    );
}
