//! The RocksDB backend: one column family per table, batches as `WriteBatch`; a long sorted
//! run of puts into one table is written as a table file and ingested, ahead of the rest of
//! its batch where that is safe (`write`, `write_unlogged`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rocksdb::{
    ColumnFamilyDescriptor, Direction, IngestExternalFileOptions, IteratorMode, Options, ReadOptions,
    SstFileWriter, WriteBatch, WriteOptions, DB,
};

use super::{Batch, Derived, KvStore, Op, ScanIter, StoreError, Table};

/// Puts below this many go through the memtable even when sorted: a table file per small
/// batch would leave level 0 full of tiny files for compaction to merge.
pub const INGEST_AT_LEAST: usize = 4096;

pub struct RocksStore {
    db: DB,
    path: PathBuf,
    /// Where sorted runs are written before RocksDB takes them in (`ingest/` in the store).
    staging: PathBuf,
    staged: AtomicU64,
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
        let cfs = Table::ALL
            .iter()
            .map(|t| ColumnFamilyDescriptor::new(t.name(), table_options(*t)));
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|e| StoreError::Open {
            path: path.display().to_string(),
            reason: e.into_string(),
        })?;
        // Files staged for ingestion by a process that stopped before RocksDB took them are
        // not part of the store: whatever wrote them is replayed or retried.
        let staging = path.join("ingest");
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|e| StoreError::Open {
            path: staging.display().to_string(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            db,
            path: path.to_path_buf(),
            staging,
            staged: AtomicU64::new(0),
        })
    }

    /// Writes `batch` without RocksDB's log: durable only once flushed. For a group member's
    /// applies alone (`open_replicated`), whose Raft log holds the entry until then.
    ///
    /// Any long sorted run of puts into one table goes in as a table file ahead of the
    /// rest of the batch (a manifest page's entries), and so do a derived change's deletes
    /// (a version's index rows): should the member crash between the two, it replays the
    /// entry from its log, computes the same changes from the same rows, and makes them
    /// again.
    pub fn write_unlogged(&self, batch: Batch) -> Result<(), StoreError> {
        let mut wo = WriteOptions::default();
        wo.disable_wal(true);
        let run = sorted_run(&batch, |_| true);
        self.write_opt(batch, &wo, run, true)
    }

    /// `deletes_first`: a derived change's deletes may go in as a table file ahead of the
    /// rest (a replayed apply); else they stay in the batch, which is atomic — a version
    /// whose index rows were gone while its record stayed would lose its replicas.
    fn write_opt(
        &self,
        batch: Batch,
        wo: &WriteOptions,
        run: Option<Table>,
        deletes_first: bool,
    ) -> Result<(), StoreError> {
        let mut wb = WriteBatch::default();
        // Derived changes first, from the rows earlier batches stored (`Op::Derive`).
        for op in batch.ops() {
            if let Op::Derive(t, what) = op {
                match super::derived(self, t, what)? {
                    Derived::Put(rows) if rows.len() >= INGEST_AT_LEAST => {
                        self.ingest(t, rows.iter().map(|(k, v)| (&k[..], Some(&v[..]))))?
                    }
                    Derived::Put(rows) => {
                        for (k, v) in &rows {
                            wb.put_cf(self.cf(t), k, v);
                        }
                    }
                    Derived::Delete(keys) if deletes_first && keys.len() >= INGEST_AT_LEAST => {
                        self.ingest(t, keys.iter().map(|k| (&k[..], None)))?
                    }
                    Derived::Delete(keys) => {
                        for k in &keys {
                            wb.delete_cf(self.cf(t), k);
                        }
                    }
                }
            }
        }
        let ingested = match run {
            Some(t) => {
                let puts = batch.ops().filter_map(|op| match op {
                    Op::Put(u, k, v) if u == t => Some((k, Some(v))),
                    _ => None,
                });
                self.ingest(t, puts)?;
                Some(t)
            }
            None => None,
        };
        for op in batch.ops() {
            if ingested.is_some_and(|t| op.table() == t) {
                continue;
            }
            match op {
                Op::Derive(..) => {}
                Op::Put(t, k, v) => wb.put_cf(self.cf(t), k, v),
                Op::Delete(t, k) => wb.delete_cf(self.cf(t), k),
                Op::DeleteRange(t, from, to) => wb.delete_range_cf(self.cf(t), from, to),
            }
        }
        if ingested.is_some() && wb.is_empty() {
            return Ok(());
        }
        self.db.write_opt(wb, wo).map_err(io)
    }

    /// Writes `rows` (ascending keys; a row without a value is a delete) into table `t` as
    /// one table file and hands it to RocksDB, which links it into the tree without a
    /// memtable: for
    /// keys in random order (the blob → shard index, keyed by hash) that is a sequential
    /// write where a memtable insert searches a skip list of a million keys per row.
    ///
    /// Atomic on its own (RocksDB ingests a file whole, durably, and gives it one sequence
    /// number); the rest of the batch is written after it: a group member's `applied`
    /// mark, or what a derived change came with (a session's progress, a commit). Should a
    /// crash fall between the two, a member replays the entry and a single service's
    /// caller retries; putting the same rows again changes nothing, and rows of a session
    /// belong to no version until its commit is written.
    fn ingest<'a>(
        &self,
        t: Table,
        rows: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) -> Result<(), StoreError> {
        let opts = table_options(t);
        let mut w = SstFileWriter::create(&opts);
        let file = self.staging.join(format!(
            "{}-{}.sst",
            t.name(),
            self.staged.fetch_add(1, Ordering::Relaxed)
        ));
        w.open(&file).map_err(io)?;
        let written = (|| {
            for (k, v) in rows {
                match v {
                    Some(v) => w.put(k, v)?,
                    None => w.delete(k)?,
                }
            }
            w.finish()
        })();
        let ingested = written.and_then(|()| {
            let mut io = IngestExternalFileOptions::default();
            // Linked, not copied: the file was written for this and nothing else reads it.
            io.set_move_files(true);
            self.db.ingest_external_file_cf_opts(self.cf(t), &io, vec![&file])
        });
        let _ = std::fs::remove_file(&file);
        ingested.map_err(io)
    }

    /// Rows in a table's active memtable (what went in through `WriteBatch`, not ingested).
    #[cfg(test)]
    pub(crate) fn memtable_rows(&self, t: Table) -> u64 {
        self.db
            .property_int_value_cf(self.cf(t), "rocksdb.num-entries-active-mem-table")
            .ok()
            .flatten()
            .unwrap_or(0)
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
        // A run may land ahead of the rest only where nothing else is in the batch (but a
        // member's marks), or where the writer says a crash between is harmless.
        let first = batch.may_ingest_first();
        let run = sorted_run(&batch, |t| Some(t) == first)
            .or_else(|| sorted_run(&batch, |_| true).filter(|t| only_run_and_marks(&batch, *t)));
        self.write_opt(batch, &wo, run, false)
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

/// One table's column-family options, at open and for the table files `ingest` writes.
fn table_options(t: Table) -> Options {
    let mut o = Options::default();
    o.set_compression_type(rocksdb::DBCompressionType::Lz4);
    if t == Table::Entries {
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
    o
}

/// A table, among those `may` allows, whose changes in this batch are all puts, at least
/// `INGEST_AT_LEAST` of them, in strictly ascending key order. Never the group's own
/// marks (`Table::Raft`), which are what says how far a member got.
fn sorted_run(batch: &Batch, may: impl Fn(Table) -> bool) -> Option<Table> {
    if batch.len() < INGEST_AT_LEAST {
        return None;
    }
    // (puts so far, the last key, still a run) per table.
    let mut runs: [(usize, Option<&[u8]>, bool); Table::ALL.len()] = [(0, None, true); Table::ALL.len()];
    for op in batch.ops() {
        let r = &mut runs[op.table() as usize];
        match op {
            Op::Put(_, k, _) if r.2 && r.1.is_none_or(|l| l < k) => {
                r.0 += 1;
                r.1 = Some(k);
            }
            _ => r.2 = false,
        }
    }
    Table::ALL.into_iter().find(|t| {
        *t != Table::Raft && may(*t) && runs[*t as usize].2 && runs[*t as usize].0 >= INGEST_AT_LEAST
    })
}

/// Whether `batch` holds nothing but its run of `t` and puts of the group's own marks.
fn only_run_and_marks(batch: &Batch, t: Table) -> bool {
    batch
        .ops()
        .all(|op| op.table() == t || matches!(op, Op::Put(Table::Raft, ..)))
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
