//! The blob store: BLAKE3-addressed blobs on one or more local data directories.
//!
//! Layout of each data dir (format version 1, in `LOCUS_BLOBSTORE`):
//! `blobs/<h[0..2]>/<hash>` complete, verified blobs; `tmp/` blobs being written;
//! `quarantine/<hash>.<ms>` blobs that failed verification. The first data dir also holds
//! `index/`, a RocksDB map hash → (size, dir, pinned, chunk size, chunk hashes), so a
//! restart reads the index and lists directory names instead of re-hashing every blob.
//!
//! Rules this module never breaks:
//! - a blob becomes visible (renamed into `blobs/`) only after its bytes hashed to its
//!   name, and after the file and its directory were fsynced;
//! - bytes are returned only after the chunk they belong to matched its stored hash; a
//!   blob that fails is moved to `quarantine/` and forgotten;
//! - pinned blobs (this node is a replica of a shard needing them) are never evicted;
//!   space for a write is reserved before the first byte lands, evicting unpinned blobs
//!   (least recently used first) when needed, else the write is refused.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use locus_proto::manifest::hash_file;
use locus_proto::BlobHash;
use prost::Message;

pub const FORMAT_FILE: &str = "LOCUS_BLOBSTORE";
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("data dir {path}: {reason}")]
    DataDir { path: String, reason: String },
    #[error("blob {0} is not on this node")]
    NotFound(BlobHash),
    #[error("blob {hash} failed verification ({what}); it was quarantined")]
    Corrupt { hash: BlobHash, what: String },
    #[error("received bytes do not match blob {hash}: {what}")]
    Mismatch { hash: BlobHash, what: String },
    #[error("blob {hash} is only partly here; chunks {missing:?} of the range are missing")]
    NotPresent { hash: BlobHash, missing: Vec<u64> },
    #[error("no room for {need} bytes: {why}")]
    Full { need: u64, why: String },
    #[error("blob I/O: {0}")]
    Io(String),
    #[error("blob index: {0}")]
    Index(String),
}

fn io(e: std::io::Error) -> StoreError {
    if e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(libc::ENOSPC) {
        // The filesystem filled up under us (another tenant, a wrong reserve): the write
        // is refused like any other full-node case, and its temporary file removed.
        return StoreError::Full {
            need: 0,
            why: format!("the disk is full: {e}"),
        };
    }
    StoreError::Io(e.to_string())
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dirs: Vec<PathBuf>,
    /// Most bytes of blobs this node keeps.
    pub capacity: u64,
    /// Free space each data dir's filesystem must keep.
    pub reserve: u64,
}

