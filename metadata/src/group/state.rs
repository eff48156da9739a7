//! The state machine of a member: the catalogue's RocksDB. Each log entry applies as one
//! `WriteBatch` that also records the entry's id (`raft` table, `applied`), so after a
//! crash the store says exactly which entries it holds and the log replays the rest; the
//! store's own writes therefore skip RocksDB's log altogether (`write_unlogged`; the
//! store is opened with atomic flush, and the Raft log flushes it before purging entries).
//!
//! Snapshots are the whole store read at one RocksDB instant (the same reader backups
//! use), written to a file (`DATA_DIR/raft-snapshots/`) that openraft sends to a lagging or
//! new member in 4 MiB pieces. A member installing one replaces every table's rows; the
//! `installing` mark brackets that, and a member that finds it at start refuses to serve
//! half a catalogue (the operator wipes it and it rejoins from a fresh snapshot).

// openraft's StorageError is what its storage traits return; helpers return it too.
#![allow(clippy::result_large_err)]

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot, SnapshotMeta};
use openraft::{
    AnyError, Entry, EntryPayload, LogId, RaftSnapshotBuilder, StorageError, StorageIOError, StoredMembership,
};

use super::{GroupError, Member, TypeConfig};
use crate::store::{Batch, KvStore, RocksStore, Table};

type SErr = StorageError<u64>;
/// The last applied entry and the membership as of it.
type Applied = (Option<LogId<u64>>, StoredMembership<u64, Member>);

const APPLIED: &[u8] = b"applied";
const MEMBERSHIP: &[u8] = b"membership";
const INSTALLING: &[u8] = b"installing";
const MAGIC: &[u8] = b"locus-raft-snapshot-1\n";
/// Rows per batch while a snapshot is installed.
const INSTALL_BATCH_BYTES: usize = 8 << 20;

fn sm_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write_state_machine(AnyError::error(e)).into()
}
fn snap_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write_snapshot(None, AnyError::error(e)).into()
}

pub struct StateMachine {
    store: Arc<RocksStore>,
    dir: PathBuf,
    outside: Arc<AtomicU64>,
}

