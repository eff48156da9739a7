//! What the index keeps per blob, and the file stamps that say whether a verified file
//! has been touched since.

use std::fs;
use std::path::Path;

use locus_proto::chunks::{ChunkAt, ChunkKind};
use locus_proto::BlobHash;

/// What the index knows about a stored blob.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct BlobRecord {
    #[prost(uint64, tag = "1")]
    pub(super) size: u64,
    #[prost(uint32, tag = "2")]
    pub(super) dir: u32,
    #[prost(bool, tag = "3")]
    pub(super) pinned: bool,
    #[prost(uint32, tag = "4")]
    pub(super) chunk_size: u32,
    /// 32-byte chunk hashes, concatenated. Empty for a complete blob of one chunk, whose
    /// chunk hash is its own hash (format 3: most blobs of a small-file store, 34 of a
    /// record's ~85 bytes on disk and an allocation each in memory).
    #[prost(bytes = "vec", tag = "5")]
    pub(super) chunks: Vec<u8>,
    /// Only some chunks are here: the blob lives in `partial/<hash>`, a sparse file.
    #[prost(bool, tag = "6")]
    pub(super) partial: bool,
    /// For a partial blob, bit i set = chunk i is on disk, verified and synced.
    #[prost(bytes = "vec", tag = "7")]
    pub(super) present: Vec<u8>,
    /// The file's stamp when it was last known whole and intact (see `State::verified`),
    /// kept so a restart does not have every blob hashed again before its next direct
    /// read. Absent in records written before it existed.
    #[prost(message, optional, tag = "8")]
    pub(super) verified: Option<StampRecord>,
    /// A partial blob asked to be pinned: it is pinned once complete. Until then it is
    /// evictable like any unpinned blob, so a transfer that never finishes cannot hold
    /// its reservation forever.
    #[prost(bool, tag = "9")]
    pub(super) pin_when_complete: bool,
    /// Nonzero: the blob's bytes are at `offset` inside pack file `pack` (`pack.rs`), not
    /// in a file of their own. Only complete blobs are packed.
    #[prost(uint64, tag = "10")]
    pub(super) pack: u64,
    #[prost(uint64, tag = "11")]
    pub(super) offset: u64,
    /// `chunks` are tree chunk hashes (`locus_proto::chunks`): what this store computes
    /// for blobs it hashes itself. False in records written before them, and for a
    /// partial blob whose chunk hashes came from a version that records plain ones.
    #[prost(bool, tag = "12")]
    pub(super) tree_chunks: bool,
    /// The team whose reader had the blob cached here (`teams.rs`); 0: none.
    #[prost(uint32, tag = "13")]
    pub(super) team: u32,
    /// When a writer (an import, a copy, a fetch asked to pin) last pinned the blob, in
    /// seconds since the epoch; 0 when its pin comes from a listing of what this node
    /// must hold, or it is not pinned. Pin sync keeps such a pin while an import begun
    /// before it is open (`BlobStore::sync_pins`).
    #[prost(uint32, tag = "14")]
    pub(super) pinned_at: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct StampRecord {
    #[prost(uint64, tag = "1")]
    pub(super) ino: u64,
    #[prost(int64, tag = "2")]
    pub(super) ctime_s: i64,
    #[prost(int64, tag = "3")]
    pub(super) ctime_ns: i64,
    #[prost(uint64, tag = "4")]
    pub(super) size: u64,
}

impl From<FileStamp> for StampRecord {
    fn from(s: FileStamp) -> Self {
        StampRecord {
            ino: s.ino,
            ctime_s: s.ctime_s,
            ctime_ns: s.ctime_ns,
            size: s.size,
        }
    }
}

impl From<&StampRecord> for FileStamp {
    fn from(s: &StampRecord) -> Self {
        FileStamp {
            ino: s.ino,
            ctime_s: s.ctime_s,
            ctime_ns: s.ctime_ns,
            size: s.size,
        }
    }
}