/// What the index knows about a stored blob.
#[derive(Clone, PartialEq, prost::Message)]
struct BlobRecord {
    #[prost(uint64, tag = "1")]
    size: u64,
    #[prost(uint32, tag = "2")]
    dir: u32,
    #[prost(bool, tag = "3")]
    pinned: bool,
    #[prost(uint32, tag = "4")]
    chunk_size: u32,
    /// 32-byte chunk hashes, concatenated.
    #[prost(bytes = "vec", tag = "5")]
    chunks: Vec<u8>,
    /// Only some chunks are here: the blob lives in `partial/<hash>`, a sparse file.
    #[prost(bool, tag = "6")]
    partial: bool,
    /// For a partial blob, bit i set = chunk i is on disk, verified and synced.
    #[prost(bytes = "vec", tag = "7")]
    present: Vec<u8>,
    /// The file's stamp when it was last known whole and intact (see `State::verified`),
    /// kept so a restart does not have every blob hashed again before its next direct
    /// read. Absent in records written before it existed.
    #[prost(message, optional, tag = "8")]
    verified: Option<StampRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StampRecord {
    #[prost(uint64, tag = "1")]
    ino: u64,
    #[prost(int64, tag = "2")]
    ctime_s: i64,
    #[prost(int64, tag = "3")]
    ctime_ns: i64,
    #[prost(uint64, tag = "4")]
    size: u64,
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
    fn complete(size: u64, dir: u32, pinned: bool, chunk_size: u32, chunks: &[BlobHash]) -> Self {
        BlobRecord {
            size,
            dir,
            pinned,
            chunk_size,
            chunks: chunks.iter().flat_map(|c| c.0).collect(),
            partial: false,
            present: Vec::new(),
            verified: None,
        }
    }

    fn chunk_count(&self) -> u64 {
        (self.chunks.len() / 32) as u64
    }

    fn has_chunk(&self, i: u64) -> bool {
        !self.partial
            || self
                .present
                .get((i / 8) as usize)
                .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    fn missing(&self) -> Vec<u64> {
        (0..self.chunk_count()).filter(|i| !self.has_chunk(*i)).collect()
    }
}

#[derive(Debug, Clone)]
struct Meta {
    rec: BlobRecord,
    last_access: u64,
}

#[derive(Default)]
struct State {
    blobs: HashMap<BlobHash, Meta>,
    /// Blobs with only some chunks present (not visible to HaveBlobs or pin sync).
    partials: HashMap<BlobHash, Meta>,
    used: u64,
    pinned: u64,
    /// Bytes reserved by writes in progress.
    reserved: u64,
    quarantined: u64,
    /// When each blob's file was last hashed whole and found intact, as the file's
    /// (inode, ctime) at that moment. Any write to the file changes its ctime, so a
    /// matching stamp means nothing has touched the bytes since (bit rot is the scrub's).
    verified: HashMap<BlobHash, FileStamp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    ino: u64,
    ctime_s: i64,
    ctime_ns: i64,
    size: u64,
}

fn stamp(p: &Path) -> std::io::Result<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(p)?;
    Ok(FileStamp {
        ino: m.ino(),
        ctime_s: m.ctime(),
        ctime_ns: m.ctime_nsec(),
        size: m.len(),
    })
}

/// What a restart found when it compared the index with the directories.
#[derive(Debug, Default, Clone)]
pub struct Reconcile {
    pub indexed: usize,
    /// In the index, missing on disk: dropped from the index.
    pub missing: usize,
    /// On disk, not in the index (a crash between rename and index write): verified and
    /// adopted, or quarantined.
    pub adopted: usize,
    pub quarantined: usize,
    /// Leftover partial writes removed from tmp/.
    pub tmp_removed: usize,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub capacity: u64,
    pub used: u64,
    pub pinned: u64,
    pub cached: u64,
    pub blobs: u64,
    pub quarantined: u64,
    /// Bytes the node can still accept for pinned blobs.
    pub placeable: u64,
}

pub struct BlobStore {
    cfg: StoreConfig,
    index: rocksdb::DB,
    state: Mutex<State>,
    tick: AtomicU64,
    /// Blobs hashed whole by `verify` (scrub and first direct reads) since open.
    whole_hashes: AtomicU64,
    /// Woken whenever a blob is quarantined, so the owner can refetch it at once.
    pub quarantine_events: tokio::sync::Notify,
}

fn hex(h: &BlobHash) -> String {
    h.to_hex()
}

fn chunk_hashes(b: &[u8]) -> Vec<BlobHash> {
    b.chunks(32)
        .map(|c| BlobHash(c.try_into().expect("index stores whole 32-byte hashes")))
        .collect()
}

/// Free bytes on the filesystem holding `p`.
#[allow(unsafe_code)]
pub fn fs_free(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe {
        // SAFETY: statvfs is a plain C struct of integers; all-zero is a valid value.
        std::mem::zeroed()
    };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid, writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn fsync_dir(p: &Path) -> Result<(), StoreError> {
    File::open(p).and_then(|d| d.sync_all()).map_err(io)
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

impl BlobStore {
    /// Opens (or initialises) the data dirs and reconciles the index with them.
    pub fn open(cfg: StoreConfig) -> Result<(Arc<Self>, Reconcile), StoreError> {
        if cfg.dirs.is_empty() {
            return Err(StoreError::DataDir {
                path: String::new(),
                reason: "at least one data dir is needed".into(),
            });
        }
        for d in &cfg.dirs {
            check_format(d)?;
            for sub in ["blobs", "tmp", "quarantine", "partial"] {
                fs::create_dir_all(d.join(sub)).map_err(|e| StoreError::DataDir {
                    path: d.display().to_string(),
                    reason: e.to_string(),
                })?;
            }
        }
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        let index = rocksdb::DB::open(&opts, cfg.dirs[0].join("index"))
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let store = Arc::new(BlobStore {
            cfg,
            index,
            state: Mutex::new(State::default()),
            tick: AtomicU64::new(1),
            whole_hashes: AtomicU64::new(0),
            quarantine_events: tokio::sync::Notify::new(),
        });
        let report = store.reconcile()?;
        Ok((store, report))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn blob_path_in(&self, dir: u32, h: &BlobHash) -> PathBuf {
        let x = hex(h);
        self.cfg.dirs[dir as usize].join("blobs").join(&x[..2]).join(x)
    }

    fn partial_path_in(&self, dir: u32, h: &BlobHash) -> PathBuf {
        self.cfg.dirs[dir as usize].join("partial").join(hex(h))
    }

    fn reconcile(&self) -> Result<Reconcile, StoreError> {
        let mut rep = Reconcile::default();
        let mut st = self.state();
        for kv in self.index.iterator(rocksdb::IteratorMode::Start) {
            let (k, v) = kv.map_err(|e| StoreError::Index(e.into_string()))?;
            let (Ok(h), Ok(rec)) = (<[u8; 32]>::try_from(&k[..]), BlobRecord::decode(&v[..])) else {
                continue;
            };
            let h = BlobHash(h);
            if rec.dir as usize >= self.cfg.dirs.len() {
                continue;
            }
            if rec.partial {
                if self.partial_path_in(rec.dir, &h).exists() {
                    st.used += rec.size;
                    if rec.pinned {
                        st.pinned += rec.size;
                    }
                    st.partials.insert(h, Meta { rec, last_access: 0 });
                } else {
                    let _ = self.index.delete(h.0);
                }
                continue;
            }
            st.used += rec.size;
            if rec.pinned {
                st.pinned += rec.size;
            }
            // Only a hint: `verified_path` compares it with the file as it is now, and any
            // change while the node was down (a write, a copy, a restored file) differs.
            if let Some(v) = &rec.verified {
                st.verified.insert(h, v.into());
            }
            st.blobs.insert(h, Meta { rec, last_access: 0 });
        }
        rep.indexed = st.blobs.len();
        // Compare with the directories: names only, no hashing of indexed blobs.
        let mut on_disk: HashSet<BlobHash> = HashSet::new();
        let mut strays: Vec<(u32, PathBuf)> = Vec::new();
        for (di, d) in self.cfg.dirs.iter().enumerate() {
            for sub in fs::read_dir(d.join("blobs")).map_err(io)?.flatten() {
                for f in fs::read_dir(sub.path()).map_err(io)?.flatten() {
                    let name = f.file_name();
                    let Some(h) = name.to_str().and_then(|n| BlobHash::from_hex(n).ok()) else {
                        continue;
                    };
                    match st.blobs.get(&h) {
                        Some(m) if m.rec.dir as usize == di => {
                            on_disk.insert(h);
                        }
                        _ => strays.push((di as u32, f.path())),
                    }
                }
            }
            // Partial files the index does not know (a crash before the index write).
            for f in fs::read_dir(d.join("partial")).map_err(io)?.flatten() {
                let known = f
                    .file_name()
                    .to_str()
                    .and_then(|n| BlobHash::from_hex(n).ok())
                    .is_some_and(|h| st.partials.contains_key(&h));
                if !known {
                    let _ = fs::remove_file(f.path());
                    rep.tmp_removed += 1;
                }
            }
            for t in fs::read_dir(d.join("tmp")).map_err(io)?.flatten() {
                let _ = fs::remove_file(t.path());
                rep.tmp_removed += 1;
            }
            rep.quarantined += fs::read_dir(d.join("quarantine")).map_err(io)?.count();
        }
        let missing: Vec<BlobHash> = st
            .blobs
            .keys()
            .filter(|h| !on_disk.contains(*h))
            .copied()
            .collect();
        for h in &missing {
            if let Some(m) = st.blobs.remove(h) {
                st.used -= m.rec.size;
                if m.rec.pinned {
                    st.pinned -= m.rec.size;
                }
            }
            let _ = self.index.delete(h.0);
        }
        rep.missing = missing.len();
        st.quarantined = rep.quarantined as u64;
        drop(st);
        for (di, p) in strays {
            // A crash after the rename but before the index write: the file was verified
            // before the rename, but re-check it since nothing vouches for it now.
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            let h = BlobHash::from_hex(&name).expect("filtered above");
            match hash_file(&p, locus_proto::DEFAULT_CHUNK_SIZE) {
                Ok((size, whole, chunks)) if whole == h => {
                    let rec = BlobRecord::complete(size, di, false, locus_proto::DEFAULT_CHUNK_SIZE, &chunks);
                    self.insert(h, rec)?;
                    rep.adopted += 1;
                }
                _ => {
                    self.move_to_quarantine(&p, &h);
                    rep.quarantined += 1;
                }
            }
        }
        Ok(rep)
    }

    /// Publishes a complete blob (`rec` from `BlobRecord::complete`).
    fn insert(&self, h: BlobHash, rec: BlobRecord) -> Result<(), StoreError> {
        let (size, pinned, verified) = (rec.size, rec.pinned, rec.verified.as_ref().map(FileStamp::from));
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let mut st = self.state();
        match verified {
            Some(v) => st.verified.insert(h, v),
            None => st.verified.remove(&h),
        };
        if let Some(old) = st.blobs.insert(
            h,
            Meta {
                rec,
                last_access: self.tick.fetch_add(1, Ordering::Relaxed),
            },
        ) {
            st.used -= old.rec.size;
            if old.rec.pinned {
                st.pinned -= old.rec.size;
            }
        }
        st.used += size;
        if pinned {
            st.pinned += size;
        }
        Ok(())
    }

    pub fn contains(&self, h: &BlobHash) -> bool {
        self.state().blobs.contains_key(h)
    }

    /// Path of a present blob (for same-host readers), marking it recently used.
    pub fn path_of(&self, h: &BlobHash) -> Option<PathBuf> {
        let mut st = self.state();
        let m = st.blobs.get_mut(h)?;
        m.last_access = self.tick.fetch_add(1, Ordering::Relaxed);
        let dir = m.rec.dir;
        drop(st);
        Some(self.blob_path_in(dir, h))
    }

    /// Size of a blob that is here, completely or partly.
    pub fn size_of(&self, h: &BlobHash) -> Option<u64> {
        let st = self.state();
        st.blobs.get(h).or_else(|| st.partials.get(h)).map(|m| m.rec.size)
    }

    pub fn chunk_size_of(&self, h: &BlobHash) -> Option<u64> {
        let st = self.state();
        st.blobs
            .get(h)
            .or_else(|| st.partials.get(h))
            .map(|m| u64::from(m.rec.chunk_size))
    }

    /// Chunks of a partly present blob that are still missing; None if the blob is not
    /// partly here (it is complete, or absent).
    pub fn missing_chunks(&self, h: &BlobHash) -> Option<Vec<u64>> {
        self.state().partials.get(h).map(|m| m.rec.missing())
    }

    /// Starts a blob that will arrive chunk by chunk (a reader wants a range before the
    /// whole blob, or a transfer resumes). Its space is held from now on. Nothing to do
    /// when it is already complete or started.
    pub fn begin_partial(
        self: &Arc<Self>,
        hash: BlobHash,
        size: u64,
        chunk_size: u32,
        chunks: &[BlobHash],
        pin: bool,
    ) -> Result<(), StoreError> {
        if self.contains(&hash) || self.state().partials.contains_key(&hash) {
            return Ok(());
        }
        let chunk_size = checked_chunk_size(hash, chunk_size)?;
        let want = locus_proto::manifest::chunk_count(size, chunk_size);
        if chunks.len() as u64 != want {
            return Err(StoreError::Mismatch {
                hash,
                what: format!(
                    "{} chunk hashes for a blob of {size} bytes ({want} chunks)",
                    chunks.len()
                ),
            });
        }
        let (dir, reservation) = self.reserve(size)?;
        let path = self.partial_path_in(dir, &hash);
        let f = File::create(&path).map_err(io)?;
        f.set_len(size).map_err(io)?;
        f.sync_all().map_err(io)?;
        fsync_dir(path.parent().expect("partial paths have a parent"))?;
        let rec = BlobRecord {
            size,
            dir,
            pinned: pin,
            chunk_size,
            chunks: chunks.iter().flat_map(|c| c.0).collect(),
            partial: true,
            present: vec![0u8; want.div_ceil(8) as usize],
            verified: None,
        };
        self.index
            .put(hash.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let mut st = self.state();
        // The reservation becomes permanent use.
        st.used += size;
        if pin {
            st.pinned += size;
        }
        st.partials.insert(
            hash,
            Meta {
                rec,
                last_access: self.tick.fetch_add(1, Ordering::Relaxed),
            },
        );
        drop(st);
        drop(reservation);
        Ok(())
    }

    /// Stores chunk `i` of a partly present blob after checking it against its hash. The
    /// bit is set only once the bytes are synced. When the last chunk arrives the whole
    /// blob is re-hashed and moved into `blobs/`. Returns true when the blob is complete.
    pub fn write_chunk(&self, h: &BlobHash, i: u64, data: &[u8]) -> Result<bool, StoreError> {
        use std::os::unix::fs::FileExt;
        let rec = match self.state().partials.get(h) {
            Some(m) => m.rec.clone(),
            None if self.contains(h) => return Ok(true),
            None => return Err(StoreError::NotFound(*h)),
        };
        let cs = u64::from(rec.chunk_size);
        if i >= rec.chunk_count() {
            return Err(StoreError::Mismatch {
                hash: *h,
                what: format!("chunk {i} of a blob with {} chunks", rec.chunk_count()),
            });
        }
        let expect_len = cs.min(rec.size - i * cs);
        let want = chunk_hashes(&rec.chunks)[i as usize];
        if data.len() as u64 != expect_len || BlobHash::of(data) != want {
            return Err(StoreError::Mismatch {
                hash: *h,
                what: format!("chunk {i} does not match its hash"),
            });
        }
        if rec.has_chunk(i) {
            return Ok(false);
        }
        let path = self.partial_path_in(rec.dir, h);
        let f = std::fs::OpenOptions::new().write(true).open(&path).map_err(io)?;
        f.write_all_at(data, i * cs).map_err(io)?;
        f.sync_data().map_err(io)?;
        let mut st = self.state();
        let Some(m) = st.partials.get_mut(h) else {
            return Err(StoreError::NotFound(*h));
        };
        m.rec.present[(i / 8) as usize] |= 1 << (i % 8);
        let rec = m.rec.clone();
        drop(st);
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        if !rec.missing().is_empty() {
            return Ok(false);
        }
        // Complete: the whole-blob hash is the final word before it becomes visible.
        let (_, whole, _) = hash_file(&path, rec.chunk_size).map_err(io)?;
        if whole != *h {
            self.move_to_quarantine(&path, h);
            self.forget(h);
            return Err(StoreError::Corrupt {
                hash: *h,
                what: "all chunks matched but the whole blob does not".into(),
            });
        }
        let dest = self.blob_path_in(rec.dir, h);
        let parent = dest.parent().expect("blob paths have a parent");
        fs::create_dir_all(parent).map_err(io)?;
        fs::rename(&path, &dest).map_err(io)?;
        fsync_dir(parent)?;
        // Just hashed whole (see `BlobWriter::finish`).
        let verified = stamp(&dest).ok();
        let done = BlobRecord {
            partial: false,
            present: Vec::new(),
            verified: verified.map(Into::into),
            ..rec
        };
        self.index
            .put(h.0, done.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let mut st = self.state();
        if let Some(m) = st.partials.remove(h) {
            st.blobs.insert(h.to_owned(), Meta { rec: done, ..m });
            if let Some(v) = verified {
                st.verified.insert(*h, v);
            }
        }
        Ok(true)
    }

    /// Every stored blob's hash (for scrub and tests).
    pub fn hashes(&self) -> Vec<BlobHash> {
        self.state().blobs.keys().copied().collect()
    }

    pub fn is_pinned(&self, h: &BlobHash) -> bool {
        self.state().blobs.get(h).is_some_and(|m| m.rec.pinned)
    }

    pub fn stats(&self) -> Stats {
        let st = self.state();
        let disk_free: u64 = self
            .cfg
            .dirs
            .iter()
            .filter_map(|d| fs_free(d))
            .map(|f| f.saturating_sub(self.cfg.reserve))
            .sum();
        let cached = st.used - st.pinned;
        let placeable = self
            .cfg
            .capacity
            .saturating_sub(st.pinned + st.reserved)
            .min(disk_free + cached);
        Stats {
            capacity: self.cfg.capacity,
            used: st.used,
            pinned: st.pinned,
            cached,
            blobs: st.blobs.len() as u64,
            quarantined: st.quarantined,
            placeable,
        }
    }

    /// Pins or unpins one present blob. Returns false if it is not here.
    pub fn set_pinned(&self, h: &BlobHash, pinned: bool) -> Result<bool, StoreError> {
        let mut st = self.state();
        let Some(m) = st.blobs.get_mut(h) else {
            return Ok(false);
        };
        if m.rec.pinned == pinned {
            return Ok(true);
        }
        m.rec.pinned = pinned;
        let rec = m.rec.clone();
        if pinned {
            st.pinned += rec.size;
        } else {
            st.pinned -= rec.size;
        }
        drop(st);
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        Ok(true)
    }

    /// Makes the pinned set exactly `want` (blobs not here are ignored). Returns how many
    /// blobs changed.
    pub fn sync_pins(&self, want: &HashSet<BlobHash>) -> Result<usize, StoreError> {
        let changes: Vec<(BlobHash, bool)> = {
            let st = self.state();
            st.blobs
                .iter()
                .filter(|(h, m)| m.rec.pinned != want.contains(*h))
                .map(|(h, m)| (*h, !m.rec.pinned))
                .collect()
        };
        for (h, p) in &changes {
            self.set_pinned(h, *p)?;
        }
        Ok(changes.len())
    }

    /// Reserves room for `size` bytes, evicting unpinned blobs if needed. The returned
    /// guard releases the reservation when dropped.
    fn reserve(self: &Arc<Self>, size: u64) -> Result<(u32, Reservation), StoreError> {
        // The data dir with the most free space takes the blob.
        let (dir, free) = self
            .cfg
            .dirs
            .iter()
            .enumerate()
            .map(|(i, d)| (i as u32, fs_free(d).unwrap_or(0).saturating_sub(self.cfg.reserve)))
            .max_by_key(|(_, f)| *f)
            .expect("at least one dir");
        let mut victims = Vec::new();
        {
            let mut st = self.state();
            let over_cap = (st.used + st.reserved + size).saturating_sub(self.cfg.capacity);
            let over_disk = size.saturating_sub(free);
            let mut need = over_cap.max(over_disk);
            if need > 0 {
                // Unpinned blobs, complete or partly fetched, least recently used first.
                let mut lru: Vec<(u64, BlobHash, u64)> = st
                    .blobs
                    .iter()
                    .chain(st.partials.iter())
                    .filter(|(_, m)| !m.rec.pinned)
                    .map(|(h, m)| (m.last_access, *h, m.rec.size))
                    .collect();
                lru.sort();
                let evictable: u64 = lru.iter().map(|x| x.2).sum();
                if evictable < need {
                    return Err(StoreError::Full {
                        need: size,
                        why: format!(
                            "capacity {} with {} pinned, {} reserved by writes in progress, {} free on disk \
                             above the reserve",
                            self.cfg.capacity, st.pinned, st.reserved, free
                        ),
                    });
                }
                for (_, h, sz) in lru {
                    if need == 0 {
                        break;
                    }
                    if let Some(m) = st.blobs.remove(&h) {
                        st.used -= m.rec.size;
                        victims.push(self.blob_path_in(m.rec.dir, &h));
                    } else if let Some(m) = st.partials.remove(&h) {
                        st.used -= m.rec.size;
                        victims.push(self.partial_path_in(m.rec.dir, &h));
                    }
                    need = need.saturating_sub(sz);
                }
            }
            st.reserved += size;
        }
        for path in victims {
            let _ = fs::remove_file(&path);
            if let Some(h) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| BlobHash::from_hex(n).ok())
            {
                let _ = self.index.delete(h.0);
                tracing::debug!(blob = %h, "evicted");
            }
        }
        Ok((
            dir,
            Reservation {
                store: self.clone(),
                size,
            },
        ))
    }

    /// Starts writing a blob. `None` when it is already here (it is pinned if asked).
    pub fn begin_write(
        self: &Arc<Self>,
        hash: BlobHash,
        size: u64,
        chunk_size: u32,
        pin: bool,
    ) -> Result<Option<BlobWriter>, StoreError> {
        if self.contains(&hash) {
            if pin {
                self.set_pinned(&hash, true)?;
            }
            return Ok(None);
        }
        let chunk_size = checked_chunk_size(hash, chunk_size)?;
        let (dir, reservation) = self.reserve(size)?;
        let tmp = self.cfg.dirs[dir as usize].join("tmp").join(format!(
            "{}.{}",
            hex(&hash),
            self.tick.fetch_add(1, Ordering::Relaxed)
        ));
        let file = File::create(&tmp).map_err(io)?;
        Ok(Some(BlobWriter {
            store: self.clone(),
            hash,
            size,
            chunk_size,
            pin,
            dir,
            tmp,
            file: Some(std::io::BufWriter::with_capacity(1 << 20, file)),
            hasher: locus_proto::manifest::ChunkHasher::new(chunk_size),
            _reservation: reservation,
        }))
    }

    /// Reads `[offset, offset + len)` of a blob, verifying every chunk it touches first.
    /// A chunk that fails sends the blob to quarantine.
    pub fn read_range(&self, h: &BlobHash, offset: u64, len: u64) -> Result<Vec<u8>, StoreError> {
        let (rec, path) = {
            let mut st = self.state();
            let tick = self.tick.fetch_add(1, Ordering::Relaxed);
            if let Some(m) = st.blobs.get_mut(h) {
                m.last_access = tick;
                (m.rec.clone(), self.blob_path_in(m.rec.dir, h))
            } else {
                let m = st.partials.get_mut(h).ok_or(StoreError::NotFound(*h))?;
                m.last_access = tick;
                (m.rec.clone(), self.partial_path_in(m.rec.dir, h))
            }
        };
        let end = offset.saturating_add(len).min(rec.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let cs = u64::from(rec.chunk_size);
        if rec.partial {
            let missing: Vec<u64> = (offset / cs..=(end - 1) / cs)
                .filter(|c| !rec.has_chunk(*c))
                .collect();
            if !missing.is_empty() {
                return Err(StoreError::NotPresent { hash: *h, missing });
            }
        }
        let hashes = chunk_hashes(&rec.chunks);
        let mut f = File::open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                self.forget(h);
                StoreError::NotFound(*h)
            } else {
                io(e)
            }
        })?;
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut buf = Vec::new();
        let first = offset / cs;
        let last = (end - 1) / cs;
        for c in first..=last {
            let start = c * cs;
            let clen = cs.min(rec.size - start);
            buf.resize(clen as usize, 0);
            f.seek(SeekFrom::Start(start)).map_err(io)?;
            if let Err(e) = f.read_exact(&mut buf) {
                return Err(self.corrupt(h, &path, format!("chunk {c} unreadable: {e}")));
            }
            if hashes.get(c as usize) != Some(&BlobHash::of(&buf)) {
                return Err(self.corrupt(h, &path, format!("chunk {c} hash mismatch")));
            }
            let from = offset.max(start) - start;
            let to = end.min(start + clen) - start;
            out.extend_from_slice(&buf[from as usize..to as usize]);
        }
        Ok(out)
    }

    /// Re-hashes a whole blob, a chunk at a time, through one open file read front to
    /// back (so the kernel's read-ahead works and the page cache it fills is laid out
    /// for fast sequential readers, who usually come next). Ok(false) (and quarantine)
    /// when it no longer matches; partly present blobs are checked chunk by chunk on
    /// every read instead.
    pub fn verify(&self, h: &BlobHash) -> Result<bool, StoreError> {
        let (rec, path) = {
            let st = self.state();
            match st.blobs.get(h) {
                Some(m) => (m.rec.clone(), self.blob_path_in(m.rec.dir, h)),
                None => return Ok(true),
            }
        };
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(h);
                return Ok(true);
            }
            Err(e) => return Err(io(e)),
        };
        self.whole_hashes.fetch_add(1, Ordering::Relaxed);
        // Bytes appended to the file would be read by the kernel through passthrough.
        let len = f.metadata().map_err(io)?.len();
        if len != rec.size {
            self.corrupt(h, &path, format!("file is {len} bytes, the blob {}", rec.size));
            return Ok(false);
        }
        let hashes = chunk_hashes(&rec.chunks);
        let cs = u64::from(rec.chunk_size);
        let mut buf = vec![0u8; cs.min(rec.size) as usize];
        let mut start = 0;
        let mut c = 0usize;
        while start < rec.size {
            let clen = cs.min(rec.size - start) as usize;
            if let Err(e) = f.read_exact(&mut buf[..clen]) {
                self.corrupt(h, &path, format!("chunk {c} unreadable: {e}"));
                return Ok(false);
            }
            if hashes.get(c) != Some(&BlobHash::of(&buf[..clen])) {
                self.corrupt(h, &path, format!("chunk {c} hash mismatch"));
                return Ok(false);
            }
            start += clen as u64;
            c += 1;
        }
        Ok(true)
    }

    /// How many blobs `verify` has hashed whole since the store was opened.
    pub fn whole_hashes(&self) -> u64 {
        self.whole_hashes.load(Ordering::Relaxed)
    }

    /// The path of a complete local blob whose file is known to hold the right bytes,
    /// for clients that read the file directly (the mount hands it to the kernel, which
    /// then reads it without us). The first request after any change to the file hashes
    /// it whole; later ones only compare the file's stamp. None when the blob is absent
    /// or failed the check (it is then quarantined and must be fetched again).
    pub fn verified_path(&self, h: &BlobHash) -> Result<Option<PathBuf>, StoreError> {
        let Some(path) = self.path_of(h) else {
            return Ok(None);
        };
        let before = match stamp(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(h);
                return Ok(None);
            }
            Err(e) => return Err(io(e)),
        };
        if self.state().verified.get(h) == Some(&before) {
            return Ok(Some(path));
        }
        if !self.verify(h)? {
            return Ok(None);
        }
        // The stamp from before hashing: a write during the hash changes the ctime, so
        // the next request hashes again.
        self.record_stamp(h, before);
        Ok(Some(path))
    }

