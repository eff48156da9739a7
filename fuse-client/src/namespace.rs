//! The mount's namespace: one immutable version's manifest as a compact inode table,
//! built once at mount time so lookups, getattr and readdir never ask the metadata
//! service again.
//!
//! Layout, chosen for million-entry versions: every inode is one fixed-size record in a
//! `Vec`; names live in one string arena; a directory's children are a contiguous,
//! name-sorted run of inode numbers in one `Vec<u32>`, so lookup is a binary search and
//! readdir a slice; files' chunk hashes live in one flat arena. Inode numbers are stable
//! for a version (root = 1, then path order), so the kernel may cache entries forever.
//!
//! It must never change after it is built: the version it describes is immutable.

use locus_proto::manifest::{BlobHash, Entry, EntryKind};

/// The root directory's inode number (FUSE's convention).
pub const ROOT: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
}

/// One inode, 48 bytes; names, children, chunk hashes and link targets live in arenas.
#[derive(Debug, Clone, Copy)]
struct Inode {
    parent: u32,
    kind: Kind,
    mode: u16,
    name_off: u32,
    name_len: u16,
    size: u64,
    mtime_ns: i64,
    /// Dirs: first index into `children`. Files: first chunk in `chunks`. Symlinks:
    /// offset of the target in `names`.
    first: u32,
    /// Dirs: number of children. Files: number of chunks. Symlinks: target length.
    count: u32,
    /// Files: index into `blobs`.
    blob: u32,
    /// Files: the shard whose replicas hold the blob.
    shard: u32,
}

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

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NamespaceError {
    #[error("{0}: its parent directory is not in the manifest")]
    Orphan(String),
    #[error("{0} appears twice in the manifest")]
    Duplicate(String),
    #[error("the manifest has {0} entries; a mount holds at most 4,294,967,294")]
    TooLarge(usize),
}

pub struct Namespace {
    inodes: Vec<Inode>,
    names: String,
    children: Vec<u32>,
    blobs: Vec<BlobHash>,
    chunks: Vec<BlobHash>,
    chunk_size: u32,
    total_bytes: u64,
}

/// One entry as it arrives, before the tree is known: the same fixed-size record as an
/// inode, with its whole path in the arena.
#[derive(Debug, Clone, Copy)]
struct Raw {
    path_off: u32,
    path_len: u16,
    node: Inode,
}

/// Collects a version's entries one at a time (in any order) into flat arenas, so a
/// million-entry manifest never exists as a million separate allocations; `finish`
/// turns them into the inode table.
pub struct Builder {
    /// Full paths and symlink targets; becomes the namespace's name arena (each name is
    /// the tail of its path).
    arena: String,
    raw: Vec<Raw>,
    blobs: Vec<BlobHash>,
    chunks: Vec<BlobHash>,
    chunk_size: u32,
    total_bytes: u64,
}

impl Builder {
    pub fn new(chunk_size: u32, expected_entries: usize) -> Self {
        Builder {
            arena: String::with_capacity(expected_entries * 24),
            raw: Vec::with_capacity(expected_entries),
            blobs: Vec::new(),
            chunks: Vec::new(),
            chunk_size,
            total_bytes: 0,
        }
    }

    pub fn add(&mut self, e: Entry) -> Result<(), NamespaceError> {
        if self.raw.len() >= u32::MAX as usize - 2 || self.arena.len() > u32::MAX as usize - 2 * 4096 {
            return Err(NamespaceError::TooLarge(self.raw.len()));
        }
        let path = e.path.as_str();
        let path_off = self.arena.len() as u32;
        self.arena.push_str(path);
        let name_len = e.path.file_name().len();
        let mut node = Inode {
            parent: 0,
            kind: Kind::Dir,
            mode: (e.mode & 0o7777) as u16,
            name_off: path_off + (path.len() - name_len) as u32,
            name_len: name_len as u16,
            size: 0,
            mtime_ns: e.mtime_ns,
            first: 0,
            count: 0,
            blob: 0,
            shard: 0,
        };
        match e.kind {
            EntryKind::Dir => {}
            EntryKind::File {
                size,
                blob,
                chunks,
                shard,
            } => {
                node.kind = Kind::File;
                node.shard = shard;
                node.size = size;
                self.total_bytes += size;
                node.blob = self.blobs.len() as u32;
                self.blobs.push(blob);
                node.first = self.chunks.len() as u32;
                node.count = chunks.len() as u32;
                self.chunks.extend_from_slice(&chunks);
            }
            EntryKind::Symlink { target } => {
                node.kind = Kind::Symlink;
                node.size = target.len() as u64;
                node.first = self.arena.len() as u32;
                node.count = target.len() as u32;
                self.arena.push_str(&target);
            }
        }
        self.raw.push(Raw {
            path_off,
            path_len: path.len() as u16,
            node,
        });
        Ok(())
    }

