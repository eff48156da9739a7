//! The mount's cache of verified chunks fetched from remote replicas.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use locus_proto::BlobHash;
use tokio::sync::OnceCell;

use super::Pieces;

type Key = (BlobHash, u32);

/// Verified chunks, bounded by bytes, evicted oldest first (mounts mostly stream).
pub(super) struct ChunkCache {
    pub(super) budget: usize,
    pub(super) inner: Mutex<CacheInner>,
}

#[derive(Default)]
pub(super) struct CacheInner {
    cells: HashMap<Key, Arc<OnceCell<Pieces>>>,
    order: VecDeque<Key>,
    bytes: usize,
}

impl ChunkCache {
    pub(super) fn cell(&self, k: Key) -> Arc<OnceCell<Pieces>> {
        self.inner.lock().unwrap().cells.entry(k).or_default().clone()
    }

    /// Whether a chunk is cached or being fetched. Looks without inserting: an empty cell
    /// left by a look would sit outside the FIFO (only filled cells enter it), never
    /// evicted.
    pub(super) fn known(&self, k: &Key) -> bool {
        self.inner.lock().unwrap().cells.contains_key(k)
    }

    pub(super) fn filled(&self, k: Key, len: usize) {
        let mut c = self.inner.lock().unwrap();
        c.order.push_back(k);
        c.bytes += len;
        while c.bytes > self.budget {
            let Some(old) = c.order.pop_front() else { break };
            if let Some(cell) = c.cells.remove(&old) {
                c.bytes -= cell.get().map_or(0, Pieces::len);
            }
        }
    }

    /// Drops a cell whose fetch failed, so the next reader tries afresh.
    pub(super) fn failed(&self, k: Key) {
        let mut c = self.inner.lock().unwrap();
        if c.cells.get(&k).is_some_and(|cell| !cell.initialized()) {
            c.cells.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Looking whether a chunk is there (read-ahead does, for every chunk it considers)
    /// must leave nothing behind: a cell that no fill ever enters into the FIFO would
    /// never be evicted, and a long read with its budget full would grow the map forever.
    #[test]
    fn a_look_at_the_cache_leaves_no_cell_behind() {
        let cache = ChunkCache {
            budget: 10,
            inner: Mutex::default(),
        };
        let k = |i: u32| (BlobHash([1; 32]), i);
        for i in 0..1000 {
            assert!(!cache.known(&k(i)));
        }
        assert!(cache.inner.lock().unwrap().cells.is_empty());
        // A cell being filled is known, and once the fills pass the budget the oldest go.
        let c = cache.cell(k(0));
        assert!(cache.known(&k(0)));
        c.set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; 8])]))
            .unwrap();
        cache.filled(k(0), 8);
        let c = cache.cell(k(1));
        c.set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; 8])]))
            .unwrap();
        cache.filled(k(1), 8);
        assert!(!cache.known(&k(0)), "the oldest was evicted");
        assert!(cache.known(&k(1)));
    }
}
