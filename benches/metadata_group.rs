//! The replicated metadata group against a single service, measured in one run on one
//! machine (every member a real `locus metadata serve` process on loopback, release build):
//!
//! - failover: the leader is killed (`kill -9`) and a client commits through the other
//!   members' URLs in a loop; the time from the kill to the first acknowledged commit, over
//!   `LOCUS_FAILOVER_TRIALS` trials (default 20; the killed member is restarted and caught
//!   up between trials). Target: p50 and p99 ≤ 3 s.
//! - a `LOCUS_SCALE_FILES`-entry manifest (default 1,000,000) uploaded and committed on a
//!   single service and on the group, the same manifest. Target: group ≤ 2× single.
//! - a follower wiped and rejoined with `--join` while that manifest is in the state: the
//!   time until it has applied what the others have (snapshot sent, installed, log
//!   replayed; the group snapshots every 1000 entries here).
//! - the CPU seconds of the service, and of each member (from /proc) until every member has
//!   applied the manifest: on one machine the members share its cores, so the group's
//!   wall-clock ratio is bounded below by its CPU ratio; and the share of the upload the
//!   machine's cores sat idle (near 0: bound by CPU; more pages in flight would not help).
//! - locality p50/p99 over 500 calls on that version: single service, the group's leader,
//!   and a follower (which answers from its own catalogue and the leader's liveness view).
//! - the version deleted (`DeleteVersion`), last: the time until the service answered, or
//!   until every member has applied the delete, and the CPU that cost (`LOCUS_BENCH_DELETE=0`
//!   leaves it out).
//!
//! With `LOCUS_BENCH_PERF=DIR` the single service's and the group's uploads are profiled
//! (`perf record -a`) into `DIR/metadata_group_single.data` and `DIR/metadata_group_group.data`.
//!
//! The machine's free page reporting is stopped for the run (`SteadyMemory`): on a virtual
//! machine that hands freed memory back to its host, every page-cache page a member writes
//! into (its Raft log, its flushes and compactions) can cost a host fault, and a group
//! writes three times what the single service writes, so the ratio measured the VM.
//!
//! Run:
//!
//!     cargo bench --bench metadata_group
//!     LOCUS_SCALE_FILES=200000 LOCUS_FAILOVER_TRIALS=5 cargo bench --bench metadata_group
//!
//! At 10M entries the rejoin moves a catalogue of ~1.5 GB and each failover trial waits for
//! the restarted member to catch up; `LOCUS_FAILOVER_TRIALS=0 LOCUS_GROUP_REJOIN=0` measures
//! only the upload, commit and locality rows:
//!
//!     LOCUS_SCALE_FILES=10000000 LOCUS_FAILOVER_TRIALS=0 LOCUS_GROUP_REJOIN=0 \
//!         cargo bench --bench metadata_group

use locus_testkit as support;

use std::time::{Duration, Instant};

use locus_proto::pb;
use support::*;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

async fn upload_and_commit(
    c: &mut locus_proto::client::MetadataClient,
    files: usize,
) -> (Duration, Duration) {
    let (entries, shards) = synthetic_manifest("b", files, 1000, 10_000, 1 << 22);
    // What an importer sends with the commit (built before the clock starts: the
    // importer's work, not the service's).
    let (sealed, hash) = locus_testkit::seal_manifest(c, "big", 1 << 22, &entries)
        .await
        .expect("cluster info");
    let t = Instant::now();
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "big".into(),
            chunk_size: 1 << 22,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    locus_proto::client::put_entries_paged(c, s.session_id, entries)
        .await
        .unwrap();
    locus_proto::client::put_shards_paged(c, s.session_id, shards)
        .await
        .unwrap();
    let upload = t.elapsed();
    let t = Instant::now();
    c.commit_version(pb::CommitVersionRequest {
        session_id: s.session_id,
        namespace_blob: hash.0.to_vec(),
        namespace_size: sealed.len() as u64,
    })
    .await
    .unwrap();
    (upload, t.elapsed())
}

