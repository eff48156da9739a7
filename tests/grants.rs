//! Grants, end to end: clients present to nodes a grant the metadata service signed for
//! one operation on one node, never their own token. Nodes here (as in every test with
//! tokens) hold no admin token at all, so an import and a backup that succeed show that
//! none was needed; then each limit of a grant is tried against a real node over TLS.

use locus_testkit as support;

use std::time::Duration;

use locus_proto::nodepb;
use locus_proto::pb;
use support::*;

async fn grant(c: &mut locus_proto::client::MetadataClient, node: &str, op: &str, target: &str) -> String {
    issue(c, node, op, target, 0).await.unwrap().grant
}

async fn issue(
    c: &mut locus_proto::client::MetadataClient,
    node: &str,
    op: &str,
    target: &str,
    ttl_ms: u64,
) -> Result<pb::IssueGrantResponse, tonic::Status> {
    c.issue_grant(pb::IssueGrantRequest {
        node: node.into(),
        operation: op.into(),
        target: target.into(),
        ttl_ms,
    })
    .await
    .map(|r| r.into_inner())
}

async fn have(n: &Node, credential: &str) -> Result<(), tonic::Status> {
    ask_have(n, credential, false).await
}

/// HaveBlobs as an import asks it: what the node holds is pinned for the import.
async fn have_pinning(n: &Node, credential: &str) -> Result<(), tonic::Status> {
    ask_have(n, credential, true).await
}

async fn ask_have(n: &Node, credential: &str, pin: bool) -> Result<(), tonic::Status> {
    n.client_with(Some(credential))
        .await
        .have_blobs(nodepb::HaveBlobsRequest {
            hashes: vec![[7u8; 32].to_vec()],
            pin,
        })
        .await
        .map(|_| ())
}

