//! The mount's cache of verified chunks fetched from remote replicas.
//!
//! A chunk leaves it when the budget needs room (oldest first), or as soon as every byte
//! of it has been handed to the kernel for its page cache (`handed`): from then on the
//! kernel answers those reads itself, so a copy here would only double the memory a
//! streaming reader holds, and keep its buffer from being reused while still warm in
//! the CPU's cache (a fresh buffer costs a page fault and a zeroing per page, a cold one
//! a miss per line in the receive copy that writes it).

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
    /// The filled chunks the budget counts, oldest first, and their sizes.
    order: VecDeque<Key>,
    counted: HashMap<Key, usize>,
    bytes: usize,
    /// Pages of cached chunks already handed to the kernel, for chunks some are.
    handed: HashMap<Key, Handed>,
}

impl CacheInner {
    /// Lets chunk `k` go, whatever state it is in.
    fn remove(&mut self, k: &Key) {
        self.cells.remove(k);
        self.handed.remove(k);
        if let Some(len) = self.counted.remove(k) {
            self.bytes -= len;
            // Eviction takes the oldest; a chunk handed over is usually among the newest.
            if self.order.front() == Some(k) {
                self.order.pop_front();
            } else if let Some(at) = self.order.iter().rposition(|o| o == k) {
                self.order.remove(at);
            }
        }
    }
}

/// The page size the kernel's page cache is filled by.
const PAGE: u64 = 4096;

/// Which pages of one chunk went to the kernel's page cache: a bit per 4 KiB page.
struct Handed {
    bits: Vec<u64>,
    left: usize,
}

impl Handed {
    fn new(pages: usize) -> Self {
        Handed {
            bits: vec![0; pages.div_ceil(64)],
            left: pages,
        }
    }

    /// Marks the pages `[from, to)` covers whole (the chunk's shorter last page counts
    /// whole when `to` reaches `len`); true once every page is marked.
    fn mark(&mut self, len: u64, from: u64, to: u64) -> bool {
        let first = from.div_ceil(PAGE);
        let end = if to >= len { len.div_ceil(PAGE) } else { to / PAGE };
        for p in first..end {
            let (w, b) = ((p / 64) as usize, p % 64);
            if let Some(word) = self.bits.get_mut(w) {
                if *word & (1 << b) == 0 {
                    *word |= 1 << b;
                    self.left -= 1;
                }
            }
        }
        self.left == 0
    }
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

    /// Counts the chunk `cell` (just filled, `len` bytes) against the budget, evicting
    /// the oldest beyond it; a cell no longer in the cache (already handed over whole,
    /// or replaced) is not counted.
    pub(super) fn filled(&self, k: Key, cell: &Arc<OnceCell<Pieces>>, len: usize) {
        let mut c = self.inner.lock().unwrap();
        if !c.cells.get(&k).is_some_and(|now| Arc::ptr_eq(now, cell)) || c.counted.contains_key(&k) {
            return;
        }
        if c.handed.get(&k).is_some_and(|h| h.left == 0) {
            // Every page reached the kernel before the fetch that filled it got here.
            c.remove(&k);
            return;
        }
        c.order.push_back(k);
        c.counted.insert(k, len);
        c.bytes += len;
        while c.bytes > self.budget {
            let Some(old) = c.order.front().copied() else {
                break;
            };
            if !c.counted.contains_key(&old) {
                // Never so (both change together), but a loop that could not shrink the
                // list would hang every reader.
                c.order.pop_front();
                continue;
            }
            c.remove(&old);
        }
    }

    /// Bytes `[from, to)` of a cached chunk of `len` bytes went to the kernel's page
    /// cache; once every page of it has, the chunk is let go (its buffer returns for
    /// reuse when the last reply holding a slice of it is sent). A read the kernel does
    /// not keep (O_DIRECT) must not be counted here.
    pub(super) fn handed(&self, k: Key, len: u64, from: u64, to: u64) {
        if len == 0 || from >= to {
            return;
        }
        let mut c = self.inner.lock().unwrap();
        if !c.cells.get(&k).is_some_and(|cell| cell.initialized()) {
            return;
        }
        let pages = len.div_ceil(PAGE) as usize;
        let all = c
            .handed
            .entry(k)
            .or_insert_with(|| Handed::new(pages))
            .mark(len, from, to);
        // A chunk not counted yet keeps its marks: `filled` lets it go on arrival.
        if all && c.counted.contains_key(&k) {
            c.remove(&k);
        }
    }

