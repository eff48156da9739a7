//! The Raft log of one member: its own RocksDB beside the catalogue's (`DATA_DIR/raft-log`),
//! column family `log` (entry index, big-endian → the entry, bincode) and `meta` (the vote,
//! the committed id, the last purged id).
//!
//! Every append and vote is written with sync: an entry counts towards a quorum only once
//! it is on this member's disk, which is what lets the catalogue's own writes skip syncing.

// openraft's StorageError is what its storage traits return; helpers return it too.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{AnyError, Entry, LogId, RaftLogReader, StorageError, StorageIOError, Vote};
use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};

use super::{GroupError, TypeConfig};

type SErr = StorageError<u64>;

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const PURGED: &[u8] = b"last_purged";

#[derive(Clone)]
pub struct LogStore {
    db: Arc<DB>,
}

fn read_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::read_logs(AnyError::error(e)).into()
}
fn write_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write_logs(AnyError::error(e)).into()
}

impl LogStore {
    pub fn open(path: &Path) -> Result<Self, GroupError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_keep_log_file_num(3);
        let cfs = ["log", "meta"].map(|n| ColumnFamilyDescriptor::new(n, Options::default()));
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|e| GroupError::Log {
            path: path.display().to_string(),
            reason: e.into_string(),
        })?;
        Ok(Self { db: Arc::new(db) })
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db.cf_handle(name).expect("created at open")
    }

    /// No entry was ever appended (a member of a group not yet initialised).
    pub fn is_empty(&self) -> Result<bool, GroupError> {
        let first = self.db.iterator_cf(self.cf("log"), IteratorMode::Start).next();
        let purged = self
            .db
            .get_cf(self.cf("meta"), PURGED)
            .map_err(|e| GroupError::Log {
                path: "raft-log".into(),
                reason: e.into_string(),
            })?;
        Ok(first.is_none() && purged.is_none())
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, SErr> {
        match self.db.get_cf(self.cf("meta"), key).map_err(read_err)? {
            None => Ok(None),
            Some(v) => bincode::deserialize(&v).map(Some).map_err(read_err),
        }
    }

    fn put_meta<T: serde::Serialize>(&self, key: &[u8], v: &T) -> Result<(), SErr> {
        let bytes = bincode::serialize(v).map_err(write_err)?;
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        super::blocking(|| self.db.put_cf_opt(self.cf("meta"), key, bytes, &wo)).map_err(write_err)
    }

    fn last_entry_id(&self) -> Result<Option<LogId<u64>>, SErr> {
        match self.db.iterator_cf(self.cf("log"), IteratorMode::End).next() {
            None => Ok(None),
            Some(r) => {
                let (_, v) = r.map_err(read_err)?;
                let e: Entry<TypeConfig> = bincode::deserialize(&v).map_err(read_err)?;
                Ok(Some(e.log_id))
            }
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i + 1,
            Bound::Unbounded => 0,
        };
        let mut out = Vec::new();
        let it = self.db.iterator_cf(
            self.cf("log"),
            IteratorMode::From(&start.to_be_bytes(), rocksdb::Direction::Forward),
        );
        for r in it {
            let (k, v) = r.map_err(read_err)?;
            let idx = u64::from_be_bytes(k.as_ref().try_into().map_err(read_err)?);
            if !range.contains(&idx) {
                break;
            }
            out.push(bincode::deserialize(&v).map_err(read_err)?);
        }
        Ok(out)
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
        let mut wb = WriteBatch::default();
        for e in entries {
            let v = bincode::serialize(&e).map_err(write_err)?;
            wb.put_cf(self.cf("log"), e.log_id.index.to_be_bytes(), v);
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        let r = super::blocking(|| self.db.write_opt(wb, &wo));
        let done = r
            .as_ref()
            .map(|_| ())
            .map_err(|e| std::io::Error::other(e.to_string()));
        callback.log_io_completed(done);
        r.map_err(write_err)
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        // Entries from log_id.index on conflict with the leader's log: remove them.
        let mut wb = WriteBatch::default();
        wb.delete_range_cf(self.cf("log"), log_id.index.to_be_bytes(), u64::MAX.to_be_bytes());
        wb.delete_cf(self.cf("log"), u64::MAX.to_be_bytes());
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        super::blocking(|| self.db.write_opt(wb, &wo)).map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        // The purge point first: were the deletion to land without it, the log would look
        // like it starts later than it says.
        self.put_meta(PURGED, &log_id)?;
        let mut wb = WriteBatch::default();
        wb.delete_range_cf(
            self.cf("log"),
            0u64.to_be_bytes(),
            (log_id.index + 1).to_be_bytes(),
        );
        self.db.write(wb).map_err(write_err)
    }
}
