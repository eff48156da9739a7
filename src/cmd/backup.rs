//! `locus backup run|list|verify|gc` and `locus restore`: the cluster's safety net in
//! object storage.
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
//!
//! Why this file is still long: it holds the orchestration of run, verify, gc and restore
//! as well as their arguments and printing. Import has moved to library code
//! (`locus::ops::import`, which restore --dataset calls); these four are next, into
//! `locus::ops` the same way (plain options in, reports and typed errors out, progress to
//! an `Observer`), leaving only parsing and printing here.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use futures_util::StreamExt;
use locus_backup::format::{now_ms, DatasetSummary};
use locus_backup::retention::Policy;
use locus_backup::{blob, BlobList, Committed, SnapshotManifest, SnapshotState, Target};
use locus_proto::{nodepb, pb, BlobHash};
use serde::Serialize;

use crate::config::Resolved;
use crate::output::{self, Progress, StatusExt};

#[derive(Subcommand, Debug)]
pub enum BackupCmd {
    /// Back the cluster up: a consistent snapshot of the metadata plus every blob the
    /// target does not hold yet, uploaded by the nodes in parallel. The snapshot is valid
    /// only once its COMMITTED marker is written, last; an interrupted run is resumed by
    /// running it again. Exit status 0 only if the snapshot was committed.
    Run(RunArgs),
    /// List the snapshots in a backup target: id, time, datasets, bytes, new bytes,
    /// duration, state.
    List(TargetArg),
    /// Re-read and re-hash stored blobs (all, or a sample) and the catalogue of a
    /// snapshot; report missing or corrupt ones (exit status 1 if any).
    Verify(VerifyArgs),
    /// Apply retention and delete blobs no kept snapshot needs. Safe while a backup runs.
    Gc(GcArgs),
}

#[derive(Args, Debug)]
pub struct TargetArg {
    /// Backup target: file:///DIR or s3://BUCKET/PREFIX (S3 credentials and endpoint from
    /// the AWS_* environment). Default: `to` in the config file's [backup] section.
    #[arg(long, visible_alias = "target", value_name = "URL")]
    pub to: Option<String>,
}

#[derive(Args, Debug, Default)]
pub struct RetentionArgs {
    /// Keep the N newest snapshots.
    #[arg(long, value_name = "N")]
    pub keep_last: Option<u32>,
    /// Keep the newest snapshot of each of the last N days that have one.
    #[arg(long, value_name = "N")]
    pub keep_daily: Option<u32>,
    /// Keep the newest snapshot of each of the last N ISO weeks that have one.
    #[arg(long, value_name = "N")]
    pub keep_weekly: Option<u32>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub target: TargetArg,
    /// After a committed run, apply this retention and collect garbage (also read from
    /// the config file's [backup] section). Without any, nothing is deleted.
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Uploads in flight per node.
    #[arg(long, default_value_t = 4)]
    pub parallel: u32,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub target: TargetArg,
    /// Snapshot to verify [default: the newest committed one].
    #[arg(long, value_name = "ID")]
    pub snapshot: Option<String>,
    /// Fraction of the snapshot's blobs to re-read, chosen at random (0 < F ≤ 1).
    #[arg(long, default_value_t = 1.0, value_name = "FRACTION")]
    pub sample: f64,
    /// Blobs read at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Mend what is found: nodes holding a missing or corrupt blob upload it again
    /// (needs the metadata service and an admin token). Exit status 0 if all were mended.
    #[arg(long)]
    pub repair: bool,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    #[command(flatten)]
    pub target: TargetArg,
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Incomplete snapshots older than this are taken as abandoned runs and deleted;
    /// younger ones may still be running and their blobs are kept.
    #[arg(long, default_value = "24h", value_name = "DURATION")]
    pub abandoned_after: String,
    /// Report what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Backup target to restore from (file:///DIR or s3://BUCKET/PREFIX).
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// Snapshot to restore [default: the newest committed one].
    #[arg(long, value_name = "ID")]
    pub snapshot: Option<String>,
    /// Rebuild a whole metadata service here: a new data dir, which must not exist or be
    /// empty. Start the service on it afterwards (`locus metadata serve --data-dir DIR`).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "dataset",
        conflicts_with = "dataset"
    )]
    pub data_dir: Option<PathBuf>,
    /// Or bring one version back into the running cluster (a deleted dataset, say):
    /// NAME[@VERSION] as the snapshot holds it [default version: its newest there]. It
    /// becomes the next version of the dataset (numbers are never reused); blobs come
    /// from nodes that still hold them, else from the backup.
    #[arg(long, value_name = "NAME[@VERSION]")]
    pub dataset: Option<String>,
    /// With --dataset: restore under this dataset name instead.
    #[arg(long = "as", value_name = "NAME", requires = "dataset")]
    pub as_name: Option<String>,
    /// With --dataset: replicas of every shard [default: as the version had].
    #[arg(long, value_name = "R", requires = "dataset")]
    pub replicas: Option<u32>,
}

