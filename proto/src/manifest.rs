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

/// A file's size, BLAKE3 hash and the hashes of its `chunk_size` chunks.
pub type FileHashes = (u64, BlobHash, Vec<BlobHash>);

/// Hashes a byte stream fed in pieces of any size: the whole-blob BLAKE3 and the BLAKE3
/// of each `chunk_size` chunk.
#[derive(Debug, Clone)]
pub struct ChunkHasher {
    whole: blake3::Hasher,
    chunks: Chunks,
}

impl ChunkHasher {
    pub fn new(chunk_size: u32) -> Self {
        ChunkHasher {
            whole: blake3::Hasher::new(),
            chunks: Chunks::new(chunk_size),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        self.whole.update(data);
        self.chunks.update(data);
    }

    pub fn size(&self) -> u64 {
        self.chunks.size
    }

    pub fn finish(self) -> FileHashes {
        (
            self.chunks.size,
            BlobHash(*self.whole.finalize().as_bytes()),
            self.chunks.finish(),
        )
    }
}

/// The BLAKE3 of each `chunk_size` chunk of a byte stream fed in pieces of any size
/// (the whole-blob hash is someone else's: a plain hasher, or an outboard's builder).
#[derive(Debug, Clone)]
pub struct Chunks {
    chunk_size: u64,
    chunk: blake3::Hasher,
    in_chunk: u64,
    done: Vec<BlobHash>,
    size: u64,
}

impl Chunks {
    pub fn new(chunk_size: u32) -> Self {
        Chunks {
            chunk_size: u64::from(chunk_size.max(1)),
            chunk: blake3::Hasher::new(),
            in_chunk: 0,
            done: Vec::new(),
            size: 0,
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.size += data.len() as u64;
        while !data.is_empty() {
            let take = (self.chunk_size - self.in_chunk).min(data.len() as u64) as usize;
            self.chunk.update(&data[..take]);
            self.in_chunk += take as u64;
            data = &data[take..];
            if self.in_chunk == self.chunk_size {
                self.done.push(BlobHash(*self.chunk.finalize().as_bytes()));
                self.chunk.reset();
                self.in_chunk = 0;
            }
        }
    }

    pub fn finish(mut self) -> Vec<BlobHash> {
        if self.in_chunk > 0 {
            self.done.push(BlobHash(*self.chunk.finalize().as_bytes()));
        }
        self.done
    }
}

/// The hashes of bytes held whole in memory. A blob of one chunk is hashed once: its
/// chunk's hash is its own (for 1 KiB files, half the hashing).
pub fn hash_bytes(data: &[u8], chunk_size: u32) -> FileHashes {
    if data.len() as u64 <= u64::from(chunk_size.max(1)) {
        let whole = BlobHash::of(data);
        let chunks = if data.is_empty() { Vec::new() } else { vec![whole] };
        return (data.len() as u64, whole, chunks);
    }
    let mut h = ChunkHasher::new(chunk_size);
    h.update(data);
    h.finish()
}

/// Hashes a file in one pass: its size, its BLAKE3 and the BLAKE3 of each chunk.
pub fn hash_file(path: &std::path::Path, chunk_size: u32) -> std::io::Result<FileHashes> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = ChunkHasher::new(chunk_size);
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

impl Entry {
    pub fn size(&self) -> u64 {
        match &self.kind {
            EntryKind::File { size, .. } => *size,
            _ => 0,
        }
    }

    /// Checks what depends on the version: the number of chunk hashes.
    pub fn check_chunks(&self, chunk_size: u32) -> Result<(), InvalidInput> {
        if let EntryKind::File { size, chunks, .. } = &self.kind {
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
        assert!(e.check_chunks(8).is_ok());
        assert!(e.check_chunks(2).is_err());
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
        let mut h = ChunkHasher::new(65536);
        for piece in data.chunks(7777) {
            h.update(piece);
        }
        let (size, whole, chunks) = h.finish();
        assert_eq!(size, 300_001);
        assert_eq!(whole, BlobHash::of(&data));
        let want: Vec<BlobHash> = data.chunks(65536).map(BlobHash::of).collect();
        assert_eq!(chunks, want);
        assert_eq!(
            ChunkHasher::new(65536).finish().2.len(),
            0,
            "an empty blob has no chunks"
        );
        // Held whole: the same hashes, whether one chunk (hashed once) or many.
        for len in [0, 1, 65_535, 65_536, 65_537, 300_001] {
            let mut h = ChunkHasher::new(65536);
            h.update(&data[..len]);
            assert_eq!(hash_bytes(&data[..len], 65536), h.finish(), "{len} bytes");
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
