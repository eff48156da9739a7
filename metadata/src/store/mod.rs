//! The storage interface of the metadata service: ordered key-value tables with atomic
//! multi-table batches. The catalogue speaks only this interface, so it never sees RocksDB
//! types and a replicated backend can be put underneath later without touching it.
//!
//! Contract every backend keeps: a `write` is all-or-nothing and, with `sync`, durable
//! when it returns; `scan` yields keys in ascending byte order.

mod mem;
mod rocks;

pub use mem::MemStore;
pub use rocks::RocksStore;

/// The tables (RocksDB column families) of the catalogue. The names are the on-disk
/// column-family names and must never change; neither may the order of the variants, which
/// a replicated group's log entries encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Table {
    Meta,
    Nodes,
    Datasets,
    Versions,
    Entries,
    Shards,
    NodeShards,
    Resident,
    Sessions,
    Backups,
    ShardBlobs,
    BlobShards,
    /// A replicated group's own state (the last applied log entry, the membership, the
    /// group's grant key): never in a backup, never read by the catalogue.
    Raft,
}

impl Table {
    pub const ALL: [Table; 13] = [
        Table::Meta,
        Table::Nodes,
        Table::Datasets,
        Table::Versions,
        Table::Entries,
        Table::Shards,
        Table::NodeShards,
        Table::Resident,
        Table::Sessions,
        Table::Backups,
        Table::ShardBlobs,
        Table::BlobShards,
        Table::Raft,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Table::Meta => "meta",
            Table::Nodes => "nodes",
            Table::Datasets => "datasets",
            Table::Versions => "versions",
            Table::Entries => "entries",
            Table::Shards => "shards",
            Table::NodeShards => "node_shards",
            Table::Resident => "resident",
            Table::Sessions => "sessions",
            Table::Backups => "backups",
            Table::ShardBlobs => "shard_blobs",
            Table::BlobShards => "blob_shards",
            Table::Raft => "raft",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the metadata store at {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("metadata store I/O failed: {0}")]
    Io(String),
    /// A replicated store cannot take writes here now (not the leader, no quorum); the
    /// caller may retry, elsewhere or later.
    #[error("{0}")]
    Unavailable(String),
}

/// One change inside a batch.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Op {
    Put(
        Table,
        #[serde(with = "bytes")] Vec<u8>,
        #[serde(with = "bytes")] Vec<u8>,
    ),
    Delete(Table, #[serde(with = "bytes")] Vec<u8>),
    /// Deletes keys in `[from, to)`.
    DeleteRange(
        Table,
        #[serde(with = "bytes")] Vec<u8>,
        #[serde(with = "bytes")] Vec<u8>,
    ),
}

/// Keys and values as byte strings in a serialised batch (a group's log entries): one copy
/// each, where serde's default for `Vec<u8>` is a sequence handled byte by byte, which made
/// a manifest page slow enough to encode and decode to delay a group's heartbeats.
mod bytes {
    pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

/// Changes applied together or not at all.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Batch {
    pub ops: Vec<Op>,
}

impl Batch {
    pub fn put(&mut self, t: Table, k: impl Into<Vec<u8>>, v: impl Into<Vec<u8>>) {
        self.ops.push(Op::Put(t, k.into(), v.into()));
    }
    pub fn delete(&mut self, t: Table, k: impl Into<Vec<u8>>) {
        self.ops.push(Op::Delete(t, k.into()));
    }
    pub fn delete_range(&mut self, t: Table, from: impl Into<Vec<u8>>, to: impl Into<Vec<u8>>) {
        self.ops.push(Op::DeleteRange(t, from.into(), to.into()));
    }
    pub fn len(&self) -> usize {
        self.ops.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

pub type KeyValue = (Box<[u8]>, Box<[u8]>);
pub type ScanIter<'a> = Box<dyn Iterator<Item = Result<KeyValue, StoreError>> + 'a>;

pub trait KvStore: Send + Sync + 'static {
    fn get(&self, t: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Keys in `[from, to)` in ascending order; `to = None` means to the end of the table.
    fn scan<'a>(&'a self, t: Table, from: &[u8], to: Option<&[u8]>) -> ScanIter<'a>;
    fn write(&self, batch: Batch, sync: bool) -> Result<(), StoreError>;
    /// Approximate bytes on disk, for status and benchmarks.
    fn size_on_disk(&self) -> u64;
    /// Moves what is only in memory and the write-ahead log into the tables, so the log
    /// can go (a large commit's rows would otherwise sit in both until later writes push
    /// them out, and be replayed from the log at a restart). Nothing to do by default.
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Visits every row of `tables` as of one instant (writes that land meanwhile are not
    /// seen), table by table in the order given, keys ascending. For backups.
    fn export(&self, tables: &[Table], visit: &mut ExportVisitor<'_>) -> Result<(), StoreError>;
    /// Counts batches that reached the store without passing through this process's
    /// `write` (a replicated group applying its log): caches of what the store holds are
    /// valid only while it is unchanged.
    fn outside_writes(&self) -> u64 {
        0
    }
}

/// Called with (table, key, value) for each exported row; an error stops the export.
pub type ExportVisitor<'a> = dyn FnMut(Table, &[u8], &[u8]) -> Result<(), StoreError> + 'a;

/// The smallest key greater than every key that starts with `prefix`, for range ends.
/// `None` when no such key exists (the prefix is all 0xff).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contract(s: &dyn KvStore) {
        let mut b = Batch::default();
        for k in [b"a1".as_slice(), b"a2", b"a3", b"b1"] {
            b.put(Table::Entries, k, k);
        }
        b.put(Table::Shards, b"a1", b"other table");
        s.write(b, true).unwrap();
        let keys: Vec<_> = s
            .scan(Table::Entries, b"a", Some(b"b"))
            .map(|r| r.unwrap().0.to_vec())
            .collect();
        assert_eq!(keys, vec![b"a1".to_vec(), b"a2".to_vec(), b"a3".to_vec()]);
        let mut b = Batch::default();
        b.delete_range(Table::Entries, b"a2".to_vec(), b"b".to_vec());
        b.delete(Table::Entries, b"b1");
        s.write(b, false).unwrap();
        let keys: Vec<_> = s
            .scan(Table::Entries, b"", None)
            .map(|r| r.unwrap().0.to_vec())
            .collect();
        assert_eq!(keys, vec![b"a1".to_vec()]);
        assert_eq!(s.get(Table::Shards, b"a1").unwrap().unwrap(), b"other table");
        assert_eq!(s.get(Table::Shards, b"a2").unwrap(), None);
        let mut rows = Vec::new();
        s.export(&[Table::Shards, Table::Entries], &mut |t, k, v| {
            rows.push((t, k.to_vec(), v.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            rows,
            vec![
                (Table::Shards, b"a1".to_vec(), b"other table".to_vec()),
                (Table::Entries, b"a1".to_vec(), b"a1".to_vec()),
            ]
        );
    }

    #[test]
    fn mem_store_contract() {
        contract(&MemStore::default());
    }

    #[test]
    fn rocks_store_contract() {
        let dir = tempfile::tempdir().unwrap();
        contract(&RocksStore::open(dir.path()).unwrap());
    }

    #[test]
    fn rocks_export_is_one_instant() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        let mut b = Batch::default();
        b.put(Table::Entries, b"e1", b"old");
        b.put(Table::Shards, b"s1", b"old");
        s.write(b, true).unwrap();
        let mut rows = Vec::new();
        let mut wrote = false;
        s.export(&[Table::Entries, Table::Shards], &mut |t, k, v| {
            if !wrote {
                // Writes landing while the export runs belong to the next one.
                let mut b = Batch::default();
                b.put(Table::Shards, b"s2", b"new");
                b.put(Table::Shards, b"s1", b"changed");
                s.write(b, true).unwrap();
                wrote = true;
            }
            rows.push((t, k.to_vec(), v.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            rows,
            vec![
                (Table::Entries, b"e1".to_vec(), b"old".to_vec()),
                (Table::Shards, b"s1".to_vec(), b"old".to_vec()),
            ]
        );
        assert_eq!(s.get(Table::Shards, b"s1").unwrap().unwrap(), b"changed");
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }
}