impl StateMachine {
    pub fn open(store: Arc<RocksStore>, dir: &Path, outside: Arc<AtomicU64>) -> Result<Self, GroupError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| GroupError::State(format!("cannot create {}: {e}", dir.display())))?;
        if store
            .get(Table::Raft, INSTALLING)
            .map_err(|e| GroupError::State(e.to_string()))?
            .is_some()
        {
            return Err(GroupError::State(
                "this member stopped while installing a snapshot, so its catalogue is incomplete; \
                 move its data directory away and start it again: it rejoins the group and \
                 receives a fresh snapshot"
                    .into(),
            ));
        }
        Ok(Self {
            store,
            dir: dir.to_path_buf(),
            outside,
        })
    }

    fn read_state(&self) -> Result<Applied, SErr> {
        let get = |k: &[u8]| self.store.get(Table::Raft, k).map_err(sm_err);
        let applied = match get(APPLIED)? {
            Some(v) => bincode::deserialize(&v).map_err(sm_err)?,
            None => None,
        };
        let membership = match get(MEMBERSHIP)? {
            Some(v) => bincode::deserialize(&v).map_err(sm_err)?,
            None => StoredMembership::default(),
        };
        Ok((applied, membership))
    }

    /// The newest snapshot this member built or received: its meta and data file.
    fn current(&self) -> Option<(SnapshotMeta<u64, Member>, PathBuf)> {
        let meta = std::fs::read(self.dir.join("current.meta")).ok()?;
        let meta: SnapshotMeta<u64, Member> = bincode::deserialize(&meta).ok()?;
        let data = self.dir.join(format!("{}.snap", meta.snapshot_id));
        data.exists().then_some((meta, data))
    }

    fn set_current(&self, meta: &SnapshotMeta<u64, Member>) -> Result<(), SErr> {
        let bytes = bincode::serialize(meta).map_err(snap_err)?;
        let tmp = self.dir.join("current.meta.tmp");
        std::fs::write(&tmp, bytes)
            .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|_| std::fs::rename(&tmp, self.dir.join("current.meta")))
            .map_err(snap_err)?;
        // Older snapshot files are superseded.
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            let keep = format!("{}.snap", meta.snapshot_id);
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                if n.ends_with(".snap") && n != keep {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Builder;

    async fn applied_state(&mut self) -> Result<Applied, SErr> {
        self.read_state()
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut out = Vec::new();
        for e in entries {
            let mut batch = match e.payload {
                EntryPayload::Normal(b) => {
                    if b.ops().any(|op| touches_group_state(&op)) && !is_grant_key_only(&b) {
                        // Only this module writes the raft table; a catalogue batch never does.
                        return Err(sm_err(format!("entry {} writes the group's own state", e.log_id)));
                    }
                    b
                }
                EntryPayload::Blank => Batch::default(),
                EntryPayload::Membership(m) => {
                    let mut b = Batch::default();
                    let stored = StoredMembership::new(Some(e.log_id), m);
                    b.put(
                        Table::Raft,
                        MEMBERSHIP,
                        bincode::serialize(&stored).map_err(sm_err)?,
                    );
                    b
                }
            };
            batch.put(
                Table::Raft,
                APPLIED,
                bincode::serialize(&Some(e.log_id)).map_err(sm_err)?,
            );
            // Without RocksDB's log: the Raft log holds the entry until the state is flushed.
            super::blocking(|| self.store.write_unlogged(batch)).map_err(sm_err)?;
            self.outside.fetch_add(1, Ordering::SeqCst);
            out.push(());
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Builder {
        Builder {
            store: self.store.clone(),
            dir: self.dir.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<tokio::fs::File>, SErr> {
        let path = self.dir.join("receiving.snap");
        let f = tokio::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .await
            .map_err(snap_err)?;
        Ok(Box::new(f))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, Member>,
        snapshot: Box<tokio::fs::File>,
    ) -> Result<(), SErr> {
        snapshot.sync_all().await.map_err(snap_err)?;
        drop(snapshot);
        super::blocking(|| self.install(meta))
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SErr> {
        let Some((meta, path)) = self.current() else {
            return Ok(None);
        };
        let f = tokio::fs::File::open(&path).await.map_err(snap_err)?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(f),
        }))
    }
}

impl StateMachine {
    /// Replaces the whole store with the received snapshot's rows.
    fn install(&self, meta: &SnapshotMeta<u64, Member>) -> Result<(), SErr> {
        let data = self.dir.join(format!("{}.snap", meta.snapshot_id));
        std::fs::rename(self.dir.join("receiving.snap"), &data).map_err(snap_err)?;
        let mut mark = Batch::default();
        mark.put(Table::Raft, INSTALLING, b"1");
        self.store.write(mark, true).map_err(sm_err)?;
        // Every row goes: the snapshot holds the whole state, the raft table included.
        for t in Table::ALL {
            let mut b = Batch::default();
            for kv in self.store.scan(t, b"", None) {
                let (k, _) = kv.map_err(sm_err)?;
                if t == Table::Raft && &*k == INSTALLING {
                    continue;
                }
                b.delete(t, &k);
                if b.len() >= 10_000 {
                    self.store.write(std::mem::take(&mut b), false).map_err(sm_err)?;
                }
            }
            self.store.write(b, false).map_err(sm_err)?;
        }
        let mut r = BufReader::new(std::fs::File::open(&data).map_err(snap_err)?);
        let mut magic = vec![0u8; MAGIC.len()];
        r.read_exact(&mut magic).map_err(snap_err)?;
        if magic != MAGIC {
            return Err(snap_err("the received snapshot is not a Locus snapshot"));
        }
        let mut b = Batch::default();
        let mut bytes = 0usize;
        while let Some((t, k, v)) = read_row(&mut r).map_err(snap_err)? {
            bytes += k.len() + v.len();
            b.put(t, k, v);
            if bytes >= INSTALL_BATCH_BYTES {
                self.store.write(std::mem::take(&mut b), false).map_err(sm_err)?;
                bytes = 0;
            }
        }
        // The snapshot's own `applied` and `membership` rows came with it; the mark goes
        // in the same, synced, batch as the last rows.
        b.delete(Table::Raft, INSTALLING);
        self.store.write(b, true).map_err(sm_err)?;
        self.outside.fetch_add(1, Ordering::SeqCst);
        self.set_current(meta)?;
        Ok(())
    }
}

fn touches_group_state(op: &crate::store::Op) -> bool {
    use crate::store::Op;
    matches!(
        op,
        Op::Put(Table::Raft, ..)
            | Op::Delete(Table::Raft, ..)
            | Op::DeleteRange(Table::Raft, ..)
            | Op::Derive(Table::Raft, _)
    )
}

/// The one write of the group's own state that goes through the log as a batch: the
/// group's grant keys (made by the first leader, replaced by each rotation; `grant_key`
/// is the single key of logs written before key rings).
fn is_grant_key_only(b: &Batch) -> bool {
    use crate::store::Op;
    b.len() == 1
        && matches!(b.ops().next(), Some(Op::Put(Table::Raft, k, _)) if k == b"grant_keys" || k == b"grant_key")
}

pub struct Builder {
    store: Arc<RocksStore>,
    dir: PathBuf,
}

impl RaftSnapshotBuilder<TypeConfig> for Builder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SErr> {
        let (meta, data) = super::blocking(|| self.build())?;
        let f = tokio::fs::File::open(&data).await.map_err(snap_err)?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(f),
        })
    }
}

