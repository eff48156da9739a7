//! What imports and backups ask of the cluster — the metadata service's calls and the
//! nodes' blob writes and uploads — behind traits, so their own rules (a failed send
//! aborts the session, nothing is sent twice, unplaced shards are refused; a blob a node
//! cannot send is asked of the next replica, nothing is committed while a blob is
//! missing) are unit-tested with a fake cluster. [`GrpcCluster`] is the real one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use locus_proto::client::{MetadataClient, NodeClient};

use locus_proto::grant::{Grants, NodeLinks, Op};
use locus_proto::manifest::FileHashes;
use locus_proto::{nodepb, pb, BlobHash};
use send::send_blob;

use super::scan::BlobSource;

mod error;
mod send;
pub use error::NodeError;

/// A boxed future, for the object-safe trait.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A file of a dataset's latest version: (path, size, blob).
pub type PreviousFile = (String, u64, BlobHash);

/// One blob to store on a node, pinned.
#[derive(Clone)]
pub struct Upload {
    pub hash: BlobHash,
    pub size: u64,
    pub chunk_size: u32,
    pub source: BlobSource,
    /// Where an object-store source is read from.
    pub store: Option<Arc<dyn object_store::ObjectStore>>,
    /// Advanced as bytes go out.
    pub done: Arc<AtomicU64>,
}

pub trait ImportCluster: Send + Sync {
    /// Opens an import session; its id.
    fn begin(&self, r: pb::BeginVersionRequest) -> BoxFuture<'_, Result<u64, tonic::Status>>;
    fn put_entries(&self, session: u64, entries: Vec<pb::Entry>) -> BoxFuture<'_, Result<(), tonic::Status>>;
    /// For each blob, the nodes that hold it as a replica.
    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>>;
    fn place(
        &self,
        r: pb::PlaceShardsRequest,
    ) -> BoxFuture<'_, Result<pb::PlaceShardsResponse, tonic::Status>>;
    fn put_shards(&self, session: u64, shards: Vec<pb::Shard>) -> BoxFuture<'_, Result<(), tonic::Status>>;
    /// Commits the session; `namespace`: the sealed namespace stored with it (hash, size).
    fn commit(
        &self,
        session: u64,
        namespace: Option<(BlobHash, u64)>,
    ) -> BoxFuture<'_, Result<pb::Version, tonic::Status>>;
    /// The cluster's id (what a sealed namespace names).
    fn cluster_id(&self) -> BoxFuture<'_, Result<String, tonic::Status>>;
    /// Drops the session's manifest now rather than at its expiry; best effort.
    fn abort(&self, session: u64) -> BoxFuture<'_, ()>;
    /// Which of `blobs` the node holds already; those it holds it pins for the import
    /// (as it pins what it is sent), so none is evicted before the commit lists it.
    fn have<'a>(&'a self, node: &'a str, blobs: Vec<BlobHash>)
        -> BoxFuture<'a, Result<Vec<bool>, NodeError>>;
    /// Stores one blob on the node (which verifies it).
    fn send<'a>(&'a self, node: &'a str, blob: Upload) -> BoxFuture<'a, Result<(), NodeError>>;
    /// Stores many small blobs (local files or bytes in memory) on the node in one group
    /// commit (each verified).
    /// Clusters without one send them one by one.
    fn send_small<'a>(&'a self, node: &'a str, blobs: Vec<Upload>) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            for b in blobs {
                self.send(node, b).await?;
            }
            Ok(())
        })
    }
    /// The files of the dataset's latest version; empty when it has none.
    fn previous<'a>(&'a self, dataset: &'a str) -> BoxFuture<'a, Result<Vec<PreviousFile>, tonic::Status>>;
    /// Has `node` read one file of the version's origin itself and store it (pinned); the
    /// file's hashes. Clusters whose nodes cannot do that answer UNIMPLEMENTED.
    fn pull<'a>(
        &'a self,
        node: &'a str,
        r: nodepb::ImportObjectRequest,
    ) -> BoxFuture<'a, Result<FileHashes, tonic::Status>> {
        let _ = (node, r);
        Box::pin(async {
            Err(tonic::Status::unimplemented(
                "this cluster's nodes do not read origins",
            ))
        })
    }
    /// Has `node` copy a blob from node `from` (verified, pinned).
    fn copy<'a>(
        &'a self,
        node: &'a str,
        from: &'a str,
        blob: nodepb::BlobRef,
        chunk_size: u32,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        let _ = (node, from, blob, chunk_size);
        Box::pin(async {
            Err(NodeError::Unsupported(
                "this cluster's nodes do not copy from each other".to_string(),
            ))
        })
    }
}

