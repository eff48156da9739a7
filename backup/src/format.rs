//! The snapshot objects: manifest, blob list, COMMITTED report, the gc marker, and
//! listing snapshots with their state.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use locus_proto::manifest::BlobHash;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::{BackupError, Result, Target};

/// The backup layout version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A new snapshot id: UTC time to the millisecond plus a random suffix, so ids sort by
/// time and two runs in the same millisecond still differ (`20261129T203000Z-042-1a2b3c`).
pub fn new_snapshot_id(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // A clock beyond the years ±9999 is not one to name snapshots by: the epoch's date.
    let (y, m, d) = locus_proto::human::civil_from_days(days).unwrap_or((1970, 1, 1));
    let nonce =
        blake3::hash(format!("{ms}.{}.{:?}", std::process::id(), std::thread::current().id()).as_bytes());
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z-{:03}-{}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000),
        &nonce.to_hex()[..6]
    )
}

/// Snapshot ids are made by `new_snapshot_id`; anything else is refused before it can
/// become part of a key.
pub fn check_snapshot_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(BackupError::Invalid(format!("{id:?} is not a snapshot id")))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DatasetSummary {
    pub name: String,
    pub versions: Vec<u64>,
    pub bytes: u64,
}

/// `snapshots/<id>/manifest.json`: written before any blob is uploaded, so garbage
/// collection sees what a running backup needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotManifest {
    pub format: u32,
    pub id: String,
    pub cluster_id: String,
    pub created_ms: i64,
    pub datasets: Vec<DatasetSummary>,
    pub blobs: u64,
    pub blob_bytes: u64,
    pub catalog_bytes: u64,
    /// BLAKE3 of the catalog object, hex.
    pub catalog_blake3: String,
}

/// `snapshots/<id>/COMMITTED`: the run's report. Its presence makes the snapshot valid.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Committed {
    pub snapshot: String,
    pub started_ms: i64,
    pub finished_ms: i64,
    pub blobs: u64,
    pub bytes: u64,
    pub blobs_uploaded: u64,
    pub bytes_uploaded: u64,
    pub blobs_skipped: u64,
    pub bytes_skipped: u64,
}

/// `gc/STATE`: written by garbage collection when it starts and when it ends, read by
/// backup runs to learn whether a collection overlapped them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GcState {
    pub id: String,
    pub running: bool,
    pub started_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotState {
    /// COMMITTED is present: the snapshot can be restored.
    Committed,
    /// No COMMITTED: a backup still running, or one that was interrupted.
    Incomplete,
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    pub id: String,
    pub state: SnapshotState,
    pub manifest: Option<SnapshotManifest>,
    pub committed: Option<Committed>,
    /// Objects of the snapshot that exist but cannot be read (damaged).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub damage: Vec<String>,
}

impl SnapshotInfo {
    /// When the snapshot was taken: from its manifest, else from its id.
    pub fn created_ms(&self) -> i64 {
        self.manifest.as_ref().map(|m| m.created_ms).unwrap_or(0)
    }
}

/// The blobs a snapshot needs: sorted (hash, size) pairs.
///
/// Encoding: `LOCUSBL1`, then 40 bytes per blob (hash, size u64 BE), then the BLAKE3 of
/// everything before it, so a truncated or damaged list is detected.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlobList(pub Vec<(BlobHash, u64)>);

const BLOB_LIST_MAGIC: &[u8; 8] = b"LOCUSBL1";

impl BlobList {
    pub fn from_unsorted(mut v: Vec<(BlobHash, u64)>) -> Self {
        v.sort_unstable_by_key(|a| a.0 .0);
        v.dedup_by(|a, b| a.0 == b.0);
        BlobList(v)
    }

    pub fn bytes(&self) -> u64 {
        self.0.iter().fold(0u64, |a, (_, s)| a.saturating_add(*s))
    }

    pub fn contains(&self, h: &BlobHash) -> bool {
        self.0.binary_search_by(|(x, _)| x.0.cmp(&h.0)).is_ok()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.0.len() * 40 + 32);
        out.extend_from_slice(BLOB_LIST_MAGIC);
        for (h, s) in &self.0 {
            out.extend_from_slice(&h.0);
            out.extend_from_slice(&s.to_be_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let bad = |why: &str| BackupError::Corrupt(format!("blob list: {why}"));
        if b.len() < 40 || &b[..8] != BLOB_LIST_MAGIC || !(b.len() - 40).is_multiple_of(40) {
            return Err(bad("not a version-1 blob list"));
        }
        let (body, sum) = b.split_at(b.len() - 32);
        if blake3::hash(body).as_bytes() != sum {
            return Err(bad("checksum mismatch (truncated or damaged)"));
        }
        let v = body[8..]
            .chunks_exact(40)
            .map(|c| {
                let mut h = [0u8; 32];
                h.copy_from_slice(&c[..32]);
                let mut s = [0u8; 8];
                s.copy_from_slice(&c[32..]);
                (BlobHash(h), u64::from_be_bytes(s))
            })
            .collect::<Vec<_>>();
        // `contains` (gc keeps what a snapshot lists) searches by halves: a list out of
        // order would answer "not listed" for a blob it lists, and gc would delete it.
        if v.windows(2).any(|w| w[0].0 .0 >= w[1].0 .0) {
            return Err(bad("hashes out of order or repeated"));
        }
        Ok(BlobList(v))
    }
}

/// Largest JSON object of the layout (manifest, COMMITTED, SIGNATURE, gc state): they
/// are a few KB; a manifest lists datasets and version numbers.
pub const JSON_MAX: u64 = 64 << 20;
/// Largest blob list read without its manifest's count: 100 million blobs.
pub const BLOB_LIST_MAX: u64 = 40 + 40 * 100_000_000;

impl Target {
    pub async fn put_bytes(&self, key: &object_store::path::Path, data: Vec<u8>) -> Result<()> {
        self.store
            .put(key, PutPayload::from(Bytes::from(data)))
            .await
            .map(|_| ())
            .map_err(|e| BackupError::store(format!("cannot write {}", self.describe(key)), e))
    }

