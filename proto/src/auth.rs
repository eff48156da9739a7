//! Bearer tokens with roles, and the tower layer that checks them on every gRPC call of a
//! Locus daemon before any handler runs.
//!
//! Each service supplies its policy — a function from method name to the access it needs
//! — and a method missing from it is refused, so a call added to a proto without a policy
//! line can never be reached unchecked. Tokens are compared as BLAKE3 digests with a
//! constant-time equality, and every configured token is compared on every call, so
//! timing reveals neither a token nor its length. Both daemons read the same token file
//! format, so one file can serve a whole cluster.

use std::path::Path;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde::Deserialize;
use tonic::body::Body;
use tonic::Status;

pub use crate::scope::{Action, Scope};

/// What a token lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Import, delete, backup; and everything a reader may do.
    Admin,
    /// Register, heartbeat, report inventory and replicas; and everything a reader may do.
    Node,
    /// Mount, locality, listings.
    Reader,
    /// A member of a replicated metadata group, on the other members' raft ports and
    /// nowhere else: it opens no call of the Metadata API, and no other role opens the
    /// raft port, so a member token that leaks grants no admin, and an admin token that
    /// leaks cannot feed a member log entries.
    Member,
    /// A grant the metadata service signed (`crate::grant`): never in a token file.
    #[serde(skip)]
    Grant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Node => "node",
            Role::Reader => "reader",
            Role::Member => "member",
            Role::Grant => "grant",
        }
    }
}

/// The caller of a request, put into the request's extensions by the auth layer.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The token's name; "anonymous" when the service runs without tokens.
    pub name: String,
    /// None when the service runs without tokens (every call is allowed).
    pub role: Option<Role>,
    /// The grant the call came with (role `Grant`), for the scope checks of handlers.
    pub grant: Option<std::sync::Arc<crate::grant::GrantBody>>,
    /// The datasets the token reaches, when its `[[token.scope]]` narrows it; None: every
    /// dataset its role reaches.
    pub scope: Option<Arc<Scope>>,
}

impl Principal {
    pub fn anonymous() -> Self {
        Principal {
            name: "anonymous".into(),
            role: None,
            grant: None,
            scope: None,
        }
    }

    /// Whether this caller may do `action` on the dataset `name`. Unscoped callers may do
    /// whatever their role lets them (the auth layer decided that).
    pub fn may(&self, name: &str, action: Action) -> bool {
        self.scope.as_ref().is_none_or(|s| s.allows(name, action))
    }

    /// Whether this caller may learn that the dataset `name` exists (any action on it).
    pub fn sees(&self, name: &str) -> bool {
        self.scope.as_ref().is_none_or(|s| s.sees(name))
    }

    pub fn is_scoped(&self) -> bool {
        self.scope.is_some()
    }

    pub fn role_name(&self) -> &'static str {
        self.role.map_or("anonymous", Role::as_str)
    }
}

/// The access a method needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Any,
    Read,
    Node,
    Admin,
    NodeOrAdmin,
    /// A node's token, or a grant whose operation allows the method.
    NodeOrGrant,
    /// Only a grant whose operation allows the method: no token opens it, so an admin
    /// token need never be sent to a node.
    Grant,
    /// Only a metadata group member's token (the raft port).
    Member,
    /// No credential at all, even where tokens are configured: for the one call a peer
    /// must answer before it is sent any (a group member's Hello, which proves the
    /// answerer is a member before the asker presents its token). Such a call must
    /// reveal nothing a stranger may not know and change nothing.
    Open,
}