pub async fn run(cmd: BackupCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Run(a) => backup_run(a, cfg).await,
        BackupCmd::List(a) => list(&open_target(&a, cfg)?, cfg).await,
        BackupCmd::Verify(a) => verify(a, cfg).await,
        BackupCmd::Gc(a) => gc(a, cfg).await,
    }
}

fn open_target(a: &TargetArg, cfg: &Resolved) -> anyhow::Result<Target> {
    let Some(url) = a.to.clone().or_else(|| cfg.backup.to.clone()) else {
        bail!("no backup target: give --to URL or set `to` in the config file's [backup] section");
    };
    Ok(Target::open(&url)?)
}

fn policy(r: &RetentionArgs, cfg: &Resolved) -> Policy {
    Policy {
        keep_last: r.keep_last.or(cfg.backup.keep_last).unwrap_or(0),
        keep_daily: r.keep_daily.or(cfg.backup.keep_daily).unwrap_or(0),
        keep_weekly: r.keep_weekly.or(cfg.backup.keep_weekly).unwrap_or(0),
    }
}

/// The `--json` report of a run, also printed (with `errors`) when it fails.
#[derive(Debug, Default, Serialize)]
struct RunReport {
    snapshot: String,
    target: String,
    committed: bool,
    datasets: usize,
    versions: usize,
    blobs: u64,
    bytes_scanned: u64,
    blobs_uploaded: u64,
    bytes_uploaded: u64,
    blobs_skipped: u64,
    bytes_skipped: u64,
    catalog_bytes: u64,
    duration_s: f64,
    gc: Option<locus_backup::gc::GcReport>,
    errors: Vec<String>,
}

async fn backup_run(a: RunArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let t = open_target(&a.target, cfg)?;
    let start = Instant::now();
    let started_ms = now_ms();
    let id = locus_backup::format::new_snapshot_id(started_ms);
    let mut report = RunReport {
        snapshot: id.clone(),
        target: t.url.clone(),
        ..Default::default()
    };
    let r = backup_inner(&a, cfg, &t, &id, started_ms, &mut report).await;
    report.duration_s = start.elapsed().as_secs_f64();
    if let Err(e) = &r {
        report.errors.push(format!("{e:#}"));
    }
    if cfg.json {
        output::json(&report)?;
    } else if r.is_ok() {
        println!(
            "snapshot {} committed to {}: {} dataset(s), {} version(s), {} blobs ({}); uploaded {} blobs ({}), \
             skipped {} already stored ({}); {:.1}s",
            id,
            t.url,
            report.datasets,
            report.versions,
            report.blobs,
            output::size(report.bytes_scanned),
            report.blobs_uploaded,
            output::size(report.bytes_uploaded),
            report.blobs_skipped,
            output::size(report.bytes_skipped),
            report.duration_s
        );
        if let Some(g) = &report.gc {
            println!(
                "retention: kept {} snapshot(s), deleted {}; deleted {} unreferenced blobs ({})",
                g.snapshots_kept.len(),
                g.snapshots_deleted.len(),
                g.blobs_deleted,
                output::size(g.bytes_deleted)
            );
        }
    }
    r.with_context(|| {
        format!(
            "backup to {} failed; snapshot {id} was not committed (earlier snapshots are untouched; \
             rerun to resume: blobs already stored are not sent again)",
            t.url
        )
    })
}

