//! Key layouts of the catalogue tables. Every multi-part key puts fixed-width big-endian
//! integers and NUL-terminated names first so that one version's (or one directory's,
//! or one dataset's) keys are one contiguous range.
//!
//! entries: `uid(8) | parent dir | 0x00 | name` — a directory's children are contiguous,
//! and a parent's own key always sorts before its children's (its group is a prefix of
//! theirs followed by 0x00, which sorts before '/'), which the commit check relies on.

pub const META_SCHEMA: &[u8] = b"schema_version";
pub const META_CLUSTER_ID: &[u8] = b"cluster_id";
pub const META_NEXT_UID: &[u8] = b"next_uid";

pub fn uid(uid: u64) -> [u8; 8] {
    uid.to_be_bytes()
}

pub fn version(dataset: &str, number: u64) -> Vec<u8> {
    let mut k = version_prefix(dataset);
    k.extend_from_slice(&number.to_be_bytes());
    k
}

/// (dataset, number) of a `versions` key.
pub fn split_version(k: &[u8]) -> Option<(&str, u64)> {
    let (name, rest) = k.split_at(k.len().checked_sub(9)?);
    if rest[0] != 0 {
        return None;
    }
    Some((
        std::str::from_utf8(name).ok()?,
        u64::from_be_bytes(rest[1..].try_into().ok()?),
    ))
}

pub fn version_prefix(dataset: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(dataset.len() + 9);
    k.extend_from_slice(dataset.as_bytes());
    k.push(0);
    k
}

pub fn version_number(key: &[u8]) -> Option<u64> {
    let tail = key.get(key.len().checked_sub(8)?..)?;
    Some(u64::from_be_bytes(tail.try_into().ok()?))
}

/// Key of the entry at `path` (non-empty) in version `uid`.
pub fn entry(uid: u64, path: &str) -> Vec<u8> {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    let mut k = dir_prefix(uid, dir);
    k.extend_from_slice(name.as_bytes());
    k
}

/// Prefix of the keys of the direct children of `dir` ("" = root).
pub fn dir_prefix(uid: u64, dir: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(8 + dir.len() + 1);
    k.extend_from_slice(&uid.to_be_bytes());
    k.extend_from_slice(dir.as_bytes());
    k.push(0);
    k
}

/// Splits an entries key into (parent dir, name).
pub fn split_entry(key: &[u8]) -> Option<(&str, &str)> {
    let rest = key.get(8..)?;
    let nul = rest.iter().position(|b| *b == 0)?;
    let dir = std::str::from_utf8(&rest[..nul]).ok()?;
    let name = std::str::from_utf8(&rest[nul + 1..]).ok()?;
    Some((dir, name))
}

pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

pub fn shard(uid: u64, shard: u32) -> Vec<u8> {
    let mut k = uid.to_be_bytes().to_vec();
    k.extend_from_slice(&shard.to_be_bytes());
    k
}

pub fn shard_id(key: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(key.get(8..12)?.try_into().ok()?))
}

pub fn node_shard(node: &str, uid: u64, shard: u32) -> Vec<u8> {
    let mut k = node.as_bytes().to_vec();
    k.push(0);
    k.extend_from_slice(&uid.to_be_bytes());
    k.extend_from_slice(&shard.to_be_bytes());
    k
}

/// `uid | shard | blob`: the blobs one shard needs (value: size u64 BE, chunk size u32 BE).
pub fn shard_blob(uid: u64, shard: u32, blob: &[u8; 32]) -> Vec<u8> {
    let mut k = self::shard(uid, shard);
    k.extend_from_slice(blob);
    k
}

/// `uid | shard | page`: the blobs one manifest page gave one shard, in one row (schema
/// version 2). Value: chunk size u32 BE, then each blob (32) and its size u64 BE, in hash
/// order. One row per page and shard rather than one per blob: a 10M-entry upload makes
/// 10M fewer memtable inserts on every member (~15% of a 3M-entry upload's time).
pub fn shard_blob_page(uid: u64, shard: u32, page: u32) -> Vec<u8> {
    let mut k = self::shard(uid, shard);
    k.extend_from_slice(&page.to_be_bytes());
    k
}

/// Bytes of one blob in a `shard_blob_page` value.
pub const SHARD_PAGE_BLOB: usize = 32 + 8;

