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

use crate::manifest::{BlobHash, Entry, EntryKind};

pub const MAGIC: &[u8; 8] = b"LOCUSNS1";
pub const FORMAT: u32 = 1;
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
    total_bytes: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W, chunk_size: u32) -> Result<Self, SealError> {
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
        t[8..12].copy_from_slice(&FORMAT.to_le_bytes());
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
    mut entries: Vec<Entry>,
    chunk_size: u32,
    dataset: &str,
    cluster_id: &str,
) -> Result<(Vec<u8>, BlobHash), SealError> {
    entries.sort_unstable_by(|a, b| canonical_cmp(a.path.as_str(), b.path.as_str()));
    let mut out = Vec::new();
    let mut w = Writer::new(&mut out, chunk_size)?;
    for e in &entries {
        w.push(e)?;
    }
    let hash = w.finish(dataset, cluster_id)?.hash;
    Ok((out, hash))
}

/// Why sealed bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("not a sealed namespace (no trailer)")]
    NotSealed,
    #[error("sealed namespace format {0}; this build reads format 1")]
    Format(u32),
    #[error("the sealed namespace is damaged: {0}")]
    Damaged(&'static str),
    #[error("the sealed namespace is {found}'s, not {want}'s")]
    OtherVersion { found: String, want: String },
}

/// What getattr needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    pub mode: u16,
    pub mtime_ns: i64,
    pub shard: u32,
}

/// One inode's record, decoded.
#[derive(Debug, Clone, Copy)]
struct Rec<'a> {
    kind: Kind,
    mode: u16,
    parent: u32,
    size: u64,
    mtime_ns: i64,
    shard: u32,
    extra: u32,
    name: &'a str,
    /// What follows the name.
    tail: &'a [u8],
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// A file's chunk hashes, read in place.
#[derive(Debug, Clone, Copy)]
pub struct Chunks<'a> {
    blob: BlobHash,
    /// 32 bytes each; empty when the file has one chunk (its hash is the blob's).
    raw: &'a [u8],
    count: u32,
}

impl<'a> Chunks<'a> {
    pub fn len(&self) -> usize {
        self.count as usize
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    pub fn get(&self, i: usize) -> Option<BlobHash> {
        if i >= self.count as usize {
            return None;
        }
        if self.count == 1 {
            return Some(self.blob);
        }
        let b: [u8; 32] = self.raw.get(i * 32..i * 32 + 32)?.try_into().ok()?;
        Some(BlobHash(b))
    }
    pub fn to_vec(&self) -> Vec<BlobHash> {
        (0..self.len()).filter_map(|i| self.get(i)).collect()
    }
}

/// A sealed namespace over its bytes (a mapped file, or a buffer).
pub struct Index<B: AsRef<[u8]>> {
    bytes: B,
    inodes: u64,
    dirs: u64,
    offsets_at: usize,
    dirs_at: usize,
    chunk_size: u32,
    total_bytes: u64,
    dataset: String,
    cluster_id: String,
}

impl<B: AsRef<[u8]>> std::fmt::Debug for Index<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Index({}, {} inodes)", self.dataset, self.inodes)
    }
}

