//! Import: a directory or an object-store prefix becomes the next version of a dataset,
//! its blobs replicated onto cache nodes.
//!
//! Both kinds of source are read once, in the same order of work, chosen so that nothing
//! half-done is ever visible: list the source (names and sizes), group files into shards
//! by size and place the shards (stopping, and aborting the session, if any cannot be
//! placed), then read each file, hashing it as it comes in, and send it to its shard's
//! nodes, which verify every byte; the manifest of what was read is uploaded with the
//! replicas and committed last. A directory is read by this client (`local`); an object
//! store by the nodes or by this client (`import_remote`, `pull`). An interrupted import
//! leaves only an uncommitted session, which the service discards; rerunning it skips
//! every blob the nodes already hold. A node that takes no bytes for `LOCUS_PEER_TIMEOUT`
//! fails the import instead of stalling it. A version read back from a backup, already
//! hashed, goes through `commit_scanned`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::{pb, BlobHash};
use tokio::task::JoinSet;

use super::cluster::{ImportCluster, NodeError, Upload};
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
    /// Who reads an object-store source.
    pub read_by: ReadBy,
}

/// Who reads the objects of an object-store import (a directory is always read here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadBy {
    /// The nodes, each object by the first node of its shard (see `pull`).
    Nodes,
    /// This client, sending each object to its nodes.
    Client,
    /// The nodes; this client for the objects a node cannot read.
    #[default]
    Auto,
}

/// What an import did.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub version: pb::Version,
    pub replicas: u32,
    pub distinct_blobs: usize,
    pub uploaded_bytes: u64,
    pub skipped_bytes: u64,
    /// Paths in the source a version cannot hold (FIFOs, sockets, devices): not imported.
    pub left_out: Vec<String>,
    pub hash_time: Duration,
    pub upload_time: Duration,
    pub total_time: Duration,
    /// Where the time went, phase by phase in order, where the import knows (a local
    /// directory: listing, reading and sending, committing).
    pub phases: Vec<(&'static str, Duration)>,
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
    /// Sending blobs to a node failed: what was being done, and why (whose fault it is:
    /// the source's, the node's, its room, the grant).
    #[error("{context}: {cause}")]
    Transfer { context: String, cause: NodeError },
    /// A task of the import itself failed (a panic): a bug, not the cluster's fault.
    #[error("{0}")]
    Internal(String),
}

impl ImportError {
    pub(crate) fn transfer(context: impl Into<String>, cause: NodeError) -> Self {
        ImportError::Transfer {
            context: context.into(),
            cause,
        }
    }
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
    if o.source.contains("://") && !o.source.starts_with("file://") {
        let remote = super::remote::open(&o.source)?;
        return import_remote(cluster, o, remote, obs, started).await;
    }
    let source = PathBuf::from(o.source.strip_prefix("file://").unwrap_or(&o.source));
    if !source.is_dir() {
        return Err(ImportError::Invalid(if source.exists() {
            format!(
                "{} is not a directory (import a directory, or an s3://, gs://, az:// prefix)",
                source.display()
            )
        } else {
            format!("{} does not exist", source.display())
        }));
    }
    // Where the bytes came from: the mount's last source when no node has them.
    let abs = std::fs::canonicalize(&source)
        .or_else(|_| std::env::current_dir().map(|d| d.join(&source)))
        .unwrap_or_else(|_| source.clone());
    let origin = format!(
        "file://{}",
        locus_backup::origin::encode_path(&abs.display().to_string())
    );
    local::import_local(cluster, o, source, origin, obs, started).await
}

/// Each shard's bytes, from the shard of each entry and its size.
fn shard_bytes(groups: &[Option<u32>], sizes: &[Option<u64>]) -> Vec<u64> {
    let mut shard_bytes: Vec<u64> = Vec::new();
    for (g, size) in groups.iter().zip(sizes) {
        if let (Some(g), Some(size)) = (g, size) {
            if shard_bytes.len() <= *g as usize {
                shard_bytes.push(0);
            }
            shard_bytes[*g as usize] += size;
        }
    }
    shard_bytes
}