/// The value of a `shard_blob_page` row; `blobs` sorted by hash, without duplicates.
pub fn shard_blob_page_value(chunk_size: u32, blobs: &[([u8; 32], u64)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + blobs.len() * SHARD_PAGE_BLOB);
    v.extend_from_slice(&chunk_size.to_be_bytes());
    for (h, size) in blobs {
        v.extend_from_slice(h);
        v.extend_from_slice(&size.to_be_bytes());
    }
    v
}

/// A blob of a shard: hash, size, chunk size.
pub type ShardBlob = ([u8; 32], u64, u32);

/// One `shard_blobs` row, of either form, as (shard, [(blob, size, chunk size)]): a row
/// per blob (key `uid | shard | blob`, value size and chunk size: schema version 1, and
/// still how a version's sealed namespace is recorded) or a row per page. `None`: neither.
pub fn shard_blobs_row(k: &[u8], v: &[u8]) -> Option<(u32, Vec<ShardBlob>)> {
    let shard = shard_id(k)?;
    match k.len() {
        44 => {
            let h: [u8; 32] = k[12..44].try_into().ok()?;
            let size = u64_value(v.get(..8)?)?;
            let chunk = u32::from_be_bytes(v.get(8..12)?.try_into().ok()?);
            (v.len() == 12).then(|| (shard, vec![(h, size, chunk)]))
        }
        16 => {
            let chunk = u32::from_be_bytes(v.get(..4)?.try_into().ok()?);
            let rest = &v[4..];
            if rest.is_empty() || !rest.len().is_multiple_of(SHARD_PAGE_BLOB) {
                return None;
            }
            let blobs = rest
                .chunks_exact(SHARD_PAGE_BLOB)
                .map(|b| {
                    let h: [u8; 32] = b[..32].try_into().expect("32 bytes");
                    (h, u64::from_be_bytes(b[32..].try_into().expect("8 bytes")), chunk)
                })
                .collect();
            Some((shard, blobs))
        }
        _ => None,
    }
}

/// The value of a `blob_shards` row: the blob's size and chunk size (empty in rows
/// written before schema version 2, whose size is in the per-blob `shard_blobs` row).
pub fn blob_shard_value(size: u64, chunk_size: u32) -> Vec<u8> {
    let mut v = size.to_be_bytes().to_vec();
    v.extend_from_slice(&chunk_size.to_be_bytes());
    v
}

/// `blob | uid | shard`: the shards that need one blob, for locating it.
pub fn blob_shard(blob: &[u8], uid: u64, shard: u32) -> Vec<u8> {
    let mut k = blob.to_vec();
    k.extend_from_slice(&uid.to_be_bytes());
    k.extend_from_slice(&shard.to_be_bytes());
    k
}

pub fn resident(uid: u64, node: &str) -> Vec<u8> {
    let mut k = uid.to_be_bytes().to_vec();
    k.extend_from_slice(node.as_bytes());
    k
}

/// The range `[uid, uid + 1)` that holds every key of one version in a uid-keyed table.
pub fn uid_range(uid: u64) -> (Vec<u8>, Vec<u8>) {
    (
        uid.to_be_bytes().to_vec(),
        uid.checked_add(1)
            .map(|n| n.to_be_bytes().to_vec())
            .unwrap_or_else(|| vec![0xff; 9]),
    )
}

pub fn u64_value(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_sorts_before_children() {
        let paths = [
            "a", "a/b", "a/b/c", "a-b", "a.b", "a.b/x", "ab", "a/b c", "z", "z/a",
        ];
        let mut keys: Vec<_> = paths.iter().map(|p| (entry(7, p), *p)).collect();
        keys.sort();
        for (i, (_, p)) in keys.iter().enumerate() {
            if let Some((parent, _)) = p.rsplit_once('/') {
                let pi = keys.iter().position(|(_, q)| *q == parent).unwrap();
                assert!(pi < i, "{parent} must sort before {p}");
            }
        }
        let k = entry(7, "a/b/c");
        assert_eq!(split_entry(&k), Some(("a/b", "c")));
        assert!(k.starts_with(&dir_prefix(7, "a/b")));
        assert!(!entry(7, "a/bc").starts_with(&dir_prefix(7, "a/b")));
    }

    #[test]
    fn version_keys_are_per_dataset() {
        let a = version("ab", 1);
        assert!(a.starts_with(&version_prefix("ab")));
        assert!(!version("abc", 1).starts_with(&version_prefix("ab")));
        assert_eq!(version_number(&a), Some(1));
    }
}
