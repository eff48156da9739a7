//! Builds a manifest from a source: walks a local directory (or, in `remote`, lists an
//! object-store prefix) with each file's size, groups files into shards in path order
//! from the sizes alone, and assembles the manifest once every file is hashed (BLAKE3,
//! whole blob and fixed-size chunks; the import hashes each file as it reads it).
//!
//! Never follows symlinks (they are recorded as links) and never leaves the root.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{Explain, SourceError};

type Result<T, E = SourceError> = std::result::Result<T, E>;
use locus_proto::manifest::{BlobHash, Entry, EntryKind, FileHashes, RelPath};
use locus_proto::pb;

/// Where an import reads a blob's bytes from.
#[derive(Debug, Clone)]
pub enum BlobSource {
    Local(PathBuf),
    Remote(object_store::path::Path),
    /// Already read (an object-store import reads each object once and sends it from here).
    Memory(bytes::Bytes),
}

impl std::fmt::Display for BlobSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlobSource::Local(p) => write!(f, "{}", p.display()),
            BlobSource::Remote(p) => write!(f, "{p}"),
            BlobSource::Memory(b) => write!(f, "{} bytes in memory", b.len()),
        }
    }
}

/// Sets and maps keyed by blob hashes, which are uniform already: a fast seeded hasher
/// instead of SipHash (a million-file import inserts each blob into several).
pub type BlobMap<V> = HashMap<BlobHash, V, foldhash::fast::RandomState>;
pub type BlobSet = HashSet<BlobHash, foldhash::fast::RandomState>;

pub struct Scanned {
    pub entries: Vec<pb::Entry>,
    pub shards: Vec<pb::Shard>,
    /// For each distinct blob, one source holding it and its size.
    pub blobs: BlobMap<(BlobSource, u64)>,
    /// For each shard, its distinct blobs.
    pub shard_blobs: Vec<Vec<BlobHash>>,
    /// What the source held that a version cannot: FIFOs, sockets, devices (paths).
    pub left_out: Vec<String>,
}

/// One entry found in a source, before hashing.
pub struct Found {
    pub rel: String,
    pub kind: FoundKind,
    pub mode: u32,
    pub mtime_ns: i64,
}

pub enum FoundKind {
    Dir,
    Symlink(String),
    File(BlobSource),
}

/// A directory as walked, before any file is read: its entries in path order, each
/// file's size as listed (None for directories and links), and what a version cannot
/// hold (FIFOs, sockets, devices).
pub struct Listing {
    pub found: Vec<Found>,
    pub sizes: Vec<Option<u64>>,
    pub left_out: Vec<String>,
}

/// Threads listing directories at once: a cold directory's inodes are read at the disk's
/// random-read latency, which only more reads in flight hide (one thread listed 1M cold
/// files of 1 KiB in about half the time the whole import then took to read and send
/// them).
const LISTERS: usize = 8;

