//! The mount's remote source: chunks read from cache nodes over the bulk path (gRPC for
//! a node without it), each connection presenting a read grant; and the metadata service
//! asked over gRPC where blobs are and what the version's shards and nodes look like.

use std::time::Duration;

use locus_proto::client::{MetadataClient, NodeClient};
use locus_proto::{nodepb, pb, BlobHash};

use super::*;

/// Bytes hashed at a time as a chunk arrives: the largest read the kernel sends a mount
/// (1 MiB), small enough to be hashed while the receive copy left it in the CPU's cache.
const BULK_PIECE: usize = 1 << 20;

/// The cluster's replicas over gRPC: node connections kept per address, the metadata
/// service for locations and topology. Nodes are sent a read grant (renewed while the
/// mount lives), never the mount's token.
pub struct GrpcReplicas {
    metadata: MetadataClient,
    version: pb::VersionRef,
    /// Node connections, each presenting a read grant every node accepts.
    links: locus_proto::grant::NodeLinks,
    /// The read grants' target, `DATASET@N`: a token narrowed to datasets is granted this
    /// version's blobs only.
    target: String,
}

impl GrpcReplicas {
    pub fn new(metadata: MetadataClient, version: pb::VersionRef, token: Option<String>) -> Self {
        GrpcReplicas {
            links: locus_proto::grant::NodeLinks::new(locus_proto::grant::Grants::new(
                metadata.clone(),
                token.as_deref(),
            )),
            target: format!("{}@{}", version.dataset, version.version),
            metadata,
            version,
        }
    }

    async fn client(&self, addr: &str) -> Result<NodeClient, SourceError> {
        use locus_proto::grant::LinkError;
        self.links
            .link(
                "*",
                addr,
                locus_proto::grant::Op::Read,
                &self.target,
                Duration::from_secs(3),
            )
            .await
            .map_err(|e| match e {
                LinkError::NoGrant(m) => SourceError::Grant(m),
                LinkError::Connect(m) => SourceError::Unreachable(m),
            })
    }

    async fn read_from(&self, addr: &str, c: ChunkRef, idle: Duration) -> Result<Pieces, SourceError> {
        use locus_proto::bulk::BulkError;
        // The bulk path first: the node sends from its file and the bytes land straight
        // in the pieces that are verified and cached.
        match self
            .links
            .bulk_read(
                "*",
                addr,
                locus_proto::grant::Op::Read,
                &self.target,
                &c.blob,
                c.offset,
                c.len,
                idle,
            )
            .await
        {
            Ok(mut r) => {
                // Into one buffer for the chunk (`memory`: huge pages, reused), hashed a
                // piece of the kernel's read size at a time as it arrives, while it is
                // still in the CPU's cache (a whole chunk received first and hashed
                // after is read back from memory: measurably dearer per byte). Any read
                // inside the chunk is then answered with a slice of it.
                let len = usize::try_from(r.len())
                    .ok()
                    .filter(|n| *n as u64 == c.len)
                    .ok_or_else(|| SourceError::Wrong(format!("sends {} bytes for {}", r.len(), c.len)))?;
                let mut mem = memory::ChunkMemory::take(len);
                let mut hasher = c.at().hasher();
                let buf = mem.as_mut_slice();
                let mut done = 0;
                while done < len {
                    let piece = &mut buf[done..(done + BULK_PIECE).min(len)];
                    let mut got = 0;
                    while got < piece.len() {
                        match r.read_into(&mut piece[got..]).await {
                            Ok(0) => return Err(SourceError::Unreachable("the answer ended early".into())),
                            Ok(n) => got += n,
                            Err(e) => return Err(SourceError::Unreachable(e.to_string())),
                        }
                    }
                    hasher.update(piece);
                    done += piece.len();
                }
                let whole = Bytes::from_owner(mem);
                return Ok(Pieces::hashed(vec![whole], c.at(), &hasher));
            }
            Err(BulkError::Unsupported(_)) => {}
            Err(BulkError::Missing(m)) => return Err(SourceError::Missing(m)),
            Err(BulkError::Grant(m)) => return Err(SourceError::Grant(m)),
            Err(e) => return Err(SourceError::Unreachable(e.to_string())),
        }
        let mut client = self.client(addr).await?;
        let mut stream = tokio::time::timeout(
            idle,
            client.read_blob(nodepb::ReadBlobRequest {
                hash: c.blob.0.to_vec(),
                offset: c.offset,
                length: c.len,
            }),
        )
        .await
        .map_err(|_| SourceError::Unreachable(format!("no answer within {idle:?}")))?
        .map_err(|s| SourceError::from_status(&s))?
        .into_inner();
        let mut pieces = Vec::with_capacity(4);
        let mut got = 0;
        loop {
            let msg = tokio::time::timeout(idle, stream.message())
                .await
                .map_err(|_| SourceError::Unreachable(format!("stalled for {idle:?}")))?
                .map_err(|s| SourceError::from_status(&s))?;
            let Some(m) = msg else { break };
            got += m.data.len();
            if got > c.len as usize {
                return Err(SourceError::Wrong("sent more bytes than asked for".into()));
            }
            pieces.push(m.data);
        }
        Ok(pieces.into())
    }
}