async fn backup_inner(
    a: &RunArgs,
    cfg: &Resolved,
    t: &Target,
    id: &str,
    started_ms: i64,
    report: &mut RunReport,
) -> anyhow::Result<()> {
    let gc_at_start = t.gc_state().await?;
    let mut m = cfg.connect().await?;

    // 1. The catalogue, as of one instant, into a temp file (it may be large).
    let mut file = tempfile::tempfile().context("cannot create a temp file for the catalogue")?;
    let mut stream = m.export_catalog(pb::ExportCatalogRequest {}).await.or_status()?;
    let mut hasher = blake3::Hasher::new();
    let mut catalog_bytes = 0u64;
    let exporting = Progress::new("exporting the catalogue", 0);
    while let Some(c) = stream.next().await {
        let c = c.map_err(output::status_error).context("catalogue export")?;
        hasher.update(&c.data);
        catalog_bytes += c.data.len() as u64;
        exporting.done.fetch_add(c.data.len() as u64, Ordering::Relaxed);
        file.write_all(&c.data)
            .context("writing the catalogue to a temp file")?;
    }
    exporting.finish();
    let catalog_hash = BlobHash(*hasher.finalize().as_bytes());
    report.catalog_bytes = catalog_bytes;

    // 2. What the snapshot needs, and who sends it.
    let mut reader = file.try_clone()?;
    let plan = tokio::task::spawn_blocking(move || {
        use std::io::Seek;
        reader.rewind()?;
        Ok::<_, anyhow::Error>(locus_metadata::snapshot::plan(reader)?)
    })
    .await??;
    let up = live_nodes(&mut m).await?;
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
        Some(p) => t.blob_list(&p.id).await?,
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
        bail!(
            "blob {} has no live replica to read from (replicas: {}); bring its nodes back or let \
             repair finish, then rerun",
            b.hash,
            b.replicas.join(", ")
        );
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
    t.put_bytes(&t.snapshot_key(id, "blobs"), list.encode()).await?;

    // 4. The catalogue, checked against the hash taken while it was exported.
    let cat = tokio::fs::File::from_std(file.try_clone()?);
    let cat = {
        use tokio::io::AsyncSeekExt;
        let mut cat = cat;
        cat.rewind().await?;
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
        parallel: a.parallel,
        overwrite: false,
    };
    send_blobs(cfg, &up, todo, t, send, report).await?;

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
        send_blobs(cfg, &up, plan.blobs.iter().collect(), t, send, &mut again).await?;
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
    if let Err(e) = m
        .record_backup(pb::RecordBackupRequest {
            url: t.url.clone(),
            snapshot: id.to_string(),
        })
        .await
    {
        eprintln!(
            "warning: snapshot {id} is committed, but the metadata service did not record {} as a \
             source for lost blobs: {}",
            t.url,
            e.message()
        );
    }

    let p = policy(&a.retention, cfg);
    if !p.is_empty() {
        report.gc = Some(locus_backup::gc::collect(t, p, Duration::from_secs(86_400), false).await?);
    }
    Ok(())
}