    /// Remembers a verified file's stamp, in memory and in the blob's index record.
    fn record_stamp(&self, h: &BlobHash, s: FileStamp) {
        let mut st = self.state();
        st.verified.insert(*h, s);
        let Some(m) = st.blobs.get_mut(h) else {
            return;
        };
        m.rec.verified = Some(s.into());
        let rec = m.rec.encode_to_vec();
        drop(st);
        // Losing it only costs one hash after a restart.
        if let Err(e) = self.index.put(h.0, rec) {
            tracing::warn!(blob = %h, "cannot record the blob's verification: {}", e.into_string());
        }
    }

    fn corrupt(&self, h: &BlobHash, path: &Path, what: String) -> StoreError {
        tracing::error!(blob = %h, "{what}; quarantining");
        self.move_to_quarantine(path, h);
        self.forget(h);
        self.state().quarantined += 1;
        self.quarantine_events.notify_one();
        StoreError::Corrupt { hash: *h, what }
    }

    fn move_to_quarantine(&self, path: &Path, h: &BlobHash) {
        // The data dir the file lives in keeps it, so the rename never crosses devices.
        let dir = self
            .cfg
            .dirs
            .iter()
            .find(|d| path.starts_with(d))
            .unwrap_or(&self.cfg.dirs[0])
            .join("quarantine");
        let dest = dir.join(format!("{}.{}", hex(h), now_ms()));
        if fs::rename(path, &dest).is_err() {
            let _ = fs::remove_file(path);
        }
    }

