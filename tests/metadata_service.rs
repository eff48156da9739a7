//! End-to-end tests of the metadata service: a real `locus metadata serve` process with
//! RocksDB on disk, spoken to over gRPC on loopback.
//!
//! Longer than our ~700-line guide on purpose: every file under `tests/` is its own binary
//! that links the whole workspace (seconds each on two cores), so end-to-end tests of one
//! component share one file. Helpers belong in `testkit/`, not here.

use locus_testkit as support;

use std::collections::HashSet;
use std::time::Duration;

use locus_proto::pb;
use support::*;
use tonic::Code;

#[tokio::test]
async fn committed_version_survives_kill9_and_uncommitted_never_appears() {
    let h = Harness::new("kill9");
    let mut m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    c.register_node(pb::RegisterNodeRequest {
        id: "n1".into(),
        address: "127.0.0.1:7500".into(),
        capacity_bytes: 1 << 40,
        ..Default::default()
    })
    .await
    .unwrap();
    let (entries, mut shards) = synthetic_manifest("a", 3_000, 100, 500, 1 << 16);
    for s in &mut shards {
        s.replicas = vec!["n1".into()];
    }
    let v = commit(&mut c, "imagenet", 1 << 16, entries.clone(), shards.clone())
        .await
        .unwrap();
    assert_eq!(v.version, 1);

    // A second version is uploaded but never committed.
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "imagenet".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    locus_proto::client::put_entries_paged(&mut c, s.session_id, vec![dir_entry("half")])
        .await
        .unwrap();

    m.kill9();
    m.restart().await;
    let mut c = m.client(None).await;

    let d = c
        .get_dataset(pb::GetDatasetRequest {
            name: "imagenet".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (d.latest, d.version_count),
        (1, 1),
        "only the committed version exists"
    );
    let got = all_entries(&mut c, "imagenet", 1).await;
    assert_eq!(got, sorted(entries), "entries intact after kill -9");
    let listed = c
        .list_shards(pb::ListShardsRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "imagenet".into(),
                version: 1,
            }),
            start: 0,
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.shards, shards, "shards and replicas intact");
    let v1 = c
        .get_version(pb::GetVersionRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "imagenet".into(),
                version: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v1.resident.len(), 1);
    assert_eq!(v1.resident[0].bytes, v1.bytes, "n1 holds every shard");

    // The half-uploaded session survived too (it can still be finished or aborted) but is
    // not a version; aborting it leaves nothing behind.
    let info = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.open_sessions, 1);
    c.abort_version(pb::AbortVersionRequest {
        session_id: s.session_id,
    })
    .await
    .unwrap();
    let info = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.open_sessions, 0);
    // The next commit gets number 2: nothing was consumed by the abandoned session.
    let (e2, s2) = synthetic_manifest("b", 10, 10, 10, 1 << 16);
    assert_eq!(
        commit(&mut c, "imagenet", 1 << 16, e2, s2).await.unwrap().version,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_get_distinct_consecutive_numbers() {
    let h = Harness::new("concurrent");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut tasks = Vec::new();
    for writer in 0..2 {
        let mut c = m.client(None).await;
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for round in 0..5 {
                let seed = format!("w{writer}r{round}");
                let (e, s) = synthetic_manifest(&seed, 200 + writer * 50 + round, 40, 64, 1 << 16);
                let v = commit(&mut c, "shared", 1 << 16, e.clone(), s).await.unwrap();
                mine.push((v.version, e));
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let numbers: HashSet<u64> = all.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        numbers,
        (1..=10).collect::<HashSet<_>>(),
        "distinct and consecutive"
    );
    let mut c = m.client(None).await;
    for (n, entries) in all {
        assert_eq!(
            all_entries(&mut c, "shared", n).await,
            sorted(entries),
            "manifest of version {n}"
        );
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_a_message_and_changes_nothing() {
    let h = Harness::new("badinput");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    let (good, good_shards) = synthetic_manifest("g", 5, 5, 5, 1 << 22);
    commit(&mut c, "good", 1 << 22, good.clone(), good_shards)
        .await
        .unwrap();

    // Dataset names.
    for name in ["Bad", "", "-x", "a/b", "a b", &"x".repeat(64), "ü"] {
        let e = c
            .begin_version(pb::BeginVersionRequest {
                dataset: name.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name:?}");
        assert!(e.message().contains("dataset"), "{}", e.message());
    }

    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "good".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let file = |path: &str| {
        let mut f = good[2].clone();
        f.path = path.into();
        f
    };
    let long = vec!["d"; 2100].join("/");
    let mut short_hash = file("ok-name");
    short_hash.blob = vec![1; 16];
    let mut bad_chunk = file("ok-name");
    bad_chunk.chunks = vec![vec![1; 33]];
    let cases: Vec<(&str, Vec<pb::Entry>)> = vec![
        ("dot-dot", vec![file("top/../etc/passwd")]),
        ("absolute", vec![file("/etc/passwd")]),
        ("nul", vec![file("a\0b")]),
        ("too long", vec![file(&long)]),
        ("empty", vec![file("")]),
        ("duplicate", vec![file("dup"), file("dup")]),
        ("hash length", vec![short_hash]),
        ("chunk hash length", vec![bad_chunk]),
    ];
    for (what, entries) in cases {
        let e = c
            .put_entries(pb::PutEntriesRequest {
                session_id: s.session_id,
                page: 0,
                entries,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}");
        assert!(!e.message().is_empty());
    }
    // Nothing was stored by the refused pages: page 0 is still expected and accepted.
    let r = c
        .put_entries(pb::PutEntriesRequest {
            session_id: s.session_id,
            page: 0,
            entries: vec![dir_entry("fine")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.entries_received, r.next_page), (1, 1));
    // A duplicate of an entry stored in an earlier page.
    let e = c
        .put_entries(pb::PutEntriesRequest {
            session_id: s.session_id,
            page: 1,
            entries: vec![dir_entry("fine")],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("more than once"), "{}", e.message());

    // An oversized message (a 40 MiB page) is refused by the server before it is decoded,
    // and the session is untouched.
    let channel = tonic::transport::Endpoint::from_shared(m.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = pb::metadata_client::MetadataClient::new(channel).max_encoding_message_size(usize::MAX);
    let mut huge = good[2].clone();
    huge.path = "huge".into();
    huge.size = (1u64 << 22) * 1_300_000;
    huge.chunks = vec![vec![9u8; 32]; 1_300_000];
    let e = raw
        .put_entries(pb::PutEntriesRequest {
            session_id: s.session_id,
            page: 1,
            entries: vec![huge],
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );

    // Versions that do not exist.
    for (ds, v) in [("good", 7u64), ("nosuch", 1), ("nosuch", 0)] {
        let e = c
            .get_version(pb::GetVersionRequest {
                r#ref: Some(pb::VersionRef {
                    dataset: ds.into(),
                    version: v,
                }),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{ds}@{v}");
    }
    let e = c
        .delete_version(pb::DeleteVersionRequest {
            dataset: "good".into(),
            version: 9,
            force: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .list_entries(pb::ListEntriesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Everything that was there is still there, unchanged.
    let ds = c
        .list_datasets(pb::ListDatasetsRequest {})
        .await
        .unwrap()
        .into_inner()
        .datasets;
    assert_eq!(
        ds.iter().map(|d| (d.name.as_str(), d.latest)).collect::<Vec<_>>(),
        vec![("good", 1)]
    );
    assert_eq!(all_entries(&mut c, "good", 1).await, sorted(good));
}

#[tokio::test]
async fn each_role_is_refused_what_it_may_not_do() {
    let h = Harness::new("roles");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                ..Default::default()
            },
        )
        .await;
    let mut admin = m.client(Some("admin")).await;
    // n1's own node token; "gpu-node" is another node-role token.
    let mut node = m.client_named("n1").await;
    let mut other_node = m.client_named("gpu-node").await;
    let mut reader = m.client(Some("reader")).await;
    let mut nobody = m.client(None).await;
    let mut forged = locus_proto::client::connect(&m.client_options(Some("forged-token-0123456789".into())))
        .await
        .unwrap();

    let reg = || pb::RegisterNodeRequest {
        id: "n1".into(),
        address: "10.0.0.1:7500".into(),
        ..Default::default()
    };
    let begin = || pb::BeginVersionRequest {
        dataset: "ds".into(),
        ..Default::default()
    };
    let code = |r: Result<(), tonic::Status>| r.err().map(|s| s.code());

    // Node calls, for its own id only.
    assert_eq!(code(node.register_node(reg()).await.map(drop)), None);
    let e = other_node.register_node(reg()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("node n1 must present its own"), "{e:?}");
    assert_eq!(
        code(admin.register_node(reg()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(
        code(reader.register_node(reg()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    let hb = || pb::HeartbeatRequest {
        id: "n1".into(),
        ..Default::default()
    };
    assert_eq!(code(node.heartbeat(hb()).await.map(drop)), None);
    assert_eq!(
        code(other_node.heartbeat(hb()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    let pins = |id: &str| pb::ListNodeBlobsRequest {
        node: id.into(),
        ..Default::default()
    };
    assert_eq!(code(node.list_node_blobs(pins("n1")).await.map(drop)), None);
    assert_eq!(
        code(node.list_node_blobs(pins("n2")).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(
        code(reader.heartbeat(hb()).await.map(drop)),
        Some(Code::PermissionDenied)
    );

    // Admin calls.
    assert_eq!(
        code(node.begin_version(begin()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(
        code(reader.begin_version(begin()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    let (e, s) = synthetic_manifest("r", 3, 3, 3, 1 << 22);
    let v = commit(&mut admin, "ds", 1 << 22, e, s).await.unwrap();
    let del = || pb::DeleteVersionRequest {
        dataset: "ds".into(),
        version: v.version,
        force: false,
    };
    assert_eq!(
        code(reader.delete_version(del()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(
        code(node.delete_version(del()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    let rm = || pb::DeleteDatasetRequest {
        name: "ds".into(),
        force: false,
    };
    assert_eq!(
        code(reader.delete_dataset(rm()).await.map(drop)),
        Some(Code::PermissionDenied)
    );

    // Replica changes: admin only (the service's own repair makes them).
    let upd = || pb::UpdateReplicasRequest {
        r#ref: Some(pb::VersionRef {
            dataset: "ds".into(),
            version: v.version,
        }),
        shard: 0,
        add: vec!["n1".into()],
        remove: vec![],
    };
    assert_eq!(
        code(reader.update_replicas(upd()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(
        code(node.update_replicas(upd()).await.map(drop)),
        Some(Code::PermissionDenied)
    );
    assert_eq!(code(admin.update_replicas(upd()).await.map(drop)), None);

    // Reads: every role.
    for c in [&mut admin, &mut node, &mut reader] {
        assert_eq!(
            code(c.list_datasets(pb::ListDatasetsRequest {}).await.map(drop)),
            None
        );
        assert_eq!(code(c.list_nodes(pb::ListNodesRequest {}).await.map(drop)), None);
    }
    // No token, or a wrong one: nothing at all.
    for c in [&mut nobody, &mut forged] {
        assert_eq!(
            code(c.list_datasets(pb::ListDatasetsRequest {}).await.map(drop)),
            Some(Code::Unauthenticated)
        );
        assert_eq!(
            code(c.get_cluster_info(pb::GetClusterInfoRequest {}).await.map(drop)),
            Some(Code::Unauthenticated)
        );
        assert_eq!(
            code(c.begin_version(begin()).await.map(drop)),
            Some(Code::Unauthenticated)
        );
    }
    let info = reader
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (info.caller_name.as_str(), info.caller_role.as_str()),
        ("trainer", "reader")
    );

    // The admin's actions and the registrations (the refused one too) are in the audit
    // log, and the calls the auth layer refused, and nothing else.
    assert_eq!(code(admin.delete_version(del()).await.map(drop)), None);
    let (refused, audit): (Vec<_>, Vec<_>) = m
        .audit_lines()
        .into_iter()
        .partition(|l| l["action"] == "refused");
    let by_reason = |r: &str| refused.iter().filter(|l| l["reason"] == r).count();
    // A tokenless and a forged caller, three calls each; the role denials above
    // that the table decides (the rest are the handlers' own, node-id checks).
    assert_eq!(
        (by_reason("missing_token"), by_reason("bad_token"), refused.len()),
        (3, 3, 16),
        "{refused:?}"
    );
    let actions: Vec<_> = audit
        .iter()
        .map(|l| l["action"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        actions,
        vec![
            "node.register",
            "node.register",
            "version.begin",
            "version.commit",
            "replicas.update",
            "version.delete"
        ]
    );
    assert_eq!(
        (&audit[0]["who"], &audit[0]["result"]),
        (&"n1".into(), &"ok".into())
    );
    assert_eq!(audit[1]["who"], "gpu-node");
    assert_ne!(audit[1]["result"], "ok", "{}", audit[1]);
    assert!(audit[2..]
        .iter()
        .all(|l| l["who"] == "ops" && l["result"] == "ok"));
    assert_eq!(audit[5]["target"], format!("ds@{}", v.version));
}

#[tokio::test]
async fn refuses_to_serve_without_tokens_beyond_loopback() {
    let h = Harness::new("insecure");
    let out = std::process::Command::new(locus())
        .args([
            "metadata",
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--http-listen",
            "off",
            "--data-dir",
        ])
        .arg(h.path("data"))
        .env_remove("LOCUS_METADATA_TOKENS_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("refusing to serve") && err.contains("--insecure"),
        "{err}"
    );
    assert!(!err.contains("InsecureBind"), "no debug dumps: {err}");
}

#[tokio::test]
async fn tls_endpoint_serves_the_cli_and_refuses_plaintext() {
    let h = Harness::new("tls");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tls: true,
                ..Default::default()
            },
        )
        .await;
    let out = m.cli(&["status", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["datasets"]["count"], 0);
    // Plain HTTP/2 to the TLS port fails.
    let plain = locus_proto::client::ClientOptions::new(format!("http://{}", m.grpc));
    let res = match locus_proto::client::connect(&plain).await {
        Ok(mut c) => c
            .list_datasets(pb::ListDatasetsRequest {})
            .await
            .map(drop)
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    assert!(res.is_err());
}

#[tokio::test]
async fn sigterm_stops_cleanly_and_metrics_are_served() {
    let h = Harness::new("sigterm");
    let mut m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    let (e, s) = synthetic_manifest("m", 20, 10, 10, 1 << 22);
    commit(&mut c, "metrics", 1 << 22, e, s).await.unwrap();
    let body = http_get(m.http, "/metrics").await;
    assert!(
        body.contains("locus_metadata_versions_committed_total 1"),
        "{body}"
    );
    assert!(
        body.contains("locus_metadata_rpc_requests_total{method=\"CommitVersion\",code=\"Ok\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("locus_metadata_entries_received_total 23"),
        "{body}"
    );
    assert!(http_get(m.http, "/healthz").await.starts_with("ok"));
    drop(c);
    let st = m.terminate().await;
    assert!(st.success(), "exit status {st}");
    let log = std::fs::read_to_string(&m.log).unwrap();
    assert!(log.contains("metadata service stopped"), "{log}");
    // And the data is all there after the clean stop.
    m.restart().await;
    let mut c = m.client(None).await;
    assert_eq!(all_entries(&mut c, "metrics", 1).await.len(), 23);
}

#[tokio::test]
async fn abandoned_sessions_are_reaped() {
    let h = Harness::new("reap");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                session_timeout: Some("1s"),
                ..Default::default()
            },
        )
        .await;
    let mut c = m.client(None).await;
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "ds".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (e, _) = synthetic_manifest("x", 100, 10, 10, 1 << 22);
    locus_proto::client::put_entries_paged(&mut c, s.session_id, e)
        .await
        .unwrap();
    let opts = m.client_options(None);
    wait_until("the idle session to be reaped", Duration::from_secs(20), || {
        let opts = opts.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let i = c
                .get_cluster_info(pb::GetClusterInfoRequest {})
                .await
                .ok()?
                .into_inner();
            (i.open_sessions == 0).then_some(())
        }
    })
    .await;
    let e = c
        .commit_version(pb::CommitVersionRequest {
            session_id: s.session_id,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(c
        .list_datasets(pb::ListDatasetsRequest {})
        .await
        .unwrap()
        .into_inner()
        .datasets
        .is_empty());
}

#[tokio::test]
async fn nodes_go_down_when_silent_and_replicas_move_resident_counters() {
    let h = Harness::new("liveness");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("1s"),
                ..Default::default()
            },
        )
        .await;
    let mut c = m.client(None).await;
    for (id, rack) in [("n1", "r1"), ("n2", "r2"), ("n3", "r3")] {
        c.register_node(pb::RegisterNodeRequest {
            id: id.into(),
            address: format!("127.0.0.1:75{}", &id[1..]),
            labels: [
                ("zone".to_string(), "z1".to_string()),
                ("rack".to_string(), rack.to_string()),
            ]
            .into(),
            capacity_bytes: 1 << 40,
            free_bytes: 1 << 39,
            used_bytes: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let (e, mut s) = synthetic_manifest("l", 40, 10, 10, 1 << 22);
    for sh in &mut s {
        sh.replicas = vec!["n1".into(), "n2".into()];
    }
    let v = commit(&mut c, "ds", 1 << 22, e, s.clone()).await.unwrap();
    let r = pb::VersionRef {
        dataset: "ds".into(),
        version: v.version,
    };
    // Move shard 0 from n1 to n3, as repair would.
    let reps = c
        .update_replicas(pb::UpdateReplicasRequest {
            r#ref: Some(r.clone()),
            shard: 0,
            add: vec!["n3".into()],
            remove: vec!["n1".into()],
        })
        .await
        .unwrap()
        .into_inner()
        .replicas;
    assert_eq!(reps, vec!["n2", "n3"]);
    let got = c
        .get_version(pb::GetVersionRequest { r#ref: Some(r) })
        .await
        .unwrap()
        .into_inner();
    let res: std::collections::HashMap<_, _> =
        got.resident.iter().map(|x| (x.node.as_str(), x.bytes)).collect();
    assert_eq!(res["n1"], v.bytes - s[0].bytes);
    assert_eq!(res["n2"], v.bytes);
    assert_eq!(res["n3"], s[0].bytes);

    // n1 keeps heartbeating, the others fall silent.
    let mut beat = m.client(None).await;
    let state_of = |out: &std::process::Output, id: &str| -> String {
        let j: serde_json::Value = serde_json::from_str(&stdout(out)).unwrap();
        j.as_array().unwrap().iter().find(|n| n["id"] == id).unwrap()["state"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        beat.heartbeat(pb::HeartbeatRequest {
            id: "n1".into(),
            free_bytes: 123,
            used_bytes: 456,
            ..Default::default()
        })
        .await
        .unwrap();
        let out = m.cli(&["node", "list", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        if state_of(&out, "n2") == "down" && state_of(&out, "n3") == "down" {
            assert_eq!(state_of(&out, "n1"), "up");
            let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            let n1 = j
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["id"] == "n1")
                .unwrap()
                .clone();
            assert_eq!(
                (n1["free_bytes"].as_u64(), n1["used_bytes"].as_u64()),
                (Some(123), Some(456))
            );
            assert_eq!(n1["labels"]["rack"], "r1");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "n2 and n3 never went down");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A node that was never registered cannot heartbeat.
    let e = beat
        .heartbeat(pb::HeartbeatRequest {
            id: "ghost".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test]
async fn daemon_logs_are_plain_text_or_json_lines() {
    let h = Harness::new("logs");
    let m = h.start_metadata("plain", MetadataOpts::default()).await;
    let j = h
        .start_metadata(
            "json",
            MetadataOpts {
                extra: vec!["--log-format".into(), "json".into()],
                ..Default::default()
            },
        )
        .await;
    let plain = std::fs::read_to_string(&m.log).unwrap();
    assert!(plain.contains("metadata service ready"), "{plain}");
    assert!(
        !plain.contains('\u{1b}'),
        "no terminal colours in a log file: {plain:?}"
    );
    let json = std::fs::read_to_string(&j.log).unwrap();
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines
        .iter()
        .any(|l| l["fields"]["message"] == "metadata service ready"));
}

/// Resident memory of a process, from /proc.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A caller sending made-up method paths gets UNIMPLEMENTED each time, and neither the
/// service's metrics nor its memory grow with the number of distinct paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_unknown_grpc_paths_leave_metrics_and_memory_flat() {
    let h = Harness::new("unknown-paths");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(m.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let call = |i: usize| {
        let mut g = tonic::client::Grpc::new(channel.clone());
        async move {
            g.ready().await.unwrap();
            let path = http::uri::PathAndQuery::try_from(format!(
                "/locus.metadata.v1.Metadata/Made{i:05}Up{}",
                "x".repeat(i % 100)
            ))
            .unwrap();
            g.unary::<(), (), _>(tonic::Request::new(()), path, tonic_prost::ProstCodec::default())
                .await
                .unwrap_err()
                .code()
        }
    };
    // Warm up, then measure.
    for i in 0..500 {
        assert_eq!(call(i).await, tonic::Code::Unimplemented);
    }
    let metrics_before = http_get(m.http, "/metrics").await.len();
    let rss_before = rss_kib(m.pid());
    let mut codes = futures_util::stream::iter((500..10_500).map(call)).buffer_unordered(32);
    use futures_util::StreamExt;
    while let Some(code) = codes.next().await {
        assert_eq!(code, tonic::Code::Unimplemented);
    }
    let metrics_after = http_get(m.http, "/metrics").await;
    assert!(
        !metrics_after.contains("Made"),
        "a made-up path became a metrics label"
    );
    assert!(
        metrics_after.len() < metrics_before + 4096,
        "metrics grew from {metrics_before} to {} bytes",
        metrics_after.len()
    );
    let rss_after = rss_kib(m.pid());
    assert!(
        rss_after < rss_before + 16 * 1024,
        "memory grew from {rss_before} to {rss_after} KiB over 10,000 unknown paths"
    );
}

/// The HTTP port takes no token (schedulers call it), so it holds a bounded number of
/// connections and cuts off a client that does not finish its request's headers: forty
/// connections trickling half a request neither keep /healthz from answering nor stay
/// open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_http_clients_are_cut_off_and_cannot_take_every_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new("slow-http");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                extra: vec![
                    "--http-max-connections".into(),
                    "8".into(),
                    "--http-header-timeout".into(),
                    "1s".into(),
                ],
                ..Default::default()
            },
        )
        .await;
    let mut slow = Vec::new();
    for _ in 0..40 {
        let mut s = tokio::net::TcpStream::connect(m.http).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    assert_eq!(http_get(m.http, "/healthz").await.trim(), "ok");
    for mut s in slow {
        let mut buf = [0u8; 256];
        let r = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
            .await
            .expect("a slow client's connection was still open after 30 s");
        // Closed: end of stream, a reset, or a 408 before the close.
        if let Ok(n) = r {
            assert!(n == 0 || buf.starts_with(b"HTTP/1.1 408"), "{:?}", &buf[..n]);
        }
    }
}

/// The harness's own promise, which every end-to-end test leans on: a port chosen free
/// and then taken by someone else before the service binds it costs a retry on new
/// ports, not the test.
#[tokio::test]
async fn a_service_whose_chosen_port_is_taken_before_it_listens_starts_on_new_ports() {
    let h = Harness::new("port-taken");
    let mut m = h.prepare_metadata("meta", MetadataOpts::default(), &[]);
    let taken = m.grpc;
    let _squatter = std::net::TcpListener::bind(taken).expect("the chosen port is free");
    m.start_on_free_ports().await;
    assert_ne!(m.grpc.port(), taken.port(), "it moved off the taken port");
    let mut c = m.client(None).await;
    c.get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .expect("it answers on its new port");
}

/// A daemon says when it is ready, with its addresses, at the default log level (no
/// RUST_LOG): `locus node serve` logged only warnings, so its log stayed empty.
#[tokio::test]
async fn a_node_logs_a_ready_line_with_its_address_by_default() {
    let h = Harness::new("node-ready");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let dir = h.path("n1");
    let log = std::fs::File::create(h.path("n1.log")).unwrap();
    let mut child = std::process::Command::new(locus())
        .args([
            "--metadata",
            &m.url(),
            "node",
            "serve",
            "--id",
            "n1",
            "--capacity",
            "1GiB",
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .arg("--addr-file")
        .arg(dir.join("addr"))
        .env_remove("RUST_LOG")
        .env_remove("LOCUS_CONFIG")
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let text = loop {
        let text = std::fs::read_to_string(h.path("n1.log")).unwrap_or_default();
        if text.contains("cache node ready") || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let addr = std::fs::read_to_string(dir.join("addr")).unwrap_or_default();
    let grpc = addr
        .lines()
        .find_map(|l| l.strip_prefix("grpc="))
        .unwrap_or_else(|| panic!("no address file: {addr:?}"));
    let ready = text
        .lines()
        .find(|l| l.contains("cache node ready"))
        .unwrap_or_else(|| panic!("no ready line: {text}"));
    assert!(
        ready.contains(grpc.trim()),
        "the ready line names {grpc}: {ready}"
    );
}
