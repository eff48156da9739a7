//! `locus dataset import`: a local directory becomes the next version of a dataset, its
//! blobs replicated onto cache nodes.
//!
//! Order of work, chosen so that nothing half-done is ever visible: hash everything, open
//! an import session and upload the manifest, ask for a placement (and stop, aborting the
//! session, if any shard cannot be placed), send each node the blobs its shards need that
//! it does not already have (nodes verify every byte), then record the replicas and
//! commit. An interrupted import leaves only an uncommitted session, which the service
//! discards; rerunning it skips every blob the nodes already hold.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use locus_proto::client::NodeClient;
use locus_proto::{nodepb, pb, BlobHash};
use tokio::task::JoinSet;

use crate::config::Resolved;
use crate::output::{self, Progress, StatusExt};
use crate::scan::BlobSource;

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Dataset name; the import becomes its next version.
    pub name: String,
    /// A local directory, file://PATH, or s3://BUCKET/PREFIX (credentials and endpoint
    /// from the AWS_* environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
    /// AWS_ENDPOINT_URL, AWS_ALLOW_HTTP).
    pub source: String,
    /// Replicas of every shard, on distinct hosts.
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    /// Target shard size: files are grouped in path order into shards of about this many
    /// bytes; a larger file is a shard of its own.
    #[arg(long, default_value = "1GiB", value_name = "SIZE")]
    pub shard_size: String,
    /// Chunk size for hashes and partial transfers (power of two, 64KiB..1GiB).
    #[arg(long, default_value = "4MiB", value_name = "SIZE")]
    pub chunk_size: String,
    /// Blob uploads in flight at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
}

