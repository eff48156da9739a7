//! What an operator meets: each test is one thing that went wrong when a new operator
//! followed the README, tried again with the real CLI and real processes.

use locus_testkit as support;

use std::time::{Duration, Instant};

use support::*;

/// A metadata service that stops answering (SIGSTOP, a frozen VM) costs every command a
/// few seconds and a sentence that names it — not HTTP/2's 50-second keep-alive and
/// "http2 error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_service_stopped_every_command_returns_within_ten_seconds_saying_so() {
    let h = Harness::new("op-stopped");
    let (m, _nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 5);
    assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    m.daemon.sigstop();
    for args in [
        &["status"][..],
        &["node", "list"],
        &["dataset", "list"],
        &["dataset", "show", "ds@1"],
        &["locality", "ds@1"],
    ] {
        let t = Instant::now();
        let out = m.cli_within(Duration::from_secs(12), args, &[]).await;
        let took = t.elapsed();
        let err = stderr(&out);
        assert!(
            !out.status.success(),
            "{args:?} succeeded against a stopped service"
        );
        assert!(
            err.contains("not answering") && err.contains(&m.url()),
            "{args:?} did not say the service at {} is not answering: {err}",
            m.url()
        );
        eprintln!("{args:?}: {took:?}");
    }
    m.daemon.sigcont();
    let out = m.cli(&["dataset", "list"]);
    assert!(out.status.success(), "after SIGCONT: {}", stderr(&out));
}

/// The service's own pause longer than the liveness timeout is not the nodes' silence:
/// after SIGCONT no node is declared down and nothing is repaired while the nodes keep
/// heartbeating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_of_the_service_longer_than_the_liveness_timeout_repairs_nothing() {
    let h = Harness::new("op-paused");
    let (m, _nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 30);
    let o = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "128KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = m.client(None).await;
    let before = shards(&mut c, "ds", 1).await;
    // Two and a half liveness timeouts (2 s in the harness).
    m.daemon.sigstop();
    tokio::time::sleep(Duration::from_secs(5)).await;
    m.daemon.sigcont();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let nodes = c
            .list_nodes(locus_proto::pb::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        for n in &nodes {
            assert_eq!(
                n.state,
                locus_proto::pb::NodeState::Up as i32,
                "{} was declared down after the service's own pause",
                n.id
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        shards(&mut c, "ds", 1).await,
        before,
        "replicas moved after a pause"
    );
    let log = std::fs::read_to_string(&m.log).unwrap();
    assert!(!log.contains("re-replicated"), "a repair ran:\n{log}");
    assert!(log.contains("did not run for"), "the pause went unnoticed");
}

/// A mount asked to use a node socket that is not there fails, naming it, instead of
/// saying it is local and sending every read to remote replicas; a mountpoint with files
/// in it is refused (they would be hidden) unless `--nonempty`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_refuses_a_missing_node_socket_and_a_mountpoint_with_files() {
    let h = Harness::new("op-mount-checks");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 5);
    assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    let (_, out) = m.try_mount(
        "wrong-socket",
        "ds@1",
        None,
        &["--node-socket", "/nonexistent.sock"],
    );
    assert!(!out.status.success(), "mounted with a socket that is not there");
    assert!(stderr(&out).contains("/nonexistent.sock"), "{}", stderr(&out));
    let plain = h.path("not-a-socket");
    std::fs::write(&plain, b"x").unwrap();
    let (_, out) = m.try_mount(
        "plain-file",
        "ds@1",
        None,
        &["--node-socket", plain.to_str().unwrap()],
    );
    assert!(stderr(&out).contains("is not a socket"), "{}", stderr(&out));
    // Files in the mountpoint.
    let busy = h.path("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("mine.txt"), b"do not hide me").unwrap();
    let (_, out) = m.try_mount("busy", "ds@1", Some(&nodes[0]), &[]);
    assert!(!out.status.success(), "mounted over files");
    assert!(
        stderr(&out).contains("not empty") && stderr(&out).contains("--nonempty"),
        "{}",
        stderr(&out)
    );
    let mnt = m.mount("busy", "ds@1", Some(&nodes[0]), &["--nonempty"]);
    assert_same_tree(&src, &mnt.path);
}

