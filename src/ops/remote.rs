//! Object-store sources for `locus dataset import`: lists a prefix, and reads each object
//! once, hashing it as it streams in and keeping its bytes (in memory, or a spill file
//! when large) for the sends to the nodes.
//!
//! `s3://`, `gs://` and `az://` URLs, opened by `locus_backup::url` (which says where
//! each finds its credentials; they are never printed).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Explain, SourceError};

type Result<T, E = SourceError> = std::result::Result<T, E>;
use futures_util::StreamExt;
use locus_proto::manifest::{ChunkHasher, ChunkKind, FileHashes};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::scan::{BlobSource, Found, FoundKind};

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

/// An object read once: its size and hashes, and its bytes kept for sending — in memory
/// when small, else in a spill file that is removed when this is dropped.
pub struct Staged {
    pub hashes: FileHashes,
    pub source: BlobSource,
    _spill: Option<tempfile::TempPath>,
}

/// Objects up to this size are kept in memory between their read and their sends; with
/// `--parallel` objects in flight that bounds the memory an import holds.
pub const IN_MEMORY_MAX: u64 = 16 << 20;

/// Reads `path` once, hashing it on a blocking thread as it streams in, and keeps its
/// bytes for the sends (`size` as listed picks memory or a spill file).
pub async fn stage_object(
    store: Arc<dyn ObjectStore>,
    path: ObjPath,
    size: u64,
    chunk_size: u32,
    done: Arc<AtomicU64>,
) -> Result<Staged> {
    use std::io::Write;
    let spill = if size > IN_MEMORY_MAX {
        Some(
            tempfile::NamedTempFile::new()
                .explain(|| "cannot create a spill file for a large object".to_string())?,
        )
    } else {
        None
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(8);
    let sink = tokio::task::spawn_blocking(move || {
        let mut h = ChunkHasher::new(chunk_size, ChunkKind::Tree);
        let mut mem = bytes::BytesMut::with_capacity(if spill.is_none() { size as usize } else { 0 });
        let mut file = spill.map(|f| std::io::BufWriter::with_capacity(1 << 20, f));
        while let Some(b) = rx.blocking_recv() {
            h.update(&b);
            match &mut file {
                Some(f) => f
                    .write_all(&b)
                    .map_err(|e| SourceError(format!("writing a spill file: {e}")))?,
                None => mem.extend_from_slice(&b),
            }
        }
        let (source, spill) = match file {
            Some(f) => {
                let f = f
                    .into_inner()
                    .map_err(|e| SourceError(format!("writing a spill file: {e}")))?;
                let p = f.into_temp_path();
                (BlobSource::Local(p.to_path_buf()), Some(p))
            }
            None => (BlobSource::Memory(mem.freeze()), None),
        };
        Ok::<_, SourceError>(Staged {
            hashes: h.finish(),
            source,
            _spill: spill,
        })
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
    let staged = sink.await.explain(|| "hashing task failed".to_string())??;
    if staged.hashes.0 != size {
        return Err(SourceError(format!(
            "{path} was {size} bytes when listed and {} when read: it changed during the import; \
             rerun it",
            staged.hashes.0
        )));
    }
    Ok(staged)
}

/// Lists `remote`: every object as a file entry (and the directories its keys imply), in
/// path order, with each entry's size (None for directories).
pub async fn list(remote: &Remote) -> Result<(Vec<Found>, Vec<Option<u64>>)> {
    let prefix = remote.prefix.clone();
    let mut listing = remote.store.list(Some(&prefix));
    let mut found = Vec::new();
    let mut dirs = BTreeSet::new();
    let mut sizes = std::collections::HashMap::new();
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
        sizes.insert(rel.clone(), meta.size);
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
    let sizes = found.iter().map(|f| sizes.get(&f.rel).copied()).collect();
    Ok((found, sizes))
}
