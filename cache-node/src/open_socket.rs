//! The node's open socket (`locus_proto::open_socket`): blobs handed to same-host callers
//! as open descriptors, under a read grant checked as for a remote caller.
//!
//! The local socket trusts its group with every blob (it serves paths into the data dir,
//! which that group may read). A host shared by teams keeps their users out of that group
//! and lets them ask here instead: each request names a blob and carries a read grant;
//! the node verifies the grant (signature, node, time, `ReadBlob`), checks that a grant
//! narrowed to versions opens that blob (`Peers::grant_opens`), makes the blob local and
//! verified as `EnsureLocal` does, and answers with the file open for reading. The caller
//! never learns a path and cannot open any other blob. When the node requires no grants
//! (a cluster without tokens), the socket admits what the local socket admits.
//!
//! One thread per connection (a mount keeps a few), the async work of each request run on
//! the node's runtime; a connection's last verified grant is remembered, so a mount's
//! stream of requests under one grant costs one signature check.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::nodepb::{self, OpenBlobRequest, OpenBlobResponse};
use locus_proto::open_socket;
use prost::Message;
use tonic::Status;

use crate::service::NodeService;

/// A connection with no request for this long is closed.
const IDLE: Duration = Duration::from_secs(300);
/// Connections served at once (a thread each): anyone on the host may connect, so a
/// flood of them must not exhaust the node's threads.
pub(crate) const MAX_CONNECTIONS: usize = 1024;
/// A connection's verified grant is checked again after this, so a key revoked with
/// `grant-keys rotate --revoke` stops opening blobs within it, not at the grant's end.
const RECHECK: Duration = Duration::from_secs(60);

pub(crate) struct OpenSocket {
    pub(crate) svc: NodeService,
    pub(crate) require_grants: bool,
    pub(crate) rt: tokio::runtime::Handle,
    /// Host users narrowed to datasets (`NodeConfig::socket_scopes`), by uid.
    pub(crate) scopes: std::collections::HashMap<u32, Arc<locus_proto::auth::Scope>>,
    /// Connections being served now.
    pub(crate) live: std::sync::atomic::AtomicUsize,
}

/// The grant a connection presented last: as received, as verified, and when.
type Verified = Option<(String, Arc<locus_proto::grant::GrantBody>, std::time::Instant)>;

fn refusal(s: &Status) -> OpenBlobResponse {
    OpenBlobResponse {
        code: s.code() as u32,
        message: s.message().to_string(),
        ..Default::default()
    }
}

