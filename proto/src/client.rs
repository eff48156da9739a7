//! The typed client of the metadata service: connection (plain or TLS), the bearer token on
//! every call, message-size limits that match the server's, and helpers that page large
//! uploads so no single message approaches those limits.

use std::time::Duration;

use prost::Message;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::pb;

/// Target encoded size of one manifest page. Well under `MAX_MESSAGE_BYTES`, so that even
/// a page that ends with a huge file's chunk list fits.
pub const ENTRY_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Most shards sent in one page.
pub const SHARD_PAGE_LEN: usize = 10_000;

/// How to reach the metadata service.
#[derive(Clone)]
pub struct ClientOptions {
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    pub token: Option<String>,
    /// PEM of the CA that signed the server's certificate, for `https://` URLs.
    pub ca_cert_pem: Option<Vec<u8>>,
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token: Debug output ends up in logs and panic messages.
        f.debug_struct("ClientOptions")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("ca_cert_pem", &self.ca_cert_pem.as_ref().map(|p| p.len()))
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl ClientOptions {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            token: None,
            ca_cert_pem: None,
            connect_timeout: Duration::from_secs(5),
        }
    }

    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0:?} is not a metadata service URL (expected http://HOST:PORT or https://HOST:PORT)")]
    BadUrl(String),
    #[error("the token contains characters that cannot be sent in a header")]
    BadToken,
    #[error("https:// needs the CA certificate that signed the server's (--ca-cert)")]
    MissingCa,
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("cannot reach the metadata service at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("cannot reach the cache node at {url}: {reason}")]
    ConnectNode { url: String, reason: String },
    #[error(
        "refusing to send a token in clear to {0}: use TLS (an https:// address and --ca-cert), \
         or pass --insecure if this network is trusted"
    )]
    PlaintextToken(String),
}

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
pub struct BearerToken(Option<tonic::metadata::AsciiMetadataValue>);