    fn forget(&self, h: &BlobHash) {
        let mut st = self.state();
        st.verified.remove(h);
        if let Some(m) = st.blobs.remove(h).or_else(|| st.partials.remove(h)) {
            st.used -= m.rec.size;
            if m.rec.pinned {
                st.pinned -= m.rec.size;
            }
        }
        drop(st);
        let _ = self.index.delete(h.0);
    }
}

/// The chunk size a blob is kept at: 0 means the default; anything else must be a power
/// of two in the range versions allow. A tiny chunk size would make the index hold a hash
/// per few bytes, so it is refused rather than trusted.
fn checked_chunk_size(hash: BlobHash, chunk_size: u32) -> Result<u32, StoreError> {
    if chunk_size == 0 {
        return Ok(locus_proto::DEFAULT_CHUNK_SIZE);
    }
    if !chunk_size.is_power_of_two()
        || !(locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(&chunk_size)
    {
        return Err(StoreError::Mismatch {
            hash,
            what: format!("chunk size {chunk_size} is not a power of two from 64 KiB to 1 GiB"),
        });
    }
    Ok(chunk_size)
}

fn check_format(d: &Path) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::DataDir {
        path: d.display().to_string(),
        reason,
    };
    fs::create_dir_all(d).map_err(|e| err(e.to_string()))?;
    let f = d.join(FORMAT_FILE);
    match fs::read_to_string(&f) {
        Ok(s) => {
            let v = s
                .trim()
                .strip_prefix("locus-blobstore ")
                .and_then(|v| v.parse::<u32>().ok());
            match v {
                Some(FORMAT_VERSION) => Ok(()),
                Some(other) => Err(err(format!(
                    "blob store format {other}; this build reads format {FORMAT_VERSION}"
                ))),
                None => Err(err(format!("{FORMAT_FILE} is not a Locus format marker"))),
            }
        }
        Err(_) => {
            let empty = fs::read_dir(d).map(|mut r| r.next().is_none()).unwrap_or(false);
            if !empty {
                return Err(err(format!(
                    "not empty and has no {FORMAT_FILE}; refusing to use a directory Locus did not create"
                )));
            }
            let tmp = d.join(format!("{FORMAT_FILE}.tmp"));
            fs::write(&tmp, format!("locus-blobstore {FORMAT_VERSION}\n"))
                .and_then(|_| File::open(&tmp)?.sync_all())
                .and_then(|_| fs::rename(&tmp, &f))
                .map_err(|e| err(e.to_string()))?;
            fsync_dir(d)
        }
    }
}

