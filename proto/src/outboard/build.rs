//! Building an outboard from bytes pushed front to back ([`Builder`]), in the pass that
//! hashes them: what a node's store does as a blob arrives, so the outboard costs no read
//! and no hash of its own. The outboard goes to a [`Sink`] as it is made (a file, for a
//! blob of any size, or memory), never whole in memory.
//!
//! Pre-order puts a parent's pair before its children's, but the pair is known only after
//! them: the builder reserves the pair's place when it enters the subtree and patches it
//! when the subtree is done (a sink that buffers, as the store's file does, patches most
//! of them in memory). Each group is hashed where it lies in the piece pushed; only a
//! group split between two pieces is gathered first.

use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root, ChainingValue, Mode};

use super::{outboard, outboard_len, split, subtree, GROUP, PAIR};
use crate::BlobHash;

/// The subtrees the builder hashes whole: one verification group, so a piece that
/// holds whole groups is hashed where it lies (buffering larger subtrees cost a copy of
/// every byte: 1.4× a plain BLAKE3 pass, against 1.1× hashed in place).
const LEAF: u64 = GROUP;

/// Where a [`Builder`] writes the outboard: `append` extends it, `patch` fills a pair
/// reserved earlier (at a byte offset `append` already passed). A sink that can fail
/// keeps its first error for its owner to report; the builder never stops for it.
pub trait Sink {
    fn append(&mut self, bytes: &[u8]);
    fn patch(&mut self, at: u64, pair: &[u8; PAIR]);
}

impl Sink for Vec<u8> {
    fn append(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn patch(&mut self, at: u64, pair: &[u8; PAIR]) {
        self[at as usize..at as usize + PAIR].copy_from_slice(pair);
    }
}

/// A parent on the path from the root to the subtree being read.
struct Frame {
    /// Where its pair goes in the outboard.
    at: u64,
    offset: u64,
    len: u64,
    /// Its left child's chaining value, once that subtree is done.
    left: Option<ChainingValue>,
}

/// Hashes a blob of a known length pushed in pieces of any size, writing its outboard to
/// `S`. The root is exactly `blake3::hash` of the bytes and the outboard exactly
/// [`outboard`]'s.
pub struct Builder<S: Sink> {
    len: u64,
    sink: S,
    /// Bytes of outboard appended so far (reserved pairs included).
    written: u64,
    frames: Vec<Frame>,
    /// The subtree being read: its offset and length (one group, or the whole blob when
    /// that is smaller).
    leaf: (u64, u64),
    buf: Vec<u8>,
    fed: u64,
    pairs: Vec<u8>,
    root: Option<BlobHash>,
    /// Tree chunk hashes being collected (`keep_chunks`): the chunk size, and the chaining
    /// values of the chunks done so far, which are nodes of this very tree.
    chunks: Option<(u64, Vec<BlobHash>)>,
}

impl<S: Sink> Builder<S> {
    pub fn new(len: u64, sink: S) -> Self {
        let mut b = Builder {
            len,
            sink,
            written: 0,
            frames: Vec::new(),
            leaf: (0, len),
            buf: Vec::new(),
            fed: 0,
            pairs: Vec::new(),
            root: None,
            chunks: None,
        };
        b.descend(0, len);
        b
    }

    /// Also yields the blob's tree chunk hashes of `chunk_size` (`crate::chunks`) at
    /// `finish_with_chunks`, for no extra hashing. Before any byte is pushed.
    pub fn keep_chunks(&mut self, chunk_size: u32) {
        debug_assert_eq!(self.fed, 0);
        self.chunks = Some((u64::from(chunk_size.max(1)), Vec::new()));
    }

    /// Bytes pushed so far.
    pub fn fed(&self) -> u64 {
        self.fed
    }

    /// The next bytes of the blob. Bytes past its announced length are ignored (the
    /// caller checks the length; `finish` then says the tree is not this blob's).
    pub fn update(&mut self, mut data: &[u8]) {
        let room = self.len - self.fed.min(self.len);
        if data.len() as u64 > room {
            self.fed += data.len() as u64 - room;
            data = &data[..room as usize];
        }
        self.fed += data.len() as u64;
        if self.frames.is_empty() {
            // A blob of one leaf: hashed whole at the end, as the root.
            self.buf.extend_from_slice(data);
            return;
        }
        while !data.is_empty() {
            let want = (self.leaf.1 - self.buf.len() as u64) as usize;
            let cv = if self.buf.is_empty() && data.len() >= want {
                // The whole leaf is here: hashed where it lies, not copied first.
                let cv = self.leaf_cv(&data[..want]);
                data = &data[want..];
                cv
            } else {
                let take = want.min(data.len());
                self.buf.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.buf.len() < self.leaf.1 as usize {
                    return;
                }
                let buf = std::mem::take(&mut self.buf);
                let cv = self.leaf_cv(&buf);
                self.buf = buf;
                self.buf.clear();
                cv
            };
            self.leaf_done(cv);
        }
    }

    /// `finish`, with the tree chunk hashes `keep_chunks` asked for (none if it was not).
    pub fn finish_with_chunks(mut self) -> Option<(BlobHash, S, Vec<BlobHash>)> {
        let chunks = self.chunks.take();
        let (root, sink) = self.finish()?;
        let chunks = match chunks {
            None => Vec::new(),
            Some((_, done)) if done.is_empty() => vec![root],
            Some((_, done)) => done,
        };
        Some((root, sink, chunks))
    }