/// Walks `root` (never following links, never leaving it) into a [`Listing`]; `listed`
/// counts the bytes of the files found so far (for progress).
pub fn list_dir(root: &Path, listed: &AtomicU64) -> Result<Listing> {
    let mut found = Vec::new();
    let mut left_out = Vec::new();
    // Level by level: every directory of a level is listed by the pool, and their
    // subdirectories make the next level (a dataset's tree is wide, not deep).
    let mut level = vec![String::new()];
    while !level.is_empty() {
        let next = AtomicUsize::new(0);
        let lists: Vec<Result<Listed>> = std::thread::scope(|sc| {
            let workers: Vec<_> = (0..LISTERS.min(level.len()))
                .map(|_| {
                    sc.spawn(|| {
                        let mut mine = Vec::new();
                        while let Some(rel) = level.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let l = list_one(root, rel, listed);
                            let failed = l.is_err();
                            mine.push(l);
                            if failed {
                                break;
                            }
                        }
                        mine
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("a lister does not panic"))
                .collect()
        });
        level = Vec::new();
        for l in lists {
            let l = l?;
            found.extend(l.found);
            left_out.extend(l.left_out);
            level.extend(l.dirs);
        }
    }
    found.sort_by(|a, b| a.0.rel.cmp(&b.0.rel));
    left_out.sort();
    let (found, sizes) = found.into_iter().unzip();
    Ok(Listing {
        found,
        sizes,
        left_out,
    })
}

/// Turns sorted found entries and their hashes (`Some` for every file) into a manifest
/// with shards: files in path order fill a shard until the next would overflow it; a
/// file of at least a shard's size gets a shard of its own.
/// The shard of each entry (None for directories and links): files, in path order, fill a
/// shard until the next one would take it past `shard_size`; a larger file is a shard of
/// its own. It depends on sizes alone, so an object-store import can place shards before
/// it reads any object.
pub fn group_shards(sizes: &[Option<u64>], shard_size: u64) -> Vec<Option<u32>> {
    let mut out = Vec::with_capacity(sizes.len());
    let (mut shards, mut bytes, mut files) = (0u32, 0u64, 0u64);
    for size in sizes {
        let Some(size) = *size else {
            out.push(None);
            continue;
        };
        if shards == 0 || (bytes + size > shard_size && files > 0) {
            shards += 1;
            bytes = 0;
            files = 0;
        }
        bytes += size;
        files += 1;
        out.push(Some(shards - 1));
    }
    out
}

pub fn assemble(found: Vec<Found>, hashes: Vec<Option<FileHashes>>, shard_size: u64) -> Result<Scanned> {
    let sizes: Vec<Option<u64>> = found
        .iter()
        .zip(&hashes)
        .map(|(f, h)| match (&f.kind, h) {
            (FoundKind::File(_), Some(h)) => Some(h.0),
            (FoundKind::File(_), None) => Some(0),
            _ => None,
        })
        .collect();
    let groups = group_shards(&sizes, shard_size);
    let mut entries = Vec::with_capacity(found.len());
    let mut shards: Vec<pb::Shard> = Vec::new();
    let mut blobs = BlobMap::default();
    let mut shard_blobs: Vec<Vec<BlobHash>> = Vec::new();
    let mut in_shard = BlobSet::default();
    for ((f, h), group) in found.into_iter().zip(hashes).zip(groups) {
        let path = RelPath::try_from(f.rel.as_str())
            .map_err(|e| SourceError(format!("{:?}: {}", f.rel, e.reason)))?;
        let kind = match f.kind {
            FoundKind::Dir => EntryKind::Dir,
            FoundKind::Symlink(target) => EntryKind::Symlink { target },
            FoundKind::File(source) => {
                let (size, blob, chunks) = h.explain(|| format!("{} was not hashed", f.rel))?;
                if group.map(|g| g as usize) != shards.len().checked_sub(1) {
                    shards.push(pb::Shard {
                        id: shards.len() as u32,
                        ..Default::default()
                    });
                    shard_blobs.push(Vec::new());
                    in_shard.clear();
                }
                blobs.entry(blob).or_insert((source, size));
                if in_shard.insert(blob) {
                    shard_blobs.last_mut().expect("pushed").push(blob);
                }
                let s = shards.last_mut().expect("a shard was just ensured");
                s.bytes += size;
                s.files += 1;
                EntryKind::File {
                    size,
                    blob,
                    chunks,
                    shard: s.id,
                }
            }
        };
        entries.push(pb::Entry::from(Entry {
            path,
            kind,
            mode: f.mode,
            mtime_ns: f.mtime_ns,
        }));
    }
    Ok(Scanned {
        entries,
        shards,
        blobs,
        shard_blobs,
        left_out: Vec::new(),
    })
}

/// What one directory holds.
struct Listed {
    found: Vec<(Found, Option<u64>)>,
    left_out: Vec<String>,
    /// Its subdirectories (relative to the root), to list next.
    dirs: Vec<String>,
}

fn list_one(root: &Path, rel: &str, listed: &AtomicU64) -> Result<Listed> {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    let mut out = Listed {
        found: Vec::new(),
        left_out: Vec::new(),
        dirs: Vec::new(),
    };
    let rd = std::fs::read_dir(&dir).explain(|| format!("cannot list {}", dir.display()))?;
    for e in rd {
        let e = e.explain(|| format!("cannot list {}", dir.display()))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return Err(SourceError(format!(
                "{}: file name is not UTF-8; rename it to import",
                e.path().display()
            )));
        };
        let child = if rel.is_empty() {
            name.to_string()
        } else {
            format!("{rel}/{name}")
        };
        // Relative to the open directory (fstatat), not a walk of the whole path.
        let meta = e
            .metadata()
            .explain(|| format!("cannot stat {}", e.path().display()))?;
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            FoundKind::Dir
        } else if ft.is_symlink() {
            let t = std::fs::read_link(e.path())
                .explain(|| format!("cannot read link {}", e.path().display()))?;
            let target = t
                .to_str()
                .explain(|| format!("{}: link target is not UTF-8", e.path().display()))?
                .to_string();
            FoundKind::Symlink(target)
        } else if ft.is_file() {
            FoundKind::File(BlobSource::Local(e.path()))
        } else {
            tracing::warn!(
                "skipping {}: not a file, directory or symlink",
                e.path().display()
            );
            out.left_out.push(child);
            continue;
        };
        if matches!(kind, FoundKind::Dir) {
            out.dirs.push(child.clone());
        }
        let size = matches!(kind, FoundKind::File(_)).then(|| meta.len());
        listed.fetch_add(size.unwrap_or(0), Ordering::Relaxed);
        out.found.push((
            Found {
                rel: child,
                kind,
                mode: meta.permissions().mode() & 0o7777,
                mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            },
            size,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_a_tree() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::write(d.path().join("a/b/big"), vec![7u8; 300_000]).unwrap();
        std::fs::write(d.path().join("a/small"), b"hello").unwrap();
        std::fs::write(d.path().join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("a/small", d.path().join("link")).unwrap();
        let l = list_dir(d.path(), &AtomicU64::new(0)).unwrap();
        assert_eq!(l.sizes, vec![None, None, Some(300_000), Some(5), Some(0), None]);
        let hashes = l
            .found
            .iter()
            .map(|f| match &f.kind {
                FoundKind::File(BlobSource::Local(p)) => Some(
                    locus_proto::manifest::hash_file(p, 1 << 16, locus_proto::manifest::ChunkKind::Plain)
                        .unwrap(),
                ),
                _ => None,
            })
            .collect();
        let s = assemble(l.found, hashes, 200_000).unwrap();
        let paths: Vec<_> = s.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, vec!["a", "a/b", "a/b/big", "a/small", "empty", "link"]);
        let big = &s.entries[2];
        assert_eq!(big.chunks.len(), 5);
        assert_eq!(big.blob, blake3::hash(&vec![7u8; 300_000]).as_bytes().to_vec());
        assert_eq!(
            big.chunks[4],
            blake3::hash(&vec![7u8; 300_000 - 4 * 65536]).as_bytes().to_vec()
        );
        assert_eq!(s.entries[4].chunks.len(), 0);
        assert_eq!(s.entries[5].symlink_target, "a/small");
        // The big file fills shard 0; the small files share shard 1.
        assert_eq!(s.shards.len(), 2);
        assert_eq!((s.shards[0].files, s.shards[1].files), (1, 2));
        assert_eq!(s.shards.iter().map(|x| x.bytes).sum::<u64>(), 300_005);
        // Two distinct blobs of content plus the empty one; each shard lists its own.
        assert_eq!(s.blobs.len(), 3);
        assert_eq!(s.shard_blobs[0].len(), 1);
        assert_eq!(s.shard_blobs[1].len(), 2);
    }
}