pub async fn run(a: ImportArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let started = Instant::now();
    locus_proto::DatasetName::try_from(a.name.as_str()).map_err(|e| anyhow::anyhow!("{}", e))?;
    let remote = if a.source.contains("://") && !a.source.starts_with("file://") {
        Some(crate::remote::open(&a.source)?)
    } else {
        None
    };
    let source = PathBuf::from(a.source.strip_prefix("file://").unwrap_or(&a.source));
    if remote.is_none() && !source.is_dir() {
        bail!("{} is not a directory", source.display());
    }
    let chunk_size = locus_proto::human::parse_size(&a.chunk_size)
        .map_err(|e| anyhow::anyhow!("--chunk-size: {}", e.reason))?;
    let chunk_size = u32::try_from(chunk_size).ok().filter(|c| {
        c.is_power_of_two() && (locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(c)
    });
    let Some(chunk_size) = chunk_size else {
        bail!("--chunk-size must be a power of two from 64KiB to 1GiB");
    };
    let shard_size = locus_proto::human::parse_size(&a.shard_size)
        .map_err(|e| anyhow::anyhow!("--shard-size: {}", e.reason))?;
    if a.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let mut meta = cfg.connect().await?;

    // 1. Hash.
    let total_guess = if remote.is_some() { 0 } else { dir_bytes(&source) };
    let hashing = Progress::new("hashing", total_guess);
    let done = hashing.done.clone();
    let scanned = match &remote {
        Some(r) => crate::remote::scan(r, chunk_size, shard_size.max(1), a.parallel, done).await?,
        None => {
            let src = source.clone();
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
            tokio::task::spawn_blocking(move || {
                crate::scan::scan_dir_parallel(&src, chunk_size, shard_size.max(1), threads, &|n| {
                    done.store(n, Ordering::Relaxed)
                })
            })
            .await??
        }
    };
    let hash_time = hashing.finish();
    let store = remote.as_ref().map(|r| r.store.clone());
    // Where the bytes came from: the mount's last source when no node has them.
    let origin = match &remote {
        Some(_) => a.source.clone(),
        None => format!(
            "file://{}",
            locus_fuse::origin::encode_path(
                &std::fs::canonicalize(&source)
                    .unwrap_or_else(|_| crate::absolute(source.clone()))
                    .display()
                    .to_string()
            )
        ),
    };
    commit_scanned(
        &a, cfg, &mut meta, &scanned, store, origin, chunk_size, started, hash_time,
    )
    .await
}

/// Sends an already hashed manifest's blobs to the nodes and commits it as the next
/// version of `a.name` — for a scanned source, or a version read back from a backup.
#[allow(clippy::too_many_arguments)]
pub async fn commit_scanned(
    a: &ImportArgs,
    cfg: &Resolved,
    meta: &mut locus_proto::client::MetadataClient,
    scanned: &crate::scan::Scanned,
    store: Option<Arc<dyn object_store::ObjectStore>>,
    origin: String,
    chunk_size: u32,
    started: Instant,
    hash_time: Duration,
) -> anyhow::Result<()> {
    // 2. Session and manifest.
    let begin = meta
        .begin_version(pb::BeginVersionRequest {
            dataset: a.name.clone(),
            chunk_size,
            origin,
            replication: a.replicas,
        })
        .await
        .or_status()?;
    let session = begin.session_id;
    let result = import_into_session(a, cfg, store, meta, session, chunk_size, scanned).await;
    let (placement, uploaded, skipped, upload_time) = match result {
        Ok(r) => r,
        Err(e) => {
            // Leave nothing behind: the session's manifest is dropped now, not at expiry.
            let _ = meta
                .abort_version(pb::AbortVersionRequest { session_id: session })
                .await;
            return Err(e);
        }
    };
    let mut shards = scanned.shards.clone();
    for s in &mut shards {
        s.replicas = placement.get(&s.id).cloned().unwrap_or_default();
    }
    locus_proto::client::put_shards_paged(meta, session, shards)
        .await
        .map_err(output::status_error)?;
    let v = meta
        .commit_version(pb::CommitVersionRequest { session_id: session })
        .await
        .or_status()?
        .version
        .context("the service committed without returning the version")?;
    let secs = started.elapsed().as_secs_f64();
    let summary = serde_json::json!({
        "dataset": v.dataset,
        "version": v.version,
        "files": v.files,
        "dirs": v.dirs,
        "symlinks": v.symlinks,
        "bytes": v.bytes,
        "shards": v.shards,
        "replicas": a.replicas,
        "distinct_blobs": scanned.blobs.len(),
        "uploaded_bytes": uploaded,
        "skipped_bytes": skipped,
        "hash_seconds": hash_time.as_secs_f64(),
        "upload_seconds": upload_time.as_secs_f64(),
        "seconds": secs,
        "throughput_bytes_per_second": (v.bytes as f64 / secs) as u64,
    });
    if cfg.json {
        return output::json(&summary);
    }
    println!(
        "imported {}@{}: {} files ({}), {} dirs, {} symlinks in {} shard(s) × {} replicas",
        v.dataset,
        v.version,
        v.files,
        output::size(v.bytes),
        v.dirs,
        v.symlinks,
        v.shards,
        a.replicas
    );
    println!(
        "sent {} to nodes, skipped {} already there; {:.1}s ({}/s)",
        output::size(uploaded),
        output::size(skipped),
        secs,
        output::size((v.bytes as f64 / secs.max(0.001)) as u64)
    );
    Ok(())
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
    a: &ImportArgs,
    cfg: &Resolved,
    remote: Option<Arc<dyn object_store::ObjectStore>>,
    meta: &mut locus_proto::client::MetadataClient,
    session: u64,
    chunk_size: u32,
    scanned: &crate::scan::Scanned,
) -> anyhow::Result<(Placement, u64, u64, Duration)> {
    locus_proto::client::put_entries_paged(meta, session, scanned.entries.clone())
        .await
        .map_err(output::status_error)?;
    let prefer = holders(meta, scanned).await?;
    let placed = meta
        .place_shards(pb::PlaceShardsRequest {
            shards: scanned
                .shards
                .iter()
                .map(|s| pb::ShardSize {
                    id: s.id,
                    bytes: s.bytes,
                    prefer: prefer.get(&s.id).cloned().unwrap_or_default(),
                })
                .collect(),
            replication: a.replicas,
        })
        .await
        .or_status()?;
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
        bail!(msg);
    }
    let placement: Placement = placed
        .placements
        .into_iter()
        .map(|p| (p.shard, p.nodes))
        .collect();

    // What each node must hold.
    let mut per_node: HashMap<String, Vec<BlobHash>> = HashMap::new();
    for (shard, nodes) in &placement {
        for n in nodes {
            let v = per_node.entry(n.clone()).or_default();
            v.extend(scanned.shard_blobs[*shard as usize].iter().copied());
        }
    }
    let addresses: HashMap<String, String> = meta
        .list_nodes(pb::ListNodesRequest {})
        .await
        .or_status()?
        .nodes
        .into_iter()
        .map(|n| (n.id, n.address))
        .collect();
    let mut clients: HashMap<String, NodeClient> = HashMap::new();
    let mut todo: Vec<(String, BlobHash)> = Vec::new();
    let mut skipped = 0u64;
    for (node, mut blobs) in per_node {
        blobs.sort();
        blobs.dedup();
        let addr = addresses
            .get(&node)
            .with_context(|| format!("node {node} has no address"))?;
        let mut c = locus_proto::client::connect_node(addr, cfg.token.as_deref(), Duration::from_secs(5))
            .await
            .with_context(|| format!("node {node}"))?;
        let idle = locus_proto::net::peer_idle();
        for batch in blobs.chunks(50_000) {
            let ask = c.have_blobs(nodepb::HaveBlobsRequest {
                hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
            });
            let have = tokio::time::timeout(idle, ask)
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "node {node} at {addr} did not answer within {}s (LOCUS_PEER_TIMEOUT)",
                        idle.as_secs_f64()
                    )
                })?
                .map_err(|s| anyhow::anyhow!("node {node}: {}", s.message()))?
                .into_inner()
                .present;
            for (h, here) in batch.iter().zip(have) {
                if here {
                    skipped += scanned.blobs[h].1;
                } else {
                    todo.push((node.clone(), *h));
                }
            }
        }
        clients.insert(node, c);
    }

    // Send what is missing, a bounded number of blobs at a time.
    let total: u64 = todo.iter().map(|(_, h)| scanned.blobs[h].1).sum();
    let progress = Progress::new("uploading", total);
    let mut set: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let mut pending = todo.into_iter();
    loop {
        while set.len() < a.parallel.max(1) {
            let Some((node, h)) = pending.next() else { break };
            let (source, size) = scanned.blobs[&h].clone();
            let client = clients[&node].clone();
            let done = progress.done.clone();
            let remote = remote.clone();
            set.spawn(async move {
                send_blob(client, remote, &source, h, size, chunk_size, done)
                    .await
                    .with_context(|| format!("sending {source} to node {node}"))
            });
        }
        match set.join_next().await {
            None => break,
            Some(r) => {
                if let Err(e) = r.map_err(anyhow::Error::from).and_then(|x| x) {
                    set.abort_all();
                    progress.finish();
                    return Err(e);
                }
            }
        }
    }
    let t = progress.finish();
    Ok((placement, total, skipped, t))
}

