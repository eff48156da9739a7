//! The storage interface of the metadata service: ordered key-value tables with atomic
//! multi-table batches. The catalogue speaks only this interface, so it never sees RocksDB
//! types and a replicated backend can be put underneath later without touching it.
//!
//! Contract every backend keeps: a `write` is all-or-nothing and, with `sync`, durable
//! when it returns; `scan` yields keys in ascending byte order.

use std::sync::Arc;

mod derive;
mod mem;
pub(crate) mod rocks;

pub use derive::{derive_blob_shards, derived_rows, IndexRow};
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

/// One change inside a batch, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename = "Op")]
pub enum Op<'a> {
    Put(
        Table,
        #[serde(with = "bytes")] &'a [u8],
        #[serde(with = "bytes")] &'a [u8],
    ),
    Delete(Table, #[serde(with = "bytes")] &'a [u8]),
    /// Deletes keys in `[from, to)`.
    DeleteRange(
        Table,
        #[serde(with = "bytes")] &'a [u8],
        #[serde(with = "bytes")] &'a [u8],
    ),
    /// Puts the rows of `Table` that the store computes from rows it already holds, as
    /// `derived_rows` says: the change names them rather than carrying them (a group ships
    /// 16 bytes where the rows are ~80 each), and every member computes them from its own
    /// copy of the rows they come from. Applied before the batch's other changes.
    Derive(Table, #[serde(with = "bytes")] &'a [u8]),
}

impl Op<'_> {
    pub fn table(&self) -> Table {
        match self {
            Op::Put(t, ..) | Op::Delete(t, _) | Op::DeleteRange(t, ..) | Op::Derive(t, _) => *t,
        }
    }
}

/// Keys and values as byte strings in a serialised batch (a group's log entries): one copy
/// each, where serde's default for `Vec<u8>` is a sequence handled byte by byte, which made
/// a manifest page slow enough to encode and decode to delay a group's heartbeats.
mod bytes {
    pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
}

/// Changes applied together or not at all.
///
/// The changes are kept in one buffer (kind, table, then each byte string after its
/// length), not as a vector of owned keys and values: a manifest page is a batch of about
/// 75,000 rows, and two allocations per row, made by the catalogue and again by every
/// member decoding the page from the Raft log, were a fifth of a follower's CPU. The
/// serialised form is unchanged: a sequence of `Op`s, as older builds wrote it.
///
/// The buffer is shared by clones: a group member hands the same page to its log, to
/// each follower's replication and to its own apply, and a clone that copied megabytes
/// each time was paid three times per page on the leader.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct Batch {
    buf: Arc<Vec<u8>>,
    n: usize,
}

const PUT: u8 = 0;
const DELETE: u8 = 1;
const DELETE_RANGE: u8 = 2;
const DERIVE: u8 = 3;

impl Batch {
    fn push(&mut self, kind: u8, t: Table, parts: &[&[u8]]) {
        let buf = Arc::make_mut(&mut self.buf);
        buf.push(kind);
        buf.push(t as u8);
        for p in parts {
            buf.extend_from_slice(&(p.len() as u32).to_le_bytes());
            buf.extend_from_slice(p);
        }
        self.n += 1;
    }
    /// About the length of the serialised form (bincode: a 4-byte kind and table and an
    /// 8-byte length per byte string, where the buffer has one byte and four), to size
    /// the buffer it is written into once.
    pub fn encoded_len_hint(&self) -> usize {
        self.buf.len() + 14 * self.n + 16
    }
    pub fn put(&mut self, t: Table, k: impl AsRef<[u8]>, v: impl AsRef<[u8]>) {
        self.push(PUT, t, &[k.as_ref(), v.as_ref()]);
    }
    pub fn delete(&mut self, t: Table, k: impl AsRef<[u8]>) {
        self.push(DELETE, t, &[k.as_ref()]);
    }
    pub fn delete_range(&mut self, t: Table, from: impl AsRef<[u8]>, to: impl AsRef<[u8]>) {
        self.push(DELETE_RANGE, t, &[from.as_ref(), to.as_ref()]);
    }
    /// See `Op::Derive`.
    pub fn derive(&mut self, t: Table, what: impl AsRef<[u8]>) {
        self.push(DERIVE, t, &[what.as_ref()]);
    }
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// The changes, in the order they were added.
    pub fn ops(&self) -> impl Iterator<Item = Op<'_>> + '_ {
        let mut rest = &self.buf[..];
        std::iter::from_fn(move || {
            let (&kind, r) = rest.split_first()?;
            let (&t, mut r) = r.split_first().expect("a table after the kind");
            let t = Table::ALL[t as usize];
            let mut part = || {
                let (len, tail) = r.split_at(4);
                let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
                let (p, tail) = tail.split_at(len);
                r = tail;
                p
            };
            let op = match kind {
                PUT => {
                    let k = part();
                    Op::Put(t, k, part())
                }
                DELETE => Op::Delete(t, part()),
                DERIVE => Op::Derive(t, part()),
                _ => {
                    let from = part();
                    Op::DeleteRange(t, from, part())
                }
            };
            rest = r;
            Some(op)
        })
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.ops()).finish()
    }
}