impl OpenSocket {
    /// Serves one connection (of the host user `uid`) until the caller closes it or stays
    /// silent for IDLE.
    pub(crate) fn connection(self: Arc<Self>, s: UnixStream, uid: Option<u32>) {
        let scope = uid.and_then(|u| self.scopes.get(&u).cloned());
        let _ = s.set_read_timeout(Some(IDLE));
        let _ = s.set_write_timeout(Some(Duration::from_secs(30)));
        let mut last: Verified = None;
        loop {
            let frame = match open_socket::read_frame(&mut &s) {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(e) => {
                    // Say why before closing where the caller can still hear it (an
                    // oversized frame), not only that the connection went away.
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        let why = Status::invalid_argument(format!("a malformed request: {e}"));
                        let _ = open_socket::send_response(&s, &refusal(&why), &[]);
                    }
                    tracing::debug!("open socket connection ended: {e}");
                    return;
                }
            };
            let (resp, files) = match OpenBlobRequest::decode(&frame[..]) {
                Ok(q) => match self.answer(q, &mut last, scope.as_deref()) {
                    Ok(x) => x,
                    Err(st) => (refusal(&st), Vec::new()),
                },
                Err(e) => (
                    refusal(&Status::invalid_argument(format!("a malformed request: {e}"))),
                    Vec::new(),
                ),
            };
            let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
            if let Err(e) = open_socket::send_response(&s, &resp, &fds) {
                tracing::debug!("open socket: cannot answer: {e}");
                return;
            }
        }
    }

    fn answer(
        &self,
        q: OpenBlobRequest,
        last: &mut Verified,
        scope: Option<&locus_proto::auth::Scope>,
    ) -> Result<(OpenBlobResponse, Vec<std::fs::File>), Status> {
        if q.more.len() > open_socket::MAX_FDS - 1 {
            return Err(Status::invalid_argument(format!(
                "{} more blobs; at most {}",
                q.more.len(),
                open_socket::MAX_FDS - 1
            )));
        }
        let first = (!q.hash.is_empty())
            .then(|| locus_proto::BlobHash::from_slice("hash", &q.hash))
            .transpose()?;
        let more = q
            .more
            .iter()
            .map(|m| locus_proto::BlobHash::from_slice("more", m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut opens_more = vec![true; more.len()];
        let mut team = crate::store::TeamId::NONE;
        if self.require_grants || scope.is_some() {
            let now = locus_proto::grant::now_ms();
            let g = match last.as_ref() {
                Some((given, g, at))
                    if *given == q.grant && g.expires_unix_ms > now && at.elapsed() < RECHECK =>
                {
                    g.clone()
                }
                _ => {
                    if q.grant.is_empty() {
                        return Err(Status::unauthenticated(
                            "the open socket takes a read grant with each request (locus mount asks \
                             for one itself)",
                        ));
                    }
                    let (_, g) = self
                        .svc
                        .peers
                        .grants
                        .verify(q.grant.as_bytes(), "ReadBlob", now)
                        .map_err(|e| match e {
                            locus_proto::grant::GrantError::WrongMethod { .. } => {
                                Status::permission_denied(e.to_string())
                            }
                            e => Status::unauthenticated(e.to_string()),
                        })?;
                    let g = Arc::new(g);
                    *last = Some((q.grant.clone(), g.clone(), std::time::Instant::now()));
                    g
                }
            };
            // A host user the node's table narrows: its grant must be for versions of
            // datasets its scope names, and only their blobs are handed out, whatever
            // the token the grant was issued to may read elsewhere.
            if let Some(scope) = scope {
                if g.versions.is_empty() || !g.datasets.iter().all(|d| scope.sees(d)) {
                    return Err(Status::permission_denied(format!(
                        "this host gives your user the datasets {} only; the grant presented is \
                         for {}",
                        scope.describe(),
                        if g.datasets.is_empty() {
                            "every dataset".to_string()
                        } else {
                            g.datasets.join(", ")
                        }
                    )));
                }
            }
            // A grant for a team's version: what this caches counts in that team's share.
            team = self.svc.store.team(&g.team, g.cache_permille);
            let narrow = g.scoped || scope.is_some();
            if let Some(h) = &first {
                self.rt.block_on(self.svc.peers.grant_opens_if(&g, h, narrow))?;
            }
            if narrow && !more.is_empty() {
                opens_more = self.rt.block_on(self.svc.peers.grant_filter(&g, &more))?;
            }
        }
        let mut resp = OpenBlobResponse::default();
        let mut files = Vec::new();
        if let Some(h) = first {
            let at = self.rt.block_on(self.svc.make_local(
                nodepb::EnsureLocalRequest {
                    hash: q.hash,
                    size: q.size,
                    chunk_size: q.chunk_size,
                    packed_ok: true,
                },
                team,
            ))?;
            files.push(
                std::fs::File::open(&at.path)
                    .map_err(|e| Status::internal(format!("cannot open blob {h}'s file: {e}")))?,
            );
            (resp.offset, resp.packed) = (at.offset, at.packed);
        }
        // The reader's next files: handed out only if verified here already; a blob not
        // here (or one the grant does not open) is simply not present.
        for (h, opens) in more.into_iter().zip(opens_more) {
            let at = match opens {
                true => self.rt.block_on(self.svc.verified_path(h)).ok().flatten(),
                false => None,
            };
            match at.and_then(|at| std::fs::File::open(&at.path).ok().map(|f| (at, f))) {
                Some((at, f)) => {
                    files.push(f);
                    resp.more.push(nodepb::OpenedBlob {
                        present: true,
                        offset: at.offset,
                        packed: at.packed,
                    });
                }
                None => resp.more.push(nodepb::OpenedBlob::default()),
            }
        }
        self.svc.metrics.opened_blobs.inc_by(files.len() as u64);
        Ok((resp, files))
    }
}
