//! Restores: a snapshot's catalogue fetched and checked, written into a new metadata
//! store, or one version of it read out to be imported again (`import::commit_scanned`).
//!
//! The rules live here, not in whoever calls: a snapshot is used only once its
//! signature (or the operator's `allow_unsigned`) vouches for its manifest, checked
//! before anything large is downloaded; its manifest must be the one of the directory it
//! was read from and its catalogue of the cluster the manifest names; a whole restore
//! goes only into a new or empty data dir and, if it fails, removes only what it made;
//! a version restored into a running cluster records the backup as a source without
//! making it look like a fresh backup.

use std::path::Path;

use locus_backup::sign::{Checked, Trust};
use locus_backup::{blob, SnapshotManifest, Target};

use super::backup::{io, joined, BackupOpError};

type Result<T, E = BackupOpError> = std::result::Result<T, E>;

/// A snapshot whose manifest was checked and whose catalogue was downloaded to a temp
/// file and checked whole against it.
pub struct Fetched {
    pub id: String,
    pub manifest: SnapshotManifest,
    /// What the signature check found (an unsigned snapshot the caller allowed says so).
    pub checked: Checked,
    file: std::fs::File,
}

/// Fetches snapshot `snapshot` (the newest committed one when None) of `t`: its manifest
/// and signature first — refused unless `trust` vouches for it — then its catalogue,
/// bounded by the size the (now trusted) manifest gives and checked against its hash.
pub async fn fetch_catalog(t: &Target, snapshot: Option<&str>, trust: &Trust) -> Result<Fetched> {
    let snap = t.committed_snapshot(snapshot).await?;
    let manifest = snap
        .manifest
        .clone()
        .ok_or_else(|| BackupOpError::Invalid(format!("snapshot {} has no manifest.json", snap.id)))?;
    // Before a single byte of the catalogue: its size and hash come from the manifest,
    // which only the signature makes worth believing.
    let checked = trust.check(t, &snap.id, &manifest).await?;
    let mut file = tempfile::tempfile().map_err(io("cannot create a temp file for the catalogue"))?;
    let got = blob::download(
        t,
        &t.snapshot_key(&snap.id, "catalog"),
        Some(&mut file),
        manifest.catalog_bytes,
    )
    .await;
    let (n, h) = match got {
        Ok(x) => x,
        Err(locus_backup::BackupError::Corrupt(_)) => (u64::MAX, locus_proto::BlobHash([0; 32])),
        Err(e) => return Err(e.into()),
    };
    if n != manifest.catalog_bytes || h.to_hex() != manifest.catalog_blake3 {
        return Err(BackupOpError::Invalid(format!(
            "the catalogue of snapshot {} does not match its manifest (damaged); try an older \
             snapshot with --snapshot",
            snap.id
        )));
    }
    Ok(Fetched {
        id: snap.id,
        manifest,
        checked,
        file,
    })
}

/// Writes a fetched catalogue into a new metadata store at `dir/db`. `dir` must not
/// exist or be empty (checked here: nothing is changed otherwise). On failure what this
/// made is removed again, and nothing else.
pub async fn restore_catalog(
    f: Fetched,
    dir: &Path,
    url: &str,
) -> Result<locus_metadata::snapshot::RestoreStats> {
    let existed = dir.exists();
    if existed {
        let mut rd = std::fs::read_dir(dir).map_err(io(&format!("cannot read {}", dir.display())))?;
        if rd.next().is_some() {
            return Err(BackupOpError::Invalid(format!(
                "{} is not empty: restore only into a new or empty data dir (nothing was changed)",
                dir.display()
            )));
        }
    }
    std::fs::create_dir_all(dir).map_err(io(&format!("cannot create {}", dir.display())))?;
    let db = dir.join("db");
    let (url, id, db2) = (url.to_string(), f.id.clone(), db.clone());
    let cluster = f.manifest.cluster_id.clone();
    let mut file = f.file;
    let r = tokio::task::spawn_blocking(move || {
        let store =
            locus_metadata::store::RocksStore::open(&db2).map_err(|e| BackupOpError::Store(e.to_string()))?;
        use std::io::Seek;
        file.rewind().map_err(io("the catalogue's temp file"))?;
        Ok::<_, BackupOpError>(locus_metadata::snapshot::restore(
            file,
            &store,
            &url,
            &id,
            Some(&cluster),
        )?)
    })
    .await
    .map_err(joined)?;
    if r.is_err() {
        // The directory was empty (or absent) before: everything in it is ours.
        let _ = std::fs::remove_dir_all(&db);
        if !existed {
            let _ = std::fs::remove_dir(dir);
        }
    }
    r
}

/// One version of a fetched catalogue (`number` None: the newest it holds), with the
/// blobs of each shard to be read from `t` where no node still has them. `cluster_id`:
/// the running cluster's, which the snapshot must be of unless `other_cluster`.
pub async fn read_version(
    t: &Target,
    f: Fetched,
    dataset: &str,
    number: Option<u64>,
    cluster_id: &str,
    other_cluster: bool,
) -> Result<(locus_metadata::snapshot::ExportedVersion, super::scan::Scanned)> {
    if f.manifest.cluster_id != cluster_id && !other_cluster {
        return Err(BackupOpError::Invalid(format!(
            "snapshot {} is of cluster {}, not of this one ({cluster_id}); to bring a version \
             over from another cluster on purpose, say --from-other-cluster",
            f.id, f.manifest.cluster_id
        )));
    }
    let name = dataset.to_string();
    let mut file = f.file;
    let mut v = tokio::task::spawn_blocking(move || {
        use std::io::Seek;
        file.rewind().map_err(io("the catalogue's temp file"))?;
        Ok::<_, BackupOpError>(locus_metadata::snapshot::version_from_export(
            file, &name, number,
        )?)
    })
    .await
    .map_err(joined)??;
    if v.cluster_id != f.manifest.cluster_id {
        return Err(BackupOpError::Invalid(format!(
            "snapshot {}: its catalogue is cluster {}'s but its manifest names cluster {}; refusing it",
            f.id, v.cluster_id, f.manifest.cluster_id
        )));
    }
    // Only the files' blobs: the version's sealed namespace is a blob of its first shard
    // too, but the import seals the restored manifest afresh (in this cluster).
    let files: std::collections::HashSet<&[u8]> = v.entries.iter().map(|e| e.blob.as_slice()).collect();
    let mut blobs = crate::ops::scan::BlobMap::default();
    let mut shard_blobs = Vec::with_capacity(v.shard_blobs.len());
    for sb in &v.shard_blobs {
        let sb: Vec<_> = sb.iter().filter(|(h, _)| files.contains(&h.0[..])).collect();
        for (h, size) in &sb {
            blobs.insert(*h, (super::scan::BlobSource::Remote(t.blob_key(h)), *size));
        }
        shard_blobs.push(sb.iter().map(|(h, _)| *h).collect());
    }
    let scanned = super::scan::Scanned {
        entries: std::mem::take(&mut v.entries),
        shards: std::mem::take(&mut v.shards),
        blobs,
        shard_blobs,
        left_out: Vec::new(),
    };
    Ok((v, scanned))
}

/// After a version was restored into the running cluster: the backup becomes a source
/// of its blobs (nodes refill from it), without counting as a backup that just ran.
pub async fn record_source(
    meta: &mut locus_proto::client::MetadataClient,
    url: &str,
    snapshot: &str,
) -> Result<()> {
    meta.record_backup(locus_proto::pb::RecordBackupRequest {
        url: url.to_string(),
        snapshot: snapshot.to_string(),
        restored: true,
    })
    .await?;
    Ok(())
}