/// Starts an upload of nothing: the node checks the caller and the target, then finishes.
async fn upload(n: &Node, credential: &str, target: &str) -> Result<(), tonic::Status> {
    use futures_util::StreamExt;
    let mut s = n
        .client_with(Some(credential))
        .await
        .upload_blobs(nodepb::UploadBlobsRequest {
            target: target.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    while let Some(p) = s.next().await {
        p?;
    }
    Ok(())
}

fn refused(r: Result<(), tonic::Status>, code: tonic::Code, says: &str) {
    let e = r.expect_err("must be refused");
    assert_eq!(e.code(), code, "{e:?}");
    assert!(
        e.message().contains(says),
        "{:?} does not say {says:?}",
        e.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_opens_one_operation_on_one_node_for_a_while_and_nodes_need_no_admin_token() {
    let h = Harness::new("grants");
    let mut m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                tls: true,
                ..Default::default()
            },
        )
        .await;
    let mut nodes = Vec::new();
    for i in 1..=2 {
        let mut o = NodeOpts::host(i);
        o.tls = true;
        nodes.push(h.start_node(&format!("n{i}"), &m, o).await);
    }
    let node_tokens = std::fs::read_to_string(m.dir.join("node-tokens.toml")).unwrap();
    let admin = m.token("admin").unwrap();
    assert!(
        !node_tokens.contains(&admin),
        "the nodes must not know the admin token"
    );

    // An import and a backup with the admin token: the nodes never saw it, so they must
    // have been sent grants.
    let src = h.path("src");
    make_tree(&src, 30);
    let o = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(o.status.success(), "import: {}", stderr(&o));
    let url = format!("file://{}", h.path("backup").display());
    let o = m.cli(&["backup", "run", "--to", &url]);
    assert!(o.status.success(), "backup: {}", stderr(&o));
    let audit = std::fs::read_to_string(m.data_dir.join("audit.log")).unwrap();
    // Both nodes stored the import's replicas; one of them (whichever) uploaded.
    let granted = |what: &str| {
        audit
            .lines()
            .any(|l| l.contains("grant.issue") && l.contains(what) && l.contains("\"ops\""))
    };
    for want in ["n1/import", "n2/import"] {
        assert!(granted(want), "no grant for {want} in the audit log:\n{audit}");
    }
    assert!(granted("/backup"), "no backup grant in the audit log:\n{audit}");

    let mut c = m.client(Some("admin")).await;
    let (n1, n2) = (&nodes[0], &nodes[1]);
    let backup = grant(&mut c, "n1", "backup", &url).await;
    // What it is for: uploads by n1 to that target.
    upload(n1, &backup, &url)
        .await
        .expect("the grant's own operation");
    have(n1, &backup).await.expect("a backup checks what a node has");
    // Pinning what it finds is an import's to ask, not a backup's.
    refused(
        have_pinning(n1, &backup).await,
        tonic::Code::PermissionDenied,
        "takes an import grant",
    );
    let import_grant = grant(&mut c, "n1", "import", "").await;
    have_pinning(n1, &import_grant)
        .await
        .expect("an import pins what the node holds");
    // Not another node, not another method, not another target.
    refused(
        have(n2, &backup).await,
        tonic::Code::Unauthenticated,
        "for node n1",
    );
    let write = n1
        .client_with(Some(&backup))
        .await
        .write_blob(tokio_stream::iter(Vec::<nodepb::WriteBlobMessage>::new()))
        .await
        .map(|_| ());
    refused(write, tonic::Code::PermissionDenied, "does not allow WriteBlob");
    let elsewhere = format!("file://{}", h.path("elsewhere").display());
    refused(
        upload(n1, &backup, &elsewhere).await,
        tonic::Code::PermissionDenied,
        "not this URL",
    );
    // Changed by one hex digit of its body: the signature no longer holds.
    let mut forged = backup.clone().into_bytes();
    let i = locus_proto::grant::PREFIX.len() + 10;
    forged[i] = if forged[i] == b'0' { b'1' } else { b'0' };
    refused(
        have(n1, std::str::from_utf8(&forged).unwrap()).await,
        tonic::Code::Unauthenticated,
        "signature",
    );
    // An import grant for a moment: it runs out.
    let short = issue(&mut c, "n1", "import", "", 1000).await.unwrap();
    have(n1, &short.grant).await.expect("a fresh grant");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    refused(
        have(n1, &short.grant).await,
        tonic::Code::Unauthenticated,
        "expired",
    );

    // The service issues backup grants only for targets a run recorded, and write
    // grants only to admins; readers get read grants that any node takes.
    refused(
        issue(&mut c, "n1", "backup", &elsewhere, 0).await.map(|_| ()),
        tonic::Code::FailedPrecondition,
        "not a recorded backup target",
    );
    refused(
        issue(&mut c, "n9", "import", "", 0).await.map(|_| ()),
        tonic::Code::NotFound,
        "no node n9",
    );
    let mut r = m.client(Some("reader")).await;
    refused(
        issue(&mut r, "n1", "import", "", 0).await.map(|_| ()),
        tonic::Code::PermissionDenied,
        "needs an admin token",
    );
    let read = grant(&mut r, "*", "read", "").await;
    for n in &nodes {
        have(n, &read).await.expect("a read grant for every node");
        refused(
            have_pinning(n, &read).await,
            tonic::Code::PermissionDenied,
            "takes an import grant",
        );
    }
    refused(
        upload(n2, &read, &url).await,
        tonic::Code::PermissionDenied,
        "does not allow UploadBlobs",
    );

    // Uploads and origin reads take a grant only: not even a node's own token opens them.
    let n1_token = m.node_token("n1").unwrap();
    refused(
        upload(n1, &n1_token, &url).await,
        tonic::Code::PermissionDenied,
        "takes a grant",
    );
    // And no token at all is a credential at a node: not the admin's, not a node's.
    refused(
        have(n1, &admin).await,
        tonic::Code::PermissionDenied,
        "takes a grant",
    );
    refused(
        have(n1, &n1_token).await,
        tonic::Code::PermissionDenied,
        "takes a grant",
    );

    // The service restarted keeps its grant key: the nodes, which learnt it before,
    // take the grants of the next import (once they are heard from again: nodes not
    // heard since a restart take no new replica).
    m.kill9();
    m.restart().await;
    for n in ["n1", "n2"] {
        m.wait_node_up(n, "after the service restarted").await;
    }
    std::fs::write(src.join("new.bin"), pseudo_random(99, 300_000)).unwrap();
    let o = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(
        o.status.success(),
        "import after a restart of the service: {}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_mount_keeps_reading_on_its_grant_while_the_metadata_service_is_stopped() {
    let h = Harness::new("grants-outage");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let _n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..4u64 {
        std::fs::write(src.join(format!("f{i}.bin")), pseudo_random(i, 3 << 20)).unwrap();
    }
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // No local node: every byte comes from n1, under a read grant.
    let mnt = m.mount("mnt", "ds@1", None, &[]);
    assert_eq!(
        std::fs::read(mnt.path.join("f0.bin")).unwrap(),
        std::fs::read(src.join("f0.bin")).unwrap()
    );
    // The service stops answering: files not read yet still come from the node, on the
    // grant the mount holds.
    m.daemon.sigstop();
    for i in 1..4 {
        let f = format!("f{i}.bin");
        let got = std::fs::read(mnt.path.join(&f));
        assert_eq!(
            got.map_err(|e| e.to_string()),
            Ok(std::fs::read(src.join(&f)).unwrap()),
            "{f} with the metadata service stopped"
        );
    }
    m.daemon.sigcont();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_renewed_in_the_background_and_the_one_in_hand_serves_until_it_ends() {
    use locus_proto::grant::{Grants, Op};
    let h = Harness::new("grants-renew");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    // Four-second grants: always within the renewal window, so every call after the
    // first (once the retry interval allows) starts a renewal in the background.
    let grants = Grants::new(m.client(Some("admin")).await, m.token("admin").as_deref())
        .with_ttl(std::time::Duration::from_secs(4));
    let first = grants.get("n1", Op::Import, "").await.unwrap().unwrap();
    have(&n, &first).await.expect("the grant works");
    // The service stops: the grant in hand is still handed out (no error, no renewal
    // waited for), and still works at the node.
    m.daemon.sigstop();
    let held = grants.get("n1", Op::Import, "").await.unwrap().unwrap();
    assert_eq!(held, first);
    have(&n, &held)
        .await
        .expect("the held grant works while the service is stopped");
    // Once it has ended, a call has to wait for the service and fails without it.
    tokio::time::sleep(std::time::Duration::from_millis(4200)).await;
    let e = grants.get("n1", Op::Import, "").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    // The service back: a fresh grant, and the next renewal replaces it in the
    // background.
    m.daemon.sigcont();
    let fresh = grants.get("n1", Op::Import, "").await.unwrap().unwrap();
    assert_ne!(fresh, first);
    let renewed = wait_until(
        "a background renewal",
        std::time::Duration::from_secs(30),
        || async {
            let g = grants.get("n1", Op::Import, "").await.ok()??;
            (g != fresh).then_some(g)
        },
    )
    .await;
    have(&n, &renewed).await.expect("the renewed grant works");
}

/// Grant keys rotate without a refused call: the new key reaches the nodes (heartbeat
/// answers carry the keys) before it signs, and the old key's grants hold until they end;
/// a revoking rotation (a key that leaked) makes the old key's grants worthless at once.
/// The ring survives a restart of the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_keys_rotate_without_refusing_a_grant_and_a_revoked_key_opens_nothing() {
    let h = Harness::new("grant-rotation");
    let mut m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let mut c = m.client(Some("admin")).await;
    let old = grant(&mut c, "*", "read", "").await;
    have(&n1, &old).await.expect("a grant of the first key");
    let keys = |c: &mut locus_proto::client::MetadataClient, op: &str, delay: u64, revoke: bool| {
        let mut c = c.clone();
        let op = op.to_string();
        async move {
            c.grant_keys(pb::GrantKeysRequest {
                op,
                publish_delay_ms: delay,
                revoke,
            })
            .await
            .unwrap()
            .into_inner()
            .keys
        }
    };
    let states = |k: &[pb::GrantKey]| k.iter().map(|k| k.state.clone()).collect::<Vec<_>>();
    let r = keys(&mut c, "rotate", 1500, false).await;
    assert_eq!(states(&r), ["signing", "next"]);
    // Until the delay is over the old key signs; then the new one, which the node already
    // took from its heartbeats.
    let cluster = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .cluster_id;
    let signed_by = |g: &str, key: &[u8]| {
        let v = locus_proto::grant::Verifier::new("n1");
        v.set(&cluster, vec![key.to_vec()]);
        v.verify(g.as_bytes(), "ReadBlob", locus_proto::grant::now_ms())
            .is_ok()
    };
    let during = grant(&mut c, "*", "read", "").await;
    assert!(
        signed_by(&during, &r[0].public_key),
        "the next key signed before its time"
    );
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let k = keys(&mut c, "list", 0, false).await;
    assert_eq!(states(&k), ["verifying", "signing"]);
    let new = grant(&mut c, "*", "read", "").await;
    assert!(signed_by(&new, &r[1].public_key), "the new key does not sign");
    have(&n1, &new).await.expect("a grant of the new key");
    have(&n1, &old).await.expect("the old key's grant still holds");
    // The CLI says the same.
    let o = m.cli(&["metadata", "grant-keys", "list", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let listed: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");

    // A leak: rotate and revoke. Once the node heard (a heartbeat), nothing signed before
    // opens it; a fresh grant does.
    let o = m.cli(&["metadata", "grant-keys", "rotate", "--revoke"]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_until(
        "the node to drop the revoked keys",
        Duration::from_secs(10),
        || async { have(&n1, &new).await.is_err().then_some(()) },
    )
    .await;
    refused(have(&n1, &old).await, tonic::Code::Unauthenticated, "signature");
    refused(have(&n1, &new).await, tonic::Code::Unauthenticated, "signature");
    let fresh = grant(&mut c, "*", "read", "").await;
    have(&n1, &fresh)
        .await
        .expect("a grant of the key that replaced them");
    let audit = std::fs::read_to_string(m.data_dir.join("audit.log")).unwrap();
    assert!(audit.contains("grant-keys.rotate"), "rotations are audited");

    // The ring is kept: after a restart the same key signs.
    let before = keys(&mut c, "list", 0, false).await;
    m.kill9();
    m.restart().await;
    let mut c = m.client(Some("admin")).await;
    let after = keys(&mut c, "list", 0, false).await;
    assert_eq!(
        before.iter().map(|k| k.public_key.clone()).collect::<Vec<_>>(),
        after.iter().map(|k| k.public_key.clone()).collect::<Vec<_>>()
    );
    have(&n1, &grant(&mut c, "*", "read", "").await)
        .await
        .expect("a grant after the restart");
}
