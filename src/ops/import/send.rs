//! Sending an import's blobs to the nodes that lack them: small local files in batches
//! that each node commits together (`WriteBlobs`), every other blob on its own stream.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::BlobHash;
use tokio::task::JoinSet;

use super::{ImportError, ImportOptions, Result};
use crate::ops::cluster::{ImportCluster, Upload};
use crate::ops::scan::{BlobSource, Scanned};

pub(super) const SENDING: &str = "sending to nodes";

/// Files up to this size go to a node in batches (`WriteBlobs`): one group commit on the
/// node for a batch instead of two fsyncs per file, which made a node take small files
/// at about 800 a second.
pub(super) const SMALL: u64 = 256 << 10;
pub(super) const BATCH_BLOBS: usize = 1024;
pub(super) const BATCH_BYTES: u64 = 8 << 20;

enum Send {
    One(String, BlobHash),
    Batch(String, Vec<BlobHash>),
}

/// What to send to each node: its small local files in batches (first, so the many
/// small writes overlap the few large ones), and every other blob on its own.
fn sends(todo: Vec<(String, BlobHash)>, scanned: &Scanned) -> Vec<Send> {
    let mut batches: Vec<Send> = Vec::new();
    let mut singles: Vec<Send> = Vec::new();
    let mut open: BTreeMap<String, (Vec<BlobHash>, u64)> = BTreeMap::new();
    for (node, h) in todo {
        let (source, size) = &scanned.blobs[&h];
        if *size > SMALL || !matches!(source, BlobSource::Local(_)) {
            singles.push(Send::One(node, h));
            continue;
        }
        let b = open.entry(node.clone()).or_default();
        b.0.push(h);
        b.1 += size;
        if b.0.len() >= BATCH_BLOBS || b.1 >= BATCH_BYTES {
            let (hs, _) = std::mem::take(b);
            batches.push(Send::Batch(node, hs));
        }
    }
    batches.extend(
        open.into_iter()
            .filter(|(_, (hs, _))| !hs.is_empty())
            .map(|(n, (hs, _))| Send::Batch(n, hs)),
    );
    batches.extend(singles);
    batches
}

/// Asks each node which of its blobs it lacks and sends those, a bounded number at a
/// time. Returns the bytes sent, the bytes already there and the time the sending took.
pub(super) async fn send_missing(
    o: &ImportOptions,
    remote: Option<Arc<dyn object_store::ObjectStore>>,
    cluster: &Arc<dyn ImportCluster>,
    scanned: &Scanned,
    per_node: Vec<(String, Vec<BlobHash>)>,
    done: &Arc<std::sync::atomic::AtomicU64>,
) -> Result<(u64, u64, Duration)> {
    let mut todo: Vec<(String, BlobHash)> = Vec::new();
    let mut skipped = 0u64;
    for (node, blobs) in per_node {
        let have = cluster
            .have(&node, blobs.clone())
            .await
            .map_err(|e| ImportError::transfer(format!("asking node {node} what it holds"), e))?;
        for (h, here) in blobs.iter().zip(have) {
            if here {
                skipped += scanned.blobs[h].1;
            } else {
                todo.push((node.clone(), *h));
            }
        }
    }
    done.fetch_add(skipped, std::sync::atomic::Ordering::Relaxed);

    let total: u64 = todo.iter().map(|(_, h)| scanned.blobs[h].1).sum();
    let upload_started = Instant::now();
    let upload = |h: &BlobHash| {
        let (source, size) = scanned.blobs[h].clone();
        Upload {
            hash: *h,
            size,
            chunk_size: o.chunk_size,
            source,
            store: remote.clone(),
            done: done.clone(),
        }
    };
    let mut set: JoinSet<Result<()>> = JoinSet::new();
    let mut pending = sends(todo, scanned).into_iter();
    loop {
        while set.len() < o.parallel.max(1) {
            let Some(send) = pending.next() else { break };
            let cluster = cluster.clone();
            match send {
                Send::One(node, h) => {
                    let u = upload(&h);
                    set.spawn(async move {
                        let source = u.source.to_string();
                        cluster
                            .send(&node, u)
                            .await
                            .map_err(|e| ImportError::transfer(format!("sending {source} to node {node}"), e))
                    });
                }
                Send::Batch(node, hs) => {
                    let us: Vec<Upload> = hs.iter().map(upload).collect();
                    set.spawn(async move {
                        let n = us.len();
                        cluster.send_small(&node, us).await.map_err(|e| {
                            ImportError::transfer(
                                format!("sending a batch of {n} small files to node {node}"),
                                e,
                            )
                        })
                    });
                }
            }
        }
        match set.join_next().await {
            None => break,
            Some(r) => {
                let r = r
                    .map_err(|e| ImportError::Internal(format!("upload task failed: {e}")))
                    .and_then(|x| x);
                if let Err(e) = r {
                    set.abort_all();
                    return Err(e);
                }
            }
        }
    }
    Ok((total, skipped, upload_started.elapsed()))
}