impl BlobRecord {
    /// An index value decoded and checked: a record whose chunk list is not whole hashes,
    /// whose chunk size is not one the store writes, or whose chunk count does not match
    /// its size (a damaged index, or one written by a broken build) is refused here, so
    /// no later read divides by its chunk size or slices its hashes wrongly. The store
    /// then treats the blob as missing: pin sync fetches it again.
    pub(super) fn decode_checked(v: &[u8]) -> Result<Self, String> {
        use prost::Message;
        let r = BlobRecord::decode(v).map_err(|e| format!("not a record: {e}"))?;
        if r.implicit_chunk() {
            let want = locus_proto::manifest::chunk_count(r.size, r.chunk_size.max(1));
            if r.partial || want != 1 {
                return Err(format!(
                    "no chunk hashes for a {} blob of {want} chunks",
                    if r.partial { "partial" } else { "complete" }
                ));
            }
        }
        if !r.chunks.len().is_multiple_of(32) {
            return Err(format!(
                "{} bytes of chunk hashes is not whole hashes",
                r.chunks.len()
            ));
        }
        if !r.chunk_size.is_power_of_two()
            || !(locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(&r.chunk_size)
        {
            return Err(format!("chunk size {} is not one the store writes", r.chunk_size));
        }
        if r.pack != 0 && (r.partial || r.offset < super::pack::header_len(1)) {
            return Err(format!(
                "a packed blob must be complete and after its pack's header (offset {})",
                r.offset
            ));
        }
        let want = locus_proto::manifest::chunk_count(r.size, r.chunk_size);
        if r.chunk_count() != want {
            return Err(format!(
                "{} chunk hashes for {} bytes in {}-byte chunks (want {want})",
                r.chunk_count(),
                r.size,
                r.chunk_size
            ));
        }
        Ok(r)
    }

    pub(super) fn complete(
        size: u64,
        dir: u32,
        pinned: bool,
        chunk_size: u32,
        (kind, chunks): (ChunkKind, &[BlobHash]),
    ) -> Self {
        BlobRecord {
            size,
            dir,
            pinned,
            chunk_size,
            chunks: compact_chunks(chunks),
            partial: false,
            present: Vec::new(),
            verified: None,
            pin_when_complete: false,
            pack: 0,
            offset: 0,
            tree_chunks: kind.is_tree(),
            team: 0,
            pinned_at: if pinned { super::unix_secs() } else { 0 },
        }
    }

    /// A complete blob of one chunk that keeps no chunk list: its chunk hash is its hash.
    fn implicit_chunk(&self) -> bool {
        self.chunks.is_empty() && self.size > 0
    }

    /// Drops the chunk list of a complete blob of one chunk (a record written before
    /// format 3), which says nothing its hash does not.
    pub(super) fn compact(&mut self) {
        if !self.partial && self.chunks.len() == 32 {
            self.chunks = Vec::new();
        }
    }

    /// The blob's chunk hashes (`h` is the blob's own hash).
    pub(super) fn chunk_hashes(&self, h: &BlobHash) -> Vec<BlobHash> {
        match self.implicit_chunk() {
            true => vec![*h],
            false => chunk_hashes(&self.chunks),
        }
    }

    /// How to hash chunk `i` to check it against `chunks[i]`.
    pub(super) fn chunk_at(&self, i: u64) -> ChunkAt {
        ChunkAt::index(
            ChunkKind::from_tree(self.tree_chunks),
            i,
            self.chunk_size,
            self.size,
        )
    }

    pub(super) fn chunk_count(&self) -> u64 {
        match self.implicit_chunk() {
            true => 1,
            false => (self.chunks.len() / 32) as u64,
        }
    }

    pub(super) fn has_chunk(&self, i: u64) -> bool {
        !self.partial
            || self
                .present
                .get((i / 8) as usize)
                .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    pub(super) fn missing(&self) -> Vec<u64> {
        (0..self.chunk_count()).filter(|i| !self.has_chunk(*i)).collect()
    }
}

/// A file's identity as of a moment: any write to it changes the ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    pub ino: u64,
    pub ctime_s: i64,
    pub ctime_ns: i64,
    pub size: u64,
}

pub(super) fn stamp(p: &Path) -> std::io::Result<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(p)?;
    Ok(FileStamp {
        ino: m.ino(),
        ctime_s: m.ctime(),
        ctime_ns: m.ctime_nsec(),
        size: m.len(),
    })
}