/// A stream of catalogue pieces.
pub type CatalogStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<bytes::Bytes, tonic::Status>> + Send>>;

pub trait BackupCluster: Send + Sync {
    /// The catalogue as of one instant (one store snapshot), in pieces.
    fn export_catalog(&self) -> BoxFuture<'_, Result<CatalogStream, tonic::Status>>;
    /// Nodes that are up: id → address.
    fn live_nodes(&self) -> BoxFuture<'_, Result<HashMap<String, String>, tonic::Status>>;
    /// For each blob, the nodes that hold it as a replica.
    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>>;
    /// Tells the metadata service the target holds a committed snapshot (a source for
    /// blobs every node lost).
    fn record_backup(&self, url: String, snapshot: String) -> BoxFuture<'_, Result<(), tonic::Status>>;
    /// Has `node` upload `r.blobs` into the target `r.target`; `done` advances by the
    /// bytes uploaded or found stored as the node reports them. The node's final tally,
    /// or why the node failed as a whole (unreachable, silent, refused).
    fn upload<'a>(
        &'a self,
        node: &'a str,
        r: nodepb::UploadBlobsRequest,
        done: &'a AtomicU64,
    ) -> BoxFuture<'a, Result<nodepb::UploadProgress, NodeError>>;
}

/// The cluster over gRPC: the metadata service, and node connections opened once per
/// node and grant. Nodes are never sent this client's token, only grants for the
/// operation at hand (`locus_proto::grant`), renewed on long runs.
pub struct GrpcCluster {
    meta: MetadataClient,
    addresses: tokio::sync::OnceCell<HashMap<String, String>>,
    nodes: NodeLinks,
}

impl GrpcCluster {
    pub fn new(meta: MetadataClient, token: Option<String>) -> Self {
        GrpcCluster {
            nodes: NodeLinks::new(Grants::new(meta.clone(), token.as_deref())),
            meta,
            addresses: tokio::sync::OnceCell::new(),
        }
    }

    async fn address(&self, node: &str) -> Result<String, NodeError> {
        let addresses = self
            .addresses
            .get_or_try_init(|| async {
                let mut m = self.meta.clone();
                let nodes = m
                    .list_nodes(pb::ListNodesRequest {})
                    .await
                    .map_err(|s| NodeError::Unreachable(super::status_sentence(&s)))?
                    .into_inner()
                    .nodes;
                Ok::<_, NodeError>(nodes.into_iter().map(|n| (n.id, n.address)).collect())
            })
            .await?;
        addresses
            .get(node)
            .cloned()
            .ok_or_else(|| NodeError::Unreachable(format!("node {node} has no address")))
    }

    /// A connection to `node` that presents a grant for `op` on `target`; its address.
    async fn node(&self, node: &str, op: Op, target: &str) -> Result<(NodeClient, String), NodeError> {
        use locus_proto::grant::LinkError;
        let addr = self.address(node).await?;
        let c = self
            .nodes
            .link(node, &addr, op, target, Duration::from_secs(5))
            .await
            .map_err(|e| match e {
                LinkError::NoGrant(m) => NodeError::Grant(format!("node {node}: {m}")),
                LinkError::Connect(m) => NodeError::Unreachable(format!("node {node}: {m}")),
            })?;
        Ok((c, addr))
    }

    /// For each blob, the nodes that hold it as a replica.
    async fn locate(&self, blobs: Vec<BlobHash>) -> Result<Vec<Vec<String>>, tonic::Status> {
        let mut m = self.meta.clone();
        let mut out = Vec::with_capacity(blobs.len());
        for batch in blobs.chunks(10_000) {
            let r = m
                .locate_blobs(pb::LocateBlobsRequest {
                    hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
                })
                .await?
                .into_inner();
            out.extend(r.blobs.into_iter().map(|b| b.nodes));
        }
        Ok(out)
    }
}

