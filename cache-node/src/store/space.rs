//! Space: reserving room for writes, evicting unpinned blobs (least recently used first)
//! when the node is over capacity or the disk is short. A whole-blob write reserves as
//! its bytes arrive, never on the word of whoever announced its size; a partial blob's
//! sparse file holds its (manifest-checked) size from the start.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use locus_proto::BlobHash;

use super::*;

impl BlobStore {
    /// Reserves room for `size` bytes, evicting unpinned blobs if needed. The returned
    /// guard releases the reservation when dropped.
    /// `keep` says whether the blob is pinned and whom it is cached for (`teams.rs`:
    /// whose blobs it may evict).
    pub(super) fn reserve(self: &Arc<Self>, size: u64, keep: Keep) -> Result<(u32, Reservation), StoreError> {
        let size = outboards::footprint(size);
        let (dir, free) = self.roomiest_dir();
        self.reserve_in(free, size, keep)?;
        Ok((
            dir,
            Reservation {
                store: self.clone(),
                size,
                dir,
                keep,
            },
        ))
    }

    /// Room for a write of `size` bytes that is reserved as its bytes arrive
    /// (`Reservation::grow_to`): what a caller announces evicts nothing until it is sent,
    /// so announcing a huge blob and sending nothing costs the cache nothing. Refused at
    /// once only when the size could never fit (beyond the capacity left unpinned).
    pub(super) fn reserve_as_written(
        self: &Arc<Self>,
        size: u64,
        keep: Keep,
    ) -> Result<(u32, Reservation), StoreError> {
        let (dir, free) = self.roomiest_dir();
        {
            let b = self.books();
            let room = self.cfg.capacity.saturating_sub(b.pinned + b.reserved);
            if size > room {
                return Err(StoreError::Full {
                    need: size,
                    why: format!(
                        "capacity {} with {} pinned and {} reserved by writes in progress (disk: {} \
                         free above the reserve)",
                        self.cfg.capacity, b.pinned, b.reserved, free
                    ),
                });
            }
        }
        Ok((
            dir,
            Reservation {
                store: self.clone(),
                size: 0,
                dir,
                keep,
            },
        ))
    }

    /// The data dir with the most free space (above the reserve), and that space.
    fn roomiest_dir(&self) -> (u32, u64) {
        self.cfg
            .dirs
            .iter()
            .enumerate()
            .map(|(i, d)| (i as u32, fs_free(d).unwrap_or(0).saturating_sub(self.cfg.reserve)))
            .max_by_key(|(_, f)| *f)
            .expect("at least one dir")
    }

    /// Holds `size` more bytes in data dir `dir` (with `free` bytes free there) for a
    /// write kept as `keep`, evicting unpinned blobs it may take (`teams.rs`), least
    /// recently used first, until they fit.
    fn reserve_in(&self, free: u64, size: u64, keep: Keep) -> Result<(), StoreError> {
        let team = keep.team;
        // The cache room the shares divide: what is not pinned nor held for writes, and,
        // once `shrunk`, less this write, which will be pinned (a cached write is part
        // of the room).
        let held = |b: &Books, shrunk: bool| b.pinned + b.reserved + if shrunk { size } else { 0 };
        let mut victims = Vec::new();
        let serial = lock(&self.evicting);
        let permilles = lock(&self.teams).permilles();
        let mut need = {
            let b = self.books();
            let over_cap = (b.used + b.reserved + size).saturating_sub(self.cfg.capacity);
            let need = over_cap.max(size.saturating_sub(free));
            // Every stored byte that is not pinned can go (complete or partial), but for
            // other teams' shares of the cache room left once this write is held.
            let room = self.cfg.capacity.saturating_sub(held(&b, keep.pin));
            let may_go: u64 = (b.team_cached.iter().enumerate())
                .map(|(t, c)| teams::evictable(t, team, *c, room, &permilles))
                .sum();
            if may_go < need {
                let cached = b.team_cached.clone();
                let (pinned, reserved) = (b.pinned, b.reserved);
                drop(b);
                return Err(StoreError::Full {
                    need: size,
                    why: format!(
                        "capacity {} with {} pinned, {} reserved by writes in progress, {} free on disk \
                         above the reserve{}",
                        self.cfg.capacity,
                        pinned,
                        reserved,
                        free,
                        self.held_by_shares(team, room, &cached, &permilles)
                    ),
                });
            }
            need
        };
        // A replica first takes what no share of the room as it is protects (untagged
        // blobs, teams' excess); only if that is not enough do the shares shrink with the
        // room it takes.
        let phases: &[bool] = if keep.pin { &[false, true] } else { &[false] };
        for &shrunk in phases {
            while need > 0 {
                let allowed = {
                    let b = self.books();
                    let room = self.cfg.capacity.saturating_sub(held(&b, shrunk));
                    let open: Vec<bool> = (b.team_cached.iter().enumerate())
                        .map(|(t, c)| teams::evictable(t, team, *c, room, &permilles) > 0)
                        .collect();
                    move |t: TeamId| open.get(t.0 as usize).copied().unwrap_or(false)
                };
                let Some((freed, h, file)) = self.evict_oldest(&allowed) else {
                    break;
                };
                victims.push((h, file));
                need = need.saturating_sub(freed);
            }
        }
        if need == 0 {
            self.books().reserved += size;
        }
        drop(serial);
        for (h, file) in victims {
            if let Some(path) = file {
                let _ = fs::remove_file(&path);
                Self::remove_outboard_of(&path);
            }
            let _ = self.index.delete(h.0);
            tracing::debug!(blob = %h, "evicted");
        }
        if need > 0 {
            // Blobs were pinned between the check and the evictions.
            return Err(StoreError::Full {
                need: size,
                why: "the unpinned blobs were pinned or read while room was being made".into(),
            });
        }
        Ok(())
    }
}