    /// The root and the sink, once exactly the announced length was pushed; None
    /// otherwise (fewer or more bytes: the outboard in the sink is not the blob's).
    pub fn finish(mut self) -> Option<(BlobHash, S)> {
        if self.fed != self.len {
            return None;
        }
        if self.frames.is_empty() && self.root.is_none() {
            let (root, pairs) = outboard(&self.buf);
            self.sink.append(&pairs);
            return Some((root, self.sink));
        }
        debug_assert_eq!(self.written, outboard_len(self.len) as u64);
        self.root.map(|r| (r, self.sink))
    }

    /// Enters the subtree at `offset`, reserving the pair of each parent on the way down
    /// its left edge to the first leaf.
    fn descend(&mut self, offset: u64, mut len: u64) {
        while len > LEAF {
            let at = self.written;
            self.sink.append(&[0u8; PAIR]);
            self.written += PAIR as u64;
            self.frames.push(Frame {
                at,
                offset,
                len,
                left: None,
            });
            len = split(len).0;
        }
        self.leaf = (offset, len);
    }

    fn leaf_cv(&mut self, bytes: &[u8]) -> ChainingValue {
        self.pairs.clear();
        let cv = subtree(bytes, self.leaf.0, &mut self.pairs);
        self.sink.append(&self.pairs);
        self.written += self.pairs.len() as u64;
        cv
    }

    /// Keeps a finished non-root subtree's chaining value when it is a chunk: it starts
    /// at a chunk boundary and is a chunk long, or is the blob's last, shorter chunk.
    fn chunk_done(&mut self, (offset, len): (u64, u64), cv: &ChainingValue) {
        if let Some((cs, done)) = &mut self.chunks {
            let last = offset + len == self.len && len < *cs;
            if offset.is_multiple_of(*cs) && (len == *cs || last) && len < self.len {
                debug_assert_eq!(offset / *cs, done.len() as u64);
                done.push(BlobHash(*cv));
            }
        }
    }

    /// Climbs from a finished subtree: a parent whose left child it was moves on to its
    /// right one; a parent whose right child it was is done too.
    fn leaf_done(&mut self, mut cv: ChainingValue) {
        self.chunk_done(self.leaf, &cv);
        while let Some(f) = self.frames.last_mut() {
            match f.left {
                None => {
                    f.left = Some(cv);
                    let l = split(f.len).0;
                    let (offset, len) = (f.offset + l, f.len - l);
                    self.descend(offset, len);
                    return;
                }
                Some(l) => {
                    let mut pair = [0u8; PAIR];
                    pair[..32].copy_from_slice(&l);
                    pair[32..].copy_from_slice(&cv);
                    self.sink.patch(f.at, &pair);
                    let done = (f.offset, f.len);
                    self.frames.pop();
                    if self.frames.is_empty() {
                        self.root = Some(BlobHash(*merge_subtrees_root(&l, &cv, Mode::Hash).as_bytes()));
                        self.leaf = (self.len, 0);
                        return;
                    }
                    cv = merge_subtrees_non_root(&l, &cv, Mode::Hash);
                    self.chunk_done(done, &cv);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect()
    }

    #[test]
    fn pushed_in_any_pieces_the_tree_is_the_one_built_from_memory() {
        for n in [
            0usize,
            1,
            16 * 1024,
            16 * 1024 + 1,
            (1 << 20) - 1,
            1 << 20,
            (1 << 20) + 1,
            3 * (1 << 20) + 12_345,
            9 << 20,
            (16 << 20) + 16 * 1024,
        ] {
            let d = data(n);
            let want = outboard(&d);
            for piece in [1usize << 20, 4096, 333_333, 5 << 20, n.max(1)] {
                let mut b = Builder::new(n as u64, Vec::new());
                for p in d.chunks(piece) {
                    b.update(p);
                }
                let (root, ob) = b.finish().unwrap();
                assert_eq!((root, ob), want, "size {n}, pieces of {piece}");
            }
        }
    }

    #[test]
    fn the_builder_yields_the_tree_chunk_hashes_of_one_pass() {
        use crate::chunks::{hash_bytes, ChunkKind};
        for (n, cs) in [
            (3 * (1 << 20) + 12_345, 1u32 << 20),
            (9 << 20, 4 << 20),
            ((4 << 20) + 1, 4 << 20),
            (4 << 20, 4 << 20),
            ((1 << 20) + 5, 64 << 10),
            (200_000, 64 << 10),
            ((2 << 20) + (16 << 10), 64 << 10),
        ] {
            let d = data(n);
            let want = hash_bytes(&d, cs, ChunkKind::Tree);
            for piece in [1usize << 20, 333_333] {
                let mut b = Builder::new(n as u64, Vec::new());
                b.keep_chunks(cs);
                for p in d.chunks(piece) {
                    b.update(p);
                }
                let (root, ob, chunks) = b.finish_with_chunks().unwrap();
                assert_eq!(
                    (root, chunks),
                    (want.1, want.2.clone()),
                    "size {n}, chunks of {cs}"
                );
                assert_eq!(ob, outboard(&d).1);
            }
        }
    }

    #[test]
    fn too_few_or_too_many_bytes_give_no_tree() {
        let d = data(3 << 20);
        let mut short = Builder::new(d.len() as u64, Vec::new());
        short.update(&d[..d.len() - 1]);
        assert!(short.finish().is_none());
        let mut long = Builder::new(d.len() as u64 - 1, Vec::new());
        long.update(&d);
        assert!(long.finish().is_none());
        let mut small = Builder::new(10, Vec::new());
        small.update(&d[..11]);
        assert!(small.finish().is_none());
    }
}
