//! A remote chunk's bytes as they arrived from the node: the messages kept as received,
//! hashed across, and sliced for replies without joining them into one buffer.

use std::sync::Arc;

use bytes::Bytes;
use locus_proto::chunks::{ChunkAt, ChunkHashing};
use locus_proto::BlobHash;

/// A chunk's bytes as they arrived: the node's messages kept as they are, never copied
/// into one buffer. A read that falls inside one piece (the kernel asks in aligned 1 MiB
/// reads; pieces are 2 MiB) is answered with a slice of it, so the bytes go from the
/// receive buffer to the kernel without another copy.
#[derive(Clone, Debug, Default)]
pub struct Pieces(Arc<[Bytes]>, Option<(ChunkAt, BlobHash)>);

impl Pieces {
    /// Pieces hashed as they arrived (each while it was still in the CPU's cache):
    /// `hasher` (from `at`) must have been fed exactly `parts`, in order. The hash is this
    /// process's own, from the bytes themselves, so it is as good as hashing them again.
    pub fn hashed(parts: Vec<Bytes>, at: ChunkAt, hasher: &ChunkHashing) -> Self {
        let p = Pieces(parts.into(), Some((at, hasher.finish())));
        debug_assert_eq!(p.1.map(|x| x.1), Some(Pieces(p.0.clone(), None).hash(at)));
        p
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The messages, in order.
    pub fn parts(&self) -> &[Bytes] {
        &self.0
    }

    /// The chunk hash of the whole chunk, as the chunk at `at` is hashed.
    pub fn hash(&self, at: ChunkAt) -> BlobHash {
        if let Some((was, h)) = self.1 {
            if was == at {
                return h;
            }
        }
        let mut h = at.hasher();
        for p in self.0.iter() {
            h.update(p);
        }
        h.finish()
    }

    /// Bytes `[from, to)` of the chunk: a slice of one piece when the range lies inside
    /// it, else a copy of the parts.
    pub fn range(&self, from: usize, to: usize) -> Bytes {
        let mut at = 0;
        let mut out: Option<bytes::BytesMut> = None;
        for p in self.0.iter() {
            let (start, end) = (at, at + p.len());
            at = end;
            if end <= from || start >= to {
                continue;
            }
            let (a, b) = (from.max(start) - start, to.min(end) - start);
            if out.is_none() && start <= from && to <= end {
                return p.slice(a..b);
            }
            out.get_or_insert_with(|| bytes::BytesMut::with_capacity(to - from))
                .extend_from_slice(&p[a..b]);
        }
        out.map(|b| b.freeze()).unwrap_or_default()
    }
}

impl From<Bytes> for Pieces {
    fn from(b: Bytes) -> Self {
        Pieces(Arc::from([b]), None)
    }
}

impl From<Vec<Bytes>> for Pieces {
    fn from(v: Vec<Bytes>) -> Self {
        Pieces(v.into(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_inside_one_piece_is_a_slice_of_it_and_one_across_pieces_is_joined() {
        let whole: Vec<u8> = (0..100u8).collect();
        let b = Bytes::from(whole.clone());
        let p = Pieces::from(vec![b.slice(..40), b.slice(40..41), b.slice(41..)]);
        assert_eq!(p.len(), 100);
        let whole_at = ChunkAt::new(locus_proto::chunks::ChunkKind::Tree, 0, 100, 100);
        assert_eq!(p.hash(whole_at), BlobHash::of(&whole));
        let inside = p.range(10, 30);
        assert_eq!(&inside[..], &whole[10..30]);
        assert_eq!(
            inside.as_ptr(),
            b[10..].as_ptr(),
            "no copy for a range inside a piece"
        );
        for (from, to) in [(0, 100), (39, 42), (40, 41), (30, 99), (0, 0), (100, 100)] {
            assert_eq!(&p.range(from, to)[..], &whole[from..to], "{from}..{to}");
        }
    }
}