/// Whether a token of `role` opens a method needing `access`. Grants are decided by the
/// policy (`Policy::grant`), never here.
pub fn allows(role: Role, access: Access) -> bool {
    match access {
        // A member token is for the raft port only; a grant for the node API only.
        Access::Any | Access::Read => matches!(role, Role::Admin | Role::Node | Role::Reader),
        Access::Node | Access::NodeOrGrant => role == Role::Node,
        Access::Admin => role == Role::Admin,
        Access::NodeOrAdmin => matches!(role, Role::Node | Role::Admin),
        Access::Grant => false,
        Access::Member => role == Role::Member,
        Access::Open => true,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    #[serde(default)]
    token: Vec<TokenSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenSpec {
    name: String,
    role: Role,
    /// The secret itself.
    token: Option<String>,
    /// Or its BLAKE3 digest in hex, so the file need not hold the secret.
    blake3: Option<String>,
    /// Narrows the token to these datasets; none: every dataset.
    #[serde(default)]
    scope: Vec<ScopeSpec>,
}

/// `[[token.scope]]`: dataset name patterns and what the token may do to them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScopeSpec {
    datasets: Vec<String>,
    /// Default: everything the token's role may do.
    actions: Option<Vec<Action>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read token file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("token file {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// The configured tokens.
#[derive(Clone)]
pub struct TokenSet {
    tokens: Vec<(blake3::Hash, String, Role, Option<Arc<Scope>>)>,
}

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print digests: they are as good as the tokens to an offline guesser.
        f.debug_struct("TokenSet")
            .field("count", &self.tokens.len())
            .finish()
    }
}

impl TokenSet {
    /// Reads a TOML file of `[[token]]` tables with `name`, `role` and `token` or `blake3`.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TokenFileError::Read {
            path: p.clone(),
            reason: e.to_string(),
        })?;
        let invalid = |reason: String| TokenFileError::Invalid {
            path: p.clone(),
            reason,
        };
        let file: TokenFile = toml::from_str(&text).map_err(|e| invalid(e.message().to_string()))?;
        if file.token.is_empty() {
            return Err(invalid(
                "defines no [[token]]; a service with a token file needs at least one".into(),
            ));
        }
        let mut tokens = Vec::new();
        for t in file.token {
            let hash = match (&t.token, &t.blake3) {
                (Some(secret), None) => {
                    if secret.len() < 16 {
                        return Err(invalid(format!(
                            "token {:?} is shorter than 16 characters",
                            t.name
                        )));
                    }
                    blake3::hash(secret.as_bytes())
                }
                (None, Some(hex)) => blake3::Hash::from_hex(hex)
                    .map_err(|_| invalid(format!("token {:?}: blake3 is not 64 hex digits", t.name)))?,
                _ => {
                    return Err(invalid(format!(
                        "token {:?} needs exactly one of `token` or `blake3`",
                        t.name
                    )))
                }
            };
            if tokens.iter().any(|(h, _, _, _)| *h == hash) {
                return Err(invalid(format!("token {:?} repeats another token", t.name)));
            }
            let scope = scope_of(&t).map_err(|e| invalid(format!("token {:?}: {e}", t.name)))?;
            tokens.push((hash, t.name, t.role, scope));
        }
        // Plain secrets in a file others can read are as good as published. Digests
        // (`blake3 = …`) may be shared: they open nothing without the secret.
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            let plain = toml::from_str::<TokenFile>(&text)
                .map(|f| f.token.iter().any(|t| t.token.is_some()))
                .unwrap_or(true);
            if plain && mode & 0o077 != 0 {
                return Err(invalid(format!(
                    "holds plain tokens but other users may read it (mode {:o}): run chmod 600 {p} \
                     (for a Kubernetes Secret, defaultMode: 0400), or list `blake3 = \"<digest>\"` \
                     instead of `token = …`",
                    mode & 0o777
                )));
            }
        }
        Ok(TokenSet { tokens })
    }

    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, String, Role)>) -> Self {
        TokenSet {
            tokens: pairs
                .into_iter()
                .map(|(name, secret, role)| (blake3::hash(secret.as_bytes()), name, role, None))
                .collect(),
        }
    }

    /// Adds a token narrowed to `scope` (for tests and embedders).
    pub fn with_scoped(mut self, name: &str, secret: &str, role: Role, scope: Scope) -> Self {
        self.tokens.push((
            blake3::hash(secret.as_bytes()),
            name.to_string(),
            role,
            Some(Arc::new(scope)),
        ));
        self
    }

    /// Finds the token's holder. Compares against every token, in constant time each.
    pub fn authenticate(&self, secret: &[u8]) -> Option<Principal> {
        let given = blake3::hash(secret);
        let mut found = None;
        for (hash, name, role, scope) in &self.tokens {
            // blake3::Hash's equality is constant-time.
            if *hash == given {
                found = Some(Principal {
                    name: name.clone(),
                    role: Some(*role),
                    grant: None,
                    scope: scope.clone(),
                });
            }
        }
        found
    }
}