/// Places shards of `shard_bytes`, preferring the nodes of `prefer`; refuses (naming
/// them) when any finds no room.
async fn place(
    cluster: &Arc<dyn ImportCluster>,
    o: &ImportOptions,
    session: u64,
    shard_bytes: &[u64],
    prefer: &HashMap<u32, Vec<String>>,
) -> Result<Placement> {
    let placed = cluster
        .place(pb::PlaceShardsRequest {
            shards: shard_bytes
                .iter()
                .enumerate()
                .map(|(id, bytes)| pb::ShardSize {
                    id: id as u32,
                    bytes: *bytes,
                    prefer: prefer.get(&(id as u32)).cloned().unwrap_or_default(),
                })
                .collect(),
            replication: o.replicas,
            session_id: session,
        })
        .await?;
    placed_or_refused(placed, shard_bytes.len())
}

/// The end of a one-pass import, every blob on its nodes: the manifest of what was read
/// (its shards are the ones placed, which depend on the sizes alone) is uploaded with
/// the placement, sealed and committed. The caller aborts the session on an error.
#[allow(clippy::too_many_arguments)]
async fn commit_read(
    cluster: &Arc<dyn ImportCluster>,
    o: &ImportOptions,
    session: u64,
    found: Vec<super::scan::Found>,
    hashes: Vec<Option<locus_proto::manifest::FileHashes>>,
    shard_bytes: &[u64],
    placement: &Placement,
    phases: &mut Vec<(&'static str, Duration)>,
) -> Result<(Scanned, pb::Version)> {
    let mut mark = Instant::now();
    let mut phase = |name: &'static str, phases: &mut Vec<_>| {
        phases.push((name, mark.elapsed()));
        mark = Instant::now();
    };
    let scanned = super::scan::assemble(found, hashes, o.shard_size.max(1))?;
    phase("assembling the manifest", phases);
    if scanned
        .shards
        .iter()
        .map(|s| s.bytes)
        .ne(shard_bytes.iter().copied())
    {
        return Err(ImportError::Source(SourceError(
            "files changed size during the import; rerun it".into(),
        )));
    }
    let mut shards = scanned.shards.clone();
    for s in &mut shards {
        s.replicas = placement.get(&s.id).cloned().unwrap_or_default();
    }
    // The manifest goes to the metadata service while this client seals the namespace
    // and stores it on the nodes: neither needs the other, and each waits on a different
    // process.
    let upload = async {
        cluster.put_entries(session, scanned.entries.clone()).await?;
        cluster.put_shards(session, shards).await?;
        Ok::<(), ImportError>(())
    };
    let ((), namespace) = tokio::try_join!(
        upload,
        super::seal::seal_and_store(cluster, o, &scanned, placement)
    )?;
    phase(
        "uploading the manifest, sealing and storing the namespace",
        phases,
    );
    let version = cluster.commit(session, namespace).await?;
    phase("committing", phases);
    Ok((scanned, version))
}

