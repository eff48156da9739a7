//! The backup's own rules against a fake cluster and a real `file://` target: a blob one
//! replica cannot send is asked of the next, nothing is committed while a blob has no
//! sender, blobs without a live replica are refused before any upload, a second run sends
//! only what the last committed snapshot lacks, and verify's repair replaces a corrupt
//! object. The fake nodes upload through the same `locus_backup::blob` calls real ones do.

use crate::ops::cluster::NodeError;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use locus_metadata::keys;
use locus_metadata::records::{ShardRecord, VersionRecord};
use locus_metadata::store::{Batch, KvStore, MemStore, Table};
use prost::Message;

use super::*;
use crate::ops::cluster::{BoxFuture, CatalogStream};
use crate::ops::Quiet;

/// Nodes n1 and n2, each holding every blob; one dataset whose versions' shards are
/// replicated on [n1, n2].
struct Fake {
    catalog: MemStore,
    blobs: HashMap<BlobHash, Vec<u8>>,
    up: HashSet<&'static str>,
    /// (node, blob) pairs the node reports it cannot read (it quarantined its copy).
    bad: HashSet<(&'static str, BlobHash)>,
    /// (node, blob) for every blob a node uploaded.
    sent: Mutex<Vec<(String, BlobHash)>>,
    recorded: Mutex<Vec<String>>,
}

impl Fake {
    fn new() -> Self {
        let catalog = MemStore::default();
        let mut b = Batch::default();
        b.put(Table::Meta, keys::META_CLUSTER_ID, b"c1");
        catalog.write(b, true).unwrap();
        Fake {
            catalog,
            blobs: HashMap::new(),
            up: HashSet::from(["n1", "n2"]),
            bad: HashSet::new(),
            sent: Mutex::default(),
            recorded: Mutex::default(),
        }
    }

    /// Commits version `number` of dataset "ds" (uid = number) with one shard of `files`.
    fn version(&mut self, number: u64, files: &[&[u8]]) -> Vec<BlobHash> {
        let mut b = Batch::default();
        let bytes: u64 = files.iter().map(|f| f.len() as u64).sum();
        let rec = VersionRecord {
            uid: number,
            bytes,
            ..Default::default()
        };
        b.put(Table::Versions, keys::version("ds", number), rec.encode_to_vec());
        let shard = ShardRecord {
            bytes,
            files: files.len() as u64,
            replicas: vec!["n1".into(), "n2".into()],
        };
        b.put(Table::Shards, keys::shard(number, 0), shard.encode_to_vec());
        let mut out = Vec::new();
        for f in files {
            let h = BlobHash::of(f);
            let mut k = keys::shard(number, 0);
            k.extend_from_slice(&h.0);
            let mut v = (f.len() as u64).to_be_bytes().to_vec();
            v.extend_from_slice(&(4u32 << 20).to_be_bytes());
            b.put(Table::ShardBlobs, k, v);
            self.blobs.insert(h, f.to_vec());
            out.push(h);
        }
        self.catalog.write(b, true).unwrap();
        out
    }

    fn sent(&self) -> Vec<(String, BlobHash)> {
        let mut s = self.sent.lock().unwrap().clone();
        s.sort();
        s
    }
}

impl BackupCluster for Fake {
    fn export_catalog(&self) -> BoxFuture<'_, Result<CatalogStream, tonic::Status>> {
        let mut out = Vec::new();
        locus_metadata::snapshot::export(&self.catalog, &mut out).unwrap();
        // In several pieces, as the service streams it.
        let pieces: Vec<Result<bytes::Bytes, tonic::Status>> = out
            .chunks(100)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        Box::pin(async move { Ok(Box::pin(futures_util::stream::iter(pieces)) as CatalogStream) })
    }

    fn live_nodes(&self) -> BoxFuture<'_, Result<HashMap<String, String>, tonic::Status>> {
        let up = self
            .up
            .iter()
            .map(|n| (n.to_string(), format!("{n}:1")))
            .collect();
        Box::pin(async move { Ok(up) })
    }

    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>> {
        let r = blobs
            .iter()
            .map(|_| vec!["n1".to_string(), "n2".to_string()])
            .collect();
        Box::pin(async move { Ok(r) })
    }

    fn record_backup(&self, url: String, snapshot: String) -> BoxFuture<'_, Result<(), tonic::Status>> {
        self.recorded.lock().unwrap().push(format!("{url} {snapshot}"));
        Box::pin(async { Ok(()) })
    }

    fn upload<'a>(
        &'a self,
        node: &'a str,
        r: nodepb::UploadBlobsRequest,
        done: &'a std::sync::atomic::AtomicU64,
    ) -> BoxFuture<'a, Result<nodepb::UploadProgress, NodeError>> {
        Box::pin(async move {
            let t = Target::open(&r.target).map_err(|e| NodeError::Unreachable(e.to_string()))?;
            let mut p = nodepb::UploadProgress::default();
            for b in r.blobs {
                let h = BlobHash::from_slice("hash", &b.hash).unwrap();
                if self.bad.iter().any(|(n, x)| *n == node && *x == h) {
                    p.failed.push(nodepb::FailedBlob {
                        hash: b.hash,
                        reason: "quarantined".into(),
                    });
                    continue;
                }
                if r.skip_existing
                    && blob::exists(&t, &h, b.size)
                        .await
                        .map_err(|e| NodeError::Unreachable(e.to_string()))?
                {
                    p.blobs_skipped += 1;
                    p.bytes_skipped += b.size;
                    continue;
                }
                let data = bytes::Bytes::from(self.blobs[&h].clone());
                let s = futures_util::stream::iter([Ok::<_, std::io::Error>(data)]);
                blob::upload(&t, &h, b.size, s)
                    .await
                    .map_err(|e| NodeError::Unreachable(e.to_string()))?;
                self.sent.lock().unwrap().push((node.to_string(), h));
                p.blobs_uploaded += 1;
                p.bytes_uploaded += b.size;
                done.fetch_add(b.size, Ordering::Relaxed);
            }
            p.finished = true;
            Ok(p)
        })
    }
}

