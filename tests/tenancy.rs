//! Teams sharing one cluster, end to end: tokens narrowed to datasets by `[[token.scope]]`
//! against a real metadata service and real nodes. Team A's tokens (an admin and a reader,
//! both scoped to `a-*`) must not reach team B's dataset through gRPC, the HTTP API, the
//! Kubernetes extender, the CLI, a mount or a node — and every answer about B's dataset
//! must be the answer about a dataset that does not exist.

use locus_testkit as support;

use std::time::Duration;

use locus_proto::bulk::Pool;
use locus_proto::{nodepb, pb, BlobHash};
use support::*;

const TEAM_A_ADMIN: &str = "team-a-admin-secret-0123456789";
const TEAM_A_JOB: &str = "team-a-reader-secret-0123456789";

fn opts() -> MetadataOpts {
    MetadataOpts {
        tokens: tokens(),
        more_tokens: format!(
            "[[token]]\nname = \"team-a\"\nrole = \"admin\"\ntoken = \"{TEAM_A_ADMIN}\"\n\
             [[token.scope]]\ndatasets = [\"a-*\"]\n\
             [[token]]\nname = \"team-a-job\"\nrole = \"reader\"\ntoken = \"{TEAM_A_JOB}\"\n\
             [[token.scope]]\ndatasets = [\"a-*\"]\nactions = [\"read\"]\n"
        ),
        ..Default::default()
    }
}

/// Two nodes; team B's dataset imported by the cluster's admin, team A's by team A's own
/// scoped admin token (which shows a scoped import works end to end).
async fn two_teams(h: &Harness) -> (Metadata, Vec<Node>) {
    two_teams_with(h, NodeOpts::host).await
}

/// `two_teams` with the nodes' options given.
async fn two_teams_with(h: &Harness, node: impl Fn(usize) -> NodeOpts) -> (Metadata, Vec<Node>) {
    two_teams_in(h, opts(), node).await
}

/// `two_teams_with` on a metadata service started with `o`.
async fn two_teams_in(
    h: &Harness,
    o: MetadataOpts,
    node: impl Fn(usize) -> NodeOpts,
) -> (Metadata, Vec<Node>) {
    let (m, nodes) = cluster_with(h, o, 2, node).await;
    for (name, seed) in [("b-secret", 7u64), ("a-images", 8)] {
        let src = h.path(name);
        std::fs::create_dir_all(&src).unwrap();
        for i in 0..6 {
            std::fs::write(
                src.join(format!("f{i}.bin")),
                pseudo_random(seed * 100 + i, 200_000),
            )
            .unwrap();
        }
        let args = [
            "dataset",
            "import",
            name,
            src.to_str().unwrap(),
            "--replicas",
            "2",
            "--json",
        ];
        let o = if name.starts_with("b-") {
            m.cli(&args)
        } else {
            m.cli_as(TEAM_A_ADMIN, &args)
        };
        assert!(o.status.success(), "import {name}: {}", stderr(&o));
    }
    (m, nodes)
}

/// The manifest entry of `f0.bin` in `dataset@1`, as the cluster's admin reads it.
async fn f0(m: &Metadata, dataset: &str) -> pb::Entry {
    f_entry(m, dataset, 0).await
}

