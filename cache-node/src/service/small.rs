//! `WriteBlobs`: many small blobs in one call, each verified against its name and all made
//! durable and visible together — as one pack (`store::BlobStore::write_packed`) when
//! there are many, else a file each with the store's group commit
//! (`store::BlobStore::commit_batch`). What an import of small files sends.

use locus_proto::{nodepb, BlobHash};
use tonic::Status;

use super::{hash, to_status, NodeService};

/// At most this many blobs per call, of at most `MAX_BLOB` bytes each: a call is one
/// message, held whole in memory, and its commit one batch.
pub const MAX_BLOBS: usize = 4096;
pub const MAX_BLOB: usize = 1 << 20;
/// A call with at least this many blobs is stored as one pack (`store::pack`); fewer are
/// written a file each and committed together: a pack pays off over many files, and a
/// file of its own is what a mount can hand the kernel whole.
pub const PACK_MIN: usize = 16;

impl NodeService {
    pub(super) async fn write_small(
        &self,
        q: nodepb::WriteBlobsRequest,
    ) -> Result<nodepb::WriteBlobsResponse, Status> {
        self.not_local("WriteBlobs")?;
        if q.blobs.len() > MAX_BLOBS {
            return Err(Status::invalid_argument(format!(
                "blobs: {} in one call; at most {MAX_BLOBS}",
                q.blobs.len()
            )));
        }
        let mut blobs = Vec::with_capacity(q.blobs.len());
        for b in q.blobs {
            let h = hash(&b.hash)?;
            if b.data.len() > MAX_BLOB {
                return Err(Status::invalid_argument(format!(
                    "blob {h}: {} bytes; WriteBlobs takes blobs of at most {MAX_BLOB} (WriteBlob takes any)",
                    b.data.len()
                )));
            }
            blobs.push((h, b.data));
        }
        let store = self.store.clone();
        let (chunk_size, pin) = (q.chunk_size, q.pin);
        let r = tokio::task::spawn_blocking(move || {
            if blobs.len() >= PACK_MIN {
                let refs: Vec<(BlobHash, &[u8])> = blobs.iter().map(|(h, d)| (*h, &d[..])).collect();
                let w = store.write_packed(&refs, chunk_size, pin)?;
                return Ok((w.stored, w.already_present, w.bytes));
            }
            let mut staged = Vec::with_capacity(blobs.len());
            let mut already = 0u32;
            let mut bytes = 0u64;
            for (h, data) in &blobs {
                match store.begin_write(*h, data.len() as u64, chunk_size, pin)? {
                    None => already += 1,
                    Some(mut w) => {
                        w.write(data)?;
                        staged.push(w.finish_staged()?);
                        bytes += data.len() as u64;
                    }
                }
            }
            let stored = store.commit_batch(staged)?.len() as u32;
            Ok::<_, crate::store::StoreError>((stored, already, bytes))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let (stored, already_present, bytes) = r.map_err(|e| {
            self.metrics.refused(match &e {
                crate::store::StoreError::Full { .. } => "full",
                crate::store::StoreError::Mismatch { .. } => "mismatch",
                _ => "error",
            });
            to_status(e)
        })?;
        self.metrics.wrote_many("client", u64::from(stored), bytes);
        Ok(nodepb::WriteBlobsResponse {
            stored,
            already_present,
        })
    }
}
