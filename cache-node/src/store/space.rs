//! Space: reserving room for a write before its first byte lands, evicting unpinned
//! blobs (least recently used first) when the node is over capacity or the disk is short.

use std::fs;
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
        {
            let mut st = self.state();
            let over_cap = (st.used + st.reserved + size).saturating_sub(self.cfg.capacity);
            let over_disk = size.saturating_sub(free);
            let mut need = over_cap.max(over_disk);
            if need > 0 {
                // Every stored byte that is not pinned can go (complete or partial).
                let evictable = st.used - st.pinned;
                if evictable < need {
                    return Err(StoreError::Full {
                        need: size,
                        why: format!(
                            "capacity {} with {} pinned, {} reserved by writes in progress, {} free on disk \
                             above the reserve",
                            self.cfg.capacity, st.pinned, st.reserved, free
                        ),
                    });
                }
                // Least recently used first.
                while need > 0 {
                    let Some((_, h)) = st.lru.pop_first() else { break };
                    let (m, path) = if let Some(m) = st.blobs.remove(&h) {
                        let p = self.blob_path_in(m.rec.dir, &h);
                        (m, p)
                    } else if let Some(m) = st.partials.remove(&h) {
                        let p = self.partial_path_in(m.rec.dir, &h);
                        (m, p)
                    } else {
                        continue;
                    };
                    st.used -= m.rec.size;
                    st.verified.remove(&h);
                    victims.push(path);
                    need = need.saturating_sub(m.rec.size);
                }
            }
            st.reserved += size;
        }
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
        Ok((
            dir,
            Reservation {
                store: self.clone(),
                size,
            },
        ))
    }
}

/// Space held for a write in progress.
pub(super) struct Reservation {
    pub(super) store: Arc<BlobStore>,
    pub(super) size: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut st = self.store.state();
        st.reserved = st.reserved.saturating_sub(self.size);
    }
}
