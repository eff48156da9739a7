//! Attack tests of the trust boundary's second pass: each tries, with real processes, a way
//! in that a review found open, and asserts it is closed for the right reason.
//!
//! One test per finding: members' secrets off the wire and out of strangers' hands (1), a
//! compromised node unable to act for others (3), nodes reading only the local
//! directories they were given (4), cache eviction decided by the manifest rather than the
//! caller (5), data and secrets private on the host (6), snapshots bound to where they
//! are read from (7), nothing told without a token (8), and no credentials taken from the
//! machine (9). The CSI one (2) is in `tests/csi.rs`, beside the plugin harness.

use locus_testkit as support;

use std::time::Duration;

use locus_proto::{nodepb, pb};
use support::*;

async fn issue(
    c: &mut locus_proto::client::MetadataClient,
    node: &str,
    op: &str,
    target: &str,
) -> Result<String, tonic::Status> {
    c.issue_grant(pb::IssueGrantRequest {
        node: node.into(),
        operation: op.into(),
        target: target.into(),
        ttl_ms: 0,
    })
    .await
    .map(|r| r.into_inner().grant)
}

fn bed() -> Netbed {
    if let Some(why) = Netbed::unavailable() {
        panic!("this test needs the multi-host test bed (run as root): {why}");
    }
    Netbed::new(&[3]).unwrap_or_else(|e| panic!("building the test bed: {e}"))
}