/// An object-store import, reading each object once: list (sizes only), group into
/// shards and place them, then read each object, hashing it as it streams in, and send it
/// to its shard's nodes from memory (or a spill file when large; see `read_and_send`);
/// the manifest is built from what was read and committed last. Placement prefers the
/// nodes holding what the previous version had at the same paths and sizes
/// (`previous_holders`); nodes that hold a blob take its write without storing it twice.
async fn import_remote(
    cluster: &Arc<dyn ImportCluster>,
    o: &ImportOptions,
    remote: super::remote::Remote,
    obs: &dyn Observer,
    started: Instant,
) -> Result<ImportReport> {
    let shard_size = o.shard_size.max(1);
    let (found, sizes) = super::remote::list(&remote).await?;
    // A key that cannot be a path is refused before anything is read or sent (object_store
    // already escapes `.` and `..` segments; this guards whatever else RelPath refuses).
    for f in &found {
        locus_proto::manifest::RelPath::try_from(f.rel.as_str())
            .map_err(|e| ImportError::Source(SourceError(format!("{:?}: {}", f.rel, e.reason))))?;
    }
    let groups = super::scan::group_shards(&sizes, shard_size);
    let shard_bytes = shard_bytes(&groups, &sizes);
    let prefer = previous_holders(cluster.as_ref(), &o.name, &found, &sizes, &groups).await;
    let session = cluster
        .begin(pb::BeginVersionRequest {
            dataset: o.name.clone(),
            chunk_size: o.chunk_size,
            origin: o.source.clone(),
            replication: o.replicas,
            tree_chunks: true,
        })
        .await?;
    let work = async {
        let placement = place(cluster, o, session, &shard_bytes, &prefer).await?;
        let total: u64 = sizes.iter().flatten().sum();
        let done = obs.start("importing", total);
        let todo: Vec<pull::Todo> = found
            .iter()
            .enumerate()
            .filter_map(|(i, f)| match &f.kind {
                super::scan::FoundKind::File(super::scan::BlobSource::Remote(p)) => {
                    let nodes = placement[&groups[i].expect("a file")].clone();
                    Some((i, p.clone(), f.rel.clone(), sizes[i].unwrap_or(0), nodes))
                }
                _ => None,
            })
            .collect();
        let read = match o.read_by {
            ReadBy::Client => {
                let todo = todo.into_iter().map(|t| (t.0, t.1, t.3, t.4)).collect();
                read_and_send(cluster, &remote.store, todo, found.len(), o, &done).await
            }
            ReadBy::Nodes | ReadBy::Auto => {
                pull::pull_by_nodes(cluster, &remote.store, todo, found.len(), o, &done).await
            }
        };
        obs.end("importing");
        let hashes = read?;
        let (scanned, version) = commit_read(
            cluster,
            o,
            session,
            found,
            hashes,
            &shard_bytes,
            &placement,
            &mut Vec::new(),
        )
        .await?;
        Ok::<_, ImportError>((scanned, version, total))
    };
    let (scanned, version, total) = in_session(cluster, session, work).await?;
    let took = started.elapsed();
    Ok(ImportReport {
        version,
        replicas: o.replicas,
        distinct_blobs: scanned.blobs.len(),
        uploaded_bytes: total * u64::from(o.replicas),
        skipped_bytes: 0,
        left_out: Vec::new(),
        hash_time: took,
        upload_time: took,
        total_time: took,
        phases: Vec::new(),
    })
}

/// Reads objects `o.parallel` at a time and sends them to their nodes `o.parallel` at a
/// time, with up to `o.parallel` read objects queued between: the nodes keep writes in
/// flight while the next objects download, and memory stays bounded (objects above
/// `remote::IN_MEMORY_MAX` wait in spill files). `todo`: (entry index, key, size, nodes).
/// Returns each entry's hashes (None for non-files).
async fn read_and_send(
    cluster: &Arc<dyn ImportCluster>,
    store: &Arc<dyn object_store::ObjectStore>,
    todo: Vec<(usize, object_store::path::Path, u64, Vec<String>)>,
    entries: usize,
    o: &ImportOptions,
    done: &Arc<std::sync::atomic::AtomicU64>,
) -> Result<Vec<Option<locus_proto::manifest::FileHashes>>> {
    type Staged = (
        usize,
        object_store::path::Path,
        Vec<String>,
        super::remote::Staged,
    );
    let parallel = o.parallel.max(1);
    let chunk_size = o.chunk_size;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Staged>(parallel);
    let reads = async move {
        let mut set: JoinSet<Result<Staged>> = JoinSet::new();
        let mut todo = todo.into_iter();
        loop {
            while set.len() < parallel {
                let Some((i, path, size, nodes)) = todo.next() else {
                    break;
                };
                let (store, done) = (store.clone(), done.clone());
                set.spawn(async move {
                    let st = super::remote::stage_object(store, path.clone(), size, chunk_size, done).await?;
                    Ok((i, path, nodes, st))
                });
            }
            let Some(r) = set.join_next().await else { break };
            let staged = r.map_err(|e| ImportError::Internal(format!("read task failed: {e}")))??;
            if tx.send(staged).await.is_err() {
                break; // the sends failed; their error is the one reported
            }
        }
        Ok::<_, ImportError>(())
    };
    let sends = async {
        let mut hashes = vec![None; entries];
        let mut set: JoinSet<Result<(usize, locus_proto::manifest::FileHashes)>> = JoinSet::new();
        let mut open = true;
        loop {
            tokio::select! {
                Some(r) = set.join_next(), if !set.is_empty() => {
                    let (i, h) = r.map_err(|e| ImportError::Internal(format!("send task failed: {e}")))??;
                    hashes[i] = Some(h);
                }
                m = rx.recv(), if open && set.len() < parallel => match m {
                    Some((i, path, nodes, st)) => {
                        let cluster = cluster.clone();
                        let store = store.clone();
                        set.spawn(async move {
                            // The whole of `st`, its spill file too, lives until the sends
                            // are done (a block capturing only the fields it names would
                            // drop the spill file at once).
                            let st = st;
                            let (size, hash, _) = st.hashes;
                            let sends = nodes.iter().map(|node| {
                                let upload = Upload {
                                    hash,
                                    size,
                                    chunk_size,
                                    source: st.source.clone(),
                                    store: Some(store.clone()),
                                    done: Default::default(),
                                };
                                let cluster = cluster.clone();
                                async move { cluster.send(node, upload).await.map_err(|e| (node.clone(), e)) }
                            });
                            for r in futures_util::future::join_all(sends).await {
                                r.map_err(|(node, e)| {
                                    ImportError::transfer(format!("sending {path} to node {node}"), e)
                                })?;
                            }
                            Ok((i, st.hashes))
                        });
                    }
                    None => open = false,
                },
                else => break,
            }
        }
        Ok(hashes)
    };
    let ((), hashes) = tokio::try_join!(reads, sends)?;
    Ok(hashes)
}

