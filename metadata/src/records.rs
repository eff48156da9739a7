//! On-disk record formats (protobuf-encoded values of the catalogue tables), schema
//! version 2. Fields are only ever added, with new tags; a change that cannot be expressed
//! that way bumps `SCHEMA_VERSION` and adds a migration in `catalog::open`.

use std::collections::HashMap;

/// 2: `shard_blobs` holds a row per manifest page and shard, `blob_shards` values the
/// blob's size (`keys::shard_blob_page`); version-1 rows are still read, so a version-1
/// store or export is read as it is.
pub const SCHEMA_VERSION: u32 = 2;

pub const KIND_FILE: u32 = 1;
pub const KIND_DIR: u32 = 2;
pub const KIND_SYMLINK: u32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeRecord {
    #[prost(string, tag = "1")]
    pub address: String,
    #[prost(map = "string, string", tag = "2")]
    pub labels: HashMap<String, String>,
    #[prost(uint64, tag = "3")]
    pub capacity_bytes: u64,
    #[prost(uint64, tag = "4")]
    pub free_bytes: u64,
    #[prost(uint64, tag = "5")]
    pub used_bytes: u64,
    #[prost(int64, tag = "6")]
    pub registered_at_ms: i64,
    /// Set by DrainNode: no new replicas, existing ones are moved away by repair.
    #[prost(bool, tag = "7")]
    pub draining: bool,
    /// The registered process's identity (empty for records from before identities).
    #[prost(string, tag = "8")]
    pub instance: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DatasetRecord {
    #[prost(int64, tag = "1")]
    pub created_at_ms: i64,
    /// The number the next commit gets. Never goes down, so a number is never reused.
    #[prost(uint64, tag = "2")]
    pub next_version: u64,
    /// Highest committed version still present; 0 for none.
    #[prost(uint64, tag = "3")]
    pub latest: u64,
    /// Set by DeleteDataset; the record stays so numbering continues if the name returns.
    #[prost(bool, tag = "4")]
    pub deleted: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct VersionRecord {
    /// Internal id under which the version's entries, shards and resident counters are
    /// keyed; allocated when its import session began.
    #[prost(uint64, tag = "1")]
    pub uid: u64,
    #[prost(int64, tag = "2")]
    pub created_at_ms: i64,
    #[prost(string, tag = "3")]
    pub origin: String,
    #[prost(uint32, tag = "4")]
    pub replication: u32,
    #[prost(uint32, tag = "5")]
    pub chunk_size: u32,
    #[prost(uint64, tag = "6")]
    pub files: u64,
    #[prost(uint64, tag = "7")]
    pub dirs: u64,
    #[prost(uint64, tag = "8")]
    pub symlinks: u64,
    #[prost(uint64, tag = "9")]
    pub bytes: u64,
    #[prost(uint32, tag = "10")]
    pub shards: u32,
    #[prost(string, tag = "11")]
    pub committed_by: String,
    /// The sealed namespace's hash and size (empty for versions from before them).
    #[prost(bytes = "vec", tag = "12")]
    pub namespace_blob: Vec<u8>,
    #[prost(uint64, tag = "13")]
    pub namespace_size: u64,
    /// For a version without files (no shard to hold it): the namespace itself.
    #[prost(bytes = "vec", tag = "14")]
    pub namespace_inline: Vec<u8>,
    /// The namespace's chunk hashes, 32 bytes each (mounts check each piece they fetch).
    #[prost(bytes = "vec", tag = "15")]
    pub namespace_chunks: Vec<u8>,
    /// Its files' chunk hashes are tree chunk hashes (`locus_proto::chunks`).
    #[prost(bool, tag = "16")]
    pub tree_chunks: bool,
}

/// A manifest entry; its path is the key.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EntryRecord {
    #[prost(uint32, tag = "1")]
    pub kind: u32,
    #[prost(uint64, tag = "2")]
    pub size: u64,
    #[prost(uint32, tag = "3")]
    pub mode: u32,
    #[prost(int64, tag = "4")]
    pub mtime_ns: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub blob: Vec<u8>,
    /// Chunk hashes, 32 bytes each, concatenated; empty for a file of one chunk whose
    /// hash is the blob's (see [`EntryRecord::chunk_hashes`]).
    #[prost(bytes = "vec", tag = "6")]
    pub chunks: Vec<u8>,
    #[prost(string, tag = "7")]
    pub target: String,
    #[prost(uint32, tag = "8")]
    pub shard: u32,
}

impl EntryRecord {
    /// The file's chunk hashes. A file of one chunk has the blob's hash as its chunk's
    /// (the same bytes hashed), so that one is not stored twice: a file with bytes and no
    /// stored chunks has exactly one, the blob's. (Records from before this carry it
    /// stored; both read the same.)
    pub fn chunk_hashes(&self) -> Vec<Vec<u8>> {
        if self.chunks.is_empty() && self.size > 0 && !self.blob.is_empty() {
            return vec![self.blob.clone()];
        }
        self.chunks.chunks(32).map(<[u8]>::to_vec).collect()
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ShardRecord {
    #[prost(uint64, tag = "1")]
    pub bytes: u64,
    #[prost(uint64, tag = "2")]
    pub files: u64,
    #[prost(string, repeated, tag = "3")]
    pub replicas: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionRecord {
    #[prost(string, tag = "1")]
    pub dataset: String,
    #[prost(int64, tag = "2")]
    pub created_at_ms: i64,
    #[prost(int64, tag = "3")]
    pub last_active_ms: i64,
    #[prost(uint32, tag = "4")]
    pub chunk_size: u32,
    #[prost(string, tag = "5")]
    pub origin: String,
    #[prost(uint32, tag = "6")]
    pub replication: u32,
    #[prost(uint64, tag = "7")]
    pub next_entry_page: u64,
    #[prost(uint64, tag = "8")]
    pub next_shard_page: u64,
    #[prost(uint64, tag = "9")]
    pub entries: u64,
    #[prost(string, tag = "10")]
    pub opened_by: String,
    /// The highest entry key stored, while every page so far came in ascending key order
    /// (the catalogue's order, which importers send): a key above it cannot be a
    /// duplicate, so it is stored without a lookup. Empty once entries have come out of
    /// order (every later entry is looked up), and in sessions opened before it existed.
    #[prost(bytes = "vec", tag = "11")]
    pub ordered_up_to: Vec<u8>,
    /// The importer sends tree chunk hashes; each file's are checked to merge to its hash.
    #[prost(bool, tag = "12")]
    pub tree_chunks: bool,
    /// Replicated bytes placed for this import (its last `PlaceShards`): counted against
    /// its teams' quotas until the session ends, by whichever member leads then.
    #[prost(uint64, tag = "13")]
    pub placed_bytes: u64,
    /// Pages below this one have their `blob_shards` rows (derived a window at a time:
    /// `Op::Derive`); the commit derives the rest.
    #[prost(uint64, tag = "14")]
    pub indexed_pages: u64,
    /// Files stored in pages from `indexed_pages` on.
    #[prost(uint64, tag = "15")]
    pub unindexed_files: u64,
}

/// `backups` value: the last snapshot committed to (or restored from) a backup target.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BackupRecord {
    #[prost(string, tag = "1")]
    pub snapshot: String,
    #[prost(int64, tag = "2")]
    pub recorded_at_ms: i64,
    /// True when this service was restored from it (rather than backed up to it).
    #[prost(bool, tag = "3")]
    pub restored: bool,
}
