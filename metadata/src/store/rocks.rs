//! The RocksDB backend: one column family per table, batches as `WriteBatch`.

use std::path::Path;

use rocksdb::{
    ColumnFamilyDescriptor, Direction, IteratorMode, Options, ReadOptions, WriteBatch, WriteOptions, DB,
};

use super::{Batch, KvStore, Op, ScanIter, StoreError, Table};

pub struct RocksStore {
    db: DB,
    path: std::path::PathBuf,
}

fn io(e: rocksdb::Error) -> StoreError {
    StoreError::Io(e.into_string())
}

impl RocksStore {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, false)
    }

    /// The store of a group member, whose Raft log is what makes a change durable: its
    /// applies skip RocksDB's own log (`write_unlogged`), so every table is flushed together
    /// (atomic flush). What is on disk after a crash is then the state as of one applied
    /// entry, which the Raft log replays forward from (the log keeps every entry until
    /// the state holding it is flushed: see `group::log`).
    pub fn open_replicated(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, atomic_flush: bool) -> Result<Self, StoreError> {
        let mut opts = Options::default();
        opts.set_atomic_flush(atomic_flush);
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        // Entries dominate: bigger memtables mean fewer flushes during a large import.
        opts.set_write_buffer_size(64 << 20);
        opts.set_max_background_jobs(2);
        opts.set_keep_log_file_num(5);
        // Flushes and compactions hand their files to the disk each MiB rather than all at
        // the end: a 64 MiB memtable flushed in one go makes a member's next Raft-log
        // `fdatasync` wait behind it (ext4 commits the journal for both).
        opts.set_bytes_per_sync(1 << 20);
        let cfs = Table::ALL.iter().map(|t| {
            let mut o = Options::default();
            o.set_compression_type(rocksdb::DBCompressionType::Lz4);
            if *t == Table::Entries {
                o.set_write_buffer_size(64 << 20);
            }
            // Most point reads ask for keys that are not there (an import checks every
            // path it receives for duplicates): bloom filters answer those without
            // searching the memtable's skip list or reading SST blocks.
            let mut table = rocksdb::BlockBasedOptions::default();
            table.set_bloom_filter(10.0, false);
            o.set_block_based_table_factory(&table);
            o.set_memtable_prefix_bloom_ratio(0.05);
            o.set_memtable_whole_key_filtering(true);
            ColumnFamilyDescriptor::new(t.name(), o)
        });
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|e| StoreError::Open {
            path: path.display().to_string(),
            reason: e.into_string(),
        })?;
        Ok(Self {
            db,
            path: path.to_path_buf(),
        })
    }

    /// Writes `batch` without RocksDB's log: durable only once flushed. For a group member's
    /// applies alone (`open_replicated`), whose Raft log holds the entry until then.
    pub fn write_unlogged(&self, batch: Batch) -> Result<(), StoreError> {
        let mut wo = WriteOptions::default();
        wo.disable_wal(true);
        self.write_opt(batch, &wo)
    }

    fn write_opt(&self, batch: Batch, wo: &WriteOptions) -> Result<(), StoreError> {
        let mut wb = WriteBatch::default();
        for op in batch.ops() {
            match op {
                Op::Put(t, k, v) => wb.put_cf(self.cf(t), k, v),
                Op::Delete(t, k) => wb.delete_cf(self.cf(t), k),
                Op::DeleteRange(t, from, to) => wb.delete_range_cf(self.cf(t), from, to),
            }
        }
        self.db.write_opt(wb, wo).map_err(io)
    }

    fn cf(&self, t: Table) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(t.name())
            .expect("every table's column family is created at open")
    }
}

impl KvStore for RocksStore {
    fn get(&self, t: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.db.get_cf(self.cf(t), key).map_err(io)
    }

    fn scan<'a>(&'a self, t: Table, from: &[u8], to: Option<&[u8]>) -> ScanIter<'a> {
        let mut ro = ReadOptions::default();
        if let Some(to) = to {
            ro.set_iterate_upper_bound(to.to_vec());
        }
        let it = self
            .db
            .iterator_cf_opt(self.cf(t), ro, IteratorMode::From(from, Direction::Forward));
        Box::new(it.map(|r| r.map_err(io)))
    }

    fn write(&self, batch: Batch, sync: bool) -> Result<(), StoreError> {
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.write_opt(batch, &wo)
    }

    fn size_on_disk(&self) -> u64 {
        dir_size(&self.path)
    }

    fn flush(&self) -> Result<(), StoreError> {
        // Every table: a log file goes once no table's memtable needs it. The group's own
        // table (the applied entry) first: were a crash to come between two flushes, the
        // state on disk claims no entry that another table does not hold yet, and the Raft
        // log replays the rest.
        let order = std::iter::once(Table::Raft).chain(Table::ALL.into_iter().filter(|t| *t != Table::Raft));
        for t in order {
            self.db.flush_cf(self.cf(t)).map_err(io)?;
        }
        Ok(())
    }

    fn export(&self, tables: &[Table], visit: &mut super::ExportVisitor<'_>) -> Result<(), StoreError> {
        // One RocksDB snapshot pins the sequence number: every column family is read as
        // of the same instant while writers carry on.
        let snap = self.db.snapshot();
        for t in tables {
            let mut ro = ReadOptions::default();
            ro.set_snapshot(&snap);
            // A one-off full scan: do not push the hot working set out of the block cache.
            ro.fill_cache(false);
            for r in self.db.iterator_cf_opt(self.cf(*t), ro, IteratorMode::Start) {
                let (k, v) = r.map_err(io)?;
                visit(*t, &k, &v)?;
            }
        }
        Ok(())
    }
}

fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