/// A token's `[[token.scope]]` tables as a scope; None when it has none.
fn scope_of(t: &TokenSpec) -> Result<Option<Arc<Scope>>, String> {
    if t.scope.is_empty() {
        return Ok(None);
    }
    if !matches!(t.role, Role::Admin | Role::Reader) {
        return Err(format!(
            "role {} takes no scope (only admin and reader tokens are narrowed to datasets)",
            t.role.as_str()
        ));
    }
    let all = [Action::Read, Action::Import, Action::Delete, Action::Warm];
    let mut rules = Vec::new();
    for s in &t.scope {
        let actions = match &s.actions {
            Some(a) => a.clone(),
            None => all.iter().copied().filter(|a| a.within(t.role)).collect(),
        };
        if let Some(a) = actions.iter().find(|a| !a.within(t.role)) {
            return Err(format!(
                "a {} token cannot be given {:?} (a scope narrows what the role may do, never \
                 widens it: give the team an admin token with a scope instead)",
                t.role.as_str(),
                a.as_str()
            ));
        }
        if s.datasets.is_empty() {
            return Err("a [[token.scope]] names no datasets".into());
        }
        for d in &s.datasets {
            rules.push((d.clone(), actions.clone()));
        }
    }
    Scope::new(rules).map(|s| Some(Arc::new(s)))
}

/// A refusal: the status for the caller and a short reason for metrics.
pub type Refusal = (Status, &'static str);

/// Checks a grant (the bearer token, `lg1.…`) for a method.
pub type GrantCheck<'a> = &'a dyn Fn(&str, &[u8]) -> Result<Principal, Refusal>;

/// Decides a request: the principal to run it as, or the status to refuse it with and a
/// short reason for metrics. `access` is the policy's answer for the method (None: not a
/// method this service allows). `grants` decides bearer tokens that are grants; without
/// it they are refused.
pub fn check(
    tokens: Option<&TokenSet>,
    method: &str,
    access: Option<Access>,
    authorization: Option<&[u8]>,
    grants: Option<GrantCheck<'_>>,
) -> Result<Principal, Refusal> {
    let Some(tokens) = tokens else {
        return Ok(Principal::anonymous());
    };
    let Some(access) = access else {
        return Err((
            Status::permission_denied(format!("{method} is not a call this service allows")),
            "unknown_method",
        ));
    };
    if access == Access::Open {
        return Ok(Principal {
            name: "unauthenticated".into(),
            role: None,
            grant: None,
            scope: None,
        });
    }
    let secret = match authorization.and_then(|h| h.strip_prefix(b"Bearer ")) {
        Some(s) => s,
        None => {
            return Err((
                Status::unauthenticated(
                    "this service requires a token: send `authorization: Bearer TOKEN` \
                     (locus --token or LOCUS_TOKEN)",
                ),
                "missing_token",
            ))
        }
    };
    if secret.starts_with(crate::grant::PREFIX.as_bytes()) {
        return match grants {
            Some(g) => g(method, secret),
            None => Err((
                Status::unauthenticated("this service does not take grants; send a token"),
                "bad_token",
            )),
        };
    }
    if access == Access::Grant {
        // Said before any token is looked at: a node has no tokens to compare with, and
        // the caller learns nothing about the token it sent.
        return Err((
            Status::permission_denied(format!(
                "{method} takes a grant from the metadata service, not a token; locus asks for \
                 one itself"
            )),
            "denied",
        ));
    }
    let Some(p) = tokens.authenticate(secret) else {
        return Err((Status::unauthenticated("the token is not valid"), "bad_token"));
    };
    let role = p.role.expect("configured tokens always have a role");
    if !allows(role, access) {
        return Err((
            Status::permission_denied(format!(
                "{} (role {}) may not call {method}",
                p.name,
                role.as_str()
            )),
            "denied",
        ));
    }
    Ok(p)
}

/// A refused call, as the auth layer reports it.
#[derive(Debug)]
pub struct Refused<'a> {
    /// The request path, cut to 200 characters (it is the caller's).
    pub path: &'a str,
    /// Short reason, as in metrics: `missing_token`, `bad_token`, `denied`, ...
    pub reason: &'static str,
    /// What the caller was told.
    pub message: &'a str,
}

/// At most `max` events a `window`, counting the rest: for log lines anyone can cause
/// (refused calls cost a caller nothing), so a flood of them cannot fill a disk or bury
/// the lines that matter.
#[derive(Debug)]
pub struct Throttle {
    window: Duration,
    max: u32,
    /// (window start, events admitted in it, events dropped since the last admitted).
    state: std::sync::Mutex<(Instant, u32, u64)>,
}

impl Throttle {
    pub fn new(max: u32, window: Duration) -> Self {
        Throttle {
            window,
            max,
            state: std::sync::Mutex::new((Instant::now(), 0, 0)),
        }
    }

