//! gRPC handlers: turn wire messages into validated domain values, run the catalogue on a
//! blocking thread, and map its errors to `Status` — the one place this service's errors
//! meet the outside world. Admin actions are written to the audit log here.

use std::sync::Arc;

use locus_proto::{pb, DatasetName, Entry, NodeId, VersionSel};
use tonic::{Request, Response, Status};

use crate::audit::AuditLog;
use crate::auth::{Action, Principal};
use crate::catalog::{Catalog, CatalogError, NodeRegistration, ShardSpec};
use crate::metrics::Metrics;

mod grants;
mod members;
mod mounts;
mod placement;
mod scheduling;
mod tenancy;
mod wire;

use tenancy::QuotaFor;
pub use wire::to_status;
use wire::{check_node_caller, page_limit, principal, version_ref};

pub struct MetadataService {
    catalog: Arc<Catalog>,
    audit: Arc<AuditLog>,
    metrics: Arc<Metrics>,
    /// What the service presents to cache nodes when it orders copies (warm-up).
    orders: crate::repair::CopyOrders,
    /// Sign the grants clients present to nodes instead of their tokens.
    grant_keys: Arc<crate::grant_keys::GrantKeys>,
    /// The replicated group this service is a member of, if any.
    group: Option<Arc<crate::group::Group>>,
    /// Which versions mounts serve now (soft state, this member's while it leads).
    mounts: crate::mounts::MountLeases,
    /// Held across a quota check and the record of what it let an import place
    /// (`SessionRecord.placed_bytes`), so two imports placed at once cannot both take the
    /// last room.
    quota_checks: tokio::sync::Mutex<()>,
    /// What each node last said it holds cached per team (soft state, from heartbeats).
    team_cache: std::sync::Mutex<std::collections::HashMap<String, Vec<(String, u64)>>>,
}

impl MetadataService {
    pub fn with_group(mut self, group: Option<Arc<crate::group::Group>>) -> Self {
        self.group = group;
        self
    }

    /// What is presented to cache nodes when the service orders copies.
    pub fn with_copy_orders(mut self, orders: crate::repair::CopyOrders) -> Self {
        self.orders = orders;
        self
    }

    pub fn new(
        catalog: Arc<Catalog>,
        audit: Arc<AuditLog>,
        metrics: Arc<Metrics>,
        grant_keys: Arc<crate::grant_keys::GrantKeys>,
    ) -> Self {
        Self {
            orders: crate::repair::CopyOrders {
                keys: None,
                cluster_id: catalog.cluster_id().to_string(),
            },
            catalog,
            audit,
            metrics,
            grant_keys,
            group: None,
            mounts: Default::default(),
            quota_checks: Default::default(),
            team_cache: Default::default(),
        }
    }

    /// Runs catalogue work off the async workers.
    async fn run<T, F>(&self, f: F) -> Result<T, CatalogError>
    where
        T: Send + 'static,
        F: FnOnce(&Catalog) -> Result<T, CatalogError> + Send + 'static,
    {
        let cat = self.catalog.clone();
        match tokio::task::spawn_blocking(move || f(&cat)).await {
            Ok(r) => r,
            // A panic is the service's fault: INTERNAL, never a precondition the caller
            // could fix.
            Err(e) => Err(CatalogError::Internal(format!("internal task failed: {e}"))),
        }
    }

