//! Grants: what a client presents to a node instead of its own token.
//!
//! Node addresses come from the metadata service's node list, so whoever can register a
//! node (or intercept a connection to one) would receive every token sent there. An
//! operator's admin token opens the whole cluster; a grant opens one operation on one
//! node for a few minutes. The metadata service signs grants with its Ed25519 grant key
//! (`IssueGrant`, checked against the caller's role); nodes learn the service's public
//! keys from `GetClusterInfo` when they register and check every grant against them, the
//! cluster id, their own id, the clock and the method called.
//!
//! Wire form: the bearer token `lg1.<hex body>.<hex signature>`, where the body is a
//! protobuf `GrantBody` and the signature is over `"locus grant v1\n" + body`. The node
//! verifies the bytes it received before decoding them, so no re-encoding is involved.

use std::path::Path;
use std::sync::RwLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use prost::Message;

pub use crate::nodepb::GrantBody;

/// The bearer-token prefix that marks a grant.
pub const PREFIX: &str = "lg1.";
const DOMAIN: &[u8] = b"locus grant v1\n";
/// A grant's default lifetime; clients renew before it ends.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);
pub const MAX_TTL: Duration = Duration::from_secs(3600);
/// How far a node's clock may be behind the service's before a fresh grant looks early.
const SKEW: Duration = Duration::from_secs(300);
/// A grant larger than this is refused before any parsing (bodies are ~200 bytes).
const MAX_LEN: usize = 8192;

/// What a grant lets its holder ask of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Store blobs (WriteBlob), copy them between nodes (FetchBlobs), read the origin
    /// named as target (ImportObject).
    Import,
    /// Upload blobs to the backup target named as target.
    Backup,
    /// Read blobs.
    Read,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Import => "import",
            Op::Backup => "backup",
            Op::Read => "read",
        }
    }

    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "import" => Op::Import,
            "backup" => Op::Backup,
            "read" => Op::Read,
            _ => return None,
        })
    }

    /// Whether a grant for this operation may call `method` of the node API.
    pub fn allows(self, method: &str) -> bool {
        match self {
            Op::Import => matches!(
                method,
                "WriteBlob" | "WriteBlobs" | "HaveBlobs" | "FetchBlobs" | "ImportObject" | "GetNodeStatus"
            ),
            Op::Backup => matches!(method, "UploadBlobs" | "HaveBlobs" | "GetNodeStatus"),
            Op::Read => matches!(method, "ReadBlob" | "HaveBlobs" | "GetNodeStatus"),
        }
    }
}

/// Bytes from the system's cryptographic random source (challenges, nonces).
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    aws_lc_rs::rand::fill(&mut b).expect("the system's random source works");
    b
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("grant key {path}: {reason}")]
    File { path: String, reason: String },
}

/// The metadata service's signing key.
pub struct GrantKey(Ed25519KeyPair);

impl std::fmt::Debug for GrantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GrantKey({})", crate::hex::encode(self.public()))
    }
}

impl GrantKey {
    /// Reads the key at `path`, creating it (mode 0600) at first start.
    pub fn load_or_create(path: &Path) -> Result<Self, KeyError> {
        let bad = |reason: String| KeyError::File {
            path: path.display().to_string(),
            reason,
        };
        crate::keyfile::create_ed25519(path).map_err(bad)?;
        crate::keyfile::read_ed25519(path).map(GrantKey).map_err(bad)
    }

    pub fn public(&self) -> &[u8] {
        self.0.public_key().as_ref()
    }

    /// A new key as PKCS#8 DER (for a replicated group, which keeps it in its own state).
    pub fn generate_pkcs8() -> Result<Vec<u8>, String> {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        Ed25519KeyPair::generate_pkcs8(&rng)
            .map(|d| d.as_ref().to_vec())
            .map_err(|_| "cannot generate a key".to_string())
    }

    pub fn from_pkcs8(der: &[u8]) -> Result<Self, String> {
        Ed25519KeyPair::from_pkcs8(der)
            .map(GrantKey)
            .map_err(|e| format!("not an Ed25519 PKCS#8 key ({e})"))
    }

    /// The bearer token for `body`.
    pub fn sign(&self, body: &GrantBody) -> String {
        let bytes = body.encode_to_vec();
        let mut msg = DOMAIN.to_vec();
        msg.extend_from_slice(&bytes);
        let sig = self.0.sign(&msg);
        format!(
            "{PREFIX}{}.{}",
            crate::hex::encode(&bytes),
            crate::hex::encode(sig.as_ref())
        )
    }
}