/// Space held for a write in progress.
struct Reservation {
    store: Arc<BlobStore>,
    size: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut st = self.store.state();
        st.reserved = st.reserved.saturating_sub(self.size);
    }
}

/// A blob being written. Nothing is visible until `finish` verified it; dropping an
/// unfinished writer removes its temporary file and releases its space.
pub struct BlobWriter {
    store: Arc<BlobStore>,
    hash: BlobHash,
    size: u64,
    chunk_size: u32,
    pin: bool,
    dir: u32,
    tmp: PathBuf,
    file: Option<std::io::BufWriter<File>>,
    hasher: locus_proto::manifest::ChunkHasher,
    _reservation: Reservation,
}

impl BlobWriter {
    pub fn write(&mut self, data: &[u8]) -> Result<(), StoreError> {
        if self.hasher.size() + data.len() as u64 > self.size {
            return Err(StoreError::Mismatch {
                hash: self.hash,
                what: format!("more than the announced {} bytes", self.size),
            });
        }
        self.file
            .as_mut()
            .expect("open until finish")
            .write_all(data)
            .map_err(io)?;
        self.hasher.update(data);
        Ok(())
    }

    /// Verifies, syncs and publishes the blob.
    pub fn finish(mut self) -> Result<(), StoreError> {
        if self.hasher.size() != self.size {
            return Err(StoreError::Mismatch {
                hash: self.hash,
                what: format!("{} bytes received, {} announced", self.hasher.size(), self.size),
            });
        }
        let (_, got, chunks) = self.hasher.clone().finish();
        if got != self.hash {
            return Err(StoreError::Mismatch {
                hash: self.hash,
                what: format!("the bytes hash to {got}"),
            });
        }
        let file = self
            .file
            .take()
            .expect("open until finish")
            .into_inner()
            .map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        drop(file);
        let dest = self.store.blob_path_in(self.dir, &self.hash);
        let parent = dest.parent().expect("blob paths have a parent");
        fs::create_dir_all(parent).map_err(io)?;
        fs::rename(&self.tmp, &dest).map_err(io)?;
        fsync_dir(parent)?;
        let mut rec = BlobRecord::complete(self.size, self.dir, self.pin, self.chunk_size, &chunks);
        // The bytes were hashed on the way in, so the first `verified_path` after an
        // import or a copy from a peer need not read the file whole again (what made a
        // cold passthrough open of a large file cost a full read before the kernel's
        // own). The stamp is taken after the rename, which changes the ctime; a write by
        // someone else between the fsync and this stamp, microseconds apart, would go
        // unnoticed until the scrub.
        rec.verified = stamp(&dest).ok().map(Into::into);
        self.store.insert(self.hash, rec)?;
        Ok(())
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path, capacity: u64) -> Arc<BlobStore> {
        BlobStore::open(StoreConfig {
            dirs: vec![dir.to_path_buf()],
            capacity,
            reserve: 0,
        })
        .unwrap()
        .0
    }

