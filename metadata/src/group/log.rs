//! The Raft log of one member (`DATA_DIR/raft-log`): entries in append-only segment files
//! (`segments/`), and the vote, the committed id and the last purged id in a small RocksDB
//! beside them (column family `meta`).
//!
//! Every append and vote is written with sync: an entry counts towards a quorum only once
//! it is on this member's disk, which is what lets the catalogue's own writes skip syncing.
//!
//! Why segments and not RocksDB: a manifest page is one entry of several MiB, and a log
//! entry is written once, read back while it is replicated and deleted soon after. In
//! RocksDB each entry went through the WAL (with a software CRC), a memtable, a flush to
//! an SST (compressed) and a compaction — four copies of every page on every member, which
//! made a follower of a 3,000,000-entry upload spend more CPU than a whole single service.
//! A segment costs one `write` and one `fdatasync` per append.
//!
//! A segment is named by the index of its first entry (`{index:020}.seg`) and holds
//! consecutive entries, each a record: length (u32 LE), index (u64 LE), the first 8 bytes
//! of the BLAKE3 hash of index and payload, then the entry (bincode). A segment past
//! `SEGMENT_BYTES` is closed and the next append opens a new one. Truncation cuts the
//! segment holding the first entry to drop and deletes the later ones; a purge deletes
//! the segments that hold only purged entries. At open every record is checked: a torn
//! record at the end of the last segment (an append that never returned) is cut off, any
//! other damage refuses to start the member, naming the file and offset. A log written by
//! older builds (entries in RocksDB's `log` column family) is moved into segments at open.
//!
//! The segment files themselves (appends, reads, cuts, deletions, the entries kept in
//! memory after their append) are `group::segments`; this module puts openraft's storage
//! traits, the vote and the purge point on top.

// openraft's StorageError is what its storage traits return; helpers return it too.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, Mutex};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{AnyError, Entry, LogId, RaftLogReader, StorageError, StorageIOError, Vote};
use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};

use super::segments::{record, record_of, Appended, Segments, SEGMENT_BYTES};
use super::{GroupError, TypeConfig};
use crate::store::{KvStore, RocksStore};

type SErr = StorageError<u64>;

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const PURGED: &[u8] = b"last_purged";

#[derive(Clone)]
pub struct LogStore {
    meta: Arc<DB>,
    /// The catalogue this log feeds: its applies skip RocksDB's log, so an entry may be
    /// purged only once the state holding it is flushed.
    state: Arc<RocksStore>,
    segs: Arc<Mutex<Segments>>,
}

fn read_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::read_logs(AnyError::error(e)).into()
}
fn write_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write_logs(AnyError::error(e)).into()
}

impl LogStore {
    pub fn open(path: &Path, state: Arc<RocksStore>) -> Result<Self, GroupError> {
        Self::open_rolling_at(path, state, SEGMENT_BYTES)
    }

    fn open_rolling_at(path: &Path, state: Arc<RocksStore>, roll: u64) -> Result<Self, GroupError> {
        let fail = |reason: String| GroupError::Log {
            path: path.display().to_string(),
            reason,
        };
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_keep_log_file_num(3);
        let cfs = ["log", "meta"].map(|n| ColumnFamilyDescriptor::new(n, Options::default()));
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|e| fail(e.into_string()))?;
        let purged: Option<LogId<u64>> = match db.get_cf(db.cf_handle("meta").expect("created"), PURGED) {
            Ok(None) => None,
            Ok(Some(v)) => Some(
                bincode::deserialize::<LogId<u64>>(&v)
                    .map_err(|e| fail(format!("the purge point cannot be decoded: {e}")))?,
            ),
            Err(e) => return Err(fail(e.into_string())),
        };
        let dir = path.join("segments");
        let mut segs = Segments::load(&dir, purged.map(|p| p.index), roll).map_err(&fail)?;
        migrate(&db, &mut segs, purged.map(|p| p.index)).map_err(fail)?;
        Ok(Self {
            meta: Arc::new(db),
            state,
            segs: Arc::new(Mutex::new(segs)),
        })
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.meta.cf_handle(name).expect("created at open")
    }

    fn segs(&self) -> std::sync::MutexGuard<'_, Segments> {
        self.segs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No entry was ever appended (a member of a group not yet initialised).
    pub fn is_empty(&self) -> Result<bool, GroupError> {
        let purged = self
            .meta
            .get_cf(self.cf("meta"), PURGED)
            .map_err(|e| GroupError::Log {
                path: "raft-log".into(),
                reason: e.into_string(),
            })?;
        Ok(self.segs().held.is_empty() && purged.is_none())
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, SErr> {
        match self.meta.get_cf(self.cf("meta"), key).map_err(read_err)? {
            None => Ok(None),
            Some(v) => bincode::deserialize(&v).map(Some).map_err(read_err),
        }
    }

    fn put_meta<T: serde::Serialize>(&self, key: &[u8], v: &T) -> Result<(), SErr> {
        let bytes = bincode::serialize(v).map_err(write_err)?;
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        super::blocking(|| self.meta.put_cf_opt(self.cf("meta"), key, bytes, &wo)).map_err(write_err)
    }

    fn last_entry_id(&self) -> Result<Option<LogId<u64>>, SErr> {
        let mut s = self.segs();
        if s.last.is_none() && !s.held.is_empty() {
            // After a truncation: the entry now last.
            let i = s.first + s.held.len() as u64 - 1;
            let e = super::blocking(|| s.read(i, i + 1)).map_err(read_err)?;
            s.last = e.first().map(|e| e.log_id);
        }
        Ok(s.last)
    }
}

