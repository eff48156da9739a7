//! Rows a store computes from rows it holds (`Op::Derive`), all of the blob → shard index
//! (`blob_shards`): the rows of a range of a session's manifest pages, put, from their
//! `shard_blobs` page rows; or every row a version's (or session's) `shard_blobs` rows
//! name, deleted, when it goes.
//!
//! Why: the index is keyed by hash, so written with each page its rows land all over the
//! key space, and each was a memtable insert searching a skip list of a million keys, on
//! the service and on every member of a group — two thirds of what a follower spent on a
//! large upload. Derived a million rows at a time, they are sorted once in memory and go
//! in as one table file (`RocksStore`), and a group's log carries 16 bytes for them.

use super::{KvStore, StoreError, Table};
use crate::keys;

/// What a `Derive` of `blob_shards` names: the pages `[from, to)` of session `uid`.
pub fn derive_blob_shards(uid: u64, from: u32, to: u32) -> Vec<u8> {
    let mut v = uid.to_be_bytes().to_vec();
    v.extend_from_slice(&from.to_be_bytes());
    v.extend_from_slice(&to.to_be_bytes());
    v
}

/// What a `Derive` that deletes names: every `blob_shards` row of `uid`'s `shard_blobs`
/// rows. Deleting a 10M-entry version wrote 10M point deletes into one batch (~500 MB,
/// past what a group's log sends in one message); these are 8 bytes.
pub fn forget_blob_shards(uid: u64) -> Vec<u8> {
    uid.to_be_bytes().to_vec()
}

/// One derived `blob_shards` row: key (blob, uid, shard) and value (size, chunk size).
pub type IndexRow = ([u8; 44], [u8; 12]);

/// What an `Op::Derive` does: rows to put, or keys to delete, each in ascending key order
/// without duplicates.
pub enum Derived {
    Put(Vec<IndexRow>),
    Delete(Vec<[u8; 44]>),
}

/// What `Op::Derive(t, what)` changes, computed from the rows `store` holds now.
pub fn derived(store: &dyn KvStore, t: Table, what: &[u8]) -> Result<Derived, StoreError> {
    match (t, what.len()) {
        (Table::BlobShards, 16) => derived_rows(store, t, what).map(Derived::Put),
        (Table::BlobShards, 8) => forgotten_rows(store, what).map(Derived::Delete),
        _ => Err(bad_derive(t, what)),
    }
}

fn bad_derive(t: Table, what: &[u8]) -> StoreError {
    StoreError::Io(format!(
        "a derived change of {} names {} bytes",
        t.name(),
        what.len()
    ))
}

/// The keys `forget_blob_shards(uid)` deletes: one per blob of each `shard_blobs` row of
/// `uid` (its pages and its namespace's row), whether or not a window derived them yet.
fn forgotten_rows(store: &dyn KvStore, what: &[u8]) -> Result<Vec<[u8; 44]>, StoreError> {
    let uid = keys::u64_value(what).ok_or_else(|| bad_derive(Table::BlobShards, what))?;
    let (from, to) = keys::uid_range(uid);
    let mut gone = Vec::new();
    for kv in store.scan(Table::ShardBlobs, &from, Some(&to)) {
        let (k, v) = kv?;
        let Some((shard, blobs)) = keys::shard_blobs_row(&k, &v) else {
            continue;
        };
        for (h, _, _) in blobs {
            let mut key = [0u8; 44];
            key[..32].copy_from_slice(&h);
            key[32..40].copy_from_slice(&uid.to_be_bytes());
            key[40..].copy_from_slice(&shard.to_be_bytes());
            gone.push(key);
        }
    }
    gone.sort_unstable();
    gone.dedup();
    Ok(gone)
}

/// The rows `Op::Derive(t, what)` puts for a range of pages, in ascending key order
/// without duplicates.
pub fn derived_rows(store: &dyn KvStore, t: Table, what: &[u8]) -> Result<Vec<IndexRow>, StoreError> {
    let bad = || bad_derive(t, what);
    if t != Table::BlobShards || what.len() != 16 {
        return Err(bad());
    }
    let uid = keys::u64_value(&what[..8]).ok_or_else(bad)?;
    let from = u32::from_be_bytes(what[8..12].try_into().expect("4 bytes"));
    let to = u32::from_be_bytes(what[12..16].try_into().expect("4 bytes"));
    // Fixed-size rows in one vector: a million of them is one allocation.
    let mut rows: Vec<IndexRow> = Vec::new();
    let (_, hi) = keys::uid_range(uid);
    // Rows are keyed uid | shard | page: each shard's pages in the range are one run, so
    // the scan seeks to each shard's first page and leaves at its last, reading only the
    // window's rows (a scan of every page so far, each window, grew with the square of
    // the upload).
    let mut shard = 0u32;
    'shards: loop {
        let start = keys::shard_blob_page(uid, shard, from);
        let mut next = None;
        for kv in store.scan(Table::ShardBlobs, &start, Some(&hi)) {
            let (k, v) = kv?;
            let Some(s) = keys::shard_id(&k) else { continue };
            if s != shard {
                // The next shard with rows: from its first page in the range.
                next = Some(s);
                break;
            }
            // Page rows only (`uid | shard | page`); a version's namespace has a row per
            // blob, written with its own index row.
            if k.len() != 16 {
                continue;
            }
            let page = u32::from_be_bytes(k[12..16].try_into().expect("4 bytes"));
            if page >= to {
                next = shard.checked_add(1);
                break;
            }
            if page < from {
                continue;
            }
            let Some((_, blobs)) = keys::shard_blobs_row(&k, &v) else {
                return Err(StoreError::Io(format!(
                    "shard_blobs row of page {page} of {uid} is malformed ({} bytes)",
                    v.len()
                )));
            };
            for (h, size, chunk) in blobs {
                let mut key = [0u8; 44];
                key[..32].copy_from_slice(&h);
                key[32..40].copy_from_slice(&uid.to_be_bytes());
                key[40..].copy_from_slice(&shard.to_be_bytes());
                let mut val = [0u8; 12];
                val[..8].copy_from_slice(&size.to_be_bytes());
                val[8..].copy_from_slice(&chunk.to_be_bytes());
                rows.push((key, val));
            }
        }
        match next {
            Some(s) => shard = s,
            None => break 'shards,
        }
    }
    rows.sort_unstable_by_key(|r| r.0);
    rows.dedup_by(|a, b| a.0 == b.0);
    Ok(rows)
}