/// The placement, or the refusal naming the shards that found no room.
fn placed_or_refused(placed: pb::PlaceShardsResponse, shards: usize) -> Result<Placement> {
    if !placed.unplaced.is_empty() {
        let mut msg = format!(
            "{} of {} shard(s) could not be placed; nothing was committed:",
            placed.unplaced.len(),
            shards
        );
        for u in placed.unplaced.iter().take(20) {
            msg.push_str(&format!("\n  shard {}: {}", u.shard, u.reason));
        }
        if placed.unplaced.len() > 20 {
            msg.push_str(&format!("\n  … and {} more", placed.unplaced.len() - 20));
        }
        return Err(ImportError::Unplaced(msg));
    }
    Ok(placed
        .placements
        .into_iter()
        .map(|p| (p.shard, p.nodes))
        .collect())
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
            tree_chunks: true,
        })
        .await?;
    let (placement, uploaded, skipped, upload_time) = in_session(
        cluster,
        session,
        import_into_session(o, store, cluster, session, scanned, obs),
    )
    .await?;
    let mut shards = scanned.shards.clone();
    for s in &mut shards {
        s.replicas = placement.get(&s.id).cloned().unwrap_or_default();
    }
    let committed = async {
        cluster.put_shards(session, shards).await?;
        let namespace = super::seal::seal_and_store(cluster, o, scanned, &placement).await?;
        Ok::<_, ImportError>(cluster.commit(session, namespace).await?)
    };
    let version = in_session(cluster, session, committed).await?;
    Ok(ImportReport {
        version,
        replicas: o.replicas,
        distinct_blobs: scanned.blobs.len(),
        uploaded_bytes: uploaded,
        skipped_bytes: skipped,
        left_out: scanned.left_out.clone(),
        hash_time,
        upload_time,
        total_time: started.elapsed(),
        phases: Vec::new(),
    })
}

/// An import's work on an open session: the session is dropped at once if the work
/// fails (else it would hold its manifest until it expires).
pub(super) async fn in_session<T>(
    cluster: &Arc<dyn ImportCluster>,
    session: u64,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let r = work.await;
    if r.is_err() {
        cluster.abort(session).await;
    }
    r
}

