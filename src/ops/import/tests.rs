//! The import's own rules against a fake cluster: a failed send aborts the session and
//! commits nothing, blobs a node holds already are not sent, unplaced shards are refused.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use locus_proto::{pb, BlobHash};

use super::*;
use crate::ops::cluster::{BoxFuture, ImportCluster, Upload};
use crate::ops::scan::BlobSource;
use crate::ops::Quiet;

/// Every shard placed on nodes a and b (or none, when `unplaced`); what happened, in order.
#[derive(Default)]
struct Fake {
    unplaced: bool,
    /// Sends to this node fail.
    refuse: Option<&'static str>,
    /// (node, blob) pairs the nodes hold already.
    holding: HashSet<(String, BlobHash)>,
    /// The dataset's latest version: (path, size, blob).
    previous: Vec<(String, u64, BlobHash)>,
    /// The origin the nodes read (ImportObject) under `ds/`; None: nodes cannot read it.
    origin: Option<Arc<dyn object_store::ObjectStore>>,
    /// A node whose reads of the origin fail, and how.
    refuse_pull: Option<(&'static str, tonic::Code)>,
    log: Mutex<Vec<String>>,
}

impl Fake {
    fn said(&self, what: &str) {
        self.log.lock().unwrap().push(what.to_string());
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

impl ImportCluster for Fake {
    fn begin(&self, _r: pb::BeginVersionRequest) -> BoxFuture<'_, Result<u64, tonic::Status>> {
        self.said("begin");
        Box::pin(async { Ok(7) })
    }
    fn put_entries(&self, _s: u64, _e: Vec<pb::Entry>) -> BoxFuture<'_, Result<(), tonic::Status>> {
        Box::pin(async { Ok(()) })
    }
    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>> {
        let r = blobs
            .iter()
            .map(|h| {
                let mut nodes: Vec<String> = self
                    .holding
                    .iter()
                    .filter(|(_, b)| b == h)
                    .map(|(n, _)| n.clone())
                    .collect();
                nodes.sort();
                nodes
            })
            .collect();
        Box::pin(async move { Ok(r) })
    }
    fn previous<'a>(
        &'a self,
        _dataset: &'a str,
    ) -> BoxFuture<'a, Result<Vec<crate::ops::cluster::PreviousFile>, tonic::Status>> {
        let p = self.previous.clone();
        Box::pin(async move { Ok(p) })
    }
    fn place(
        &self,
        r: pb::PlaceShardsRequest,
    ) -> BoxFuture<'_, Result<pb::PlaceShardsResponse, tonic::Status>> {
        for s in &r.shards {
            if !s.prefer.is_empty() {
                self.said(&format!("prefer {} {}", s.id, s.prefer.join(",")));
            }
        }
        let resp = if self.unplaced {
            pb::PlaceShardsResponse {
                placements: vec![],
                unplaced: r
                    .shards
                    .iter()
                    .map(|s| pb::UnplacedShard {
                        shard: s.id,
                        reason: "no node has room".into(),
                    })
                    .collect(),
            }
        } else {
            pb::PlaceShardsResponse {
                placements: r
                    .shards
                    .iter()
                    .map(|s| pb::ShardPlacement {
                        shard: s.id,
                        nodes: vec!["a".into(), "b".into()],
                    })
                    .collect(),
                unplaced: vec![],
            }
        };
        Box::pin(async move { Ok(resp) })
    }
    fn put_shards(&self, _s: u64, _sh: Vec<pb::Shard>) -> BoxFuture<'_, Result<(), tonic::Status>> {
        Box::pin(async { Ok(()) })
    }
    fn cluster_id(&self) -> BoxFuture<'_, Result<String, tonic::Status>> {
        Box::pin(async { Ok("fake-cluster".to_string()) })
    }
    fn commit(
        &self,
        session: u64,
        namespace: Option<(BlobHash, u64)>,
    ) -> BoxFuture<'_, Result<pb::Version, tonic::Status>> {
        if let Some((h, _)) = namespace {
            self.said(&format!("namespace {h}"));
        }
        self.said(&format!("commit {session}"));
        Box::pin(async {
            Ok(pb::Version {
                version: 1,
                ..Default::default()
            })
        })
    }
    fn abort(&self, session: u64) -> BoxFuture<'_, ()> {
        self.said(&format!("abort {session}"));
        Box::pin(async {})
    }
    fn have<'a>(
        &'a self,
        node: &'a str,
        blobs: Vec<BlobHash>,
    ) -> BoxFuture<'a, Result<Vec<bool>, NodeError>> {
        Box::pin(async move {
            Ok(blobs
                .iter()
                .map(|h| self.holding.contains(&(node.to_string(), *h)))
                .collect())
        })
    }
    fn pull<'a>(
        &'a self,
        node: &'a str,
        r: locus_proto::nodepb::ImportObjectRequest,
    ) -> BoxFuture<'a, Result<locus_proto::manifest::FileHashes, tonic::Status>> {
        Box::pin(async move {
            use object_store::ObjectStoreExt;
            let Some(store) = &self.origin else {
                return Err(tonic::Status::unimplemented("no origin reads"));
            };
            if let Some((n, code)) = self.refuse_pull {
                if n == node {
                    return Err(tonic::Status::new(code, "cannot read the store"));
                }
            }
            let key = object_store::path::Path::from(format!("ds/{}", r.path));
            let data = store.get(&key).await.unwrap().bytes().await.unwrap();
            assert_eq!(data.len() as u64, r.size, "the size the listing gave");
            let mut h = locus_proto::manifest::ChunkHasher::new(
                r.chunk_size,
                locus_proto::manifest::ChunkKind::from_tree(r.tree_chunks),
            );
            h.update(&data);
            self.said(&format!("pull {node} {}", r.path));
            Ok(h.finish())
        })
    }
    fn copy<'a>(
        &'a self,
        node: &'a str,
        from: &'a str,
        blob: locus_proto::nodepb::BlobRef,
        _chunk_size: u32,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            let h = BlobHash::from_slice("hash", &blob.hash).unwrap();
            self.said(&format!("copy {node}<-{from} {h}"));
            Ok(())
        })
    }
    fn send<'a>(&'a self, node: &'a str, blob: Upload) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            if self.refuse == Some(node) {
                return Err(NodeError::from_status(
                    node,
                    &tonic::Status::resource_exhausted("refused: the disk is full"),
                ));
            }
            // What a node would receive must hash to the blob's name.
            let bytes = match &blob.source {
                BlobSource::Memory(b) => Some(b.to_vec()),
                BlobSource::Local(p) => {
                    Some(std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
                }
                BlobSource::Remote(_) => None,
            };
            if let Some(b) = bytes {
                assert_eq!(BlobHash::of(&b), blob.hash, "the bytes sent for {}", blob.hash);
            }
            self.said(&format!("send {node} {}", blob.hash));
            Ok(())
        })
    }
}