/// Finding 1, on the wire: a group with tokens but no TLS on separate hosts refuses to
/// start (its members would send the member secret, the catalogue and the grant keys in
/// clear); with TLS, a capture of the raft ports shows neither a token nor the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_off_one_host_refuses_plaintext_and_under_tls_no_secret_crosses_a_link() {
    let bed = bed();
    let h = Harness::new("sec-group-wire");
    let mut plain = h.prepare_group_on(&bed, "plain", MetadataOpts::with_tokens());
    for m in plain.iter_mut() {
        m.spawn();
    }
    wait_until(
        "every plaintext member to refuse to start",
        Duration::from_secs(30),
        || {
            let done = plain.iter_mut().all(|m| m.daemon.exited());
            async move { done.then_some(()) }
        },
    )
    .await;
    for m in &plain {
        let log = std::fs::read_to_string(&m.log).unwrap_or_default();
        assert!(
            log.contains("in clear") && log.contains("--insecure") && log.contains("--tls-cert"),
            "{} did not say why and what to do:\n{log}",
            m.daemon.name
        );
    }
    drop(plain);

    // With TLS: everything the members say to each other, captured.
    let pcap = h.path("raft.pcap");
    let mut dump = std::process::Command::new("tcpdump")
        .args(["-i", "any", "-U", "-s", "0", "-w"])
        .arg(&pcap)
        .args(["tcp", "port", "7410", "or", "tcp", "port", "7400"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tcpdump (scripts/setup-debian.sh installs it)");
    {
        use std::io::Read;
        let mut err = dump.stderr.take().unwrap();
        let mut seen = Vec::new();
        let mut b = [0u8; 256];
        while !String::from_utf8_lossy(&seen).contains("listening on") {
            let n = err.read(&mut b).unwrap();
            assert!(n > 0, "tcpdump ended: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&b[..n]);
        }
        std::mem::forget(err);
    }
    let opts = MetadataOpts {
        tls: true,
        ..MetadataOpts::with_tokens()
    };
    let ms = h.start_group_on(&bed, "tls", opts).await;
    let l = group_leader(&ms).await;
    let f = (l + 1) % 3;
    // A write through a follower (forwarded with the caller's token, replicated) and a
    // key rotation (the new key travels in a log entry).
    let mut c = ms[f].own_client().await;
    let (e, s) = synthetic_manifest("wire", 20, 20, 10, 1 << 16);
    assert_eq!(commit(&mut c, "ds", 1 << 16, e, s).await.unwrap().version, 1);
    c.grant_keys(pb::GrantKeysRequest {
        op: "rotate".into(),
        publish_delay_ms: 1000,
        revoke: false,
    })
    .await
    .expect("rotate the grant keys");
    group_settled(&ms, Duration::from_secs(30)).await;
    drop(ms);
    // SIGINT: tcpdump flushes its capture and exits.
    let _ = std::process::Command::new("kill")
        .args(["-INT", &dump.id().to_string()])
        .status();
    let _ = dump.wait();
    let wire = std::fs::read(&pcap).unwrap();
    assert!(
        wire.len() > 20_000,
        "the capture saw the members talk: {} bytes",
        wire.len()
    );
    let secrets = [
        member_token().secret,
        tokens()
            .iter()
            .find(|t| t.role == "admin")
            .unwrap()
            .secret
            .clone(),
        "pkcs8".to_string(),
        "Bearer".to_string(),
        "PRI * HTTP/2.0".to_string(),
    ];
    for s in &secrets {
        assert!(
            !wire.windows(s.len()).any(|w| w == s.as_bytes()),
            "{s:?} crossed a link in clear"
        );
    }
}

/// Finding 1, on the ports: only the member role opens the raft port and it opens nothing
/// else; a learner is sent nothing until it proves it holds the member secret, so
/// `add-learner` naming a stranger's host hands it neither a token nor the catalogue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_tokens_open_only_raft_ports_and_a_stranger_added_as_learner_receives_nothing() {
    let h = Harness::new("sec-group-ports");
    let ms = h.start_group("meta", 3, MetadataOpts::with_tokens()).await;
    let l = group_leader(&ms).await;
    let raft = ms[l].raft.expect("the leader's raft port");
    let liveness = |token: Option<String>| async move {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{raft}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = pb::raft_client::RaftClient::new(ch);
        let mut req = tonic::Request::new(pb::RaftHelloRequest::default());
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        c.liveness(req).await.map(|_| ())
    };
    let admin = ms[l].token("admin").unwrap();
    let e = liveness(Some(admin.clone()))
        .await
        .expect_err("an admin token opened the raft port");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(liveness(None).await.is_err());
    liveness(Some(member_token().secret))
        .await
        .expect("the member token opens the raft port");
    // The member token is no credential on the Metadata API.
    let mut o = ms[l].client_options(Some(member_token().secret));
    o.url = ms[l].own_url();
    let mut as_member = locus_proto::client::connect(&o).await.unwrap();
    let e = as_member
        .list_datasets(pb::ListDatasetsRequest {})
        .await
        .expect_err("a member token read the catalogue");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // A stranger's raft port, added by an admin who was talked into it.
    let stranger = ImpostorMember::start("m4").await;
    let out = ms[l]
        .cli_within(
            Duration::from_secs(30),
            &[
                "metadata",
                "members",
                "add-learner",
                "m4",
                &stranger.addr.to_string(),
            ],
            &[("LOCUS_TOKEN", admin)],
        )
        .await;
    assert!(!out.status.success(), "the stranger was added");
    assert!(stderr(&out).contains("does not prove"), "{}", stderr(&out));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let heard = stranger.heard.calls();
    assert!(!heard.is_empty(), "the leader never even asked the stranger");
    for (method, auth) in &heard {
        assert_eq!(method, "Hello", "the stranger was sent {method}");
        assert_eq!(auth, &None, "the stranger was sent a credential");
    }
    let info = ms[l]
        .own_client()
        .await
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await;
    assert!(
        !info.unwrap().into_inner().members.iter().any(|m| m.name == "m4"),
        "m4 joined the membership"
    );
}

/// Finding 3: a node never sends its token to anyone, so it holds no peer's; and a node
/// token alone (without the identity that registered) cannot keep a dead node up, so
/// repair starts within the liveness timeout; reported free space is bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_a_peers_token_cannot_keep_it_up_and_no_node_collects_tokens() {
    let h = Harness::new("sec-node-tokens");
    let secured = MetadataOpts {
        liveness_timeout: Some("3s"),
        ..MetadataOpts::with_tokens()
    };
    let (m, mut nodes) = cluster_with(&h, secured, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 40);
    let o = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // A stranger registered as a node (n4, with its own valid token): whatever the
    // cluster sends it, it records.
    let fake = ListeningPeer::start().await;
    let mut n4 = m.client_named("n4").await;
    n4.register_node(pb::RegisterNodeRequest {
        id: "n4".into(),
        address: fake.addr.to_string(),
        labels: [("host".to_string(), "h4".to_string())].into(),
        capacity_bytes: 1 << 40,
        free_bytes: 1 << 40,
        instance: "a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // A peer copy from it (n1 ordered under an admin's import grant), and a warm-up onto
    // it (the metadata service ordering a copy): neither hands it a token.
    let mut admin = m.client(Some("admin")).await;
    let g = issue(&mut admin, "n1", "import", "").await.unwrap();
    let h1 = *blake3::hash(b"wanted").as_bytes();
    let _ = nodes[0]
        .client_with(Some(&g))
        .await
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: fake.addr.to_string(),
            blobs: vec![nodepb::BlobRef {
                hash: h1.to_vec(),
                size: 6,
                origin_path: String::new(),
            }],
            ..Default::default()
        })
        .await;
    let _ = m.cli(&["warm", "ds@1", "--nodes", "n4"]);
    let heard = fake.heard.calls();
    assert!(
        heard.iter().any(|(m, _)| m == "ReadBlob"),
        "n1 never read from the stranger: {heard:?}"
    );
    assert!(
        heard.iter().any(|(m, _)| m == "FetchBlobs"),
        "the warm-up never ordered it: {heard:?}"
    );
    let secrets: Vec<String> = tokens().into_iter().map(|t| t.secret).collect();
    for (method, auth) in &heard {
        let auth = auth.as_deref().unwrap_or_default();
        assert!(
            auth.starts_with("Bearer lg1."),
            "{method} came with {auth:?}, not a grant"
        );
        assert!(
            !secrets.iter().any(|s| auth.contains(s.as_str())),
            "{method} carried a token"
        );
    }

    // n2 dies; whoever holds its token keeps heartbeating for it without its identity
    // (the file that holds it is private to n2's host), or with a made-up one.
    let mut as_n2 = m.client_named("n2").await;
    nodes[1].daemon.kill9();
    let started = std::time::Instant::now();
    let attack = async {
        loop {
            for instance in ["", "00000000000000000000000000000000"] {
                let r = as_n2
                    .heartbeat(pb::HeartbeatRequest {
                        id: "n2".into(),
                        instance: instance.into(),
                        free_bytes: u64::MAX,
                        ..Default::default()
                    })
                    .await;
                let e = r.expect_err("a heartbeat for n2 without its identity was taken");
                assert!(
                    matches!(
                        e.code(),
                        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
                    ),
                    "{e:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let down = async {
        wait_until(
            "n2 to be declared down and repaired",
            Duration::from_secs(60),
            || {
                let mut c = admin.clone();
                async move {
                    let s = shards(&mut c, "ds", 1).await;
                    s.iter()
                        .all(|s| s.replicas.len() == 2 && !s.replicas.iter().any(|r| r == "n2"))
                        .then_some(())
                }
            },
        )
        .await
    };
    tokio::select! {
        _ = attack => unreachable!(),
        _ = down => {}
    }
    eprintln!("n2 repaired away {:?} after its death", started.elapsed());
    // And a node's own heartbeat cannot claim more room than it registered.
    let list = admin
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    for n in list {
        assert!(
            n.free_bytes <= n.capacity_bytes,
            "{}: free {} > capacity {}",
            n.id,
            n.free_bytes,
            n.capacity_bytes
        );
    }
}

/// Finding 4: a node reads as a `file://` origin only directories its operator named
/// (`--origin-root`), symlinks resolved: an import grant cannot make it read `/etc` or
/// its own process's environment, and a refusal does not tell the file's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reads_no_local_file_outside_its_origin_roots() {
    let h = Harness::new("sec-origin-roots");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let allowed = h.path("allowed");
    let secret_dir = h.path("private");
    std::fs::create_dir_all(&allowed).unwrap();
    std::fs::create_dir_all(&secret_dir).unwrap();
    std::fs::write(allowed.join("ok.bin"), pseudo_random(1, 5000)).unwrap();
    std::fs::write(
        secret_dir.join("shadow"),
        b"root:$6$secret-hash-of-1234567:19000:0:99999:7:::\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(secret_dir.join("shadow"), allowed.join("sneaky")).unwrap();
    let mut o = NodeOpts::host(1);
    o.extra = vec!["--origin-root".into(), allowed.display().to_string()];
    let n1 = h.start_node("n1", &m, o).await;
    let mut admin = m.client(Some("admin")).await;
    let ask = |origin: String, path: &'static str, size: u64| {
        let mut admin = admin.clone();
        let n1 = &n1;
        async move {
            let g = issue(&mut admin, "n1", "import", &origin).await.unwrap();
            n1.client_with(Some(&g))
                .await
                .import_object(nodepb::ImportObjectRequest {
                    origin,
                    path: path.into(),
                    size,
                    ..Default::default()
                })
                .await
        }
    };
    let private = format!("file://{}", secret_dir.display());
    for (origin, path) in [
        (private.clone(), "shadow"),
        ("file:///etc".to_string(), "passwd"),
        ("file:///proc/self".to_string(), "environ"),
        (format!("file://{}", allowed.display()), "sneaky"),
    ] {
        let e = ask(origin.clone(), path, 1)
            .await
            .expect_err(&format!("{origin}/{path} was read"));
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{origin}/{path}: {e:?}");
        assert!(e.message().contains("--origin-root"), "{e:?}");
        // The run directory's name holds the test's pid, which may contain the digits.
        let said = e.message().replace(&h.root.display().to_string(), "");
        assert!(!said.contains("49"), "the refusal gave the size away: {e:?}");
    }
    // Under the root: imported, and a wrong size is refused without the right one.
    let root = format!("file://{}", allowed.display());
    let r = ask(root.clone(), "ok.bin", 5000)
        .await
        .expect("a file under the root");
    assert_eq!(
        r.into_inner().hash,
        blake3::hash(&pseudo_random(1, 5000)).as_bytes().to_vec()
    );
    let e = ask(root, "ok.bin", 7).await.expect_err("a wrong size");
    assert!(!e.message().contains("5000"), "{e:?}");
    let _ = &mut admin;
}

/// Finding 5: how much cache a request evicts is decided by the manifest and the bytes
/// that arrive, never by a size the caller announces: a socket user asking for a blob
/// with a huge size, or a writer announcing one and sending nothing, evicts nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcing_a_huge_size_evicts_no_cached_blob() {
    let h = Harness::new("sec-evict");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n1 = h
        .start_node("n1", &m, NodeOpts::host(1).with_capacity("3MiB"))
        .await;
    let n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..12u64 {
        std::fs::write(src.join(format!("f{i:02}")), pseudo_random(i, 100_000)).unwrap();
    }
    // Every shard on n2 alone (n1 is too small to be chosen for 1.2 MB... so drain it).
    let out = m.cli(&["node", "drain", "n1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let o = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // n1 caches six of them (unpinned), through its socket as a mount would.
    let mut local = locus_proto::client::connect_local_node(&n1.socket);
    let mut c = m.client(Some("admin")).await;
    let entries = all_entries(&mut c, "ds", 1).await;
    let blob = |e: &pb::Entry| (e.blob.clone(), e.size);
    let files: Vec<_> = entries.iter().filter(|e| e.size > 0).map(blob).collect();
    assert_eq!(files.len(), 12);
    for (b, size) in &files[..6] {
        local
            .ensure_local(nodepb::EnsureLocalRequest {
                hash: b.clone(),
                size: *size,
                chunk_size: 0,
                packed_ok: true,
            })
            .await
            .expect("cache a blob on n1");
    }
    let cached = |local: &mut locus_proto::client::NodeClient| {
        let mut local = local.clone();
        let hashes: Vec<Vec<u8>> = files[..6].iter().map(|f| f.0.clone()).collect();
        async move {
            local
                .have_blobs(nodepb::HaveBlobsRequest { hashes, pin: false })
                .await
                .unwrap()
                .into_inner()
                .present
                .iter()
                .filter(|p| **p)
                .count()
        }
    };
    assert_eq!(cached(&mut local).await, 6);
    // Another blob, announced as nearly the whole capacity: served with its real size,
    // evicting nothing.
    let (b, _) = &files[6];
    local
        .ensure_local(nodepb::EnsureLocalRequest {
            hash: b.clone(),
            size: 3 << 20,
            chunk_size: 0,
            packed_ok: true,
        })
        .await
        .expect("a blob asked for with a wrong size is still served, at its own size");
    assert_eq!(
        cached(&mut local).await,
        6,
        "a caller's size evicted cached blobs"
    );
    // A writer (an import grant) announcing a huge blob and sending nothing.
    let g = issue(&mut c, "n1", "import", "").await.unwrap();
    let header = nodepb::WriteBlobMessage {
        msg: Some(nodepb::write_blob_message::Msg::Header(nodepb::WriteBlobHeader {
            hash: blake3::hash(b"never sent").as_bytes().to_vec(),
            size: (3 << 20) - 1,
            chunk_size: 0,
            pin: false,
        })),
    };
    let _ = n1
        .client_with(Some(&g))
        .await
        .write_blob(tokio_stream::iter(vec![header]))
        .await;
    assert_eq!(
        cached(&mut local).await,
        6,
        "an announced write evicted cached blobs"
    );
    drop(n2);
}

/// Finding 6: the node's data and identity are private to its user (and the socket's
/// group), the metadata service's data dir to its own; secrets are refused on the
/// command line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_data_is_private_and_secrets_never_come_from_the_command_line() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new("sec-hygiene");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 5);
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, blob) = n.blob_files().into_iter().next().expect("a blob file");
    let file = blob.path;
    let as_nobody = |p: &std::path::Path| {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
            .arg(p)
            .output()
            .expect("setpriv (util-linux)")
    };
    // The control: nobody can reach this run's directory at all (else the next check
    // would pass for the wrong reason).
    let control = n.data_dir.parent().unwrap().join("control.txt");
    std::fs::write(&control, b"anyone").unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = as_nobody(&control);
    assert!(out.status.success(), "the control failed: {}", stderr(&out));
    // Another local user (nobody, in no group of the node's) reads no cached dataset.
    let out = as_nobody(&file);
    assert!(!out.status.success(), "another user read {}", file.display());
    assert!(stderr(&out).contains("Permission denied"), "{}", stderr(&out));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&n.data_dir.join("identity")), 0o600);
    assert_eq!(mode(&n.data_dir.join("index")), 0o700);
    assert_eq!(mode(&m.data_dir), 0o700);
    // No secret on the command line, for any command.
    let reader = m.token("reader").unwrap();
    let out = m.cli_env(&["--token", &reader, "status"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("process list"), "{}", stderr(&out));
    for flag in ["--member-token", "--node-token"] {
        // (--listen is bad too, so a build that took the flag stops rather than serves.)
        let out = m.cli_env(
            &["metadata", "serve", flag, "x", "--listen", "not-an-address"],
            &[],
        );
        assert!(!out.status.success(), "{flag} was accepted");
        assert!(
            stderr(&out).contains("unexpected argument"),
            "{flag}: {}",
            stderr(&out)
        );
    }
}

