//! For same-host clients on the node's Unix socket (mounts): where a verified blob's
//! bytes are on this host's disk (`LocalPaths`, without fetching or hashing), and "make
//! this blob local" (`EnsureLocal`, from a peer if needed). A packed blob is a range of a
//! shared file, answered only to clients that say they read ranges (`packed_ok`).

use locus_proto::nodepb;
use locus_proto::BlobHash;
use tonic::Status;

use super::{hash, to_status, NodeService};

impl NodeService {
    /// `BlobStore::verified_path` off the async threads: it may hash a whole blob.
    pub(crate) async fn verified_path(&self, h: BlobHash) -> Result<Option<crate::store::Located>, Status> {
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        let before = store.stats().quarantined;
        let r = tokio::task::spawn_blocking(move || store.verified_path(&h))
            .await
            .map_err(|e| Status::internal(format!("verification task failed: {e}")))?
            .map_err(to_status);
        if self.store.stats().quarantined > before {
            metrics.corrupt.inc();
        }
        r
    }

    pub(super) async fn paths_here(
        &self,
        q: nodepb::LocalPathsRequest,
    ) -> Result<nodepb::LocalPathsResponse, Status> {
        if !self.local {
            return Err(Status::permission_denied(
                "LocalPaths is served on the node's Unix socket only",
            ));
        }
        if q.hashes.len() > 10_000 {
            return Err(Status::invalid_argument(format!(
                "{} hashes in one LocalPaths call; at most 10,000",
                q.hashes.len()
            )));
        }
        let hashes = q.hashes.iter().map(|h| hash(h)).collect::<Result<Vec<_>, _>>()?;
        let store = self.store.clone();
        let packed_ok = q.packed_ok;
        let paths = tokio::task::spawn_blocking(move || {
            hashes
                .iter()
                .map(|h| match store.trusted_path(h) {
                    Some((at, s)) if packed_ok || !at.packed => nodepb::LocalPath {
                        path: at.path.display().to_string(),
                        ino: s.ino,
                        ctime_s: s.ctime_s,
                        ctime_ns: s.ctime_ns,
                        size: s.size,
                        offset: at.offset,
                        packed: at.packed,
                    },
                    _ => nodepb::LocalPath::default(),
                })
                .collect()
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(nodepb::LocalPathsResponse { paths })
    }

    /// `team`: whom the copy, if one is needed, is cached for (`store::teams`).
    pub(crate) async fn make_local(
        &self,
        q: nodepb::EnsureLocalRequest,
        team: crate::store::TeamId,
    ) -> Result<nodepb::EnsureLocalResponse, Status> {
        if !self.local {
            return Err(Status::permission_denied(
                "EnsureLocal is served on the node's Unix socket only",
            ));
        }
        let h = hash(&q.hash)?;
        let answer = |at: crate::store::Located| {
            if at.packed && !q.packed_ok {
                return Err(Status::failed_precondition(format!(
                    "blob {h} is stored packed with other blobs; this client reads whole \
                     files only (read it with ReadBlob, or upgrade the client)"
                )));
            }
            Ok(nodepb::EnsureLocalResponse {
                path: at.path.display().to_string(),
                offset: at.offset,
                packed: at.packed,
            })
        };
        if let Some(at) = self.verified_path(h).await? {
            return answer(at);
        }
        // Whoever can reach the socket names the blob, never its size: that would decide
        // how much of this node's cache is evicted for it. The size is the manifest's.
        let sources = self.peers.locate(&h).await?;
        let Some((size, chunk_size)) = sources.size else {
            return Err(Status::not_found(format!(
                "blob {h} is in no committed version of this cluster"
            )));
        };
        let opts = crate::transfer::CopyOptions {
            me: &self.id,
            pin: false,
            team,
            idle: self.peer_idle,
            limit: None,
            origin: None,
        };
        let src = crate::transfer::copy_from_anywhere(
            &self.store,
            &self.peers,
            h,
            size,
            chunk_size,
            opts,
            Some(sources),
        )
        .await?;
        if let Some(kind) = src.kind() {
            self.metrics.wrote(kind, size)
        }
        match self.verified_path(h).await? {
            Some(at) => answer(at),
            None => Err(Status::unavailable(format!(
                "blob {h} was copied but failed its check here; try again"
            ))),
        }
    }
}