impl BlobStore {
    /// Removes the least recently used unpinned blob from the maps and the books; its
    /// size, hash and the file the caller deletes (a packed blob's pack only when it was
    /// the pack's last). None when nothing is evictable.
    fn evict_oldest(&self, allowed: &dyn Fn(TeamId) -> bool) -> Option<(u64, BlobHash, Option<PathBuf>)> {
        loop {
            // Ticks are global, so the oldest blob is the oldest of the shards' oldest.
            let (key, team, i) = self
                .shards
                .iter()
                .enumerate()
                .filter_map(|(i, sh)| lock(sh).lru.firsts(allowed).min().map(|(k, t)| (k, t, i)))
                .min()?;
            let mut sh = lock(&self.shards[i]);
            // Read or pinned since it was looked at: look again.
            if !sh.lru.remove(team, &key) {
                continue;
            }
            let h = key.1;
            let (m, path) = if let Some(m) = sh.blobs.remove(&h) {
                let p = if m.rec.pack != 0 {
                    self.release_packed(m.rec.pack)
                } else {
                    Some(self.blob_path_in(m.rec.dir, &h))
                };
                (m, p)
            } else if let Some(m) = sh.partials.remove(&h) {
                let p = self.partial_path_in(m.rec.dir, &h);
                (m, Some(p))
            } else {
                continue;
            };
            sh.verified.remove(&h);
            self.books().remove(m.rec.size, m.rec.pinned, m.rec.team_id());
            return Some((outboards::footprint(m.rec.size), h, path));
        }
    }
}

/// Space held for a write in progress.
pub(super) struct Reservation {
    pub(super) store: Arc<BlobStore>,
    pub(super) size: u64,
    dir: u32,
    /// Whether the bytes will be pinned, and whom they are cached for: whose cached blobs
    /// growing it may evict.
    pub(super) keep: Keep,
}

/// How far ahead of the bytes received a write reserves: one eviction pass per step,
/// not per message.
const GROW_STEP: u64 = 16 << 20;

impl Reservation {
    /// Moves what this reservation holds into a new one, leaving this one empty (a write
    /// handing its space on to the batch that commits it).
    pub(super) fn take(&mut self) -> Reservation {
        Reservation {
            store: self.store.clone(),
            size: std::mem::take(&mut self.size),
            dir: self.dir,
            keep: self.keep,
        }
    }
}

impl Reservation {
    /// Holds at least `total` bytes (at most `cap`, the announced size), reserving in
    /// steps ahead of it; `written` of them are on disk already.
    pub(super) fn grow_to(&mut self, written: u64, total: u64, cap: u64) -> Result<(), StoreError> {
        if total <= self.size {
            return Ok(());
        }
        let want = (total + GROW_STEP).min(cap.max(total));
        let free = fs_free(&self.store.cfg.dirs[self.dir as usize])
            .unwrap_or(0)
            .saturating_sub(self.store.cfg.reserve)
            // What this write holds but has not written yet is not free for it again.
            .saturating_sub(self.size.saturating_sub(written));
        self.store.reserve_in(free, want - self.size, self.keep)?;
        self.size = want;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut b = self.store.books();
        b.reserved = b.reserved.saturating_sub(self.size);
    }
}