impl<B: AsRef<[u8]>> Index<B> {
    /// Opens sealed bytes: reads the trailer and checks that the tables lie inside them.
    /// O(1): records are checked as they are read.
    pub fn open(bytes: B) -> Result<Self, OpenError> {
        let b = bytes.as_ref();
        if b.len() < TRAILER {
            return Err(OpenError::NotSealed);
        }
        let t = &b[b.len() - TRAILER..];
        if &t[0..8] != MAGIC {
            return Err(OpenError::NotSealed);
        }
        let format = u32_at(t, 8).ok_or(OpenError::NotSealed)?;
        if format != FORMAT {
            return Err(OpenError::Format(format));
        }
        let get = |at| u64_at(t, at).ok_or(OpenError::NotSealed);
        let (inodes, dirs) = (get(16)?, get(24)?);
        let (offsets_at, dirs_at, identity_at) = (get(32)?, get(40)?, get(48)?);
        let identity_len = u64::from(u32_at(t, 56).ok_or(OpenError::NotSealed)?);
        let end = (b.len() - TRAILER) as u64;
        let damaged = OpenError::Damaged;
        if inodes == 0 || inodes > u64::from(u32::MAX) {
            return Err(damaged("inode count"));
        }
        if offsets_at.checked_add(inodes.checked_mul(8).ok_or(damaged("inode count"))?) != Some(dirs_at) {
            return Err(damaged("offset table"));
        }
        if dirs_at.checked_add(dirs.checked_mul(DIR).ok_or(damaged("dir count"))?) != Some(identity_at) {
            return Err(damaged("directory table"));
        }
        if identity_at.checked_add(identity_len) != Some(end) {
            return Err(damaged("identity"));
        }
        let identity =
            std::str::from_utf8(&b[identity_at as usize..end as usize]).map_err(|_| damaged("identity"))?;
        let (dataset, cluster_id) = identity.split_once('\0').ok_or(damaged("identity"))?;
        Ok(Index {
            inodes,
            dirs,
            offsets_at: offsets_at as usize,
            dirs_at: dirs_at as usize,
            chunk_size: u32_at(t, 60).ok_or(OpenError::NotSealed)?,
            total_bytes: get(64)?,
            dataset: dataset.to_string(),
            cluster_id: cluster_id.to_string(),
            bytes,
        })
    }

    /// Refuses an index that is not of `dataset` of `cluster_id`.
    pub fn check_identity(&self, dataset: &str, cluster_id: &str) -> Result<(), OpenError> {
        if self.dataset != dataset || self.cluster_id != cluster_id {
            return Err(OpenError::OtherVersion {
                found: format!("dataset {} of cluster {}", self.dataset, self.cluster_id),
                want: format!("dataset {dataset} of cluster {cluster_id}"),
            });
        }
        Ok(())
    }

    /// The (dataset, cluster id) it was sealed for.
    pub fn identity(&self) -> (&str, &str) {
        (&self.dataset, &self.cluster_id)
    }

    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    /// What the bytes are held in.
    pub fn backing(&self) -> &B {
        &self.bytes
    }

    /// Number of inodes, the root included.
    pub fn len(&self) -> usize {
        self.inodes as usize
    }

    pub fn is_empty(&self) -> bool {
        self.inodes <= 1
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    fn rec(&self, ino: u64) -> Option<Rec<'_>> {
        if ino == 0 || ino > self.inodes {
            return None;
        }
        let b = self.bytes.as_ref();
        let at = usize::try_from(u64_at(b, self.offsets_at + (ino as usize - 1) * 8)?).ok()?;
        if at >= self.offsets_at {
            return None;
        }
        let head = b.get(at..at + RECORD)?;
        let kind = Kind::from_code(head[0])?;
        let name_len = u16_at(head, 4)? as usize;
        let name_at = at + RECORD;
        let name = std::str::from_utf8(b.get(name_at..name_at + name_len)?).ok()?;
        // The record ends where the next begins (or where the offset table does).
        let next = if ino < self.inodes {
            usize::try_from(u64_at(b, self.offsets_at + ino as usize * 8)?).ok()?
        } else {
            self.offsets_at
        };
        let tail = b.get(name_at + name_len..next.min(self.offsets_at))?;
        Some(Rec {
            kind,
            mode: u16_at(head, 2)?,
            parent: u32_at(head, 6)?,
            size: u64_at(head, 10)?,
            mtime_ns: i64::from_le_bytes(head[18..26].try_into().ok()?),
            shard: u32_at(head, 26)?,
            extra: u32_at(head, 30)?,
            name,
            tail,
        })
    }