    pub fn finish(self) -> Result<Namespace, NamespaceError> {
        let Builder {
            arena,
            mut raw,
            blobs,
            chunks,
            chunk_size,
            total_bytes,
        } = self;
        let path = |r: &Raw| &arena[r.path_off as usize..r.path_off as usize + r.path_len as usize];
        // Path order: a directory comes before everything under it, and siblings come in
        // name order (they share the prefix), which is what lookup's binary search needs.
        raw.sort_unstable_by(|a, b| path(a).cmp(path(b)));
        for w in raw.windows(2) {
            if path(&w[0]) == path(&w[1]) {
                return Err(NamespaceError::Duplicate(path(&w[0]).to_string()));
            }
        }
        // Index 0 is unused so inode numbers equal indexes; 1 is the root; entry i of
        // the sorted list is inode i + 2.
        let root = Inode {
            parent: ROOT as u32,
            kind: Kind::Dir,
            mode: 0o755,
            name_off: 0,
            name_len: 0,
            size: 0,
            mtime_ns: 0,
            first: 0,
            count: 0,
            blob: 0,
            shard: 0,
        };
        let mut inodes = Vec::with_capacity(raw.len() + 2);
        inodes.push(Inode { parent: 0, ..root });
        inodes.push(root);
        for r in &raw {
            let p = path(r);
            let parent = match p.rfind('/') {
                None => ROOT as u32,
                Some(cut) => {
                    let want = &p[..cut];
                    // The parent sorts before its children: search the sorted paths.
                    let i = raw
                        .binary_search_by(|x| path(x).cmp(want))
                        .map_err(|_| NamespaceError::Orphan(p.to_string()))?;
                    (i + 2) as u32
                }
            };
            let mut node = r.node;
            node.parent = parent;
            inodes.push(node);
        }
        // Children runs by counting: a parent's children are already in name order.
        let mut counts = vec![0u32; inodes.len()];
        for n in &inodes[2..] {
            counts[n.parent as usize] += 1;
        }
        let mut next = 0u32;
        for (ino, n) in inodes.iter_mut().enumerate() {
            if n.kind == Kind::Dir && ino > 0 {
                n.first = next;
                n.count = counts[ino];
                next += counts[ino];
            } else if counts[ino] > 0 {
                // Something claims a file or a symlink as its directory.
                let child = inodes_child_path(&raw, ino, &arena);
                return Err(NamespaceError::Orphan(child));
            }
        }
        drop(counts);
        let mut children = vec![0u32; next as usize];
        let mut fill: Vec<u32> = inodes.iter().map(|n| n.first).collect();
        for (ino, n) in inodes.iter().enumerate().skip(2) {
            let p = n.parent as usize;
            children[fill[p] as usize] = ino as u32;
            fill[p] += 1;
        }
        drop(raw);
        Ok(Namespace {
            inodes,
            names: arena,
            children,
            blobs,
            chunks,
            chunk_size,
            total_bytes,
        })
    }
}

/// For the error message: the path of some entry whose parent is inode `parent`.
fn inodes_child_path(raw: &[Raw], parent: usize, arena: &str) -> String {
    let prefix = &raw[parent - 2];
    let p = &arena[prefix.path_off as usize..prefix.path_off as usize + prefix.path_len as usize];
    raw.iter()
        .map(|r| &arena[r.path_off as usize..r.path_off as usize + r.path_len as usize])
        .find(|c| c.len() > p.len() && c.starts_with(p) && c.as_bytes()[p.len()] == b'/')
        .unwrap_or(p)
        .to_string()
}

