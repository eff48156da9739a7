//! Followers pass calls to the leader, so every client — CLI, nodes, mounts, the CSI driver —
//! may talk to any member and needs to know nothing about leaders.
//!
//! Sits inside the auth layer: a follower authenticates the caller first, then sends the
//! HTTP/2 request on unchanged (streams included, the caller's `authorization` header too,
//! which the leader checks again) to the leader's Metadata port and streams the answer
//! back. The leader confirms with a quorum that it still leads before it serves anything
//! (`Group::linearize`), so no answer reflects a state older than an acknowledged write.
//!
//! `GetClusterInfo` is answered by the member asked: it reports the group as that member
//! sees it (members, roles, leader), which is what `locus status` shows per member.
//!
//! A forwarded call carries `x-locus-forwarded`; a member that receives one while not
//! leading (leadership moved in between) answers Unavailable instead of forwarding again,
//! so calls never loop between members that disagree about the leader.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use super::Group;

const FORWARDED: &str = "x-locus-forwarded";
/// How long a forwarded call may wait for the leader to start answering: under the
/// clients' own `MEMBER_ANSWER_TIMEOUT`, so the caller hears why rather than a timeout.
const LEADER_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
const PREFIX: &str = "/locus.metadata.v1.Metadata/";

/// Methods any member answers itself.
fn answered_locally(method: &str) -> bool {
    method == "GetClusterInfo"
}

/// Methods that tolerate a bounded staleness: a follower with a fresh liveness view answers
/// them from its own catalogue (replication lag plus at most 2 s of liveness age), which
/// keeps a scheduler's questions off the leader and one hop shorter.
fn stale_ok(method: &str) -> bool {
    matches!(method, "Locality" | "Assign")
}

#[derive(Clone)]
pub struct Forward<S> {
    inner: S,
    group: Arc<Group>,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
}

impl<S> Forward<S> {
    pub fn new(inner: S, group: Arc<Group>) -> Self {
        Self {
            inner,
            group,
            channels: Default::default(),
        }
    }
}

impl<S: NamedService> NamedService for Forward<S> {
    const NAME: &'static str = S::NAME;
}

fn channel_to(channels: &Mutex<HashMap<String, Channel>>, url: &str) -> Result<Channel, Status> {
    let mut map = channels.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = map.get(url) {
        return Ok(c.clone());
    }
    let mut ep = Endpoint::from_shared(url.to_string())
        .map_err(|e| Status::unavailable(format!("the leader's URL {url:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10));
    if url.starts_with("https://") {
        let tls = locus_proto::tls::client_config(None)
            .map_err(|e| Status::unavailable(format!("TLS to the leader: {e}")))?;
        ep = ep
            .tls_config(tls)
            .map_err(|e| Status::unavailable(format!("TLS to the leader: {e}")))?;
    }
    let c = ep.connect_lazy();
    map.insert(url.to_string(), c.clone());
    Ok(c)
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<Body>> for Forward<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let method = req
            .uri()
            .path()
            .strip_prefix(PREFIX)
            .unwrap_or_default()
            .to_string();
        if answered_locally(&method) {
            return Box::pin(inner.call(req));
        }
        let group = self.group.clone();
        let channels = self.channels.clone();
        // Locality and assignment tolerate the staleness followers answer them with; a
        // leader answers them as a follower would, from its own catalogue, with no quorum
        // round per call (a scheduler's calls cost the followers a heartbeat each, and
        // the caller a millisecond).
        if stale_ok(&method) && group.may_answer_stale_reads() {
            return Box::pin(inner.call(req));
        }
        Box::pin(async move {
            if group.is_leader() {
                if let Err(s) = group.linearize().await {
                    return Ok(s.into_http());
                }
                return inner.call(req).await;
            }
            if req.headers().contains_key(FORWARDED) {
                return Ok(Status::unavailable(format!(
                    "metadata member {} was sent this call as the leader but no longer leads; retry",
                    group.name()
                ))
                .into_http());
            }
            let Some((id, member)) = group.leader() else {
                return Ok(Status::unavailable(format!(
                    "the metadata group has no leader right now (member {} is waiting for an \
                     election); retry in a few seconds",
                    group.name()
                ))
                .into_http());
            };
            let url = match group.api_url(id, &member).await {
                Ok(u) => u,
                Err(s) => return Ok(s.into_http()),
            };
            let ch = match channel_to(&channels, &url) {
                Ok(c) => c,
                Err(s) => return Ok(s.into_http()),
            };
            let target: http::Uri = match url.parse::<http::Uri>() {
                Ok(base) => {
                    let mut parts = base.into_parts();
                    parts.path_and_query = req.uri().path_and_query().cloned();
                    match http::Uri::from_parts(parts) {
                        Ok(u) => u,
                        Err(e) => {
                            return Ok(Status::unavailable(format!("the leader's URL: {e}")).into_http())
                        }
                    }
                }
                Err(e) => return Ok(Status::unavailable(format!("the leader's URL: {e}")).into_http()),
            };
            *req.uri_mut() = target;
            req.headers_mut()
                .insert(FORWARDED, http::HeaderValue::from_static("1"));
            let mut ch = ch;
            match tower::ServiceExt::ready(&mut ch).await {
                Ok(_) => {}
                Err(e) => {
                    return Ok(Status::unavailable(format!(
                        "cannot reach the metadata leader {} at {url}: {}",
                        member.name,
                        locus_proto::client::error_chain(&e)
                    ))
                    .into_http())
                }
            }
            // A leader that stopped answering (frozen, cut off) must not hold the follower's
            // callers for longer than their client would wait.
            let answer = tokio::time::timeout(LEADER_ANSWER_TIMEOUT, tower::Service::call(&mut ch, req));
            match answer.await {
                Ok(Ok(resp)) => Ok(resp),
                Ok(Err(e)) => Ok(Status::unavailable(format!(
                    "the metadata leader {} at {url} failed: {}",
                    member.name,
                    locus_proto::client::error_chain(&e)
                ))
                .into_http()),
                Err(_) => Ok(Status::unavailable(format!(
                    "the metadata leader {} at {url} did not answer within {} s",
                    member.name,
                    LEADER_ANSWER_TIMEOUT.as_secs()
                ))
                .into_http()),
            }
        })
    }
}