async fn locality_latency(c: &mut locus_proto::client::MetadataClient) -> (Duration, Duration) {
    let mut v = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        c.locality(pb::LocalityRequest {
            refs: vec![pb::VersionRef {
                dataset: "big".into(),
                version: 1,
            }],
            ..Default::default()
        })
        .await
        .unwrap();
        v.push(t.elapsed());
    }
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("metadata_group: bench");
        return;
    }
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let files = env("LOCUS_SCALE_FILES", 1_000_000);
    let trials = env("LOCUS_FAILOVER_TRIALS", 20);
    let rejoin_too = env("LOCUS_GROUP_REJOIN", 1) != 0;
    let delete_too = env("LOCUS_BENCH_DELETE", 1) != 0;
    let h = Harness::new("bench-group");
    let _memory = SteadyMemory::hold();

    // The single service first, alone on the machine.
    let mut single = h.start_metadata("single", MetadataOpts::default()).await;
    let mut c = single.client(None).await;
    let cpu0 = cpu_seconds(single.pid());
    let ticks0 = machine_ticks();
    let perf = profile("metadata_group_single");
    let (s_up, s_commit) = upload_and_commit(&mut c, files).await;
    stop_profile(perf);
    let s_idle = idle_share(ticks0, machine_ticks());
    let s_cpu = cpu_seconds(single.pid()) - cpu0;
    eprintln!("single service: upload {s_up:?}, commit {s_commit:?}, {s_cpu:.1} CPU-s");
    let (s_p50, s_p99) = locality_latency(&mut c).await;
    let s_delete = if delete_too {
        let cpu0 = cpu_seconds(single.pid());
        let t = Instant::now();
        delete_big(&mut c).await;
        Some((t.elapsed(), cpu_seconds(single.pid()) - cpu0))
    } else {
        None
    };
    single.terminate().await;

    // The default election timeout (the harness sets a longer one for tests).
    let timeout = std::env::var("LOCUS_ELECTION_TIMEOUT").unwrap_or_else(|_| "500ms".into());
    let opts = MetadataOpts {
        extra: vec![
            "--election-timeout".into(),
            timeout.clone(),
            "--snapshot-every".into(),
            "1000".into(),
        ],
        ..Default::default()
    };
    let mut ms = h.start_group("meta", 3, opts).await;
    let mut c = ms[0].client(None).await;
    let cpu0: Vec<f64> = ms.iter().map(|m| cpu_seconds(m.pid())).collect();
    let ticks0 = machine_ticks();
    let perf = profile("metadata_group_group");
    let (g_up, g_commit) = upload_and_commit(&mut c, files).await;
    let g_idle = idle_share(ticks0, machine_ticks());
    group_settled(&ms, Duration::from_secs(900)).await;
    stop_profile(perf);
    // Until every member has applied the manifest: what the group spent on it.
    let g_cpu: Vec<f64> = ms
        .iter()
        .zip(&cpu0)
        .map(|(m, c0)| cpu_seconds(m.pid()) - c0)
        .collect();
    eprintln!("group: upload {g_up:?}, commit {g_commit:?}, CPU-s per member {g_cpu:.1?}");
    let l = group_leader(&ms).await;
    let f = (l + 1) % 3;
    let (l_p50, l_p99) = locality_latency(&mut ms[l].own_client().await).await;
    let (f_p50, f_p99) = locality_latency(&mut ms[f].own_client().await).await;

    // Failover trials.
    let mut times = Vec::new();
    for trial in 0..trials {
        group_settled(&ms, Duration::from_secs(900)).await;
        let l = group_leader(&ms).await;
        let mut c = ms[0].client(None).await;
        // The client is warm (it has committed through the group) before the kill.
        let (e, s) = synthetic_manifest(&format!("pre{trial}"), 5, 5, 5, 1 << 16);
        commit(&mut c, "small", 1 << 16, e, s).await.unwrap();
        let t = Instant::now();
        ms[l].kill9();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (e, s) = synthetic_manifest(&format!("t{trial}a{attempt}"), 5, 5, 5, 1 << 16);
            if commit(&mut c, "small", 1 << 16, e, s).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = t.elapsed();
        eprintln!(
            "trial {trial}: leader {} killed, first commit after {took:?}",
            l + 1
        );
        times.push(took);
        ms[l].restart().await;
    }
    // A follower loses its disk and rejoins: it receives a snapshot holding the manifest.
    let rejoin = if rejoin_too {
        Some(rejoin_wiped_follower(&mut ms).await)
    } else {
        None
    };
    let g_delete = if delete_too {
        group_settled(&ms, Duration::from_secs(900)).await;
        let cpu0: Vec<f64> = ms.iter().map(|m| cpu_seconds(m.pid())).collect();
        let t = Instant::now();
        delete_big(&mut ms[0].client(None).await).await;
        let answered = t.elapsed();
        group_settled(&ms, Duration::from_secs(900)).await;
        let cpu: Vec<f64> = ms
            .iter()
            .zip(&cpu0)
            .map(|(m, c0)| cpu_seconds(m.pid()) - c0)
            .collect();
        Some((answered, t.elapsed(), cpu))
    } else {
        None
    };
    // Heartbeat or AppendEntries rounds a member's leader gave up on (each a follower that
    // did not answer within one heartbeat interval), over the whole run.
    let timed_out: Vec<usize> = (1..=3)
        .map(|i| {
            std::fs::read_to_string(h.path(&format!("meta-m{i}.log")))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("append timed out") && l.contains("error replication"))
                .count()
        })
        .collect();
    println!();
    println!("| measure | single service | 3-member group | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| upload of {files} entries (paged) | {:.2} s | {:.2} s | {:.2}× |",
        s_up.as_secs_f64(),
        g_up.as_secs_f64(),
        g_up.as_secs_f64() / s_up.as_secs_f64()
    );
    println!(
        "| commit | {:.2} s | {:.2} s | {:.2}× |",
        s_commit.as_secs_f64(),
        g_commit.as_secs_f64(),
        g_commit.as_secs_f64() / s_commit.as_secs_f64()
    );
    let (s_all, g_all) = ((s_up + s_commit).as_secs_f64(), (g_up + g_commit).as_secs_f64());
    println!(
        "| upload + commit | {s_all:.2} s | {g_all:.2} s | {:.2}× |",
        g_all / s_all
    );
    println!(
        "| metadata CPU for the upload and commit (each member's, until all applied) | {s_cpu:.1} s | {} = {:.1} s | {:.2}× |",
        g_cpu.iter().map(|c| format!("{c:.1} s")).collect::<Vec<_>>().join(" + "),
        g_cpu.iter().sum::<f64>(),
        g_cpu.iter().sum::<f64>() / s_cpu
    );
    println!(
        "| the machine's cores idle during the upload and commit (/proc/stat) | {:.0}% | {:.0}% | |",
        s_idle * 100.0,
        g_idle * 100.0
    );
    println!(
        "| locality p50 / p99 (500 calls) | {:.2} / {:.2} ms | leader {:.2} / {:.2} ms; follower {:.2} / {:.2} ms | |",
        ms_f(s_p50),
        ms_f(s_p99),
        ms_f(l_p50),
        ms_f(l_p99),
        ms_f(f_p50),
        ms_f(f_p99)
    );
    if let (Some((s_took, s_cpu)), Some((g_answered, g_applied, g_cpu))) = (s_delete, &g_delete) {
        println!(
            "| the version deleted: answered (group: and applied by every member); CPU | {:.2} s; {s_cpu:.1} CPU-s | {:.2} s ({:.2} s); {} CPU-s | {:.2}× |",
            s_took.as_secs_f64(),
            g_answered.as_secs_f64(),
            g_applied.as_secs_f64(),
            g_cpu.iter().map(|c| format!("{c:.1}")).collect::<Vec<_>>().join(" + "),
            g_applied.as_secs_f64() / s_took.as_secs_f64()
        );
    }
    if let Some((rejoin, snap)) = rejoin {
        println!(
            "| a wiped follower rejoins (--join) with the {files}-entry manifest in the state | | {:.2} s (snapshot {:.1} MiB) | |",
            rejoin.as_secs_f64(),
            snap as f64 / (1 << 20) as f64
        );
    }
    println!(
        "| replication rounds that timed out (leaders' logs, m1 / m2 / m3, whole run) | | {} | |",
        timed_out
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(" / ")
    );
    if !times.is_empty() {
        let mut sorted = times.clone();
        let (p50, p99, max) = (
            pct(&mut sorted, 0.5),
            pct(&mut sorted, 0.99),
            *sorted.last().unwrap(),
        );
        println!(
            "| failover, leader kill -9 → first acknowledged commit ({trials} trials, election timeout {timeout}) | | p50 {:.2} s, p99 {:.2} s, max {:.2} s | |",
            p50.as_secs_f64(),
            p99.as_secs_f64(),
            max.as_secs_f64()
        );
    }
}