/// Finding 8: with tokens, the scheduler extender answers only a caller with a token
/// (in the URL, as kube-scheduler can give it, or a header), and cluster info too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_extender_and_cluster_info_tell_nothing() {
    let h = Harness::new("sec-tokenless");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let _n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 5);
    assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    let body = r#"{"pod":{"metadata":{"annotations":{"locus.io/dataset":"ds@1"}}},"nodenames":["n1","n9"]}"#;
    let post = |path: String| async move {
        let out = tokio::process::Command::new("curl")
            .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-XPOST", "-d", body])
            .arg(format!("http://{}{path}", m.http))
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (b, code) = text.rsplit_once('\n').unwrap();
        (code.to_string(), b.to_string())
    };
    for path in ["/k8s/prioritize", "/k8s/filter", "/k8s/not-a-token/prioritize"] {
        let (code, b) = post(path.into()).await;
        assert!(code == "401" || code == "403", "{path}: {code} {b}");
        assert!(!b.contains("Score") && !b.contains("n1"), "{path} told {b}");
    }
    let reader = m.token("reader").unwrap();
    let (code, b) = post(format!("/k8s/{reader}/prioritize")).await;
    assert_eq!(code, "200", "{b}");
    assert!(b.contains("\"Score\":10"), "{b}");
    let mut anon = locus_proto::client::connect(&m.client_options(None))
        .await
        .unwrap();
    let e = anon
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .expect_err("cluster info without a token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
}

