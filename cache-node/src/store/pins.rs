//! Which blobs are pinned (kept, never evicted) and why: a listing of what this node
//! must hold (pin sync), or a writer's word (an import, a copy, a fetch asked to pin),
//! which pin sync keeps while an import that may name the blob is still open.

use std::collections::HashSet;

use locus_proto::BlobHash;
use prost::Message;

use super::{BlobStore, StoreError};

/// Now in seconds since the epoch, as a writer's pin records it (u32: until 2106).
pub(crate) fn unix_secs() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
        .unwrap_or(0)
}

impl BlobStore {
    pub fn is_pinned(&self, h: &BlobHash) -> bool {
        self.shard(h).blobs.get(h).is_some_and(|m| m.rec.pinned)
    }

    /// Pins or unpins one present blob at a writer's word (an import, a copy, a fetch
    /// asked to pin). A writer's pin is stamped with the time, so that pin sync keeps it
    /// while an import that may name the blob is still open (`sync_pins`). Returns false
    /// if the blob is not here.
    pub fn set_pinned(&self, h: &BlobHash, pinned: bool) -> Result<bool, StoreError> {
        self.repin(h, pinned, pinned.then(unix_secs))
    }

    /// Sets a blob's pin; `stamp`: the writer's pin time to record (None keeps the one
    /// recorded while pinned, and clears it when unpinned). Writes the record only when
    /// something changed.
    fn repin(&self, h: &BlobHash, pinned: bool, stamp: Option<u32>) -> Result<bool, StoreError> {
        let mut sh = self.shard(h);
        let Some(m) = sh.blobs.get_mut(h) else {
            return Ok(false);
        };
        let at = match (pinned, stamp) {
            (_, Some(t)) => t,
            (true, None) => m.rec.pinned_at,
            (false, None) => 0,
        };
        if m.rec.pinned == pinned && m.rec.pinned_at == at {
            return Ok(true);
        }
        let was = m.rec.pinned;
        m.rec.pinned = pinned;
        m.rec.pinned_at = at;
        let rec = m.rec.clone();
        if was != pinned {
            let key = (m.last_access, *h);
            if pinned {
                sh.lru.remove(rec.team_id(), &key);
            } else {
                sh.lru.insert(rec.team_id(), key);
            }
            let mut b = self.books();
            b.remove(rec.size, !pinned, rec.team_id());
            b.add(rec.size, pinned, rec.team_id());
        }
        drop(sh);
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        Ok(true)
    }

    /// Makes the pinned set `want` (blobs not here are ignored), except that a blob a
    /// writer pinned at or after `keep_since` (unix seconds) stays pinned: an import
    /// still open when the listing was read names its blobs in no listing until it
    /// commits, and unpinning them would leave an import's acknowledged blobs evictable
    /// (and cost a record write per blob, then another to pin it again at the commit).
    /// Returns (pins changed, writers' pins kept).
    pub fn sync_pins(&self, want: &HashSet<BlobHash>, keep_since: u32) -> Result<(usize, usize), StoreError> {
        let mut changes: Vec<(BlobHash, bool)> = Vec::new();
        let mut kept = 0;
        self.each_meta(|h, m, partial| {
            if partial || m.rec.pinned == want.contains(h) {
                return;
            }
            if m.rec.pinned && m.rec.pinned_at != 0 && m.rec.pinned_at >= keep_since {
                kept += 1;
                return;
            }
            changes.push((*h, !m.rec.pinned));
        });
        for (h, p) in &changes {
            self.repin(h, *p, None)?;
        }
        Ok((changes.len(), kept))
    }
}

#[cfg(test)]
mod tests;