impl Namespace {
    /// Builds the table from a version's entries (any order; the root is implicit).
    pub fn build(entries: Vec<Entry>, chunk_size: u32) -> Result<Self, NamespaceError> {
        let mut b = Builder::new(chunk_size, entries.len());
        for e in entries {
            b.add(e)?;
        }
        b.finish()
    }

    fn name_of(&self, ino: u32) -> &str {
        let n = &self.inodes[ino as usize];
        &self.names[n.name_off as usize..n.name_off as usize + n.name_len as usize]
    }

    fn get(&self, ino: u64) -> Option<&Inode> {
        if ino == 0 {
            return None;
        }
        self.inodes.get(usize::try_from(ino).ok()?)
    }

    /// Number of entries, the root included.
    pub fn len(&self) -> usize {
        self.inodes.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 1
    }

    /// Bytes of all files.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    pub fn attr(&self, ino: u64) -> Option<Attr> {
        let n = self.get(ino)?;
        let nlink = match n.kind {
            Kind::Dir => {
                2 + self.children[n.first as usize..(n.first + n.count) as usize]
                    .iter()
                    .filter(|c| self.inodes[**c as usize].kind == Kind::Dir)
                    .count() as u32
            }
            _ => 1,
        };
        Some(Attr {
            ino,
            kind: n.kind,
            size: n.size,
            mode: n.mode,
            mtime_ns: n.mtime_ns,
            nlink,
        })
    }

    /// The child `name` of directory `parent`.
    pub fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        let p = self.get(parent)?;
        if p.kind != Kind::Dir {
            return None;
        }
        let run = &self.children[p.first as usize..(p.first + p.count) as usize];
        run.binary_search_by(|c| self.name_of(*c).cmp(name))
            .ok()
            .map(|i| u64::from(run[i]))
    }

    /// A directory's entries from position `offset` on: (inode, name, kind). `.` and
    /// `..` are the caller's to add.
    pub fn readdir(&self, dir: u64, offset: usize) -> Option<impl Iterator<Item = (u64, &str, Kind)> + '_> {
        let d = self.get(dir)?;
        if d.kind != Kind::Dir {
            return None;
        }
        let run = &self.children[d.first as usize..(d.first + d.count) as usize];
        Some(
            run.iter()
                .skip(offset)
                .map(move |c| (u64::from(*c), self.name_of(*c), self.inodes[*c as usize].kind)),
        )
    }

    pub fn parent(&self, ino: u64) -> Option<u64> {
        self.get(ino).map(|n| u64::from(n.parent))
    }

    pub fn readlink(&self, ino: u64) -> Option<&str> {
        let n = self.get(ino)?;
        (n.kind == Kind::Symlink).then(|| &self.names[n.first as usize..(n.first + n.count) as usize])
    }

    /// A file's blob and chunk hashes.
    pub fn blob(&self, ino: u64) -> Option<(BlobHash, &[BlobHash])> {
        let n = self.get(ino)?;
        (n.kind == Kind::File).then(|| {
            (
                self.blobs[n.blob as usize],
                &self.chunks[n.first as usize..(n.first + n.count) as usize],
            )
        })
    }

    /// The shard a file belongs to.
    pub fn shard(&self, ino: u64) -> Option<u32> {
        let n = self.get(ino)?;
        (n.kind == Kind::File).then_some(n.shard)
    }

    /// The entry's path from the version's root (`a/b/c`), rebuilt from parent links:
    /// only the rare origin fallback needs it, so it is not stored.
    pub fn path(&self, ino: u64) -> Option<String> {
        self.get(ino)?;
        let mut parts = Vec::new();
        let mut cur = ino as u32;
        while u64::from(cur) != ROOT {
            parts.push(self.name_of(cur));
            cur = self.inodes[cur as usize].parent;
        }
        parts.reverse();
        Some(parts.join("/"))
    }

    /// Approximate heap bytes held, for the mount's memory budget.
    pub fn heap_bytes(&self) -> usize {
        self.inodes.capacity() * std::mem::size_of::<Inode>()
            + self.names.capacity()
            + self.children.capacity() * 4
            + (self.blobs.capacity() + self.chunks.capacity()) * 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use locus_proto::manifest::RelPath;

    fn dir(p: &str) -> Entry {
        Entry {
            path: RelPath::try_from(p).unwrap(),
            kind: EntryKind::Dir,
            mode: 0o750,
            mtime_ns: 7,
        }
    }

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

    #[test]
    fn lookups_attrs_and_listings() {
        let link = Entry {
            path: RelPath::try_from("a/link").unwrap(),
            kind: EntryKind::Symlink {
                target: "../b.bin".into(),
            },
            mode: 0o777,
            mtime_ns: 1,
        };
        // Any input order.
        let ns = Namespace::build(
            vec![
                file("a/z.bin", 5),
                link,
                dir("a"),
                file("b.bin", 6_000_000),
                dir("a/sub"),
                file("a/m.bin", 0),
            ],
            4 << 20,
        )
        .unwrap();
        assert_eq!(ns.len(), 7);
        let a = ns.lookup(ROOT, "a").unwrap();
        assert_eq!(ns.attr(a).unwrap().kind, Kind::Dir);
        assert_eq!(ns.attr(a).unwrap().nlink, 3, "a and its one subdirectory");
        assert_eq!(ns.attr(a).unwrap().mode, 0o750);
        let names: Vec<_> = ns.readdir(a, 0).unwrap().map(|(_, n, _)| n.to_string()).collect();
        assert_eq!(names, vec!["link", "m.bin", "sub", "z.bin"]);
        let rest: Vec<_> = ns.readdir(a, 2).unwrap().map(|(_, n, _)| n.to_string()).collect();
        assert_eq!(rest, vec!["sub", "z.bin"]);
        let b = ns.lookup(ROOT, "b.bin").unwrap();
        let at = ns.attr(b).unwrap();
        assert_eq!(
            (at.kind, at.size, at.mode, at.mtime_ns),
            (Kind::File, 6_000_000, 0o640, 9)
        );
        assert_eq!(ns.blob(b).unwrap().0, BlobHash::of(b"b.bin"));
        assert_eq!(ns.blob(b).unwrap().1.len(), 2);
        let l = ns.lookup(a, "link").unwrap();
        assert_eq!(ns.readlink(l), Some("../b.bin"));
        assert_eq!(ns.attr(l).unwrap().size, 8);
        assert_eq!(ns.parent(l), Some(a));
        assert_eq!(ns.lookup(a, "nope"), None);
        assert_eq!(ns.lookup(b, "x"), None, "files have no children");
        assert!(ns.readdir(b, 0).is_none());
        assert!(ns.attr(0).is_none() && ns.attr(99).is_none());
        // Inode numbers are stable: path order.
        let again = Namespace::build(vec![dir("a"), file("b.bin", 1), dir("a/sub")], 4 << 20).unwrap();
        assert_eq!(again.lookup(ROOT, "a"), Some(2));
    }

    #[test]
    fn refuses_inconsistent_manifests() {
        assert_eq!(
            Namespace::build(vec![file("x/y", 1)], 1 << 22).err(),
            Some(NamespaceError::Orphan("x/y".into()))
        );
        assert!(matches!(
            Namespace::build(vec![file("f", 1), file("f/g", 1)], 1 << 22),
            Err(NamespaceError::Orphan(_))
        ));
        assert!(matches!(
            Namespace::build(vec![dir("d"), dir("d")], 1 << 22),
            Err(NamespaceError::Duplicate(_))
        ));
    }

    #[test]
    fn a_million_entries_fit_the_memory_budget() {
        let mut entries = Vec::with_capacity(1_001_000);
        for d in 0..1000 {
            entries.push(dir(&format!("d{d:04}")));
            for f in 0..1000 {
                entries.push(file(&format!("d{d:04}/file-{f:05}.jpg"), 100_000));
            }
        }
        let ns = Namespace::build(entries, 4 << 20).unwrap();
        let d = ns.lookup(ROOT, "d0500").unwrap();
        assert!(ns.lookup(d, "file-00999.jpg").is_some());
        assert_eq!(ns.readdir(d, 0).unwrap().count(), 1000);
        // Two chunk hashes per file here; the table itself stays well under the mount's
        // 400 MB budget.
        assert!(std::mem::size_of::<Inode>() <= 48);
        assert!(ns.heap_bytes() < 250 << 20, "{} bytes", ns.heap_bytes());
    }
}