/// Deletes version 1 of the bench's dataset; panics, naming the error, if it is refused.
async fn delete_big(c: &mut locus_proto::client::MetadataClient) {
    if let Err(e) = c
        .delete_version(pb::DeleteVersionRequest {
            dataset: "big".into(),
            version: 1,
            force: false,
        })
        .await
    {
        panic!("deleting big@1: {e}");
    }
}

/// Wipes a follower's disk, commits past its log, and times its `--join` until the group
/// has settled again; returns that time and the size of the snapshot it received.
async fn rejoin_wiped_follower(ms: &mut [Metadata]) -> (Duration, u64) {
    group_settled(ms, Duration::from_secs(900)).await;
    let l = group_leader(ms).await;
    let w = (l + 1) % 3;
    ms[w].terminate().await;
    std::fs::remove_dir_all(&ms[w].data_dir).unwrap();
    // Enough entries after the wipe that the log the member had is behind a snapshot.
    let mut c = ms[l].client(None).await;
    for i in 0..1100 {
        let (e, s) = synthetic_manifest(&format!("after{i}"), 1, 1, 1, 1 << 16);
        commit(&mut c, "filler", 1 << 16, e, s).await.unwrap();
    }
    ms[w].opts.extra.push("--join".into());
    let t = Instant::now();
    // Its API port opens (the address file is written) once the snapshot is installed.
    ms[w].spawn();
    let addr_file = ms[w].daemon.addr_file.clone();
    wait_until(
        "the rejoining member to open its port",
        Duration::from_secs(900),
        || {
            let f = addr_file.clone();
            async move { f.exists().then_some(()) }
        },
    )
    .await;
    ms[w].wait_ready().await;
    group_settled(ms, Duration::from_secs(900)).await;
    (t.elapsed(), dir_bytes(&ms[w].data_dir.join("raft-snapshots")))
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn ms_f(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
