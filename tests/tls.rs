//! TLS on every TCP hop, end to end: a cluster whose metadata service and nodes serve
//! TLS with certificates of one CA made by `locus tls`, mutual TLS demanded of every
//! caller, and a TLS-only tap in front of every daemon, through which every hop of an
//! import, a repair, a remote mount and a backup must pass.

use locus_testkit as support;

use std::time::Duration;

use support::*;

fn secrets(m: &Metadata) -> Vec<String> {
    m.opts.tokens.iter().map(|t| t.secret.clone()).collect()
}

// The taps run on this test's runtime while the CLI blocks a thread: several workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_tls_on_every_hop_no_token_crosses_a_tcp_connection_in_clear() {
    let h = Harness::new("tls-hops");
    let mut m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                mtls: true,
                liveness_timeout: Some("2s"),
                ..Default::default()
            },
        )
        .await;
    let meta_tap = WireTap::start(secrets(&m)).await;
    meta_tap.forward_to(m.grpc);
    // Nodes, mounts and the CLI reach the service only through its tap.
    m.public_url = Some(format!("https://localhost:{}", meta_tap.addr.port()));
    let mut taps = Vec::new();
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let tap = WireTap::start(secrets(&m)).await;
        let mut o = NodeOpts::host(i);
        o.tls = true;
        o.extra = vec!["--advertise".into(), tap.addr.to_string()];
        let n = h.start_node(&format!("n{i}"), &m, o).await;
        tap.forward_to(n.grpc);
        taps.push(tap);
        nodes.push(n);
    }
    let listed = stdout(&m.cli(&["node", "list", "--json"]));
    for t in &taps {
        assert!(
            listed.contains(&format!("https://{}", t.addr)),
            "a TLS node registers an https:// address: {listed}"
        );
    }

    // Import: CLI → service, CLI → nodes.
    let src = h.path("src");
    make_tree(&src, 40);
    std::fs::write(src.join("big.bin"), pseudo_random(7, 6 << 20)).unwrap();
    let o = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(o.status.success(), "import over TLS: {}", stderr(&o));

    // Repair: the service orders a node to copy from a peer (service → node, node → node).
    let mut c = m.client(Some("admin")).await;
    let holder = shards(&mut c, "ds", 1).await[0].replicas[0].clone();
    let k = nodes.iter().position(|n| n.id == holder).unwrap();
    nodes[k].daemon.kill9();
    wait_node_down(&m, &holder).await;
    wait_moved_off(&m, "ds", &holder).await;

    // A mount with no local node reads every byte from the remaining nodes (mount → node).
    let mnt = m.mount("mnt", "ds@1", None, &[]);
    assert_same_tree(&src, &mnt.path);
    drop(mnt);

    // A backup: the service exports its catalogue, nodes upload blobs (CLI → node).
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let o = m.cli(&["backup", "run", "--to", &url]);
    assert!(o.status.success(), "backup over TLS: {}", stderr(&o));

    // Every hop went through a tap, in TLS, with no secret and no cleartext HTTP/2 in it.
    let mut node_bytes = 0;
    for (i, t) in std::iter::once(&meta_tap).chain(&taps).enumerate() {
        assert_eq!(t.get(|s| &s.plaintext_refused), 0, "tap {i} refused plaintext");
        assert_eq!(t.get(|s| &s.secrets_seen), 0, "tap {i} saw a secret in clear");
        assert!(
            t.get(|s| &s.tls_connections) > 0,
            "tap {i} carried no TLS connection"
        );
        if i > 0 {
            node_bytes += t.get(|s| &s.bytes);
        }
    }
    // Blob bytes to and between TLS nodes took the bulk path, inside TLS.
    let bulk: u64 = taps.iter().map(|t| t.get(|s| &s.bulk_tls_connections)).sum();
    assert!(bulk > 0, "no bulk connection reached a TLS node");
    let src_bytes: u64 = walk(&src, false).values().map(|f| f.1).sum();
    // Import (two replicas), repair, mount read and backup each moved the data once.
    assert!(
        node_bytes > 3 * src_bytes,
        "the node hops carried {node_bytes} bytes; the data is {src_bytes}"
    );

    // The tap is not blind: a client that speaks gRPC in clear to it is refused and counted.
    let before = taps[0].get(|s| &s.plaintext_refused);
    let plain = locus_proto::client::connect_node(
        &taps[0].addr.to_string(),
        m.token("admin").as_deref(),
        Duration::from_secs(3),
    )
    .await;
    if let Ok(mut p) = plain {
        let r = p
            .get_node_status(locus_proto::nodepb::GetNodeStatusRequest {})
            .await;
        assert!(r.is_err(), "a plaintext call through the tap must fail");
    }
    // (The client may try the connection more than once.)
    assert!(
        taps[0].get(|s| &s.plaintext_refused) > before,
        "the tap let plaintext through"
    );

    // Mutual TLS: a caller with a valid admin token but no client certificate is refused,
    // and told what is missing.
    let o = m
        .cli_command(&["node", "list"], &[])
        .env_remove("LOCUS_CLIENT_CERT")
        .env_remove("LOCUS_CLIENT_KEY")
        .output()
        .unwrap();
    assert!(!o.status.success(), "no client certificate, no answer");
    assert!(stderr(&o).contains("--client-cert"), "{}", stderr(&o));

    // The HTTP port speaks TLS with the same certificate, and not plaintext.
    let https = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(m.dir.join("ca.pem"))
        .arg(format!("https://localhost:{}/healthz", m.http.port()))
        .output()
        .expect("curl");
    assert_eq!(
        String::from_utf8_lossy(&https.stdout).trim(),
        "ok",
        "{}",
        stderr(&https)
    );
    let plain = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{}/healthz", m.http.port()))
        .output()
        .expect("curl");
    assert!(!String::from_utf8_lossy(&plain.stdout).contains("ok"));
}
