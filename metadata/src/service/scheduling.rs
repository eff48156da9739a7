//! What schedulers and operators ask of placement: Locality (ranked nodes for versions)
//! and Warm (copies onto chosen nodes, progress streamed).

use std::collections::HashSet;

use locus_proto::{pb, NodeId};
use tonic::Status;

use super::{to_status, version_ref, MetadataService};
use crate::auth::Principal;

impl MetadataService {
    pub(super) async fn locality_of(&self, q: pb::LocalityRequest) -> Result<pb::LocalityResponse, Status> {
        crate::locality::check_request(q.refs.len(), q.path_prefixes.len(), q.shards.len(), q.nodes.len())
            .map_err(Status::invalid_argument)?;
        let refs = q
            .refs
            .into_iter()
            .map(|r| version_ref(Some(r)))
            .collect::<Result<Vec<_>, _>>()?;
        for p in &q.path_prefixes {
            locus_proto::RelPath::check_dir(p.trim_end_matches('/'))
                .map_err(|e| e.within("path_prefixes"))?;
        }
        let shards: Option<HashSet<u32>> = (!q.shards.is_empty()).then(|| q.shards.into_iter().collect());
        let limit = if q.limit == 0 {
            usize::MAX
        } else {
            q.limit as usize
        };
        let out = self
            .run(move |c| {
                c.locality(
                    &refs,
                    shards.as_ref(),
                    &q.path_prefixes,
                    &q.nodes,
                    &q.selector,
                    (limit, q.labels),
                )
            })
            .await
            .map_err(to_status)?;
        Ok(out)
    }

    /// Plans the copies and starts them; progress arrives on the returned channel.
    pub(super) async fn warm_copies(
        &self,
        who: Principal,
        q: pb::WarmRequest,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<pb::WarmProgress, Status>>, Status> {
        let r = version_ref(q.r#ref)?;
        for n in &q.nodes {
            NodeId::try_from(n.as_str()).map_err(|e| e.within("nodes"))?;
        }
        let target = format!("{r} on {}", q.nodes.join(","));
        let nodes = q.nodes.clone();
        let planned = self.run(move |c| c.warm_plan(&r, &nodes)).await;
        self.audit(&who, "warm", &target, &planned, |p| {
            format!("{} copies planned", p.tasks.len())
        });
        let mut plan = planned.map_err(to_status)?;
        let outside: u64 = plan.origin.iter().map(|t| t.bytes).sum();
        if outside > 0 {
            let copies = plan.origin.len();
            if !plan.outside_source {
                return Err(Status::failed_precondition(format!(
                    "{copies} shard copies ({outside} bytes) have no live replica to copy from, and the \
                     version has no origin and no backup is recorded; bring a node holding them back \
                     or re-import"
                )));
            }
            if outside > q.max_origin_bytes {
                return Err(Status::failed_precondition(format!(
                    "{copies} shard copies ({outside} bytes) have no live replica to copy from; they \
                     would come from a backup or the version's origin, which the budget \
                     (--max-origin-bytes {}) does not allow: allow {outside} bytes or bring a node \
                     holding them back",
                    q.max_origin_bytes
                )));
            }
            // Within the budget: the targets copy those from a backup, else the origin.
            plan.tasks.append(&mut plan.origin);
        }
        // Every copy is a pinned replica more: it must fit the dataset's teams' quotas.
        let adds: u64 = plan.tasks.iter().map(|t| t.bytes).sum();
        if adds > 0 {
            let dataset = plan.tasks[0].dataset.clone();
            self.within_quota(super::QuotaFor::Dataset(dataset), adds).await?;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let catalog = self.catalog.clone();
        tokio::spawn(crate::repair::warm(
            catalog,
            self.orders.clone(),
            who.name.clone(),
            plan,
            tx,
        ));
        Ok(rx)
    }
}