    /// Some(n) when this event may be logged, n being how many were dropped since the
    /// last that was (log that too); None when it must be dropped.
    pub fn admit(&self) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0.elapsed() >= self.window {
            s.0 = Instant::now();
            s.1 = 0;
        }
        if s.1 >= self.max {
            s.2 += 1;
            return None;
        }
        s.1 += 1;
        Some(std::mem::take(&mut s.2))
    }
}

/// What a service tells the auth layer: its gRPC path prefix, its policy, and hooks for
/// its metrics.
pub trait Policy: Send + Sync + 'static {
    /// `/package.Service/`
    fn prefix(&self) -> &'static str;
    fn access(&self, method: &str) -> Option<Access>;
    /// Decides a call that came with a grant; None: this service takes no grants.
    fn grant(&self, _method: &str, _grant: &[u8]) -> Option<Result<Principal, Refusal>> {
        None
    }
    /// A call was refused (after the auth layer's own throttled log line).
    fn refused(&self, _refused: &Refused<'_>) {}
    fn done(&self, _method: &str, _code: tonic::Code, _took: Duration) {}
}

/// Tower layer that authenticates and authorises every gRPC call and reports each
/// call's outcome to the policy (for metrics).
#[derive(Clone)]
pub struct AuthLayer {
    tokens: Option<Arc<TokenSet>>,
    policy: Arc<dyn Policy>,
    log: Arc<Throttle>,
}

impl AuthLayer {
    pub fn new(tokens: Option<Arc<TokenSet>>, policy: Arc<dyn Policy>) -> Self {
        Self {
            tokens,
            policy,
            log: Arc::new(Throttle::new(20, Duration::from_secs(1))),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            tokens: self.tokens.clone(),
            policy: self.policy.clone(),
            log: self.log.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    tokens: Option<Arc<TokenSet>>,
    policy: Arc<dyn Policy>,
    log: Arc<Throttle>,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<Body>> for AuthService<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let start = Instant::now();
        let path = req.uri().path().to_string();
        let access = path
            .strip_prefix(self.policy.prefix())
            .and_then(|m| self.policy.access(m));
        // Metrics are labelled by method: a path this service does not know gets one
        // shared label, so a caller sending endless made-up paths cannot grow the
        // metrics (and the service's memory) without bound.
        let method = match access {
            Some(_) => path.rsplit('/').next().unwrap_or_default().to_string(),
            None => "unknown".to_string(),
        };
        let policy = self.policy.clone();
        let auth = req.headers().get("authorization").map(|v| v.as_bytes().to_vec());
        let grants = |m: &str, g: &[u8]| {
            policy.grant(m, g).unwrap_or_else(|| {
                Err((
                    Status::unauthenticated("this service does not take grants; send a token"),
                    "bad_token",
                ))
            })
        };
        match check(
            self.tokens.as_deref(),
            &method,
            access,
            auth.as_deref(),
            Some(&grants),
        ) {
            Err((status, reason)) => {
                // The path is the caller's: cut to a sane length before it is logged.
                let shown: String = path.chars().take(200).collect();
                if let Some(dropped) = self.log.admit() {
                    if dropped > 0 {
                        tracing::warn!("{dropped} more refused calls were not logged (over 20 a second)");
                    }
                    tracing::warn!(path = %shown, reason, "refused call: {}", status.message());
                }
                policy.refused(&Refused {
                    path: &shown,
                    reason,
                    message: status.message(),
                });
                policy.done(&method, status.code(), start.elapsed());
                Box::pin(async move { Ok(status.into_http()) })
            }
            Ok(principal) => {
                req.extensions_mut().insert(principal);
                // The service that was polled ready is the one that must be called.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(async move {
                    let resp = inner.call(req).await?;
                    let code = resp
                        .headers()
                        .get("grpc-status")
                        .map(|v| tonic::Code::from_bytes(v.as_bytes()))
                        .unwrap_or(tonic::Code::Ok);
                    policy.done(&method, code, start.elapsed());
                    Ok(resp)
                })
            }
        }
    }
}

/// The `rpc` names of `service NAME` in a .proto file's text, for the tests that check
/// every call has an access rule (metadata and node). Panics when the text has no such
/// service: the tests embed the proto files, so that is a test's mistake.
pub fn rpcs_of(proto: &str, service: &str) -> Vec<String> {
    let start = proto
        .find(&format!("service {service} {{"))
        .unwrap_or_else(|| panic!("no service {service}"));
    let body = &proto[start..];
    let body = &body[..body.find("\n}").expect("the service block ends")];
    body.lines()
        .filter_map(|l| l.trim().strip_prefix("rpc "))
        .map(|l| l.split('(').next().unwrap_or_default().trim().to_string())
        .collect()
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
