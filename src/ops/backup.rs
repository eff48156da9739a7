//! Backups as library code: a run and verification (with repair), taking plain options
//! and reporting through an [`Observer`] (restores are in `restore`). The binary's
//! `locus backup …` and `locus restore` only parse arguments and print.
//!
//! A run, in the order that keeps every snapshot either valid or visibly incomplete:
//! export the catalogue (one store snapshot, streamed by the metadata service) to a temp
//! file → derive from it every blob the snapshot needs and the node to read each from
//! (its shard's first live replica) → write the snapshot's manifest and blob list (so
//! garbage collection protects them from now on) → upload the catalogue → have every
//! node upload, in parallel, the blobs the target does not hold yet (the previous
//! committed snapshot's list says what it holds without listing the bucket; anything
//! else is checked with one HEAD, which is how an interrupted run resumes) → re-check if
//! a garbage collection overlapped the run → write COMMITTED last.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use locus_backup::format::{now_ms, DatasetSummary};
use locus_backup::retention::Policy;
use locus_backup::{blob, BlobList, Committed, SnapshotManifest, SnapshotState, Target};
use locus_proto::{nodepb, BlobHash};
use serde::Serialize;

use super::cluster::BackupCluster;
use super::{status_sentence, Observer};

#[derive(Debug, thiserror::Error)]
pub enum BackupOpError {
    /// The backup target failed or holds something unusable.
    #[error(transparent)]
    Target(#[from] locus_backup::BackupError),
    #[error("{}", status_sentence(.0))]
    Metadata(#[from] tonic::Status),
    /// The catalogue export could not be read or written back.
    #[error(transparent)]
    Catalog(#[from] locus_metadata::snapshot::SnapshotError),
    #[error("{0}")]
    Store(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Some blob could not be sent by any node, or a node failed.
    #[error("{0}")]
    Nodes(String),
    #[error("{0}")]
    Invalid(String),
}

type Result<T, E = BackupOpError> = std::result::Result<T, E>;

pub(super) fn io(what: &str) -> impl FnOnce(std::io::Error) -> BackupOpError + '_ {
    move |source| BackupOpError::Io {
        what: what.to_string(),
        source,
    }
}

pub(super) fn joined(e: tokio::task::JoinError) -> BackupOpError {
    BackupOpError::Nodes(format!("a task failed: {e}"))
}

/// How a run goes.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The snapshot id (`locus_backup::format::new_snapshot_id`) and when the run started.
    pub id: String,
    pub started_ms: i64,
    /// Uploads in flight per node.
    pub parallel: u32,
    /// Applied after a committed run; an empty policy deletes nothing.
    pub retention: Policy,
    /// Signs the snapshot's manifest (`snapshots/<id>/SIGNATURE`, before COMMITTED).
    pub signing_key: Option<std::sync::Arc<locus_backup::sign::SigningKey>>,
}

/// The `--json` report of a run, also printed (with `errors`) when it fails.
#[derive(Debug, Default, Serialize)]
pub struct RunReport {
    pub snapshot: String,
    pub target: String,
    pub committed: bool,
    pub datasets: usize,
    pub versions: usize,
    pub blobs: u64,
    pub bytes_scanned: u64,
    pub blobs_uploaded: u64,
    pub bytes_uploaded: u64,
    pub blobs_skipped: u64,
    pub bytes_skipped: u64,
    pub catalog_bytes: u64,
    pub duration_s: f64,
    pub gc: Option<locus_backup::gc::GcReport>,
    /// The public key the snapshot was signed with, if it was.
    pub signed_by: Option<String>,
    pub errors: Vec<String>,
}

/// One backup run into `t`; what it did goes into `report` whether it succeeds or not.
pub async fn run(
    c: &dyn BackupCluster,
    t: &Target,
    o: &RunOptions,
    obs: &dyn Observer,
    report: &mut RunReport,
) -> Result<()> {
    let (id, started_ms) = (o.id.as_str(), o.started_ms);
    let gc_at_start = t.gc_state().await?;
    // 1. The catalogue, as of one instant, into a temp file (it may be large).
    let mut file = tempfile::tempfile().map_err(io("cannot create a temp file for the catalogue"))?;
    let mut stream = c.export_catalog().await?;
    let mut hasher = blake3::Hasher::new();
    let mut catalog_bytes = 0u64;
    let exporting = obs.start("exporting the catalogue", 0);
    while let Some(piece) = stream.next().await {
        let piece = piece?;
        hasher.update(&piece);
        catalog_bytes += piece.len() as u64;
        exporting.fetch_add(piece.len() as u64, Ordering::Relaxed);
        file.write_all(&piece)
            .map_err(io("writing the catalogue to a temp file"))?;
    }
    obs.end("exporting the catalogue");
    let catalog_hash = BlobHash(*hasher.finalize().as_bytes());
    report.catalog_bytes = catalog_bytes;

    // 2. What the snapshot needs, and who sends it.
    let mut reader = file.try_clone().map_err(io("the catalogue's temp file"))?;
    let plan = tokio::task::spawn_blocking(move || {
        use std::io::Seek;
        reader.rewind().map_err(io("the catalogue's temp file"))?;
        Ok::<_, BackupOpError>(locus_metadata::snapshot::plan(reader)?)
    })
    .await
    .map_err(joined)??;
    let up = c.live_nodes().await?;
    let list = BlobList::from_unsorted(plan.blobs.iter().map(|b| (b.hash, b.size)).collect());
    report.datasets = plan.datasets.len();
    report.versions = plan.datasets.values().map(|d| d.0.len()).sum();
    report.blobs = list.0.len() as u64;
    report.bytes_scanned = list.bytes();

    // Blobs the newest committed snapshot lists are in the target already.
    let previous = t
        .list_snapshots()
        .await?
        .into_iter()
        .rev()
        .find(|s| s.state == SnapshotState::Committed);
    let known = match &previous {
        Some(p) => {
            t.blob_list_of(&p.id, p.manifest.as_ref().map(|m| m.blobs))
                .await?
        }
        None => BlobList::default(),
    };
    let mut todo = Vec::new();
    for b in &plan.blobs {
        if known.contains(&b.hash) {
            report.blobs_skipped += 1;
            report.bytes_skipped += b.size;
        } else {
            todo.push(b);
        }
    }
    // Only blobs still to send need a live replica: what the target holds is safe even
    // if every node holding it is gone.
    if let Some(b) = todo
        .iter()
        .find(|b| !b.replicas.iter().any(|r| up.contains_key(r)))
    {
        return Err(BackupOpError::Nodes(format!(
            "blob {} has no live replica to read from (replicas: {}); bring its nodes back or let \
             repair finish, then rerun",
            b.hash,
            b.replicas.join(", ")
        )));
    }

    // 3. Announce the snapshot before anything is uploaded (gc protects what it lists).
    let manifest = SnapshotManifest {
        format: locus_backup::format::FORMAT_VERSION,
        id: id.to_string(),
        cluster_id: plan.cluster_id.clone(),
        created_ms: started_ms,
        datasets: plan
            .datasets
            .iter()
            .map(|(name, (versions, bytes))| DatasetSummary {
                name: name.clone(),
                versions: versions.clone(),
                bytes: *bytes,
            })
            .collect(),
        blobs: list.0.len() as u64,
        blob_bytes: list.bytes(),
        catalog_bytes,
        catalog_blake3: catalog_hash.to_hex(),
    };
    t.put_json(&t.snapshot_key(id, "manifest.json"), &manifest)
        .await?;
    if let Some(k) = &o.signing_key {
        t.put_json(&t.snapshot_key(id, "SIGNATURE"), &k.sign(&manifest))
            .await?;
        report.signed_by = Some(k.public_hex());
    }
    t.put_bytes(&t.snapshot_key(id, "blobs"), list.encode()).await?;

    // 4. The catalogue, checked against the hash taken while it was exported.
    let cat = tokio::fs::File::from_std(file.try_clone().map_err(io("the catalogue's temp file"))?);
    let cat = {
        use tokio::io::AsyncSeekExt;
        let mut cat = cat;
        cat.rewind().await.map_err(io("the catalogue's temp file"))?;
        file_stream(cat)
    };
    blob::upload_to(
        t,
        &t.snapshot_key(id, "catalog"),
        &catalog_hash,
        catalog_bytes,
        cat,
    )
    .await?;

    // 5. The nodes upload what is new, all at once.
    let send = SendMode {
        parallel: o.parallel,
        overwrite: false,
    };
    send_blobs(c, obs, &up, todo, t, send, report).await?;

    // 6. A collection that overlapped this run may have deleted a blob it skipped as
    //    present: check every blob of the snapshot and send what is missing.
    let gc_now = t.gc_state().await?;
    // A "running" marker older than a day is a collection that died part-way: it deletes
    // nothing any more, and must not force a full re-check on every night after.
    let running = |g: &locus_backup::GcState| g.running && now_ms() - g.started_ms < 86_400_000;
    let overlapped = gc_at_start.as_ref().is_some_and(running) || gc_now != gc_at_start;
    if overlapped {
        tracing::info!("a garbage collection ran during this backup; re-checking every blob");
        let mut again = RunReport::default();
        send_blobs(c, obs, &up, plan.blobs.iter().collect(), t, send, &mut again).await?;
        report.blobs_uploaded += again.blobs_uploaded;
        report.bytes_uploaded += again.bytes_uploaded;
    }

    // 7. Valid from here on.
    let committed = Committed {
        snapshot: id.to_string(),
        started_ms,
        finished_ms: now_ms(),
        blobs: report.blobs,
        bytes: report.bytes_scanned,
        blobs_uploaded: report.blobs_uploaded,
        bytes_uploaded: report.bytes_uploaded,
        blobs_skipped: report.blobs_skipped,
        bytes_skipped: report.bytes_skipped,
    };
    // What the marker vouches for must be on disk before it is, and the marker before
    // the metadata service relies on it.
    t.sync_local().await?;
    t.put_json(&t.snapshot_key(id, "COMMITTED"), &committed).await?;
    t.sync_local().await?;
    report.committed = true;
    if let Err(e) = c.record_backup(t.url.clone(), id.to_string()).await {
        obs.warn(&format!(
            "snapshot {id} is committed, but the metadata service did not record {} as a source \
             for lost blobs: {}",
            t.url,
            e.message()
        ));
    }

    if !o.retention.is_empty() {
        report.gc =
            Some(locus_backup::gc::collect(t, o.retention, Duration::from_secs(86_400), false).await?);
    }
    Ok(())
}

/// A tokio file as a stream of 1 MiB pieces.
fn file_stream(
    f: tokio::fs::File,
) -> impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static {
    futures_util::stream::unfold(f, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    })
}

/// Has the nodes upload `blobs` (those the target may lack), each from the first live
/// replica not yet tried: a node whose copy turns out bad (it quarantines it) or gone
/// reports the blob, and the next replica sends it in another round. Counts go into
/// `report`.
async fn send_blobs(
    c: &dyn BackupCluster,
    obs: &dyn Observer,
    up: &HashMap<String, String>,
    blobs: Vec<&locus_metadata::snapshot::PlannedBlob>,
    t: &Target,
    send: SendMode,
    report: &mut RunReport,
) -> Result<()> {
    // Nodes upload only to targets the metadata service has recorded: record this one as
    // in use (a no-op once a run has committed there).
    if !blobs.is_empty() {
        c.record_backup(t.url.clone(), String::new()).await.map_err(|e| {
            BackupOpError::Nodes(format!(
                "cannot record {} as a backup target: {}",
                t.url,
                e.message()
            ))
        })?;
    }
    let by_hash: HashMap<BlobHash, &locus_metadata::snapshot::PlannedBlob> =
        blobs.iter().map(|b| (b.hash, *b)).collect();
    let mut tried: HashMap<BlobHash, Vec<String>> = HashMap::new();
    let mut pending: Vec<(BlobHash, String)> = blobs.iter().map(|b| (b.hash, String::new())).collect();
    while !pending.is_empty() {
        let mut per_node: BTreeMap<String, Vec<nodepb::BlobRef>> = BTreeMap::new();
        for (h, why) in &pending {
            let b = by_hash[h];
            let tried = tried.entry(*h).or_default();
            let Some(n) = b
                .replicas
                .iter()
                .find(|r| up.contains_key(*r) && !tried.contains(r))
            else {
                return Err(BackupOpError::Nodes(format!(
                    "no live replica could send blob {h} (tried {}): {why}",
                    tried.join(", ")
                )));
            };
            tried.push(n.clone());
            per_node.entry(n.clone()).or_default().push(nodepb::BlobRef {
                hash: h.0.to_vec(),
                size: b.size,
                ..Default::default()
            });
        }
        let (sums, failed) = upload_from_nodes(c, obs, &per_node, t, send).await?;
        report.blobs_uploaded += sums.0;
        report.bytes_uploaded += sums.1;
        report.blobs_skipped += sums.2;
        report.bytes_skipped += sums.3;
        for (h, node, why) in &failed {
            obs.warn(&format!(
                "node {node} could not send blob {h} ({why}); asking another replica"
            ));
        }
        pending = failed.into_iter().map(|(h, _, why)| (h, why)).collect();
    }
    Ok(())
}

type Sums = (u64, u64, u64, u64);

/// Blob references per `UploadBlobs` call (about 2.5 MB of request).
const UPLOAD_BATCH: usize = 50_000;

/// How nodes upload: uploads in flight per node, and whether to replace objects already
/// in the target (to mend corrupt ones) instead of skipping them.
#[derive(Debug, Clone, Copy)]
struct SendMode {
    parallel: u32,
    overwrite: bool,
}

/// Every node uploads its share at once; returns (blobs uploaded, bytes uploaded, blobs
/// found already stored, their bytes) and the blobs a node could not read (hash, node,
/// why). Fails if any node or the target fails, naming each.
async fn upload_from_nodes(
    c: &dyn BackupCluster,
    obs: &dyn Observer,
    per_node: &BTreeMap<String, Vec<nodepb::BlobRef>>,
    t: &Target,
    send: SendMode,
) -> Result<(Sums, Vec<(BlobHash, String, String)>)> {
    let total: u64 = per_node.values().flatten().map(|b| b.size).sum();
    if total == 0 && per_node.values().all(Vec::is_empty) {
        return Ok(((0, 0, 0, 0), Vec::new()));
    }
    let done = obs.start("uploading", total);
    let uploads = per_node.iter().map(|(node, blobs)| {
        let done = &*done;
        async move {
            // Batches keep each request far below the gRPC message limit, however many
            // blobs a node sends (a 1M-file dataset is ~45 MB of blob references).
            let mut total = nodepb::UploadProgress::default();
            for batch in blobs.chunks(UPLOAD_BATCH) {
                let r = nodepb::UploadBlobsRequest {
                    target: t.url.clone(),
                    blobs: batch.to_vec(),
                    skip_existing: !send.overwrite,
                    parallel: send.parallel,
                };
                let p = match c.upload(node, r, done).await {
                    Ok(p) => p,
                    Err(e) => return (node, Err(e)),
                };
                total.blobs_uploaded += p.blobs_uploaded;
                total.bytes_uploaded += p.bytes_uploaded;
                total.blobs_skipped += p.blobs_skipped;
                total.bytes_skipped += p.bytes_skipped;
                total.failed.extend(p.failed);
            }
            (node, Ok(total))
        }
    });
    // Every node at once; each call is network-bound, so one task drives them all.
    let results = futures_util::future::join_all(uploads).await;
    obs.end("uploading");
    let mut sums = (0, 0, 0, 0);
    let mut failed = Vec::new();
    let mut errors = Vec::new();
    for (node, r) in results {
        match r {
            Ok(p) => {
                sums.0 += p.blobs_uploaded;
                sums.1 += p.bytes_uploaded;
                sums.2 += p.blobs_skipped;
                sums.3 += p.bytes_skipped;
                for f in p.failed {
                    let h = BlobHash::from_slice("hash", &f.hash)
                        .map_err(|e| BackupOpError::Nodes(format!("node {node}: {e}")))?;
                    failed.push((h, node.clone(), f.reason));
                }
            }
            Err(e) => errors.push(format!("node {node}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(BackupOpError::Nodes(errors.join("; ")));
    }
    Ok((sums, failed))
}

/// What `verify` checks.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// [default: the newest committed snapshot]
    pub snapshot: Option<String>,
    /// Fraction of the blobs to re-read, chosen at random (0 < F ≤ 1).
    pub sample: f64,
    /// Blobs read at once.
    pub parallel: usize,
    /// Have nodes upload missing or corrupt blobs again (needs the cluster).
    pub repair: bool,
    /// Which signatures make the snapshot acceptable.
    pub trust: locus_backup::sign::Trust,
}

#[derive(Debug, Default, Serialize)]
pub struct VerifyReport {
    pub snapshot: String,
    /// Whose signature was checked, or why none was.
    pub signature: Option<locus_backup::sign::Checked>,
    pub catalog_ok: bool,
    pub blobs_total: u64,
    pub blobs_checked: u64,
    pub bytes_checked: u64,
    pub missing: Vec<String>,
    pub corrupt: Vec<String>,
    /// Blobs uploaded again from the cluster (--repair).
    pub repaired: Vec<String>,
    pub duration_s: f64,
    /// Why asked-for repair failed.
    #[serde(skip)]
    pub repair_error: Option<String>,
}

impl VerifyReport {
    /// Whether something is still missing or corrupt after any repair.
    pub fn failed(&self) -> bool {
        let mended = |h: &String| self.repaired.iter().any(|r| h.starts_with(r.as_str()));
        !self.catalog_ok || self.missing.iter().any(|h| !mended(h)) || self.corrupt.iter().any(|h| !mended(h))
    }
}

/// Re-reads a snapshot's catalogue and its blobs (all, or a random sample) and reports
/// what is missing or corrupt; with `o.repair`, the nodes holding those blobs upload them
/// again (`cluster` is then needed to find them).
pub async fn verify(
    t: &Target,
    cluster: Option<&dyn BackupCluster>,
    o: &VerifyOptions,
    obs: &dyn Observer,
) -> Result<VerifyReport> {
    if !(o.sample > 0.0 && o.sample <= 1.0) {
        return Err(BackupOpError::Invalid(format!(
            "--sample must be a fraction in (0, 1], not {}",
            o.sample
        )));
    }
    let start = Instant::now();
    let snap = t.committed_snapshot(o.snapshot.as_deref()).await?;
    let manifest = snap
        .manifest
        .clone()
        .ok_or_else(|| BackupOpError::Invalid(format!("snapshot {} has no manifest.json", snap.id)))?;
    let mut report = VerifyReport {
        snapshot: snap.id.clone(),
        signature: Some(o.trust.check(t, &snap.id, &manifest).await?),
        ..Default::default()
    };
    let cat =
        BlobHash::from_hex(&manifest.catalog_blake3).map_err(|e| BackupOpError::Invalid(e.to_string()))?;
    report.catalog_ok = match blob::download(
        t,
        &t.snapshot_key(&snap.id, "catalog"),
        None,
        manifest.catalog_bytes,
    )
    .await
    {
        Ok((n, h)) => n == manifest.catalog_bytes && h == cat,
        Err(locus_backup::BackupError::Corrupt(_)) => false,
        Err(e) if e.is_not_found() => false,
        Err(e) => return Err(e.into()),
    };
    let list = t.blob_list_of(&snap.id, Some(manifest.blobs)).await?;
    report.blobs_total = list.0.len() as u64;
    // A different random sample each run: over many nights every blob gets read.
    let salt = blake3::hash(format!("{}{:?}", now_ms(), std::process::id()).as_bytes());
    let picked: Vec<(BlobHash, u64)> = list
        .0
        .iter()
        .filter(|(h, _)| {
            if o.sample >= 1.0 {
                return true;
            }
            let mut k = blake3::Hasher::new_keyed(salt.as_bytes());
            k.update(&h.0);
            let x = u64::from_be_bytes(k.finalize().as_bytes()[..8].try_into().expect("8 bytes"));
            (x as f64) < o.sample * u64::MAX as f64
        })
        .copied()
        .collect();
    let done = obs.start("verifying", picked.iter().map(|p| p.1).sum());
    let mut checks = futures_util::stream::iter(picked.into_iter().map(|(h, size)| {
        let (t, done) = (t.clone(), done.clone());
        async move {
            let r = blob::verify(&t, &h, size).await;
            done.fetch_add(size, Ordering::Relaxed);
            (h, size, r)
        }
    }))
    .buffer_unordered(o.parallel.max(1));
    let mut failed = None;
    while let Some((h, size, r)) = checks.next().await {
        report.blobs_checked += 1;
        report.bytes_checked += size;
        match r {
            Ok(blob::Check::Ok) => {}
            Ok(blob::Check::Missing) => report.missing.push(h.to_hex()),
            Ok(blob::Check::Corrupt(why)) => report.corrupt.push(format!("{} ({why})", h.to_hex())),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(checks);
    obs.end("verifying");
    if let Some(e) = failed {
        return Err(e.into());
    }
    if o.repair && (!report.missing.is_empty() || !report.corrupt.is_empty()) {
        let bad: Vec<BlobHash> = report
            .missing
            .iter()
            .chain(&report.corrupt)
            .filter_map(|s| BlobHash::from_hex(&s[..64.min(s.len())]).ok())
            .collect();
        let r = match cluster {
            Some(c) => repair(c, obs, t, &list, &bad).await,
            None => Err(BackupOpError::Invalid(
                "repair needs the metadata service to find the blobs' holders".into(),
            )),
        };
        match r {
            Ok(()) => report.repaired = bad.iter().map(BlobHash::to_hex).collect(),
            Err(e) => report.repair_error = Some(e.to_string()),
        }
    }
    report.duration_s = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Has the nodes holding `bad` upload them again, replacing what the target holds.
async fn repair(
    c: &dyn BackupCluster,
    obs: &dyn Observer,
    t: &Target,
    list: &BlobList,
    bad: &[BlobHash],
) -> Result<()> {
    let up = c.live_nodes().await?;
    let mut planned = Vec::new();
    for chunk in bad.chunks(1000) {
        let found = c.holders(chunk.to_vec()).await?;
        for (h, nodes) in chunk.iter().zip(found) {
            let size = list
                .0
                .binary_search_by(|(x, _)| x.0.cmp(&h.0))
                .map(|i| list.0[i].1)
                .unwrap_or(0);
            planned.push(locus_metadata::snapshot::PlannedBlob {
                hash: *h,
                size,
                chunk_size: 0,
                replicas: nodes,
            });
        }
    }
    let send = SendMode {
        parallel: 4,
        overwrite: true,
    };
    let mut report = RunReport::default();
    send_blobs(c, obs, &up, planned.iter().collect(), t, send, &mut report).await
}

#[cfg(test)]
mod tests;
