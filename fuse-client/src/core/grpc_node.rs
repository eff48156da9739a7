//! The mount's side of the node's local socket: gRPC `EnsureLocal` and `LocalPaths`,
//! answered with paths into the node's data dir (which this mount's user may read).

use std::path::PathBuf;
use std::time::Duration;

use locus_proto::client::NodeClient;
use locus_proto::{nodepb, BlobHash};

use super::{KnownPath, LocalError, LocalNode, NodeBlob};

/// The node over its Unix socket.
pub struct GrpcLocalNode {
    pub client: NodeClient,
    pub rt: tokio::runtime::Handle,
    pub chunk_size: u32,
}

impl LocalNode for GrpcLocalNode {
    fn ensure_local(&self, blob: BlobHash, size: u64, limit: Duration) -> Result<NodeBlob, LocalError> {
        let mut node = self.client.clone();
        let req = nodepb::EnsureLocalRequest {
            hash: blob.0.to_vec(),
            size,
            chunk_size: self.chunk_size,
            packed_ok: true,
        };
        self.rt.block_on(async move {
            match tokio::time::timeout(limit, node.ensure_local(req)).await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    Ok(NodeBlob {
                        path: PathBuf::from(r.path),
                        offset: r.offset,
                        packed: r.packed,
                    })
                }
                Ok(Err(s)) => Err(LocalError::from_status(&s)),
                Err(_) => Err(LocalError::Unreachable(format!("no answer within {limit:?}"))),
            }
        })
    }

    fn local_paths(&self, blobs: &[BlobHash], limit: Duration) -> Result<Vec<Option<KnownPath>>, LocalError> {
        let mut out = Vec::with_capacity(blobs.len());
        for batch in blobs.chunks(10_000) {
            let mut node = self.client.clone();
            let req = nodepb::LocalPathsRequest {
                hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
                packed_ok: true,
            };
            let paths = self.rt.block_on(async move {
                match tokio::time::timeout(limit, node.local_paths(req)).await {
                    Ok(Ok(r)) => Ok(r.into_inner().paths),
                    Ok(Err(s)) => Err(LocalError::from_status(&s)),
                    Err(_) => Err(LocalError::Unreachable(format!("no answer within {limit:?}"))),
                }
            })?;
            if paths.len() != batch.len() {
                return Err(LocalError::Refused(format!(
                    "{} paths for {} blobs",
                    paths.len(),
                    batch.len()
                )));
            }
            out.extend(paths.into_iter().map(|p| {
                (!p.path.is_empty()).then(|| KnownPath {
                    path: PathBuf::from(p.path),
                    ino: p.ino,
                    ctime_s: p.ctime_s,
                    ctime_ns: p.ctime_ns,
                    size: p.size,
                    offset: p.offset,
                    packed: p.packed,
                })
            }));
        }
        Ok(out)
    }
}