/// Finding 9: a node whose environment names no object-store credentials refuses to
/// read a bucket without touching the network — above all not the cloud's
/// instance-metadata service — and the import falls back to the client's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_credentials_never_asks_the_instance_metadata_service() {
    let h = Harness::new("sec-imds");
    let s3 = h.start_s3().await;
    let bucket = s3.bucket("imds").await;
    for i in 0..4u64 {
        let p = object_store::path::Path::from(format!("data/f{i}"));
        object_store::ObjectStoreExt::put(bucket.as_ref(), &p, pseudo_random(i, 20_000).into())
            .await
            .unwrap();
    }
    // Where the instance-metadata service would be: anyone who connects is counted.
    let imds = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let imds_addr = imds.local_addr().unwrap();
    let knocks = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let k = knocks.clone();
    tokio::spawn(async move {
        while let Ok((_s, _)) = imds.accept().await {
            k.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let mut o = NodeOpts::host(1);
    o.env = vec![
        ("AWS_ENDPOINT_URL".into(), s3.endpoint.clone()),
        ("AWS_ALLOW_HTTP".into(), "true".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_METADATA_ENDPOINT".into(), format!("http://{imds_addr}")),
        (
            "AWS_EC2_METADATA_SERVICE_ENDPOINT".into(),
            format!("http://{imds_addr}"),
        ),
    ];
    let n = h.start_node("n1", &m, o).await;
    let env: Vec<(&str, String)> = s3.env();
    let out = m.cli_env(
        &[
            "dataset",
            "import",
            "ds",
            "s3://imds/data",
            "--replicas",
            "1",
            "--read-by",
            "auto",
            "--json",
        ],
        &env,
    );
    assert!(out.status.success(), "import: {}", stderr(&out));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        knocks.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the node asked the instance-metadata service for credentials"
    );
    assert!(
        stderr(&out).contains("no credentials for s3://imds/data"),
        "nobody said why the node could not read: {}",
        stderr(&out)
    );
    drop(n);
}
