//! The sealed namespace: one version's file tree as one immutable, content-addressed blob
//! that a mount uses in place (memory-mapped), so a mount's start, its memory and the
//! metadata service's work per mount do not grow with the number of files.
//!
//! Written once per version, in one pass over the entries in catalogue order (each
//! directory's children contiguous and in name order: the order the metadata service
//! stores entries in, `(parent, name)`), so the service can recompute its hash while it
//! checks a commit, and the importer can build the same bytes from its scan. Moved,
//! stored, replicated, backed up and verified like any blob.
//!
//! Format 1, little-endian, the trailer last so the writer never seeks:
//!
//! ```text
//! records   one per inode (inode 1 = the root, then catalogue order), each:
//!           kind u8 | 0 u8 | mode u16 | name_len u16 | parent u32 | size u64 |
//!           mtime_ns i64 | shard u32 | extra u32          (34 bytes)
//!           | name | files: blob hash (32) and, when extra (the chunk count) > 1, the
//!           chunk hashes (32 each; one chunk's hash is the blob's) | symlinks: target
//!           (extra bytes)
//! offsets   u64 per inode: where its record starts
//! dirs      (inode u32, first child u32, children u32, subdirectories u32) for each
//!           directory with children, by inode
//! identity  dataset name, 0, cluster id
//! trailer   magic "LOCUSNS1" | format u32 | 0 u32 | inodes u64 | dirs u64 |
//!           offsets_at u64 | dirs_at u64 | identity_at u64 | identity_len u32 |
//!           chunk_size u32 | total_bytes u64 | 0 u64 | 0 u64   (96 bytes)
//! ```
//!
//! The version number is not in it (a version is numbered when it commits, after its
//! namespace was built): the catalogue binds a version to its namespace's hash, and the
//! identity binds the namespace to its dataset and cluster.
//!
//! The reader trusts nothing it reads: every offset and length is checked against the
//! bytes at hand on use, so damaged bytes give "not found" or an error, never a panic or
//! an out-of-bounds read (fuzz target `namespace`); its identity is checked against the
//! version asked for.

use std::collections::HashMap;
use std::io::Write;

use crate::chunks::ChunkKind;
use crate::manifest::{BlobHash, Entry, EntryKind};

pub const MAGIC: &[u8; 8] = b"LOCUSNS1";
/// The layout above, its files' chunk hashes plain (`crate::chunks`).
pub const FORMAT: u32 = 1;
/// The same layout, its files' chunk hashes tree chunk hashes. A format of its own, not
/// a flag, so a mount that predates tree chunk hashes refuses the namespace by name
/// rather than finding every chunk of every large file wrong.
pub const FORMAT_TREE: u32 = 2;
const TRAILER: usize = 96;
const RECORD: usize = 34;
const DIR: u64 = 16;
/// The root's inode number (FUSE's convention).
pub const ROOT: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::File => 1,
            Kind::Dir => 2,
            Kind::Symlink => 3,
        }
    }
    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::File,
            2 => Kind::Dir,
            3 => Kind::Symlink,
            _ => return None,
        })
    }
}

/// What the writer refuses; each names the entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("{0}: its parent directory is not in the manifest (or is not a directory)")]
    Orphan(String),
    #[error("{0} appears twice in the manifest")]
    Duplicate(String),
    #[error("{0} comes out of catalogue order (entries must come by parent directory, then name)")]
    Unsorted(String),
    #[error("the manifest has more than 4,294,967,294 entries")]
    TooLarge,
    #[error("writing the sealed namespace: {0}")]
    Io(String),
}

/// The canonical order of entries: by parent directory, then name (bytewise), the
/// catalogue's key order. Sort a scan's entries with this before sealing them.
pub fn canonical_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn split(p: &str) -> (&str, &str) {
        p.rsplit_once('/').unwrap_or(("", p))
    }
    split(a).cmp(&split(b))
}

/// A writer that counts and hashes what passes through it: the whole, and each chunk
/// of `chunk_size` (a namespace is a blob like any other, read and checked chunk by
/// chunk).
struct Counting<W> {
    inner: W,
    hasher: blake3::Hasher,
    pos: u64,
    chunk: blake3::Hasher,
    chunk_size: u64,
    chunks: Vec<BlobHash>,
}

impl<W: Write> Counting<W> {
    fn put(&mut self, mut b: &[u8]) -> Result<(), SealError> {
        self.inner
            .write_all(b)
            .map_err(|e| SealError::Io(e.to_string()))?;
        self.hasher.update(b);
        while !b.is_empty() {
            let room = self.chunk_size - self.pos % self.chunk_size;
            let n = (room as usize).min(b.len());
            self.chunk.update(&b[..n]);
            self.pos += n as u64;
            b = &b[n..];
            if self.pos.is_multiple_of(self.chunk_size) {
                self.chunks.push(BlobHash(*self.chunk.finalize().as_bytes()));
                self.chunk.reset();
            }
        }
        Ok(())
    }
}