    fn put(s: &Arc<BlobStore>, data: &[u8], pin: bool) -> Result<BlobHash, StoreError> {
        let h = BlobHash::of(data);
        if let Some(mut w) = s.begin_write(h, data.len() as u64, 1 << 16, pin)? {
            for part in data.chunks(10_000) {
                w.write(part)?;
            }
            w.finish()?;
        }
        Ok(h)
    }

    #[test]
    fn writes_verify_and_read_back() {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path(), 1 << 30);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let h = put(&s, &data, true).unwrap();
        assert_eq!(s.read_range(&h, 0, 1 << 30).unwrap(), data);
        assert_eq!(s.read_range(&h, 65_530, 20).unwrap(), data[65_530..65_550]);
        assert_eq!(s.read_range(&h, 199_990, 100).unwrap(), data[199_990..]);
        assert!(s.read_range(&h, 300_000, 1).unwrap().is_empty());
        let empty = put(&s, b"", false).unwrap();
        assert!(s.read_range(&empty, 0, 10).unwrap().is_empty());
        assert!(s.is_pinned(&h));
        assert_eq!(s.stats().used, 200_000);

        // A chunk size that would blow up the index is refused.
        assert!(matches!(
            s.begin_write(BlobHash::of(b"x"), 1, 1, false),
            Err(StoreError::Mismatch { .. })
        ));

