//! The tenant boundary in the metadata API: a caller narrowed to datasets
//! (`[[token.scope]]`) reaches only those, and what a team's datasets pin stays within
//! its quota (`crate::quota`). See docs/architecture.md, "Teams".

use tonic::Status;

use super::{to_status, MetadataService};
use crate::auth::{Action, Principal};
use locus_proto::DatasetName;

/// What a quota check is for: an import session's placement (held until it ends), or
/// copies of a dataset's committed version (a warm-up).
pub(super) enum QuotaFor {
    Session(u64),
    Dataset(String),
}

impl MetadataService {
    /// Refuses `action` on the dataset `name` to a caller whose scope does not allow it.
    /// A dataset outside the scope is answered exactly as one that does not exist
    /// (NOT_FOUND, the catalogue's words), so a token cannot probe other teams' names; one
    /// it may see but not act on is refused plainly. Every refusal is audited.
    pub(super) fn scope(&self, p: &Principal, name: &str, action: Action) -> Result<(), Status> {
        if p.may(name, action) {
            return Ok(());
        }
        // A malformed name is refused as malformed, whoever asks.
        DatasetName::try_from(name)?;
        self.audit.scope_refused(p, action.as_str(), name);
        if p.sees(name) {
            Err(Status::permission_denied(format!(
                "{} may not {} dataset {name}: its scope allows {}",
                p.name,
                action.as_str(),
                p.scope.as_ref().map(|s| s.describe()).unwrap_or_default()
            )))
        } else {
            Err(Status::not_found(format!("no dataset named {name}")))
        }
    }

    /// Refuses a cluster-wide call (nodes, members, keys, backups, the whole catalogue) to
    /// a token narrowed to datasets.
    pub(super) fn unscoped(&self, p: &Principal, what: &str) -> Result<(), Status> {
        if !p.is_scoped() {
            return Ok(());
        }
        self.audit.scope_refused(p, what, "");
        Err(Status::permission_denied(format!(
            "{} is narrowed to datasets ({}); {what} is for an unscoped admin token",
            p.name,
            p.scope.as_ref().map(|s| s.describe()).unwrap_or_default()
        )))
    }

    /// The import session's dataset must be in the caller's import scope; a session of
    /// another team's looks like one that is not open.
    pub(super) async fn session_scope(&self, p: &Principal, session: u64) -> Result<(), Status> {
        if !p.is_scoped() {
            return Ok(());
        }
        let name = self
            .run(move |c| c.session_dataset(session))
            .await
            .map_err(to_status)?;
        if p.may(&name, Action::Import) {
            return Ok(());
        }
        self.audit
            .scope_refused(p, "import", &format!("session {session}"));
        Err(to_status(self.catalog.no_session(session)))
    }

    /// Refuses placing `needs` replicated bytes for import session `session` when a team
    /// whose datasets include the session's would go over its quota (`crate::quota`):
    /// checked before any byte reaches a node.
    pub(super) async fn within_quota(&self, of: QuotaFor, needs: u64) -> Result<(), Status> {
        if self.catalog.config().teams.is_empty() {
            return Ok(());
        }
        let session = match &of {
            QuotaFor::Session(s) => *s,
            QuotaFor::Dataset(_) => 0,
        };
        let _serial = self.quota_checks.lock().await;
        let (dataset, refused) = self
            .run(move |c| {
                let dataset = match of {
                    QuotaFor::Session(s) => c.session_dataset(s)?,
                    QuotaFor::Dataset(d) => d,
                };
                // Imports placed and not yet ended (committed versions count in
                // `pinned_by`; aborted and expired sessions are gone), recorded in the
                // catalogue so a new leader counts them too.
                let open = c.held_by_sessions(session)?;
                for team in c.config().teams.iter().filter(|t| t.covers(&dataset)) {
                    let placed: u64 = open.iter().filter(|(d, _)| team.covers(d)).map(|(_, b)| *b).sum();
                    let used = c.pinned_by(|d| team.covers(d))?.saturating_add(placed);
                    if let Err(why) = crate::quota::check(team, used, needs) {
                        return Ok((dataset, Some(why)));
                    }
                }
                // Held until the import ends; a warm-up's copies are counted as they land.
                if session != 0 {
                    c.hold_for_session(session, needs)?;
                }
                Ok((dataset, None))
            })
            .await
            .map_err(to_status)?;
        match refused {
            None => Ok(()),
            Some(why) => {
                tracing::warn!(%dataset, session, "refused over a team's quota: {why}");
                Err(Status::resource_exhausted(why))
            }
        }
    }

    /// A scoped importer's session may not name content that only datasets outside its
    /// scope hold: content is addressed by hash and shared, so a manifest naming another
    /// team's blob would make it readable through the importer's own grants. Those must
    /// come from a dataset in its scope (or an unscoped admin's import).
    pub(super) async fn own_content(&self, p: &Principal, session: u64) -> Result<(), Status> {
        if let Some(scope) = p.scope.clone() {
            let foreign = self
                .run(move |c| c.foreign_blobs(session, |d| scope.sees(d), 3))
                .await
                .map_err(to_status)?;
            if !foreign.is_empty() {
                self.audit
                    .scope_refused(p, "import", &format!("session {session}"));
                return Err(Status::permission_denied(format!(
                    "{} is narrowed to datasets, and this import names content that only datasets \
                     outside its scope hold (blob {}{}): a scoped import cannot take another \
                     team's bytes by their hash. Read them from a dataset in your scope, or have \
                     an unscoped admin import them",
                    p.name,
                    foreign[0],
                    if foreign.len() > 1 { " and others" } else { "" }
                )));
            }
        }
        Ok(())
    }
}

/// Most teams a node's heartbeat reports cached bytes for, and the longest name kept
/// (a team's name is 1 to 63 characters): a node token cannot grow the service's memory.
const TEAM_CACHE_ROWS: usize = 256;

impl MetadataService {
    /// Keeps what node `id` said it holds cached per team (its last heartbeat's word).
    pub(super) fn note_team_cache(&self, id: &locus_proto::NodeId, rows: Vec<locus_proto::pb::TeamCache>) {
        let rows: Vec<(String, u64)> = rows
            .into_iter()
            .filter(|r| !r.team.is_empty() && r.team.len() <= 63)
            .take(TEAM_CACHE_ROWS)
            .map(|r| (r.team, r.cached_bytes))
            .collect();
        let mut m = self.team_cache.lock().unwrap_or_else(|p| p.into_inner());
        if rows.is_empty() {
            m.remove(id.as_str());
        } else {
            m.insert(id.to_string(), rows);
        }
    }

    /// Bytes cached for `team`'s readers on the nodes up now.
    pub(super) fn team_cached(&self, team: &str) -> u64 {
        let timeout = self.catalog.config().liveness_timeout.as_millis() as u64;
        let up: std::collections::HashSet<String> = (self.catalog.liveness().into_iter())
            .filter(|(_, ago, _)| *ago <= timeout)
            .map(|(id, ..)| id)
            .collect();
        let m = self.team_cache.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .filter(|(node, _)| up.contains(*node))
            .flat_map(|(_, rows)| rows.iter().filter(|(t, _)| t == team).map(|(_, b)| *b))
            .sum()
    }
}