/// The namespace hash the commit claimed.
fn sealed_namespace(log: &[String]) -> String {
    log.iter()
        .find_map(|l| l.strip_prefix("namespace "))
        .unwrap_or_else(|| panic!("no namespace came with the commit: {log:?}"))
        .to_string()
}

/// Three files of distinct content in a temp dir, and the options to import it.
fn source() -> (tempfile::TempDir, ImportOptions, Vec<BlobHash>) {
    let d = tempfile::tempdir().unwrap();
    let mut blobs = Vec::new();
    for i in 0..3u8 {
        let data = vec![i; 1000 + usize::from(i)];
        blobs.push(BlobHash::of(&data));
        std::fs::write(d.path().join(format!("f{i}")), data).unwrap();
    }
    let o = ImportOptions {
        name: "ds".into(),
        source: d.path().display().to_string(),
        replicas: 2,
        shard_size: 1 << 30,
        chunk_size: 64 * 1024,
        parallel: 2,
        token: None,
        read_by: ReadBy::Client,
    };
    (d, o, blobs)
}

async fn run(fake: Fake, o: &ImportOptions) -> (Result<ImportReport>, Vec<String>) {
    let fake = Arc::new(fake);
    let cluster: Arc<dyn ImportCluster> = fake.clone();
    let r = import(&cluster, o, &Quiet).await;
    (r, fake.log())
}