fn target(d: &tempfile::TempDir) -> Target {
    Target::open(&format!("file://{}", d.path().display())).unwrap()
}

fn options(id: &str) -> RunOptions {
    RunOptions {
        id: id.into(),
        started_ms: now_ms(),
        parallel: 2,
        retention: Policy::default(),
        signing_key: None,
    }
}

async fn run_once(c: &Fake, t: &Target, id: &str) -> (Result<()>, RunReport) {
    let mut report = RunReport::default();
    let r = run(c, t, &options(id), &Quiet, &mut report).await;
    (r, report)
}

fn verify_all() -> VerifyOptions {
    VerifyOptions {
        snapshot: None,
        sample: 1.0,
        parallel: 4,
        repair: false,
        trust: locus_backup::sign::Trust {
            keys: vec![],
            allow_unsigned: true,
        },
    }
}

#[tokio::test]
async fn a_blob_one_replica_cannot_send_is_sent_by_the_next_and_the_snapshot_commits() {
    let d = tempfile::tempdir().unwrap();
    let t = target(&d);
    let mut c = Fake::new();
    let hs = c.version(1, &[b"alpha", b"beta"]);
    c.bad.insert(("n1", hs[0]));
    let (r, report) = run_once(&c, &t, "s1").await;
    r.unwrap();
    assert!(report.committed);
    assert_eq!(report.blobs_uploaded, 2);
    let mut want = vec![("n1".to_string(), hs[1]), ("n2".to_string(), hs[0])];
    want.sort();
    assert_eq!(c.sent(), want, "n2 sent the blob n1 could not");
    let v = verify(&t, None, &verify_all(), &Quiet).await.unwrap();
    assert!(v.catalog_ok && !v.failed(), "{v:?}");
    assert_eq!(v.blobs_checked, 2);
    let url = &t.url;
    assert_eq!(
        *c.recorded.lock().unwrap(),
        [format!("{url} "), format!("{url} s1")],
        "the target was recorded before any upload, the snapshot once committed"
    );
}

#[tokio::test]
async fn a_blob_no_replica_can_send_fails_the_run_naming_both_and_commits_nothing() {
    let d = tempfile::tempdir().unwrap();
    let t = target(&d);
    let mut c = Fake::new();
    let hs = c.version(1, &[b"alpha", b"beta"]);
    c.bad.insert(("n1", hs[0]));
    c.bad.insert(("n2", hs[0]));
    let (r, report) = run_once(&c, &t, "s1").await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains(&hs[0].to_string()) && e.contains("n1, n2"), "{e}");
    assert!(!report.committed);
    assert!(
        t.committed_snapshot(None).await.is_err(),
        "no snapshot is committed"
    );
    // The target was recorded as in use (nodes upload only to recorded targets); no
    // snapshot was.
    assert_eq!(*c.recorded.lock().unwrap(), [format!("{} ", t.url)]);
}

#[tokio::test]
async fn a_blob_without_a_live_replica_is_refused_before_anything_is_uploaded() {
    let d = tempfile::tempdir().unwrap();
    let t = target(&d);
    let mut c = Fake::new();
    c.version(1, &[b"alpha"]);
    c.up = HashSet::from(["n3"]);
    let (r, _) = run_once(&c, &t, "s1").await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("no live replica"), "{e}");
    assert!(c.sent().is_empty());
}

#[tokio::test]
async fn a_second_run_sends_only_the_blobs_the_last_committed_snapshot_lacks() {
    let d = tempfile::tempdir().unwrap();
    let t = target(&d);
    let mut c = Fake::new();
    c.version(1, &[b"alpha", b"beta"]);
    run_once(&c, &t, "s1").await.0.unwrap();
    let new = c.version(2, &[b"alpha", b"gamma"]);
    c.sent.lock().unwrap().clear();
    let (r, report) = run_once(&c, &t, "s2").await;
    r.unwrap();
    assert_eq!(c.sent().iter().map(|x| x.1).collect::<Vec<_>>(), [new[1]]);
    assert_eq!(
        (report.blobs, report.blobs_uploaded, report.blobs_skipped),
        (3, 1, 2)
    );
    assert_eq!(report.versions, 2);
}

#[tokio::test]
async fn verify_repair_has_a_holder_replace_a_corrupt_object() {
    let d = tempfile::tempdir().unwrap();
    let t = target(&d);
    let mut c = Fake::new();
    let hs = c.version(1, &[b"alpha", b"beta"]);
    run_once(&c, &t, "s1").await.0.unwrap();
    let hex = hs[1].to_hex();
    let file = d.path().join("blobs").join(&hex[..2]).join(&hex);
    std::fs::write(&file, b"BETA").unwrap();
    let v = verify(&t, None, &verify_all(), &Quiet).await.unwrap();
    assert_eq!(v.corrupt.len(), 1, "{v:?}");
    assert!(v.corrupt[0].starts_with(&hex));
    assert!(v.failed());
    let mut o = verify_all();
    o.repair = true;
    let v = verify(&t, Some(&c), &o, &Quiet).await.unwrap();
    assert_eq!(v.repaired.len(), 1);
    assert_eq!(v.repaired[0], hex);
    assert!(!v.failed());
    assert_eq!(std::fs::read(&file).unwrap(), b"beta");
    let v = verify(&t, None, &verify_all(), &Quiet).await.unwrap();
    assert!(!v.failed() && v.corrupt.is_empty(), "{v:?}");
}
