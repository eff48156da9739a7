//! Manifest domain types: validated relative paths, BLAKE3 hashes and entries.
//!
//! A manifest is the file tree of one immutable version. Paths are relative and
//! normalised at the boundary: nothing past `TryFrom` can hold `..`, an absolute path, a NUL
//! or an over-long name, so no consumer (the FUSE mount, a cache node writing files) has to
//! defend against traversal again.

use std::fmt;

use crate::{pb, InvalidInput};

/// Longest path, in bytes (Linux PATH_MAX).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest path component, in bytes (Linux NAME_MAX).
pub const MAX_NAME_BYTES: usize = 255;

/// A validated relative path: `a/b/c.txt`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct RelPath(String);

impl RelPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The parent directory's path; `""` for an entry at the root.
    pub fn parent(&self) -> &str {
        self.0.rsplit_once('/').map_or("", |(p, _)| p)
    }

    /// The last component.
    pub fn file_name(&self) -> &str {
        self.0.rsplit_once('/').map_or(self.0.as_str(), |(_, n)| n)
    }

    /// Validates a directory path where the root, `""`, is also allowed.
    pub fn check_dir(s: &str) -> Result<(), InvalidInput> {
        if s.is_empty() {
            Ok(())
        } else {
            RelPath::try_from(s).map(|_| ())
        }
    }
}

impl TryFrom<String> for RelPath {
    type Error = InvalidInput;
    fn try_from(s: String) -> Result<Self, InvalidInput> {
        let err = |reason: String| InvalidInput::new("path", reason);
        if s.is_empty() {
            return Err(err("must not be empty".into()));
        }
        if s.len() > MAX_PATH_BYTES {
            return Err(err(format!(
                "is {} bytes long; at most {MAX_PATH_BYTES} are allowed",
                s.len()
            )));
        }
        if s.contains('\0') {
            return Err(err(format!("{s:?} contains a NUL byte")));
        }
        if s.starts_with('/') {
            return Err(err(format!(
                "{s:?} is absolute; paths are relative to the dataset root"
            )));
        }
        for c in s.split('/') {
            match c {
                "" => return Err(err(format!("{s:?} has an empty component"))),
                "." | ".." => {
                    return Err(err(format!("{s:?} contains a {c:?} component")));
                }
                c if c.len() > MAX_NAME_BYTES => {
                    return Err(err(format!(
                        "{s:?} has a component of {} bytes; at most {MAX_NAME_BYTES} are allowed",
                        c.len()
                    )));
                }
                _ => {}
            }
        }
        Ok(RelPath(s))
    }
}

impl TryFrom<&str> for RelPath {
    type Error = InvalidInput;
    fn try_from(s: &str) -> Result<Self, InvalidInput> {
        RelPath::try_from(s.to_string())
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A BLAKE3 hash: the name of a blob or chunk.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlobHash(pub [u8; 32]);

impl BlobHash {
    pub fn of(data: &[u8]) -> Self {
        BlobHash(*blake3::hash(data).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    pub fn from_hex(s: &str) -> Result<Self, InvalidInput> {
        blake3::Hash::from_hex(s)
            .map(|h| BlobHash(*h.as_bytes()))
            .map_err(|_| InvalidInput::new("hash", format!("{s:?} is not 64 hex digits")))
    }

    pub fn from_slice(field: &str, b: &[u8]) -> Result<Self, InvalidInput> {
        <[u8; 32]>::try_from(b).map(BlobHash).map_err(|_| {
            InvalidInput::new(
                field,
                format!("a BLAKE3 hash is 32 bytes, this one is {}", b.len()),
            )
        })
    }
}

impl fmt::Debug for BlobHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobHash({})", self.to_hex())
    }
}

impl fmt::Display for BlobHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// What an entry is, with what only that kind has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    File {
        size: u64,
        blob: BlobHash,
        chunks: Vec<BlobHash>,
        shard: u32,
    },
    Dir,
    Symlink {
        target: String,
    },
}

/// A validated manifest entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: RelPath,
    pub kind: EntryKind,
    pub mode: u32,
    pub mtime_ns: i64,
}