/// For each shard, the nodes that already hold its blobs as replicas, most bytes first,
/// so placement can choose them and nothing is sent twice.
async fn holders(
    meta: &mut locus_proto::client::MetadataClient,
    scanned: &crate::scan::Scanned,
) -> anyhow::Result<HashMap<u32, Vec<String>>> {
    let all: Vec<BlobHash> = scanned.blobs.keys().copied().collect();
    let mut at: HashMap<BlobHash, Vec<String>> = HashMap::new();
    for batch in all.chunks(10_000) {
        let r = meta
            .locate_blobs(pb::LocateBlobsRequest {
                hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
            })
            .await
            .or_status()?;
        for (h, loc) in batch.iter().zip(r.blobs) {
            if !loc.nodes.is_empty() {
                at.insert(*h, loc.nodes);
            }
        }
    }
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

/// Streams one file or object to a node as a pinned blob; the node verifies it against `h`.
async fn send_blob(
    mut client: NodeClient,
    remote: Option<Arc<dyn object_store::ObjectStore>>,
    source: &BlobSource,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use nodepb::write_blob_message::Msg;
    use tokio::io::AsyncReadExt;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(nodepb::WriteBlobMessage {
        msg: Some(Msg::Header(nodepb::WriteBlobHeader {
            hash: h.0.to_vec(),
            size,
            chunk_size,
            pin: true,
        })),
    })
    .await
    .ok();
    let data = |b: bytes::Bytes| nodepb::WriteBlobMessage {
        msg: Some(Msg::Data(b)),
    };
    // Bytes of this blob handed to the node's stream.
    let moved = locus_proto::net::Progress::default();
    let moved2 = moved.clone();
    let done = {
        let total = done;
        move |n: u64| {
            total.fetch_add(n, Ordering::Relaxed);
            moved2.fetch_add(n, Ordering::Relaxed);
        }
    };
    // The reader ends early without error when the node ends the call (it had the blob,
    // or failed; the call's own result says which).
    let reader: tokio::task::JoinHandle<anyhow::Result<()>> = match source {
        BlobSource::Local(path) => {
            let mut file = tokio::fs::File::open(path)
                .await
                .with_context(|| format!("cannot open {}", path.display()))?;
            tokio::spawn(async move {
                loop {
                    // A fresh buffer per message, frozen and handed over without a copy.
                    let mut buf = bytes::BytesMut::with_capacity(2 << 20);
                    let n = file.read_buf(&mut buf).await?;
                    if n == 0 || tx.send(data(buf.freeze())).await.is_err() {
                        return Ok(());
                    }
                    done(n as u64);
                }
            })
        }
        BlobSource::Remote(path) => {
            let store = remote.context("an object-store blob without its store")?;
            let path = path.clone();
            tokio::spawn(async move {
                let mut s = std::pin::pin!(crate::remote::open_object(&store, &path).await?);
                while let Some(piece) = s.next().await {
                    let piece = piece.with_context(|| format!("reading {path} failed"))?;
                    let n = piece.len() as u64;
                    if tx.send(data(piece)).await.is_err() {
                        break;
                    }
                    done(n);
                }
                Ok(())
            })
        }
    };
    // The node takes the bytes as fast as it stores them; one that takes none for the
    // peer timeout (hung, partitioned) fails this blob instead of the import waiting.
    let idle = locus_proto::net::peer_idle();
    let call = client.write_blob(tokio_stream::wrappers::ReceiverStream::new(rx));
    let resp = match locus_proto::net::until_idle(call, &moved, idle).await {
        Ok(r) => r,
        Err(()) => {
            reader.abort();
            bail!(
                "no bytes reached the node for {}s: it or the source is stalled (LOCUS_PEER_TIMEOUT)",
                idle.as_secs_f64()
            );
        }
    };
    reader.await??;
    match resp {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            bail!("{} (did the source change while importing?)", s.message())
        }
        Err(s) => bail!("{}", s.message()),
    }
}
