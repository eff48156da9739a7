//! `locus dataset seal`: gives a version committed before sealed namespaces (by an older
//! Locus, or restored from a catalogue it wrote) the namespace mounts need.
//!
//! The same as an import's last step, on a version that exists: its entries are read
//! from the catalogue page by page (in catalogue order, the namespace's) and sealed into
//! a temp file as they arrive, never all held at once; the file is stored on the first
//! shard's replicas; the metadata service seals the entries again itself and records the
//! namespace only if the two agree.

use std::sync::Arc;

use locus_proto::client::MetadataClient;
use locus_proto::{pb, Entry};

use super::cluster::ImportCluster;
use super::import::{store_namespace, ImportError};

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
    let mut w = locus_proto::sealed::Writer::new(out, v.chunk_size).map_err(|e| fail(e.to_string()))?;
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
