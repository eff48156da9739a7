//! Import: a directory or an object-store prefix becomes the next version of a dataset,
//! its blobs replicated onto cache nodes.
//!
//! Order of work, chosen so that nothing half-done is ever visible: hash everything, open
//! an import session and upload the manifest, ask for a placement (and stop, aborting the
//! session, if any shard cannot be placed), send each node the blobs its shards need that
//! it does not already have (nodes verify every byte), then record the replicas and
//! commit. An interrupted import leaves only an uncommitted session, which the service
//! discards; rerunning it skips every blob the nodes already hold. A node that takes no
//! bytes for `LOCUS_PEER_TIMEOUT` fails the import instead of stalling it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::{pb, BlobHash};
use tokio::task::JoinSet;

use super::cluster::{ImportCluster, Upload};
use super::scan::Scanned;
use super::{status_sentence, Observer, SourceError};

/// What to import and how.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The dataset; the import becomes its next version.
    pub name: String,
    /// A local directory, `file://PATH`, or an `s3://`, `gs://` or `az://` URL.
    pub source: String,
    pub replicas: u32,
    /// Target shard size in bytes.
    pub shard_size: u64,
    /// A power of two from 64 KiB to 1 GiB.
    pub chunk_size: u32,
    /// Blob uploads in flight at once.
    pub parallel: usize,
    /// The token presented to nodes.
    pub token: Option<String>,
}

/// What an import did.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub version: pb::Version,
    pub replicas: u32,
    pub distinct_blobs: usize,
    pub uploaded_bytes: u64,
    pub skipped_bytes: u64,
    pub hash_time: Duration,
    pub upload_time: Duration,
    pub total_time: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The options or the source are not usable.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Some shard had no room on the cluster; nothing was committed.
    #[error("{0}")]
    Unplaced(String),
    #[error("{}", status_sentence(.0))]
    Metadata(#[from] tonic::Status),
    /// Sending blobs to a node failed (it refused, stalled, or the bytes did not match).
    #[error("{0}")]
    Transfer(String),
}

type Result<T, E = ImportError> = std::result::Result<T, E>;

