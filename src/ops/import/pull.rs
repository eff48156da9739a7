//! An object-store import read by the nodes: each object is read by the first node of
//! its shard (`ImportObject`: the node streams it from the store, hashes it as it
//! arrives and stores it under its hash), and the shard's other replicas copy it from
//! that node (`FetchBlobs`, verified). The importing client moves no bytes: the import
//! runs at the rate of the nodes' links to the store, summed over the nodes, instead of
//! one client's, and each byte is received and hashed once on its way to a disk.
//!
//! With `ReadBy::Auto`, an object a node cannot read (no credentials for the store, a
//! node too old to know the call, a store it cannot reach) is read by this client and
//! sent to the nodes instead (`read_and_send`), with one warning per node; with
//! `ReadBy::Nodes` that is an error.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use locus_proto::manifest::FileHashes;
use locus_proto::nodepb;
use tokio::task::JoinSet;

use super::{read_and_send, ImportError, ImportOptions, ReadBy, Result};
use crate::ops::cluster::ImportCluster;

/// (entry index, key, relative path, size, nodes of its shard, first one first).
pub(super) type Todo = (usize, object_store::path::Path, String, u64, Vec<String>);

/// Reads every object of `todo` through its shard's nodes, `o.parallel` at a time;
/// each entry's hashes (None for non-files).
pub(super) async fn pull_by_nodes(
    cluster: &Arc<dyn ImportCluster>,
    store: &Arc<dyn object_store::ObjectStore>,
    todo: Vec<Todo>,
    entries: usize,
    o: &ImportOptions,
    done: &Arc<AtomicU64>,
) -> Result<Vec<Option<FileHashes>>> {
    let parallel = o.parallel.max(1);
    let mut hashes: Vec<Option<FileHashes>> = vec![None; entries];
    // What the nodes could not read, for this client to read and send.
    let mut fallback = Vec::new();
    let warned: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut set: JoinSet<(Todo, std::result::Result<FileHashes, tonic::Status>)> = JoinSet::new();
    let mut todo = todo.into_iter();
    loop {
        while set.len() < parallel {
            let Some(t) = todo.next() else { break };
            let cluster = cluster.clone();
            let req = nodepb::ImportObjectRequest {
                origin: o.source.clone(),
                path: t.2.clone(),
                size: t.3,
                chunk_size: o.chunk_size,
                pin: true,
                tree_chunks: true,
            };
            set.spawn(async move {
                let first = t.4[0].clone();
                let r = pull_one(cluster.as_ref(), &first, &t.4[1..], req).await;
                (t, r)
            });
        }
        let Some(r) = set.join_next().await else { break };
        let (t, r) = r.map_err(|e| ImportError::Internal(format!("read task failed: {e}")))?;
        match r {
            Ok(h) => {
                done.fetch_add(t.3, Ordering::Relaxed);
                hashes[t.0] = Some(h);
            }
            Err(s) if o.read_by == ReadBy::Auto && falls_back(&s) => {
                let node = t.4[0].clone();
                if warned.lock().unwrap().insert(node.clone()) {
                    tracing::warn!(
                        "node {node} could not read the source ({}); this client reads the objects \
                         it cannot and sends them",
                        crate::ops::status_sentence(&s)
                    );
                }
                fallback.push((t.0, t.1, t.3, t.4));
            }
            Err(s) => {
                set.abort_all();
                return Err(ImportError::transfer(
                    format!("node {} reading {}", t.4[0], t.2),
                    crate::ops::cluster::NodeError::from_status(&t.4[0], &s)
                        .map(|_| crate::ops::status_sentence(&s)),
                ));
            }
        }
    }
    if !fallback.is_empty() {
        let read = read_and_send(cluster, store, fallback, entries, o, done).await?;
        for (i, h) in read.into_iter().enumerate() {
            if h.is_some() {
                hashes[i] = h;
            }
        }
    }
    Ok(hashes)
}

/// One object read by `first`, then copied to each of `others` from it.
async fn pull_one(
    cluster: &dyn ImportCluster,
    first: &str,
    others: &[String],
    req: nodepb::ImportObjectRequest,
) -> std::result::Result<FileHashes, tonic::Status> {
    let chunk_size = req.chunk_size;
    let h = cluster.pull(first, req).await?;
    let blob = nodepb::BlobRef {
        hash: h.1 .0.to_vec(),
        size: h.0,
        ..Default::default()
    };
    let copies = others
        .iter()
        .map(|n| cluster.copy(n, first, blob.clone(), chunk_size));
    for r in futures_util::future::join_all(copies).await {
        // A failed copy is not a reason to read the object again through this client:
        // it is the import's failure (the session is aborted, a rerun resumes).
        r.map_err(|e| tonic::Status::aborted(format!("copying to another replica: {e}")))?;
    }
    Ok(h)
}

/// Whether this client should read an object a node could not: the node cannot read
/// origins, or not this one (credentials, reachability), as opposed to an import that
/// is wrong whoever reads it (the object changed size, the node is full).
fn falls_back(s: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(
        s.code(),
        Unimplemented | Unavailable | PermissionDenied | Unauthenticated | FailedPrecondition | NotFound
    )
}
