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

/// Why a registration failed.
enum Refused {
    /// Try again later (the service is unreachable, busy, or another live process holds
    /// the id: `Some(ms)`, when it would be declared down).
    Retry(Status, Option<u64>),
    /// Never: the data dir belongs to another cluster.
    Fatal(String),
}

impl From<Status> for Refused {
    fn from(s: Status) -> Self {
        Refused::Retry(s, None)
    }
}

/// `bounded` for a registration.
async fn bounded_refusal(f: impl std::future::Future<Output = Result<(), Refused>>) -> Result<(), Refused> {
    tokio::time::timeout(CALL_TIMEOUT, f).await.unwrap_or_else(|_| {
        Err(Refused::Retry(
            Status::deadline_exceeded(format!("register: no answer within {CALL_TIMEOUT:?}")),
            None,
        ))
    })
}

/// Shared between the heartbeat and pin-sync tasks.
pub struct Agent {
    pub cfg: NodeConfig,
    pub advertise: String,
    pub store: Arc<BlobStore>,
    pub peers: Arc<Peers>,
    pub refill: Arc<Refill>,
    pub metrics: Arc<crate::metrics::Metrics>,
    identity: std::sync::Mutex<crate::identity::Identity>,
    /// Set once registered (and again after the service forgot us); pin sync waits for it.
    registered: tokio::sync::watch::Sender<bool>,
    /// Why the node must stop, once it must.
    fatal: tokio::sync::watch::Sender<Option<String>>,
}