    /// Reads a whole object of at most `max` bytes: whoever can write the bucket must
    /// not be able to make a list or a restore hold an object of any size in memory.
    /// Counted as it streams in, whatever the object claims to be.
    pub async fn get_bytes(&self, key: &object_store::path::Path, max: u64) -> Result<Bytes> {
        use futures_util::StreamExt;
        let what = || format!("cannot read {}", self.describe(key));
        let r = self
            .store
            .get(key)
            .await
            .map_err(|e| BackupError::store(what(), e))?;
        let too_big = |n: u64| {
            BackupError::Corrupt(format!(
                "{} is {n} bytes or more, larger than such an object may be ({max})",
                self.describe(key)
            ))
        };
        if r.meta.size > max {
            return Err(too_big(r.meta.size));
        }
        let mut out = Vec::with_capacity(r.meta.size as usize);
        let mut body = r.into_stream();
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| BackupError::store(what(), e))?;
            if (out.len() + piece.len()) as u64 > max {
                return Err(too_big((out.len() + piece.len()) as u64));
            }
            out.extend_from_slice(&piece);
        }
        Ok(Bytes::from(out))
    }

    pub async fn put_json<T: Serialize>(&self, key: &object_store::path::Path, v: &T) -> Result<()> {
        let data = serde_json::to_vec_pretty(v).map_err(|e| BackupError::Invalid(e.to_string()))?;
        self.put_bytes(key, data).await
    }

    pub async fn get_json<T: DeserializeOwned>(&self, key: &object_store::path::Path) -> Result<T> {
        let b = self.get_bytes(key, JSON_MAX).await?;
        serde_json::from_slice(&b).map_err(|e| BackupError::Corrupt(format!("{}: {e}", self.describe(key))))
    }

    /// `Ok(None)` when the object does not exist.
    pub async fn get_json_opt<T: DeserializeOwned>(
        &self,
        key: &object_store::path::Path,
    ) -> Result<Option<T>> {
        match self.get_json(key).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn gc_state(&self) -> Result<Option<GcState>> {
        self.get_json_opt(&self.key("gc/STATE")).await
    }

    /// A snapshot's blob list; `blobs`, when its manifest is at hand, bounds its size.
    pub async fn blob_list_of(&self, id: &str, blobs: Option<u64>) -> Result<BlobList> {
        let max = blobs.map_or(BLOB_LIST_MAX, |n| 40 + 40 * n);
        BlobList::decode(&self.get_bytes(&self.snapshot_key(id, "blobs"), max).await?)
    }

    pub async fn blob_list(&self, id: &str) -> Result<BlobList> {
        self.blob_list_of(id, None).await
    }

    /// Every snapshot under the target, oldest first, with its state.
    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let dir = self.key("snapshots");
        let listing = self
            .store
            .list_with_delimiter(Some(&dir))
            .await
            .map_err(|e| BackupError::store(format!("cannot list {}", self.describe(&dir)), e))?;
        let mut ids: Vec<String> = listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .filter(|id| check_snapshot_id(id).is_ok())
            .collect();
        ids.sort();
        let mut out = Vec::with_capacity(ids.len());
        // A few requests at once: listing a year of nightly snapshots stays quick.
        let mut infos = futures_util::stream::iter(ids.into_iter().map(|id| async move {
            let (mk, ck) = (
                self.snapshot_key(&id, "manifest.json"),
                self.snapshot_key(&id, "COMMITTED"),
            );
            let manifest = self.get_json_opt::<SnapshotManifest>(&mk);
            let committed = self.get_json_opt::<Committed>(&ck);
            let (manifest, committed) = futures_util::future::join(manifest, committed).await;
            // A damaged object is reported with its snapshot rather than failing the list.
            let mut damage = Vec::new();
            let manifest = match manifest {
                Ok(m) => m,
                Err(BackupError::Corrupt(e)) => {
                    damage.push(e);
                    None
                }
                Err(e) => return Err(e),
            };
            let (committed, is_committed) = match committed {
                Ok(c) => (c.clone(), c.is_some()),
                Err(BackupError::Corrupt(e)) => {
                    damage.push(e);
                    (None, true)
                }
                Err(e) => return Err(e),
            };
            Ok::<_, BackupError>(SnapshotInfo {
                state: if is_committed {
                    SnapshotState::Committed
                } else {
                    SnapshotState::Incomplete
                },
                id,
                manifest,
                committed,
                damage,
            })
        }))
        .buffered(8);
        while let Some(i) = infos.next().await {
            let i = i?;
            // A directory with neither object is not a snapshot: what a deletion leaves
            // behind on a file:// target. (A run writes its manifest first of all.)
            if i.manifest.is_some() || i.committed.is_some() || !i.damage.is_empty() {
                out.push(i);
            }
        }
        Ok(out)
    }

    /// The newest committed snapshot, or the one named, which must be committed.
    pub async fn committed_snapshot(&self, id: Option<&str>) -> Result<SnapshotInfo> {
        let all = self.list_snapshots().await?;
        match id {
            Some(id) => {
                check_snapshot_id(id)?;
                let s = all
                    .into_iter()
                    .find(|s| s.id == id)
                    .ok_or_else(|| BackupError::Invalid(format!("{}: no snapshot {id}", self.url)))?;
                if s.state != SnapshotState::Committed {
                    return Err(BackupError::Invalid(format!(
                        "snapshot {id} has no COMMITTED marker (interrupted or still running); \
                         it cannot be used"
                    )));
                }
                Ok(s)
            }
            None => all
                .into_iter()
                .rev()
                .find(|s| s.state == SnapshotState::Committed)
                .ok_or_else(|| BackupError::Invalid(format!("{}: no committed snapshot", self.url))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_lists_round_trip_and_detect_damage() {
        let l = BlobList::from_unsorted(vec![
            (BlobHash::of(b"b"), 2),
            (BlobHash::of(b"a"), 1),
            (BlobHash::of(b"b"), 2),
        ]);
        assert_eq!(l.0.len(), 2);
        assert!(l.contains(&BlobHash::of(b"a")));
        assert!(!l.contains(&BlobHash::of(b"c")));
        let mut e = l.encode();
        assert_eq!(BlobList::decode(&e).unwrap(), l);
        e[10] ^= 1;
        assert!(BlobList::decode(&e).is_err());
        assert!(BlobList::decode(&e[..e.len() - 1]).is_err());
    }

    /// A list with a valid checksum but out of order (anyone can compute BLAKE3) would
    /// make `contains` miss blobs it lists, and gc delete them; sizes that add past u64
    /// must not panic.
    #[test]
    fn a_checksummed_blob_list_out_of_order_is_refused_and_huge_sizes_saturate() {
        let sorted = BlobList::from_unsorted(vec![(BlobHash::of(b"a"), 1), (BlobHash::of(b"b"), 2)]);
        let swapped = BlobList(vec![sorted.0[1], sorted.0[0]]);
        let e = BlobList::decode(&swapped.encode()).unwrap_err().to_string();
        assert!(e.contains("out of order"), "{e}");
        let dup = BlobList(vec![sorted.0[0], sorted.0[0]]);
        assert!(BlobList::decode(&dup.encode()).is_err());
        let huge = BlobList(vec![(sorted.0[0].0, u64::MAX), (sorted.0[1].0, u64::MAX)]);
        assert_eq!(BlobList::decode(&huge.encode()).unwrap().bytes(), u64::MAX);
    }

    #[tokio::test]
    async fn objects_larger_than_they_may_be_are_refused_not_read() {
        let d = tempfile::tempdir().unwrap();
        let t = Target::open(&format!("file://{}", d.path().display())).unwrap();
        let l = BlobList::from_unsorted((0..3u8).map(|i| (BlobHash::of(&[i]), 1)).collect());
        t.put_bytes(&t.snapshot_key("s", "blobs"), l.encode())
            .await
            .unwrap();
        assert_eq!(t.blob_list_of("s", Some(3)).await.unwrap(), l);
        // The manifest says one blob; the list holds three.
        let e = t.blob_list_of("s", Some(1)).await.unwrap_err().to_string();
        assert!(e.contains("larger than such an object may be"), "{e}");
        // A JSON object of the layout over its cap.
        let key = t.snapshot_key("s", "COMMITTED");
        t.put_bytes(&key, vec![b' '; JSON_MAX as usize + 1])
            .await
            .unwrap();
        let e = t.get_json::<Committed>(&key).await.unwrap_err().to_string();
        assert!(e.contains("larger than such an object may be"), "{e}");
    }

    #[test]
    fn ids_sort_by_time_and_are_checked() {
        let a = new_snapshot_id(1_795_000_000_000);
        let b = new_snapshot_id(1_795_000_000_999);
        let c = new_snapshot_id(1_795_000_001_000);
        assert!(a < b && b < c, "{a} {b} {c}");
        assert!(a.starts_with("2026"), "{a}");
        check_snapshot_id(&a).unwrap();
        assert!(check_snapshot_id("../x").is_err());
        assert!(check_snapshot_id("").is_err());
        assert_eq!(locus_proto::human::civil_from_days(20_786), Some((2026, 11, 29)));
    }
}