    pub fn attr(&self, ino: u64) -> Option<Attr> {
        let r = self.rec(ino)?;
        Some(Attr {
            ino,
            kind: r.kind,
            size: r.size,
            mode: r.mode,
            mtime_ns: r.mtime_ns,
            shard: r.shard,
        })
    }

    pub fn name(&self, ino: u64) -> Option<&str> {
        self.rec(ino).map(|r| r.name)
    }

    pub fn parent(&self, ino: u64) -> Option<u64> {
        self.rec(ino).map(|r| u64::from(r.parent))
    }

    /// The run of a directory's children: (first inode, count); (0, 0) when it has none;
    /// None when `ino` is not a directory.
    pub fn children(&self, ino: u64) -> Option<(u64, u64)> {
        self.dir_row(ino).map(|(f, c, _)| (f, c))
    }

    /// A directory's link count: 2 and one per subdirectory.
    pub fn nlink(&self, ino: u64) -> Option<u32> {
        let (_, _, subdirs) = self.dir_row(ino)?;
        Some(2u32.saturating_add(subdirs))
    }

    fn dir_row(&self, ino: u64) -> Option<(u64, u64, u32)> {
        if self.rec(ino)?.kind != Kind::Dir {
            return None;
        }
        let b = self.bytes.as_ref();
        let (mut lo, mut hi) = (0u64, self.dirs);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let at = self.dirs_at + (mid * DIR) as usize;
            let d = u64::from(u32_at(b, at)?);
            match d.cmp(&ino) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => {
                    let first = u64::from(u32_at(b, at + 4)?);
                    let count = u64::from(u32_at(b, at + 8)?);
                    if first < 2 || first.checked_add(count)? > self.inodes + 1 {
                        return None;
                    }
                    return Some((first, count, u32_at(b, at + 12)?));
                }
            }
        }
        Some((0, 0, 0))
    }

    /// The child `name` of directory `parent` (a binary search of its run).
    pub fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        let (first, count) = self.children(parent)?;
        let (mut lo, mut hi) = (0u64, count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let ino = first + mid;
            match self.name(ino)?.cmp(name) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(ino),
            }
        }
        None
    }

    pub fn readlink(&self, ino: u64) -> Option<&str> {
        let r = self.rec(ino)?;
        if r.kind != Kind::Symlink {
            return None;
        }
        std::str::from_utf8(r.tail.get(..r.extra as usize)?).ok()
    }

    /// A file's blob and chunk hashes.
    pub fn blob(&self, ino: u64) -> Option<(BlobHash, Chunks<'_>)> {
        let r = self.rec(ino)?;
        if r.kind != Kind::File {
            return None;
        }
        let blob = BlobHash(r.tail.get(..32)?.try_into().ok()?);
        let raw = if r.extra > 1 {
            r.tail.get(32..32 + r.extra as usize * 32)?
        } else {
            &[]
        };
        Some((
            blob,
            Chunks {
                blob,
                raw,
                count: r.extra,
            },
        ))
    }

    /// The entry's path from the root, from parent links (a bounded walk: damaged links
    /// that loop give None).
    pub fn path(&self, ino: u64) -> Option<String> {
        let mut parts = Vec::new();
        let mut cur = ino;
        while cur != ROOT {
            if parts.len() > crate::manifest::MAX_PATH_BYTES {
                return None;
            }
            let r = self.rec(cur)?;
            parts.push(r.name);
            cur = u64::from(r.parent);
        }
        parts.reverse();
        Some(parts.join("/"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::RelPath;

    fn dir(p: &str) -> Entry {
        Entry {
            path: RelPath::try_from(p).unwrap(),
            kind: EntryKind::Dir,
            mode: 0o750,
            mtime_ns: 7,
        }
    }

    fn file(p: &str, size: u64, chunks: usize) -> Entry {
        Entry {
            path: RelPath::try_from(p).unwrap(),
            kind: EntryKind::File {
                size,
                blob: BlobHash::of(p.as_bytes()),
                chunks: (0..chunks)
                    .map(|c| BlobHash::of(format!("{p}#{c}").as_bytes()))
                    .collect(),
                shard: 3,
            },
            mode: 0o640,
            mtime_ns: 9,
        }
    }

    fn sample() -> Vec<Entry> {
        vec![
            file("a/z.bin", 5, 1),
            Entry {
                path: RelPath::try_from("a/link").unwrap(),
                kind: EntryKind::Symlink {
                    target: "../b.bin".into(),
                },
                mode: 0o777,
                mtime_ns: 1,
            },
            dir("a"),
            file("b.bin", 6_000_000, 2),
            dir("a/sub"),
            file("a/m.bin", 0, 0),
            file("a/sub/deep", 1, 1),
        ]
    }

    #[test]
    fn a_sealed_tree_answers_lookups_listings_and_attrs_in_place() {
        let (bytes, hash) = seal(sample(), 4 << 20, "ds", "c1").unwrap();
        assert_eq!(hash, BlobHash::of(&bytes));
        let ix = Index::open(&bytes[..]).unwrap();
        ix.check_identity("ds", "c1").unwrap();
        assert!(matches!(
            ix.check_identity("other", "c1"),
            Err(OpenError::OtherVersion { .. })
        ));
        assert!(ix.check_identity("ds", "c2").is_err());
        assert_eq!(ix.len(), 8);
        assert_eq!(ix.total_bytes(), 6_000_006);
        let a = ix.lookup(ROOT, "a").unwrap();
        assert_eq!(ix.attr(a).unwrap().kind, Kind::Dir);
        assert_eq!(ix.attr(a).unwrap().mode, 0o750);
        assert_eq!(ix.nlink(a), Some(3), "a and its one subdirectory");
        assert_eq!(ix.nlink(ROOT), Some(3));
        let (first, count) = ix.children(a).unwrap();
        let names: Vec<_> = (first..first + count).map(|i| ix.name(i).unwrap()).collect();
        assert_eq!(names, ["link", "m.bin", "sub", "z.bin"]);
        let b = ix.lookup(ROOT, "b.bin").unwrap();
        let at = ix.attr(b).unwrap();
        assert_eq!(
            (at.kind, at.size, at.mode, at.mtime_ns, at.shard),
            (Kind::File, 6_000_000, 0o640, 9, 3)
        );
        let (blob, chunks) = ix.blob(b).unwrap();
        assert_eq!(blob, BlobHash::of(b"b.bin"));
        assert_eq!(
            chunks.to_vec(),
            vec![BlobHash::of(b"b.bin#0"), BlobHash::of(b"b.bin#1")]
        );
        // One chunk: its hash is the blob's, not stored twice.
        let z = ix.lookup(a, "z.bin").unwrap();
        assert_eq!(ix.blob(z).unwrap().1.to_vec(), vec![BlobHash::of(b"a/z.bin")]);
        let m = ix.lookup(a, "m.bin").unwrap();
        assert!(ix.blob(m).unwrap().1.is_empty());
        let l = ix.lookup(a, "link").unwrap();
        assert_eq!(ix.readlink(l), Some("../b.bin"));
        assert_eq!(ix.parent(l), Some(a));
        let sub = ix.lookup(a, "sub").unwrap();
        let deep = ix.lookup(sub, "deep").unwrap();
        assert_eq!(ix.path(deep).as_deref(), Some("a/sub/deep"));
        assert_eq!(ix.lookup(a, "nope"), None);
        assert_eq!(ix.lookup(b, "x"), None, "files have no children");
        assert_eq!(ix.children(b), None);
        assert_eq!(ix.children(deep), None);
        assert!(ix.attr(0).is_none() && ix.attr(99).is_none());
        // The same entries in any order seal to the same bytes.
        let mut rev = sample();
        rev.reverse();
        assert_eq!(seal(rev, 4 << 20, "ds", "c1").unwrap().1, hash);
    }

    /// What the writer says of its output (hash, size, each chunk's hash) is what the
    /// bytes hash to, whatever the chunk size against the record boundaries.
    #[test]
    fn the_writer_names_its_bytes_and_each_chunk_of_them() {
        for chunk in [7u32, 64, 100, 1 << 22] {
            let mut entries = sample();
            entries.sort_unstable_by(|a, b| canonical_cmp(a.path.as_str(), b.path.as_str()));
            let mut out = Vec::new();
            let mut w = Writer::new(&mut out, chunk).unwrap();
            for e in &entries {
                w.push(e).unwrap();
            }
            let sealed = w.finish("ds", "c1").unwrap();
            assert_eq!(sealed.hash, BlobHash::of(&out));
            assert_eq!(sealed.size, out.len() as u64);
            assert_eq!(sealed.chunks, chunk_hashes(&out, chunk), "chunk size {chunk}");
            assert_eq!(sealed.chunks.len() as u64, sealed.size.div_ceil(u64::from(chunk)));
            assert_eq!(sealed.chunk_bytes().len(), 32 * sealed.chunks.len());
        }
    }

    #[test]
    fn inconsistent_or_unordered_manifests_are_refused_naming_the_entry() {
        assert_eq!(
            seal(vec![file("x/y", 1, 1)], 1 << 22, "d", "c").err(),
            Some(SealError::Orphan("x/y".into()))
        );
        assert_eq!(
            seal(vec![file("f", 1, 1), file("f/g", 1, 1)], 1 << 22, "d", "c").err(),
            Some(SealError::Orphan("f/g".into()))
        );
        assert_eq!(
            seal(vec![dir("d"), dir("d")], 1 << 22, "d", "c").err(),
            Some(SealError::Duplicate("d".into()))
        );
        let mut out = Vec::new();
        let mut w = Writer::new(&mut out, 1 << 22).unwrap();
        w.push(&file("b", 1, 1)).unwrap();
        assert_eq!(w.push(&file("a", 1, 1)), Err(SealError::Unsorted("a".into())));
    }

    #[test]
    fn damaged_bytes_are_refused_or_read_as_absent_never_a_panic() {
        let (bytes, _) = seal(sample(), 4 << 20, "ds", "c1").unwrap();
        assert_eq!(Index::open(&bytes[..10]).err(), Some(OpenError::NotSealed));
        assert_eq!(
            Index::open(&bytes[..bytes.len() - 1]).err(),
            Some(OpenError::NotSealed)
        );
        // Flip every byte in turn: opening and walking never panics.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xA5;
            if let Ok(ix) = Index::open(&b[..]) {
                for ino in 0..12 {
                    let _ = (ix.attr(ino), ix.children(ino), ix.readlink(ino), ix.path(ino));
                    if let Some((_, c)) = ix.blob(ino) {
                        let _ = c.to_vec();
                    }
                    let _ = ix.lookup(ino, "a");
                }
            }
        }
    }

    #[test]
    fn a_million_entries_cost_about_a_hundred_bytes_each() {
        let mut entries = Vec::with_capacity(1_001_000);
        for d in 0..1000 {
            entries.push(dir(&format!("d{d:04}")));
            for f in 0..1000 {
                entries.push(file(&format!("d{d:04}/file-{f:05}.jpg"), 100_000, 1));
            }
        }
        let (bytes, _) = seal(entries, 4 << 20, "ds", "c").unwrap();
        let per = bytes.len() / 1_001_000;
        assert!(per <= 100, "{per} bytes per entry");
        let ix = Index::open(&bytes[..]).unwrap();
        let d = ix.lookup(ROOT, "d0500").unwrap();
        assert!(ix.lookup(d, "file-00999.jpg").is_some());
        assert_eq!(ix.children(d).unwrap().1, 1000);
    }
}