/// The stamp to record for a file this store just published, whose bytes were hashed on
/// the way in: `at_rename` is its stamp taken right after the rename (which changes the
/// ctime), and it counts only if the file still has it now, after the syncs that follow.
/// A write by anyone in between (the syncs can take long on a busy disk) leaves it
/// unstamped, so its first use hashes it whole instead of trusting the changed bytes.
pub(super) fn stamp_published(at_rename: Option<FileStamp>, dest: &Path) -> Option<FileStamp> {
    let now = stamp(dest).ok()?;
    (at_rename == Some(now)).then_some(now)
}

/// The stamp of an open file (same meaning as `stamp`).
pub(super) fn stamp_file(f: &fs::File) -> std::io::Result<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata()?;
    Ok(FileStamp {
        ino: m.ino(),
        ctime_s: m.ctime(),
        ctime_ns: m.ctime_nsec(),
        size: m.len(),
    })
}

/// A chunk list as a record keeps it: nothing for a blob of one chunk.
pub(super) fn compact_chunks(chunks: &[BlobHash]) -> Vec<u8> {
    match chunks.len() {
        1 => Vec::new(),
        _ => chunks.iter().flat_map(|c| c.0).collect(),
    }
}

pub(super) fn chunk_hashes(b: &[u8]) -> Vec<BlobHash> {
    b.chunks(32)
        .map(|c| BlobHash(c.try_into().expect("index stores whole 32-byte hashes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn a_file_changed_after_its_rename_is_not_stamped_as_verified() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("blob");
        fs::write(&p, vec![7u8; 6000]).unwrap();
        let renamed = stamp(&p).ok();
        assert_eq!(
            stamp_published(renamed, &p),
            renamed,
            "untouched: its stamp counts"
        );
        // Someone truncates it before the syncs are done.
        fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(100)
            .unwrap();
        assert_eq!(stamp_published(renamed, &p), None);
        assert_eq!(stamp_published(None, &p), None);
    }

    /// What the `index_record` fuzz target guards: a damaged record is refused, not used
    /// (a chunk list of 33 bytes sliced into hashes panicked; a chunk size of 0 divided by
    /// zero on the first read).
    #[test]
    fn damaged_index_records_are_refused_whole_ones_accepted() {
        let h = BlobHash::of(b"x");
        let good = BlobRecord::complete(100_000, 0, false, 1 << 16, (ChunkKind::Tree, &[h, h]));
        assert!(BlobRecord::decode_checked(&good.encode_to_vec()).is_ok());
        let damage: [fn(&mut BlobRecord); 7] = [
            |r| r.chunks.push(7),
            // Only a blob of one chunk may leave its chunk list out.
            |r| r.chunks.clear(),
            |r| r.chunk_size = 0,
            |r| r.chunk_size = 3 << 16,
            |r| r.size = 200_000,
            |r| {
                r.pack = 1;
                r.offset = 3
            },
            |r| {
                r.pack = 1;
                r.offset = 4096;
                r.partial = true
            },
        ];
        for (i, d) in damage.iter().enumerate() {
            let mut r = good.clone();
            d(&mut r);
            assert!(
                BlobRecord::decode_checked(&r.encode_to_vec()).is_err(),
                "damage {i} accepted"
            );
        }
        assert!(BlobRecord::decode_checked(b"\xff\xff").is_err());
        let one = BlobRecord::complete(60_000, 0, false, 1 << 16, (ChunkKind::Tree, &[h]));
        assert!(one.chunks.is_empty(), "one chunk: no list kept");
        let back = BlobRecord::decode_checked(&one.encode_to_vec()).unwrap();
        assert_eq!((back.chunk_count(), back.chunk_hashes(&h)), (1, vec![h]));
        let partial = BlobRecord { partial: true, ..one };
        assert!(
            BlobRecord::decode_checked(&partial.encode_to_vec()).is_err(),
            "a partial blob keeps its list"
        );
        let empty = BlobRecord::complete(0, 0, false, 1 << 16, (ChunkKind::Tree, &[]));
        assert!(
            BlobRecord::decode_checked(&empty.encode_to_vec()).is_ok(),
            "an empty blob has no chunks"
        );
    }
}