/// Why a grant was refused. Each names what to do, for the log and the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("the grant is malformed")]
    Malformed,
    #[error(
        "this node does not know the cluster's grant keys yet (it has not registered with the \
         metadata service)"
    )]
    NoKeys,
    #[error("the grant's signature is not by a grant key of this cluster")]
    BadSignature,
    #[error("the grant is for cluster {0}, not this node's")]
    WrongCluster(String),
    #[error("the grant is for node {0}, not this one; ask the metadata service for one for this node")]
    WrongNode(String),
    #[error("the grant expired; ask the metadata service for a new one")]
    Expired,
    #[error("the grant is not valid yet (is this node's clock behind?)")]
    NotYet,
    #[error("a grant for {op} does not allow {method}")]
    WrongMethod { op: String, method: String },
}

/// What a node checks grants against, set when it registers.
#[derive(Debug)]
pub struct Verifier {
    node: String,
    state: RwLock<(String, Vec<Vec<u8>>)>,
}

impl Verifier {
    pub fn new(node: impl Into<String>) -> Self {
        Verifier {
            node: node.into(),
            state: RwLock::new((String::new(), Vec::new())),
        }
    }

    /// The cluster this node belongs to and the service's grant keys.
    pub fn set(&self, cluster_id: &str, keys: Vec<Vec<u8>>) {
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = (cluster_id.to_string(), keys);
    }

    /// New grant keys for the cluster already set (a rotation, as heartbeat answers carry
    /// it). An empty list (a service that sends none) changes nothing.
    pub fn set_keys(&self, keys: Vec<Vec<u8>>) {
        if keys.is_empty() {
            return;
        }
        let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
        if st.1 != keys {
            tracing::info!(keys = keys.len(), "grant keys changed");
            st.1 = keys;
        }
    }

    /// Checks `token` (the bearer token, `lg1.…`) for a call of `method` at `now_ms`.
    pub fn verify(&self, token: &[u8], method: &str, now_ms: u64) -> Result<(Op, GrantBody), GrantError> {
        if token.len() > MAX_LEN {
            return Err(GrantError::Malformed);
        }
        let rest = token
            .strip_prefix(PREFIX.as_bytes())
            .ok_or(GrantError::Malformed)?;
        let rest = std::str::from_utf8(rest).map_err(|_| GrantError::Malformed)?;
        let (body_hex, sig_hex) = rest.split_once('.').ok_or(GrantError::Malformed)?;
        let body = crate::hex::decode(body_hex).ok_or(GrantError::Malformed)?;
        let sig = crate::hex::decode(sig_hex).ok_or(GrantError::Malformed)?;
        let mut msg = DOMAIN.to_vec();
        msg.extend_from_slice(&body);
        {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            if state.1.is_empty() {
                return Err(GrantError::NoKeys);
            }
            let signed = state
                .1
                .iter()
                .any(|k| UnparsedPublicKey::new(&ED25519, k).verify(&msg, &sig).is_ok());
            if !signed {
                return Err(GrantError::BadSignature);
            }
            let g = GrantBody::decode(body.as_slice()).map_err(|_| GrantError::Malformed)?;
            if g.cluster_id != state.0 {
                return Err(GrantError::WrongCluster(g.cluster_id));
            }
            let op = Op::parse(&g.operation).ok_or(GrantError::Malformed)?;
            if g.node != self.node && !(g.node == "*" && op == Op::Read) {
                return Err(GrantError::WrongNode(g.node));
            }
            if now_ms >= g.expires_unix_ms {
                return Err(GrantError::Expired);
            }
            if now_ms.saturating_add(SKEW.as_millis() as u64) < g.not_before_unix_ms {
                return Err(GrantError::NotYet);
            }
            if !op.allows(method) {
                return Err(GrantError::WrongMethod {
                    op: g.operation,
                    method: method.to_string(),
                });
            }
            Ok((op, g))
        }
    }
}

/// The grants a client holds, by (node, operation, target), renewed a while before they
/// end. A client without a token asks for none: its cluster runs without tokens.
///
/// Only a call with no valid grant in hand waits for the metadata service. A grant near
/// its end is renewed in the background while it is still used, and when renewal fails
/// the grant in hand stays in use until it ends (renewal retried every 10 s), so a
/// mount's reads never stall on a slow or stopped service. Read grants last the longest
/// allowed (an hour): a mount rides out that long an outage.
pub struct Grants {
    meta: crate::client::MetadataClient,
    enabled: bool,
    /// Every grant's lifetime, instead of the defaults (`with_ttl`).
    ttl: Option<Duration>,
    held: std::sync::Arc<tokio::sync::Mutex<std::collections::HashMap<GrantScope, Held>>>,
}

