//! The repair loop: keeps every shard at its version's replication factor.
//!
//! Every `repair_interval` it asks the catalogue for under-replicated shards (replicas on
//! down or draining nodes do not count), orders each chosen target node to copy the
//! shard's blobs from a live replica (the node verifies every byte) — or, when no replica
//! is left, to copy them back from a recorded backup or the version's origin — and only then
//! records the new replica, and drops the ones that no longer count, in one catalogue
//! write. A failed copy changes nothing and is retried on the next round.

use std::sync::Arc;
use std::time::Duration;

use locus_proto::{nodepb, DatasetRef, NodeId, VersionSel};
use tokio::task::JoinSet;

use crate::catalog::{Catalog, RepairTask};
use crate::metrics::{Metrics, ReasonLabel};

/// Shards repaired at once.
const PARALLEL: usize = 4;

/// What the service presents to a node it orders to copy: a grant it signs itself, for
/// that node and that copy only. Nodes are never sent a token (one that reached a node
/// could be replayed by it to act for others); None: the cluster runs without tokens.
#[derive(Clone)]
pub struct CopyOrders {
    pub keys: Option<Arc<crate::grant_keys::GrantKeys>>,
    pub cluster_id: String,
}

impl CopyOrders {
    /// An import grant for `node` (FetchBlobs and nothing wider) lasting `ttl`.
    pub fn grant(&self, node: &str, who: &str, ttl: Duration) -> Option<String> {
        let keys = self.keys.as_ref()?;
        let now = locus_proto::grant::now_ms();
        let ttl = ttl.min(locus_proto::grant::MAX_TTL);
        Some(keys.sign(&locus_proto::grant::GrantBody {
            cluster_id: self.cluster_id.clone(),
            node: node.to_string(),
            operation: locus_proto::grant::Op::Import.as_str().into(),
            target: String::new(),
            issued_to: who.to_string(),
            not_before_unix_ms: now,
            expires_unix_ms: now + ttl.as_millis() as u64,
            ..Default::default()
        }))
    }
}

pub async fn run(
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    orders: CopyOrders,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let every = catalog.config().repair_interval;
    let mut reported_lost = 0usize;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // In a group only the leader repairs.
        if !catalog.acting() {
            continue;
        }
        let c = catalog.clone();
        let (tasks, lost, under) = match tokio::task::spawn_blocking(move || c.repair_plan(64)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                tracing::error!("repair planning failed: {e}");
                continue;
            }
            Err(e) => {
                tracing::error!("repair planning task failed: {e}");
                continue;
            }
        };
        metrics.shards_lost.set(lost.len() as i64);
        metrics.shards_under_replicated.set(under as i64);
        if lost.len() != reported_lost {
            for l in lost.iter().take(10) {
                tracing::error!("{l}");
            }
            reported_lost = lost.len();
        }
        let mut set = JoinSet::new();
        for t in tasks {
            while set.len() >= PARALLEL {
                let _ = set.join_next().await;
            }
            let c = catalog.clone();
            let m = metrics.clone();
            let orders = orders.clone();
            set.spawn(async move {
                let label = match repair_one(&c, &t, &orders, "repair").await {
                    Ok(()) => {
                        m.repair_bytes.inc_by(t.bytes);
                        tracing::info!(
                            dataset = %t.dataset, version = t.version, shard = t.shard,
                            from = %t.source.as_ref().map_or("a backup or the origin", |s| s.0.as_str()),
                            to = %t.target.0, dropped = ?t.drop,
                            "shard re-replicated"
                        );
                        "ok"
                    }
                    Err(e) => {
                        tracing::warn!(
                            dataset = %t.dataset, version = t.version, shard = t.shard,
                            to = %t.target.0, "repair failed, will retry: {e}"
                        );
                        "failed"
                    }
                };
                m.repairs
                    .get_or_create(&ReasonLabel { reason: label.into() })
                    .inc();
            });
        }
        while set.join_next().await.is_some() {}
    }
}

