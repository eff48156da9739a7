//! The blob store: BLAKE3-addressed blobs on one or more local data directories.
//!
//! Layout of each data dir (format version 2, in `LOCUS_BLOBSTORE`):
//! `blobs/<h[0..2]>/<hash>` complete, verified blobs; `packs/<id>` many small complete
//! blobs in one file (`pack.rs`); `tmp/` blobs and packs being written;
//! `quarantine/<hash>.<ms>` blobs that failed verification; `outboards/<h[0..2]>/<hash>`
//! the BLAKE3 tree of each blob over 1 MiB in `blobs/` (derived data, `outboards.rs`;
//! an earlier build ignores the directory). The first data dir also holds
//! `index/`, a RocksDB map hash → (size, dir, pinned, chunk size, chunk hashes), so a
//! restart reads the index and lists directory names instead of re-hashing every blob.
//!
//! Rules this module never breaks:
//! - a blob becomes visible (renamed into `blobs/`) only after its bytes hashed to its
//!   name, and after the file and its directory were fsynced;
//! - bytes are returned only after the chunk they belong to matched its stored hash; a
//!   blob that fails is moved to `quarantine/` and forgotten;
//! - pinned blobs (this node is a replica of a shard needing them) are never evicted;
//!   space for a write is reserved as its bytes land, evicting unpinned blobs (least
//!   recently used first) when needed, else the write is refused;
//! - the data is private: each data dir is mode 0750 with the readers' group (the local
//!   socket's), `tmp/`, `quarantine/` and the index 0700, so a user who may not ask the
//!   node for a blob cannot read its file either (set again at every start).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use locus_proto::chunks::ChunkKind;
use locus_proto::manifest::hash_file;
use locus_proto::BlobHash;
use prost::Message;

mod batch;
mod datadir;
mod direct;
mod open;
mod outboards;
mod pack;
mod pins;
pub(crate) use pins::unix_secs;
pub(crate) mod read;
mod record;
mod scrub;
mod space;
mod teams;
mod write;

pub use batch::Staged;
use datadir::{check_format, restrict, set_mode};
pub use direct::Block as WriteBlock;
pub use open::indexed_blobs;
pub use outboards::KEEP_ABOVE as OUTBOARD_KEPT_ABOVE;
pub use pack::{read_pack_table, PackRow, PackedWrite};
pub use read::BlobReader;
pub use record::FileStamp;
use record::{stamp, BlobRecord};
use space::Reservation;
pub use teams::{Keep, TeamId, TeamUse};
pub use write::{BlobWriter, Stored};

pub const FORMAT_FILE: &str = "LOCUS_BLOBSTORE";
/// 2: blobs may live in packs (`pack.rs`, index fields 10 and 11). A build of format 1
/// would take every packed blob for missing and fetch it all again, so a store is marked
/// 2 when this build opens it, and format 1 builds refuse it by name.
/// 3: a complete blob of one chunk keeps no chunk list (`BlobRecord::chunks`). A format 2
/// build would drop such records as damaged (and a pack no record names as a stray), so
/// it must refuse the store: marked 3 at the first open by this build. Records written
/// before stay as they are until next rewritten; they load compact.
pub const FORMAT_VERSION: u32 = 3;

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
    /// The group that may read blob files besides the node's user: the local socket's
    /// (whoever may ask the node for a blob's path may read it). None: nobody else.
    pub readers_gid: Option<u32>,
}

#[derive(Debug, Clone)]
struct Meta {
    rec: BlobRecord,
    last_access: u64,
}

/// The blob maps are split by the hash's first byte into this many shards, each behind
/// its own lock, so readers of different blobs (every FUSE read touches the LRU) do not
/// queue behind one another or behind a write's bookkeeping. Hashes are uniform, so the
/// shards fill evenly.
const SHARDS: usize = 16;

/// The blob maps' hasher. Their keys are BLAKE3 hashes, but chosen by whoever imports
/// content, so not an identity hash: foldhash, seeded per process, hashes a key in a few
/// multiplies where SipHash took a fifth of a 10M-blob restart.
type Keyed = foldhash::fast::RandomState;