/// (node, operation, target).
type GrantScope = (String, Op, String);

struct Held {
    grant: String,
    expires: u64,
    /// No renewal is started before this (one runs, or the last one failed).
    retry_after: u64,
}

/// A grant is renewed once less than this is left of it, so a call never starts with one
/// about to end (and clocks a little apart do not matter).
const RENEW_BEFORE: Duration = Duration::from_secs(180);
const RENEW_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_EVERY: Duration = Duration::from_secs(10);

impl Grants {
    pub fn new(meta: crate::client::MetadataClient, token: Option<&str>) -> Self {
        Grants {
            meta,
            enabled: token.is_some(),
            ttl: None,
            held: Default::default(),
        }
    }

    /// Grants of this lifetime (1 s to 1 h) rather than 10 minutes (an hour for reads).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// What to present to `node` for `op` on `target`: a grant, the same one until it is
    /// near its end; None when this client has no token to get one with.
    pub async fn get(&self, node: &str, op: Op, target: &str) -> Result<Option<String>, tonic::Status> {
        if !self.enabled {
            return Ok(None);
        }
        let key = (node.to_string(), op, target.to_string());
        let now = now_ms();
        {
            let mut held = self.held.lock().await;
            if let Some(h) = held.get_mut(&key) {
                if now + 1000 < h.expires {
                    if now + RENEW_BEFORE.as_millis() as u64 > h.expires && now >= h.retry_after {
                        h.retry_after = now + RETRY_EVERY.as_millis() as u64;
                        let (meta, held, key) = (self.meta.clone(), self.held.clone(), key.clone());
                        let ttl = self.ttl;
                        tokio::spawn(async move {
                            if let Ok(fresh) = issue(meta, &key, ttl).await {
                                held.lock().await.insert(key, fresh);
                            }
                        });
                    }
                    return Ok(Some(h.grant.clone()));
                }
            }
        }
        let fresh = issue(self.meta.clone(), &key, self.ttl).await?;
        let grant = fresh.grant.clone();
        self.held.lock().await.insert(key, fresh);
        Ok(Some(grant))
    }
}

impl Grants {
    /// Forgets the grant held for (`node`, `op`, `target`): the next `get` asks for a new
    /// one (a node refused the one in hand: its key was revoked, or the node's clock is
    /// off).
    pub async fn forget(&self, node: &str, op: Op, target: &str) {
        self.held
            .lock()
            .await
            .remove(&(node.to_string(), op, target.to_string()));
    }
}

/// Node connections, one per (address, operation, target), each presenting the grant for
/// its scope and made anew when that grant is renewed: what every client of nodes (an
/// import, a backup, a mount's remote reads, a node copying from a peer) keeps, so none
/// ever sends a node its own token.
pub struct NodeLinks {
    grants: Grants,
    /// By (address, operation, target): the grant the connection presents, and it.
    links:
        tokio::sync::Mutex<std::collections::HashMap<LinkScope, (Option<String>, crate::client::NodeClient)>>,
    /// Bulk-path connections (blob bytes), presenting the same grants.
    bulk: std::sync::Arc<crate::bulk::Pool>,
}

/// (address, operation, target).
type LinkScope = (String, Op, String);

/// Why `NodeLinks::link` gave no connection.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The metadata service issued no grant (down, slow, or it refused): the node is not
    /// at fault.
    #[error("{0}")]
    NoGrant(String),
    /// The node could not be reached.
    #[error("{0}")]
    Connect(String),
}

impl NodeLinks {
    pub fn new(grants: Grants) -> Self {
        NodeLinks {
            grants,
            links: Default::default(),
            bulk: crate::bulk::Pool::new(),
        }
    }

