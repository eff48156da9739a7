//! `IssueGrant`: the grants clients present to nodes instead of their tokens
//! (`locus_proto::grant`). The caller needs the role the operation needs; a backup grant
//! names a recorded target, a node grant a registered node.

use locus_proto::grant::{now_ms, GrantBody, Op, DEFAULT_TTL, MAX_TTL};
use locus_proto::{pb, NodeId};
use tonic::Status;

use super::{to_status, MetadataService};
use crate::auth::Principal;

impl MetadataService {
    /// `GrantKeys`: lists or rotates the keys grants are signed and checked with.
    pub(super) async fn keys(
        &self,
        p: Principal,
        q: pb::GrantKeysRequest,
    ) -> Result<pb::GrantKeysResponse, Status> {
        let now = now_ms();
        match q.op.as_str() {
            "list" | "" => Ok(pb::GrantKeysResponse {
                keys: self.grant_keys.fresh_ring().describe(now),
            }),
            "rotate" => {
                let delay = match q.publish_delay_ms {
                    0 => crate::grant_keys::DEFAULT_PUBLISH_DELAY,
                    ms => std::time::Duration::from_millis(ms.min(24 * 3600 * 1000)),
                };
                let keys = self.grant_keys.clone();
                let revoke = q.revoke;
                let r = tokio::task::spawn_blocking(move || keys.rotate(delay, revoke))
                    .await
                    .map_err(|e| Status::internal(format!("rotation task failed: {e}")))?;
                let what = if revoke { "rotate+revoke" } else { "rotate" };
                self.audit.record(
                    &p,
                    "grant-keys.rotate",
                    what,
                    r.as_ref()
                        .map(|_| {
                            format!(
                                "new key signs in {} ms",
                                if revoke { 0 } else { delay.as_millis() }
                            )
                        })
                        .map_err(|e| e.to_string()),
                );
                let ring = r.map_err(|e| Status::unavailable(e.to_string()))?;
                tracing::warn!(revoke, "grant keys rotated by {}", p.name);
                Ok(pb::GrantKeysResponse {
                    keys: ring.describe(now),
                })
            }
            other => Err(Status::invalid_argument(format!(
                "op {other:?}: expected list or rotate"
            ))),
        }
    }

    /// `IssueGrant`: a grant for one operation on one node, if the caller may have it.
    pub(super) async fn grant(
        &self,
        p: Principal,
        q: pb::IssueGrantRequest,
    ) -> Result<pb::IssueGrantResponse, Status> {
        let op = Op::parse(&q.operation)
            .ok_or_else(|| Status::invalid_argument("operation: one of import, backup, read"))?;
        // A grant opens on a node what the operation's own calls need here.
        if op != Op::Read && p.role.is_some() && p.role != Some(crate::auth::Role::Admin) {
            return Err(Status::permission_denied(format!(
                "{} (role {}) may not be granted {} on a node; it needs an admin token",
                p.name,
                p.role_name(),
                op.as_str()
            )));
        }
        // A token narrowed to datasets gets no grant that reaches beyond them: no backup
        // grant (a backup holds every dataset), an import grant only if it may import
        // somewhere (the blobs an import writes are its own).
        if let Some(scope) = &p.scope {
            let ok = match op {
                Op::Import => scope.allows_any(crate::auth::Action::Import),
                Op::Backup => false,
                Op::Read => true,
            };
            if !ok {
                self.audit.scope_refused(&p, op.as_str(), &q.node);
                return Err(Status::permission_denied(format!(
                    "{} is narrowed to datasets ({}) and may not be granted {} on a node",
                    p.name,
                    scope.describe(),
                    op.as_str()
                )));
            }
        }
        if q.target.len() > 1024 || q.target.contains('\0') || (op != Op::Read && q.target.contains('@')) {
            return Err(Status::invalid_argument(
                "target: a URL of at most 1 KiB, without credentials",
            ));
        }
        // A read grant names the version read; for a token narrowed to datasets it opens
        // only that version's blobs (and its namespace), never every blob.
        let (mut versions, mut namespaces, mut datasets) = (Vec::new(), Vec::new(), Vec::new());
        match op {
            Op::Read if !q.target.is_empty() || p.is_scoped() => {
                if q.target.is_empty() {
                    return Err(Status::invalid_argument(format!(
                        "target: {} is narrowed to datasets, so its read grants name the version \
                         read (DATASET@N)",
                        p.name
                    )));
                }
                let r: locus_proto::DatasetRef = q
                    .target
                    .parse()
                    .map_err(|e| Status::invalid_argument(format!("target: {e}")))?;
                if r.version == locus_proto::VersionSel::Latest {
                    return Err(Status::invalid_argument(
                        "target: a read grant names a numbered version (DATASET@N)",
                    ));
                }
                self.scope(&p, r.name.as_str(), crate::auth::Action::Read)?;
                // Named in every grant for a version: a node's socket table may hold an
                // unscoped token's grant to them too (`GrantBody.scoped` says whether
                // every node must).
                datasets.push(r.name.to_string());
                let (uid, ns) = self
                    .run(move |c| c.version_grant_ids(&r))
                    .await
                    .map_err(to_status)?;
                versions.push(uid);
                if !ns.is_empty() {
                    namespaces.push(ns);
                }
            }
            Op::Backup => {
                let url = q.target.clone();
                let known = self
                    .run(move |c| Ok(c.list_backups()?.iter().any(|(u, _)| *u == url)))
                    .await
                    .map_err(to_status)?;
                if !known {
                    return Err(Status::failed_precondition(format!(
                        "{} is not a recorded backup target (a backup run records its target \
                         before any node uploads)",
                        q.target
                    )));
                }
            }
            _ => {}
        }
        if q.node == "*" {
            if op != Op::Read {
                return Err(Status::invalid_argument(
                    "node: only a read grant may be for every node",
                ));
            }
        } else {
            let id = NodeId::try_from(q.node.clone())?;
            let registered = self
                .run(move |c| Ok(c.list_nodes()?.iter().any(|n| n.id == id.as_str())))
                .await
                .map_err(to_status)?;
            if !registered {
                return Err(Status::not_found(format!("no node {} is registered", q.node)));
            }
        }
        let ttl = match q.ttl_ms {
            0 => DEFAULT_TTL,
            ms => std::time::Duration::from_millis(ms).clamp(std::time::Duration::from_secs(1), MAX_TTL),
        };
        // What nodes cache under a grant for a team's dataset counts in that team's cache
        // share (the first team in the configuration that covers it and has one).
        let (team, cache_permille) = datasets
            .first()
            .and_then(|d| {
                (self.catalog.config().teams.iter())
                    .find(|t| t.cache_permille > 0 && t.covers(d))
                    .map(|t| (t.name.clone(), t.cache_permille))
            })
            .unwrap_or_default();
        let now = now_ms();
        let body = GrantBody {
            cluster_id: self.catalog.cluster_id().to_string(),
            node: q.node,
            operation: op.as_str().to_string(),
            target: q.target,
            issued_to: p.name.clone(),
            not_before_unix_ms: now,
            expires_unix_ms: now + ttl.as_millis() as u64,
            versions,
            namespaces,
            scoped: p.is_scoped(),
            team,
            cache_permille,
            datasets,
        };
        if op != Op::Read {
            self.audit.record(
                &p,
                "grant.issue",
                &format!("{}/{}", body.node, body.operation),
                Ok(format!("target {:?}, {} s", body.target, ttl.as_secs())),
            );
        }
        Ok(pb::IssueGrantResponse {
            grant: self.grant_keys.sign(&body),
            expires_unix_ms: body.expires_unix_ms,
        })
    }
}