impl BearerToken {
    pub fn new(header: Option<tonic::metadata::AsciiMetadataValue>) -> Self {
        Self(header)
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type MetadataClient = pb::metadata_client::MetadataClient<InterceptedService<MetaChannel, BearerToken>>;

/// The connection under a metadata client: one service, or the members of a replicated
/// group, tried in turn.
///
/// With several members a call goes to the member that answered last; if it cannot be
/// connected to (dead, restarting), the call is sent to the next member, so a client keeps
/// working through the loss of any minority without seeing an error. Only calls that were
/// never delivered are resent: a connection that fails after the request went out is
/// reported, as the member may have acted on it. Request bodies are kept to be resent,
/// which is bounded because every Metadata call sends one message (none streams requests).
#[derive(Clone)]
pub struct MetaChannel {
    members: std::sync::Arc<Vec<(String, Channel)>>,
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a group member may take to start answering a call (its response headers)
/// before the client gives up on that call and moves on. The slowest legitimate answer is
/// a write waiting for a quorum (the service gives up on those at 30 s, but says so early
/// when it has no leader); streams answer their headers at once.
pub const MEMBER_ANSWER_TIMEOUT: Duration = Duration::from_secs(15);
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// How often a client pings the metadata service, and how long a ping may go unanswered.
pub const PING_EVERY: Duration = Duration::from_secs(2);
pub const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// A call that failed because the service stopped answering, said as such.
fn not_answering(url: &str, e: tonic::transport::Error) -> BoxError {
    let chain = error_chain(&e);
    if chain.contains("keep-alive timed out") || chain.contains("ping timeout") {
        // A Status, so callers see UNAVAILABLE (retryable), not UNKNOWN.
        return Box::new(tonic::Status::unavailable(format!(
            "the metadata service at {url} is not answering: the connection is open but nothing \
             came back for {} s (the process is stopped, frozen or its host is overloaded)",
            (PING_EVERY + PING_TIMEOUT).as_secs()
        )));
    }
    e.into()
}

/// Whether a channel error means the request never reached the member.
fn not_delivered(e: &tonic::transport::Error) -> bool {
    let chain = error_chain(e).to_ascii_lowercase();
    chain.contains("connect error") || chain.contains("connection refused")
}

impl tower::Service<http::Request<tonic::body::Body>> for MetaChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        // Each call readies the member channel it uses.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        use tower::ServiceExt;
        let members = self.members.clone();
        let current = self.current.clone();
        Box::pin(async move {
            if members.len() == 1 {
                let (url, mut ch) = (members[0].0.clone(), members[0].1.clone());
                ch.ready().await.map_err(|e| not_answering(&url, e))?;
                return tower::Service::call(&mut ch, req)
                    .await
                    .map_err(|e| not_answering(&url, e));
            }
            let (parts, body) = req.into_parts();
            let body = http_body_util::BodyExt::collect(body).await?.to_bytes();
            let start = current.load(std::sync::atomic::Ordering::Relaxed);
            let mut last: Option<BoxError> = None;
            for i in 0..members.len() {
                let idx = (start + i) % members.len();
                let mut r =
                    http::Request::new(tonic::body::Body::new(http_body_util::Full::new(body.clone())));
                *r.method_mut() = parts.method.clone();
                *r.uri_mut() = parts.uri.clone();
                *r.version_mut() = parts.version;
                *r.headers_mut() = parts.headers.clone();
                let mut ch = members[idx].1.clone();
                let attempt = async {
                    ch.ready().await?;
                    tower::Service::call(&mut ch, r).await
                };
                // A member that accepts connections but does not answer (frozen, or cut
                // off behind a half-open connection) costs this call, not every later one.
                let next = (idx + 1) % members.len();
                let res = match tokio::time::timeout(MEMBER_ANSWER_TIMEOUT, attempt).await {
                    Ok(r) => r,
                    Err(_) => {
                        current.store(next, std::sync::atomic::Ordering::Relaxed);
                        return Err(format!(
                            "metadata member {} did not answer within {} s; later calls go to another member",
                            members[idx].0,
                            MEMBER_ANSWER_TIMEOUT.as_secs()
                        )
                        .into());
                    }
                };
                match res {
                    Ok(resp) => {
                        current.store(idx, std::sync::atomic::Ordering::Relaxed);
                        return Ok(resp);
                    }
                    Err(e) if not_delivered(&e) => {
                        last = Some(format!("{}: {}", members[idx].0, error_chain(&e)).into());
                    }
                    Err(e) => {
                        current.store(next, std::sync::atomic::Ordering::Relaxed);
                        return Err(not_answering(&members[idx].0, e));
                    }
                }
            }
            Err(last.unwrap_or_else(|| "no metadata member to call".into()))
        })
    }
}

/// Connects now, so that an unreachable service is reported at once and clearly.
///
/// `opts.url` may list several members of a replicated metadata group, comma-separated:
/// calls then go to whichever members answer (each forwards what only the leader serves),
/// and a member that dies takes no later calls. At least one must answer now.
pub async fn connect(opts: &ClientOptions) -> Result<MetadataClient, ClientError> {
    let token = match &opts.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse::<tonic::metadata::AsciiMetadataValue>()
                .map_err(|_| ClientError::BadToken)?,
        ),
        None => None,
    };
    let urls: Vec<&str> = opts
        .url
        .split(',')
        .map(|u| u.trim().trim_end_matches('/'))
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() {
        return Err(ClientError::BadUrl(opts.url.clone()));
    }
    let mut endpoints = Vec::with_capacity(urls.len());
    for url in &urls {
        endpoints.push(endpoint(url, opts)?);
    }
    let channel = if endpoints.len() == 1 {
        let ch = endpoints[0].connect().await.map_err(|e| ClientError::Connect {
            url: opts.url.clone(),
            reason: error_chain(&e),
        })?;
        MetaChannel {
            members: std::sync::Arc::new(vec![(urls[0].to_string(), ch)]),
            current: Default::default(),
        }
    } else {
        // Reported at once when no member answers; calls start at the first that did.
        let mut last = None;
        let mut first = None;
        for (i, (url, ep)) in urls.iter().zip(&endpoints).enumerate() {
            match ep.connect().await {
                Ok(_) => {
                    first = Some(i);
                    break;
                }
                Err(e) => last = Some(format!("{url}: {}", error_chain(&e))),
            }
        }
        let Some(first) = first else {
            return Err(ClientError::Connect {
                url: opts.url.clone(),
                reason: last.unwrap_or_default(),
            });
        };
        MetaChannel {
            members: std::sync::Arc::new(
                urls.iter()
                    .zip(endpoints)
                    .map(|(u, ep)| (u.to_string(), ep.connect_lazy()))
                    .collect(),
            ),
            current: std::sync::Arc::new(first.into()),
        }
    };
    Ok(
        pb::metadata_client::MetadataClient::with_interceptor(channel, BearerToken(token))
            .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(crate::MAX_MESSAGE_BYTES),
    )
}

