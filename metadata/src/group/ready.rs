//! What a member waits for before it serves — the group's catalogue in its own state, and
//! the group's grant keys — and where those keys are kept (`GroupRing`).

use std::sync::Arc;
use std::time::Duration;

use super::{Group, GroupError, ReplicatedStore};
use crate::store::{Batch, KvStore, Table};

impl Group {
    /// Waits until the group's catalogue is set up in this member's state, or this member
    /// leads (and sets it up itself when `Catalog::open` finds none). A member that is
    /// not the leader cannot set it up — its write is refused as a follower's — so one
    /// that starts before the entry reached it (a member of a new group, or one killed
    /// before it applied that entry and restarted while the group had no leader) used to
    /// exit with "has to forward request to: None".
    pub async fn catalogue_ready(
        self: &Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), GroupError> {
        let mut waited = false;
        loop {
            let here = self
                .state
                .get(Table::Meta, crate::keys::META_SCHEMA)
                .map_err(|e| GroupError::State(format!("reading this member's state: {e}")))?;
            if here.is_some() || (self.is_leader() && self.linearize().await.is_ok()) {
                return Ok(());
            }
            if !waited {
                tracing::info!("waiting for the group's catalogue to reach this member");
                waited = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop.wait_for(|s| *s) => {
                    return Err(GroupError::State("stopped while waiting for the group's catalogue".into()))
                }
            }
        }
    }

    /// The group's grant keys: made by the first leader (from the single key of a group
    /// that predates key rings, if it has one), replicated to every member, so a grant
    /// signed before a failover is still accepted after it. Waits for them, until `stop`.
    pub async fn grant_keys(
        self: &Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<crate::grant_keys::KeyRing, GroupError> {
        use crate::grant_keys::{KeyRing, RingStore};
        let bad = |e: String| GroupError::State(format!("the group's grant keys: {e}"));
        loop {
            if let Some(b) = GroupRing(self.clone()).load().map_err(|e| bad(e.to_string()))? {
                return KeyRing::decode(&b, "in the group's state").map_err(|e| bad(e.to_string()));
            }
            if self.is_leader() && self.linearize().await.is_ok() && !self.has_keys() {
                let now = locus_proto::grant::now_ms();
                let legacy = self
                    .state
                    .get(Table::Raft, LEGACY_GRANT_KEY)
                    .map_err(|e| bad(e.to_string()))?;
                let ring = match legacy {
                    Some(pkcs8) => KeyRing::from_legacy(&pkcs8, now),
                    None => KeyRing::fresh(now),
                }
                .map_err(|e| bad(e.to_string()))?;
                let mut b = Batch::default();
                b.put(Table::Raft, GRANT_KEYS, ring.encode());
                match tokio::time::timeout(Duration::from_secs(30), self.raft.client_write(b)).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => tracing::warn!("writing the group's grant keys: {e}; retrying"),
                    Err(_) => {
                        tracing::warn!("writing the group's grant keys: no quorum within 30 s; retrying")
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop.wait_for(|s| *s) => {
                    return Err(GroupError::State("stopped while waiting for the group's grant keys".into()))
                }
            }
        }
    }

    fn has_keys(&self) -> bool {
        self.state.get(Table::Raft, GRANT_KEYS).ok().flatten().is_some()
    }
}

/// The group's key ring in its replicated state (the `raft` table: never exported).
const GRANT_KEYS: &[u8] = b"grant_keys";
/// The single key groups kept before key rings.
const LEGACY_GRANT_KEY: &[u8] = b"grant_key";

/// Where a group keeps its grant keys: read from this member's state, written through
/// the log (so a rotation reaches every member, and only members).
pub struct GroupRing(pub Arc<Group>);

impl crate::grant_keys::RingStore for GroupRing {
    fn load(&self) -> Result<Option<Vec<u8>>, crate::grant_keys::KeyRingError> {
        self.0
            .state
            .get(Table::Raft, GRANT_KEYS)
            .map_err(|e| crate::grant_keys::KeyRingError::Store {
                place: self.place(),
                reason: e.to_string(),
            })
    }
    fn store(&self, bytes: Vec<u8>) -> Result<(), crate::grant_keys::KeyRingError> {
        let mut b = Batch::default();
        b.put(Table::Raft, GRANT_KEYS, bytes);
        ReplicatedStore(self.0.clone())
            .write(b, true)
            .map_err(|e| crate::grant_keys::KeyRingError::Store {
                place: self.place(),
                reason: e.to_string(),
            })
    }
    fn place(&self) -> String {
        "in the metadata group's state".into()
    }
}