/// One shard's blobs. Lock order: `evicting` → one shard → `books`; never two shards at
/// once, never a shard while holding `books`.
#[derive(Default)]
struct Shard {
    blobs: HashMap<BlobHash, Meta, Keyed>,
    /// Blobs with only some chunks present (not visible to HaveBlobs or pin sync).
    partials: HashMap<BlobHash, Meta, Keyed>,
    /// When each blob's file was last hashed whole and found intact, as the file's
    /// (inode, ctime) at that moment. Any write to the file changes its ctime, so a
    /// matching stamp means nothing has touched the bytes since (bit rot is the scrub's).
    verified: HashMap<BlobHash, FileStamp, Keyed>,
    /// This shard's unpinned blobs, complete or partial, by team and (last access, hash).
    /// Ticks are global, so the store's least recently used blob is the smallest of the
    /// shards' first entries: choosing a victim costs O(shards × teams + log n), never a
    /// sort.
    lru: teams::Lru,
}

/// Byte counts over all shards. A blob counts by its footprint (`outboards::footprint`:
/// its bytes and its kept outboard), in `used` and `pinned` alike.
#[derive(Default)]
struct Books {
    used: u64,
    pinned: u64,
    /// Bytes reserved by writes in progress.
    reserved: u64,
    quarantined: u64,
    /// Unpinned bytes per team id (`teams.rs`; 0: untagged).
    team_cached: Vec<u64>,
}

impl Books {
    fn add(&mut self, size: u64, pinned: bool, team: TeamId) {
        let f = outboards::footprint(size);
        self.used += f;
        if pinned {
            self.pinned += f;
        } else {
            *self.cached_of(team) += f;
        }
    }

    fn remove(&mut self, size: u64, pinned: bool, team: TeamId) {
        let f = outboards::footprint(size);
        self.used -= f;
        if pinned {
            self.pinned -= f;
        } else {
            *self.cached_of(team) -= f;
        }
    }

    fn cached_of(&mut self, team: TeamId) -> &mut u64 {
        let i = team.0 as usize;
        if self.team_cached.len() <= i {
            self.team_cached.resize(i + 1, 0);
        }
        &mut self.team_cached[i]
    }

    /// Adds another count's figures (the index loaders' partial books).
    fn merge(&mut self, o: Books) {
        self.used += o.used;
        self.pinned += o.pinned;
        for (i, c) in o.team_cached.into_iter().enumerate() {
            *self.cached_of(TeamId(i as u16)) += c;
        }
    }
}

impl BlobRecord {
    fn team_id(&self) -> TeamId {
        TeamId(self.team as u16)
    }
}

impl Shard {
    /// Records that a blob that was just added to `blobs` or `partials` may be evicted.
    fn track(&mut self, h: BlobHash, m: &Meta) {
        if !m.rec.pinned {
            self.lru.insert(m.rec.team_id(), (m.last_access, h));
        }
    }

    /// Forgets a blob's place in the eviction order (it was removed or pinned).
    fn untrack(&mut self, h: BlobHash, m: &Meta) {
        self.lru.remove(m.rec.team_id(), &(m.last_access, h));
    }

    /// Marks a blob (complete or partial) used at `tick`.
    fn touch(&mut self, h: &BlobHash, tick: u64) {
        let Shard {
            blobs, partials, lru, ..
        } = self;
        let Some(m) = blobs.get_mut(h).or_else(|| partials.get_mut(h)) else {
            return;
        };
        if !m.rec.pinned && lru.remove(m.rec.team_id(), &(m.last_access, *h)) {
            lru.insert(m.rec.team_id(), (tick, *h));
        }
        m.last_access = tick;
    }
}

/// What a restart found: `open` fills `indexed`, `tmp_removed` and the quarantine's
/// count; `check_dirs`, the walk of the blob directories, `missing`, `adopted` and the
/// strays it quarantined.
#[derive(Debug, Default, Clone)]
pub struct Reconcile {
    pub indexed: usize,
    /// In the index, missing on disk: dropped from the index.
    pub missing: usize,
    /// On disk, not in the index (a crash between rename and index write): verified and
    /// adopted, or quarantined.
    pub adopted: usize,
    pub quarantined: usize,
    /// Leftover partial writes removed from tmp/, and packs no index record names that
    /// held no blob to adopt.
    pub tmp_removed: usize,
    /// Outboards whose blob is not in the index in their data dir (a crash between the
    /// outboard's rename and the blob's, or a blob an earlier build evicted): removed.
    pub stray_outboards: usize,
}

