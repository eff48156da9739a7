//! Chunk hashes: what a version records for each `chunk_size` piece of a file, so that a
//! piece fetched from anywhere (a node, a backup, the origin) is checked on its own.
//!
//! Two definitions exist, named by the version ([`ChunkKind`]):
//!
//! - **Plain** (versions committed before tree chunk hashes): a chunk's hash is the
//!   BLAKE3 of its bytes, unrelated to the file's hash, so whoever hashes a file for a
//!   manifest hashes every byte twice (file and chunks).
//! - **Tree**: a chunk's hash is the chaining value of the chunk's subtree in the file's
//!   own BLAKE3 tree. A `chunk_size`-aligned piece (chunk sizes are powers of two of at
//!   least 64 KiB) is always a whole subtree of that tree, so the chunk hashes are nodes
//!   of it: one pass over the bytes yields them and the file's hash (merged from them,
//!   [`tree_root`]); the store's outboard builder yields them too. A file of one chunk
//!   has the file's hash as its chunk hash under both definitions.
//!
//! A chunk is checked the same way under both: hash its bytes as [`ChunkAt`] says and
//! compare. A tree chunk hash is as binding as a plain one (a subtree's chaining value is
//! BLAKE3's compression of those bytes at that offset; the offset is part of the input).

use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode};

use crate::BlobHash;

/// How a version's chunk hashes are defined (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChunkKind {
    #[default]
    Plain,
    Tree,
}

impl ChunkKind {
    /// From the wire's `tree_chunks` flag.
    pub fn from_tree(tree: bool) -> Self {
        match tree {
            true => ChunkKind::Tree,
            false => ChunkKind::Plain,
        }
    }

    pub fn is_tree(self) -> bool {
        self == ChunkKind::Tree
    }
}

/// Where a chunk sits in its blob: what, besides its bytes, its hash depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkAt {
    pub kind: ChunkKind,
    pub offset: u64,
    /// The chunk is the whole blob (its hash is the blob's).
    pub whole: bool,
}

impl ChunkAt {
    /// Chunk of `len` bytes at `offset` of a blob of `size` bytes.
    pub fn new(kind: ChunkKind, offset: u64, len: u64, size: u64) -> Self {
        ChunkAt {
            kind,
            offset,
            whole: offset == 0 && len >= size,
        }
    }

    /// Chunk `index` of a blob of `size` bytes in `chunk_size` chunks.
    pub fn index(kind: ChunkKind, index: u64, chunk_size: u32, size: u64) -> Self {
        let offset = index * u64::from(chunk_size);
        let len = u64::from(chunk_size).min(size.saturating_sub(offset));
        ChunkAt::new(kind, offset, len, size)
    }

    /// A hasher for the chunk's bytes, fed in pieces of any size.
    pub fn hasher(self) -> ChunkHashing {
        let mut h = blake3::Hasher::new();
        let subtree = self.kind.is_tree() && !self.whole;
        if subtree {
            h.set_input_offset(self.offset);
        }
        ChunkHashing { h, subtree }
    }

    /// The chunk hash of `data`, this chunk's bytes.
    pub fn hash(self, data: &[u8]) -> BlobHash {
        let mut h = self.hasher();
        h.update(data);
        h.finish()
    }
}

/// Hashes one chunk's bytes as its [`ChunkAt`] says.
#[derive(Debug, Clone)]
pub struct ChunkHashing {
    h: blake3::Hasher,
    subtree: bool,
}

impl ChunkHashing {
    pub fn update(&mut self, data: &[u8]) {
        self.h.update(data);
    }

    pub fn finish(&self) -> BlobHash {
        match self.subtree {
            true => BlobHash(self.h.finalize_non_root()),
            false => BlobHash(*self.h.finalize().as_bytes()),
        }
    }
}

/// The blob's hash from its tree chunk hashes (two or more, in order): the chunks are the
/// leaves of the left-complete tree BLAKE3 builds above them.
pub fn tree_root(cvs: &[BlobHash]) -> BlobHash {
    assert!(cvs.len() >= 2, "a blob of one chunk has its chunk's hash");
    let l = left_len(cvs.len());
    BlobHash(*merge_subtrees_root(&subtree(&cvs[..l]), &subtree(&cvs[l..]), Mode::Hash).as_bytes())
}

fn subtree(cvs: &[BlobHash]) -> ChainingValue {
    if let [one] = cvs {
        return one.0;
    }
    let l = left_len(cvs.len());
    merge_subtrees_non_root(&subtree(&cvs[..l]), &subtree(&cvs[l..]), Mode::Hash)
}