/// Copies one shard to its target peer to peer (verified, pinned) and records the new
/// replica; also what `Warm` runs for each of its copies.
pub async fn repair_one(
    catalog: &Arc<Catalog>,
    t: &RepairTask,
    orders: &CopyOrders,
    who: &str,
) -> Result<(), String> {
    let r = DatasetRef {
        name: t.dataset.as_str().try_into().map_err(|e| format!("{e}"))?,
        version: VersionSel::Number(t.version),
    };
    let c = catalog.clone();
    let r2 = r.clone();
    let shard = t.shard;
    let blobs = tokio::task::spawn_blocking(move || c.version_shard_blobs(&r2, shard))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let chunk_size = blobs.first().map_or(0, |b| b.2);
    // No live replica: the target may end at the version's origin, and needs to know
    // which file holds each blob there.
    let origin = match &t.source {
        Some(_) => None,
        None => {
            let (c, r2) = (catalog.clone(), r.clone());
            tokio::task::spawn_blocking(move || c.shard_origin(&r2, shard))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?
        }
    };
    // A copy gets a minute plus time for its bytes at a slow 20 MB/s; a target or source
    // that hangs must not hold a repair slot forever.
    let bytes: u64 = blobs.iter().map(|b| b.1).sum();
    let limit = Duration::from_secs(60) + Duration::from_secs_f64(bytes as f64 / 20e6);
    let grant = orders.grant(&t.target.0, who, limit + Duration::from_secs(60));
    let mut node = locus_proto::client::connect_node(&t.target.1, grant.as_deref(), Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    let call = node.fetch_blobs(nodepb::FetchBlobsRequest {
        // No live replica: the target finds each blob itself (a backup, the origin).
        source: t.source.as_ref().map(|s| s.1.clone()).unwrap_or_default(),
        blobs: blobs
            .iter()
            .map(|(h, size, _)| nodepb::BlobRef {
                hash: h.0.to_vec(),
                size: *size,
                origin_path: origin
                    .as_ref()
                    .and_then(|o| o.1.get(h).cloned())
                    .unwrap_or_default(),
            })
            .collect(),
        pin: true,
        chunk_size,
        origin: origin.as_ref().map(|o| o.0.clone()).unwrap_or_default(),
        origin_dataset: t.dataset.clone(),
        origin_version: t.version,
    });
    tokio::time::timeout(limit, call)
        .await
        .map_err(|_| format!("{}: no answer within {}s", t.target.0, limit.as_secs()))?
        .map_err(|s| format!("{}: {}", t.target.0, s.message()))?;
    let add = vec![NodeId::try_from(t.target.0.as_str()).map_err(|e| e.to_string())?];
    let remove = t
        .drop
        .iter()
        .map(|n| NodeId::try_from(n.as_str()).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let c = catalog.clone();
    tokio::task::spawn_blocking(move || c.update_replicas(&r, shard, &add, &remove))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Runs a warm-up's copies, four at a time, sending progress after each; stops starting
/// new ones when the caller goes away.
pub async fn warm(
    catalog: Arc<Catalog>,
    orders: CopyOrders,
    who: String,
    plan: crate::catalog::WarmPlan,
    tx: tokio::sync::mpsc::Sender<Result<locus_proto::pb::WarmProgress, tonic::Status>>,
) {
    let mut p = locus_proto::pb::WarmProgress {
        version: plan.version,
        copies_total: plan.tasks.len() as u32,
        bytes_total: plan.tasks.iter().map(|t| t.bytes).sum(),
        bytes_already: plan.bytes_already,
        ..Default::default()
    };
    let _ = tx.send(Ok(p.clone())).await;
    let mut set = tokio::task::JoinSet::new();
    let mut tasks = plan.tasks.into_iter();
    loop {
        while set.len() < 4 {
            let Some(t) = tasks.next() else { break };
            let (c, orders, who) = (catalog.clone(), orders.clone(), format!("warm:{who}"));
            set.spawn(async move {
                let r = crate::repair::repair_one(&c, &t, &orders, &who).await;
                (t, r)
            });
        }
        let Some(done) = set.join_next().await else { break };
        let Ok((t, r)) = done else { continue };
        p.message.clear();
        match r {
            Ok(()) => {
                p.copies_done += 1;
                p.bytes_done += t.bytes;
            }
            Err(e) => {
                p.copies_failed += 1;
                p.message = format!("shard {} to {}: {e}", t.shard, t.target.0);
            }
        }
        if tx.send(Ok(p.clone())).await.is_err() {
            // The caller went away; copies in flight finish, nothing new starts.
            return;
        }
    }
    p.message.clear();
    p.finished = true;
    let _ = tx.send(Ok(p)).await;
}