impl ImportCluster for GrpcCluster {
    fn previous<'a>(&'a self, dataset: &'a str) -> BoxFuture<'a, Result<Vec<PreviousFile>, tonic::Status>> {
        Box::pin(async move {
            let r = pb::VersionRef {
                dataset: dataset.to_string(),
                version: 0,
            };
            let entries =
                match locus_proto::client::list_all_entries(&mut self.meta.clone(), r, None, true).await {
                    Ok((_, e)) => e,
                    Err(s) if s.code() == tonic::Code::NotFound => return Ok(Vec::new()),
                    Err(s) => return Err(s),
                };
            Ok(entries
                .into_iter()
                .filter(|e| e.kind == pb::EntryKind::File as i32)
                .filter_map(|e| Some((e.path, e.size, BlobHash::from_slice("blob", &e.blob).ok()?)))
                .collect())
        })
    }

    fn begin(&self, r: pb::BeginVersionRequest) -> BoxFuture<'_, Result<u64, tonic::Status>> {
        Box::pin(async move {
            let tree = r.tree_chunks;
            let s = self.meta.clone().begin_version(r).await?.into_inner();
            if s.tree_chunks != tree {
                // A service that predates tree chunk hashes would take this client's for
                // plain ones, and every mount would find every chunk wrong.
                self.abort(s.session_id).await;
                return Err(tonic::Status::failed_precondition(
                    "the metadata service predates tree chunk hashes, which this client's \
                     imports record: upgrade the metadata service first",
                ));
            }
            Ok(s.session_id)
        })
    }

    fn put_entries(
        &self,
        session: u64,
        mut entries: Vec<pb::Entry>,
    ) -> BoxFuture<'_, Result<(), tonic::Status>> {
        Box::pin(async move {
            // In the catalogue's key order, the service stores each page without looking
            // every path up for a duplicate (any order is accepted; this one is cheapest).
            entries.sort_unstable_by(|a, b| locus_proto::sealed::canonical_cmp(&a.path, &b.path));
            locus_proto::client::put_entries_paged(&mut self.meta.clone(), session, entries).await?;
            Ok(())
        })
    }

    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>> {
        Box::pin(self.locate(blobs))
    }

    fn place(
        &self,
        r: pb::PlaceShardsRequest,
    ) -> BoxFuture<'_, Result<pb::PlaceShardsResponse, tonic::Status>> {
        Box::pin(async move { Ok(self.meta.clone().place_shards(r).await?.into_inner()) })
    }

    fn put_shards(&self, session: u64, shards: Vec<pb::Shard>) -> BoxFuture<'_, Result<(), tonic::Status>> {
        Box::pin(async move {
            locus_proto::client::put_shards_paged(&mut self.meta.clone(), session, shards).await
        })
    }

    fn commit(
        &self,
        session: u64,
        namespace: Option<(BlobHash, u64)>,
    ) -> BoxFuture<'_, Result<pb::Version, tonic::Status>> {
        Box::pin(async move {
            self.meta
                .clone()
                .commit_version(pb::CommitVersionRequest {
                    session_id: session,
                    namespace_blob: namespace.map(|n| n.0 .0.to_vec()).unwrap_or_default(),
                    namespace_size: namespace.map_or(0, |n| n.1),
                })
                .await?
                .into_inner()
                .version
                .ok_or_else(|| tonic::Status::internal("the service committed without returning the version"))
        })
    }

    fn cluster_id(&self) -> BoxFuture<'_, Result<String, tonic::Status>> {
        Box::pin(async move {
            Ok(self
                .meta
                .clone()
                .get_cluster_info(pb::GetClusterInfoRequest {})
                .await?
                .into_inner()
                .cluster_id)
        })
    }

    fn abort(&self, session: u64) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self
                .meta
                .clone()
                .abort_version(pb::AbortVersionRequest { session_id: session })
                .await;
        })
    }

    fn have<'a>(
        &'a self,
        node: &'a str,
        blobs: Vec<BlobHash>,
    ) -> BoxFuture<'a, Result<Vec<bool>, NodeError>> {
        Box::pin(async move {
            let (mut c, addr) = self.node(node, Op::Import, "").await?;
            let idle = locus_proto::net::peer_idle();
            let mut out = Vec::with_capacity(blobs.len());
            for batch in blobs.chunks(50_000) {
                let ask = c.have_blobs(nodepb::HaveBlobsRequest {
                    hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
                    pin: true,
                });
                let have = tokio::time::timeout(idle, ask)
                    .await
                    .map_err(|_| {
                        NodeError::Unreachable(format!(
                            "node {node} at {addr} did not answer within {}s (LOCUS_PEER_TIMEOUT)",
                            idle.as_secs_f64()
                        ))
                    })?
                    .map_err(|s| NodeError::from_status(node, &s))?
                    .into_inner()
                    .present;
                out.extend(have);
            }
            Ok(out)
        })
    }

    fn pull<'a>(
        &'a self,
        node: &'a str,
        r: nodepb::ImportObjectRequest,
    ) -> BoxFuture<'a, Result<FileHashes, tonic::Status>> {
        Box::pin(async move {
            let (mut c, _) = self
                .node(node, Op::Import, &r.origin)
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            // A node gives up on a silent source after its own peer timeout; this bounds a
            // node that stops answering: a minute plus the bytes at a slow 20 MB/s.
            let limit = Duration::from_secs(60) + Duration::from_secs_f64(r.size as f64 / 20e6);
            let (size, chunk_size, tree) = (r.size, r.chunk_size, r.tree_chunks);
            let resp = tokio::time::timeout(limit, c.import_object(r))
                .await
                .map_err(|_| {
                    tonic::Status::unavailable(format!("node {node}: no answer within {}s", limit.as_secs()))
                })??
                .into_inner();
            let hash = BlobHash::from_slice("hash", &resp.hash)
                .map_err(|e| tonic::Status::internal(e.to_string()))?;
            let chunks = resp
                .chunk_hashes
                .iter()
                .map(|c| BlobHash::from_slice("chunk_hashes", c))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tonic::Status::internal(e.to_string()))?;
            if resp.tree_chunks != tree {
                // A node that predates them answered plain chunk hashes.
                return Err(tonic::Status::failed_precondition(format!(
                    "node {node} predates tree chunk hashes (upgrade it)"
                )));
            }
            if chunks.len() as u64 != locus_proto::manifest::chunk_count(size, chunk_size) {
                return Err(tonic::Status::internal(format!(
                    "node {node} returned {} chunk hashes for {size} bytes",
                    chunks.len()
                )));
            }
            Ok((size, hash, chunks))
        })
    }

    fn copy<'a>(
        &'a self,
        node: &'a str,
        from: &'a str,
        blob: nodepb::BlobRef,
        chunk_size: u32,
    ) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            let (mut c, _) = self.node(node, Op::Import, "").await?;
            let source = self.address(from).await?;
            let limit = Duration::from_secs(60) + Duration::from_secs_f64(blob.size as f64 / 20e6);
            let call = c.fetch_blobs(nodepb::FetchBlobsRequest {
                source,
                blobs: vec![blob],
                pin: true,
                chunk_size,
                ..Default::default()
            });
            tokio::time::timeout(limit, call)
                .await
                .map_err(|_| {
                    NodeError::Unreachable(format!("node {node}: no answer within {}s", limit.as_secs()))
                })?
                .map_err(|s| {
                    NodeError::from_status(node, &s).map(|m| format!("{m} (copying from {from})"))
                })?;
            Ok(())
        })
    }

    fn send_small<'a>(&'a self, node: &'a str, blobs: Vec<Upload>) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            let (mut c, _) = self.node(node, Op::Import, "").await?;
            let mut req = nodepb::WriteBlobsRequest {
                blobs: Vec::with_capacity(blobs.len()),
                chunk_size: blobs.first().map_or(0, |b| b.chunk_size),
                pin: true,
            };
            for b in &blobs {
                let data = match &b.source {
                    BlobSource::Memory(data) => data.clone(),
                    BlobSource::Local(path) => tokio::fs::read(path)
                        .await
                        .map_err(|e| NodeError::Source(format!("cannot read {}: {e}", path.display())))?
                        .into(),
                    BlobSource::Remote(_) => {
                        return Err(NodeError::Source(format!(
                            "{} is not read yet; WriteBlobs takes local files and bytes in memory",
                            b.source
                        )))
                    }
                };
                if data.len() as u64 != b.size {
                    return Err(NodeError::Source(format!(
                        "{} changed size during the import ({} bytes, {} when hashed); rerun it",
                        b.source,
                        data.len(),
                        b.size
                    )));
                }
                req.blobs.push(nodepb::SmallBlob {
                    hash: b.hash.0.to_vec(),
                    data,
                });
            }
            // One message: the node answers once all are durable, so the wait is bounded
            // by the idle timeout as a whole call.
            let idle = locus_proto::net::peer_idle_setting().unwrap_or(Duration::from_secs(60));
            match tokio::time::timeout(idle, c.write_blobs(req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(s)) => return Err(NodeError::from_status(node, &s)),
                Err(_) => {
                    return Err(NodeError::Unreachable(format!(
                    "node {node} did not answer a batch of {} small files within {}s (LOCUS_PEER_TIMEOUT)",
                    blobs.len(),
                    idle.as_secs()
                )))
                }
            }
            for b in &blobs {
                b.done.fetch_add(b.size, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    fn send<'a>(&'a self, node: &'a str, blob: Upload) -> BoxFuture<'a, Result<(), NodeError>> {
        Box::pin(async move {
            if let Some(done) = self.send_bulk(node, &blob).await? {
                return Ok(done);
            }
            let (c, _) = self.node(node, Op::Import, "").await?;
            send_blob(node, c, blob).await
        })
    }
}

impl BackupCluster for GrpcCluster {
    fn export_catalog(&self) -> BoxFuture<'_, Result<CatalogStream, tonic::Status>> {
        Box::pin(async move {
            use futures_util::StreamExt;
            let s = self
                .meta
                .clone()
                .export_catalog(pb::ExportCatalogRequest {})
                .await?
                .into_inner();
            Ok(Box::pin(s.map(|c| c.map(|c| bytes::Bytes::from(c.data)))) as CatalogStream)
        })
    }

    fn live_nodes(&self) -> BoxFuture<'_, Result<HashMap<String, String>, tonic::Status>> {
        Box::pin(async move {
            let nodes = self
                .meta
                .clone()
                .list_nodes(pb::ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            Ok(nodes
                .into_iter()
                .filter(|n| n.state == pb::NodeState::Up as i32)
                .map(|n| (n.id, n.address))
                .collect())
        })
    }

    fn holders(&self, blobs: Vec<BlobHash>) -> BoxFuture<'_, Result<Vec<Vec<String>>, tonic::Status>> {
        Box::pin(self.locate(blobs))
    }

    fn record_backup(&self, url: String, snapshot: String) -> BoxFuture<'_, Result<(), tonic::Status>> {
        Box::pin(async move {
            self.meta
                .clone()
                .record_backup(pb::RecordBackupRequest {
                    url,
                    snapshot,
                    restored: false,
                })
                .await?;
            Ok(())
        })
    }

    fn upload<'a>(
        &'a self,
        node: &'a str,
        r: nodepb::UploadBlobsRequest,
        done: &'a AtomicU64,
    ) -> BoxFuture<'a, Result<nodepb::UploadProgress, NodeError>> {
        Box::pin(async move {
            use futures_util::StreamExt;
            let (mut c, addr) = self.node(node, Op::Backup, &r.target).await?;
            // A working node reports at least every 5 s (UploadBlobs); one silent for the
            // peer timeout hangs, and the run says so instead of waiting.
            let idle = locus_proto::net::peer_idle().max(Duration::from_secs(10));
            let silent = || {
                NodeError::Unreachable(format!(
                    "{addr} sent no progress for {}s (LOCUS_PEER_TIMEOUT)",
                    idle.as_secs_f64()
                ))
            };
            let mut s = tokio::time::timeout(idle, c.upload_blobs(r))
                .await
                .map_err(|_| silent())?
                .map_err(|s| NodeError::from_status(node, &s))?
                .into_inner();
            let mut last = nodepb::UploadProgress::default();
            let mut counted = 0;
            while let Some(p) = tokio::time::timeout(idle, s.next()).await.map_err(|_| silent())? {
                let p = p.map_err(|s| NodeError::from_status(node, &s))?;
                let now = p.bytes_uploaded + p.bytes_skipped;
                done.fetch_add(now.saturating_sub(counted), Ordering::Relaxed);
                counted = now;
                last = p;
            }
            if !last.finished {
                return Err(NodeError::Unreachable(format!(
                    "node {node} ended the upload without finishing it"
                )));
            }
            Ok(last)
        })
    }
}