impl Agent {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: NodeConfig,
        advertise: String,
        identity: crate::identity::Identity,
        store: Arc<BlobStore>,
        peers: Arc<Peers>,
        refill: Arc<Refill>,
        metrics: Arc<crate::metrics::Metrics>,
        fatal: tokio::sync::watch::Sender<Option<String>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            advertise,
            store,
            peers,
            refill,
            metrics,
            identity: std::sync::Mutex::new(identity),
            registered: tokio::sync::watch::channel(false).0,
            fatal,
        })
    }

    fn instance(&self) -> String {
        self.identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .instance
            .clone()
    }

    /// Checks the service's cluster against the data dir's (binding a new data dir to
    /// it), then registers this node's address and identity.
    async fn register(&self) -> Result<(), Refused> {
        let mut m = self.peers.metadata().await?;
        let info = m
            .get_cluster_info(pb::GetClusterInfoRequest {})
            .await?
            .into_inner();
        self.identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .bind_cluster(&info.cluster_id)
            .map_err(|e| Refused::Fatal(e.to_string()))?;
        self.peers.grants.set(&info.cluster_id, info.grant_keys);
        let s = self.store.stats();
        let r = m
            .register_node(pb::RegisterNodeRequest {
                id: self.cfg.id.to_string(),
                address: self.advertise.clone(),
                labels: self.cfg.labels.clone(),
                capacity_bytes: s.capacity,
                free_bytes: s.placeable,
                used_bytes: s.used,
                instance: self.instance(),
            })
            .await;
        match r {
            Ok(r) => {
                self.peers.grants.set_keys(r.into_inner().grant_keys);
                Ok(())
            }
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                let ms = s
                    .metadata()
                    .get("locus-liveness-ms")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                Err(Refused::Retry(s, ms))
            }
            Err(s) => Err(s.into()),
        }
    }

    /// Registers before the node serves. While another live process holds this id, it
    /// retries until that one would be declared down (a node restarted on a wiped disk
    /// waits out its old self), then gives up: two live processes with one id is a
    /// configuration error. A service that cannot be reached is not: the heartbeat loop
    /// keeps trying.
    pub async fn first_registration(&self) -> Result<(), crate::NodeError> {
        let started = std::time::Instant::now();
        loop {
            match bounded_refusal(self.register()).await {
                Ok(()) => {
                    tracing::info!(node = %self.cfg.id, "registered with the metadata service");
                    self.registered.send_replace(true);
                    return Ok(());
                }
                Err(Refused::Fatal(why)) => return Err(crate::NodeError::Identity(why)),
                Err(Refused::Retry(s, Some(liveness_ms))) => {
                    let window = Duration::from_millis(liveness_ms) + Duration::from_secs(2);
                    if started.elapsed() >= window {
                        return Err(crate::NodeError::Identity(s.message().to_string()));
                    }
                    tracing::warn!(
                        "registration refused, retrying until the other holder of this id would be \
                         declared down: {}",
                        s.message()
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(Refused::Retry(s, None))
                    if matches!(
                        s.code(),
                        tonic::Code::PermissionDenied
                            | tonic::Code::Unauthenticated
                            | tonic::Code::InvalidArgument
                    ) =>
                {
                    // This credential or configuration will never register this node.
                    return Err(crate::NodeError::Identity(format!(
                        "the metadata service refused to register node {}: {}",
                        self.cfg.id,
                        s.message()
                    )));
                }
                Err(Refused::Retry(s, None)) => {
                    tracing::warn!("cannot register yet: {}", s.message());
                    return Ok(());
                }
            }
        }
    }

    fn stop(&self, why: String) {
        tracing::error!("{why}");
        self.fatal.send_replace(Some(why));
    }

    /// Registration and heartbeats, until stopped. Nothing else runs on this task.
    pub async fn heartbeats(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if !*self.registered.borrow() {
                match bounded_refusal(self.register()).await {
                    Ok(()) => {
                        tracing::info!(node = %self.cfg.id, "registered with the metadata service");
                        self.registered.send_replace(true);
                    }
                    Err(Refused::Fatal(why)) => return self.stop(why),
                    Err(Refused::Retry(s, _)) => tracing::warn!("cannot register yet: {}", s.message()),
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
                            instance: self.instance(),
                            leaving: false,
                            team_cache: (self.store.team_use().into_iter())
                                .filter(|u| u.cached > 0)
                                .map(|u| pb::TeamCache {
                                    team: u.name,
                                    cached_bytes: u.cached,
                                })
                                .collect(),
                        })
                        .await
                };
                match bounded("heartbeat", hb).await {
                    // A rotation of the grant keys reaches this node here.
                    Ok(r) => self.peers.grants.set_keys(r.into_inner().grant_keys),
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        self.registered.send_replace(false);
                    }
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                        // Another identity holds our id now: serving on would put two
                        // processes behind one name.
                        return self.stop(format!("stopping: {}", s.message()));
                    }
                    Err(s) => tracing::warn!("heartbeat failed: {}", s.message()),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.heartbeat_interval) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.goodbye().await
    }

    /// On a clean stop, gives the id up, so this node on a replaced disk (a new identity)
    /// can register at once instead of waiting to be declared down. Best effort, bounded.
    async fn goodbye(&self) {
        let registered = *self.registered.borrow();
        let stopping_on_error = self.fatal.borrow().is_some();
        if !registered || stopping_on_error {
            return;
        }
        let bye = async {
            self.peers
                .metadata()
                .await?
                .heartbeat(pb::HeartbeatRequest {
                    id: self.cfg.id.to_string(),
                    instance: self.instance(),
                    leaving: true,
                    ..Default::default()
                })
                .await
        };
        if let Err(s) = bounded("goodbye", bye).await {
            tracing::warn!("could not give the node id up on the way out: {}", s.message());
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

    /// Pins exactly the blobs this node's shards need (and keeps what open imports wrote
    /// pinned) and queues the missing ones for the refill workers. Returns (pins
    /// changed, blobs missing).
    async fn sync_once(&self) -> Result<(usize, usize), Status> {
        let mut m = self.peers.metadata().await?;
        let started = crate::store::unix_secs();
        // The oldest import session open while any page was read (service clock, ms).
        let mut open_since_ms: Option<i64> = None;
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
            if r.open_since_ms > 0 {
                open_since_ms = Some(open_since_ms.map_or(r.open_since_ms, |o| o.min(r.open_since_ms)));
            }
            for b in r.blobs {
                let h = BlobHash::from_slice("hash", &b.hash)?;
                want.insert(h, (b.size, b.chunk_size));
            }
            if r.next_page_token.is_empty() {
                break;
            }
            token = r.next_page_token;
        }
        // What writers pinned since the oldest open import began (else since this sync
        // began: an import begun after the listing was read writes after that) stays
        // pinned; the grace covers the clocks of this host and the service disagreeing.
        let since = match open_since_ms {
            Some(ms) => u32::try_from(ms / 1000).unwrap_or(u32::MAX),
            None => started,
        };
        let grace = u32::try_from(self.cfg.write_pin_grace.as_secs()).unwrap_or(u32::MAX);
        let keep_since = since.saturating_sub(grace);
        let set: HashSet<BlobHash> = want.keys().copied().collect();
        let st = self.store.clone();
        let (changed, kept) = tokio::task::spawn_blocking(move || st.sync_pins(&set, keep_since))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(crate::service::to_status)?;
        self.metrics
            .open_import_pinned
            .set(i64::try_from(kept).unwrap_or(i64::MAX));
        self.metrics.pin_syncs.inc();
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