/// `locus status` lists this cluster's mounts on the host, not every mount a runtime dir
/// holds a status file for (another cluster's, on a host shared by two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_only_its_own_clusters_mounts() {
    let h = Harness::new("op-status-mounts");
    let a = h.start_metadata("meta-a", MetadataOpts::default()).await;
    let b = h.start_metadata("meta-b", MetadataOpts::default()).await;
    let na = h.start_node("na", &a, NodeOpts::host(1)).await;
    let nb = h.start_node("nb", &b, NodeOpts::host(2)).await;
    let src = h.path("src");
    make_tree(&src, 5);
    for m in [&a, &b] {
        assert!(import(m, "ds", &src, &["--replicas", "1"]).status.success());
    }
    let ma = a.mount("mnt-a", "ds@1", Some(&na), &[]);
    let mb = b.mount("mnt-b", "ds@1", Some(&nb), &[]);
    assert_eq!(
        ma.runtime_dir, mb.runtime_dir,
        "the two mounts share a runtime dir"
    );
    let runtime = ma.runtime_dir.display().to_string();
    let out = a.cli_env(&["status", "--json"], &[("LOCUS_RUNTIME_DIR", runtime)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let shown: Vec<&str> = v["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountpoint"].as_str().unwrap())
        .collect();
    assert_eq!(shown, [ma.path.to_str().unwrap()], "{v}");
}

/// After the service restarts, a node it has not heard from since is shown as such, not
/// "up … seen 3 s ago", and no new replica is placed on it (an import in that window
/// once chose a dead node and failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_not_heard_since_a_restart_is_not_up_and_takes_no_new_replica() {
    let h = Harness::new("op-unheard");
    let (mut m, mut nodes) = cluster_with(
        &h,
        MetadataOpts {
            liveness_timeout: Some("20s"),
            ..Default::default()
        },
        3,
        NodeOpts::host,
    )
    .await;
    nodes[2].daemon.kill9();
    m.kill9();
    m.restart().await;
    // n1 and n2 heartbeat again within a moment; n3 never will.
    wait_until("n1 and n2 to be heard", Duration::from_secs(10), || {
        let out = m.cli(&["node", "list", "--json"]);
        async move {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let state = |id: &str| {
                v.as_array()?
                    .iter()
                    .find(|n| n["id"] == id)
                    .map(|n| n["state"].as_str().unwrap_or_default().to_string())
            };
            (state("n1")? == "up" && state("n2")? == "up").then_some(())
        }
    })
    .await;
    let out = m.cli(&["node", "list"]);
    let line = stdout(&out)
        .lines()
        .find(|l| l.starts_with("n3"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains("unheard") && line.contains("not since restart"),
        "{line}"
    );
    let src = h.path("src");
    make_tree(&src, 20);
    let o = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "64KiB"]);
    assert!(
        o.status.success(),
        "an import while n3 is unheard: {}",
        stderr(&o)
    );
    let mut c = m.client(None).await;
    for s in shards(&mut c, "ds", 1).await {
        assert!(
            !s.replicas.iter().any(|r| r == "n3"),
            "shard {} placed on n3",
            s.id
        );
    }
}

