//! The mount's namespace: the version's sealed namespace (`locus_proto::sealed`), used in
//! place. On a host with a cache node it is the node's verified blob file, memory-mapped:
//! every mount of the version on the host shares its page-cache pages, and a mount's own
//! memory does not grow with the number of files. Lookups, getattr and readdir read it
//! and never ask the metadata service.
//!
//! Inode numbers are the sealed namespace's (root = 1, then catalogue order): stable for a
//! version, so the kernel may cache entries for as long as the mount lives, and a
//! restarted mount server answers for the inodes the kernel holds.
//!
//! It must never change after it is opened: the version it describes is immutable.

use std::path::Path;

use locus_proto::manifest::{BlobHash, Entry};
pub use locus_proto::sealed::{Chunks, Kind, ROOT};

/// What getattr needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    pub mode: u16,
    pub mtime_ns: i64,
    pub nlink: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error(transparent)]
    Seal(#[from] locus_proto::sealed::SealError),
    #[error(transparent)]
    Open(#[from] locus_proto::sealed::OpenError),
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
}

/// The bytes under the index: a mapped file, or a buffer (a namespace the catalogue keeps
/// inline, or one built in a test).
enum Backing {
    Owned(Vec<u8>),
    Mapped(Mapped),
}

impl AsRef<[u8]> for Backing {
    fn as_ref(&self) -> &[u8] {
        match self {
            Backing::Owned(v) => v,
            Backing::Mapped(m) => m.as_ref(),
        }
    }
}

/// A read-only, shared mapping of a whole file.
struct Mapped {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and lives until drop; sharing it across threads is
// sharing immutable bytes.
#[allow(unsafe_code)]
unsafe impl Send for Mapped {}
#[allow(unsafe_code)]
unsafe impl Sync for Mapped {}

impl Mapped {
    #[allow(unsafe_code)]
    fn file(f: &std::fs::File) -> std::io::Result<Mapped> {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(f.metadata()?.len()).map_err(std::io::Error::other)?;
        if len == 0 {
            return Err(std::io::Error::other("the file is empty"));
        }
        // SAFETY: a fresh read-only shared mapping of an open descriptor's whole file,
        // not aliased mutably by this process. The file is a content-addressed blob,
        // written whole before it was named and never written in place again (the node
        // replaces, renames or unlinks blob files; an unlinked file stays mapped). Its
        // bytes are read through bounds-checked accessors only, so even bytes changed
        // under the mapping give wrong answers, not undefined behaviour.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapped {
            ptr: p as *const u8,
            len,
        })
    }
}

impl AsRef<[u8]> for Mapped {
    #[allow(unsafe_code)]
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live mapping of exactly `len` readable bytes until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapped {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `file`, once; no slice of it outlives
        // `self` (they borrow it).
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
    }
}

pub struct Namespace {
    ix: locus_proto::sealed::Index<Backing>,
}

impl Namespace {
    /// Seals entries (any order) and opens them: for tests and tools that hold a
    /// manifest in memory.
    pub fn build(entries: Vec<Entry>, chunk_size: u32) -> Result<Self, NamespaceError> {
        let (bytes, _) = locus_proto::sealed::seal(entries, chunk_size, "", "")?;
        Self::from_bytes(bytes)
    }

