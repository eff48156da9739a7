//! Where blobs and shards are: placing an import's shards (within its team's quota),
//! locating blobs (a scoped caller is told only of its own datasets'), and the
//! membership nodes check narrowed read grants against.

use locus_proto::pb;
use tonic::Status;

use super::{to_status, MetadataService, QuotaFor};
use crate::auth::{Action, Principal};

impl MetadataService {
    /// `BlobsInVersions`: which of the hashes the versions' shards hold (a node checking
    /// a narrowed read grant).
    pub(super) async fn members_of(
        &self,
        q: pb::BlobsInVersionsRequest,
    ) -> Result<pb::BlobsInVersionsResponse, Status> {
        if q.versions.len() > 64 || q.hashes.len() > 10_000 {
            return Err(Status::invalid_argument(
                "at most 64 versions and 10,000 hashes per call",
            ));
        }
        let hashes = q
            .hashes
            .iter()
            .map(|h| locus_proto::BlobHash::from_slice("hashes", h))
            .collect::<Result<Vec<_>, _>>()?;
        let member = self
            .run(move |c| c.blobs_in_versions(&q.versions, &hashes))
            .await
            .map_err(to_status)?;
        Ok(pb::BlobsInVersionsResponse { member })
    }

    /// `PlaceShards`: where an import's shards go, within its team's quota.
    pub(super) async fn place(
        &self,
        p: Principal,
        q: pb::PlaceShardsRequest,
    ) -> Result<pb::PlaceShardsResponse, Status> {
        // Placing an import's shards is part of an import: of the session's dataset when
        // it names one.
        if p.scope.as_ref().is_some_and(|s| !s.allows_any(Action::Import)) {
            self.unscoped(&p, "placing shards")?;
        }
        if q.shards.len() > 1_000_000 {
            return Err(Status::invalid_argument("shards: at most 1,000,000 per call"));
        }
        if q.session_id != 0 {
            self.session_scope(&p, q.session_id).await?;
            let replicas = u64::from(q.replication.max(1));
            let needs = q
                .shards
                .iter()
                .fold(0u64, |a, s| a.saturating_add(s.bytes.saturating_mul(replicas)));
            self.within_quota(QuotaFor::Session(q.session_id), needs).await?;
        }
        let shards: Vec<(u32, u64, Vec<String>)> =
            q.shards.into_iter().map(|s| (s.id, s.bytes, s.prefer)).collect();
        let replication = if q.replication == 0 { 1 } else { q.replication };
        let (placed, unplaced) = self
            .run(move |c| c.place_shards(&shards, replication))
            .await
            .map_err(to_status)?;
        Ok(pb::PlaceShardsResponse {
            placements: placed
                .into_iter()
                .map(|(shard, nodes)| pb::ShardPlacement { shard, nodes })
                .collect(),
            unplaced: unplaced
                .into_iter()
                .map(|(shard, reason)| pb::UnplacedShard { shard, reason })
                .collect(),
        })
    }

    /// `LocateBlobs`: where each blob is; a scoped caller is told only of its datasets'.
    pub(super) async fn locate(
        &self,
        p: Principal,
        q: pb::LocateBlobsRequest,
    ) -> Result<pb::LocateBlobsResponse, Status> {
        if q.hashes.len() > 10_000 {
            return Err(Status::invalid_argument("hashes: at most 10,000 per call"));
        }
        let hashes = q
            .hashes
            .iter()
            .map(|h| locus_proto::BlobHash::from_slice("hashes", h))
            .collect::<Result<Vec<_>, _>>()?;
        // A scoped caller learns where a blob is only if a dataset in its scope holds it;
        // any other is answered as a blob no version holds.
        let scope = p.scope.clone();
        let found = self
            .run(move |c| {
                let mut found = c.locate_blobs(&hashes)?;
                if let Some(scope) = scope {
                    let seen = c.blobs_seen(&hashes, |d| scope.sees(d))?;
                    for (f, seen) in found.iter_mut().zip(seen) {
                        if !seen {
                            *f = Default::default();
                        }
                    }
                }
                Ok(found)
            })
            .await
            .map_err(to_status)?;
        let backups = match p.is_scoped() {
            true => Vec::new(),
            false => self.run(|c| c.backup_sources()).await.map_err(to_status)?,
        };
        Ok(pb::LocateBlobsResponse {
            backups,
            blobs: q
                .hashes
                .into_iter()
                .zip(found)
                .map(|(hash, (nodes, addresses, size))| pb::BlobLocation {
                    hash,
                    nodes,
                    addresses,
                    size: size.map_or(0, |s| s.0),
                    chunk_size: size.map_or(0, |s| s.1),
                    known: size.is_some(),
                })
                .collect(),
        })
    }
}
