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
