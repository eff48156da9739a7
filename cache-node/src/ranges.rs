//! Verified ranges on the node: outboards (`locus_proto::outboard`) that are not kept on
//! disk beside their blob (`store/outboards.rs`) — a chunk's, or a small, packed or
//! older blob's — computed the first time a client asks for a range of them and kept in
//! memory, so a random reader is sent the 16 KiB groups it reads and the proof that
//! checks them, not the whole chunk.
//!
//! An outboard is computed from the store's verified reader (the chunk's bytes are
//! checked against the node's own chunk hashes on the way, or come from a file
//! unchanged since its last whole check), so its root is the chunk's true hash. It is
//! keyed by the blob and the chunk's place in it, not by the node's chunk record: a
//! blob imported by two versions with different chunk sizes is asked for ranges of
//! either geometry. Content never changes under a blob hash, so a kept outboard is never
//! stale; the bytes of each range are checked against it before they are sent. One
//! computed for a whole blob is handed to the store to keep on disk as well.
//!
//! Kept in memory, bounded (`Outboards::new`): 64 MiB of outboards cover 16 GiB of
//! chunks. A node restart or an eviction costs one read of the chunk at the next range
//! of it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use locus_proto::bulk::RangeRequest;
use locus_proto::{outboard, BlobHash};

use crate::store::{BlobStore, StoreError};

/// A chunk's outboard and root.
pub(crate) struct Outboard {
    pub(crate) root: BlobHash,
    pub(crate) pairs: Vec<u8>,
}

type Key = (BlobHash, u64, u64);

/// Outboards of chunks asked for ranges, oldest dropped first past the budget.
pub(crate) struct Outboards {
    budget: usize,
    inner: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    map: HashMap<Key, Arc<Outboard>>,
    order: VecDeque<Key>,
    bytes: usize,
}

/// Default bytes of outboards kept.
pub(crate) const OUTBOARDS_KEPT: usize = 64 << 20;

impl Outboards {
    pub(crate) fn new(budget: usize) -> Self {
        Outboards {
            budget,
            inner: Mutex::default(),
        }
    }

    /// The outboard of the chunk `r` names, kept or computed now (blocking I/O: a
    /// bulk connection's thread), and whether it was computed now. A chunk that fails the
    /// store's check is quarantined and the error says so. An outboard computed for a
    /// whole blob is also kept on disk by the store (a blob stored before outboards
    /// were), so the next range of it after a restart costs no read of the blob.
    pub(crate) fn of(
        &self,
        store: &Arc<BlobStore>,
        r: &RangeRequest,
    ) -> Result<(Arc<Outboard>, bool), StoreError> {
        let key = (r.hash, r.chunk_offset, r.chunk_len);
        if let Some(o) = self.inner.lock().unwrap().map.get(&key) {
            return Ok((o.clone(), false));
        }
        // Two readers of one new chunk may both compute it: the same bytes, kept once.
        let o = Arc::new(compute(store, r)?);
        if r.chunk_offset == 0 && store.size_of(&r.hash) == Some(r.chunk_len) {
            store.keep_outboard(&r.hash, &o.pairs);
        }
        let mut k = self.inner.lock().unwrap();
        if !k.map.contains_key(&key) {
            k.bytes += o.pairs.len();
            k.map.insert(key, o.clone());
            k.order.push_back(key);
            while k.bytes > self.budget {
                let Some(old) = k.order.pop_front() else { break };
                if let Some(gone) = k.map.remove(&old) {
                    k.bytes -= gone.pairs.len();
                }
            }
        }
        Ok((o, true))
    }

    /// Drops the outboard kept in memory for `r`'s chunk (its disk copy was found wrong).
    pub(crate) fn forget(&self, r: &RangeRequest) {
        let mut k = self.inner.lock().unwrap();
        if let Some(gone) = k.map.remove(&(r.hash, r.chunk_offset, r.chunk_len)) {
            k.bytes -= gone.pairs.len();
            k.order.retain(|x| *x != (r.hash, r.chunk_offset, r.chunk_len));
        }
    }

    /// Chunks whose outboards are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().unwrap().map.len()
    }
}

/// Reads the chunk through the store's verified reader, front to back, building its
/// outboard on the way (one pass, at most a MiB of it in memory beyond the reader's
/// piece).
fn compute(store: &Arc<BlobStore>, r: &RangeRequest) -> Result<Outboard, StoreError> {
    let mut rd = store.open_reader(&r.hash, r.chunk_offset, r.chunk_len)?;
    let mut piece: Vec<u8> = Vec::new();
    let mut at = 0;
    let (root, pairs) = outboard::outboard_from(r.chunk_len, |buf| {
        let mut filled = 0;
        while filled < buf.len() {
            if at == piece.len() {
                piece = rd
                    .next_piece()?
                    .ok_or_else(|| StoreError::Io(format!("blob {} ended early", r.hash)))?;
                at = 0;
            }
            let n = (buf.len() - filled).min(piece.len() - at);
            buf[filled..filled + n].copy_from_slice(&piece[at..at + n]);
            filled += n;
            at += n;
        }
        Ok(())
    })?;
    Ok(Outboard { root, pairs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    #[test]
    fn a_kept_outboard_is_the_chunks_own_and_the_kept_ones_stay_within_budget() {
        let d = tempfile::tempdir().unwrap();
        let (store, _) = BlobStore::open(StoreConfig {
            dirs: vec![d.path().to_path_buf()],
            capacity: 1 << 30,
            reserve: 0,
            readers_gid: None,
        })
        .unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 31 % 253) as u8).collect();
        let h = BlobHash::of(&data);
        let mut w = store
            .begin_write(h, data.len() as u64, 1 << 20, true)
            .unwrap()
            .unwrap();
        w.write(&data).unwrap();
        w.finish().unwrap();
        let chunk = |i: u64| RangeRequest {
            hash: h,
            chunk_offset: i << 20,
            chunk_len: (1u64 << 20).min(data.len() as u64 - (i << 20)),
            start: 0,
            end: outboard::GROUP,
        };
        // Room for two 1 MiB chunks' outboards (63 pairs each).
        let kept = Outboards::new(2 * outboard::outboard_len(1 << 20));
        for i in 0..3 {
            let r = chunk(i);
            let (o, _) = kept.of(&store, &r).unwrap();
            let bytes = &data[r.chunk_offset as usize..(r.chunk_offset + r.chunk_len) as usize];
            let (root, pairs) = outboard::outboard(bytes);
            assert!(o.root == root && o.pairs == pairs, "chunk {i}");
        }
        assert_eq!(kept.len(), 2, "the oldest was dropped");
        // A blob the store does not hold: its error, nothing kept.
        let mut r = chunk(0);
        r.hash = BlobHash([9; 32]);
        assert!(matches!(kept.of(&store, &r), Err(StoreError::NotFound(_))));
        assert_eq!(kept.len(), 2);
    }
}