impl Builder {
    /// Writes the snapshot file and makes it the current one: its meta and path.
    fn build(&self) -> Result<(SnapshotMeta<u64, Member>, PathBuf), SErr> {
        // What was applied is not yet on disk (applies skip RocksDB's log); the log flushes
        // the catalogue before it purges up to this snapshot (`log::LogStore::purge`).
        let tmp = self.dir.join("building.snap");
        let mut w = BufWriter::with_capacity(
            1 << 20,
            Paced::new(std::fs::File::create(&tmp).map_err(snap_err)?),
        );
        w.write_all(MAGIC).map_err(snap_err)?;
        let mut applied: Option<LogId<u64>> = None;
        let mut membership = StoredMembership::<u64, Member>::default();
        // One RocksDB instant for every table: the rows, `applied` and `membership` agree.
        self.store
            .export(&Table::ALL, &mut |t, k, v| {
                if t == Table::Raft {
                    let io = |e: bincode::Error| crate::store::StoreError::Io(e.to_string());
                    if k == APPLIED {
                        applied = bincode::deserialize(v).map_err(io)?;
                    } else if k == MEMBERSHIP {
                        membership = bincode::deserialize(v).map_err(io)?;
                    }
                }
                write_row(&mut w, t, k, v).map_err(|e| crate::store::StoreError::Io(e.to_string()))
            })
            .map_err(snap_err)?;
        w.write_all(&[0xff]).map_err(snap_err)?;
        let f = w.into_inner().map_err(|e| snap_err(e.error()))?.into_inner();
        f.sync_all().map_err(snap_err)?;
        drop(f);
        let id = format!(
            "{}-{}",
            applied.map_or(0, |l| l.index),
            locus_proto::grant::now_ms()
        );
        let data = self.dir.join(format!("{id}.snap"));
        std::fs::rename(&tmp, &data).map_err(snap_err)?;
        let meta = SnapshotMeta {
            last_log_id: applied,
            last_membership: membership,
            snapshot_id: id,
        };
        let sm = StateMachine {
            store: self.store.clone(),
            dir: self.dir.clone(),
            outside: Arc::new(AtomicU64::new(0)),
        };
        sm.set_current(&meta)?;
        Ok((meta, data))
    }
}