impl Replicas for GrpcReplicas {
    fn read<'a>(
        &'a self,
        addr: &'a str,
        c: ChunkRef,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Pieces, SourceError>> {
        Box::pin(self.read_from(addr, c, idle))
    }

    fn read_range<'a>(
        &'a self,
        addr: &'a str,
        r: RangeRequest,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Option<Ranged>, SourceError>> {
        Box::pin(async move {
            use locus_proto::bulk::BulkError;
            match self
                .links
                .bulk_range("*", addr, locus_proto::grant::Op::Read, &self.target, &r, idle)
                .await
            {
                Ok(r) => Ok(Some(r)),
                // gRPC has no ranges with proofs: the whole chunk, then.
                Err(BulkError::Unsupported(_)) => Ok(None),
                // It cannot prove this range (a blob over 1 GiB stored by a build that
                // kept no outboards): nothing wrong with the node, the whole chunk then.
                Err(BulkError::Refused(_)) => Ok(None),
                Err(BulkError::Missing(m)) => Err(SourceError::Missing(m)),
                Err(BulkError::Grant(m)) => Err(SourceError::Grant(m)),
                Err(e) => Err(SourceError::Unreachable(e.to_string())),
            }
        })
    }

    fn forget<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, ()> {
        // The grant too: a node that refused it (a revoked key) must see a fresh one.
        // `refused` also closes the kept bulk connections.
        Box::pin(
            self.links
                .refused("*", addr, locus_proto::grant::Op::Read, &self.target),
        )
    }

    fn locate<'a>(
        &'a self,
        blob: BlobHash,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Located, SourceError>> {
        Box::pin(async move {
            let mut m = self.metadata.clone();
            let ask = m.locate_blobs(pb::LocateBlobsRequest {
                hashes: vec![blob.0.to_vec()],
            });
            // A reader is waiting: a hung metadata service costs it one timeout.
            let r = tokio::time::timeout(timeout, ask)
                .await
                .map_err(|_| {
                    SourceError::Unreachable(format!(
                        "the metadata service did not answer within {timeout:?}"
                    ))
                })?
                .map_err(|s| SourceError::from_status(&s))?
                .into_inner();
            Ok(Located {
                nodes: r
                    .blobs
                    .into_iter()
                    .flat_map(|b| b.nodes.into_iter().zip(b.addresses))
                    .collect(),
                backups: r.backups,
            })
        })
    }

    fn topology<'a>(&'a self, place: &'a Place) -> BoxFuture<'a, Result<Topology, SourceError>> {
        Box::pin(async move {
            let mut c = self.metadata.clone();
            // A metadata service that hangs must not stall the mount's housekeeping.
            tokio::time::timeout(REFRESH_TIMEOUT, Topology::load(&mut c, &self.version, place))
                .await
                .map_err(|_| {
                    SourceError::Unreachable(format!(
                        "the metadata service did not answer within {REFRESH_TIMEOUT:?}"
                    ))
                })?
                .map_err(|s| SourceError::from_status(&s))
        })
    }
}
