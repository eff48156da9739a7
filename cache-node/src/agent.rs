//! The node's conversation with the metadata service: registration and heartbeats on one
//! task, pin sync on another.
//!
//! The heartbeat loop proves the node is alive, so it never awaits anything long: each
//! heartbeat is bounded by a timeout shorter than the metadata service's liveness window
//! would tolerate, reads the store's figures and the refill's progress (both cheap), and
//! sends them. Pin sync lists the blobs this node must hold, pins exactly those, and hands
//! the missing ones to the refill workers — it never copies a blob itself, however many
//! are missing. A refill of a whole disk therefore runs for hours while the node stays up
//! and says how far it has got.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use locus_proto::{pb, BlobHash};
use tonic::Status;

use crate::refill::{Refill, Wanted};
use crate::store::BlobStore;
use crate::{NodeConfig, Peers};

/// Longest a single heartbeat or registration call may take before the loop moves on.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest one page of the blobs this node must hold may take.
const PAGE_TIMEOUT: Duration = Duration::from_secs(60);

async fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    tokio::time::timeout(CALL_TIMEOUT, f).await.unwrap_or_else(|_| {
        Err(Status::deadline_exceeded(format!(
            "{what}: no answer within {CALL_TIMEOUT:?}"
        )))
    })
}

async fn register(cfg: &NodeConfig, advertise: &str, store: &BlobStore, peers: &Peers) -> Result<(), Status> {
    let s = store.stats();
    let mut m = peers.metadata().await?;
    m.register_node(pb::RegisterNodeRequest {
        id: cfg.id.to_string(),
        address: advertise.to_string(),
        labels: cfg.labels.clone(),
        capacity_bytes: s.capacity,
        free_bytes: s.placeable,
        used_bytes: s.used,
    })
    .await?;
    Ok(())
}

/// Shared between the heartbeat and pin-sync tasks.
pub struct Agent {
    pub cfg: NodeConfig,
    pub advertise: String,
    pub store: Arc<BlobStore>,
    pub peers: Arc<Peers>,
    pub refill: Arc<Refill>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Set once registered (and again after the service forgot us); pin sync waits for it.
    registered: tokio::sync::watch::Sender<bool>,
}

impl Agent {
    pub fn new(
        cfg: NodeConfig,
        advertise: String,
        store: Arc<BlobStore>,
        peers: Arc<Peers>,
        refill: Arc<Refill>,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            advertise,
            store,
            peers,
            refill,
            metrics,
            registered: tokio::sync::watch::channel(false).0,
        })
    }

    /// Registration and heartbeats, until stopped. Nothing else runs on this task.
    pub async fn heartbeats(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if !*self.registered.borrow() {
                match bounded(
                    "register",
                    register(&self.cfg, &self.advertise, &self.store, &self.peers),
                )
                .await
                {
                    Ok(()) => {
                        tracing::info!(node = %self.cfg.id, "registered with the metadata service");
                        self.registered.send_replace(true);
                    }
                    Err(s) => tracing::warn!("cannot register yet: {}", s.message()),
                }
            } else {
                let s = self.store.stats();
                let r = self.refill.progress();
                self.metrics.refill(&r);
                let hb = async {
                    self.peers
                        .metadata()
                        .await?
                        .heartbeat(pb::HeartbeatRequest {
                            id: self.cfg.id.to_string(),
                            free_bytes: s.placeable,
                            used_bytes: s.used,
                            pinned_bytes: s.pinned,
                            cached_bytes: s.cached,
                            blobs: s.blobs,
                            quarantined: s.quarantined,
                            refill_blobs: r.blobs,
                            refill_bytes: r.bytes,
                            refill_rate: r.rate,
                            refill_failing: r.failing,
                        })
                        .await
                };
                match bounded("heartbeat", hb).await {
                    Ok(_) => {}
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        self.registered.send_replace(false);
                    }
                    Err(s) => tracing::warn!("heartbeat failed: {}", s.message()),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.heartbeat_interval) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// Pin sync every `pin_sync_interval`, and at once after a quarantine, until stopped.
    pub async fn pin_sync(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut registered = self.registered.subscribe();
        loop {
            tokio::select! {
                r = registered.wait_for(|r| *r) => if r.is_err() { return },
                _ = stop.wait_for(|s| *s) => return,
            }
            match self.sync_once().await {
                Ok((changed, missing)) if changed + missing > 0 => {
                    tracing::info!(changed, missing, "pins synced with the metadata service")
                }
                Ok(_) => {}
                Err(s) => tracing::warn!("pin sync failed: {}", s.message()),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.pin_sync_interval) => {}
                _ = self.store.quarantine_events.notified() => {
                    self.metrics.corrupt.inc();
                }
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// Pins exactly the blobs this node's shards need and queues the missing ones for the
    /// refill workers. Returns (pins changed, blobs missing).
    async fn sync_once(&self) -> Result<(usize, usize), Status> {
        let mut m = self.peers.metadata().await?;
        let mut want: HashMap<BlobHash, (u64, u32)> = HashMap::new();
        let mut token = Vec::new();
        loop {
            let page = m.list_node_blobs(pb::ListNodeBlobsRequest {
                node: self.cfg.id.to_string(),
                page_token: token,
                limit: 0,
            });
            // A hung service costs this sync one page's timeout; the next sync tries again.
            let r = tokio::time::timeout(PAGE_TIMEOUT, page)
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(format!("ListNodeBlobs: no answer within {PAGE_TIMEOUT:?}"))
                })??
                .into_inner();
            for b in r.blobs {
                let h = BlobHash::from_slice("hash", &b.hash)?;
                want.insert(h, (b.size, b.chunk_size));
            }
            if r.next_page_token.is_empty() {
                break;
            }
            token = r.next_page_token;
        }
        let set: HashSet<BlobHash> = want.keys().copied().collect();
        let st = self.store.clone();
        let changed = tokio::task::spawn_blocking(move || st.sync_pins(&set))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(crate::service::to_status)?;
        let missing: Vec<Wanted> = want
            .into_iter()
            .filter(|(h, _)| !self.store.contains(h))
            .map(|(hash, (size, chunk_size))| Wanted {
                hash,
                size,
                chunk_size,
            })
            .collect();
        let n = missing.len();
        self.refill.set_missing(missing);
        Ok((changed, n))
    }
}