/// Live nodes: id → address.
async fn live_nodes(m: &mut locus_proto::client::MetadataClient) -> anyhow::Result<HashMap<String, String>> {
    let nodes = m.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
    Ok(nodes
        .into_iter()
        .filter(|n| n.state == pb::NodeState::Up as i32)
        .map(|n| (n.id, n.address))
        .collect())
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
    cfg: &Resolved,
    up: &HashMap<String, String>,
    blobs: Vec<&locus_metadata::snapshot::PlannedBlob>,
    t: &Target,
    send: SendMode,
    report: &mut RunReport,
) -> anyhow::Result<()> {
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
                bail!(
                    "no live replica could send blob {h} (tried {}): {why}",
                    tried.join(", ")
                );
            };
            tried.push(n.clone());
            per_node.entry(n.clone()).or_default().push(nodepb::BlobRef {
                hash: h.0.to_vec(),
                size: b.size,
            });
        }
        let (sums, failed) = upload_from_nodes(cfg, up, &per_node, t, send).await?;
        report.blobs_uploaded += sums.0;
        report.bytes_uploaded += sums.1;
        report.blobs_skipped += sums.2;
        report.bytes_skipped += sums.3;
        for (h, node, why) in &failed {
            eprintln!("warning: node {node} could not send blob {h} ({why}); asking another replica");
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
    cfg: &Resolved,
    up: &HashMap<String, String>,
    per_node: &BTreeMap<String, Vec<nodepb::BlobRef>>,
    t: &Target,
    send: SendMode,
) -> anyhow::Result<(Sums, Vec<(BlobHash, String, String)>)> {
    let total: u64 = per_node.values().flatten().map(|b| b.size).sum();
    if total == 0 && per_node.values().all(Vec::is_empty) {
        return Ok(((0, 0, 0, 0), Vec::new()));
    }
    let progress = Progress::new("uploading", total);
    let mut set = tokio::task::JoinSet::new();
    for (node, blobs) in per_node {
        let addr = up[node].clone();
        let (node, blobs, token) = (node.clone(), blobs.clone(), cfg.token.clone());
        let (url, done) = (t.url.clone(), progress.done.clone());
        set.spawn(async move {
            let r = async {
                let mut c =
                    locus_proto::client::connect_node(&addr, token.as_deref(), Duration::from_secs(5))
                        .await
                        .map_err(|e| anyhow::anyhow!("cannot reach it at {addr}: {e}"))?;
                // Batches keep each request far below the gRPC message limit, however many
                // blobs a node sends (a 1M-file dataset is ~45 MB of blob references).
                let mut total = nodepb::UploadProgress::default();
                // A working node reports at least every 5 s (UploadBlobs); one silent
                // for the peer timeout hangs, and the run says so instead of waiting.
                let idle = locus_proto::net::peer_idle().max(Duration::from_secs(10));
                let silent = || {
                    anyhow::anyhow!(
                        "{addr} sent no progress for {}s (LOCUS_PEER_TIMEOUT)",
                        idle.as_secs_f64()
                    )
                };
                for batch in blobs.chunks(UPLOAD_BATCH) {
                    let open = c.upload_blobs(nodepb::UploadBlobsRequest {
                        target: url.clone(),
                        blobs: batch.to_vec(),
                        skip_existing: !send.overwrite,
                        parallel: send.parallel,
                    });
                    let mut s = tokio::time::timeout(idle, open)
                        .await
                        .map_err(|_| silent())?
                        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
                        .into_inner();
                    let mut last = nodepb::UploadProgress::default();
                    let mut counted = 0;
                    loop {
                        let Some(p) = tokio::time::timeout(idle, s.next()).await.map_err(|_| silent())?
                        else {
                            break;
                        };
                        let p = p.map_err(|s| anyhow::anyhow!("{}", s.message()))?;
                        let now = p.bytes_uploaded + p.bytes_skipped;
                        done.fetch_add(now - counted, Ordering::Relaxed);
                        counted = now;
                        last = p;
                    }
                    if !last.finished {
                        bail!("the node ended the upload without finishing it");
                    }
                    total.blobs_uploaded += last.blobs_uploaded;
                    total.bytes_uploaded += last.bytes_uploaded;
                    total.blobs_skipped += last.blobs_skipped;
                    total.bytes_skipped += last.bytes_skipped;
                    total.failed.extend(last.failed);
                }
                let last = total;
                Ok(last)
            }
            .await;
            (node, r)
        });
    }
    let mut sums = (0, 0, 0, 0);
    let mut failed = Vec::new();
    let mut errors = Vec::new();
    while let Some(r) = set.join_next().await {
        let (node, r) = r?;
        match r {
            Ok(p) => {
                sums.0 += p.blobs_uploaded;
                sums.1 += p.bytes_uploaded;
                sums.2 += p.blobs_skipped;
                sums.3 += p.bytes_skipped;
                for f in p.failed {
                    let h = BlobHash::from_slice("hash", &f.hash)
                        .map_err(|e| anyhow::anyhow!("node {node}: {e}"))?;
                    failed.push((h, node.clone(), f.reason));
                }
            }
            Err(e) => errors.push(format!("node {node}: {e:#}")),
        }
    }
    progress.finish();
    if !errors.is_empty() {
        bail!("{}", errors.join("; "));
    }
    Ok((sums, failed))
}

