//! Space: reserving room for a write before its first byte lands, evicting unpinned
//! blobs (least recently used first) when the node is over capacity or the disk is short.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use locus_proto::BlobHash;

use super::*;

impl BlobStore {
    /// Reserves room for `size` bytes, evicting unpinned blobs if needed. The returned
    /// guard releases the reservation when dropped.
    pub(super) fn reserve(self: &Arc<Self>, size: u64) -> Result<(u32, Reservation), StoreError> {
        // The data dir with the most free space takes the blob.
        let (dir, free) = self
            .cfg
            .dirs
            .iter()
            .enumerate()
            .map(|(i, d)| (i as u32, fs_free(d).unwrap_or(0).saturating_sub(self.cfg.reserve)))
            .max_by_key(|(_, f)| *f)
            .expect("at least one dir");
        let mut victims = Vec::new();
        let serial = lock(&self.evicting);
        let mut need = {
            let b = self.books();
            let over_cap = (b.used + b.reserved + size).saturating_sub(self.cfg.capacity);
            let need = over_cap.max(size.saturating_sub(free));
            // Every stored byte that is not pinned can go (complete or partial).
            if b.used - b.pinned < need {
                return Err(StoreError::Full {
                    need: size,
                    why: format!(
                        "capacity {} with {} pinned, {} reserved by writes in progress, {} free on disk \
                         above the reserve",
                        self.cfg.capacity, b.pinned, b.reserved, free
                    ),
                });
            }
            need
        };
        while need > 0 {
            let Some((size, path)) = self.evict_oldest() else {
                break;
            };
            victims.push(path);
            need = need.saturating_sub(size);
        }
        if need == 0 {
            self.books().reserved += size;
        }
        drop(serial);
        for path in victims {
            let _ = fs::remove_file(&path);
            if let Some(h) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| BlobHash::from_hex(n).ok())
            {
                let _ = self.index.delete(h.0);
                tracing::debug!(blob = %h, "evicted");
            }
        }
        if need > 0 {
            // Blobs were pinned between the check and the evictions.
            return Err(StoreError::Full {
                need: size,
                why: "the unpinned blobs were pinned while room was being made".into(),
            });
        }
        Ok((
            dir,
            Reservation {
                store: self.clone(),
                size,
            },
        ))
    }
}

impl BlobStore {
    /// Removes the least recently used unpinned blob from the maps and the books; its
    /// size and file, which the caller deletes. None when nothing is evictable.
    fn evict_oldest(&self) -> Option<(u64, PathBuf)> {
        loop {
            // Ticks are global, so the oldest blob is the oldest of the shards' oldest.
            let (key, i) = self
                .shards
                .iter()
                .enumerate()
                .filter_map(|(i, sh)| lock(sh).lru.first().map(|k| (*k, i)))
                .min()?;
            let mut sh = lock(&self.shards[i]);
            // Read or pinned since it was looked at: look again.
            if !sh.lru.remove(&key) {
                continue;
            }
            let h = key.1;
            let (m, path) = if let Some(m) = sh.blobs.remove(&h) {
                let p = self.blob_path_in(m.rec.dir, &h);
                (m, p)
            } else if let Some(m) = sh.partials.remove(&h) {
                let p = self.partial_path_in(m.rec.dir, &h);
                (m, p)
            } else {
                continue;
            };
            sh.verified.remove(&h);
            self.books().remove(m.rec.size, m.rec.pinned);
            return Some((m.rec.size, path));
        }
    }
}

/// Space held for a write in progress.
pub(super) struct Reservation {
    pub(super) store: Arc<BlobStore>,
    pub(super) size: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut b = self.store.books();
        b.reserved = b.reserved.saturating_sub(self.size);
    }
}