/// BLAKE3's split of `n` leaves: the largest power of two below `n` go left.
fn left_len(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// Whether `chunks` are the right chunk hashes of a blob hashed `blob` (tree kind only:
/// plain chunk hashes cannot be checked without the bytes).
pub fn tree_chunks_match(blob: &BlobHash, chunks: &[BlobHash]) -> bool {
    match chunks {
        [] | [_] => chunks.first().is_none_or(|c| c == blob),
        many => tree_root(many) == *blob,
    }
}

/// A file's size, BLAKE3 hash and the hashes of its `chunk_size` chunks.
pub type FileHashes = (u64, BlobHash, Vec<BlobHash>);

/// Hashes a byte stream fed in pieces of any size: the whole blob's BLAKE3 and its chunk
/// hashes of either kind. Tree chunk hashes cost one pass: each chunk is hashed at its
/// offset and the blob's hash merged from them; plain ones cost two.
#[derive(Debug, Clone)]
pub struct ChunkHasher {
    chunk_size: u64,
    kind: ChunkKind,
    /// Plain kind only: the whole blob's hasher beside the chunks'.
    whole: Option<blake3::Hasher>,
    chunk: blake3::Hasher,
    in_chunk: u64,
    done: Vec<BlobHash>,
    size: u64,
}

impl ChunkHasher {
    pub fn new(chunk_size: u32, kind: ChunkKind) -> Self {
        ChunkHasher {
            chunk_size: u64::from(chunk_size.max(1)),
            kind,
            whole: (!kind.is_tree()).then(blake3::Hasher::new),
            chunk: blake3::Hasher::new(),
            in_chunk: 0,
            done: Vec::new(),
            size: 0,
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.size += data.len() as u64;
        if let Some(w) = &mut self.whole {
            w.update(data);
        }
        while !data.is_empty() {
            if self.in_chunk == self.chunk_size {
                // A full chunk is closed only once more bytes follow: until then it may
                // be the blob's only chunk, whose tree hash is the root's.
                self.close_chunk();
            }
            let take = (self.chunk_size - self.in_chunk).min(data.len() as u64) as usize;
            self.chunk.update(&data[..take]);
            self.in_chunk += take as u64;
            data = &data[take..];
        }
    }

    fn close_chunk(&mut self) {
        let h = match self.kind {
            ChunkKind::Tree => BlobHash(self.chunk.finalize_non_root()),
            ChunkKind::Plain => BlobHash(*self.chunk.finalize().as_bytes()),
        };
        self.done.push(h);
        self.chunk = blake3::Hasher::new();
        if self.kind.is_tree() {
            self.chunk.set_input_offset(self.size_before_next());
        }
        self.in_chunk = 0;
    }

    /// Where the next chunk starts.
    fn size_before_next(&self) -> u64 {
        self.done.len() as u64 * self.chunk_size
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn finish(mut self) -> FileHashes {
        if self.size == 0 {
            return (0, BlobHash::of(&[]), Vec::new());
        }
        if self.done.is_empty() {
            // One chunk: its hash is the blob's.
            let h = BlobHash(*self.chunk.finalize().as_bytes());
            return (self.size, h, vec![h]);
        }
        self.close_chunk();
        let whole = match &self.whole {
            Some(w) => BlobHash(*w.finalize().as_bytes()),
            None => tree_root(&self.done),
        };
        (self.size, whole, self.done)
    }
}

/// The plain BLAKE3 of each `chunk_size` chunk of a byte stream fed in pieces of any size
/// (the whole blob's hash is someone else's: a plain hasher, or an outboard's builder,
/// which yields tree chunk hashes itself).
#[derive(Debug, Clone)]
pub struct Chunks(ChunkHasher);

impl Chunks {
    pub fn new(chunk_size: u32) -> Self {
        let mut h = ChunkHasher::new(chunk_size, ChunkKind::Plain);
        h.whole = None;
        Chunks(h)
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    pub fn finish(mut self) -> Vec<BlobHash> {
        if self.0.size > 0 {
            self.0.close_chunk();
        }
        self.0.done
    }
}

/// The hashes of bytes held whole in memory. A blob of one chunk is hashed once: its
/// chunk's hash is its own (for 1 KiB files, half the hashing).
pub fn hash_bytes(data: &[u8], chunk_size: u32, kind: ChunkKind) -> FileHashes {
    let mut h = ChunkHasher::new(chunk_size, kind);
    h.update(data);
    h.finish()
}

/// Hashes a file in one read: its size, its BLAKE3 and its chunk hashes.
pub fn hash_file(path: &std::path::Path, chunk_size: u32, kind: ChunkKind) -> std::io::Result<FileHashes> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = ChunkHasher::new(chunk_size, kind);
    // No larger than the file (and one byte to see its end in the same read): a buffer
    // of the chunk size, zeroed for each of a million 1 KiB files, was a third of an
    // import's CPU. A file that grows meanwhile is still read whole, piece by piece.
    let len = f.metadata().map_or(u64::MAX, |m| m.len());
    let cap = (chunk_size as usize)
        .clamp(1 << 16, 8 << 20)
        .min(usize::try_from(len).unwrap_or(usize::MAX).saturating_add(1));
    let mut buf = vec![0u8; cap];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h.finish());
        }
        h.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 1000) as u8).collect()
    }

    #[test]
    fn tree_chunk_hashes_merge_to_the_blobs_own_hash_in_one_pass() {
        let cs = 64 * 1024u32;
        for n in [
            1usize,
            1000,
            65_536,
            65_537,
            131_072,
            200_000,
            3 * 65_536 + 5,
            9 * 65_536,
            1 << 20,
        ] {
            let d = data(n);
            let (size, whole, chunks) = hash_bytes(&d, cs, ChunkKind::Tree);
            assert_eq!(size, n as u64);
            assert_eq!(whole, BlobHash::of(&d), "size {n}");
            assert_eq!(chunks.len() as u64, crate::manifest::chunk_count(n as u64, cs));
            assert!(tree_chunks_match(&whole, &chunks), "size {n}");
            // Each chunk checks on its own, fed in uneven pieces.
            for (i, c) in chunks.iter().enumerate() {
                let at = ChunkAt::index(ChunkKind::Tree, i as u64, cs, n as u64);
                let bytes = &d[i * cs as usize..((i + 1) * cs as usize).min(n)];
                let mut h = at.hasher();
                for p in bytes.chunks(7777) {
                    h.update(p);
                }
                assert_eq!(h.finish(), *c, "size {n} chunk {i}");
            }
            // Fed in pieces that straddle chunk edges: the same.
            let mut h = ChunkHasher::new(cs, ChunkKind::Tree);
            for p in d.chunks(65_535) {
                h.update(p);
            }
            assert_eq!(h.finish(), (size, whole, chunks));
        }
    }

    #[test]
    fn tree_chunk_hashes_are_the_nodes_of_the_blobs_outboard_tree() {
        // The chunk at 64 KiB of a 256 KiB blob is the right child of the root's left
        // child: the outboard's second pair's right half.
        let d = data(256 * 1024);
        let (_, _, chunks) = hash_bytes(&d, 64 * 1024, ChunkKind::Tree);
        let (_, ob) = crate::outboard::outboard(&d);
        assert_eq!(&ob[64 + 32..128], &chunks[1].0);
        assert_eq!(&ob[64..96], &chunks[0].0);
    }

    #[test]
    fn a_chunk_is_refused_at_another_offset_or_under_the_other_kind() {
        let cs = 64 * 1024u32;
        let d = data(4 * cs as usize);
        let (_, _, chunks) = hash_bytes(&d, cs, ChunkKind::Tree);
        let (_, _, plain) = hash_bytes(&d, cs, ChunkKind::Plain);
        // Two chunks with the same bytes at different offsets have different hashes.
        let same = vec![9u8; 2 * cs as usize];
        let (_, _, twins) = hash_bytes(&same, cs, ChunkKind::Tree);
        assert_ne!(twins[0], twins[1]);
        let chunk1 = &d[cs as usize..2 * cs as usize];
        assert_eq!(
            ChunkAt::index(ChunkKind::Tree, 1, cs, d.len() as u64).hash(chunk1),
            chunks[1]
        );
        assert_ne!(
            ChunkAt::index(ChunkKind::Tree, 2, cs, d.len() as u64).hash(chunk1),
            chunks[1]
        );
        assert_eq!(
            ChunkAt::index(ChunkKind::Plain, 1, cs, d.len() as u64).hash(chunk1),
            plain[1]
        );
        assert_eq!(plain[1], BlobHash::of(chunk1));
        assert_ne!(plain[1], chunks[1]);
        // A wrong hash in the list no longer merges to the blob's.
        let mut bad = chunks.clone();
        bad[3].0[0] ^= 1;
        assert!(!tree_chunks_match(&BlobHash::of(&d), &bad));
        assert!(!tree_chunks_match(&BlobHash::of(&d), &plain));
    }

    #[test]
    fn a_blob_of_one_chunk_has_its_own_hash_under_both_kinds() {
        for kind in [ChunkKind::Plain, ChunkKind::Tree] {
            let d = data(5000);
            assert_eq!(
                hash_bytes(&d, 65_536, kind),
                (5000, BlobHash::of(&d), vec![BlobHash::of(&d)])
            );
            assert_eq!(ChunkAt::index(kind, 0, 65_536, 5000).hash(&d), BlobHash::of(&d));
            assert_eq!(hash_bytes(&[], 65_536, kind), (0, BlobHash::of(&[]), vec![]));
            // Exactly one full chunk is still one chunk.
            let one = data(65_536);
            assert_eq!(hash_bytes(&one, 65_536, kind).2, vec![BlobHash::of(&one)]);
        }
    }

    #[test]
    fn plain_chunk_hashes_are_as_before() {
        let d = data(300_000);
        let (_, whole, chunks) = hash_bytes(&d, 65_536, ChunkKind::Plain);
        assert_eq!(whole, BlobHash::of(&d));
        let want: Vec<_> = d.chunks(65_536).map(BlobHash::of).collect();
        assert_eq!(chunks, want);
    }
}