    /// Bytes `[offset, offset+len)` of blob `h` from the node at `addr` over the bulk
    /// path, presenting the grant for (`node`, `op`, `target`). `Unsupported`: the node
    /// is to be asked over gRPC ([`NodeLinks::link`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn bulk_read(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        target: &str,
        h: &crate::BlobHash,
        offset: u64,
        len: u64,
        idle: Duration,
    ) -> Result<crate::bulk::Reading, crate::bulk::BulkError> {
        let grant = self.bulk_grant(node, addr, op, target).await?;
        self.bulk.open(addr, grant.as_deref(), h, offset, len, idle).await
    }

    /// A verified range of a chunk (see `bulk::RangeRequest`) from the node at `addr`,
    /// unchecked: the caller verifies it against the chunk's hash. `Unsupported`: read
    /// the whole chunk instead.
    pub async fn bulk_range(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        target: &str,
        r: &crate::bulk::RangeRequest,
        idle: Duration,
    ) -> Result<crate::bulk::Ranged, crate::bulk::BulkError> {
        let grant = self.bulk_grant(node, addr, op, target).await?;
        self.bulk.range(addr, grant.as_deref(), r, idle).await
    }

    /// Has the node at `addr` store a blob from `file` over the bulk path (an import),
    /// presenting the grant for (`node`, `op`): see `bulk::Pool::write`. `Unsupported`:
    /// send it over gRPC.
    #[allow(clippy::too_many_arguments)]
    pub async fn bulk_write(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        w: crate::bulk::WriteRequest,
        body: crate::bulk::Body<'_>,
        idle: Duration,
        sent: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<bool, crate::bulk::BulkError> {
        let grant = self.bulk_grant(node, addr, op, "").await?;
        self.bulk.write(addr, grant.as_deref(), w, body, idle, sent).await
    }

    /// The grant a bulk request to `addr` presents; `Unsupported` when `addr` is asked
    /// over gRPC only.
    async fn bulk_grant(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        target: &str,
    ) -> Result<Option<String>, crate::bulk::BulkError> {
        use crate::bulk::BulkError;
        if !self.bulk.speaks(addr) {
            return Err(BulkError::Unsupported(format!("{addr} is asked over gRPC")));
        }
        self.grants.get(node, op, target).await.map_err(|s| {
            BulkError::Grant(format!(
                "no {} grant for node {node}: {}",
                op.as_str(),
                s.message()
            ))
        })
    }

    /// The node at `addr` failed: its kept bulk connections are closed.
    pub fn failed(&self, addr: &str) {
        self.bulk.forget(addr);
    }

    /// A connection to the node at `addr` presenting a grant for `op` on `target`, issued
    /// for node id `node` ("*": a read grant every node accepts).
    pub async fn get(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        target: &str,
        connect_timeout: Duration,
    ) -> Result<crate::client::NodeClient, String> {
        self.link(node, addr, op, target, connect_timeout)
            .await
            .map_err(|e| e.to_string())
    }

    /// `get`, saying whose fault a failure is: no grant (the metadata service's side;
    /// nothing wrong with the node) or no connection (the node's side).
    pub async fn link(
        &self,
        node: &str,
        addr: &str,
        op: Op,
        target: &str,
        connect_timeout: Duration,
    ) -> Result<crate::client::NodeClient, LinkError> {
        let grant = self.grants.get(node, op, target).await.map_err(|s| {
            LinkError::NoGrant(format!(
                "no {} grant for node {node}: {}",
                op.as_str(),
                s.message()
            ))
        })?;
        let key = (addr.to_string(), op, target.to_string());
        if let Some((g, c)) = self.links.lock().await.get(&key) {
            if *g == grant {
                return Ok(c.clone());
            }
        }
        let c = crate::client::connect_node(addr, grant.as_deref(), connect_timeout)
            .await
            .map_err(|e| LinkError::Connect(e.to_string()))?;
        self.links.lock().await.insert(key, (grant, c.clone()));
        Ok(c)
    }

    /// After a node refused the grant (UNAUTHENTICATED): drops it and its connection, so
    /// the next `get` presents a fresh one.
    pub async fn refused(&self, node: &str, addr: &str, op: Op, target: &str) {
        self.grants.forget(node, op, target).await;
        self.bulk.forget(addr);
        self.links
            .lock()
            .await
            .remove(&(addr.to_string(), op, target.to_string()));
    }
}

