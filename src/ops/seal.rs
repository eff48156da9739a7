//! `locus dataset seal`: gives a version committed before sealed namespaces (by an older
//! Locus, or restored from a catalogue it wrote) the namespace mounts need.
//!
//! The same as an import's last step, on a version that exists: its entries are read
//! from the catalogue page by page (in catalogue order, the namespace's) and sealed into
//! a temp file as they arrive, never all held at once; the file is stored on the first
//! shard's replicas; the metadata service seals the entries again itself and records the
//! namespace only if the two agree.
//!
//! Also the importer's last step before its commit (`seal_and_store`): the same sealing
//! of a scanned manifest, and storing the namespace on the first shard's replicas.

use std::sync::Arc;

use locus_proto::client::MetadataClient;
use locus_proto::{pb, Entry};

use locus_proto::BlobHash;

use super::cluster::{ImportCluster, NodeError, Upload};
use super::import::ImportError;
use super::scan::Scanned;

type Result<T, E = ImportError> = std::result::Result<T, E>;

/// What sealing did.
#[derive(Debug)]
pub struct Sealed {
    pub version: pb::Version,
    /// False when the version had a namespace already (nothing was done).
    pub sealed_now: bool,
    pub entries: u64,
}

/// Seals `dataset@version` (0: the latest).
pub async fn seal(
    meta: &mut MetadataClient,
    cluster: &Arc<dyn ImportCluster>,
    dataset: &str,
    version: u64,
) -> Result<Sealed, ImportError> {
    let r = pb::VersionRef {
        dataset: dataset.to_string(),
        version,
    };
    let v = meta
        .get_version(pb::GetVersionRequest {
            r#ref: Some(r.clone()),
        })
        .await?
        .into_inner();
    let r = pb::VersionRef {
        version: v.version,
        ..r
    };
    if !v.namespace_blob.is_empty() {
        return Ok(Sealed {
            entries: v.files + v.dirs + v.symlinks,
            version: v,
            sealed_now: false,
        });
    }
    let cluster_id = cluster.cluster_id().await?;
    let fail = |e: String| ImportError::Invalid(format!("sealing {dataset}@{}: {e}", v.version));
    let file = tempfile::NamedTempFile::new().map_err(|e| fail(e.to_string()))?;
    let out = std::io::BufWriter::with_capacity(1 << 20, file.reopen().map_err(|e| fail(e.to_string()))?);
    let kind = locus_proto::chunks::ChunkKind::from_tree(v.tree_chunks);
    let mut w =
        locus_proto::sealed::Writer::with_kind(out, v.chunk_size, kind).map_err(|e| fail(e.to_string()))?;
    let mut token = Vec::new();
    loop {
        let page = meta
            .list_entries(pb::ListEntriesRequest {
                r#ref: Some(r.clone()),
                directory: None,
                page_token: token,
                limit: 10_000,
                without_chunks: false,
            })
            .await?
            .into_inner();
        // Encoding and hashing a page is CPU work; it is small enough per page to stay on
        // this task.
        for e in page.entries {
            let e = Entry::try_from(e).map_err(|e| fail(e.to_string()))?;
            w.push(&e).map_err(|e| fail(e.to_string()))?;
        }
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let entries = w.len() as u64 - 1;
    let sealed = w.finish(dataset, &cluster_id).map_err(|e| fail(e.to_string()))?;
    let first = meta
        .list_shards(pb::ListShardsRequest {
            r#ref: Some(r.clone()),
            start: 0,
            limit: 1,
        })
        .await?
        .into_inner()
        .shards
        .into_iter()
        .next();
    if let Some(s) = first {
        if s.replicas.is_empty() {
            return Err(ImportError::Unplaced(format!(
                "shard {} of {dataset}@{} has no replica to hold the namespace; repair it first",
                s.id, v.version
            )));
        }
        store_namespace(
            cluster,
            &s.replicas,
            file.path(),
            (sealed.hash, sealed.size, v.chunk_size),
        )
        .await?;
    }
    let version = meta
        .seal_version(pb::SealVersionRequest {
            r#ref: Some(r),
            namespace_blob: sealed.hash.0.to_vec(),
            namespace_size: sealed.size,
        })
        .await?
        .into_inner();
    Ok(Sealed {
        version,
        sealed_now: true,
        entries,
    })
}

/// Builds the version's sealed namespace (`locus_proto::sealed`) from the manifest and
/// stores it as a blob on the first shard's replicas (the commit records it there, so pin
/// sync, repair, refill and backups carry it like the files); its hash and size for the
/// commit, which the service checks against the manifest. None for a version without
/// files: the service keeps that one itself. Written to a temp file, not held in memory:
/// a hundred-million-file version's namespace is gigabytes.
pub(crate) async fn seal_and_store(
    cluster: &Arc<dyn ImportCluster>,
    o: &super::import::ImportOptions,
    scanned: &Scanned,
    placement: &super::import::Placement,
) -> Result<Option<(BlobHash, u64)>> {
    let Some(first) = scanned.shards.iter().map(|s| s.id).min() else {
        return Ok(None);
    };
    let nodes = placement
        .get(&first)
        .cloned()
        .ok_or_else(|| ImportError::Unplaced(format!("shard {first} has no placement")))?;
    let cluster_id = cluster.cluster_id().await?;
    let (entries, name, chunk_size) = (scanned.entries.clone(), o.name.clone(), o.chunk_size);
    let (file, hash, size) = tokio::task::spawn_blocking(move || {
        let fail = |e: String| ImportError::Invalid(format!("sealing the namespace: {e}"));
        let mut entries = entries
            .into_iter()
            .map(|e| locus_proto::Entry::try_from(e).map_err(|e| fail(e.to_string())))
            .collect::<Result<Vec<_>>>()?;
        entries.sort_unstable_by(|a, b| locus_proto::sealed::canonical_cmp(a.path.as_str(), b.path.as_str()));
        let file = tempfile::NamedTempFile::new().map_err(|e| fail(e.to_string()))?;
        let out = std::io::BufWriter::with_capacity(1 << 20, file.reopen().map_err(|e| fail(e.to_string()))?);
        // The import's session records tree chunk hashes (`ops::cluster::begin`).
        let kind = locus_proto::chunks::ChunkKind::Tree;
        let mut w =
            locus_proto::sealed::Writer::with_kind(out, chunk_size, kind).map_err(|e| fail(e.to_string()))?;
        for e in &entries {
            w.push(e).map_err(|e| fail(e.to_string()))?;
        }
        let sealed = w.finish(&name, &cluster_id).map_err(|e| fail(e.to_string()))?;
        let (hash, size) = (sealed.hash, sealed.size);
        Ok::<_, ImportError>((file, hash, size))
    })
    .await
    .map_err(|e| ImportError::Invalid(format!("sealing the namespace: {e}")))??;
    store_namespace(cluster, &nodes, file.path(), (hash, size, chunk_size)).await?;
    drop(file);
    Ok(Some((hash, size)))
}

/// Stores the sealed namespace in the file at `path` on `nodes` (a shard's replicas):
/// sent once, to the first; the others copy it from there (a client's uplink is the
/// scarce one), or are sent it where nodes cannot copy.
pub(crate) async fn store_namespace(
    cluster: &Arc<dyn ImportCluster>,
    nodes: &[String],
    path: &std::path::Path,
    (hash, size, chunk_size): (BlobHash, u64, u32),
) -> Result<()> {
    let upload = || Upload {
        hash,
        size,
        chunk_size,
        source: super::scan::BlobSource::Local(path.to_path_buf()),
        store: None,
        done: Arc::new(std::sync::atomic::AtomicU64::new(0)),
    };
    let failed =
        |n: &str, e: NodeError| ImportError::transfer(format!("storing the sealed namespace on {n}"), e);
    let Some((first, rest)) = nodes.split_first() else {
        return Err(ImportError::Unplaced("the first shard has no replicas".into()));
    };
    cluster
        .send(first, upload())
        .await
        .map_err(|e| failed(first, e))?;
    let copies = rest.iter().map(|n| async move {
        let blob = locus_proto::nodepb::BlobRef {
            hash: hash.0.to_vec(),
            size,
            ..Default::default()
        };
        if let Err(e) = cluster.copy(n, first, blob, chunk_size).await {
            tracing::debug!("node {n} cannot copy the namespace from {first} ({e}); sending it");
            cluster.send(n, upload()).await.map_err(|e| failed(n, e))?;
        }
        Ok::<_, ImportError>(())
    });
    for r in futures_util::future::join_all(copies).await {
        r?;
    }
    Ok(())
}