#[tokio::test]
async fn every_blob_goes_to_every_replica_then_one_commit() {
    let (_d, o, blobs) = source();
    let (r, log) = run(Fake::default(), &o).await;
    let r = r.unwrap();
    assert_eq!(r.distinct_blobs, 3);
    for h in &blobs {
        for n in ["a", "b"] {
            assert!(log.contains(&format!("send {n} {h}")), "{n} got {h}: {log:?}");
        }
    }
    // The namespace is on both before the commit claims it: sent to one, copied to the other.
    let ns = sealed_namespace(&log);
    let at = |l: String| {
        log.iter()
            .position(|x| *x == l)
            .unwrap_or_else(|| panic!("{l}: {log:?}"))
    };
    assert!(at(format!("send a {ns}")) < at(format!("namespace {ns}")));
    assert!(at(format!("copy b<-a {ns}")) < at(format!("namespace {ns}")));
    assert_eq!(log.last().unwrap(), "commit 7");
    assert!(!log.iter().any(|l| l.starts_with("abort")));
}

#[tokio::test]
async fn blobs_a_node_holds_already_are_not_sent_again() {
    let (_d, o, blobs) = source();
    let holding: HashSet<(String, BlobHash)> =
        [("a".to_string(), blobs[0]), ("b".to_string(), blobs[1])].into();
    let (r, log) = run(
        Fake {
            holding,
            ..Default::default()
        },
        &o,
    )
    .await;
    let r = r.unwrap();
    assert!(!log.contains(&format!("send a {}", blobs[0])), "{log:?}");
    assert!(!log.contains(&format!("send b {}", blobs[1])), "{log:?}");
    let file_sends = log
        .iter()
        .filter(|l| l.starts_with("send") && blobs.iter().any(|h| l.ends_with(&h.to_string())))
        .count();
    assert_eq!(file_sends, 4, "{log:?}");
    assert_eq!(r.skipped_bytes, 1000 + 1001);
}

#[tokio::test]
async fn a_node_that_refuses_a_blob_aborts_the_session_and_nothing_is_committed() {
    let (_d, o, _) = source();
    let (r, log) = run(
        Fake {
            refuse: Some("b"),
            ..Default::default()
        },
        &o,
    )
    .await;
    match r {
        Err(e @ ImportError::Transfer { .. }) => {
            let why = e.to_string();
            assert!(why.contains("node b") && why.contains("disk is full"), "{why}");
            assert!(
                matches!(
                    e,
                    ImportError::Transfer {
                        cause: NodeError::Full(_),
                        ..
                    }
                ),
                "a full node is told apart: {e:?}"
            );
        }
        other => panic!("expected a transfer error, got {other:?}"),
    }
    assert!(log.contains(&"abort 7".to_string()), "{log:?}");
    assert!(!log.iter().any(|l| l.starts_with("commit")), "{log:?}");
}

#[tokio::test]
async fn shards_without_room_are_named_and_nothing_is_sent_or_committed() {
    let (_d, o, _) = source();
    let (r, log) = run(
        Fake {
            unplaced: true,
            ..Default::default()
        },
        &o,
    )
    .await;
    match r {
        Err(ImportError::Unplaced(why)) => {
            assert!(
                why.contains("shard 0: no node has room") && why.contains("nothing was committed"),
                "{why}"
            )
        }
        other => panic!("expected an unplaced error, got {other:?}"),
    }
    assert_eq!(log, vec!["begin".to_string(), "abort 7".to_string()]);
}

/// An object store holding three objects under `ds/`, one larger than the in-memory limit
/// (it is staged through a spill file); their blob hashes.
async fn bucket() -> (super::super::remote::Remote, Vec<BlobHash>) {
    use object_store::ObjectStoreExt;
    let store: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let sizes = [
        1000usize,
        70_000,
        super::super::remote::IN_MEMORY_MAX as usize + 5,
    ];
    let mut blobs = Vec::new();
    for (i, n) in sizes.into_iter().enumerate() {
        let data: Vec<u8> = (0..n).map(|x| (x * 7 + i) as u8).collect();
        blobs.push(BlobHash::of(&data));
        let key = object_store::path::Path::from(format!("ds/sub/o{i}"));
        store.put(&key, data.into()).await.unwrap();
    }
    let remote = super::super::remote::Remote {
        store,
        prefix: object_store::path::Path::from("ds"),
    };
    (remote, blobs)
}

fn remote_options() -> ImportOptions {
    ImportOptions {
        name: "ds".into(),
        source: "s3://bucket/ds".into(),
        replicas: 2,
        shard_size: 1 << 30,
        chunk_size: 64 * 1024,
        parallel: 2,
        token: None,
        // The fake's nodes cannot read origins: every object falls back to this client.
        read_by: ReadBy::Auto,
    }
}