/// One `IssueGrant` call, bounded in time.
async fn issue(
    mut meta: crate::client::MetadataClient,
    key: &GrantScope,
    ttl: Option<Duration>,
) -> Result<Held, tonic::Status> {
    let (node, op, target) = key;
    let ttl = ttl.unwrap_or(match op {
        Op::Read => MAX_TTL,
        _ => DEFAULT_TTL,
    });
    let req = crate::pb::IssueGrantRequest {
        node: node.clone(),
        operation: op.as_str().to_string(),
        target: target.clone(),
        ttl_ms: ttl.as_millis() as u64,
    };
    let ask = async {
        match meta.issue_grant(req.clone()).await {
            // The connection was closed under the call: its keep-alive went unanswered
            // while the service was paused, and the close raced this first call after.
            // The channel connects afresh for the next call; asking again is harmless.
            Err(s) if s.code() == tonic::Code::Cancelled => meta.issue_grant(req).await,
            r => r,
        }
    };
    match tokio::time::timeout(RENEW_TIMEOUT, ask).await {
        Ok(Ok(r)) => {
            let r = r.into_inner();
            Ok(Held {
                grant: r.grant,
                expires: r.expires_unix_ms,
                retry_after: 0,
            })
        }
        Ok(Err(s)) => {
            tracing::warn!(node, "cannot get a {} grant: {}", op.as_str(), s.message());
            Err(s)
        }
        Err(_) => {
            tracing::warn!(node, "cannot get a {} grant: no answer within 5 s", op.as_str());
            Err(tonic::Status::unavailable(
                "the metadata service did not answer within 5 s",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(node: &str, op: &str) -> GrantBody {
        GrantBody {
            cluster_id: "c1".into(),
            node: node.into(),
            operation: op.into(),
            target: "s3://b/backups".into(),
            issued_to: "ops".into(),
            not_before_unix_ms: 1_000_000,
            expires_unix_ms: 1_600_000,
            ..Default::default()
        }
    }

    #[test]
    fn a_grant_holds_only_for_its_cluster_node_time_and_operation() {
        let d = tempfile_dir();
        let key = GrantKey::load_or_create(&d.join("k")).unwrap();
        // Loading again reads the same key.
        assert_eq!(
            GrantKey::load_or_create(&d.join("k")).unwrap().public(),
            key.public()
        );
        let other = GrantKey::load_or_create(&d.join("other")).unwrap();
        let v = Verifier::new("n1");
        let t = key.sign(&body("n1", "backup"));
        assert_eq!(
            v.verify(t.as_bytes(), "UploadBlobs", 1_100_000),
            Err(GrantError::NoKeys)
        );
        v.set("c1", vec![other.public().to_vec(), key.public().to_vec()]);
        let (op, g) = v.verify(t.as_bytes(), "UploadBlobs", 1_100_000).unwrap();
        assert_eq!((op, g.target.as_str()), (Op::Backup, "s3://b/backups"));
        assert!(matches!(
            v.verify(t.as_bytes(), "WriteBlob", 1_100_000),
            Err(GrantError::WrongMethod { .. })
        ));
        assert_eq!(
            v.verify(t.as_bytes(), "UploadBlobs", 1_600_000),
            Err(GrantError::Expired)
        );
        assert_eq!(
            v.verify(t.as_bytes(), "UploadBlobs", 600_000),
            Err(GrantError::NotYet)
        );
        // Within the allowed skew, a fresh grant holds.
        assert!(v.verify(t.as_bytes(), "UploadBlobs", 900_000).is_ok());
        // Another node's grant, another cluster's, a stranger's key, a changed byte.
        let t2 = key.sign(&body("n2", "backup"));
        assert_eq!(
            v.verify(t2.as_bytes(), "UploadBlobs", 1_100_000),
            Err(GrantError::WrongNode("n2".into()))
        );
        let mut b = body("n1", "backup");
        b.cluster_id = "c2".into();
        assert_eq!(
            v.verify(key.sign(&b).as_bytes(), "UploadBlobs", 1_100_000),
            Err(GrantError::WrongCluster("c2".into()))
        );
        v.set("c1", vec![other.public().to_vec()]);
        assert_eq!(
            v.verify(t.as_bytes(), "UploadBlobs", 1_100_000),
            Err(GrantError::BadSignature)
        );
        v.set("c1", vec![key.public().to_vec()]);
        let mut tampered = t.clone().into_bytes();
        let i = PREFIX.len() + 5;
        tampered[i] = if tampered[i] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            v.verify(&tampered, "UploadBlobs", 1_100_000),
            Err(GrantError::BadSignature)
        );
        // "*" only for reads.
        let any = key.sign(&body("*", "read"));
        assert!(v.verify(any.as_bytes(), "ReadBlob", 1_100_000).is_ok());
        let any_import = key.sign(&body("*", "import"));
        assert_eq!(
            v.verify(any_import.as_bytes(), "WriteBlob", 1_100_000),
            Err(GrantError::WrongNode("*".into()))
        );
        for junk in ["", "lg1.", "lg1.zz.zz", "lg1.00", "Bearer x"] {
            assert_eq!(
                v.verify(junk.as_bytes(), "ReadBlob", 1),
                Err(GrantError::Malformed),
                "{junk}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_key_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile_dir();
        let p = d.join("k");
        GrantKey::load_or_create(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = GrantKey::load_or_create(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "locus-grant-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