pub(crate) type Placement = BTreeMap<u32, Vec<String>>;

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
            session_id: session,
        })
        .await?;
    let placement = placed_or_refused(placed, scanned.shards.len())?;

    // What each node must hold, less what it has already.
    let mut per_node: BTreeMap<String, Vec<BlobHash>> = BTreeMap::new();
    for (shard, nodes) in &placement {
        for n in nodes {
            let v = per_node.entry(n.clone()).or_default();
            v.extend(scanned.shard_blobs[*shard as usize].iter().copied());
        }
    }
    // One progress line from the first question to the nodes on: a node that stops
    // answering then shows as a stall, whichever step it stops in. Bytes the nodes hold
    // already count as done.
    let per_node: Vec<(String, Vec<BlobHash>)> = per_node
        .into_iter()
        .map(|(n, mut b)| {
            b.sort();
            b.dedup();
            (n, b)
        })
        .collect();
    let all: u64 = per_node
        .iter()
        .flat_map(|(_, b)| b.iter().map(|h| scanned.blobs[h].1))
        .sum();
    let done = obs.start(send::SENDING, all);
    let sent = send::send_missing(o, remote, cluster, scanned, per_node, &done).await;
    obs.end(send::SENDING);
    let (total, skipped, upload_time) = sent?;
    Ok((placement, total, skipped, upload_time))
}

/// For each shard, the nodes that already hold its blobs as replicas, most bytes first,
/// so placement can choose them and nothing is sent twice.
async fn holders(cluster: &dyn ImportCluster, scanned: &Scanned) -> Result<HashMap<u32, Vec<String>>> {
    let blobs = scanned
        .shard_blobs
        .iter()
        .enumerate()
        .flat_map(|(shard, blobs)| blobs.iter().map(move |h| (shard as u32, *h, scanned.blobs[h].1)));
    holders_of(cluster, blobs.collect()).await
}

/// For each shard, the nodes holding its (shard, blob, size) triples as replicas, most
/// bytes first.
async fn holders_of(
    cluster: &dyn ImportCluster,
    blobs: Vec<(u32, BlobHash, u64)>,
) -> Result<HashMap<u32, Vec<String>>> {
    let mut distinct: Vec<BlobHash> = blobs.iter().map(|b| b.1).collect();
    distinct.sort();
    distinct.dedup();
    let found = cluster.holders(distinct.clone()).await?;
    let at: HashMap<BlobHash, Vec<String>> = distinct
        .into_iter()
        .zip(found)
        .filter(|(_, nodes)| !nodes.is_empty())
        .collect();
    let mut bytes: BTreeMap<u32, HashMap<&str, u64>> = BTreeMap::new();
    for (shard, h, size) in &blobs {
        let per = bytes.entry(*shard).or_default();
        for n in at.get(h).into_iter().flatten() {
            *per.entry(n).or_default() += size.max(&1);
        }
    }
    Ok(bytes
        .into_iter()
        .map(|(shard, per)| {
            let mut v: Vec<(&str, u64)> = per.into_iter().collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            (shard, v.into_iter().map(|(n, _)| n.to_string()).collect())
        })
        .collect())
}

/// Placement hints for an object-store import, whose hashes are not known before it
/// reads: the blobs the dataset's latest version had at the same paths with the same
/// sizes (most likely the same objects), and the nodes that hold them. Best effort: a
/// failure only costs the hints.
async fn previous_holders(
    cluster: &dyn ImportCluster,
    dataset: &str,
    found: &[super::scan::Found],
    sizes: &[Option<u64>],
    groups: &[Option<u32>],
) -> HashMap<u32, Vec<String>> {
    let previous = match cluster.previous(dataset).await {
        Ok(p) => p,
        Err(_) => return HashMap::new(),
    };
    let by_path: HashMap<&str, (u64, BlobHash)> = previous
        .iter()
        .map(|(p, size, blob)| (p.as_str(), (*size, *blob)))
        .collect();
    let hints: Vec<(u32, BlobHash, u64)> = found
        .iter()
        .zip(sizes.iter().zip(groups))
        .filter_map(|(f, (size, group))| {
            let (size, group) = ((*size)?, (*group)?);
            match by_path.get(f.rel.as_str()) {
                Some((s, blob)) if *s == size => Some((group, *blob, size)),
                _ => None,
            }
        })
        .collect();
    if hints.is_empty() {
        return HashMap::new();
    }
    holders_of(cluster, hints).await.unwrap_or_default()
}

mod local;
mod pull;
mod send;

#[cfg(test)]
mod tests;