fn endpoint(url: &str, opts: &ClientOptions) -> Result<Endpoint, ClientError> {
    let tls = if url.starts_with("https://") {
        true
    } else if url.starts_with("http://") {
        false
    } else {
        return Err(ClientError::BadUrl(url.to_string()));
    };
    let mut ep = Endpoint::from_shared(url.to_string())
        .map_err(|_| ClientError::BadUrl(url.to_string()))?
        .connect_timeout(opts.connect_timeout)
        .tcp_nodelay(true)
        // A service that stopped answering (SIGSTOP, a frozen VM, a hung host) keeps its
        // connections open, so only pings tell: unanswered for PING_TIMEOUT after one
        // sent every PING_EVERY, the connection is given up and the call fails with a
        // sentence (`not_answering`), in seconds rather than HTTP/2's default 50. A
        // service that is merely busy answers pings from its connection task while a long
        // call runs, so slow work is never cut.
        .http2_keep_alive_interval(PING_EVERY)
        .keep_alive_timeout(PING_TIMEOUT)
        .keep_alive_while_idle(true);
    if tls {
        ep = ep
            .tls_config(crate::tls::client_config(opts.ca_cert_pem.as_deref())?)
            .map_err(|e| ClientError::Tls(error_chain(&e)))?;
    } else {
        crate::tls::check_plaintext(url, opts.token.is_some())?;
    }
    Ok(ep)
}

/// HTTP/2 flow-control windows for blob streams. The defaults (64 KiB) stall a stream
/// every few messages waiting for window updates; a blob stream wants several MiB in
/// flight. Both ends of node connections use these.
pub const BLOB_STREAM_WINDOW: u32 = 16 << 20;
pub const BLOB_CONNECTION_WINDOW: u32 = 64 << 20;
/// Largest HTTP/2 frame a node connection accepts. The default (16 KiB) cuts every 2 MiB
/// blob message into 128 frames, each parsed and copied on its own; 1 MiB frames cut the
/// per-frame work on both ends of a blob stream.
pub const BLOB_MAX_FRAME: u32 = 1 << 20;

pub type NodeClient = crate::nodepb::node_client::NodeClient<InterceptedService<Channel, BearerToken>>;