/// Where a complete blob's bytes are: its own file, or a range of a pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub path: PathBuf,
    /// Where the blob starts in the file (0 unless packed).
    pub offset: u64,
    /// In a pack: the file holds other blobs too, so only `[offset, offset + size)` of it
    /// is this blob (never hand the whole file to the kernel as the blob's).
    pub packed: bool,
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
    shards: Vec<Mutex<Shard>>,
    books: Mutex<Books>,
    /// Held by a reservation from its check of the books to its last eviction, so two
    /// writes cannot both count the same evictable bytes.
    evicting: Mutex<()>,
    /// The teams blobs are cached for (`teams.rs`). Lock order: before `books`.
    teams: Mutex<teams::Teams>,
    tick: AtomicU64,
    /// Live blobs per pack. Lock order: after a shard and `books`' callers, never before.
    packs: Mutex<pack::Packs>,
    /// Blobs hashed whole by `verify` (scrub and first direct reads) since open.
    whole_hashes: AtomicU64,
    /// Woken whenever a blob is quarantined, so the owner can refetch it at once.
    pub quarantine_events: tokio::sync::Notify,
    /// When this process opened the store: a blob file older than this that the index
    /// does not name was left by a crash; a newer one is a write of this process.
    opened: std::time::SystemTime,
}

fn hex(h: &BlobHash) -> String {
    h.to_hex()
}

/// Free bytes on the filesystem holding `p`.
pub fn fs_free(p: &Path) -> Option<u64> {
    fs_space(p).map(|(free, _)| free)
}

/// (free to unprivileged users, total) bytes of the filesystem holding `p`.
pub fn fs_space(p: &Path) -> Option<(u64, u64)> {
    let st = nix::sys::statvfs::statvfs(p).ok()?;
    Some((
        st.blocks_available() * st.fragment_size(),
        st.blocks() * st.fragment_size(),
    ))
}