#[tokio::test]
async fn an_object_store_import_sends_every_object_read_once_to_every_replica_then_commits() {
    let (remote, blobs) = bucket().await;
    let fake = Arc::new(Fake::default());
    let cluster: Arc<dyn ImportCluster> = fake.clone();
    let o = remote_options();
    let r = import_remote(&cluster, &o, remote, &Quiet, Instant::now())
        .await
        .unwrap();
    assert_eq!(r.distinct_blobs, 3);
    let log = fake.log();
    for h in &blobs {
        for n in ["a", "b"] {
            assert!(log.contains(&format!("send {n} {h}")), "{n} got {h}: {log:?}");
        }
    }
    assert_eq!(log.first().unwrap(), "begin");
    assert_eq!(log.last().unwrap(), "commit 7");
}

#[tokio::test]
async fn an_object_store_import_a_node_refuses_aborts_and_commits_nothing() {
    let (remote, _) = bucket().await;
    let fake = Arc::new(Fake {
        refuse: Some("a"),
        ..Default::default()
    });
    let cluster: Arc<dyn ImportCluster> = fake.clone();
    let r = import_remote(&cluster, &remote_options(), remote, &Quiet, Instant::now()).await;
    match r {
        Err(e @ ImportError::Transfer { .. }) => {
            let why = e.to_string();
            assert!(why.contains("node a") && why.contains("disk is full"), "{why}");
            assert!(
                matches!(
                    e,
                    ImportError::Transfer {
                        cause: NodeError::Full(_),
                        ..
                    }
                ),
                "{e:?}"
            );
        }
        other => panic!("expected a transfer error, got {other:?}"),
    }
    let log = fake.log();
    assert!(log.contains(&"abort 7".to_string()), "{log:?}");
    assert!(!log.iter().any(|l| l.starts_with("commit")), "{log:?}");
}

#[tokio::test]
async fn an_object_store_reimport_prefers_the_nodes_holding_what_the_same_paths_held_before() {
    let (remote, blobs) = bucket().await;
    let fake = Arc::new(Fake {
        // o0 is unchanged since the last version and node c holds it; o1 had another size.
        previous: vec![("sub/o0".into(), 1000, blobs[0]), ("sub/o1".into(), 5, blobs[1])],
        holding: [("c".to_string(), blobs[0]), ("d".to_string(), blobs[1])].into(),
        ..Default::default()
    });
    let cluster: Arc<dyn ImportCluster> = fake.clone();
    import_remote(&cluster, &remote_options(), remote, &Quiet, Instant::now())
        .await
        .unwrap();
    let log = fake.log();
    assert!(log.contains(&"prefer 0 c".to_string()), "{log:?}");
    assert!(
        !log.iter().any(|l| l.contains(",d") || l.ends_with(" d")),
        "{log:?}"
    );
}

/// The bucket's objects read by the nodes: what the fake cluster did, and the result.
async fn pulled(fake: Fake, read_by: ReadBy) -> (Vec<String>, Result<ImportReport>, Vec<BlobHash>) {
    let (remote, blobs) = bucket().await;
    let fake = Arc::new(Fake {
        origin: Some(remote.store.clone()),
        ..fake
    });
    let cluster: Arc<dyn ImportCluster> = fake.clone();
    let o = ImportOptions {
        read_by,
        ..remote_options()
    };
    let r = import_remote(&cluster, &o, remote, &Quiet, Instant::now()).await;
    (fake.log(), r, blobs)
}

#[tokio::test]
async fn read_by_the_nodes_each_object_is_read_once_by_its_first_replica_and_copied_to_the_others() {
    let (log, r, blobs) = pulled(Fake::default(), ReadBy::Nodes).await;
    assert_eq!(r.unwrap().distinct_blobs, 3);
    for (i, h) in blobs.iter().enumerate() {
        let pulls: Vec<_> = log
            .iter()
            .filter(|l| l.ends_with(&format!(" sub/o{i}")))
            .collect();
        assert_eq!(pulls, [&format!("pull a sub/o{i}")], "{log:?}");
        assert!(log.contains(&format!("copy b<-a {h}")), "{log:?}");
    }
    // The client sends the one thing only it has, the sealed namespace, once; the other
    // replica copies it.
    let ns = sealed_namespace(&log);
    assert!(log.contains(&format!("copy b<-a {ns}")), "{log:?}");
    assert!(
        log.iter()
            .filter(|l| l.starts_with("send"))
            .eq([&format!("send a {ns}")]),
        "the client sent file bytes: {log:?}"
    );
    assert_eq!(log.last().unwrap(), "commit 7");
}