/// Moves a log kept in RocksDB (older builds) into segments, then deletes it there.
fn migrate(db: &DB, segs: &mut Segments, purged: Option<u64>) -> Result<(), String> {
    let cf = db.cf_handle("log").expect("created");
    let mut moved = Vec::new();
    let mut batch = Vec::new();
    for r in db.iterator_cf(cf, IteratorMode::Start) {
        let (k, v) = r.map_err(|e| e.into_string())?;
        let e: Entry<TypeConfig> = bincode::deserialize(&v)
            .map_err(|e| format!("an entry of the old log cannot be decoded: {e}"))?;
        moved.push(k.to_vec());
        // A purge that stopped before deleting its entries: they stay deleted. A move
        // that stopped before deleting them: the segments hold them already.
        let held_to = segs.first + segs.held.len() as u64;
        if purged.is_some_and(|p| e.log_id.index <= p) || (!segs.held.is_empty() && e.log_id.index < held_to)
        {
            continue;
        }
        batch.push(Appended {
            id: e.log_id,
            record: record(e.log_id.index, &v),
            entry: None,
        });
        if batch.len() >= 64 {
            segs.append(std::mem::take(&mut batch))
                .map_err(|e| e.to_string())?;
        }
    }
    if moved.is_empty() {
        return Ok(());
    }
    segs.append(batch).map_err(|e| e.to_string())?;
    let mut wb = WriteBatch::default();
    for k in &moved {
        wb.delete_cf(cf, k);
    }
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    db.write_opt(wb, &wo).map_err(|e| e.into_string())?;
    tracing::info!(
        entries = moved.len(),
        "moved the Raft log from RocksDB into segment files"
    );
    Ok(())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let from = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i + 1,
            Bound::Unbounded => 0,
        };
        let to = match range.end_bound() {
            Bound::Included(i) => i.saturating_add(1),
            Bound::Excluded(i) => *i,
            Bound::Unbounded => u64::MAX,
        };
        super::blocking(|| self.segs().read(from, to)).map_err(read_err)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SErr> {
        let purged: Option<LogId<u64>> = self.get_meta(PURGED)?;
        let last = self.last_entry_id()?.or(purged);
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        self.put_meta(VOTE, vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        self.get_meta(VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        self.put_meta(COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SErr> {
        Ok(self.get_meta::<Option<LogId<u64>>>(COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut records = Vec::new();
        for e in entries {
            records.push(Appended {
                id: e.log_id,
                record: record_of(&e).map_err(write_err)?,
                entry: Some(e),
            });
        }
        let r = super::blocking(|| self.segs().append(records));
        let done = r
            .as_ref()
            .map(|_| ())
            .map_err(|e| std::io::Error::new(e.kind(), e.to_string()));
        callback.log_io_completed(done);
        r.map_err(write_err)
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        // Entries from log_id.index on conflict with the leader's log: remove them.
        super::blocking(|| self.segs().truncate(log_id.index)).map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        // The state first: after a crash the log must still hold every entry after the
        // last one the state has on disk.
        super::blocking(|| self.state.flush()).map_err(write_err)?;
        // The purge point next: were the deletion to land without it, the log would look
        // like it starts later than it says.
        self.put_meta(PURGED, &log_id)?;
        super::blocking(|| self.segs().drop_purged(log_id.index)).map_err(write_err)
    }
}

#[cfg(test)]
#[path = "log_tests.rs"]
mod tests;
