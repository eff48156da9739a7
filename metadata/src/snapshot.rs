//! The catalogue export a backup stores (`snapshots/<id>/catalog`), how it is read back
//! into an empty store on restore, and the blob plan a backup run derives from it.
//!
//! Format version 1 (documented in docs/architecture.md "Backups"):
//!
//! ```text
//! "LOCUS-CATALOG\n" | format u32 BE (1) | schema version u32 BE
//! records:  0x01 | name len u8 | table name          -- rows that follow belong here
//!           0x02 | key len u32 BE | key | value len u32 BE | value
//! trailer:  0xFF | rows u64 BE | BLAKE3 of every byte before these 32
//! ```
//!
//! Rows are the store's own keys and values (protobuf records, `records.rs`), so a
//! restore is a byte-for-byte copy. The `sessions` table and every row of an open import
//! session are left out: a snapshot holds committed versions only.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};

use locus_proto::manifest::BlobHash;
use prost::Message;

use crate::keys;
use crate::records::{ShardRecord, VersionRecord, SCHEMA_VERSION};
use crate::store::{Batch, KvStore, StoreError, Table};

pub const MAGIC: &[u8; 14] = b"LOCUS-CATALOG\n";
pub const FORMAT_VERSION: u32 = 1;
const TAG_TABLE: u8 = 1;
const TAG_ROW: u8 = 2;
const TAG_END: u8 = 0xFF;
/// Larger keys or values than this are damage, not data.
const MAX_FIELD: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("catalog export: {0}")]
    Io(#[from] std::io::Error),
    #[error("catalog export is damaged: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Incompatible(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub type Result<T, E = SnapshotError> = std::result::Result<T, E>;

/// One exported row: (table, key, value).
pub type Row = (Table, Vec<u8>, Vec<u8>);

/// The tables a snapshot carries, in export order: all but `sessions` and a group's own
/// `raft` state.
pub fn exported() -> Vec<Table> {
    Table::ALL
        .into_iter()
        .filter(|t| !matches!(t, Table::Sessions | Table::Raft))
        .collect()
}

fn table_named(name: &str) -> Option<Table> {
    Table::ALL.iter().copied().find(|t| t.name() == name)
}

/// Counts and hashes everything written through it.
struct Hashing<W> {
    inner: W,
    hasher: blake3::Hasher,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportStats {
    pub rows: u64,
    pub bytes: u64,
}

/// Writes the store as of one instant to `out`, without open sessions' rows.
pub fn export(store: &dyn KvStore, out: &mut dyn Write) -> Result<ExportStats> {
    let mut open: HashSet<[u8; 8]> = HashSet::new();
    for kv in store.scan(Table::Sessions, b"", None) {
        let (k, _) = kv?;
        if let Ok(uid) = <[u8; 8]>::try_from(&k[..]) {
            open.insert(uid);
        }
    }
    let mut w = Hashing {
        inner: std::io::BufWriter::with_capacity(1 << 20, out),
        hasher: blake3::Hasher::new(),
        bytes: 0,
    };
    w.write_all(MAGIC)?;
    w.write_all(&FORMAT_VERSION.to_be_bytes())?;
    w.write_all(&SCHEMA_VERSION.to_be_bytes())?;
    let mut rows = 0u64;
    let mut current: Option<Table> = None;
    let io = |e: std::io::Error| StoreError::Io(format!("writing the export: {e}"));
    store.export(&exported(), &mut |t, k, v| {
        // An open session's uid leads its rows, except in blob_shards (after the hash).
        let uid = match t {
            Table::Entries | Table::Shards | Table::ShardBlobs => k.get(..8),
            Table::BlobShards => k.get(32..40),
            _ => None,
        };
        if let Some(uid) = uid {
            if open.contains(<&[u8; 8]>::try_from(uid).expect("8 bytes")) {
                return Ok(());
            }
        }
        if current != Some(t) {
            current = Some(t);
            let name = t.name().as_bytes();
            w.write_all(&[TAG_TABLE, name.len() as u8]).map_err(io)?;
            w.write_all(name).map_err(io)?;
        }
        w.write_all(&[TAG_ROW]).map_err(io)?;
        w.write_all(&(k.len() as u32).to_be_bytes()).map_err(io)?;
        w.write_all(k).map_err(io)?;
        w.write_all(&(v.len() as u32).to_be_bytes()).map_err(io)?;
        w.write_all(v).map_err(io)?;
        rows += 1;
        Ok(())
    })?;
    w.write_all(&[TAG_END])?;
    w.write_all(&rows.to_be_bytes())?;
    let sum = w.hasher.finalize();
    w.inner.write_all(sum.as_bytes())?;
    w.inner.flush()?;
    Ok(ExportStats {
        rows,
        bytes: w.bytes + 32,
    })
}

/// Reads an export row by row, checking the header, every length, and the trailer's
/// row count and checksum: `next_row` returns None only after a valid trailer.
pub struct Reader<R> {
    inner: R,
    hasher: blake3::Hasher,
    table: Option<Table>,
    rows: u64,
    done: bool,
}

impl<R: Read> Reader<R> {
    pub fn new(mut inner: R) -> Result<Self> {
        let mut head = [0u8; 22];
        inner
            .read_exact(&mut head)
            .map_err(|_| SnapshotError::Corrupt("too short for a header".into()))?;
        if &head[..14] != MAGIC {
            return Err(SnapshotError::Corrupt("not a Locus catalog export".into()));
        }
        let format = u32::from_be_bytes(head[14..18].try_into().expect("4 bytes"));
        let schema = u32::from_be_bytes(head[18..22].try_into().expect("4 bytes"));
        if format != FORMAT_VERSION {
            return Err(SnapshotError::Incompatible(format!(
                "the catalog export has format {format}; this build reads format {FORMAT_VERSION}"
            )));
        }
        // Version-1 rows are version-2 rows (see `SCHEMA_VERSION`).
        if !(1..=SCHEMA_VERSION).contains(&schema) {
            return Err(SnapshotError::Incompatible(format!(
                "the snapshot's metadata schema is {schema}; this build has schema {SCHEMA_VERSION} \
                 and no migration from it"
            )));
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(&head);
        Ok(Reader {
            inner,
            hasher,
            table: None,
            rows: 0,
            done: false,
        })
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.inner
            .read_exact(buf)
            .map_err(|_| SnapshotError::Corrupt("truncated".into()))?;
        self.hasher.update(buf);
        Ok(())
    }

    fn read_field(&mut self) -> Result<Vec<u8>> {
        let mut len = [0u8; 4];
        self.read(&mut len)?;
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_FIELD {
            return Err(SnapshotError::Corrupt(format!("a {len}-byte field")));
        }
        let mut v = vec![0u8; len];
        self.read(&mut v)?;
        Ok(v)
    }

    /// The next row, or None after a valid trailer.
    pub fn next_row(&mut self) -> Result<Option<Row>> {
        if self.done {
            return Ok(None);
        }
        loop {
            let mut tag = [0u8; 1];
            self.read(&mut tag)?;
            match tag[0] {
                TAG_TABLE => {
                    let mut n = [0u8; 1];
                    self.read(&mut n)?;
                    let mut name = vec![0u8; n[0] as usize];
                    self.read(&mut name)?;
                    let name = String::from_utf8_lossy(&name).into_owned();
                    let t = table_named(&name)
                        .filter(|t| *t != Table::Sessions)
                        .ok_or_else(|| SnapshotError::Corrupt(format!("unknown table {name:?}")))?;
                    self.table = Some(t);
                }
                TAG_ROW => {
                    let t = self
                        .table
                        .ok_or_else(|| SnapshotError::Corrupt("a row before any table".into()))?;
                    let k = self.read_field()?;
                    let v = self.read_field()?;
                    self.rows += 1;
                    return Ok(Some((t, k, v)));
                }
                TAG_END => {
                    let mut rows = [0u8; 8];
                    self.read(&mut rows)?;
                    let expect = self.hasher.finalize();
                    let mut sum = [0u8; 32];
                    self.inner
                        .read_exact(&mut sum)
                        .map_err(|_| SnapshotError::Corrupt("truncated checksum".into()))?;
                    if &sum != expect.as_bytes() {
                        return Err(SnapshotError::Corrupt("checksum mismatch".into()));
                    }
                    if u64::from_be_bytes(rows) != self.rows {
                        return Err(SnapshotError::Corrupt("row count mismatch".into()));
                    }
                    let mut extra = [0u8; 1];
                    if self.inner.read(&mut extra)? != 0 {
                        return Err(SnapshotError::Corrupt("bytes after the trailer".into()));
                    }
                    self.done = true;
                    return Ok(None);
                }
                t => return Err(SnapshotError::Corrupt(format!("unknown record tag {t:#x}"))),
            }
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreStats {
    pub rows: u64,
}

/// Writes an export into `store` (which should be empty), in batches; the last batch is
/// synced. On error the store holds a partial copy and must be thrown away; callers
/// restore into a fresh directory and remove it on failure.
pub fn restore(
    input: impl Read,
    store: &dyn KvStore,
    backup_url: &str,
    snapshot: &str,
    cluster_id: Option<&str>,
) -> Result<RestoreStats> {
    let mut r = Reader::new(std::io::BufReader::with_capacity(1 << 20, input))?;
    let mut batch = Batch::default();
    let mut size = 0usize;
    let mut rows = 0u64;
    while let Some((t, k, v)) = r.next_row()? {
        // The catalogue must be of the cluster its (signed) manifest names.
        if let (Table::Meta, Some(want)) = (t, cluster_id) {
            if k == keys::META_CLUSTER_ID && v != want.as_bytes() {
                return Err(SnapshotError::Corrupt(format!(
                    "the catalogue is cluster {}'s but its manifest names cluster {want}",
                    String::from_utf8_lossy(&v)
                )));
            }
        }
        // Every row is checked like the API input it once was before it is written; one
        // that fails leaves the restore (and its fresh directory) to be thrown away.
        crate::rows::check_row(t, &k, &v)
            .map_err(|e| SnapshotError::Corrupt(format!("{} row {}: {e}", t.name(), rows + 1)))?;
        size += k.len() + v.len();
        batch.put(t, k, v);
        rows += 1;
        if batch.len() >= 20_000 || size >= 16 << 20 {
            store.write(std::mem::take(&mut batch), false)?;
            size = 0;
        }
    }
    // Blobs no node holds any more are read back from this backup. A record like the
    // ones backup runs write (raw snapshot-id bytes here once made ListBackups fail on a
    // restored service).
    let rec = crate::records::BackupRecord {
        snapshot: snapshot.to_string(),
        recorded_at_ms: crate::Clock::now_ms(&crate::SystemClock),
        restored: true,
    };
    batch.put(Table::Backups, backup_url.as_bytes(), rec.encode_to_vec());
    store.write(batch, true)?;
    Ok(RestoreStats { rows })
}

/// One blob a backup must hold and the nodes holding it (the replicas of the first shard
/// that needs it, in placement order: the first is the first replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBlob {
    pub hash: BlobHash,
    pub size: u64,
    pub chunk_size: u32,
    pub replicas: Vec<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub cluster_id: String,
    /// dataset → (version numbers, bytes of those versions).
    pub datasets: BTreeMap<String, (Vec<u64>, u64)>,
    pub blobs: Vec<PlannedBlob>,
}

/// Reads an export and lists what a backup of it needs: every blob of every committed
/// version, with where to read it.
pub fn plan(input: impl Read) -> Result<Plan> {
    let mut r = Reader::new(std::io::BufReader::with_capacity(1 << 20, input))?;
    let mut plan = Plan::default();
    let mut shards: HashMap<(u64, u32), Vec<String>> = HashMap::new();
    let mut seen: HashMap<BlobHash, usize> = HashMap::new();
    let corrupt = |t: Table, e: String| SnapshotError::Corrupt(format!("{}: {e}", t.name()));
    while let Some((t, k, v)) = r.next_row()? {
        match t {
            Table::Meta if k == keys::META_CLUSTER_ID => {
                plan.cluster_id = String::from_utf8_lossy(&v).into_owned();
            }
            Table::Versions => {
                let rec = VersionRecord::decode(&v[..]).map_err(|e| corrupt(t, e.to_string()))?;
                let nul = k
                    .iter()
                    .position(|b| *b == 0)
                    .ok_or_else(|| corrupt(t, "bad key".into()))?;
                let name = String::from_utf8_lossy(&k[..nul]).into_owned();
                let number = keys::version_number(&k).unwrap_or(0);
                let d = plan.datasets.entry(name).or_default();
                d.0.push(number);
                d.1 += rec.bytes;
            }
            Table::Shards => {
                let rec = ShardRecord::decode(&v[..]).map_err(|e| corrupt(t, e.to_string()))?;
                let uid = keys::u64_value(&k[..8.min(k.len())]).unwrap_or(0);
                let shard = keys::shard_id(&k).ok_or_else(|| corrupt(t, "bad key".into()))?;
                shards.insert((uid, shard), rec.replicas);
            }
            Table::ShardBlobs => {
                let (shard, blobs) =
                    keys::shard_blobs_row(&k, &v).ok_or_else(|| corrupt(t, "bad row".into()))?;
                let uid = keys::u64_value(&k[..8]).unwrap_or(0);
                for (h, size, chunk_size) in blobs {
                    let hash = BlobHash(h);
                    if seen.contains_key(&hash) {
                        continue;
                    }
                    seen.insert(hash, plan.blobs.len());
                    plan.blobs.push(PlannedBlob {
                        hash,
                        size,
                        chunk_size,
                        replicas: shards.get(&(uid, shard)).cloned().unwrap_or_default(),
                    });
                }
            }
            _ => {}
        }
    }
    Ok(plan)
}

/// One version as a snapshot holds it: enough to import it again into a running cluster
/// (its blobs read from the backup, or found on nodes that still hold them).
#[derive(Debug, Clone, Default)]
pub struct ExportedVersion {
    /// The cluster whose catalogue it was exported from.
    pub cluster_id: String,
    pub dataset: String,
    pub number: u64,
    pub origin: String,
    pub chunk_size: u32,
    pub replication: u32,
    /// Sorted by path, with chunk hashes.
    pub entries: Vec<locus_proto::pb::Entry>,
    /// Without replicas (a new placement is chosen).
    pub shards: Vec<locus_proto::pb::Shard>,
    /// The distinct blobs of each shard (hash, size), indexed by shard id.
    pub shard_blobs: Vec<Vec<(BlobHash, u64)>>,
}

/// Reads `dataset@number` (the newest version of `dataset` the snapshot holds when
/// `number` is None) out of an export.
pub fn version_from_export(input: impl Read, dataset: &str, number: Option<u64>) -> Result<ExportedVersion> {
    let mut r = Reader::new(std::io::BufReader::with_capacity(1 << 20, input))?;
    let corrupt = |t: Table, e: String| SnapshotError::Corrupt(format!("{}: {e}", t.name()));
    let prefix = keys::version_prefix(dataset);
    let mut found: Option<(u64, VersionRecord)> = None;
    let mut out = ExportedVersion {
        dataset: dataset.to_string(),
        ..Default::default()
    };
    let mut uid = None;
    let mut shard_blobs: BTreeMap<u32, Vec<(BlobHash, u64)>> = BTreeMap::new();
    while let Some((t, k, v)) = r.next_row()? {
        if t != Table::Versions && uid.is_none() {
            // Every version row precedes the rows that need the chosen uid.
            if let Some((n, rec)) = found.take() {
                out.number = n;
                out.origin = rec.origin;
                out.chunk_size = rec.chunk_size;
                out.replication = rec.replication;
                uid = Some(rec.uid);
            }
        }
        match t {
            Table::Meta if k == keys::META_CLUSTER_ID => {
                out.cluster_id = String::from_utf8_lossy(&v).into_owned();
            }
            Table::Versions if k.starts_with(&prefix) && k.len() == prefix.len() + 8 => {
                let n = keys::version_number(&k).unwrap_or(0);
                if number.is_none_or(|want| want == n) && found.as_ref().is_none_or(|(m, _)| n > *m) {
                    let rec = VersionRecord::decode(&v[..]).map_err(|e| corrupt(t, e.to_string()))?;
                    found = Some((n, rec));
                }
            }
            Table::Entries | Table::Shards | Table::ShardBlobs => {
                let Some(uid) = uid else { continue };
                if k.get(..8) != Some(&keys::uid(uid)[..]) {
                    continue;
                }
                match t {
                    Table::Entries => {
                        let (dir, name) =
                            keys::split_entry(&k).ok_or_else(|| corrupt(t, "bad key".into()))?;
                        let rec = crate::records::EntryRecord::decode(&v[..])
                            .map_err(|e| corrupt(t, e.to_string()))?;
                        out.entries
                            .push(crate::catalog::entry_pb(keys::join(dir, name), rec, true));
                    }
                    Table::Shards => {
                        let rec = ShardRecord::decode(&v[..]).map_err(|e| corrupt(t, e.to_string()))?;
                        let id = keys::shard_id(&k).ok_or_else(|| corrupt(t, "bad key".into()))?;
                        out.shards.push(locus_proto::pb::Shard {
                            id,
                            bytes: rec.bytes,
                            files: rec.files,
                            replicas: Vec::new(),
                        });
                    }
                    _ => {
                        let (shard, blobs) =
                            keys::shard_blobs_row(&k, &v).ok_or_else(|| corrupt(t, "bad row".into()))?;
                        let list = shard_blobs.entry(shard).or_default();
                        list.extend(blobs.into_iter().map(|(h, size, _)| (BlobHash(h), size)));
                    }
                }
            }
            _ => {}
        }
    }
    if uid.is_none() {
        let what = match number {
            Some(n) => format!("{dataset}@{n}"),
            None => format!("any version of {dataset}"),
        };
        return Err(SnapshotError::Incompatible(format!(
            "the snapshot does not hold {what}"
        )));
    }
    out.entries.sort_by(|a, b| a.path.cmp(&b.path));
    out.shards.sort_by_key(|s| s.id);
    for s in &out.shards {
        if s.id as usize != out.shard_blobs.len() {
            return Err(SnapshotError::Corrupt(format!(
                "shard ids of {dataset}@{} are not 0..n",
                out.number
            )));
        }
        // Rows per page may name a blob twice, and list each page in hash order only.
        let mut list = shard_blobs.remove(&s.id).unwrap_or_default();
        list.sort_unstable_by_key(|b| b.0 .0);
        list.dedup_by(|a, b| a.0 == b.0);
        out.shard_blobs.push(list);
    }
    Ok(out)
}

/// Bytes per ExportCatalog message.
const CHUNK: usize = 1 << 20;

/// A `Write` that sends what it is given down a gRPC stream in `CHUNK`-sized pieces.
pub struct ChunkSender {
    tx: tokio::sync::mpsc::Sender<Result<locus_proto::pb::CatalogChunk, tonic::Status>>,
    buf: Vec<u8>,
}

impl ChunkSender {
    pub fn new(tx: tokio::sync::mpsc::Sender<Result<locus_proto::pb::CatalogChunk, tonic::Status>>) -> Self {
        ChunkSender {
            tx,
            buf: Vec::with_capacity(CHUNK),
        }
    }

    pub fn flush_now(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(locus_proto::pb::CatalogChunk { data }))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the caller went away"))
    }
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= CHUNK {
            self.flush_now()?;
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
