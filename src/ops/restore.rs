//! Restores: a snapshot's catalogue fetched and checked, written into a new metadata
//! store, or one version of it read out to be imported again (`import::commit_scanned`).

use std::collections::HashMap;
use std::path::Path;

use locus_backup::{blob, SnapshotManifest, Target};

use super::backup::{io, joined, BackupOpError};

type Result<T, E = BackupOpError> = std::result::Result<T, E>;

/// A snapshot's catalogue, downloaded to a temp file and checked whole against its
/// manifest before anything uses it; with the snapshot's id and manifest.
pub async fn fetch_catalog(
    t: &Target,
    snapshot: Option<&str>,
) -> Result<(String, SnapshotManifest, std::fs::File)> {
    let snap = t.committed_snapshot(snapshot).await?;
    let manifest = snap
        .manifest
        .clone()
        .ok_or_else(|| BackupOpError::Invalid(format!("snapshot {} has no manifest.json", snap.id)))?;
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
    Ok((snap.id, manifest, file))
}

/// Writes a fetched catalogue into a new metadata store at `dir/db` (the directory must
/// be new or empty). On failure the store is removed again.
pub async fn restore_catalog(
    mut file: std::fs::File,
    dir: &Path,
    url: &str,
    snapshot: &str,
) -> Result<locus_metadata::snapshot::RestoreStats> {
    std::fs::create_dir_all(dir).map_err(io(&format!("cannot create {}", dir.display())))?;
    let db = dir.join("db");
    let (url, id, db2) = (url.to_string(), snapshot.to_string(), db.clone());
    let r = tokio::task::spawn_blocking(move || {
        let store =
            locus_metadata::store::RocksStore::open(&db2).map_err(|e| BackupOpError::Store(e.to_string()))?;
        use std::io::Seek;
        file.rewind().map_err(io("the catalogue's temp file"))?;
        Ok::<_, BackupOpError>(locus_metadata::snapshot::restore(file, &store, &url, &id)?)
    })
    .await
    .map_err(joined)?;
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&db);
    }
    r
}

/// One version of a fetched catalogue (`number` None: the newest it holds), with the
/// blobs of each shard to be read from `t` where no node still has them.
pub async fn read_version(
    t: &Target,
    mut file: std::fs::File,
    dataset: &str,
    number: Option<u64>,
) -> Result<(locus_metadata::snapshot::ExportedVersion, super::scan::Scanned)> {
    let name = dataset.to_string();
    let mut v = tokio::task::spawn_blocking(move || {
        use std::io::Seek;
        file.rewind().map_err(io("the catalogue's temp file"))?;
        Ok::<_, BackupOpError>(locus_metadata::snapshot::version_from_export(
            file, &name, number,
        )?)
    })
    .await
    .map_err(joined)??;
    let mut blobs = HashMap::new();
    let mut shard_blobs = Vec::with_capacity(v.shard_blobs.len());
    for sb in &v.shard_blobs {
        for (h, size) in sb {
            blobs.insert(*h, (super::scan::BlobSource::Remote(t.blob_key(h)), *size));
        }
        shard_blobs.push(sb.iter().map(|(h, _)| *h).collect());
    }
    let scanned = super::scan::Scanned {
        entries: std::mem::take(&mut v.entries),
        shards: std::mem::take(&mut v.shards),
        blobs,
        shard_blobs,
    };
    Ok((v, scanned))
}