    fn audit<T>(
        &self,
        who: &Principal,
        action: &str,
        target: &str,
        r: &Result<T, CatalogError>,
        ok: impl FnOnce(&T) -> String,
    ) {
        let result = match r {
            Ok(v) => Ok(ok(v)),
            Err(e) => Err(e.to_string()),
        };
        self.audit.record(who, action, target, result);
    }
}

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::metadata_server::Metadata for MetadataService {
    async fn get_cluster_info(&self, req: Request<pb::GetClusterInfoRequest>) -> Res<pb::ClusterInfo> {
        let p = principal(&req)?;
        let open_sessions = self.run(|c| c.open_sessions()).await.map_err(to_status)?;
        // Other teams' names and usage are not a scoped caller's to see.
        let teams = if p.is_scoped() {
            Vec::new()
        } else {
            self.run(|c| {
                c.config()
                    .teams
                    .iter()
                    .map(|t| {
                        Ok(pb::TeamUsage {
                            name: t.name.clone(),
                            datasets: t.patterns().to_vec(),
                            pinned_bytes: c.pinned_by(|d| t.covers(d))?,
                            pinned_limit_bytes: t.pinned_limit,
                            cached_bytes: 0,
                        })
                    })
                    .collect::<Result<Vec<_>, CatalogError>>()
            })
            .await
            .map_err(to_status)?
        };
        let mut teams = teams;
        for t in &mut teams {
            t.cached_bytes = self.team_cached(&t.name);
        }
        let (members, leader, member) = self.group.as_ref().map(|g| g.info()).unwrap_or_default();
        Ok(Response::new(pb::ClusterInfo {
            members,
            leader,
            member,
            applied_index: self.group.as_ref().map_or(0, |g| g.applied_index()),
            cluster_id: self.catalog.cluster_id().to_string(),
            server_version: env!("CARGO_PKG_VERSION").to_string(),
            schema_version: crate::records::SCHEMA_VERSION,
            uptime_ms: self.catalog.uptime_ms(),
            open_sessions,
            caller_role: p.role_name().to_string(),
            caller_scope: p.scope.as_ref().map(|s| s.describe()).unwrap_or_default(),
            caller_name: p.name,
            teams,
            grant_keys: self.grant_keys.verifying(),
            now_unix_ms: locus_proto::grant::now_ms(),
        }))
    }

    async fn issue_grant(&self, req: Request<pb::IssueGrantRequest>) -> Res<pb::IssueGrantResponse> {
        let p = principal(&req)?;
        self.grant(p, req.into_inner()).await.map(Response::new)
    }

    async fn register_node(&self, req: Request<pb::RegisterNodeRequest>) -> Res<pb::RegisterNodeResponse> {
        let p = principal(&req)?;
        let reg = NodeRegistration::try_from(req.into_inner())?;
        let id = reg.id.clone();
        let target = format!("{id} at {}", reg.address);
        if let Err(s) = check_node_caller(&p, &id) {
            self.audit
                .record(&p, "node.register", &target, Err(s.message().to_string()));
            return Err(s);
        }
        let r = self.run(move |c| c.register_node(reg)).await;
        self.audit(&p, "node.register", &target, &r, |replaced| match replaced {
            Some(old) => format!("took the id over from identity {old}, which was down"),
            None => "registered".into(),
        });
        let liveness = self.catalog.config().liveness_timeout.as_millis() as u64;
        match r {
            Ok(Some(old)) => {
                tracing::warn!(node = %id, replaced = %old, "node id taken over by a new identity (the old process was down)")
            }
            Ok(None) => {}
            Err(e) => {
                let mut s = to_status(e);
                if s.code() == tonic::Code::AlreadyExists {
                    // When the holder would be declared down: a restarted node whose data
                    // dir was wiped waits that long, a true duplicate gives up after it.
                    if let Ok(v) = liveness.to_string().parse() {
                        s.metadata_mut().insert("locus-liveness-ms", v);
                    }
                    tracing::warn!(node = %id, "registration refused: {}", s.message());
                }
                return Err(s);
            }
        }
        tracing::info!(node = %id, "node registered");
        Ok(Response::new(pb::RegisterNodeResponse {
            liveness_timeout_ms: self.catalog.config().liveness_timeout.as_millis() as u64,
            grant_keys: self.grant_keys.verifying(),
        }))
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Res<pb::HeartbeatResponse> {
        let p = principal(&req)?;
        let r = req.into_inner();
        let id = NodeId::try_from(r.id)?;
        check_node_caller(&p, &id)?;
        let instance = r.instance;
        if r.leaving {
            self.run(move |c| c.release_node(&id, &instance))
                .await
                .map_err(to_status)?;
            return Ok(Response::new(pb::HeartbeatResponse::default()));
        }
        let st = crate::catalog::NodeStats {
            free: r.free_bytes,
            used: r.used_bytes,
            pinned: r.pinned_bytes,
            cached: r.cached_bytes,
            blobs: r.blobs,
            quarantined: r.quarantined,
            refill_blobs: r.refill_blobs,
            refill_bytes: r.refill_bytes,
            refill_rate: r.refill_rate,
            refill_failing: r.refill_failing,
        };
        // Inline, not on the blocking pool: a point read of a small hot record and a map
        // update, at thousands of nodes' heartbeats a second, where the hand-off to a
        // blocking thread and back cost more than the work (a third of the service's CPU
        // at 10,000 nodes).
        self.catalog.heartbeat(&id, &instance, st).map_err(to_status)?;
        self.note_team_cache(&id, r.team_cache);
        Ok(Response::new(pb::HeartbeatResponse {
            grant_keys: self.grant_keys.verifying(),
        }))
    }

    async fn blobs_in_versions(
        &self,
        req: Request<pb::BlobsInVersionsRequest>,
    ) -> Res<pb::BlobsInVersionsResponse> {
        self.members_of(req.into_inner()).await.map(Response::new)
    }

    async fn place_shards(&self, req: Request<pb::PlaceShardsRequest>) -> Res<pb::PlaceShardsResponse> {
        let p = principal(&req)?;
        self.place(p, req.into_inner()).await.map(Response::new)
    }

    async fn locate_blobs(&self, req: Request<pb::LocateBlobsRequest>) -> Res<pb::LocateBlobsResponse> {
        let p = principal(&req)?;
        self.locate(p, req.into_inner()).await.map(Response::new)
    }

    async fn list_nodes(&self, _req: Request<pb::ListNodesRequest>) -> Res<pb::ListNodesResponse> {
        // Nodes are the cluster's, not a team's: a scoped mount needs their addresses too.
        let nodes = self.run(|c| c.list_nodes()).await.map_err(to_status)?;
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }

    async fn drain_node(&self, req: Request<pb::DrainNodeRequest>) -> Res<pb::DrainNodeResponse> {
        let p = principal(&req)?;
        self.unscoped(&p, "draining a node")?;
        let q = req.into_inner();
        let id = NodeId::try_from(q.id)?;
        let target = id.to_string();
        let drain = q.drain;
        let r = self.run(move |c| c.drain_node(&id, drain)).await;
        let action = if drain { "node.drain" } else { "node.undrain" };
        self.audit(&p, action, &target, &r, |n| format!("{n} shards held"));
        let shards_remaining = r.map_err(to_status)?;
        tracing::info!(node = %target, drain, shards_remaining, "node drain state changed");
        Ok(Response::new(pb::DrainNodeResponse { shards_remaining }))
    }

    async fn remove_node(&self, req: Request<pb::RemoveNodeRequest>) -> Res<pb::RemoveNodeResponse> {
        let p = principal(&req)?;
        self.unscoped(&p, "removing a node")?;
        let id = NodeId::try_from(req.into_inner().id)?;
        let target = id.to_string();
        let r = self.run(move |c| c.remove_node(&id)).await;
        self.audit(&p, "node.remove", &target, &r, |n| {
            format!("dropped from {n} shards")
        });
        let shards_released = r.map_err(to_status)?;
        tracing::info!(node = %target, shards_released, "node removed");
        Ok(Response::new(pb::RemoveNodeResponse { shards_released }))
    }

    async fn list_node_blobs(
        &self,
        req: Request<pb::ListNodeBlobsRequest>,
    ) -> Res<pb::ListNodeBlobsResponse> {
        let p = principal(&req)?;
        self.unscoped(&p, "listing a node's blobs")?;
        let q = req.into_inner();
        let id = NodeId::try_from(q.node)?;
        check_node_caller(&p, &id)?;
        let limit = match q.limit {
            0 => 10_000,
            n => n.min(100_000) as usize,
        };
        // Sessions first: one begun after this listing is read writes after it, which
        // the node's own clock covers.
        let ((blobs, next_page_token), open_since) = self
            .run(move |c| {
                let open_since = c.oldest_open_session_ms()?;
                Ok((c.list_node_blobs(&id, &q.page_token, limit)?, open_since))
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListNodeBlobsResponse {
            blobs,
            next_page_token,
            open_since_ms: open_since.unwrap_or(0),
        }))
    }

    async fn locality(&self, req: Request<pb::LocalityRequest>) -> Res<pb::LocalityResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        for r in &q.refs {
            self.scope(&p, &r.dataset, Action::Read)?;
        }
        Ok(Response::new(self.locality_of(q).await?))
    }

    async fn assign(&self, req: Request<pb::AssignRequest>) -> Res<pb::AssignResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let r = version_ref(q.r#ref)?;
        self.scope(&p, r.name.as_str(), Action::Read)?;
        let out = self
            .run(move |c| c.assign(&r, &q.rank_nodes, q.with_files))
            .await
            .map_err(to_status)?;
        Ok(Response::new(out))
    }

    type WarmStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::WarmProgress, Status>> + Send>>;

    async fn warm(&self, req: Request<pb::WarmRequest>) -> Res<Self::WarmStream> {
        let who = principal(&req)?;
        let q = req.into_inner();
        if let Some(r) = &q.r#ref {
            self.scope(&who, &r.dataset, Action::Warm)?;
        }
        let rx = self.warm_copies(who, q).await?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    type ExportCatalogStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CatalogChunk, Status>> + Send>>;

    async fn export_catalog(&self, req: Request<pb::ExportCatalogRequest>) -> Res<Self::ExportCatalogStream> {
        let who = principal(&req)?;
        self.unscoped(&who, "exporting the catalogue")?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::CatalogChunk, Status>>(4);
        let catalog = self.catalog.clone();
        let audit = self.audit.clone();
        // The export reads one store snapshot on a blocking thread and hands 1 MiB pieces
        // to the stream; a slow reader holds it back (bounded channel), never buffers it all.
        tokio::task::spawn_blocking(move || {
            let mut w = crate::snapshot::ChunkSender::new(tx.clone());
            let r = catalog.export(&mut w).and_then(|st| {
                w.flush_now()
                    .map_err(|e| CatalogError::Precondition(e.to_string()))
                    .map(|_| st)
            });
            audit.record(
                &who,
                "export-catalog",
                "",
                match &r {
                    Ok(st) => Ok(format!("{} rows, {} bytes", st.rows, st.bytes)),
                    Err(e) => Err(e.to_string()),
                },
            );
            if let Err(e) = r {
                let _ = tx.blocking_send(Err(to_status(e)));
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn record_backup(&self, req: Request<pb::RecordBackupRequest>) -> Res<pb::RecordBackupResponse> {
        let who = principal(&req)?;
        self.unscoped(&who, "recording a backup")?;
        let q = req.into_inner();
        if q.url.is_empty() || q.url.len() > 1024 || q.url.contains('@') || q.url.contains('\0') {
            return Err(Status::invalid_argument(
                "url: an object-store URL of at most 1 KiB, without credentials",
            ));
        }
        let (url, snap, restored) = (q.url.clone(), q.snapshot.clone(), q.restored);
        let r = self.run(move |c| c.record_backup(&url, &snap, restored)).await;
        self.audit(&who, "record-backup", &q.url, &r, |_| {
            format!("snapshot {}", q.snapshot)
        });
        r.map_err(to_status)?;
        Ok(Response::new(pb::RecordBackupResponse {}))
    }

    async fn list_backups(&self, req: Request<pb::ListBackupsRequest>) -> Res<pb::ListBackupsResponse> {
        // Backups hold every dataset: a scoped token is shown none (and granted none).
        if principal(&req)?.is_scoped() {
            return Ok(Response::new(pb::ListBackupsResponse::default()));
        }
        let list = self.run(|c| c.list_backups()).await.map_err(to_status)?;
        Ok(Response::new(pb::ListBackupsResponse {
            backups: list
                .into_iter()
                .map(|(url, r)| pb::BackupTarget {
                    url,
                    snapshot: r.snapshot,
                    recorded_at_ms: r.recorded_at_ms,
                    restored: r.restored,
                })
                .collect(),
        }))
    }

    async fn list_datasets(&self, req: Request<pb::ListDatasetsRequest>) -> Res<pb::ListDatasetsResponse> {
        let p = principal(&req)?;
        let mut datasets = self.run(|c| c.list_datasets()).await.map_err(to_status)?;
        datasets.retain(|d| p.sees(&d.name));
        Ok(Response::new(pb::ListDatasetsResponse { datasets }))
    }

    async fn get_dataset(&self, req: Request<pb::GetDatasetRequest>) -> Res<pb::Dataset> {
        let p = principal(&req)?;
        let name = DatasetName::try_from(req.into_inner().name)?;
        self.scope(&p, name.as_str(), Action::Read)?;
        let d = self.run(move |c| c.get_dataset(&name)).await.map_err(to_status)?;
        Ok(Response::new(d))
    }

    async fn get_version(&self, req: Request<pb::GetVersionRequest>) -> Res<pb::Version> {
        let p = principal(&req)?;
        let r = version_ref(req.into_inner().r#ref)?;
        self.scope(&p, r.name.as_str(), Action::Read)?;
        let v = self.run(move |c| c.get_version(&r)).await.map_err(to_status)?;
        Ok(Response::new(v))
    }

    async fn list_entries(&self, req: Request<pb::ListEntriesRequest>) -> Res<pb::ListEntriesResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let r = version_ref(q.r#ref)?;
        self.scope(&p, r.name.as_str(), Action::Read)?;
        let limit = page_limit(q.limit);
        let (version, entries, next_page_token) = self
            .run(move |c| {
                c.list_entries(
                    &r,
                    q.directory.as_deref(),
                    &q.page_token,
                    limit,
                    !q.without_chunks,
                )
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListEntriesResponse {
            version,
            entries,
            next_page_token,
        }))
    }

    async fn list_shards(&self, req: Request<pb::ListShardsRequest>) -> Res<pb::ListShardsResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let r = version_ref(q.r#ref)?;
        self.scope(&p, r.name.as_str(), Action::Read)?;
        let limit = page_limit(q.limit);
        let (version, shards, more) = self
            .run(move |c| c.list_shards(&r, q.start, limit))
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListShardsResponse {
            version,
            shards,
            more,
        }))
    }

    async fn delete_version(&self, req: Request<pb::DeleteVersionRequest>) -> Res<pb::DeleteVersionResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        self.scope(&p, &q.dataset, Action::Delete)?;
        self.remove_version(p, q).await?;
        Ok(Response::new(pb::DeleteVersionResponse {}))
    }

    async fn delete_dataset(&self, req: Request<pb::DeleteDatasetRequest>) -> Res<pb::DeleteDatasetResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        self.scope(&p, &q.name, Action::Delete)?;
        let versions_deleted = self.remove_dataset(p, q).await?;
        Ok(Response::new(pb::DeleteDatasetResponse { versions_deleted }))
    }

    async fn mount_lease(&self, req: Request<pb::MountLeaseRequest>) -> Res<pb::MountLeaseResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        if let Some(r) = &q.r#ref {
            self.scope(&p, &r.dataset, Action::Read)?;
        }
        self.lease(p, q).await.map(Response::new)
    }

    async fn begin_version(&self, req: Request<pb::BeginVersionRequest>) -> Res<pb::BeginVersionResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let name = DatasetName::try_from(q.dataset)?;
        self.scope(&p, name.as_str(), Action::Import)?;
        let target = name.to_string();
        let who = p.name.clone();
        let tree_chunks = q.tree_chunks;
        let r = self
            .run(move |c| c.begin_version(&name, q.chunk_size, &q.origin, q.replication, tree_chunks, &who))
            .await;
        self.audit(&p, "version.begin", &target, &r, |(s, _)| format!("session {s}"));
        let (session_id, chunk_size) = r.map_err(to_status)?;
        Ok(Response::new(pb::BeginVersionResponse {
            session_id,
            chunk_size,
            tree_chunks,
        }))
    }

    async fn put_entries(&self, req: Request<pb::PutEntriesRequest>) -> Res<pb::PutEntriesResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        self.session_scope(&p, q.session_id).await?;
        let entries = q
            .entries
            .into_iter()
            .enumerate()
            .map(|(i, e)| Entry::try_from(e).map_err(|x| x.within(format_args!("entries[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?;
        let n = entries.len() as u64;
        let (entries_received, next_page) = self
            .run(move |c| c.put_entries(q.session_id, q.page, entries))
            .await
            .map_err(to_status)?;
        self.metrics.entries_received.inc_by(n);
        Ok(Response::new(pb::PutEntriesResponse {
            entries_received,
            next_page,
        }))
    }

    async fn put_shards(&self, req: Request<pb::PutShardsRequest>) -> Res<pb::PutShardsResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        self.session_scope(&p, q.session_id).await?;
        let shards = q
            .shards
            .into_iter()
            .map(ShardSpec::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let next_page = self
            .run(move |c| c.put_shards(q.session_id, q.page, shards))
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PutShardsResponse { next_page }))
    }

    async fn commit_version(&self, req: Request<pb::CommitVersionRequest>) -> Res<pb::CommitVersionResponse> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let session = q.session_id;
        self.session_scope(&p, session).await?;
        let namespace = if q.namespace_blob.is_empty() {
            None
        } else {
            Some((
                locus_proto::BlobHash::from_slice("namespace_blob", &q.namespace_blob)?,
                q.namespace_size,
            ))
        };
        self.own_content(&p, session).await?;
        let who = p.name.clone();
        let r = self.run(move |c| c.commit(session, &who, namespace)).await;
        let target = match &r {
            Ok(v) => format!("{}@{}", v.dataset, v.version),
            Err(_) => format!("session {session}"),
        };
        self.audit(&p, "version.commit", &target, &r, |v| {
            format!(
                "session {session}: {} files, {} bytes, {} shards",
                v.files, v.bytes, v.shards
            )
        });
        let version = r.map_err(to_status)?;
        self.metrics.versions_committed.inc();
        tracing::info!(dataset = %version.dataset, version = version.version, files = version.files, who = %p.name, "version committed");
        Ok(Response::new(pb::CommitVersionResponse {
            version: Some(version),
        }))
    }

    async fn seal_version(&self, req: Request<pb::SealVersionRequest>) -> Res<pb::Version> {
        let p = principal(&req)?;
        let q = req.into_inner();
        let r = version_ref(q.r#ref)?;
        self.scope(&p, r.name.as_str(), Action::Import)?;
        let claim = (
            locus_proto::BlobHash::from_slice("namespace_blob", &q.namespace_blob)?,
            q.namespace_size,
        );
        let target = format!("{}@{}", r.name, r.version);
        let res = self.run(move |c| c.seal_version(&r, claim)).await;
        self.audit(&p, "version.seal", &target, &res, |v| {
            format!("namespace {} bytes", v.namespace_size)
        });
        let v = res.map_err(to_status)?;
        tracing::info!(dataset = %v.dataset, version = v.version, who = %p.name, "version sealed");
        Ok(Response::new(v))
    }

    async fn abort_version(&self, req: Request<pb::AbortVersionRequest>) -> Res<pb::AbortVersionResponse> {
        let p = principal(&req)?;
        let session = req.into_inner().session_id;
        self.session_scope(&p, session).await?;
        let r = self.run(move |c| c.abort(session)).await;
        self.audit(&p, "version.abort", &format!("session {session}"), &r, |_| {
            "aborted".into()
        });
        r.map_err(to_status)?;
        Ok(Response::new(pb::AbortVersionResponse {}))
    }

    async fn change_members(&self, req: Request<pb::ChangeMembersRequest>) -> Res<pb::ClusterInfo> {
        self.unscoped(&principal(&req)?, "changing the group's members")?;
        self.members(req).await
    }

    async fn grant_keys(&self, req: Request<pb::GrantKeysRequest>) -> Res<pb::GrantKeysResponse> {
        let p = principal(&req)?;
        self.unscoped(&p, "the grant keys")?;
        self.keys(p, req.into_inner()).await.map(Response::new)
    }

    async fn update_replicas(
        &self,
        req: Request<pb::UpdateReplicasRequest>,
    ) -> Res<pb::UpdateReplicasResponse> {
        let p = principal(&req)?;
        self.unscoped(&p, "changing replicas")?;
        let q = req.into_inner();
        let r = version_ref(q.r#ref)?;
        if r.version == VersionSel::Latest {
            return Err(Status::invalid_argument(
                "ref.version: replica changes must name the version explicitly",
            ));
        }
        let parse = |field: &str, v: Vec<String>| {
            v.into_iter()
                .map(|n| NodeId::try_from(n).map_err(|e| e.within(field)))
                .collect::<Result<Vec<_>, _>>()
        };
        let add = parse("add", q.add)?;
        let remove = parse("remove", q.remove)?;
        let target = format!("{r} shard {}", q.shard);
        let shard = q.shard;
        let detail = format!(
            "add [{}] remove [{}]",
            add.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(","),
            remove.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(",")
        );
        let res = self
            .run(move |c| c.update_replicas(&r, shard, &add, &remove))
            .await;
        if p.role == Some(crate::auth::Role::Admin) {
            self.audit(&p, "replicas.update", &target, &res, |_| detail);
        }
        let replicas = res.map_err(to_status)?;
        Ok(Response::new(pb::UpdateReplicasResponse { replicas }))
    }
}
