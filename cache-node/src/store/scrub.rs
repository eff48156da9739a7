//! What the scrub walks: stored blobs in hash order from a cursor kept in the index, so a
//! pass over a large disk (a day at the default rate) resumes where it stopped after a
//! restart instead of starting over.

use locus_proto::BlobHash;
use prost::Message;

use super::record::BlobRecord;
use super::{BlobStore, StoreError};

/// The index key of the scrub's cursor. Blob keys are 32-byte hashes; this is not one, so
/// the restart's reconcile passes over it.
const CURSOR_KEY: &[u8] = b"scrub-cursor";

impl BlobStore {
    /// Up to `n` complete blobs (hash, size) after `after` in hash order (from the first
    /// when None). Reads the index; blocking.
    pub fn scrub_batch(&self, after: Option<BlobHash>, n: usize) -> Result<Vec<(BlobHash, u64)>, StoreError> {
        let start = after.map(|h| h.0).unwrap_or([0u8; 32]);
        let mode = rocksdb::IteratorMode::From(&start, rocksdb::Direction::Forward);
        let mut out = Vec::with_capacity(n);
        for kv in self.index.iterator(mode) {
            let (k, v) = kv.map_err(|e| StoreError::Index(e.into_string()))?;
            let Ok(h) = <[u8; 32]>::try_from(&k[..]) else {
                continue;
            };
            if Some(BlobHash(h)) == after {
                continue;
            }
            let Ok(rec) = BlobRecord::decode(&v[..]) else {
                continue;
            };
            if rec.partial {
                continue;
            }
            out.push((BlobHash(h), rec.size));
            if out.len() >= n {
                break;
            }
        }
        Ok(out)
    }

    /// Where the scrub stopped: the last blob it checked in the current pass.
    pub fn scrub_cursor(&self) -> Option<BlobHash> {
        let v = self.index.get(CURSOR_KEY).ok().flatten()?;
        <[u8; 32]>::try_from(&v[..]).ok().map(BlobHash)
    }

    /// Records the scrub's place (None: a pass ended; the next starts from the first
    /// blob). Losing it only costs re-checking part of a pass.
    pub fn set_scrub_cursor(&self, at: Option<BlobHash>) {
        let r = match at {
            Some(h) => self.index.put(CURSOR_KEY, h.0),
            None => self.index.delete(CURSOR_KEY),
        };
        if let Err(e) = r {
            tracing::warn!("cannot record the scrub's place: {}", e.into_string());
        }
    }
}