async fn list(t: &Target, cfg: &Resolved) -> anyhow::Result<()> {
    let snaps = t.list_snapshots().await?;
    if cfg.json {
        return output::json(&snaps);
    }
    let rows: Vec<Vec<String>> = snaps
        .iter()
        .map(|s| {
            let m = s.manifest.as_ref();
            let c = s.committed.as_ref();
            vec![
                s.id.clone(),
                output::time(s.created_ms()),
                match (s.state, s.damage.is_empty()) {
                    (SnapshotState::Committed, true) => "committed".into(),
                    (SnapshotState::Incomplete, true) => "incomplete".into(),
                    (SnapshotState::Committed, false) => "committed, DAMAGED".into(),
                    (SnapshotState::Incomplete, false) => "incomplete, DAMAGED".into(),
                },
                m.map(|m| {
                    m.datasets
                        .iter()
                        .map(|d| format!("{}({})", d.name, d.versions.len()))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_else(|| "-".into()),
                m.map(|m| output::size(m.blob_bytes))
                    .unwrap_or_else(|| "-".into()),
                c.map(|c| output::size(c.bytes_uploaded))
                    .unwrap_or_else(|| "-".into()),
                c.map(|c| format!("{:.1}s", (c.finished_ms - c.started_ms) as f64 / 1000.0))
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    output::table(
        &[
            "ID",
            "TIME",
            "STATE",
            "DATASETS",
            "BYTES",
            "NEW BYTES",
            "DURATION",
        ],
        &rows,
    );
    Ok(())
}

#[derive(Debug, Default, Serialize)]
struct VerifyReport {
    snapshot: String,
    catalog_ok: bool,
    blobs_total: u64,
    blobs_checked: u64,
    bytes_checked: u64,
    missing: Vec<String>,
    corrupt: Vec<String>,
    /// Blobs uploaded again from the cluster (--repair).
    repaired: Vec<String>,
    duration_s: f64,
}

async fn verify(a: VerifyArgs, cfg: &Resolved) -> anyhow::Result<()> {
    if !(a.sample > 0.0 && a.sample <= 1.0) {
        bail!("--sample must be a fraction in (0, 1], not {}", a.sample);
    }
    let t = open_target(&a.target, cfg)?;
    let start = Instant::now();
    let snap = t.committed_snapshot(a.snapshot.as_deref()).await?;
    let manifest = snap
        .manifest
        .clone()
        .with_context(|| format!("snapshot {} has no manifest.json", snap.id))?;
    let mut report = VerifyReport {
        snapshot: snap.id.clone(),
        ..Default::default()
    };
    let cat = BlobHash::from_hex(&manifest.catalog_blake3).map_err(|e| anyhow::anyhow!("{e}"))?;
    report.catalog_ok = match blob::download(&t, &t.snapshot_key(&snap.id, "catalog"), None).await {
        Ok((n, h)) => n == manifest.catalog_bytes && h == cat,
        Err(e) if e.is_not_found() => false,
        Err(e) => return Err(e.into()),
    };
    let list = t.blob_list(&snap.id).await?;
    report.blobs_total = list.0.len() as u64;
    // A different random sample each run: over many nights every blob gets read.
    let salt = blake3::hash(format!("{}{:?}", now_ms(), std::process::id()).as_bytes());
    let picked: Vec<(BlobHash, u64)> = list
        .0
        .iter()
        .filter(|(h, _)| {
            if a.sample >= 1.0 {
                return true;
            }
            let mut k = blake3::Hasher::new_keyed(salt.as_bytes());
            k.update(&h.0);
            let x = u64::from_be_bytes(k.finalize().as_bytes()[..8].try_into().expect("8 bytes"));
            (x as f64) < a.sample * u64::MAX as f64
        })
        .copied()
        .collect();
    let progress = Progress::new("verifying", picked.iter().map(|p| p.1).sum());
    let done = progress.done.clone();
    let tt = t.clone();
    let mut checks = futures_util::stream::iter(picked.into_iter().map(|(h, size)| {
        let (t, done) = (tt.clone(), done.clone());
        async move {
            let r = blob::verify(&t, &h, size).await;
            done.fetch_add(size, Ordering::Relaxed);
            (h, size, r)
        }
    }))
    .buffer_unordered(a.parallel.max(1));
    while let Some((h, size, r)) = checks.next().await {
        report.blobs_checked += 1;
        report.bytes_checked += size;
        match r? {
            blob::Check::Ok => {}
            blob::Check::Missing => report.missing.push(h.to_hex()),
            blob::Check::Corrupt(why) => report.corrupt.push(format!("{} ({why})", h.to_hex())),
        }
    }
    progress.finish();
    let mut repair_error = None;
    if a.repair && (!report.missing.is_empty() || !report.corrupt.is_empty()) {
        let bad: Vec<BlobHash> = report
            .missing
            .iter()
            .chain(&report.corrupt)
            .filter_map(|s| BlobHash::from_hex(&s[..64.min(s.len())]).ok())
            .collect();
        match repair(cfg, &t, &list, &bad).await {
            Ok(()) => report.repaired = bad.iter().map(BlobHash::to_hex).collect(),
            Err(e) => repair_error = Some(e),
        }
    }
    report.duration_s = start.elapsed().as_secs_f64();
    let mended = |h: &String| report.repaired.iter().any(|r| h.starts_with(r.as_str()));
    let bad = !report.catalog_ok
        || report.missing.iter().any(|h| !mended(h))
        || report.corrupt.iter().any(|h| !mended(h));
    if cfg.json {
        output::json(&report)?;
    } else {
        println!(
            "snapshot {}: catalogue {}; {} of {} blobs re-read ({}): {} missing, {} corrupt; {:.1}s",
            report.snapshot,
            if report.catalog_ok {
                "ok"
            } else {
                "MISSING OR CORRUPT"
            },
            report.blobs_checked,
            report.blobs_total,
            output::size(report.bytes_checked),
            report.missing.len(),
            report.corrupt.len(),
            report.duration_s
        );
        for h in &report.missing {
            println!("missing  {h}");
        }
        for h in &report.corrupt {
            println!("corrupt  {h}");
        }
        for h in &report.repaired {
            println!("repaired {h}");
        }
    }
    if let Some(e) = repair_error {
        return Err(e.context(format!(
            "snapshot {} failed verification and repair",
            report.snapshot
        )));
    }
    if bad {
        bail!("snapshot {} failed verification", report.snapshot);
    }
    Ok(())
}

/// Has the nodes holding `bad` upload them again, replacing what the target holds.
async fn repair(cfg: &Resolved, t: &Target, list: &BlobList, bad: &[BlobHash]) -> anyhow::Result<()> {
    let mut m = cfg.connect().await?;
    let up = live_nodes(&mut m).await?;
    let mut planned = Vec::new();
    for chunk in bad.chunks(1000) {
        let found = m
            .locate_blobs(pb::LocateBlobsRequest {
                hashes: chunk.iter().map(|h| h.0.to_vec()).collect(),
            })
            .await
            .or_status()?
            .blobs;
        for (h, loc) in chunk.iter().zip(found) {
            let size = list
                .0
                .binary_search_by(|(x, _)| x.0.cmp(&h.0))
                .map(|i| list.0[i].1)
                .unwrap_or(0);
            planned.push(locus_metadata::snapshot::PlannedBlob {
                hash: *h,
                size,
                chunk_size: 0,
                replicas: loc.nodes,
            });
        }
    }
    let send = SendMode {
        parallel: 4,
        overwrite: true,
    };
    let mut report = RunReport::default();
    send_blobs(cfg, &up, planned.iter().collect(), t, send, &mut report).await
}

async fn gc(a: GcArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let t = open_target(&a.target, cfg)?;
    let abandoned = crate::config::duration_arg("--abandoned-after", &a.abandoned_after)?;
    let r = locus_backup::gc::collect(&t, policy(&a.retention, cfg), abandoned, a.dry_run).await?;
    if cfg.json {
        return output::json(&r);
    }
    let verb = if a.dry_run { "would delete" } else { "deleted" };
    println!(
        "kept {} snapshot(s), {verb} {} ({}); {} in progress kept; kept {} blobs, {verb} {} ({})",
        r.snapshots_kept.len(),
        r.snapshots_deleted.len(),
        r.snapshots_deleted.join(", "),
        r.snapshots_in_progress.len(),
        r.blobs_kept,
        r.blobs_deleted,
        output::size(r.bytes_deleted)
    );
    Ok(())
}

pub async fn restore(a: RestoreArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let dir = a.data_dir.clone().map(crate::absolute);
    if let Some(dir) = &dir {
        if let Ok(mut rd) = std::fs::read_dir(dir) {
            if rd.next().is_some() {
                bail!(
                    "{} is not empty: restore only into a new or empty data dir (nothing was changed)",
                    dir.display()
                );
            }
        }
    }
    let t = Target::open(&a.from)?;
    let snap = t.committed_snapshot(a.snapshot.as_deref()).await?;
    let manifest = snap
        .manifest
        .clone()
        .with_context(|| format!("snapshot {} has no manifest.json", snap.id))?;
    // Downloaded to a temp file and checked whole before anything is written.
    let mut file = tempfile::tempfile().context("cannot create a temp file for the catalogue")?;
    let (n, h) = blob::download(&t, &t.snapshot_key(&snap.id, "catalog"), Some(&mut file)).await?;
    if n != manifest.catalog_bytes || h.to_hex() != manifest.catalog_blake3 {
        bail!(
            "the catalogue of snapshot {} does not match its manifest (damaged); try an older \
             snapshot with --snapshot",
            snap.id
        );
    }
    let Some(dir) = dir else {
        return restore_version(&a, cfg, &t, &snap.id, file).await;
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let db = dir.join("db");
    let (url, id) = (t.url.clone(), snap.id.clone());
    let db2 = db.clone();
    let r = tokio::task::spawn_blocking(move || {
        let store = locus_metadata::store::RocksStore::open(&db2)?;
        use std::io::Seek;
        file.rewind()?;
        let st = locus_metadata::snapshot::restore(file, &store, &url, &id)?;
        Ok::<_, anyhow::Error>(st)
    })
    .await?;
    let st = match r {
        Ok(st) => st,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&db);
            return Err(e.context("restore failed; the data dir was left empty"));
        }
    };
    let versions: usize = manifest.datasets.iter().map(|d| d.versions.len()).sum();
    if cfg.json {
        return output::json(&serde_json::json!({
            "snapshot": snap.id,
            "data_dir": dir,
            "rows": st.rows,
            "datasets": manifest.datasets,
            "blobs": manifest.blobs,
            "blob_bytes": manifest.blob_bytes,
        }));
    }
    println!(
        "restored snapshot {} ({}) into {}: {} dataset(s), {} version(s), {} blobs ({}).\n\
         Next: start `locus metadata serve --data-dir {}`, then the cache nodes. Nodes refill \
         their replicas from {} (blobs no node holds are read from the backup), or run \
         `locus warm` to bring a version onto chosen nodes first.",
        snap.id,
        output::time(manifest.created_ms),
        dir.display(),
        manifest.datasets.len(),
        versions,
        manifest.blobs,
        output::size(manifest.blob_bytes),
        dir.display(),
        t.url
    );
    Ok(())
}

/// `restore --dataset`: one version of the snapshot imported again into the running
/// cluster, through the import path (placement, verified writes to the nodes, one commit).
async fn restore_version(
    a: &RestoreArgs,
    cfg: &Resolved,
    t: &Target,
    snapshot: &str,
    mut file: std::fs::File,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let want = a.dataset.clone().unwrap_or_default();
    let r: locus_proto::DatasetRef = want
        .parse()
        .map_err(|e: locus_proto::InvalidInput| anyhow::anyhow!("--dataset {want}: {}", e.reason))?;
    let name = r.name.to_string();
    let number = match r.version {
        locus_proto::VersionSel::Latest => None,
        locus_proto::VersionSel::Number(n) => Some(n),
    };
    let name = name.as_str();
    let (n2, num) = (name.to_string(), number);
    let v = tokio::task::spawn_blocking(move || {
        use std::io::Seek;
        file.rewind()?;
        Ok::<_, anyhow::Error>(locus_metadata::snapshot::version_from_export(file, &n2, num)?)
    })
    .await??;
    let mut blobs = HashMap::new();
    let mut shard_blobs = Vec::with_capacity(v.shard_blobs.len());
    for sb in &v.shard_blobs {
        for (h, size) in sb {
            blobs.insert(*h, (locus::ops::scan::BlobSource::Remote(t.blob_key(h)), *size));
        }
        shard_blobs.push(sb.iter().map(|(h, _)| *h).collect());
    }
    let scanned = locus::ops::scan::Scanned {
        entries: v.entries,
        shards: v.shards,
        blobs,
        shard_blobs,
    };
    let o = locus::ops::import::ImportOptions {
        name: a.as_name.clone().unwrap_or_else(|| name.to_string()),
        source: t.url.clone(),
        replicas: match a.replicas {
            Some(0) => bail!("--replicas must be at least 1"),
            Some(r) => r,
            None => v.replication.max(1),
        },
        // The snapshot's shards are reused as they were: no new grouping.
        shard_size: 0,
        chunk_size: v.chunk_size,
        parallel: 8,
        token: cfg.token.clone(),
    };
    if !cfg.json {
        println!(
            "restoring {}@{} from snapshot {snapshot} as the next version of {}",
            v.dataset, v.number, o.name
        );
    }
    let mut m = cfg.connect().await?;
    let report = locus::ops::import::commit_scanned(
        &mut m,
        &o,
        &scanned,
        Some(t.store.clone()),
        v.origin,
        &crate::output::TermObserver::default(),
        started,
        Duration::ZERO,
    )
    .await?;
    super::import::print_report(&report, cfg)?;
    // The backup is now a source for this version's blobs too.
    let _ = m
        .record_backup(pb::RecordBackupRequest {
            url: t.url.clone(),
            snapshot: snapshot.to_string(),
        })
        .await;
    Ok(())
}