#[tokio::test]
async fn objects_a_node_cannot_read_are_read_and_sent_by_the_client_in_auto() {
    let fake = Fake {
        refuse_pull: Some(("a", tonic::Code::PermissionDenied)),
        ..Default::default()
    };
    let (log, r, blobs) = pulled(fake, ReadBy::Auto).await;
    assert_eq!(r.unwrap().distinct_blobs, 3);
    for h in &blobs {
        for n in ["a", "b"] {
            assert!(log.contains(&format!("send {n} {h}")), "{n} got {h}: {log:?}");
        }
    }
    assert_eq!(log.last().unwrap(), "commit 7");
}

#[tokio::test]
async fn read_by_the_nodes_only_a_node_that_cannot_read_fails_the_import_and_commits_nothing() {
    let fake = Fake {
        refuse_pull: Some(("a", tonic::Code::PermissionDenied)),
        ..Default::default()
    };
    let (log, r, _) = pulled(fake, ReadBy::Nodes).await;
    match r {
        Err(e @ ImportError::Transfer { .. }) => {
            assert!(e.to_string().contains("node a reading sub/o"), "{e}");
            assert!(
                matches!(
                    e,
                    ImportError::Transfer {
                        cause: NodeError::Grant(_),
                        ..
                    }
                ),
                "a refusal of the node's credentials: {e:?}"
            );
        }
        other => panic!("expected a transfer error, got {other:?}"),
    }
    assert!(log.contains(&"abort 7".to_string()), "{log:?}");
    assert!(
        !log.iter()
            .any(|l| l.starts_with("commit") || l.starts_with("send")),
        "{log:?}"
    );
}

#[tokio::test]
async fn in_auto_an_object_that_is_wrong_whoever_reads_it_fails_without_a_second_read() {
    let fake = Fake {
        refuse_pull: Some(("a", tonic::Code::InvalidArgument)),
        ..Default::default()
    };
    let (log, r, _) = pulled(fake, ReadBy::Auto).await;
    assert!(
        matches!(
            r,
            Err(ImportError::Transfer {
                cause: NodeError::Rejected(_),
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        !log.iter().any(|l| l.starts_with("send")),
        "read again by the client: {log:?}"
    );
    assert!(log.contains(&"abort 7".to_string()), "{log:?}");
}

#[tokio::test]
async fn content_in_many_files_goes_to_each_node_once_and_every_file_names_it() {
    let (d, o, blobs) = source();
    // Two more files with the first's bytes, one of them past the batched size.
    std::fs::write(d.path().join("g0"), vec![0u8; 1000]).unwrap();
    let big = vec![9u8; (super::send::SMALL + 1) as usize];
    std::fs::write(d.path().join("h-big"), &big).unwrap();
    std::fs::write(d.path().join("h-big2"), &big).unwrap();
    let (r, log) = run(Fake::default(), &o).await;
    let r = r.unwrap();
    assert_eq!(r.distinct_blobs, 4);
    for h in blobs.iter().chain([&BlobHash::of(&big)]) {
        for n in ["a", "b"] {
            let sends = log.iter().filter(|l| **l == format!("send {n} {h}")).count();
            assert_eq!(sends, 1, "{n} got {h} once: {log:?}");
        }
    }
    assert_eq!(r.uploaded_bytes, 2 * (1000 + 1001 + 1002 + big.len() as u64));
}

#[test]
fn a_file_read_at_another_size_than_listed_is_refused_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("grew");
    std::fs::write(&p, b"123456").unwrap();
    for listed in [5, 7, super::send::SMALL + 10] {
        match super::local::read_file(&p, listed, 1 << 16) {
            Err(ImportError::Source(e)) => assert!(
                e.0.contains("grew")
                    && e.0.contains("changed size during the import")
                    && e.0.contains("6 bytes"),
                "{e}"
            ),
            Err(other) => panic!("listed {listed}: expected a source error, got {other:?}"),
            Ok(_) => panic!("listed {listed}: a file of 6 bytes was read as {listed}"),
        }
    }
    let (h, data) = super::local::read_file(&p, 6, 1 << 16).unwrap();
    assert_eq!((h.0, h.1), (6, BlobHash::of(b"123456")));
    assert_eq!(data.as_deref(), Some(&b"123456"[..]));
}