/// Connects to a cache node's API at the address it registered: `HOST:PORT` (plaintext)
/// or `https://HOST:PORT` (TLS, with this process's [`crate::tls`] settings).
pub async fn connect_node(
    addr: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<NodeClient, ClientError> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let token = match token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse::<tonic::metadata::AsciiMetadataValue>()
                .map_err(|_| ClientError::BadToken)?,
        ),
        None => None,
    };
    let mut ep = Endpoint::from_shared(url.clone())
        .map_err(|_| ClientError::BadUrl(addr.to_string()))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(BLOB_STREAM_WINDOW)
        .initial_connection_window_size(BLOB_CONNECTION_WINDOW)
        .max_frame_size(BLOB_MAX_FRAME);
    let tls = url.starts_with("https://");
    if tls {
        ep = ep
            .tls_config(crate::tls::client_config(None)?)
            .map_err(|e| ClientError::Tls(error_chain(&e)))?;
    } else {
        crate::tls::check_plaintext(&url, token.is_some())?;
    }
    let connected = if tls {
        ep.connect_with_connector(tower::service_fn(buffered_tcp)).await
    } else {
        ep.connect().await
    };
    let channel = connected.map_err(|e| ClientError::ConnectNode {
        url,
        reason: error_chain(&e),
    })?;
    Ok(
        crate::nodepb::node_client::NodeClient::with_interceptor(channel, BearerToken(token))
            .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(crate::MAX_MESSAGE_BYTES),
    )
}

/// A TCP connection whose reads go through a 256 KiB buffer, for TLS to a node: rustls
/// asks its socket for at most 4 KiB at a time, so a blob stream read straight from the
/// socket costs a system call per 4 KiB; from the buffer it costs a copy.
async fn buffered_tcp(
    uri: tonic::transport::Uri,
) -> std::io::Result<hyper_util::rt::TokioIo<tokio::io::BufReader<tokio::net::TcpStream>>> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no host:port in {uri}"));
    let host = uri.host().ok_or_else(bad)?;
    let port = uri.port_u16().ok_or_else(bad)?;
    let s =
        tokio::net::TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port)).await?;
    s.set_nodelay(true)?;
    Ok(hyper_util::rt::TokioIo::new(tokio::io::BufReader::with_capacity(
        256 << 10,
        s,
    )))
}

/// A gRPC channel to a Unix socket, connected on first use and again after the server
/// restarts (a node's local socket, a CSI endpoint).
pub fn unix_channel(path: &std::path::Path) -> Channel {
    let path = path.to_path_buf();
    // The URI is required by the API but unused: every connection goes to the socket.
    Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .initial_stream_window_size(BLOB_STREAM_WINDOW)
        .initial_connection_window_size(BLOB_CONNECTION_WINDOW)
        .max_frame_size(BLOB_MAX_FRAME)
        .connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
}

/// A client of a cache node's Unix socket (same-host clients: the mount). The socket's
/// file permissions are its access control; no token is sent. The connection is made on
/// first use and remade after the node restarts, so a client outlives its node.
pub fn connect_local_node(path: &std::path::Path) -> NodeClient {
    let channel = unix_channel(path);
    crate::nodepb::node_client::NodeClient::with_interceptor(channel, BearerToken(None))
        .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(crate::MAX_MESSAGE_BYTES)
}

/// An error and its sources on one line: transport errors hide the useful part
/// ("connection refused") in their source chain.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let msg = inner.to_string();
        if !s.contains(&msg) {
            s.push_str(": ");
            s.push_str(&msg);
        }
        cur = inner.source();
    }
    s
}