/// A finished sealed namespace: what names it and what checks it piece by piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub hash: BlobHash,
    pub size: u64,
    /// BLAKE3 of each `chunk_size` piece, in order.
    pub chunks: Vec<BlobHash>,
}

impl Sealed {
    /// The chunk hashes as one byte string (32 bytes each), as the catalogue keeps them.
    pub fn chunk_bytes(&self) -> Vec<u8> {
        self.chunks.iter().flat_map(|c| c.0).collect()
    }
}

/// Chunk hashes of bytes held in memory.
pub fn chunk_hashes(bytes: &[u8], chunk_size: u32) -> Vec<BlobHash> {
    bytes
        .chunks(chunk_size.max(1) as usize)
        .map(BlobHash::of)
        .collect()
}

/// Builds a sealed namespace from entries given in catalogue order (`canonical_cmp`),
/// writing it to `out` as it goes; `finish` gives the blob's hash and size. Memory is
/// one offset per entry plus one path per directory.
pub struct Writer<W: Write> {
    out: Counting<W>,
    offsets: Vec<u64>,
    /// Directory path → inode.
    dirs: HashMap<String, u32>,
    /// (parent inode, first child, count, subdirectories) of each run of siblings.
    runs: Vec<(u32, u32, u32, u32)>,
    last: Option<String>,
    chunk_size: u32,
    kind: ChunkKind,
    total_bytes: u64,
}

impl<W: Write> Writer<W> {
    /// A namespace whose files record plain chunk hashes.
    pub fn new(out: W, chunk_size: u32) -> Result<Self, SealError> {
        Self::with_kind(out, chunk_size, ChunkKind::Plain)
    }

    /// A namespace whose files record chunk hashes of `kind` (the version's).
    pub fn with_kind(out: W, chunk_size: u32, kind: ChunkKind) -> Result<Self, SealError> {
        let mut w = Writer {
            out: Counting {
                inner: out,
                hasher: blake3::Hasher::new(),
                pos: 0,
                chunk: blake3::Hasher::new(),
                chunk_size: u64::from(chunk_size.max(1)),
                chunks: Vec::new(),
            },
            offsets: Vec::new(),
            dirs: HashMap::new(),
            runs: Vec::new(),
            last: None,
            chunk_size,
            kind,
            total_bytes: 0,
        };
        // The root: inode 1, its own parent.
        w.record(Kind::Dir, 0o755, "", ROOT as u32, 0, 0, 0, &[], None)?;
        w.dirs.insert(String::new(), ROOT as u32);
        Ok(w)
    }

