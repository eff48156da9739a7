//! Receive buffers of the bulk path's client, kept for reuse (`Reading::next`).

use std::collections::HashMap;
use std::sync::Mutex;

/// Receive buffers, kept for reuse once every `Bytes` made from one is dropped. A fresh
/// multi-MiB buffer costs a page fault and a zeroed page per 4 KiB on its first write
/// (the allocator hands such blocks back to the kernel on free): about a fifth of a
/// receiver's CPU per byte before these were kept.
pub(super) struct Buffers {
    free: Mutex<Free>,
}

/// Free buffers by size class (capacity a power of two), and their bytes in all.
#[derive(Default)]
struct Free(HashMap<usize, Vec<Vec<u8>>>, usize);

/// Bytes of free buffers kept at most.
const KEEP_FREE: usize = 64 << 20;
/// Smallest and largest buffers kept; others are allocated and freed as usual.
const POOLED_MIN: usize = 256 << 10;
const POOLED_MAX: usize = 64 << 20;

pub(super) fn buffers() -> &'static Buffers {
    static B: std::sync::OnceLock<Buffers> = std::sync::OnceLock::new();
    B.get_or_init(|| Buffers {
        free: Mutex::new(Free::default()),
    })
}

impl Buffers {
    /// An empty buffer with room for at least `n` bytes.
    pub(super) fn take(&self, n: usize) -> Vec<u8> {
        if !(POOLED_MIN..=POOLED_MAX).contains(&n) {
            return Vec::with_capacity(n);
        }
        let class = n.next_power_of_two();
        let mut f = self.free.lock().unwrap();
        if let Some(b) = f.0.get_mut(&class).and_then(Vec::pop) {
            f.1 -= class;
            return b;
        }
        drop(f);
        Vec::with_capacity(class)
    }

    pub(super) fn give(&self, mut b: Vec<u8>) {
        let class = b.capacity();
        if !class.is_power_of_two() || !(POOLED_MIN..=POOLED_MAX).contains(&class) {
            return;
        }
        b.clear();
        let mut f = self.free.lock().unwrap();
        if f.1 + class <= KEEP_FREE {
            f.1 += class;
            f.0.entry(class).or_default().push(b);
        }
    }
}

/// A received buffer behind `Bytes`: back to `Buffers` when the last reference goes.
pub(super) struct Pooled(pub(super) Vec<u8>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        buffers().give(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn a_buffer_comes_back_for_reuse_once_its_last_bytes_are_dropped() {
        let mut b = buffers().take(3 << 20);
        assert!(b.capacity() >= 3 << 20 && b.is_empty());
        b.resize(3 << 20, 7);
        let ptr = b.as_ptr();
        let bytes = Bytes::from_owner(Pooled(b));
        let half = bytes.slice(..10);
        drop(bytes);
        // Still referenced: not free yet, so a take gets another buffer.
        let other = buffers().take(3 << 20);
        assert_ne!(other.as_ptr(), ptr);
        drop(half);
        let again = buffers().take(3 << 20);
        assert_eq!(again.as_ptr(), ptr, "the freed buffer is reused");
        buffers().give(other);
    }
}