/// Number of chunks a file of `size` bytes has at `chunk_size`.
pub fn chunk_count(size: u64, chunk_size: u32) -> u64 {
    size.div_ceil(u64::from(chunk_size))
}

pub use crate::chunks::{hash_bytes, hash_file, ChunkHasher, ChunkKind, Chunks, FileHashes};

impl Entry {
    pub fn size(&self) -> u64 {
        match &self.kind {
            EntryKind::File { size, .. } => *size,
            _ => 0,
        }
    }

    /// Checks what depends on the version: the number of chunk hashes, and for tree chunk
    /// hashes that they are the file's (they must merge to its hash: an importer's bug
    /// or a tampered manifest is refused here rather than found by every mount).
    pub fn check_chunks(&self, chunk_size: u32, kind: ChunkKind) -> Result<(), InvalidInput> {
        if let EntryKind::File {
            size, blob, chunks, ..
        } = &self.kind
        {
            let want = chunk_count(*size, chunk_size);
            if chunks.len() as u64 != want {
                return Err(InvalidInput::new(
                    "chunks",
                    format!(
                        "{}: a file of {size} bytes has {want} chunks of {chunk_size} bytes, \
                         {} hashes were sent",
                        self.path,
                        chunks.len()
                    ),
                ));
            }
            if kind.is_tree() && !crate::chunks::tree_chunks_match(blob, chunks) {
                return Err(InvalidInput::new(
                    "chunks",
                    format!(
                        "{}: the chunk hashes are not those of the file's hash {blob} \
                         (this version records tree chunk hashes)",
                        self.path
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl TryFrom<pb::Entry> for Entry {
    type Error = InvalidInput;
    fn try_from(e: pb::Entry) -> Result<Self, InvalidInput> {
        let path = RelPath::try_from(e.path)?;
        let at = |field: &str, reason: String| InvalidInput::new(field, format!("{path}: {reason}"));
        if e.mode > 0o7777 {
            return Err(at("mode", format!("{:#o} is not a permission mode", e.mode)));
        }
        let kind = match pb::EntryKind::try_from(e.kind) {
            Ok(pb::EntryKind::File) => {
                if !e.symlink_target.is_empty() {
                    return Err(at("symlink_target", "a file has no link target".into()));
                }
                let blob = BlobHash::from_slice("blob", &e.blob).map_err(|x| at("blob", x.reason))?;
                let chunks = e
                    .chunks
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        BlobHash::from_slice("chunks", c)
                            .map_err(|x| at("chunks", format!("chunk {i}: {}", x.reason)))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                EntryKind::File {
                    size: e.size,
                    blob,
                    chunks,
                    shard: e.shard,
                }
            }
            Ok(pb::EntryKind::Dir) | Ok(pb::EntryKind::Symlink) => {
                if e.size != 0 || !e.blob.is_empty() || !e.chunks.is_empty() || e.shard != 0 {
                    return Err(at("kind", "only files have a size, blob, chunks or shard".into()));
                }
                if e.kind == pb::EntryKind::Dir as i32 {
                    if !e.symlink_target.is_empty() {
                        return Err(at("symlink_target", "a directory has no link target".into()));
                    }
                    EntryKind::Dir
                } else {
                    let t = e.symlink_target;
                    if t.is_empty() || t.len() > MAX_PATH_BYTES || t.contains('\0') {
                        return Err(at("symlink_target", "must be 1-4096 bytes without NUL".into()));
                    }
                    EntryKind::Symlink { target: t }
                }
            }
            _ => return Err(at("kind", format!("{} is not file, dir or symlink", e.kind))),
        };
        Ok(Entry {
            path,
            kind,
            mode: e.mode,
            mtime_ns: e.mtime_ns,
        })
    }
}

impl From<Entry> for pb::Entry {
    fn from(e: Entry) -> Self {
        let mut out = pb::Entry {
            path: e.path.0,
            mode: e.mode,
            mtime_ns: e.mtime_ns,
            ..Default::default()
        };
        match e.kind {
            EntryKind::File {
                size,
                blob,
                chunks,
                shard,
            } => {
                out.kind = pb::EntryKind::File as i32;
                out.size = size;
                out.blob = blob.0.to_vec();
                out.chunks = chunks.into_iter().map(|c| c.0.to_vec()).collect();
                out.shard = shard;
            }
            EntryKind::Dir => out.kind = pb::EntryKind::Dir as i32,
            EntryKind::Symlink { target } => {
                out.kind = pb::EntryKind::Symlink as i32;
                out.symlink_target = target;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> pb::Entry {
        pb::Entry {
            path: path.into(),
            kind: pb::EntryKind::File as i32,
            size: 5,
            mode: 0o644,
            blob: vec![7; 32],
            chunks: vec![vec![7; 32]],
            ..Default::default()
        }
    }

    #[test]
    fn paths() {
        for ok in [
            "a",
            "a/b/c.txt",
            "with space/ü.bin",
            ".hidden",
            "a/..b",
            "...",
            &"x".repeat(255),
        ] {
            assert!(RelPath::try_from(ok).is_ok(), "{ok:?}");
        }
        let long = vec!["d"; 2049].join("/");
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "./a",
            "a//b",
            "a/",
            "a\0b",
            &"x".repeat(256),
            &long,
        ] {
            assert!(RelPath::try_from(bad).is_err(), "{bad:?}");
        }
        let p = RelPath::try_from("a/b/c").unwrap();
        assert_eq!((p.parent(), p.file_name()), ("a/b", "c"));
        let p = RelPath::try_from("top").unwrap();
        assert_eq!((p.parent(), p.file_name()), ("", "top"));
    }

    #[test]
    fn entry_round_trip() {
        let e = Entry::try_from(file("a/b")).unwrap();
        assert!(e.check_chunks(8, ChunkKind::Plain).is_ok());
        assert!(e.check_chunks(2, ChunkKind::Plain).is_err());
        assert_eq!(pb::Entry::from(e.clone()), file("a/b"));
        let link = pb::Entry {
            path: "l".into(),
            kind: pb::EntryKind::Symlink as i32,
            symlink_target: "../x".into(),
            ..Default::default()
        };
        let e = Entry::try_from(link.clone()).unwrap();
        assert_eq!(pb::Entry::from(e), link);
    }

    #[test]
    fn chunk_hasher_matches_one_shot_hashes() {
        let data: Vec<u8> = (0..300_001u32).map(|i| (i % 253) as u8).collect();
        let mut h = ChunkHasher::new(65536, ChunkKind::Plain);
        for piece in data.chunks(7777) {
            h.update(piece);
        }
        let (size, whole, chunks) = h.finish();
        assert_eq!(size, 300_001);
        assert_eq!(whole, BlobHash::of(&data));
        let want: Vec<BlobHash> = data.chunks(65536).map(BlobHash::of).collect();
        assert_eq!(chunks, want);
        assert_eq!(
            ChunkHasher::new(65536, ChunkKind::Plain).finish().2.len(),
            0,
            "an empty blob has no chunks"
        );
        // Held whole: the same hashes, whether one chunk (hashed once) or many.
        for len in [0, 1, 65_535, 65_536, 65_537, 300_001] {
            let mut h = ChunkHasher::new(65536, ChunkKind::Plain);
            h.update(&data[..len]);
            assert_eq!(
                hash_bytes(&data[..len], 65536, ChunkKind::Plain),
                h.finish(),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn entry_rejects() {
        let mut short_hash = file("a");
        short_hash.blob = vec![1; 31];
        let mut dir_with_size = file("d");
        dir_with_size.kind = pb::EntryKind::Dir as i32;
        let mut no_kind = file("k");
        no_kind.kind = 0;
        let mut bad_mode = file("m");
        bad_mode.mode = 0o100644;
        let mut bad_chunk = file("c");
        bad_chunk.chunks = vec![vec![0; 33]];
        for bad in [short_hash, dir_with_size, no_kind, bad_mode, bad_chunk] {
            assert!(Entry::try_from(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
