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

use std::collections::HashMap;

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

impl Namespace {
    /// Builds the table from a version's entries (any order; the root is implicit).
    pub fn build(mut entries: Vec<Entry>, chunk_size: u32) -> Result<Self, NamespaceError> {
        if entries.len() >= u32::MAX as usize - 1 {
            return Err(NamespaceError::TooLarge(entries.len()));
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let mut ns = Namespace {
            inodes: Vec::with_capacity(entries.len() + 2),
            names: String::new(),
            children: Vec::with_capacity(entries.len()),
            blobs: Vec::new(),
            chunks: Vec::new(),
            chunk_size,
            total_bytes: 0,
        };
        // Index 0 is unused so inode numbers equal indexes; 1 is the root.
        let dir = |parent: u32| Inode {
            parent,
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
        ns.inodes.push(dir(0));
        ns.inodes.push(dir(ROOT as u32));
        let mut by_path: HashMap<&str, u32> = HashMap::with_capacity(entries.len());
        let mut kids: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
        for e in &entries {
            let path = e.path.as_str();
            let parent = match e.path.parent() {
                "" => ROOT as u32,
                p => *by_path
                    .get(p)
                    .ok_or_else(|| NamespaceError::Orphan(path.to_string()))?,
            };
            if ns.inodes[parent as usize].kind != Kind::Dir {
                return Err(NamespaceError::Orphan(path.to_string()));
            }
            let ino = ns.inodes.len() as u32;
            if by_path.insert(path, ino).is_some() {
                return Err(NamespaceError::Duplicate(path.to_string()));
            }
            let name = e.path.file_name();
            let mut node = Inode {
                parent,
                kind: Kind::Dir,
                mode: (e.mode & 0o7777) as u16,
                name_off: ns.names.len() as u32,
                name_len: name.len() as u16,
                size: 0,
                mtime_ns: e.mtime_ns,
                first: 0,
                count: 0,
                blob: 0,
                shard: 0,
            };
            ns.names.push_str(name);
            match &e.kind {
                EntryKind::Dir => {}
                EntryKind::File {
                    size,
                    blob,
                    chunks,
                    shard,
                } => {
                    node.kind = Kind::File;
                    node.shard = *shard;
                    ns.total_bytes += *size;
                    node.size = *size;
                    node.blob = ns.blobs.len() as u32;
                    ns.blobs.push(*blob);
                    node.first = ns.chunks.len() as u32;
                    node.count = chunks.len() as u32;
                    ns.chunks.extend_from_slice(chunks);
                }
                EntryKind::Symlink { target } => {
                    node.kind = Kind::Symlink;
                    node.size = target.len() as u64;
                    node.first = ns.names.len() as u32;
                    node.count = target.len() as u32;
                    ns.names.push_str(target);
                }
            }
            ns.inodes.push(node);
            kids.push(Vec::new());
            kids[parent as usize].push(ino);
        }
        for (ino, mut list) in kids.into_iter().enumerate().skip(1) {
            if ns.inodes[ino].kind != Kind::Dir {
                continue;
            }
            list.sort_by(|a, b| ns.name_of(*a).cmp(ns.name_of(*b)));
            ns.inodes[ino].first = ns.children.len() as u32;
            ns.inodes[ino].count = list.len() as u32;
            ns.children.extend(list);
        }
        Ok(ns)
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