        // Wrong bytes never become visible.
        let fake = BlobHash::of(b"something else");
        let mut w = s.begin_write(fake, 3, 0, false).unwrap().unwrap();
        w.write(b"abc").unwrap();
        assert!(matches!(w.finish(), Err(StoreError::Mismatch { .. })));
        assert!(!s.contains(&fake));
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
        assert_eq!(s.stats().used, 200_000);
    }

    #[test]
    fn corruption_is_quarantined_and_never_served() {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path(), 1 << 30);
        let data = vec![42u8; 150_000];
        let h = put(&s, &data, true).unwrap();
        let p = s.path_of(&h).unwrap();
        let mut bytes = fs::read(&p).unwrap();
        bytes[140_000] ^= 1;
        fs::write(&p, bytes).unwrap();
        // The first chunk is intact and may be read; the damaged one is not.
        assert_eq!(s.read_range(&h, 0, 10).unwrap(), vec![42u8; 10]);
        assert!(matches!(
            s.read_range(&h, 139_000, 2000),
            Err(StoreError::Corrupt { .. })
        ));
        assert!(!s.contains(&h));
        assert!(!p.exists());
        assert_eq!(fs::read_dir(d.path().join("quarantine")).unwrap().count(), 1);
        assert!(matches!(s.read_range(&h, 0, 10), Err(StoreError::NotFound(_))));
    }

    #[test]
    fn capacity_evicts_unpinned_and_refuses_beyond_pinned() {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path(), 300_000);
        let a = put(&s, &vec![1u8; 100_000], true).unwrap();
        let b = put(&s, &vec![2u8; 100_000], false).unwrap();
        let c = put(&s, &vec![3u8; 100_000], false).unwrap();
        let _ = s.read_range(&b, 0, 1).unwrap(); // b is now more recent than c
        let e = put(&s, &vec![4u8; 100_000], false).unwrap();
        assert!(s.contains(&a) && s.contains(&b) && s.contains(&e));
        assert!(!s.contains(&c), "least recently used unpinned blob evicted");
        s.set_pinned(&b, true).unwrap();
        s.set_pinned(&e, true).unwrap();
        let err = put(&s, &vec![5u8; 100_000], false).unwrap_err();
        assert!(matches!(err, StoreError::Full { .. }), "{err}");
        assert_eq!(s.stats().used, 300_000);
        assert_eq!(s.stats().placeable, 0);
    }

    #[test]
    fn a_verified_blob_is_not_hashed_again_until_its_file_changes() {
        let d = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let s = open(d.path(), 1 << 30);
        let h = put(&s, &data, true).unwrap();
        // Hashed on the way in: the first direct read needs no second pass.
        let path = s.verified_path(&h).unwrap().unwrap();
        assert_eq!(s.whole_hashes(), 0);
        drop(s);
        // Nor after a restart: the stamp is in the index.
        let s = open(d.path(), 1 << 30);
        assert_eq!(s.verified_path(&h).unwrap(), Some(path.clone()));
        assert_eq!(s.whole_hashes(), 0);
        drop(s);
        // A byte changed in place while the node was down changes the file's ctime: the
        // stamp no longer matches, the blob is hashed, fails and is quarantined.
        let mut bytes = fs::read(&path).unwrap();
        bytes[123_456] ^= 1;
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
            .unwrap();
        let s = open(d.path(), 1 << 30);
        assert_eq!(s.verified_path(&h).unwrap(), None);
        assert_eq!(s.whole_hashes(), 1);
        assert_eq!(s.stats().quarantined, 1);
    }

    #[test]
    fn restart_reconciles_index_and_directory() {
        let d = tempfile::tempdir().unwrap();
        let (a, b);
        {
            let s = open(d.path(), 1 << 30);
            a = put(&s, b"first blob", true).unwrap();
            b = put(&s, b"second blob", false).unwrap();
            fs::remove_file(s.path_of(&b).unwrap()).unwrap();
            fs::write(d.path().join("tmp/leftover"), b"partial").unwrap();
        }
        // A verified blob that reached the directory but not the index is adopted.
        let c = BlobHash::of(b"third blob");
        let x = c.to_hex();
        fs::create_dir_all(d.path().join("blobs").join(&x[..2])).unwrap();
        fs::write(d.path().join("blobs").join(&x[..2]).join(&x), b"third blob").unwrap();
        let (s, rep) = BlobStore::open(StoreConfig {
            dirs: vec![d.path().to_path_buf()],
            capacity: 1 << 30,
            reserve: 0,
        })
        .unwrap();
        assert_eq!(
            (rep.indexed, rep.missing, rep.adopted, rep.tmp_removed),
            (2, 1, 1, 1)
        );
        assert!(s.contains(&a) && s.is_pinned(&a));
        assert!(!s.contains(&b));
        assert_eq!(s.read_range(&c, 0, 100).unwrap(), b"third blob");
    }

    #[test]
    fn partial_blobs_fill_chunk_by_chunk_and_survive_restarts() {
        let d = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        let h = BlobHash::of(&data);
        let cs = 1u64 << 16;
        let chunks: Vec<BlobHash> = data.chunks(cs as usize).map(BlobHash::of).collect();
        let piece = |i: u64| &data[(i * cs) as usize..((i + 1) * cs).min(200_000) as usize];
        {
            let s = open(d.path(), 1 << 30);
            s.begin_partial(h, 200_000, 1 << 16, &chunks, true).unwrap();
            assert!(!s.contains(&h), "a partial blob is not a blob yet");
            assert_eq!(s.missing_chunks(&h).unwrap(), vec![0, 1, 2, 3]);
            assert!(!s.write_chunk(&h, 2, piece(2)).unwrap());
            // A wrong chunk is refused and changes nothing.
            assert!(matches!(
                s.write_chunk(&h, 1, piece(2)),
                Err(StoreError::Mismatch { .. })
            ));
            assert_eq!(
                s.read_range(&h, 2 * cs + 5, 10).unwrap(),
                data[(2 * cs + 5) as usize..(2 * cs + 15) as usize]
            );
            match s.read_range(&h, cs, 2 * cs) {
                Err(StoreError::NotPresent { missing, .. }) => assert_eq!(missing, vec![1]),
                other => panic!("{other:?}"),
            }
            assert_eq!(s.stats().used, 200_000, "its space is held");
        }
        // After a restart the chunks already written are still known.
        let s = open(d.path(), 1 << 30);
        assert_eq!(s.missing_chunks(&h).unwrap(), vec![0, 1, 3]);
        assert!(!s.write_chunk(&h, 0, piece(0)).unwrap());
        assert!(!s.write_chunk(&h, 3, piece(3)).unwrap());
        assert!(
            s.write_chunk(&h, 1, piece(1)).unwrap(),
            "the last chunk completes it"
        );
        assert!(s.contains(&h) && s.is_pinned(&h));
        assert_eq!(s.missing_chunks(&h), None);
        assert_eq!(s.read_range(&h, 0, 1 << 30).unwrap(), data);
        assert_eq!(fs::read_dir(d.path().join("partial")).unwrap().count(), 0);
        assert_eq!(s.stats().used, 200_000);
        // Hashed whole as it completed: a direct read needs no second pass, now or after
        // a restart.
        assert!(s.verified_path(&h).unwrap().is_some());
        drop(s);
        let s = open(d.path(), 1 << 30);
        assert!(s.verified_path(&h).unwrap().is_some());
        assert_eq!(s.whole_hashes(), 0);
    }

    #[test]
    fn unpinned_partial_blobs_are_evictable() {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path(), 300_000);
        let data = vec![9u8; 200_000];
        let chunks: Vec<BlobHash> = data.chunks(1 << 16).map(BlobHash::of).collect();
        let h = BlobHash::of(&data);
        s.begin_partial(h, 200_000, 1 << 16, &chunks, false).unwrap();
        let other = put(&s, &vec![3u8; 200_000], true).unwrap();
        assert!(s.contains(&other));
        assert_eq!(s.missing_chunks(&h), None, "the abandoned partial blob made room");
        assert_eq!(fs::read_dir(d.path().join("partial")).unwrap().count(), 0);
    }

    #[test]
    fn refuses_foreign_directories() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("precious.txt"), b"not ours").unwrap();
        let r = BlobStore::open(StoreConfig {
            dirs: vec![d.path().to_path_buf()],
            capacity: 1,
            reserve: 0,
        });
        assert!(matches!(r, Err(StoreError::DataDir { .. })));
    }
}