/// Imports `o.source` as the next version of `o.name`.
pub async fn import(
    cluster: &Arc<dyn ImportCluster>,
    o: &ImportOptions,
    obs: &dyn Observer,
) -> Result<ImportReport> {
    let started = Instant::now();
    locus_proto::DatasetName::try_from(o.name.as_str()).map_err(|e| ImportError::Invalid(e.to_string()))?;
    if !o.chunk_size.is_power_of_two()
        || !(locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(&o.chunk_size)
    {
        return Err(ImportError::Invalid(
            "--chunk-size must be a power of two from 64KiB to 1GiB".into(),
        ));
    }
    if o.replicas == 0 {
        return Err(ImportError::Invalid("--replicas must be at least 1".into()));
    }
    let remote = if o.source.contains("://") && !o.source.starts_with("file://") {
        Some(super::remote::open(&o.source)?)
    } else {
        None
    };
    let source = PathBuf::from(o.source.strip_prefix("file://").unwrap_or(&o.source));
    if remote.is_none() && !source.is_dir() {
        return Err(ImportError::Invalid(format!(
            "{} is not a directory",
            source.display()
        )));
    }
    let (chunk_size, shard_size) = (o.chunk_size, o.shard_size.max(1));

    // 1. Hash.
    let total_guess = if remote.is_some() { 0 } else { dir_bytes(&source) };
    let done = obs.start("hashing", total_guess);
    let hashing_started = Instant::now();
    let scanned = match &remote {
        Some(r) => super::remote::scan(r, chunk_size, shard_size, o.parallel, done).await,
        None => {
            let src = source.clone();
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
            tokio::task::spawn_blocking(move || {
                super::scan::scan_dir_parallel(&src, chunk_size, shard_size, threads, &|n| {
                    done.store(n, Ordering::Relaxed)
                })
            })
            .await
            .map_err(|e| ImportError::Source(SourceError(format!("hashing failed: {e}"))))?
        }
    };
    obs.end("hashing");
    let scanned = scanned?;
    let hash_time = hashing_started.elapsed();
    let store = remote.as_ref().map(|r| r.store.clone());
    // Where the bytes came from: the mount's last source when no node has them.
    let origin = match &remote {
        Some(_) => o.source.clone(),
        None => {
            let abs = std::fs::canonicalize(&source)
                .or_else(|_| std::env::current_dir().map(|d| d.join(&source)))
                .unwrap_or_else(|_| source.clone());
            format!(
                "file://{}",
                locus_fuse::origin::encode_path(&abs.display().to_string())
            )
        }
    };
    commit_scanned(cluster, o, &scanned, store, origin, obs, started, hash_time).await
}

/// Sends an already hashed manifest's blobs to the nodes and commits it as the next
/// version of `o.name` — for a scanned source, or a version read back from a backup.
#[allow(clippy::too_many_arguments)]
pub async fn commit_scanned(
    cluster: &Arc<dyn ImportCluster>,
    o: &ImportOptions,
    scanned: &Scanned,
    store: Option<Arc<dyn object_store::ObjectStore>>,
    origin: String,
    obs: &dyn Observer,
    started: Instant,
    hash_time: Duration,
) -> Result<ImportReport> {
    // 2. Session and manifest.
    let session = cluster
        .begin(pb::BeginVersionRequest {
            dataset: o.name.clone(),
            chunk_size: o.chunk_size,
            origin,
            replication: o.replicas,
        })
        .await?;
    let result = import_into_session(o, store, cluster, session, scanned, obs).await;
    let (placement, uploaded, skipped, upload_time) = match result {
        Ok(r) => r,
        Err(e) => {
            // Leave nothing behind: the session's manifest is dropped now, not at expiry.
            cluster.abort(session).await;
            return Err(e);
        }
    };
    let mut shards = scanned.shards.clone();
    for s in &mut shards {
        s.replicas = placement.get(&s.id).cloned().unwrap_or_default();
    }
    let committed = async {
        cluster.put_shards(session, shards).await?;
        cluster.commit(session).await
    };
    let version = match committed.await {
        Ok(v) => v,
        Err(e) => {
            cluster.abort(session).await;
            return Err(e.into());
        }
    };
    Ok(ImportReport {
        version,
        replicas: o.replicas,
        distinct_blobs: scanned.blobs.len(),
        uploaded_bytes: uploaded,
        skipped_bytes: skipped,
        hash_time,
        upload_time,
        total_time: started.elapsed(),
    })
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        if let Ok(m) = std::fs::symlink_metadata(e.path()) {
            if m.is_dir() {
                total += dir_bytes(&e.path());
            } else if m.is_file() {
                total += m.len();
            }
        }
    }
    total
}

type Placement = BTreeMap<u32, Vec<String>>;

