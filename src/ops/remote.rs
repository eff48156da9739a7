//! Object-store sources for `locus dataset import`: lists a prefix, hashes every object
//! while streaming it (never held whole in memory), and streams objects again to the nodes.
//!
//! `s3://`, `gs://` and `az://` URLs, opened by `locus_backup::url` (which says where
//! each finds its credentials; they are never printed).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Explain, SourceError};

type Result<T, E = SourceError> = std::result::Result<T, E>;
use futures_util::StreamExt;
use locus_proto::manifest::{ChunkHasher, FileHashes};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::scan::{BlobSource, Found, FoundKind, Scanned};

pub struct Remote {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: ObjPath,
}

/// Opens an object-store URL (`s3://`, `gs://`, `az://`; see `locus_backup::url`).
pub fn open(url: &str) -> Result<Remote> {
    let o = locus_backup::url::open(url, false).map_err(|e| SourceError(e.to_string()))?;
    Ok(Remote {
        store: o.store,
        prefix: ObjPath::from(o.prefix.as_str()),
    })
}

/// Opens an object for streaming.
pub async fn open_object(
    store: &Arc<dyn ObjectStore>,
    path: &ObjPath,
) -> Result<impl futures_util::Stream<Item = object_store::Result<bytes::Bytes>> + use<>> {
    Ok(store
        .get(path)
        .await
        .explain(|| format!("cannot read {path}"))?
        .into_stream())
}

async fn hash_object(
    store: Arc<dyn ObjectStore>,
    path: ObjPath,
    chunk_size: u32,
    done: Arc<AtomicU64>,
) -> Result<FileHashes> {
    // Hashing runs on a blocking thread, fed through a bounded channel.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(8);
    let hasher = tokio::task::spawn_blocking(move || {
        let mut h = ChunkHasher::new(chunk_size);
        while let Some(b) = rx.blocking_recv() {
            h.update(&b);
        }
        h.finish()
    });
    let mut s = std::pin::pin!(open_object(&store, &path).await?);
    while let Some(piece) = s.next().await {
        let piece = piece.explain(|| format!("reading {path} failed"))?;
        done.fetch_add(piece.len() as u64, Ordering::Relaxed);
        if tx.send(piece).await.is_err() {
            break;
        }
    }
    drop(tx);
    hasher.await.explain(|| "hashing task failed".to_string())
}

/// Lists `remote`, hashes every object (`parallel` at a time) and builds the manifest.
pub async fn scan(
    remote: &Remote,
    chunk_size: u32,
    shard_size: u64,
    parallel: usize,
    done: Arc<AtomicU64>,
) -> Result<Scanned> {
    let prefix = remote.prefix.clone();
    let mut listing = remote.store.list(Some(&prefix));
    let mut found = Vec::new();
    let mut dirs = BTreeSet::new();
    while let Some(meta) = listing.next().await {
        let meta = meta.explain(|| "listing the source failed".to_string())?;
        let key = meta.location.as_ref();
        let rel = if prefix.as_ref().is_empty() {
            key.to_string()
        } else {
            match key
                .strip_prefix(prefix.as_ref())
                .and_then(|r| r.strip_prefix('/'))
            {
                Some(r) => r.to_string(),
                None => continue,
            }
        };
        if rel.is_empty() {
            continue;
        }
        let mut parent = rel.as_str();
        while let Some((p, _)) = parent.rsplit_once('/') {
            dirs.insert(p.to_string());
            parent = p;
        }
        found.push(Found {
            rel,
            kind: FoundKind::File(BlobSource::Remote(meta.location.clone())),
            mode: 0o644,
            mtime_ns: meta.last_modified.timestamp_nanos_opt().unwrap_or(0),
        });
    }
    for d in dirs {
        found.push(Found {
            rel: d,
            kind: FoundKind::Dir,
            mode: 0o755,
            mtime_ns: 0,
        });
    }
    found.sort_by(|a, b| a.rel.cmp(&b.rel));
    let mut hashes: Vec<Option<FileHashes>> = vec![None; found.len()];
    let mut set = tokio::task::JoinSet::new();
    let mut todo = found.iter().enumerate().filter_map(|(i, f)| match &f.kind {
        FoundKind::File(BlobSource::Remote(p)) => Some((i, p.clone())),
        _ => None,
    });
    loop {
        while set.len() < parallel.max(1) {
            let Some((i, p)) = todo.next() else { break };
            let store = remote.store.clone();
            let done = done.clone();
            set.spawn(async move { (i, hash_object(store, p, chunk_size, done).await) });
        }
        let Some(r) = set.join_next().await else { break };
        let (i, h) = r.explain(|| "hashing task failed".to_string())?;
        hashes[i] = Some(h?);
    }
    super::scan::assemble(found, hashes, shard_size)
}