/// `locus node rm` forgets a node that is gone for good: refused while it is up; refused,
/// with nothing changed, while it holds the last replica of a shard (named in the
/// message); once nothing depends on it alone, it is dropped from every shard's replicas
/// and from the node list, and the data it shared stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_rm_forgets_a_dead_node_but_never_one_holding_a_last_replica() {
    let h = Harness::new("node-rm");
    let (m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 20);
    let o = import(&m, "one", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = m.client(None).await;
    let victim = shards(&mut c, "one", 1).await[0].replicas[0].clone();
    let o = import(&m, "two", &src, &["--replicas", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = m.cli(&["node", "rm", &victim]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!("node {victim} is up")),
        "{}",
        stderr(&o)
    );

    let k = nodes.iter().position(|n| n.id == victim).unwrap();
    nodes[k].daemon.kill9();
    wait_node_down(&m, &victim).await;
    let o = m.cli(&["node", "rm", &victim]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("holds the last replica of one@1") && stderr(&o).contains("nothing was changed"),
        "{}",
        stderr(&o)
    );
    assert!(stdout(&m.cli(&["node", "list"])).contains(&victim));
    assert!(shards(&mut c, "one", 1)
        .await
        .iter()
        .any(|s| s.replicas == [victim.clone()]));

    // The only copy of `one` is gone with the node: the operator gives it up.
    let o = m.cli(&["dataset", "rm", "one", "--all-versions"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli(&["node", "rm", &victim, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["removed"], true);
    let listed = stdout(&m.cli(&["node", "list"]));
    assert!(!listed.contains(&victim), "{listed}");
    for s in shards(&mut c, "two", 1).await {
        assert!(
            !s.replicas.contains(&victim),
            "shard {} still lists {victim}",
            s.id
        );
        assert!(!s.replicas.is_empty(), "shard {}", s.id);
    }
    let alive = nodes.iter().find(|n| n.id != victim).unwrap();
    let mnt = m.mount("two", "two@1", Some(alive), &[]);
    assert_same_tree(&src, &mnt.path);
}

/// `dataset rm` of a version a mount serves (on any host) is refused, naming the mount
/// and both ways out; `--force` deletes it anyway; after `locus umount` it goes. The audit
/// log has the mount's start and end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dataset_rm_refuses_a_mounted_version_until_it_is_unmounted_or_forced() {
    let h = Harness::new("op-rm-mounted");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 5);
    for _ in 0..2 {
        assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    }
    let one = m.mount("one", "ds@1", Some(&nodes[0]), &[]);
    let two = m.mount("two", "ds@2", None, &[]);
    let mp1 = one.path.display().to_string();

    let out = m.cli(&["dataset", "rm", "ds@1"]);
    assert!(!out.status.success(), "deleted a mounted version");
    let err = stderr(&out);
    assert!(
        err.contains("ds@1") && err.contains(&mp1) && err.contains("--force") && err.contains("locus umount"),
        "{err}"
    );
    let out = m.cli(&["dataset", "rm", "ds", "--all-versions"]);
    assert!(!out.status.success(), "deleted a dataset with mounted versions");
    assert!(stderr(&out).contains(&mp1), "{}", stderr(&out));
    let out = m.cli(&["--json", "dataset", "show", "ds"]);
    let shown: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        shown["version_list"].as_array().map(Vec::len),
        Some(2),
        "both versions are still there after the refusals: {shown}"
    );
    assert_same_tree(&src, &one.path);

    // Forced: gone while mounted.
    let out = m.cli(&["dataset", "rm", "ds@2", "--force"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Unmounted: the lease is withdrawn by the time `locus umount` returns.
    assert!(one.umount().status.success());
    let out = m.cli(&["dataset", "rm", "ds@1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    let audit = m.audit_lines();
    let has = |action: &str, target: &str| {
        audit
            .iter()
            .any(|l| l["action"] == action && l["target"] == target && l["result"] == "ok")
    };
    assert!(
        has("mount.start", "ds@1") && has("mount.end", "ds@1"),
        "{audit:?}"
    );
    assert!(
        has("mount.start", "ds@2") && !has("mount.end", "ds@2"),
        "{audit:?}"
    );
    drop(two);
}

/// Output that was silent or wrong now says what happened: a FIFO in the source is
/// counted in the import's summary, `dataset ls --json` gives a file's real chunk count,
/// `assign` warns when ranks get no shard, and each mount's part of a shared log starts
/// under its own line while a mount point's default log starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_or_wrong_output_now_says_what_happened() {
    let h = Harness::new("op-output");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 5);
    std::fs::write(src.join("one-mib.bin"), vec![7u8; 1 << 20]).unwrap();
    let fifo = src.join("a-fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());

    // The import's summary counts what it left out (the test's import helper asks JSON).
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["left_out"], serde_json::json!(["a-fifo"]), "{report}");
    make_tree(&h.path("src2"), 3);
    std::process::Command::new("mkfifo")
        .arg(h.path("src2").join("p"))
        .status()
        .unwrap();
    let src2 = h.path("src2");
    let out = m.cli(&[
        "dataset",
        "import",
        "other",
        src2.to_str().unwrap(),
        "--replicas",
        "1",
    ]);
    assert!(
        stdout(&out).contains("left out 1 path(s)") && stdout(&out).contains("such as p\n"),
        "{}",
        stdout(&out)
    );

    // 1 MiB in 64 KiB chunks (the helper's chunk size) is 16 chunks.
    let out = m.cli(&["--json", "dataset", "ls", "ds@1"]);
    let ls: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let big = ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["path"] == "one-mib.bin")
        .unwrap_or_else(|| panic!("{ls}"));
    assert_eq!(big["chunks"], 16, "{big}");

    // One shard over four ranks: three get nothing, and the command says so.
    let out = m.cli(&["assign", "ds@1", "--nodes", &nodes[0].id, "--ranks-per-node", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("3 of 4 ranks get no shard") && stderr(&out).contains("--shard-size"),
        "{}",
        stderr(&out)
    );

    // A shared --log-file: each mount's part under its own line.
    let (failed, out) = m.try_mount("mnt", "ds@9", Some(&nodes[0]), &[]);
    assert!(!out.status.success());
    let ok = m.mount("mnt", "ds@1", Some(&nodes[0]), &[]);
    let log = std::fs::read_to_string(&ok.log).unwrap();
    let parts: Vec<&str> = log.split("--- locus mount ").collect();
    assert_eq!(parts.len(), 3, "two mounts, two header lines: {log}");
    assert!(
        parts[1].starts_with("ds@9") && parts[2].starts_with("ds@1"),
        "{log}"
    );
    assert!(
        !parts[2].contains("error"),
        "the second mount's part is its own: {log}"
    );
    assert!(ok.umount().status.success());
    drop(failed);

    // The default log (no --log-file) starts afresh with each mount of the mount point.
    let rt = ("LOCUS_RUNTIME_DIR", h.path("rt").display().to_string());
    let mp = h.path("plain");
    std::fs::create_dir_all(&mp).unwrap();
    let sock = nodes[0].socket.to_str().unwrap();
    let out = m.cli_env(
        &["mount", "ds@9", mp.to_str().unwrap(), "--node-socket", sock],
        std::slice::from_ref(&rt),
    );
    assert!(!out.status.success());
    let out = m.cli_env(
        &["mount", "ds@1", mp.to_str().unwrap(), "--node-socket", sock],
        std::slice::from_ref(&rt),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let log_path = stdout(&out)
        .lines()
        .find_map(|l| l.trim().strip_prefix("log: ").map(str::to_string))
        .unwrap_or_else(|| panic!("no log line: {}", stdout(&out)));
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(!log.contains("ds@9"), "the earlier mount's error is gone: {log}");
    let out = m.cli_env(&["umount", mp.to_str().unwrap()], &[rt]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Messages say what is wrong and what to do: a replica count the hosts cannot meet names
/// the `host=` label; a missing source is "does not exist"; an empty dataset name, a
/// negative replica count and an oversized size say which; a duration like 1h30m is
/// taken. (A node killed mid-import: see the hung-import test in cache_node.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_say_what_is_wrong_and_what_to_do() {
    let h = Harness::new("op-messages");
    // Two nodes on one host, as the README's commands make them without host=.
    let (m, _nodes) = cluster(&h, 2, |_| NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 3);
    // `import` fails, and what it says contains `needle`.
    let says = |extra: &[&str], needle: &str| {
        let mut args = vec!["dataset", "import", "ds", src.to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = m.cli(&args);
        assert!(!out.status.success(), "{extra:?} succeeded");
        assert!(stderr(&out).contains(needle), "{extra:?}: {}", stderr(&out));
    };
    says(&["--replicas", "2"], "host=");
    says(&["--replicas", "-1"], "-1 is not in 1..=16");
    says(&["--shard-size", "99999999999TiB"], "too large");

    let out = m.cli(&["dataset", "import", "ds", "/no/such/path"]);
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("is not a directory"), "{}", stderr(&out));

    let out = m.cli(&["dataset", "show", "@1"]);
    assert!(stderr(&out).contains("no dataset name"), "{}", stderr(&out));

    let out = m.cli_env(
        &["dataset", "list"],
        &[("LOCUS_PEER_TIMEOUT", "1h30m".to_string())],
    );
    assert!(out.status.success(), "1h30m is a duration: {}", stderr(&out));
}