/// Uploads the manifest, places shards and sends blobs. Returns the placement and the
/// bytes sent and skipped.
async fn import_into_session(
    o: &ImportOptions,
    remote: Option<Arc<dyn object_store::ObjectStore>>,
    cluster: &Arc<dyn ImportCluster>,
    session: u64,
    scanned: &Scanned,
    obs: &dyn Observer,
) -> Result<(Placement, u64, u64, Duration)> {
    cluster.put_entries(session, scanned.entries.clone()).await?;
    let prefer = holders(cluster.as_ref(), scanned).await?;
    let placed = cluster
        .place(pb::PlaceShardsRequest {
            shards: scanned
                .shards
                .iter()
                .map(|s| pb::ShardSize {
                    id: s.id,
                    bytes: s.bytes,
                    prefer: prefer.get(&s.id).cloned().unwrap_or_default(),
                })
                .collect(),
            replication: o.replicas,
        })
        .await?;
    if !placed.unplaced.is_empty() {
        let mut msg = format!(
            "{} of {} shard(s) could not be placed; nothing was committed:",
            placed.unplaced.len(),
            scanned.shards.len()
        );
        for u in placed.unplaced.iter().take(20) {
            msg.push_str(&format!("\n  shard {}: {}", u.shard, u.reason));
        }
        if placed.unplaced.len() > 20 {
            msg.push_str(&format!("\n  … and {} more", placed.unplaced.len() - 20));
        }
        return Err(ImportError::Unplaced(msg));
    }
    let placement: Placement = placed
        .placements
        .into_iter()
        .map(|p| (p.shard, p.nodes))
        .collect();

    // What each node must hold, less what it has already.
    let mut per_node: BTreeMap<String, Vec<BlobHash>> = BTreeMap::new();
    for (shard, nodes) in &placement {
        for n in nodes {
            let v = per_node.entry(n.clone()).or_default();
            v.extend(scanned.shard_blobs[*shard as usize].iter().copied());
        }
    }
    let mut todo: Vec<(String, BlobHash)> = Vec::new();
    let mut skipped = 0u64;
    for (node, mut blobs) in per_node {
        blobs.sort();
        blobs.dedup();
        let have = cluster
            .have(&node, blobs.clone())
            .await
            .map_err(ImportError::Transfer)?;
        for (h, here) in blobs.iter().zip(have) {
            if here {
                skipped += scanned.blobs[h].1;
            } else {
                todo.push((node.clone(), *h));
            }
        }
    }

    // Send what is missing, a bounded number of blobs at a time.
    let total: u64 = todo.iter().map(|(_, h)| scanned.blobs[h].1).sum();
    let done = obs.start("uploading", total);
    let upload_started = Instant::now();
    let mut set: JoinSet<Result<()>> = JoinSet::new();
    let mut pending = todo.into_iter();
    loop {
        while set.len() < o.parallel.max(1) {
            let Some((node, h)) = pending.next() else { break };
            let (source, size) = scanned.blobs[&h].clone();
            let upload = Upload {
                hash: h,
                size,
                chunk_size: o.chunk_size,
                source: source.clone(),
                store: remote.clone(),
                done: done.clone(),
            };
            let cluster = cluster.clone();
            set.spawn(async move {
                cluster
                    .send(&node, upload)
                    .await
                    .map_err(|e| ImportError::Transfer(format!("sending {source} to node {node}: {e}")))
            });
        }
        match set.join_next().await {
            None => break,
            Some(r) => {
                let r = r
                    .map_err(|e| ImportError::Transfer(format!("upload task failed: {e}")))
                    .and_then(|x| x);
                if let Err(e) = r {
                    set.abort_all();
                    obs.end("uploading");
                    return Err(e);
                }
            }
        }
    }
    obs.end("uploading");
    Ok((placement, total, skipped, upload_started.elapsed()))
}

/// For each shard, the nodes that already hold its blobs as replicas, most bytes first,
/// so placement can choose them and nothing is sent twice.
async fn holders(cluster: &dyn ImportCluster, scanned: &Scanned) -> Result<HashMap<u32, Vec<String>>> {
    let all: Vec<BlobHash> = scanned.blobs.keys().copied().collect();
    let found = cluster.holders(all.clone()).await?;
    let at: HashMap<BlobHash, Vec<String>> = all
        .into_iter()
        .zip(found)
        .filter(|(_, nodes)| !nodes.is_empty())
        .collect();
    let mut out = HashMap::new();
    for (shard, blobs) in scanned.shard_blobs.iter().enumerate() {
        let mut bytes: HashMap<&str, u64> = HashMap::new();
        for h in blobs {
            for n in at.get(h).into_iter().flatten() {
                *bytes.entry(n).or_default() += scanned.blobs[h].1.max(1);
            }
        }
        let mut v: Vec<(&str, u64)> = bytes.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        out.insert(shard as u32, v.into_iter().map(|(n, _)| n.to_string()).collect());
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
