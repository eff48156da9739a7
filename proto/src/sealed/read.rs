//! Reading a sealed namespace in place: every offset and length checked on use.

use super::*;

/// Why sealed bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("not a sealed namespace (no trailer)")]
    NotSealed,
    #[error("sealed namespace format {0}; this build reads formats 1 and 2 (upgrade it)")]
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
    kind: ChunkKind,
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
        let kind = match format {
            FORMAT => ChunkKind::Plain,
            FORMAT_TREE => ChunkKind::Tree,
            _ => return Err(OpenError::Format(format)),
        };
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
            kind,
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

    /// What its files' chunk hashes are.
    pub fn chunk_kind(&self) -> ChunkKind {
        self.kind
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