impl serde::Serialize for Batch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeSeq, SerializeStruct};
        struct Ops<'a>(&'a Batch);
        impl serde::Serialize for Ops<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.0.n))?;
                for op in self.0.ops() {
                    seq.serialize_element(&op)?;
                }
                seq.end()
            }
        }
        let mut st = s.serialize_struct("Batch", 1)?;
        st.serialize_field("ops", &Ops(self))?;
        st.end()
    }
}

/// Reads the serialised form straight into a batch's buffer: each key and value is copied
/// once from the input, with no allocation of its own.
impl<'de> serde::Deserialize<'de> for Batch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{DeserializeSeed, EnumAccess, Error, SeqAccess, VariantAccess, Visitor};
        use std::fmt;

        /// One byte string, appended after its length.
        struct Part<'b>(&'b mut Vec<u8>);
        impl<'de> DeserializeSeed<'de> for Part<'_> {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_bytes(self)
            }
        }
        impl<'de> Visitor<'de> for Part<'_> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<(), E> {
                self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
                self.0.extend_from_slice(v);
                Ok(())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
                let mut v = Vec::new();
                while let Some(b) = a.next_element::<u8>()? {
                    v.push(b);
                }
                self.visit_bytes(&v)
            }
        }

        /// The fields of one variant: the table, then `parts` byte strings.
        struct Fields<'b> {
            buf: &'b mut Vec<u8>,
            kind: u8,
            parts: usize,
        }
        impl<'de> Visitor<'de> for Fields<'_> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table and byte strings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
                let t: Table = a
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(0, &self))?;
                self.buf.push(self.kind);
                self.buf.push(t as u8);
                for i in 0..self.parts {
                    a.next_element_seed(Part(self.buf))?
                        .ok_or_else(|| A::Error::invalid_length(i + 1, &"a table and byte strings"))?;
                }
                Ok(())
            }
        }

        struct OneOp<'b>(&'b mut Vec<u8>);
        impl<'de> DeserializeSeed<'de> for OneOp<'_> {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_enum("Op", &["Put", "Delete", "DeleteRange", "Derive"], self)
            }
        }
        impl<'de> Visitor<'de> for OneOp<'_> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a change")
            }
            fn visit_enum<A: EnumAccess<'de>>(self, a: A) -> Result<(), A::Error> {
                let (kind, v): (u32, _) = a.variant()?;
                let (kind, parts) = match kind {
                    0 => (PUT, 2),
                    1 => (DELETE, 1),
                    2 => (DELETE_RANGE, 2),
                    3 => (DERIVE, 1),
                    k => return Err(A::Error::custom(format!("unknown change kind {k}"))),
                };
                v.tuple_variant(
                    parts + 1,
                    Fields {
                        buf: self.0,
                        kind,
                        parts,
                    },
                )
            }
        }

        struct Ops;
        impl<'de> Visitor<'de> for Ops {
            type Value = Batch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of changes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Batch, A::Error> {
                let (mut buf, mut n) = (Vec::new(), 0);
                while a.next_element_seed(OneOp(&mut buf))?.is_some() {
                    n += 1;
                }
                Ok(Batch {
                    buf: Arc::new(buf),
                    n,
                })
            }
        }
        impl<'de> DeserializeSeed<'de> for Ops {
            type Value = Batch;
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Batch, D::Error> {
                d.deserialize_seq(self)
            }
        }

        struct Whole;
        impl<'de> Visitor<'de> for Whole {
            type Value = Batch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a batch")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Batch, A::Error> {
                a.next_element_seed(Ops)?
                    .ok_or_else(|| A::Error::invalid_length(0, &self))
            }
        }
        d.deserialize_struct("Batch", &["ops"], Whole)
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
    use crate::keys;

    /// The batch as older builds defined it, whose serialised form is in Raft logs and
    /// messages between members of different builds.
    mod old {
        use super::Table;

        mod bytes {
            pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(v)
            }
            pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
                Ok(<&[u8]>::deserialize(d)?.to_vec())
            }
            use serde::Deserialize;
        }

        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        pub enum Op {
            Put(
                Table,
                #[serde(with = "bytes")] Vec<u8>,
                #[serde(with = "bytes")] Vec<u8>,
            ),
            Delete(Table, #[serde(with = "bytes")] Vec<u8>),
            DeleteRange(
                Table,
                #[serde(with = "bytes")] Vec<u8>,
                #[serde(with = "bytes")] Vec<u8>,
            ),
        }

        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        pub struct Batch {
            pub ops: Vec<Op>,
        }
    }

    #[test]
    fn a_batch_serialises_as_older_builds_wrote_it_and_reads_their_bytes_back() {
        let mut b = Batch::default();
        b.put(Table::Entries, b"k1", vec![7u8; 300]);
        b.delete(Table::Raft, b"applied");
        b.delete_range(Table::BlobShards, b"", [0xffu8; 3]);
        b.put(Table::Meta, b"", b"");
        let old = old::Batch {
            ops: vec![
                old::Op::Put(Table::Entries, b"k1".to_vec(), vec![7u8; 300]),
                old::Op::Delete(Table::Raft, b"applied".to_vec()),
                old::Op::DeleteRange(Table::BlobShards, vec![], vec![0xff; 3]),
                old::Op::Put(Table::Meta, vec![], vec![]),
            ],
        };
        let bytes = bincode::serialize(&old).unwrap();
        assert_eq!(bincode::serialize(&b).unwrap(), bytes, "the same bytes as before");
        let back: Batch = bincode::deserialize(&bytes).unwrap();
        assert_eq!(back, b);
        assert_eq!(back.len(), 4);
        // From a reader too (no borrowing from the input).
        let read: Batch = bincode::deserialize_from(&bytes[..]).unwrap();
        assert_eq!(read, b);
        assert_eq!(
            bincode::deserialize::<old::Batch>(&bincode::serialize(&b).unwrap()).unwrap(),
            old
        );
        let ops: Vec<Op> = b.ops().collect();
        assert_eq!(ops[0], Op::Put(Table::Entries, b"k1", &[7u8; 300]));
        assert_eq!(ops[2], Op::DeleteRange(Table::BlobShards, b"", &[0xff; 3]));
        // A change of a kind no build writes is refused, not misread.
        let mut bad = bytes.clone();
        bad[8] = 9;
        assert!(bincode::deserialize::<Batch>(&bad).is_err());
    }

    /// A derived change names its rows in 16 bytes, reads back as it was written, and is
    /// refused by a build that does not know the kind (a group is upgraded whole).
    #[test]
    fn a_derived_change_round_trips_and_an_older_build_refuses_it() {
        let mut b = Batch::default();
        b.derive(Table::BlobShards, derive_blob_shards(5, 1, 3));
        b.put(Table::Sessions, b"s", b"v");
        let bytes = bincode::serialize(&b).unwrap();
        assert_eq!(bincode::deserialize::<Batch>(&bytes).unwrap(), b);
        let ops: Vec<Op> = b.ops().collect();
        assert_eq!(
            ops[0],
            Op::Derive(Table::BlobShards, &derive_blob_shards(5, 1, 3))
        );
        let err = bincode::deserialize::<old::Batch>(&bytes).unwrap_err();
        assert!(err.to_string().contains("variant index"), "{err}");
    }

    /// The blob → shard rows of pages `[1, 3)` of uid 5: each (blob, shard) of those page
    /// rows once, in key order, size and chunk size as the page row says; page 0, another
    /// uid and a per-blob row (a namespace's) not at all. `per_page` blobs per page and
    /// shard, some repeated across pages.
    fn derive_contract(s: &dyn KvStore, per_page: usize) {
        let blob = |i: usize| *blake3::hash(&i.to_le_bytes()).as_bytes();
        let mut b = Batch::default();
        let mut want = std::collections::BTreeMap::new();
        for uid in [5u64, 6] {
            for page in 0..3u32 {
                for shard in 0..2u32 {
                    // Every page names blob 0 and its own blobs.
                    let mut blobs: Vec<([u8; 32], u64)> = std::iter::once(0)
                        .chain((0..per_page).map(|i| 1 + i + per_page * page as usize))
                        .map(|i| (blob(i), i as u64))
                        .collect();
                    blobs.sort();
                    if uid == 5 && page >= 1 {
                        for (h, size) in &blobs {
                            want.insert(
                                keys::blob_shard(h, uid, shard),
                                keys::blob_shard_value(*size, 4096),
                            );
                        }
                    }
                    b.put(
                        Table::ShardBlobs,
                        keys::shard_blob_page(uid, shard, page),
                        keys::shard_blob_page_value(4096, &blobs),
                    );
                }
            }
        }
        b.put(
            Table::ShardBlobs,
            keys::shard_blob(5, 0, &blob(999_999)),
            keys::blob_shard_value(1, 4096),
        );
        s.write(b, true).unwrap();
        let mut b = Batch::default();
        b.derive(Table::BlobShards, derive_blob_shards(5, 1, 3));
        b.put(Table::Sessions, b"progress", b"recorded");
        s.write(b, false).unwrap();
        let got: Vec<(Vec<u8>, Vec<u8>)> = s
            .scan(Table::BlobShards, b"", None)
            .map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
            .collect();
        assert_eq!(
            got.len(),
            2 * (1 + 2 * per_page),
            "blob 0 once per shard, the rest once each"
        );
        assert_eq!(got, want.into_iter().collect::<Vec<_>>());
        assert_eq!(s.get(Table::Sessions, b"progress").unwrap().unwrap(), b"recorded");

        // A derived change that names another table, or names it wrong, is refused.
        for (t, what) in [
            (Table::Entries, derive_blob_shards(5, 0, 1)),
            (Table::BlobShards, vec![0; 3]),
        ] {
            let mut b = Batch::default();
            b.derive(t, what);
            assert!(s.write(b, false).is_err(), "{t:?}");
        }
    }

    #[test]
    fn derived_rows_in_memory() {
        derive_contract(&MemStore::default(), 5);
    }

    #[test]
    fn derived_rows_in_rocksdb_go_in_as_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        derive_contract(&s, rocks::INGEST_AT_LEAST);
        assert_eq!(s.memtable_rows(Table::BlobShards), 0);
        // Too few to be worth a file: through the memtable, the same rows.
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        derive_contract(&s, 3);
        assert_eq!(s.memtable_rows(Table::BlobShards), 2 * (1 + 2 * 3));
    }

    #[test]
    fn tables_are_numbered_in_the_order_of_all() {
        for (i, t) in Table::ALL.iter().enumerate() {
            assert_eq!(*t as usize, i, "{t:?}");
        }
    }

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
        b.delete_range(Table::Entries, b"a2", b"b");
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

    /// A long sorted run into one table bypasses the memtable and reads back like any
    /// write: newer than what was there, older than what comes after, the same when
    /// written again (a member replaying the entry), and the group's mark beside it kept.
    #[test]
    fn a_sorted_run_is_ingested_and_reads_like_any_write() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open_replicated(dir.path()).unwrap();
        let key = |i: usize| format!("k{i:06}").into_bytes();
        let n = rocks::INGEST_AT_LEAST + 10;
        let mut before = Batch::default();
        before.put(Table::BlobShards, key(7), b"old");
        s.write(before, true).unwrap();
        let mut run = Batch::default();
        for i in 0..n {
            run.put(Table::BlobShards, key(i), format!("v{i}"));
        }
        run.put(Table::Raft, b"applied", b"1");
        s.write_unlogged(run.clone()).unwrap();
        // RocksDB flushed the earlier put (its key is in the run's range) before taking
        // the file; none of the run's rows went into the memtable.
        assert_eq!(s.memtable_rows(Table::BlobShards), 0);
        assert_eq!(s.get(Table::BlobShards, &key(7)).unwrap().unwrap(), b"v7");
        assert_eq!(s.get(Table::Raft, b"applied").unwrap().unwrap(), b"1");
        s.write_unlogged(run).unwrap();
        let mut after = Batch::default();
        after.put(Table::BlobShards, key(9), b"newer");
        s.write(after, true).unwrap();
        let got: Vec<_> = s
            .scan(Table::BlobShards, b"", None)
            .map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
            .collect();
        assert_eq!(got.len(), n);
        for (i, (k, v)) in got.iter().enumerate() {
            assert_eq!(k, &key(i));
            let want = if i == 9 {
                b"newer".to_vec()
            } else {
                format!("v{i}").into_bytes()
            };
            assert_eq!(v, &want, "row {i}");
        }
        assert_eq!(
            std::fs::read_dir(dir.path().join("ingest")).unwrap().count(),
            0,
            "staged files left"
        );

        // Out of order, short, or mixed with another table: the memtable, as before.
        for (i, batch) in [
            (0..n).rev().collect::<Vec<_>>(),
            (0..rocks::INGEST_AT_LEAST - 1).collect(),
        ]
        .into_iter()
        .enumerate()
        {
            let d = tempfile::tempdir().unwrap();
            let s = RocksStore::open(d.path()).unwrap();
            let mut b = Batch::default();
            for j in &batch {
                b.put(Table::BlobShards, key(*j), b"x");
            }
            s.write(b, false).unwrap();
            assert_eq!(s.memtable_rows(Table::BlobShards), batch.len() as u64, "case {i}");
        }
        let d = tempfile::tempdir().unwrap();
        let s = RocksStore::open(d.path()).unwrap();
        let mut b = Batch::default();
        for j in 0..n {
            b.put(Table::BlobShards, key(j), b"x");
        }
        b.put(Table::Entries, b"e", b"x");
        s.write(b, false).unwrap();
        assert_eq!(s.memtable_rows(Table::BlobShards), n as u64);
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