    /// Drops a cell whose fetch failed, so the next reader tries afresh.
    pub(super) fn failed(&self, k: Key) {
        let mut c = self.inner.lock().unwrap();
        if c.cells.get(&k).is_some_and(|cell| !cell.initialized()) {
            c.remove(&k);
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
        cache.filled(k(0), &c, 8);
        let c = cache.cell(k(1));
        c.set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; 8])]))
            .unwrap();
        cache.filled(k(1), &c, 8);
        assert!(!cache.known(&k(0)), "the oldest was evicted");
        assert!(cache.known(&k(1)));
    }

    #[test]
    fn only_pages_a_read_covers_whole_count_as_handed_and_the_short_last_one_does() {
        // 10,000 bytes: pages of 4,096, 4,096 and 1,808.
        let mut h = Handed::new(3);
        assert!(!h.mark(10_000, 100, 8_000), "no page is covered whole");
        assert_eq!(h.left, 3);
        assert!(!h.mark(10_000, 0, 4_096));
        assert!(!h.mark(10_000, 0, 4_096), "a page handed twice counts once");
        assert_eq!(h.left, 2);
        assert!(!h.mark(10_000, 4_096, 9_000), "the last page is not reached");
        assert!(
            h.mark(10_000, 8_192, 10_000),
            "the short last page ends the chunk"
        );
        assert_eq!(h.left, 0);
    }

    #[test]
    fn a_chunk_handed_whole_leaves_the_cache_and_one_handed_in_part_stays() {
        let cache = ChunkCache {
            budget: 1 << 20,
            inner: Mutex::default(),
        };
        let k = |i: u32| (BlobHash([2; 32]), i);
        let fill = |i: u32, len: usize| {
            let cell = cache.cell(k(i));
            cell.set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; len])]))
                .unwrap();
            cache.filled(k(i), &cell, len);
        };
        fill(0, 3 * 4096);
        fill(1, 3 * 4096);
        cache.handed(k(0), 3 * 4096, 0, 2 * 4096);
        assert!(cache.known(&k(0)), "a third of it is still only here");
        cache.handed(k(0), 3 * 4096, 2 * 4096, 3 * 4096);
        assert!(!cache.known(&k(0)), "every page went to the kernel");
        cache.handed(k(1), 3 * 4096, 0, 3 * 4096 - 1);
        assert!(cache.known(&k(1)), "the last page was not covered whole");
        {
            let c = cache.inner.lock().unwrap();
            assert_eq!(c.bytes, 3 * 4096, "only chunk 1 is counted");
            assert_eq!(c.order, [k(1)]);
        }
        // A chunk still being fetched has nothing to hand over.
        let pending = cache.cell(k(2));
        cache.handed(k(2), 4096, 0, 4096);
        assert!(cache.known(&k(2)) && !pending.initialized());
        assert!(!cache.inner.lock().unwrap().handed.contains_key(&k(2)));
        // Filled, and handed whole by a reader that got it before its fetcher counted
        // it: it goes when counted, and the budget never held it.
        pending
            .set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; 4096])]))
            .unwrap();
        cache.handed(k(2), 4096, 0, 4096);
        assert!(cache.known(&k(2)), "not counted yet");
        cache.filled(k(2), &pending, 4096);
        assert!(!cache.known(&k(2)));
        assert_eq!(cache.inner.lock().unwrap().bytes, 3 * 4096);
        // A cell replaced after its fetch began is not counted for the old one.
        let old = cache.cell(k(3));
        old.set(Pieces::from(vec![bytes::Bytes::from(vec![0u8; 4096])]))
            .unwrap();
        cache.inner.lock().unwrap().cells.remove(&k(3));
        let new = cache.cell(k(3));
        cache.filled(k(3), &old, 4096);
        assert_eq!(cache.inner.lock().unwrap().bytes, 3 * 4096);
        assert!(!new.initialized());
    }
}
