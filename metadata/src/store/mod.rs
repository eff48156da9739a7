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

pub use derive::{derive_blob_shards, derived, derived_rows, forget_blob_shards, Derived, IndexRow};
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
    /// A change too large for the store to take at all (a group's one-message bound);
    /// nothing was written, and retrying the same change cannot help.
    #[error("{0}")]
    TooLarge(String),
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
    /// Puts or deletes the rows of `Table` that the store computes from rows it already
    /// holds, as `derived` says: the change names them rather than carrying them (a group
    /// ships 16 bytes where the rows are ~80 each, 8 where a version's deletes were ~50
    /// each), and every member computes them from its own copy of the rows they come
    /// from. Computed before the batch's other changes, from what earlier batches stored.
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
#[derive(Default, Clone)]
pub struct Batch {
    buf: Arc<Vec<u8>>,
    n: usize,
    /// A table whose rows the writer lets land before the rest (`ingest_first`). Not
    /// serialised: a group member's applies are replayed from its log, so the store
    /// decides for them by itself.
    first: Option<Table>,
}

/// Equal changes make equal batches; `ingest_first` is how to write them, not what.
impl PartialEq for Batch {
    fn eq(&self, o: &Self) -> bool {
        self.n == o.n && self.buf == o.buf
    }
}
impl Eq for Batch {}

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
    /// Lets the store make this batch's rows of `t` durable before the rest, as one table
    /// file, should they be a long sorted run of puts (`RocksStore`). The writer vouches
    /// that a crash between the two does no harm: that whoever retries the batch puts the
    /// same rows again, and that rows nothing else points to yet mislead no reader.
    pub fn ingest_first(&mut self, t: Table) {
        self.first = Some(t);
    }
    pub fn may_ingest_first(&self) -> Option<Table> {
        self.first
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
                    first: None,
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
mod tests;