    /// Opens sealed bytes held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, NamespaceError> {
        Ok(Namespace {
            ix: locus_proto::sealed::Index::open(Backing::Owned(bytes))?,
        })
    }

    /// Opens the sealed namespace in the file at `path`, mapped, after checking its size
    /// (the file must be the whole blob).
    pub fn map(path: &Path, size: u64) -> Result<Self, NamespaceError> {
        let bad = |reason: String| NamespaceError::File {
            path: path.display().to_string(),
            reason,
        };
        let f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let len = f.metadata().map_err(|e| bad(e.to_string()))?.len();
        if len != size {
            return Err(bad(format!("{len} bytes, the sealed namespace has {size}")));
        }
        let m = Mapped::file(&f).map_err(|e| bad(format!("cannot map it: {e}")))?;
        Ok(Namespace {
            ix: locus_proto::sealed::Index::open(Backing::Mapped(m))?,
        })
    }

    /// Refuses a namespace of another dataset or cluster.
    pub fn check_identity(&self, dataset: &str, cluster_id: &str) -> Result<(), NamespaceError> {
        Ok(self.ix.check_identity(dataset, cluster_id)?)
    }

    /// The (dataset, cluster id) it was sealed for.
    pub fn identity(&self) -> (&str, &str) {
        self.ix.identity()
    }

    /// Whether the bytes are mapped from a file (shared page cache), not held in memory.
    pub fn is_mapped(&self) -> bool {
        matches!(self.ix.backing(), Backing::Mapped(_))
    }

    /// Number of entries, the root included.
    pub fn len(&self) -> usize {
        self.ix.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ix.is_empty()
    }

    /// Bytes of all files.
    pub fn total_bytes(&self) -> u64 {
        self.ix.total_bytes()
    }

    pub fn chunk_size(&self) -> u32 {
        self.ix.chunk_size()
    }

    /// What its files' chunk hashes are (the version's kind).
    pub fn chunk_kind(&self) -> locus_proto::chunks::ChunkKind {
        self.ix.chunk_kind()
    }

    pub fn attr(&self, ino: u64) -> Option<Attr> {
        let a = self.ix.attr(ino)?;
        let nlink = match a.kind {
            Kind::Dir => self.ix.nlink(ino)?,
            _ => 1,
        };
        Some(Attr {
            ino,
            kind: a.kind,
            size: a.size,
            mode: a.mode,
            mtime_ns: a.mtime_ns,
            nlink,
        })
    }

    /// The child `name` of directory `parent`.
    pub fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        self.ix.lookup(parent, name)
    }

    /// A directory's entries from position `offset` on: (inode, name, kind). `.` and
    /// `..` are the caller's to add.
    pub fn readdir(&self, dir: u64, offset: usize) -> Option<impl Iterator<Item = (u64, &str, Kind)> + '_> {
        let (first, count) = self.ix.children(dir)?;
        Some(
            (first + offset as u64..first + count)
                .filter_map(move |i| Some((i, self.ix.name(i)?, self.ix.attr(i)?.kind))),
        )
    }

    pub fn parent(&self, ino: u64) -> Option<u64> {
        self.ix.parent(ino)
    }

    pub fn readlink(&self, ino: u64) -> Option<&str> {
        self.ix.readlink(ino)
    }

    /// A file's blob and chunk hashes.
    pub fn blob(&self, ino: u64) -> Option<(BlobHash, Chunks<'_>)> {
        self.ix.blob(ino)
    }

    /// The shard a file belongs to.
    pub fn shard(&self, ino: u64) -> Option<u32> {
        let a = self.ix.attr(ino)?;
        (a.kind == Kind::File).then_some(a.shard)
    }

    /// The entry's path from the version's root (`a/b/c`), from parent links: only the
    /// rare origin fallback needs it.
    pub fn path(&self, ino: u64) -> Option<String> {
        self.ix.path(ino)
    }

    /// Heap bytes held: none for a mapped namespace (its pages are the file's, in the
    /// page cache, shared by every mount of it); the buffer's for one in memory.
    pub fn heap_bytes(&self) -> usize {
        match self.ix.backing() {
            Backing::Owned(v) => v.capacity(),
            Backing::Mapped(_) => 0,
        }
    }

    /// The sealed bytes' size.
    pub fn sealed_bytes(&self) -> usize {
        self.ix.bytes().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use locus_proto::manifest::{EntryKind, RelPath};

    fn file(p: &str, size: u64) -> Entry {
        Entry {
            path: RelPath::try_from(p).unwrap(),
            kind: EntryKind::File {
                size,
                blob: BlobHash::of(p.as_bytes()),
                chunks: vec![BlobHash::of(b"c0"), BlobHash::of(b"c1")],
                shard: 0,
            },
            mode: 0o640,
            mtime_ns: 9,
        }
    }

    fn dir(p: &str) -> Entry {
        Entry {
            path: RelPath::try_from(p).unwrap(),
            kind: EntryKind::Dir,
            mode: 0o750,
            mtime_ns: 7,
        }
    }

    /// A mapped namespace answers like one in memory and holds no heap for its entries.
    #[test]
    fn a_mapped_namespace_answers_in_place_and_refuses_a_wrong_size() {
        let entries = vec![dir("a"), file("a/x", 10), file("b", 6_000_000)];
        let (bytes, _) = locus_proto::sealed::seal(entries, 4 << 20, "ds", "c1").unwrap();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ns");
        std::fs::write(&p, &bytes).unwrap();
        let ns = Namespace::map(&p, bytes.len() as u64).unwrap();
        assert!(ns.is_mapped());
        assert_eq!(ns.heap_bytes(), 0);
        ns.check_identity("ds", "c1").unwrap();
        assert!(ns.check_identity("ds", "c2").is_err());
        let a = ns.lookup(ROOT, "a").unwrap();
        assert_eq!(ns.attr(a).unwrap().nlink, 2);
        let names: Vec<_> = ns
            .readdir(ROOT, 0)
            .unwrap()
            .map(|(_, n, _)| n.to_string())
            .collect();
        assert_eq!(names, ["a", "b"]);
        let b = ns.lookup(ROOT, "b").unwrap();
        assert_eq!(ns.blob(b).unwrap().1.len(), 2);
        assert_eq!(ns.path(ns.lookup(a, "x").unwrap()).as_deref(), Some("a/x"));
        let e = Namespace::map(&p, bytes.len() as u64 + 1)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("bytes, the sealed namespace has"), "{e}");
        std::fs::write(&p, b"not a namespace at all, but long enough to have a trailer........................................................").unwrap();
        assert!(Namespace::map(&p, std::fs::metadata(&p).unwrap().len()).is_err());
    }
}