/// Uploads a manifest to an open import session in pages of about `ENTRY_PAGE_BYTES`.
/// Returns the number of entries the service has received.
///
/// Two pages are in flight: the next page is built and sent while the service stores the
/// one before (it holds a page that arrives one ahead until its predecessor is stored), so
/// the client's work and the service's overlap instead of taking turns.
pub async fn put_entries_paged(
    client: &mut MetadataClient,
    session_id: u64,
    entries: impl IntoIterator<Item = pb::Entry>,
) -> Result<u64, tonic::Status> {
    let mut page = Vec::new();
    let mut page_bytes = 0usize;
    let mut page_no = 0u64;
    let mut received = 0;
    let mut in_flight: Option<tokio::task::JoinHandle<Result<u64, tonic::Status>>> = None;
    let send = |page_no: u64, page: Vec<pb::Entry>| {
        let mut c = client.clone();
        tokio::spawn(async move { send_entries(&mut c, session_id, page_no, page).await })
    };
    // A failed page fails the upload; the page after it would only wait and be refused.
    let abort = |h: &mut Option<tokio::task::JoinHandle<_>>| {
        if let Some(h) = h.take() {
            h.abort();
        }
    };
    let joined = |r: Result<Result<u64, tonic::Status>, tokio::task::JoinError>| {
        r.map_err(|e| tonic::Status::internal(format!("sending a manifest page: {e}")))?
    };
    for e in entries {
        let len = e.encoded_len() + 8;
        if !page.is_empty() && page_bytes + len > ENTRY_PAGE_BYTES {
            let next = send(page_no, std::mem::take(&mut page));
            if let Some(prev) = in_flight.replace(next) {
                received = joined(prev.await).inspect_err(|_| abort(&mut in_flight))?;
            }
            page_no += 1;
            page_bytes = 0;
        }
        page_bytes += len;
        page.push(e);
    }
    if !page.is_empty() {
        let next = send(page_no, page);
        if let Some(prev) = in_flight.replace(next) {
            received = joined(prev.await).inspect_err(|_| abort(&mut in_flight))?;
        }
    }
    if let Some(last) = in_flight {
        received = joined(last.await)?;
    }
    Ok(received)
}

async fn send_entries(
    client: &mut MetadataClient,
    session_id: u64,
    page: u64,
    entries: Vec<pb::Entry>,
) -> Result<u64, tonic::Status> {
    let r = client
        .put_entries(pb::PutEntriesRequest {
            session_id,
            page,
            entries,
        })
        .await?;
    Ok(r.into_inner().entries_received)
}

/// Uploads shard records in pages of `SHARD_PAGE_LEN`.
pub async fn put_shards_paged(
    client: &mut MetadataClient,
    session_id: u64,
    shards: Vec<pb::Shard>,
) -> Result<(), tonic::Status> {
    for (page, chunk) in shards.chunks(SHARD_PAGE_LEN).enumerate() {
        client
            .put_shards(pb::PutShardsRequest {
                session_id,
                page: page as u64,
                shards: chunk.to_vec(),
            })
            .await?;
    }
    Ok(())
}

/// Reads a whole manifest (or one directory of it), page by page.
pub async fn list_all_entries(
    client: &mut MetadataClient,
    r: pb::VersionRef,
    directory: Option<String>,
    without_chunks: bool,
) -> Result<(u64, Vec<pb::Entry>), tonic::Status> {
    let mut out = Vec::new();
    let mut token = Vec::new();
    let mut r = r;
    loop {
        let resp = client
            .list_entries(pb::ListEntriesRequest {
                r#ref: Some(r.clone()),
                directory: directory.clone(),
                page_token: token,
                limit: 10_000,
                without_chunks,
            })
            .await?
            .into_inner();
        // Pin the version so a concurrent commit cannot switch "latest" under us.
        r.version = resp.version;
        out.extend(resp.entries);
        if resp.next_page_token.is_empty() {
            return Ok((resp.version, out));
        }
        token = resp.next_page_token;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debug output goes to logs and panic messages: it must never carry a secret.
    #[test]
    fn debug_output_never_shows_a_secret() {
        let o = ClientOptions::new("http://x:1").with_token(Some("a-secret-token-value".into()));
        assert!(!format!("{o:?}").contains("a-secret-token-value"));
        let t = crate::tls::ServerTls {
            cert_pem: b"CERT".to_vec(),
            key_pem: b"PRIVATE-KEY-BYTES".to_vec(),
            client_ca_pem: None,
        };
        assert!(!format!("{t:?}").contains("PRIVATE-KEY-BYTES"));
        let c = crate::tls::ClientTls {
            ca_pem: None,
            identity: Some((b"CERT".to_vec(), b"PRIVATE-KEY-BYTES".to_vec())),
            insecure: false,
        };
        assert!(!format!("{c:?}").contains("PRIVATE-KEY-BYTES"));
    }
}