    /// Entries written so far, the root included.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.offsets.len() <= 1
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        kind: Kind,
        mode: u32,
        name: &str,
        parent: u32,
        size: u64,
        mtime_ns: i64,
        shard: u32,
        tail: &[&[u8]],
        extra: Option<u32>,
    ) -> Result<(), SealError> {
        if self.offsets.len() >= u32::MAX as usize - 1 {
            return Err(SealError::TooLarge);
        }
        self.offsets.push(self.out.pos);
        let mut head = [0u8; RECORD];
        head[0] = kind.code();
        head[2..4].copy_from_slice(&((mode & 0o7777) as u16).to_le_bytes());
        head[4..6].copy_from_slice(&(name.len() as u16).to_le_bytes());
        head[6..10].copy_from_slice(&parent.to_le_bytes());
        head[10..18].copy_from_slice(&size.to_le_bytes());
        head[18..26].copy_from_slice(&mtime_ns.to_le_bytes());
        head[26..30].copy_from_slice(&shard.to_le_bytes());
        head[30..34].copy_from_slice(&extra.unwrap_or(0).to_le_bytes());
        self.out.put(&head)?;
        self.out.put(name.as_bytes())?;
        for t in tail {
            self.out.put(t)?;
        }
        Ok(())
    }

    /// Adds the next entry (catalogue order).
    pub fn push(&mut self, e: &Entry) -> Result<(), SealError> {
        let path = e.path.as_str();
        if let Some(last) = &self.last {
            match canonical_cmp(last, path) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => return Err(SealError::Duplicate(path.to_string())),
                std::cmp::Ordering::Greater => return Err(SealError::Unsorted(path.to_string())),
            }
        }
        let (parent_path, name) = (e.path.parent(), e.path.file_name());
        let Some(&parent) = self.dirs.get(parent_path) else {
            return Err(SealError::Orphan(path.to_string()));
        };
        let ino = self.offsets.len() as u32 + 1;
        let is_dir = u32::from(matches!(e.kind, EntryKind::Dir));
        match self.runs.last_mut() {
            Some(r) if r.0 == parent => {
                r.2 += 1;
                r.3 += is_dir;
            }
            _ => self.runs.push((parent, ino, 1, is_dir)),
        }
        match &e.kind {
            EntryKind::Dir => {
                self.record(Kind::Dir, e.mode, name, parent, 0, e.mtime_ns, 0, &[], None)?;
                self.dirs.insert(path.to_string(), ino);
            }
            EntryKind::File {
                size,
                blob,
                chunks,
                shard,
            } => {
                self.total_bytes += size;
                let mut tail: Vec<&[u8]> = vec![&blob.0];
                if chunks.len() > 1 {
                    tail.extend(chunks.iter().map(|c| &c.0[..]));
                }
                let count = u32::try_from(chunks.len()).map_err(|_| SealError::TooLarge)?;
                self.record(
                    Kind::File,
                    e.mode,
                    name,
                    parent,
                    *size,
                    e.mtime_ns,
                    *shard,
                    &tail,
                    Some(count),
                )?;
            }
            EntryKind::Symlink { target } => {
                let len = target.len() as u32;
                self.record(
                    Kind::Symlink,
                    e.mode,
                    name,
                    parent,
                    u64::from(len),
                    e.mtime_ns,
                    0,
                    &[target.as_bytes()],
                    Some(len),
                )?;
            }
        }
        self.last = Some(path.to_string());
        Ok(())
    }

    /// Writes the tables and the trailer: the blob's hash, size and chunk hashes.
    pub fn finish(mut self, dataset: &str, cluster_id: &str) -> Result<Sealed, SealError> {
        let offsets_at = self.out.pos;
        let offsets = std::mem::take(&mut self.offsets);
        for o in &offsets {
            self.out.put(&o.to_le_bytes())?;
        }
        let dirs_at = self.out.pos;
        // Runs are in catalogue order, which is by parent path; the table is by inode.
        let mut runs = std::mem::take(&mut self.runs);
        runs.sort_unstable_by_key(|r| r.0);
        for (ino, first, count, subdirs) in &runs {
            for v in [ino, first, count, subdirs] {
                self.out.put(&v.to_le_bytes())?;
            }
        }
        let identity_at = self.out.pos;
        let identity = format!("{dataset}\0{cluster_id}");
        self.out.put(identity.as_bytes())?;
        let mut t = [0u8; TRAILER];
        t[0..8].copy_from_slice(MAGIC);
        let format = match self.kind {
            ChunkKind::Plain => FORMAT,
            ChunkKind::Tree => FORMAT_TREE,
        };
        t[8..12].copy_from_slice(&format.to_le_bytes());
        t[16..24].copy_from_slice(&(offsets.len() as u64).to_le_bytes());
        t[24..32].copy_from_slice(&(runs.len() as u64).to_le_bytes());
        t[32..40].copy_from_slice(&offsets_at.to_le_bytes());
        t[40..48].copy_from_slice(&dirs_at.to_le_bytes());
        t[48..56].copy_from_slice(&identity_at.to_le_bytes());
        t[56..60].copy_from_slice(&(identity.len() as u32).to_le_bytes());
        t[60..64].copy_from_slice(&self.chunk_size.to_le_bytes());
        t[64..72].copy_from_slice(&self.total_bytes.to_le_bytes());
        self.out.put(&t)?;
        self.out.inner.flush().map_err(|e| SealError::Io(e.to_string()))?;
        if !self.out.pos.is_multiple_of(self.out.chunk_size) {
            self.out
                .chunks
                .push(BlobHash(*self.out.chunk.finalize().as_bytes()));
        }
        Ok(Sealed {
            hash: BlobHash(*self.out.hasher.finalize().as_bytes()),
            size: self.out.pos,
            chunks: std::mem::take(&mut self.out.chunks),
        })
    }
}

/// Seals entries in any order (sorts them first): for importers and tests, which hold
/// them all.
pub fn seal(
    entries: Vec<Entry>,
    chunk_size: u32,
    dataset: &str,
    cluster_id: &str,
) -> Result<(Vec<u8>, BlobHash), SealError> {
    seal_with(entries, (chunk_size, ChunkKind::Plain), dataset, cluster_id)
}

/// `seal`, for files whose chunk hashes are of `kind`.
pub fn seal_with(
    mut entries: Vec<Entry>,
    (chunk_size, kind): (u32, ChunkKind),
    dataset: &str,
    cluster_id: &str,
) -> Result<(Vec<u8>, BlobHash), SealError> {
    entries.sort_unstable_by(|a, b| canonical_cmp(a.path.as_str(), b.path.as_str()));
    let mut out = Vec::new();
    let mut w = Writer::with_kind(&mut out, chunk_size, kind)?;
    for e in &entries {
        w.push(e)?;
    }
    let hash = w.finish(dataset, cluster_id)?.hash;
    Ok((out, hash))
}

mod read;
pub use read::{Attr, Chunks, Index, OpenError};

#[cfg(test)]
mod tests;