/// A file written for a snapshot that sends its bytes to the disk as they are made, so
/// never more than two windows of it are dirty in the page cache.
///
/// Without this the whole snapshot (hundreds of MiB at a few million entries) sits dirty
/// until its closing `sync_all`, and on ext4 an `fdatasync` of the Raft log then waits
/// behind that writeback: followers miss their one-heartbeat deadline for AppendEntries
/// while the leader and a follower both build a snapshot, and with a member down the
/// group cannot confirm its leader.
struct Paced {
    f: std::fs::File,
    /// Bytes written so far.
    written: u64,
    /// Bytes before this offset have been handed to the disk (a multiple of the window).
    started: u64,
}

/// What is handed to the disk at a time.
const PACE_WINDOW: u64 = 8 << 20;

impl Paced {
    fn new(f: std::fs::File) -> Self {
        Self {
            f,
            written: 0,
            started: 0,
        }
    }

    fn into_inner(self) -> std::fs::File {
        self.f
    }

    /// Starts writeback of the window just filled and waits for the one before it.
    #[allow(unsafe_code)]
    fn pace(&mut self) {
        use std::os::fd::AsRawFd;
        let fd = self.f.as_raw_fd();
        let end = self.written - self.written % PACE_WINDOW;
        if end <= self.started {
            return;
        }
        // SAFETY: plain syscalls on a descriptor this struct owns. Their results are
        // advice: a failure leaves the data dirty, and `sync_all` at the end still syncs.
        unsafe {
            libc::sync_file_range(
                fd,
                self.started as i64,
                (end - self.started) as i64,
                libc::SYNC_FILE_RANGE_WRITE,
            );
            if self.started >= PACE_WINDOW {
                libc::sync_file_range(
                    fd,
                    (self.started - PACE_WINDOW) as i64,
                    PACE_WINDOW as i64,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
            }
        }
        self.started = end;
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.f.write(buf)?;
        self.written += n as u64;
        if self.written - self.started >= PACE_WINDOW {
            self.pace();
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.f.flush()
    }
}

fn table_index(t: Table) -> u8 {
    Table::ALL
        .iter()
        .position(|x| *x == t)
        .expect("every table is in ALL") as u8
}

fn write_row(w: &mut impl Write, t: Table, k: &[u8], v: &[u8]) -> std::io::Result<()> {
    w.write_all(&[table_index(t)])?;
    w.write_all(&(k.len() as u32).to_be_bytes())?;
    w.write_all(k)?;
    w.write_all(&(v.len() as u32).to_be_bytes())?;
    w.write_all(v)
}

type SnapRow = (Table, Vec<u8>, Vec<u8>);

fn read_row(r: &mut impl Read) -> std::io::Result<Option<SnapRow>> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut t = [0u8; 1];
    r.read_exact(&mut t)?;
    if t[0] == 0xff {
        return Ok(None);
    }
    let table = *Table::ALL
        .get(t[0] as usize)
        .ok_or_else(|| bad("unknown table in snapshot"))?;
    let read_bytes = |r: &mut dyn Read| -> std::io::Result<Vec<u8>> {
        let mut n = [0u8; 4];
        r.read_exact(&mut n)?;
        let n = u32::from_be_bytes(n) as usize;
        if n > 1 << 30 {
            return Err(bad("row larger than 1 GiB in snapshot"));
        }
        let mut v = vec![0u8; n];
        r.read_exact(&mut v)?;
        Ok(v)
    };
    let k = read_bytes(r)?;
    let v = read_bytes(r)?;
    Ok(Some((table, k, v)))
}

#[cfg(test)]
mod paced_tests {
    use super::*;

    #[test]
    fn a_paced_snapshot_file_holds_every_byte_written_across_its_windows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.snap");
        let data: Vec<u8> = (0..(2 * PACE_WINDOW as usize + 12_345))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut w = BufWriter::with_capacity(1 << 20, Paced::new(std::fs::File::create(&path).unwrap()));
        // Writes of odd sizes, so windows end in the middle of them.
        for piece in data.chunks(777_777) {
            w.write_all(piece).unwrap();
        }
        let paced = w.into_inner().map_err(|e| e.into_error()).unwrap();
        assert_eq!(
            paced.started,
            2 * PACE_WINDOW,
            "every whole window was handed to the disk as it filled"
        );
        paced.into_inner().sync_all().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }
}