/// The manifest entry of `f{i}.bin` in `dataset@1`, as the cluster's admin reads it.
async fn f_entry(m: &Metadata, dataset: &str, i: usize) -> pb::Entry {
    m.client(Some("admin"))
        .await
        .list_entries(pb::ListEntriesRequest {
            r#ref: vref(dataset, 1),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .find(|e| e.path == format!("f{i}.bin"))
        .unwrap_or_else(|| panic!("f{i}.bin"))
}

/// The blob of `f0.bin` in `dataset@1`.
async fn f0_blob(m: &Metadata, dataset: &str) -> BlobHash {
    f_blob(m, dataset, 0).await
}

/// A refusal's code and message with the dataset's name replaced, to compare the answer
/// about B's dataset with the answer about one that does not exist.
fn shape<T: std::fmt::Debug>(r: Result<T, tonic::Status>, name: &str) -> (tonic::Code, String) {
    let e = r.expect_err("must be refused");
    (e.code(), e.message().replace(name, "NAME"))
}

fn vref(d: &str, v: u64) -> Option<pb::VersionRef> {
    Some(pb::VersionRef {
        dataset: d.into(),
        version: v,
    })
}

/// Every dataset-revealing call of the Metadata API, as team A's token, for dataset `d`.
async fn probes(
    c: &mut locus_proto::client::MetadataClient,
    d: &str,
) -> Vec<(&'static str, (tonic::Code, String))> {
    let mut out = Vec::new();
    out.push((
        "GetDataset",
        shape(c.get_dataset(pb::GetDatasetRequest { name: d.into() }).await, d),
    ));
    out.push((
        "GetVersion",
        shape(
            c.get_version(pb::GetVersionRequest { r#ref: vref(d, 1) }).await,
            d,
        ),
    ));
    out.push((
        "ListEntries",
        shape(
            c.list_entries(pb::ListEntriesRequest {
                r#ref: vref(d, 1),
                ..Default::default()
            })
            .await,
            d,
        ),
    ));
    out.push((
        "ListShards",
        shape(
            c.list_shards(pb::ListShardsRequest {
                r#ref: vref(d, 1),
                ..Default::default()
            })
            .await,
            d,
        ),
    ));
    out.push((
        "Locality",
        shape(
            c.locality(pb::LocalityRequest {
                refs: vec![vref(d, 0).unwrap()],
                ..Default::default()
            })
            .await,
            d,
        ),
    ));
    out.push((
        "Assign",
        shape(
            c.assign(pb::AssignRequest {
                r#ref: vref(d, 1),
                rank_nodes: vec!["n1".into()],
                ..Default::default()
            })
            .await,
            d,
        ),
    ));
    out.push((
        "IssueGrant",
        shape(
            c.issue_grant(pb::IssueGrantRequest {
                node: "*".into(),
                operation: "read".into(),
                target: format!("{d}@1"),
                ttl_ms: 0,
            })
            .await,
            d,
        ),
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_token_cannot_reach_another_teams_dataset_and_is_answered_as_if_it_did_not_exist() {
    let h = Harness::new("tenancy-scope");
    let (m, _nodes) = two_teams(&h).await;
    let mut job = m.client_as(TEAM_A_JOB).await;
    let mut team_admin = m.client_as(TEAM_A_ADMIN).await;
    let mut ops = m.client(Some("admin")).await;

    // Listing: its own dataset only.
    let names = |l: pb::ListDatasetsResponse| l.datasets.into_iter().map(|d| d.name).collect::<Vec<_>>();
    let seen = names(
        job.list_datasets(pb::ListDatasetsRequest {})
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(seen, vec!["a-images".to_string()]);
    let all = names(
        ops.list_datasets(pb::ListDatasetsRequest {})
            .await
            .unwrap()
            .into_inner(),
    );
    assert!(
        all.contains(&"b-secret".to_string()) && all.contains(&"a-images".to_string()),
        "{all:?}"
    );

    // Every call about B's dataset answers as about a dataset that does not exist, for
    // both of team A's tokens; and the same as the cluster's admin is told of an absent one.
    for c in [&mut job, &mut team_admin] {
        let secret = probes(c, "b-secret").await;
        let absent = probes(c, "b-absent").await;
        assert_eq!(secret, absent);
        for (call, (code, msg)) in &secret {
            assert_eq!(*code, tonic::Code::NotFound, "{call}: {msg}");
            assert!(msg.contains("no dataset named NAME"), "{call}: {msg}");
        }
    }
    let absent_to_ops = shape(
        ops.get_dataset(pb::GetDatasetRequest {
            name: "b-absent".into(),
        })
        .await,
        "b-absent",
    );
    assert_eq!(probes(&mut job, "b-secret").await[0].1, absent_to_ops);
    // Its own dataset answers.
    job.get_version(pb::GetVersionRequest {
        r#ref: vref("a-images", 1),
    })
    .await
    .expect("team A reads its own dataset");

    // Team A's admin: no delete, warm or import of B's dataset, answered as absent, and
    // B's dataset is still there afterwards.
    for d in ["b-secret", "b-absent"] {
        let del = team_admin
            .delete_dataset(pb::DeleteDatasetRequest {
                name: d.into(),
                force: true,
            })
            .await;
        assert_eq!(
            shape(del, d),
            (tonic::Code::NotFound, "no dataset named NAME".into())
        );
        let warm = team_admin
            .warm(pb::WarmRequest {
                r#ref: vref(d, 1),
                ..Default::default()
            })
            .await
            .map(|_| ());
        assert_eq!(
            shape(warm, d),
            (tonic::Code::NotFound, "no dataset named NAME".into())
        );
    }
    let src = h.path("a-images");
    // Its own dataset again: a second version of the same files imports. (A scoped
    // importer's import grant shows it no blob as present, so it sends every byte: dedup
    // would tell it what content other teams hold.)
    let o = m.cli_as(
        TEAM_A_ADMIN,
        &["dataset", "import", "a-images", src.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli_as(
        TEAM_A_ADMIN,
        &["dataset", "import", "b-secret", src.to_str().unwrap()],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no dataset named b-secret"), "{}", stderr(&o));
    let b = ops
        .get_dataset(pb::GetDatasetRequest {
            name: "b-secret".into(),
        })
        .await
        .expect("B's dataset survives team A's attempts")
        .into_inner();
    assert_eq!(b.version_count, 1);

    // Cluster-wide calls are for unscoped admins: refused plainly.
    let drain = team_admin
        .drain_node(pb::DrainNodeRequest {
            id: "n1".into(),
            drain: true,
        })
        .await;
    let e = drain.expect_err("a scoped admin drains no node");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("narrowed to datasets"), "{e:?}");
    let backup = m.cli_as(
        TEAM_A_ADMIN,
        &[
            "backup",
            "run",
            "--to",
            &format!("file://{}", h.path("bk").display()),
        ],
    );
    assert!(
        !backup.status.success(),
        "a scoped admin backs up the whole cluster"
    );
    assert!(
        stderr(&backup).contains("narrowed to datasets"),
        "{}",
        stderr(&backup)
    );
    let keys = team_admin
        .grant_keys(pb::GrantKeysRequest {
            op: "rotate".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(keys.unwrap_err().code(), tonic::Code::PermissionDenied);

    // The HTTP API answers as for an absent dataset too.
    let bearer = format!("Bearer {TEAM_A_JOB}");
    let post = |path: &'static str, body: String| {
        let (addr, bearer) = (m.http, bearer.clone());
        async move {
            http_request(
                addr,
                "POST",
                path,
                &[("Content-Type", "application/json"), ("Authorization", &bearer)],
                &body,
            )
            .await
        }
    };
    for path in ["/v1/locality", "/v1/assign"] {
        let body = |d: &str| match path {
            "/v1/locality" => format!(r#"{{"datasets":["{d}"]}}"#),
            _ => format!(r#"{{"dataset":"{d}@1","rank_nodes":["n1"]}}"#),
        };
        let (code_s, text_s) = post(path, body("b-secret")).await;
        let (code_a, text_a) = post(path, body("b-absent")).await;
        assert_eq!(code_s, 404, "{path}: {text_s}");
        assert_eq!(
            (code_s, text_s.replace("b-secret", "NAME")),
            (code_a, text_a.replace("b-absent", "NAME")),
            "{path}"
        );
        let (code_own, text_own) = post(path, body("a-images")).await;
        assert_eq!(code_own, 200, "{path}: {text_own}");
    }
    // The overview page shows every dataset: not for a scoped token.
    let (code, _) = http_request(m.http, "GET", "/", &[("Authorization", &bearer)], "").await;
    assert_eq!(code, 403);

    // The scheduler extender with team A's token: B's dataset scores like an absent one
    // (no preference), A's own is scored.
    let prioritize = |d: &str| {
        let body = format!(
            r#"{{"Pod":{{"metadata":{{"name":"p","namespace":"ml","annotations":{{"locus.io/dataset":"{d}@1"}}}},"spec":{{}}}},"Nodes":null,"NodeNames":["n1","n2","gpu99"]}}"#
        );
        post("/k8s/prioritize", body)
    };
    let (c1, s1) = prioritize("b-secret").await;
    let (c2, s2) = prioritize("b-absent").await;
    assert_eq!((c1, &s1), (c2, &s2));
    let scores: serde_json::Value = serde_json::from_str(&s1).unwrap();
    assert!(
        scores.as_array().unwrap().iter().all(|s| s["Score"] == 0),
        "{scores}"
    );
    let (_, own) = prioritize("a-images").await;
    let own: serde_json::Value = serde_json::from_str(&own).unwrap();
    assert!(
        own.as_array()
            .unwrap()
            .iter()
            .any(|s| s["Score"].as_i64() > Some(0)),
        "team A's own dataset is scored: {own}"
    );

    // The CLI: `dataset list` lists its own, `show` and `ls` of B's dataset say what they
    // say of an absent one.
    let ls = m.cli_as(TEAM_A_JOB, &["dataset", "list", "--json"]);
    assert!(ls.status.success(), "{}", stderr(&ls));
    let text = String::from_utf8_lossy(&ls.stdout);
    assert!(text.contains("a-images") && !text.contains("b-secret"), "{text}");
    for cmd in ["show", "ls"] {
        let s = m.cli_as(TEAM_A_JOB, &["dataset", cmd, "b-secret@1"]);
        let a = m.cli_as(TEAM_A_JOB, &["dataset", cmd, "b-absent@1"]);
        assert!(!s.status.success());
        assert!(stderr(&s).contains("no dataset named b-secret"), "{}", stderr(&s));
        assert_eq!(
            stderr(&s).replace("b-secret", "NAME"),
            stderr(&a).replace("b-absent", "NAME"),
            "dataset {cmd}"
        );
    }

    // Every scoped refusal is in the audit log, with who asked.
    let audit = std::fs::read_to_string(m.data_dir.join("audit.log")).unwrap();
    let scoped: Vec<&str> = audit
        .lines()
        .filter(|l| l.contains("\"reason\":\"scope\""))
        .collect();
    assert!(
        scoped
            .iter()
            .any(|l| l.contains("\"who\":\"team-a-job\"") && l.contains("b-secret")),
        "{audit}"
    );
    assert!(
        scoped
            .iter()
            .any(|l| l.contains("\"who\":\"team-a\"") && l.contains("\"action\":\"delete\"")),
        "{audit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_read_grant_opens_only_its_versions_blobs_on_every_node_over_grpc_and_the_bulk_path() {
    let h = Harness::new("tenancy-grant");
    let (m, nodes) = two_teams(&h).await;
    let mut job = m.client_as(TEAM_A_JOB).await;
    let mut ops = m.client(Some("admin")).await;
    let (theirs, ours) = (f0_blob(&m, "b-secret").await, f0_blob(&m, "a-images").await);
    let our_bytes = pseudo_random(800, 200_000);
    assert_eq!(BlobHash(*blake3::hash(&our_bytes).as_bytes()), ours);

    // A scoped token's read grant names its version; it gets no grant for every blob.
    let ask = |target: &str| pb::IssueGrantRequest {
        node: "*".into(),
        operation: "read".into(),
        target: target.into(),
        ttl_ms: 0,
    };
    let e = job.issue_grant(ask("")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("DATASET@N"), "{e:?}");
    let e = job.issue_grant(ask("b-secret@1")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let narrowed = job
        .issue_grant(ask("a-images@1"))
        .await
        .unwrap()
        .into_inner()
        .grant;
    let everything = ops.issue_grant(ask("")).await.unwrap().into_inner().grant;
    // Where a blob is: told for A's, not for B's (answered as a blob no version holds).
    let located = job
        .locate_blobs(pb::LocateBlobsRequest {
            hashes: vec![theirs.0.to_vec(), ours.0.to_vec()],
        })
        .await
        .unwrap()
        .into_inner()
        .blobs;
    assert!(
        !located[0].known && located[0].nodes.is_empty() && located[0].size == 0,
        "{located:?}"
    );
    assert!(located[1].known && located[1].nodes.len() == 2, "{located:?}");

    for n in &nodes {
        // gRPC ReadBlob: B's blob, which the node holds (the unscoped grant reads it), is
        // answered as a blob the node does not have.
        let read = |grant: &str, h: BlobHash| {
            let grant = grant.to_string();
            async move {
                use futures_util::StreamExt;
                let mut s = n
                    .client_with(Some(&grant))
                    .await
                    .read_blob(nodepb::ReadBlobRequest {
                        hash: h.0.to_vec(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                let mut got = Vec::new();
                while let Some(d) = s.next().await {
                    got.extend_from_slice(&d?.data);
                }
                Ok::<_, tonic::Status>(got)
            }
        };
        let b = read(&everything, theirs).await.expect("the node holds B's blob");
        assert_eq!(b.len(), 200_000);
        let e = read(&narrowed, theirs).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        assert_eq!(e.message(), format!("blob {theirs} is not on this node"));
        assert_eq!(read(&narrowed, ours).await.unwrap(), our_bytes);
        // HaveBlobs says nothing of B's blob either.
        let have = n
            .client_with(Some(&narrowed))
            .await
            .have_blobs(nodepb::HaveBlobsRequest {
                hashes: vec![theirs.0.to_vec(), ours.0.to_vec()],
                pin: false,
            })
            .await
            .unwrap()
            .into_inner()
            .present;
        assert_eq!(have, vec![false, true]);

        // The bulk path: the same.
        let pool = Pool::new();
        let addr = n.address();
        let idle = Duration::from_secs(10);
        let e = match pool.open(&addr, Some(&narrowed), &theirs, 0, 0, idle).await {
            Ok(_) => panic!("the bulk path served B's blob under A's grant"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("is not on this node"), "{e}");
        let got = pool
            .open(&addr, Some(&narrowed), &ours, 0, 0, idle)
            .await
            .expect("A's own blob over the bulk path")
            .all()
            .await
            .unwrap();
        assert_eq!(&got[..], &our_bytes[..]);
    }

    // A mount with team A's reader token and no local node: its own dataset reads right
    // through narrowed grants; B's dataset does not mount.
    let mnt = m.mount_with_env("a", "a-images@1", None, &[], &[("LOCUS_TOKEN", TEAM_A_JOB)]);
    for i in 0..6u64 {
        let got = std::fs::read(mnt.path.join(format!("f{i}.bin"))).unwrap();
        assert!(
            got == pseudo_random(800 + i, 200_000),
            "f{i}.bin through the mount"
        );
    }
    // The operator can tell who mounted it, and from where.
    let data_dir = m.data_dir.display().to_string();
    let audit = |json: bool| {
        let mut args = vec![
            "metadata",
            "audit",
            "--data-dir",
            &data_dir,
            "--dataset",
            "a-images",
            "--action",
            "mount",
        ];
        if json {
            args.push("--json");
        }
        m.cli(&args)
    };
    let line = wait_until("the mount's audit line", Duration::from_secs(10), || {
        let o = audit(true);
        async move {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.contains("mount.start"))
                .map(str::to_string)
        }
    })
    .await;
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["who"], "team-a-job");
    assert_eq!(v["target"], "a-images@1");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .ends_with(&format!(":{}", mnt.path.display())),
        "{v}"
    );
    let table = String::from_utf8_lossy(&audit(false).stdout).to_string();
    assert!(
        table.contains("a-images@1: mounted 1 time(s) by team-a-job"),
        "{table}"
    );
    drop(mnt);
    // And when it ended.
    let end = wait_until(
        "the mount's end in the audit log",
        Duration::from_secs(10),
        || {
            let o = m.cli(&[
                "metadata",
                "audit",
                "--data-dir",
                &data_dir,
                "--action",
                "mount.end",
                "--json",
            ]);
            async move {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .find(|l| l.contains("a-images@1"))
                    .map(str::to_string)
            }
        },
    )
    .await;
    assert!(end.contains("\"who\":\"team-a-job\""), "{end}");
    std::fs::create_dir_all(h.path("b-mnt")).unwrap();
    let out = m
        .cli_command(&["mount", "b-secret@1", h.path("b-mnt").to_str().unwrap()], &[])
        .env("LOCUS_TOKEN", TEAM_A_JOB)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no dataset named b-secret"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_or_restore_over_its_teams_pinned_quota_is_refused_before_any_byte_reaches_a_node() {
    let h = Harness::new("tenancy-quota");
    let config = h.path("locus.toml");
    std::fs::write(
        &config,
        "[[metadata_server.team]]\nname = \"team-a\"\ndatasets = [\"a-*\"]\npinned = \"1MiB\"\n",
    )
    .unwrap();
    let mut o = opts();
    o.extra = vec!["--config".into(), config.display().to_string()];
    let (mut m, nodes) = cluster_with(&h, o, 2, NodeOpts::host).await;
    // Three files of 100,000 bytes a dataset.
    let tree = |name: &str, seed: u64| {
        let src = h.path(name);
        std::fs::create_dir_all(&src).unwrap();
        let mut hashes = Vec::new();
        for i in 0..3 {
            let data = pseudo_random(seed * 10 + i, 100_000);
            hashes.push(BlobHash(*blake3::hash(&data).as_bytes()));
            std::fs::write(src.join(format!("f{i}.bin")), data).unwrap();
        }
        (src, hashes)
    };
    let imp = |m: &Metadata, name: &str, src: &std::path::Path, replicas: &str| {
        m.cli(&[
            "dataset",
            "import",
            name,
            src.to_str().unwrap(),
            "--replicas",
            replicas,
        ])
    };
    // 300,000 bytes × 2 replicas = 600,000 of 1,048,576: fits.
    let (one, _) = tree("a-one", 1);
    let o = imp(&m, "a-one", &one, "2");
    assert!(o.status.success(), "{}", stderr(&o));

    // Another 600,000 would not: refused with the figures, and no node got a byte of it.
    let (two, two_hashes) = tree("a-two", 2);
    let o = imp(&m, "a-two", &two, "2");
    assert!(!o.status.success(), "an import over the quota was accepted");
    let err = stderr(&o);
    assert!(err.contains("team team-a's quota would be exceeded"), "{err}");
    assert!(err.contains("585.9 KiB") && err.contains("1.0 MiB"), "{err}");
    let grant = m.grant("read", "*").await;
    for n in &nodes {
        let present = n
            .client_with(Some(&grant))
            .await
            .have_blobs(nodepb::HaveBlobsRequest {
                hashes: two_hashes.iter().map(|h| h.0.to_vec()).collect(),
                pin: false,
            })
            .await
            .unwrap()
            .into_inner()
            .present;
        assert_eq!(present, vec![false; 3], "a refused import left blobs on {}", n.id);
    }
    let mut ops = m.client(Some("admin")).await;
    let e = ops
        .get_dataset(pb::GetDatasetRequest { name: "a-two".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    // Nor an import session: the refused import aborted its own.
    let info = ops
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.open_sessions, 0);
    // An import placed but not yet committed holds its room: another import of the
    // team that would fit only without it is refused until it ends.
    let session = ops
        .begin_version(pb::BeginVersionRequest {
            dataset: "a-three".into(),
            replication: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session_id;
    ops.place_shards(pb::PlaceShardsRequest {
        shards: vec![pb::ShardSize {
            id: 0,
            bytes: 200_000,
            prefer: vec![],
        }],
        replication: 1,
        session_id: session,
    })
    .await
    .expect("200,000 more fits");
    let o = imp(&m, "a-two", &two, "1");
    assert!(!o.status.success(), "the open import's room was taken");
    assert!(stderr(&o).contains("781.2 KiB of the 1.0 MiB"), "{}", stderr(&o));
    // The hold is in the catalogue, not the serving process's memory: a restarted
    // service (or a new leader) still counts it.
    m.terminate().await;
    m.restart().await;
    let mut ops = m.client(Some("admin")).await;
    // Placement waits for the nodes' first heartbeats to the restarted service.
    for n in &nodes {
        m.wait_node_up(&n.id, "a node heard by the restarted service")
            .await;
    }
    let o = imp(&m, "a-two", &two, "1");
    assert!(!o.status.success(), "a restart forgot the open import's room");
    assert!(stderr(&o).contains("781.2 KiB of the 1.0 MiB"), "{}", stderr(&o));
    ops.abort_version(pb::AbortVersionRequest { session_id: session })
        .await
        .unwrap();
    // With one replica it fits (900,000), as the message suggests; another team's
    // dataset is not counted against team A.
    let o = imp(&m, "a-two", &two, "1");
    assert!(o.status.success(), "{}", stderr(&o));
    // A warm-up adds pinned replicas: a copy of a-two onto its second node (300,000
    // more) would not fit, and is refused before it starts.
    let o = m.cli(&["warm", "a-two@1", "--nodes", "n1,n2"]);
    assert!(!o.status.success(), "a warm-up over the quota was accepted");
    assert!(
        stderr(&o).contains("team team-a's quota would be exceeded"),
        "{}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("292.969 KiB") || stderr(&o).contains("293.0 KiB"),
        "{}",
        stderr(&o)
    );
    let (other, _) = tree("b-big", 3);
    let o = imp(&m, "b-big", &other, "2");
    assert!(o.status.success(), "{}", stderr(&o));

    // A restore of one of the team's versions into the running cluster is an import like
    // any other: 600,000 more would take the team over, so it is refused at placement and
    // leaves neither a dataset nor a session.
    let url = format!("file://{}", h.path("backup").display());
    let o = m.cli(&["backup", "run", "--to", &url, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "a-one@1",
        "--as",
        "a-restored",
    ]);
    assert!(!o.status.success(), "a restore over the quota was accepted");
    assert!(
        stderr(&o).contains("team team-a's quota would be exceeded"),
        "{}",
        stderr(&o)
    );
    let e = ops
        .get_dataset(pb::GetDatasetRequest {
            name: "a-restored".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let info = ops
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.open_sessions, 0, "the refused restore left its session open");

    // Usage is shown to the operator (status, metrics), not to a scoped token.
    let st = m.cli(&["status", "--json"]);
    assert!(st.status.success(), "{}", stderr(&st));
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(v["teams"][0]["name"], "team-a");
    assert_eq!(v["teams"][0]["pinned_bytes"], 900_000);
    assert_eq!(v["teams"][0]["pinned_limit_bytes"], 1 << 20);
    let (_, metrics) = http_request(m.http, "GET", "/metrics", &[], "").await;
    assert!(
        metrics.contains("locus_metadata_team_pinned_bytes{team=\"team-a\"} 900000"),
        "{metrics}"
    );
    let st = m.cli_as(TEAM_A_JOB, &["status", "--json"]);
    assert!(st.status.success(), "{}", stderr(&st));
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(v["teams"], serde_json::json!([]));
    assert_eq!(v["metadata"]["caller"]["scope"], "a-*:read");
    assert_eq!(
        v["datasets"]["count"], 2,
        "team A sees its two datasets only: {v}"
    );
}

fn publish_request(
    volume: &str,
    target: &std::path::Path,
    dataset: &str,
    token: Option<&str>,
) -> locus_proto::csi::NodePublishVolumeRequest {
    csi_publish_request(volume, target, Some(dataset), token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csi_volume_mounts_only_what_the_pods_own_token_may_read() {
    let h = Harness::new("tenancy-csi");
    let m = h.start_metadata("meta", opts()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    for (name, seed) in [("b-secret", 7u64), ("a-images", 8)] {
        let src = h.path(name);
        make_tree(&src, 5 + seed as usize);
        let o = m.cli(&[
            "dataset",
            "import",
            name,
            src.to_str().unwrap(),
            "--replicas",
            "1",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // The driver's own token reads every dataset (an unscoped reader's); it is told to
    // mount only volumes that bring the pod's token.
    let _plugin = MountingProcess {
        child: spawn_csi_driver_with(&h, &m, &n, "node", &["--require-pod-token"]),
        root: h.path(""),
    };
    let sock = h.path("csi/csi.sock");
    wait_for_socket(&sock).await;
    let mut node = locus_proto::csi::node_client::NodeClient::new(locus_proto::client::unix_channel(&sock));
    let target = |pod: &str| {
        h.path("kubelet")
            .join(format!("pods/{pod}/volumes/kubernetes.io~csi/data/mount"))
    };

    // Team B's dataset with team A's token: refused as for a dataset that does not exist.
    let e = node
        .node_publish_volume(publish_request(
            "v1",
            &target("p1"),
            "b-secret@1",
            Some(TEAM_A_JOB),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("no dataset named b-secret"), "{e:?}");
    let empty = |p: std::path::PathBuf| std::fs::read_dir(p).map_or(true, |mut d| d.next().is_none());
    assert!(empty(target("p1")), "nothing was mounted for the refused volume");
    // No token at all: refused, saying what to give.
    let e = node
        .node_publish_volume(publish_request("v2", &target("p2"), "b-secret@1", None))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("nodePublishSecretRef"), "{e:?}");
    // A token the service does not know: refused by the service.
    let e = node
        .node_publish_volume(publish_request(
            "v3",
            &target("p3"),
            "a-images@1",
            Some("not-a-token-of-this-cluster-01234"),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    // Team A's own dataset with team A's token: mounted, and it reads.
    node.node_publish_volume(publish_request(
        "v4",
        &target("p4"),
        "a-images@1",
        Some(TEAM_A_JOB),
    ))
    .await
    .unwrap_or_else(|e| {
        panic!(
            "publish: {e:?}; log: {}",
            std::fs::read_to_string(h.path("csi.log")).unwrap_or_default()
        )
    });
    assert_same_tree(&h.path("a-images"), &target("p4"));
    node.node_unpublish_volume(locus_proto::csi::NodeUnpublishVolumeRequest {
        volume_id: "v4".into(),
        target_path: target("p4").display().to_string(),
    })
    .await
    .unwrap();
}

/// A client of the node's open socket in Python (its own implementation of the wire: a
/// frame is a u32 length and a protobuf message; the descriptor comes by SCM_RIGHTS), run
/// as another user by the test below. It reports, as JSON, whether it could reach the
/// node's local socket and a blob file in the data dir, and what the open socket answered.
const OPEN_SOCKET_CLIENT: &str = r#"
import json, os, socket, struct, sys

def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])

def field(no, payload):
    return varint(no << 3 | 2) + varint(len(payload)) + payload

def parse(body):
    fields, i = {}, 0
    while i < len(body):
        key, shift = 0, 0
        while True:
            b = body[i]; i += 1
            key |= (b & 0x7F) << shift; shift += 7
            if b < 0x80: break
        no, wire = key >> 3, key & 7
        if wire == 0:
            v, shift = 0, 0
            while True:
                b = body[i]; i += 1
                v |= (b & 0x7F) << shift; shift += 7
                if b < 0x80: break
            fields[no] = v
        else:
            n, shift = 0, 0
            while True:
                b = body[i]; i += 1
                n |= (b & 0x7F) << shift; shift += 7
                if b < 0x80: break
            fields[no] = body[i:i + n]; i += n
    return fields

open_sock, main_sock, grant, blob_file = sys.argv[1:5]
out = {"uid": os.getuid()}
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect(main_sock)
    out["main"] = "connected"
except OSError as e:
    out["main"] = type(e).__name__
try:
    open(blob_file, "rb").read(1)
    out["file"] = "read"
except OSError as e:
    out["file"] = type(e).__name__
s = socket.socket(socket.AF_UNIX)
s.connect(open_sock)
answers = []
for h in sys.argv[5:]:
    for g in (grant, ""):
        req = field(1, bytes.fromhex(h)) + field(4, g.encode())
        s.sendall(struct.pack("<I", len(req)) + req)
        msg, fds, _, _ = socket.recv_fds(s, 65536, 1)
        n = struct.unpack("<I", msg[:4])[0]
        body = msg[4:]
        while len(body) < n:
            body += s.recv(n - len(body))
        f = parse(body)
        a = {"hash": h, "grant": bool(g), "code": f.get(1, 0), "message": f.get(2, b"").decode(), "fd": bool(fds)}
        if fds:
            data = os.pread(fds[0], 1 << 20, f.get(3, 0))
            a["len"], a["head"] = len(data), data[:32].hex()
            os.close(fds[0])
        answers.append(a)
out["answers"] = answers
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_user_outside_the_socket_group_gets_only_its_grants_blobs_as_descriptors() {
    let h = Harness::new("tenancy-open-socket");
    let (m, nodes) = two_teams(&h).await;
    let n = &nodes[0];
    let (ours, theirs) = (f0_blob(&m, "a-images").await, f0_blob(&m, "b-secret").await);
    let mut job = m.client_as(TEAM_A_JOB).await;
    let grant = job
        .issue_grant(pb::IssueGrantRequest {
            node: "*".into(),
            operation: "read".into(),
            target: "a-images@1".into(),
            ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .grant;
    // Where the node keeps our blob (asked as root, whom the local socket admits).
    let file = locus_proto::client::connect_local_node(&n.socket)
        .local_paths(nodepb::LocalPathsRequest {
            hashes: vec![ours.0.to_vec()],
            packed_ok: true,
        })
        .await
        .unwrap()
        .into_inner()
        .paths[0]
        .path
        .clone();
    assert!(!file.is_empty());
    let v = open_socket_client_as_nobody(&h, n, &grant, &file, &[ours, theirs]).await;
    assert_eq!(v["uid"], 65534);
    // Neither the local socket nor the data dir admits this user.
    assert_eq!(v["main"], "PermissionError", "{v}");
    assert_eq!(v["file"], "PermissionError", "{v}");
    let a = v["answers"].as_array().unwrap();
    // Our blob, under our grant: a descriptor of exactly its bytes.
    assert_eq!(
        (&a[0]["code"], &a[0]["fd"]),
        (&serde_json::json!(0), &serde_json::json!(true)),
        "{v}"
    );
    assert_eq!(a[0]["len"], 200_000);
    let want: String = pseudo_random(800, 32)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(a[0]["head"], want.as_str());
    // Without a grant: refused, no descriptor.
    assert_eq!(a[1]["code"], tonic::Code::Unauthenticated as i32, "{v}");
    assert_eq!(a[1]["fd"], false);
    // Another team's blob under our grant: as if the node did not have it.
    assert_eq!(a[2]["code"], tonic::Code::NotFound as i32, "{v}");
    assert_eq!(a[2]["message"], format!("blob {theirs} is not on this node"));
    assert_eq!(a[2]["fd"], false);
    assert_eq!(counter(n, "locus_node_opened_blobs_total").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_through_the_open_socket_reads_its_files_from_descriptors_the_node_handed_out() {
    let h = Harness::new("tenancy-open-mount");
    let (m, nodes) = two_teams(&h).await;
    let n = &nodes[0];
    let mnt = m.mount_with_env(
        "a",
        "a-images@1",
        Some(n),
        &["--opens", "mount"],
        &[("LOCUS_TOKEN", TEAM_A_JOB), ("LOCUS_NODE_SOCKET_MODE", "open")],
    );
    for i in 0..6u64 {
        let got = std::fs::read(mnt.path.join(format!("f{i}.bin"))).unwrap();
        assert!(
            got == pseudo_random(800 + i, 200_000),
            "f{i}.bin through the mount"
        );
    }
    // Every file came from a descriptor the node handed out, none from replicas (which
    // served only the namespace, a little over a kilobyte).
    // (At least one each: a file asked for alone may also come in a window opened ahead.)
    assert!(counter(n, "locus_node_opened_blobs_total").await >= 6);
    let mut served = 0;
    for n in &nodes {
        served += counter(n, "locus_node_read_bytes_total").await;
    }
    assert!(served < 200_000, "{served} bytes were read from replicas");
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(log.contains("open socket"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_mount_leases_is_counted_in_the_audit_log_not_written_line_by_line() {
    let h = Harness::new("tenancy-audit-flood");
    let (m, _nodes) = two_teams(&h).await;
    const FLOOD: usize = 1500;
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16 {
        let mut c = m.client_as(TEAM_A_JOB).await;
        tasks.spawn(async move {
            for i in (t..FLOOD).step_by(16) {
                c.mount_lease(pb::MountLeaseRequest {
                    r#ref: vref("a-images", 1),
                    host: "h".into(),
                    mountpoint: format!("/mnt/{i}"),
                    ended: false,
                })
                .await
                .unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // The next line after the flood's second carries the count of those left out.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    m.client_as(TEAM_A_JOB)
        .await
        .mount_lease(pb::MountLeaseRequest {
            r#ref: vref("a-images", 1),
            host: "h".into(),
            mountpoint: "/mnt/last".into(),
            ended: false,
        })
        .await
        .unwrap();
    let audit = std::fs::read_to_string(m.data_dir.join("audit.log")).unwrap();
    let written = audit.lines().filter(|l| l.contains("\"mount.start\"")).count();
    let counted: u64 = audit
        .lines()
        .filter(|l| l.contains("mount.not-written"))
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["count"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert_eq!(
        written as u64 + counted,
        FLOOD as u64 + 1,
        "every start written or counted"
    );
    assert!(
        counted > 0,
        "{written} of {FLOOD} starts written: the flood was not throttled"
    );
    assert!(
        audit.lines().any(|l| l.contains("/mnt/last")),
        "the line after the flood is written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_import_cannot_take_another_teams_blob_by_naming_its_hash() {
    let h = Harness::new("tenancy-steal");
    let (m, _nodes) = two_teams(&h).await;
    let theirs = f0(&m, "b-secret").await;
    // Team A's admin writes a manifest by hand that names B's blob, without its bytes.
    let mut team = m.client_as(TEAM_A_ADMIN).await;
    let session = team
        .begin_version(pb::BeginVersionRequest {
            dataset: "a-stolen".into(),
            replication: 1,
            tree_chunks: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session_id;
    team.put_entries(pb::PutEntriesRequest {
        session_id: session,
        page: 0,
        entries: vec![pb::Entry {
            path: "stolen.bin".into(),
            shard: 0,
            ..theirs.clone()
        }],
    })
    .await
    .unwrap();
    team.put_shards(pb::PutShardsRequest {
        session_id: session,
        page: 0,
        shards: vec![pb::Shard {
            id: 0,
            bytes: theirs.size,
            files: 1,
            replicas: vec!["n1".into()],
        }],
    })
    .await
    .unwrap();
    let e = team
        .commit_version(pb::CommitVersionRequest {
            session_id: session,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message()
            .contains("cannot take another team's bytes by their hash"),
        "{e:?}"
    );
    // No version of it exists, so no grant of team A's opens B's blob.
    let e = team
        .get_dataset(pb::GetDatasetRequest {
            name: "a-stolen".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_webhook_places_a_teams_pods_by_what_the_teams_token_may_read() {
    let h = Harness::new("tenancy-webhook");
    let (m, _nodes) = two_teams(&h).await;
    let tokens = h.path("namespace-tokens.toml");
    std::fs::write(&tokens, format!("[namespaces]\ntraining = \"{TEAM_A_JOB}\"\n")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let port = free_low_port();
    let log = std::fs::File::create(h.path("webhook.log")).unwrap();
    // The webhook's own token is an unscoped reader's: it could place any pod anywhere.
    let _hook = MountingProcess {
        child: std::process::Command::new(locus())
            .args([
                "webhook",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--namespace-tokens",
            ])
            .arg(&tokens)
            .env("LOCUS_METADATA", m.url())
            .env("LOCUS_TOKEN", m.token("reader").unwrap())
            .env_remove("LOCUS_CONFIG")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
        root: h.path(""),
    };
    wait_until("the webhook to listen", Duration::from_secs(20), || {
        let ok = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        async move { ok.then_some(()) }
    })
    .await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admit = |namespace: &'static str, dataset: &'static str| async move {
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer-0", "namespace": namespace,
                         "annotations": {"locus.io/dataset": format!("{dataset}@1")}},
            "spec": {"containers": [{"name": "t", "image": "pytorch"}]}
        });
        let review = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": namespace, "operation": "CREATE", "object": pod}
        });
        let (code, body) = http_request(
            addr,
            "POST",
            "/mutate",
            &[("Content-Type", "application/json")],
            &review.to_string(),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["response"]["allowed"], true);
        (
            v["response"]["patch"].is_string(),
            v["response"]["warnings"].to_string(),
        )
    };
    // Team A's namespace: its own dataset is placed; B's is answered as an absent one,
    // and nothing of where B's bytes are reaches the pod.
    let (placed, _) = admit("training", "a-images").await;
    assert!(placed, "team A's own dataset places its pod");
    let (placed, said) = admit("training", "b-secret").await;
    assert!(!placed, "a pod of team A was placed by team B's data");
    assert!(said.contains("no dataset named b-secret"), "{said}");
    let (_, absent) = admit("training", "b-absent").await;
    assert_eq!(
        said.replace("b-secret", "NAME"),
        absent.replace("b-absent", "NAME")
    );
    // A namespace without a team token is placed with the webhook's own.
    let (placed, said) = admit("research", "b-secret").await;
    assert!(placed, "{said}");
}

/// Runs the open socket's Python client as uid 65534 against node `n` with `grant`, for
/// `hashes`; its JSON report.
/// `file` is a path it tries to read directly (a blob file in the node's data dir).
async fn open_socket_client_as_nobody(
    h: &Harness,
    n: &Node,
    grant: &str,
    file: &str,
    hashes: &[BlobHash],
) -> serde_json::Value {
    let script = h.path("open_socket_client.py");
    std::fs::write(&script, OPEN_SOCKET_CLIENT).unwrap();
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "/usr/bin/python3",
    ])
    .arg(&script)
    .arg(locus_proto::open_socket::path_of(&n.socket))
    .arg(&n.socket)
    .arg(grant)
    .arg(file)
    .args(hashes.iter().map(|h| h.to_hex()));
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("setpriv and /usr/bin/python3"))
        .await
        .unwrap();
    assert!(out.status.success(), "the client failed: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_user_the_node_maps_to_team_a_is_handed_only_team_as_blobs_whatever_its_token() {
    let h = Harness::new("tenancy-socket-scope");
    let (m, nodes) = two_teams_with(&h, |i| {
        let mut o = NodeOpts::host(i);
        o.extra.push("--socket-scope".into());
        o.extra.push("65534=a-*".into());
        o
    })
    .await;
    let n = &nodes[0];
    let (ours, theirs) = (f0_blob(&m, "a-images").await, f0_blob(&m, "b-secret").await);
    // The user holds an unscoped reader's token: every grant it asks for is granted.
    let reader = m.client(Some("reader")).await;
    let grant = |target: &'static str| {
        let mut reader = reader.clone();
        async move {
            reader
                .issue_grant(pb::IssueGrantRequest {
                    node: "*".into(),
                    operation: "read".into(),
                    target: target.into(),
                    ttl_ms: 0,
                })
                .await
                .unwrap()
                .into_inner()
                .grant
        }
    };
    let for_a = grant("a-images@1").await;
    let for_b = grant("b-secret@1").await;
    let for_all = grant("").await;
    // Team A's version: handed out.
    let v = open_socket_client_as_nobody(&h, n, &for_a, "/nonexistent", &[ours]).await;
    assert_eq!(v["answers"][0]["code"], 0, "{v}");
    assert_eq!(v["answers"][0]["len"], 200_000);
    // Team B's version, under a grant the token was given: the node's table refuses it.
    let v = open_socket_client_as_nobody(&h, n, &for_b, "/nonexistent", &[theirs]).await;
    assert_eq!(
        v["answers"][0]["code"],
        tonic::Code::PermissionDenied as i32,
        "{v}"
    );
    let said = v["answers"][0]["message"].as_str().unwrap();
    assert!(said.contains("a-*") && said.contains("b-secret"), "{said}");
    assert_eq!(v["answers"][0]["fd"], false);
    // A grant for every blob: refused too (it names no version).
    let v = open_socket_client_as_nobody(&h, n, &for_all, "/nonexistent", &[ours]).await;
    assert_eq!(
        v["answers"][0]["code"],
        tonic::Code::PermissionDenied as i32,
        "{v}"
    );
    // B's blob under A's grant: as if the node did not have it.
    let v = open_socket_client_as_nobody(&h, n, &for_a, "/nonexistent", &[theirs]).await;
    assert_eq!(v["answers"][0]["code"], tonic::Code::NotFound as i32, "{v}");
    // Root (not in the table) with B's grant: handed out, as before.
    let file = tokio::task::spawn_blocking({
        let (sock, g) = (locus_proto::open_socket::path_of(&n.socket), for_b.clone());
        move || {
            let c = locus_proto::open_socket::connect(&sock, Duration::from_secs(10)).unwrap();
            locus_proto::open_socket::ask(
                &c,
                &nodepb::OpenBlobRequest {
                    hash: theirs.0.to_vec(),
                    grant: g,
                    ..Default::default()
                },
            )
            .unwrap()
        }
    })
    .await
    .unwrap();
    assert_eq!(file.0.code, 0, "{:?}", file.0);
    assert_eq!(file.1.len(), 1);
}

const TEAM_B_JOB: &str = "team-b-reader-secret-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_cached_bytes_within_its_share_survive_another_teams_reads_on_a_shared_host() {
    let h = Harness::new("tenancy-cache-share");
    let config = h.path("locus.toml");
    std::fs::write(
        &config,
        "[[metadata_server.team]]\nname = \"team-a\"\ndatasets = [\"a-*\"]\npinned = \"1GiB\"\ncache = \"50%\"\n\
         [[metadata_server.team]]\nname = \"team-b\"\ndatasets = [\"b-*\"]\npinned = \"1GiB\"\ncache = \"50%\"\n",
    )
    .unwrap();
    let mut o = opts();
    o.extra = vec!["--config".into(), config.display().to_string()];
    o.more_tokens.push_str(&format!(
        "[[token]]\nname = \"team-b-job\"\nrole = \"reader\"\ntoken = \"{TEAM_B_JOB}\"\n\
         [[token.scope]]\ndatasets = [\"b-*\"]\nactions = [\"read\"]\n"
    ));
    let (m, _replicas) = two_teams_in(&h, o, NodeOpts::host).await;
    // A shared GPU host that holds no replica: everything its readers get is cached, in
    // room for five of the 200,000-byte files.
    let shared = h
        .start_node(
            "n3",
            &m,
            NodeOpts {
                capacity: "1000000",
                ..NodeOpts::host(3)
            },
        )
        .await;
    let mount = |team: &str, dataset: &str, token: &str| {
        m.mount_with_env(
            team,
            dataset,
            Some(&shared),
            &["--opens", "mount"],
            &[("LOCUS_TOKEN", token), ("LOCUS_NODE_SOCKET_MODE", "open")],
        )
    };
    // Team B's job reads two files: 400,000 bytes cached for team B, within its half.
    let b = mount("b", "b-secret@1", TEAM_B_JOB);
    for i in 0..2u64 {
        let got = std::fs::read(b.path.join(format!("f{i}.bin"))).unwrap();
        assert!(got == pseudo_random(700 + i, 200_000), "b f{i}.bin");
    }
    let b_cached = r#"locus_node_team_cached_bytes{team="team-b"}"#;
    assert_eq!(counter(&shared, b_cached).await, 400_000);
    // Team A's job then reads all six of its files, more than the node holds: each one
    // correct, room made from team A's own older files, none of team B's.
    let a = mount("a", "a-images@1", TEAM_A_JOB);
    for i in 0..6u64 {
        let got = std::fs::read(a.path.join(format!("f{i}.bin"))).unwrap();
        assert!(got == pseudo_random(800 + i, 200_000), "a f{i}.bin");
    }
    assert_eq!(
        counter(&shared, b_cached).await,
        400_000,
        "team B's cached bytes survived team A's reads"
    );
    let a_cached = counter(&shared, r#"locus_node_team_cached_bytes{team="team-a"}"#).await;
    assert!(
        (200_000..=600_000).contains(&a_cached),
        "team A holds what is left: {a_cached}"
    );
    for i in 0..2 {
        let blob = f_blob(&m, "b-secret", i).await.to_hex();
        let file = shared.data_dir.join("blobs").join(&blob[..2]).join(&blob);
        assert!(
            file.exists(),
            "team B's f{i}.bin is still cached on the shared host"
        );
    }
    // Team A's oldest file went to make room for its newest.
    let a0 = f_blob(&m, "a-images", 0).await.to_hex();
    assert!(!shared.data_dir.join("blobs").join(&a0[..2]).join(&a0).exists());
    let share = r#"locus_node_team_cache_share_bytes{team="team-b"}"#;
    assert_eq!(
        counter(&shared, share).await,
        500_000,
        "half of the node's cache room"
    );
    // The operator sees each team's cached bytes over the nodes (from their heartbeats).
    let team = |v: &serde_json::Value, name: &str| {
        v["teams"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["name"] == name).cloned())
            .unwrap_or_else(|| panic!("team {name} in {v}"))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v: serde_json::Value = serde_json::from_slice(&m.cli(&["status", "--json"]).stdout).unwrap();
        if team(&v, "team-b")["cached_bytes"] == 400_000 && team(&v, "team-a")["cached_bytes"] == a_cached {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "status never showed the cache: {v}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let text = stdout(&m.cli(&["status"]));
    assert!(text.contains("390.6 KiB cached on nodes up"), "{text}");
}

/// The blob of `f{i}.bin` in `dataset@1`.
async fn f_blob(m: &Metadata, dataset: &str, i: usize) -> BlobHash {
    BlobHash::from_slice("blob", &f_entry(m, dataset, i).await.blob).unwrap()
}