/// A poisoned lock still guards consistent maps: every critical section here only
/// updates maps and counters, and a panic in one leaves at worst a stale LRU entry.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
            for sub in ["blobs", pack::PACKS, "tmp", "quarantine", "partial", "outboards"] {
                fs::create_dir_all(d.join(sub)).map_err(|e| StoreError::DataDir {
                    path: d.display().to_string(),
                    reason: e.to_string(),
                })?;
            }
            restrict(d, cfg.readers_gid)?;
        }
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        let index_dir = cfg.dirs[0].join("index");
        let index = rocksdb::DB::open(&opts, &index_dir).map_err(|e| StoreError::Index(e.into_string()))?;
        set_mode(&index_dir, 0o700)?;
        let teams = Mutex::new(teams::Teams::load(&index));
        let store = Arc::new(BlobStore {
            cfg,
            teams,
            index,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            books: Mutex::default(),
            evicting: Mutex::new(()),
            tick: AtomicU64::new(1),
            packs: Mutex::default(),
            whole_hashes: AtomicU64::new(0),
            quarantine_events: tokio::sync::Notify::new(),
            opened: std::time::SystemTime::now(),
        });
        let report = store.reconcile()?;
        Ok((store, report))
    }

    fn shard(&self, h: &BlobHash) -> MutexGuard<'_, Shard> {
        lock(&self.shards[usize::from(h.0[0]) % SHARDS])
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        lock(&self.books)
    }

    /// Every stored blob (complete or partial) with its record, one shard at a time.
    fn each_meta(&self, mut f: impl FnMut(&BlobHash, &Meta, bool)) {
        for sh in &self.shards {
            let sh = lock(sh);
            sh.blobs.iter().for_each(|(h, m)| f(h, m, false));
            sh.partials.iter().for_each(|(h, m)| f(h, m, true));
        }
    }

    pub fn blob_path_in(&self, dir: u32, h: &BlobHash) -> PathBuf {
        let x = hex(h);
        self.cfg.dirs[dir as usize].join("blobs").join(&x[..2]).join(x)
    }

    fn partial_path_in(&self, dir: u32, h: &BlobHash) -> PathBuf {
        self.cfg.dirs[dir as usize].join("partial").join(hex(h))
    }

    /// Publishes a complete blob (`rec` from `BlobRecord::complete`).
    fn insert(&self, h: BlobHash, rec: BlobRecord) -> Result<(), StoreError> {
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        self.remember(h, rec);
        Ok(())
    }

    /// Makes a complete blob whose record is in the index visible to readers.
    fn remember(&self, h: BlobHash, rec: BlobRecord) {
        let (size, pinned, team, verified) = (
            rec.size,
            rec.pinned,
            rec.team_id(),
            rec.verified.as_ref().map(FileStamp::from),
        );
        let mut sh = self.shard(&h);
        match verified {
            Some(v) => sh.verified.insert(h, v),
            None => sh.verified.remove(&h),
        };
        let m = Meta {
            rec,
            last_access: self.tick.fetch_add(1, Ordering::Relaxed),
        };
        sh.track(h, &m);
        let old = sh.blobs.insert(h, m);
        if let Some(old) = &old {
            sh.untrack(h, old);
        }
        let mut b = self.books();
        if let Some(old) = &old {
            b.remove(old.rec.size, old.rec.pinned, old.rec.team_id());
        }
        b.add(size, pinned, team);
        drop(b);
        drop(sh);
        // The same blob stored twice at once (two batches racing): the older copy's
        // pack no longer holds it.
        if let Some(old) = old.filter(|o| o.rec.pack != 0) {
            self.release_and_remove(old.rec.pack);
        }
    }

    /// `release_packed`, removing the pack's file when that was its last blob.
    fn release_and_remove(&self, pack: u64) {
        if let Some(p) = self.release_packed(pack) {
            let _ = fs::remove_file(p);
        }
    }

    pub fn contains(&self, h: &BlobHash) -> bool {
        self.shard(h).blobs.contains_key(h)
    }

    /// Where a present blob's bytes are (for same-host readers), marking it recently used.
    pub fn locate(&self, h: &BlobHash) -> Option<Located> {
        let mut sh = self.shard(h);
        let at = self.location(h, &sh.blobs.get(h)?.rec);
        sh.touch(h, self.tick.fetch_add(1, Ordering::Relaxed));
        Some(at)
    }

    /// The file and offset of a complete blob with record `rec`.
    fn location(&self, h: &BlobHash, rec: &BlobRecord) -> Located {
        if rec.pack != 0 {
            Located {
                path: self.pack_path_in(rec.dir, rec.pack),
                offset: rec.offset,
                packed: true,
            }
        } else {
            Located {
                path: self.blob_path_in(rec.dir, h),
                offset: 0,
                packed: false,
            }
        }
    }

    /// Size of a blob that is here, completely or partly.
    pub fn size_of(&self, h: &BlobHash) -> Option<u64> {
        let sh = self.shard(h);
        sh.blobs.get(h).or_else(|| sh.partials.get(h)).map(|m| m.rec.size)
    }

    pub fn chunk_size_of(&self, h: &BlobHash) -> Option<u64> {
        let sh = self.shard(h);
        sh.blobs
            .get(h)
            .or_else(|| sh.partials.get(h))
            .map(|m| u64::from(m.rec.chunk_size))
    }

    /// Chunks of a partly present blob that are still missing; None if the blob is not
    /// partly here (it is complete, or absent).
    pub fn missing_chunks(&self, h: &BlobHash) -> Option<Vec<u64>> {
        self.shard(h).partials.get(h).map(|m| m.rec.missing())
    }

    /// Every stored blob's hash (for scrub and tests).
    pub fn hashes(&self) -> Vec<BlobHash> {
        let mut out = Vec::new();
        self.each_meta(|h, _, partial| {
            if !partial {
                out.push(*h);
            }
        });
        out
    }

    /// Each data dir with its file system's free and total bytes (for metrics).
    pub fn dir_space(&self) -> Vec<(String, u64, u64)> {
        self.cfg
            .dirs
            .iter()
            .filter_map(|d| fs_space(d).map(|(free, size)| (d.display().to_string(), free, size)))
            .collect()
    }

    pub fn stats(&self) -> Stats {
        // statvfs before any lock: a slow filesystem must not hold up every reader.
        let disk_free: u64 = self
            .cfg
            .dirs
            .iter()
            .filter_map(|d| fs_free(d))
            .map(|f| f.saturating_sub(self.cfg.reserve))
            .sum();
        let blobs: usize = self.shards.iter().map(|s| lock(s).blobs.len()).sum();
        let b = self.books();
        let cached = b.used - b.pinned;
        let placeable = self
            .cfg
            .capacity
            .saturating_sub(b.pinned + b.reserved)
            .min(disk_free + cached);
        Stats {
            capacity: self.cfg.capacity,
            used: b.used,
            pinned: b.pinned,
            cached,
            blobs: blobs as u64,
            quarantined: b.quarantined,
            placeable,
        }
    }

    fn corrupt(&self, h: &BlobHash, path: &Path, what: String) -> StoreError {
        tracing::error!(blob = %h, "{what}; quarantining");
        let packed = self
            .shard(h)
            .blobs
            .get(h)
            .filter(|m| m.rec.pack != 0)
            .map(|m| (m.rec.offset, m.rec.size));
        match packed {
            Some((offset, size)) => self.copy_to_quarantine(path, offset, size, h),
            None => self.move_to_quarantine(path, h),
        }
        self.forget(h);
        self.books().quarantined += 1;
        self.quarantine_events.notify_one();
        StoreError::Corrupt { hash: *h, what }
    }

    /// Where blob `h`, now in the file at `path`, is set aside: the quarantine of the data
    /// dir the file lives in, so a rename never crosses devices.
    fn quarantine_dest(&self, path: &Path, h: &BlobHash) -> PathBuf {
        self.cfg
            .dirs
            .iter()
            .find(|d| path.starts_with(d))
            .unwrap_or(&self.cfg.dirs[0])
            .join("quarantine")
            .join(format!("{}.{}", hex(h), now_ms()))
    }

    fn move_to_quarantine(&self, path: &Path, h: &BlobHash) {
        let dest = self.quarantine_dest(path, h);
        if fs::rename(path, &dest).is_err() {
            let _ = fs::remove_file(path);
        }
    }

    fn forget(&self, h: &BlobHash) {
        let mut sh = self.shard(h);
        sh.verified.remove(h);
        let removed = sh.blobs.remove(h).or_else(|| sh.partials.remove(h));
        if let Some(m) = &removed {
            sh.untrack(*h, m);
            self.books().remove(m.rec.size, m.rec.pinned, m.rec.team_id());
        }
        drop(sh);
        let _ = self.index.delete(h.0);
        if let Some(m) = removed.as_ref().filter(|m| m.rec.pack == 0 && !m.rec.partial) {
            Self::remove_outboard_of(&self.blob_path_in(m.rec.dir, h));
        }
        if let Some(m) = removed.filter(|m| m.rec.pack != 0) {
            self.release_and_remove(m.rec.pack);
        }
    }
}

/// The chunk size a blob is kept at: 0 means the default; anything else must be a power
/// of two in the range versions allow. A tiny chunk size would make the index hold a hash
/// per few bytes, so it is refused rather than trusted.
/// What the store does with an index value when it opens: decode it, check it, and use
/// its chunk list and presence bits. For the fuzz target (`fuzz/`), which feeds it any
/// bytes: none may panic.
pub fn check_index_record(v: &[u8]) -> Result<(u64, usize), String> {
    let rec = BlobRecord::decode_checked(v)?;
    let missing = rec.missing();
    Ok((rec.chunk_count(), missing.len()))
}

fn hex_lossy(k: &[u8]) -> String {
    k.iter().take(32).map(|b| format!("{b:02x}")).collect()
}

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

#[cfg(test)]
mod tests;
