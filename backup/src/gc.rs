//! Retention and garbage collection of a backup target.
//!
//! Safe while a backup runs, by two rules:
//! - blobs named by any incomplete snapshot younger than `abandoned_after` are kept (a
//!   backup writes its blob list before it uploads or skips anything);
//! - collection announces itself in `gc/STATE` before it lists anything and again when
//!   done; a backup that saw a collection running when it started, or finds another one
//!   recorded when it is about to commit, re-checks every blob it skipped before it writes
//!   COMMITTED (the backup run's side, in the CLI).

use std::collections::HashSet;
use std::time::Duration;

use futures_util::StreamExt;
use locus_proto::manifest::BlobHash;
use object_store::ObjectStoreExt;
use serde::Serialize;

use crate::format::{new_snapshot_id, now_ms, GcState, SnapshotState};
use crate::retention::{self, Policy};
use crate::{BackupError, Result, Target};

#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    pub snapshots_kept: Vec<String>,
    pub snapshots_deleted: Vec<String>,
    /// Incomplete snapshots still protected (a backup may be running).
    pub snapshots_in_progress: Vec<String>,
    pub blobs_kept: u64,
    pub blobs_deleted: u64,
    pub bytes_deleted: u64,
    pub dry_run: bool,
}

/// Deletes every object under `snapshots/<id>/`, COMMITTED first so a half-deleted
/// snapshot is never mistaken for a valid one.
async fn delete_snapshot(t: &Target, id: &str) -> Result<()> {
    let committed = t.snapshot_key(id, "COMMITTED");
    match t.store.delete(&committed).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => {
            return Err(BackupError::store(
                format!("cannot delete {}", t.describe(&committed)),
                e,
            ))
        }
    }
    let dir = t.key(&format!("snapshots/{id}"));
    let mut listing = t.store.list(Some(&dir));
    while let Some(m) = listing.next().await {
        let m = m.map_err(|e| BackupError::store(format!("cannot list {}", t.describe(&dir)), e))?;
        match t.store.delete(&m.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                return Err(BackupError::store(
                    format!("cannot delete {}", t.describe(&m.location)),
                    e,
                ))
            }
        }
    }
    if let Some(root) = &t.local_root {
        // Object stores have no directories; a local one keeps them unless told.
        let _ = std::fs::remove_dir_all(root.join(dir.as_ref()));
    }
    Ok(())
}

/// Applies `policy` to the committed snapshots (an empty policy keeps them all), drops incomplete ones older than
/// `abandoned_after`, and deletes every blob no remaining snapshot needs.
pub async fn collect(
    t: &Target,
    policy: Policy,
    abandoned_after: Duration,
    dry_run: bool,
) -> Result<GcReport> {
    let started = now_ms();
    let state = GcState {
        id: new_snapshot_id(started),
        running: true,
        started_ms: started,
    };
    let marker = t.key("gc/STATE");
    if !dry_run {
        t.put_json(&marker, &state).await?;
    }
    let snaps = t.list_snapshots().await?;
    let committed: Vec<(String, i64)> = snaps
        .iter()
        .filter(|s| s.state == SnapshotState::Committed)
        .map(|s| (s.id.clone(), s.created_ms()))
        .collect();
    // No policy means no snapshot is due to go: only unreferenced blobs and abandoned
    // runs are collected.
    let kept = if policy.is_empty() {
        committed.iter().map(|(id, _)| id.clone()).collect()
    } else {
        retention::keep(&committed, policy)
    };
    let mut report = GcReport {
        dry_run,
        ..Default::default()
    };
    let mut protect = Vec::new();
    for s in &snaps {
        let keep = match s.state {
            SnapshotState::Committed => kept.contains(&s.id),
            SnapshotState::Incomplete => {
                let young = started - s.created_ms() < abandoned_after.as_millis() as i64;
                if young {
                    report.snapshots_in_progress.push(s.id.clone());
                }
                young
            }
        };
        if keep {
            if s.state == SnapshotState::Committed {
                report.snapshots_kept.push(s.id.clone());
            }
            protect.push(s.id.clone());
        } else {
            report.snapshots_deleted.push(s.id.clone());
        }
    }
    let mut referenced: HashSet<BlobHash> = HashSet::new();
    for id in &protect {
        match t.blob_list(id).await {
            Ok(l) => referenced.extend(l.0.into_iter().map(|(h, _)| h)),
            // An incomplete snapshot may not have written its list yet; a committed one
            // without a readable list is damage, and nothing may be deleted on its behalf.
            Err(e) if e.is_not_found() && !committed.iter().any(|(c, _)| c == id) => {}
            Err(e) => return Err(e),
        }
    }
    if !dry_run {
        for id in &report.snapshots_deleted {
            delete_snapshot(t, id).await?;
        }
    }
    let dir = t.key("blobs");
    let mut listing = t.store.list(Some(&dir));
    let mut doomed = Vec::new();
    while let Some(m) = listing.next().await {
        let m = m.map_err(|e| BackupError::store(format!("cannot list {}", t.describe(&dir)), e))?;
        match t.blob_of_key(&m.location) {
            Some(h) if referenced.contains(&h) => report.blobs_kept += 1,
            // Anything else under blobs/ (a stray temporary file) is left alone.
            None => {}
            Some(_) => {
                report.blobs_deleted += 1;
                report.bytes_deleted += m.size;
                doomed.push(m.location);
            }
        }
    }
    if !dry_run {
        let mut deletes = futures_util::stream::iter(doomed.into_iter().map(|k| async move {
            match t.store.delete(&k).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(BackupError::store(format!("cannot delete {}", t.describe(&k)), e)),
            }
        }))
        .buffer_unordered(16);
        while let Some(r) = deletes.next().await {
            r?;
        }
        t.put_json(
            &marker,
            &GcState {
                running: false,
                ..state
            },
        )
        .await?;
    }
    Ok(report)
}
