//! The Locus cache node: the blob store on a GPU host's NVMe, the node API its peers,
//! importers and the repair loop use, and the local socket the FUSE mount asks for blobs.
//!
//! Background work of a running node, each on its own task so that none waits on another:
//! heartbeats (`agent`: space, inventory and refill figures; nothing slow ever runs on
//! this task, so a node busy with long work is never taken for dead), pin sync (`agent`:
//! the metadata service says which blobs this node must hold; the node pins exactly those
//! and queues the missing ones), the refill workers (`refill`: bounded-parallel,
//! rate-limited copies of the queued blobs with retries and backoff) and scrub (`scrub`:
//! re-verifies stored blobs at a bounded rate, resuming after a restart; a blob that fails
//! is quarantined, which triggers a pin sync that queues it for refill).
//!
//! It depends on `locus-proto`, and on `locus-backup` to read blobs back from backups; it
//! never reaches into another Locus crate's internals.

mod access;
pub mod agent;
mod bulk;
pub mod identity;
pub mod metrics;
mod open_socket;
mod peers;
mod ranges;
pub mod refill;
pub mod scrub;
pub mod service;
pub mod store;
pub mod transfer;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::client::ClientOptions;
use locus_proto::{nodepb, NodeId};

use crate::service::NodeService;
use crate::store::{BlobStore, StoreConfig};
pub use access::required_access;
use access::NodePolicy;
pub use peers::{Peers, Sources};

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub id: NodeId,
    pub metadata: ClientOptions,
    pub listen: SocketAddr,
    /// Metrics and health over HTTP; None disables.
    pub http_listen: Option<SocketAddr>,
    /// Address peers and the metadata service use to reach this node; default: the bound
    /// address (which must then not be a wildcard).
    pub advertise: Option<String>,
    pub local_socket: Option<PathBuf>,
    /// Group allowed on the Unix socket besides root and the node's own user (its mode is
    /// 0660, owned by this group); None: the node's own group.
    pub local_socket_gid: Option<u32>,
    pub store: StoreConfig,
    pub labels: HashMap<String, String>,
    pub heartbeat_interval: Duration,
    pub pin_sync_interval: Duration,
    /// How much earlier than an open import's start (or, with none open, a pin sync's)
    /// a writer's pin may be and still be kept by pin sync: the clocks of this host and
    /// the metadata service's may disagree by this much.
    pub write_pin_grace: Duration,
    /// Scrub rate in bytes per second; 0 disables scrubbing.
    pub scrub_rate: u64,
    pub addr_file: Option<PathBuf>,
    /// Callers of the TCP API must present grants: set when the cluster runs with tokens
    /// (this node has a token of its own, or was given a tokens file). Without it the
    /// node only listens on loopback unless `insecure`.
    pub require_grants: bool,
    pub insecure: bool,
    /// TLS for the node API and HTTP port. The node then registers `https://ADVERTISE`.
    pub tls: Option<locus_proto::tls::ServerTls>,
    /// How long a peer may stay silent during a transfer before it is given up on.
    pub peer_idle: Duration,
    /// Refill copies at once.
    pub refill_parallel: usize,
    /// Bytes per second for all refill copies together; 0 = unlimited.
    pub refill_rate: u64,
    /// The local directories this node may read as `file://` origins (imports it reads
    /// itself, repairs from an origin); none: no local origin at all.
    pub origin_roots: Vec<PathBuf>,
    /// Host users (by uid) narrowed to datasets on the open socket: each is handed only
    /// blobs of versions of the datasets its scope matches, under grants naming them.
    pub socket_scopes: HashMap<u32, locus_proto::auth::Scope>,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error(
        "refusing to serve {0} without tokens: anyone who can reach it could fill this node. \
         Give --tokens-file, listen on a loopback address, or pass --insecure"
    )]
    InsecureBind(SocketAddr),
    #[error("node API server failed: {0}")]
    Serve(String),
    /// Another process holds this node's id, or the data dir belongs to another cluster.
    #[error("{0}")]
    Identity(String),
}

fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, NodeError> {
    locus_proto::net::bind_tcp(addr).map_err(|e| NodeError::Bind {
        addr: addr.to_string(),
        reason: e.to_string(),
    })
}

/// Gives the Unix socket mode 0660 and group `gid` (default: this process's); the group
/// in effect.
fn restrict_socket(p: &std::path::Path, gid: Option<u32>) -> Result<u32, NodeError> {
    use std::os::unix::fs::PermissionsExt;
    let fail = |e: std::io::Error| NodeError::Bind {
        addr: p.display().to_string(),
        reason: e.to_string(),
    };
    let gid = gid.unwrap_or_else(|| nix::unistd::getegid().as_raw());
    std::os::unix::fs::chown(p, None, Some(gid)).map_err(fail)?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o660)).map_err(fail)?;
    Ok(gid)
}

/// Root, this node's user and members of the socket's group (by primary group) may use
/// the socket.
fn peer_allowed(s: &tokio::net::UnixStream, gid: u32) -> bool {
    let me = nix::unistd::geteuid().as_raw();
    match s.peer_cred() {
        Ok(c) if c.uid() == 0 || c.uid() == me || c.gid() == gid => true,
        Ok(c) => {
            tracing::warn!(
                pid = ?c.pid(),
                uid = c.uid(),
                gid = c.gid(),
                "refused a connection on the local socket: not root, not this node's user, not in its group"
            );
            false
        }
        Err(e) => {
            tracing::warn!("refused a connection on the local socket: no peer credentials: {e}");
            false
        }
    }
}

/// Runs a cache node until `shutdown` completes.
pub async fn serve(
    cfg: NodeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), NodeError> {
    if !cfg.require_grants && !cfg.listen.ip().is_loopback() && !cfg.insecure {
        return Err(NodeError::InsecureBind(cfg.listen));
    }
    let opening = std::time::Instant::now();
    let (store, rep) = BlobStore::open(cfg.store.clone())?;
    tracing::info!(
        indexed = rep.indexed,
        quarantined = rep.quarantined,
        tmp_removed = rep.tmp_removed,
        "blob store opened in {:.2}s",
        opening.elapsed().as_secs_f64()
    );
    // The walk of the blob directories runs beside serving (store::BlobStore::check_dirs).
    let checking = store.clone();
    tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        match checking.check_dirs() {
            Ok(rep) => {
                tracing::info!(
                    missing = rep.missing,
                    adopted = rep.adopted,
                    quarantined = rep.quarantined,
                    stray_outboards = rep.stray_outboards,
                    "blob directories checked against the index in {:.1}s",
                    started.elapsed().as_secs_f64()
                );
                if rep.missing > 0 {
                    tracing::warn!(
                        missing = rep.missing,
                        "blobs in the index were missing on disk; pin sync will refetch pinned ones"
                    );
                }
            }
            Err(e) => tracing::warn!("cannot check the blob directories against the index: {e}"),
        }
    });
    let listener = bind(cfg.listen)?;
    let bound = listener.local_addr().map_err(|e| NodeError::Bind {
        addr: cfg.listen.to_string(),
        reason: e.to_string(),
    })?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None if bound.ip().is_unspecified() => {
            return Err(NodeError::Config(format!(
                "listening on {bound}: give --advertise HOST:PORT so peers know where to reach this node"
            )))
        }
        None => bound.to_string(),
    };
    // The scheme is part of the registered address: it is how peers, the metadata
    // service and mounts know to speak TLS to this node.
    let advertise = match (&cfg.tls, advertise.strip_prefix("https://")) {
        (Some(_), Some(_)) => advertise,
        (Some(_), None) => format!("https://{advertise}"),
        (None, Some(_)) => {
            return Err(NodeError::Config(format!(
                "--advertise {advertise} says https but this node has no --tls-cert"
            )))
        }
        (None, None) => advertise,
    };
    let identity = identity::Identity::load_or_create(&cfg.store.dirs[0])?;
    let peers = Arc::new(Peers::with_origin_roots(
        cfg.metadata.clone(),
        cfg.id.as_str(),
        cfg.origin_roots.clone(),
    ));
    let metrics = Arc::new(metrics::Metrics::new(
        cfg.tls.as_ref().and_then(|t| t.not_after()),
    ));
    let refill = refill::Refill::new(refill::RefillConfig {
        me: cfg.id.to_string(),
        parallel: cfg.refill_parallel,
        rate: cfg.refill_rate,
        idle: cfg.peer_idle,
    });
    let svc = NodeService {
        refill: refill.clone(),
        store: store.clone(),
        peers: peers.clone(),
        peer_idle: cfg.peer_idle,
        id: cfg.id.to_string(),
        local: false,
        metrics: metrics.clone(),
    };
    let http_listener = match cfg.http_listen {
        Some(a) => Some(bind(a)?),
        None => None,
    };
    let http_addr = http_listener.as_ref().and_then(|l| l.local_addr().ok());

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Set when the node must stop on its own: its id was taken over, or its data dir
    // belongs to another cluster.
    let (fatal_tx, mut fatal_rx) = tokio::sync::watch::channel::<Option<String>>(None);
    let fatal = fatal_rx.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = shutdown => {}
            _ = fatal_rx.wait_for(|f| f.is_some()) => {}
        }
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut uds = None;
    if let Some(p) = &cfg.local_socket {
        let _ = std::fs::remove_file(p);
        let l = tokio::net::UnixListener::bind(p).map_err(|e| NodeError::Bind {
            addr: p.display().to_string(),
            reason: e.to_string(),
        })?;
        let gid = restrict_socket(p, cfg.local_socket_gid)?;
        let local = NodeService {
            local: true,
            ..svc.clone()
        };
        let rx = stop_rx.clone();
        uds = Some(tokio::spawn(async move {
            // The file's mode already keeps others from connecting; the peer's credentials
            // are checked as well, so a socket whose mode was loosened (or a path bind
            // mounted into a container) still admits only the node's user, root and its
            // group, and every refusal is logged with the caller's pid and uid.
            let incoming = tokio_stream::StreamExt::filter(
                tokio_stream::wrappers::UnixListenerStream::new(l),
                move |c| match c {
                    Ok(s) => peer_allowed(s, gid),
                    Err(_) => true,
                },
            );
            if let Err(e) = tonic::transport::Server::builder()
                .initial_stream_window_size(locus_proto::client::BLOB_STREAM_WINDOW)
                .initial_connection_window_size(locus_proto::client::BLOB_CONNECTION_WINDOW)
                .max_frame_size(locus_proto::client::BLOB_MAX_FRAME)
                .add_service(node_server(local))
                .serve_with_incoming_shutdown(incoming, stopped(rx))
                .await
            {
                tracing::error!("local socket server failed: {e}");
            }
        }));
    }
    if let Some(p) = &cfg.local_socket {
        open_socket(p, &cfg, &svc, stop_rx.clone())?;
    }
    if let Some(l) = http_listener {
        let http_tls = cfg
            .tls
            .as_ref()
            .map(|t| t.http_acceptor())
            .transpose()
            .map_err(NodeError::Config)?;
        let st = store.clone();
        let m = metrics.clone();
        let rf = refill.clone();
        let app = axum::Router::new()
            .route("/healthz", axum::routing::get(|| async { "ok\n" }))
            .route(
                "/metrics",
                axum::routing::get(move || {
                    m.refill(&rf.progress());
                    m.dirs(&st.dir_space());
                    let stats = st.stats();
                    m.teams(&st.team_use(), stats.capacity.saturating_sub(stats.pinned));
                    let body = m.encode(&stats);
                    async move {
                        (
                            [(
                                http::header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            body,
                        )
                    }
                }),
            );
        let rx = stop_rx.clone();
        tokio::spawn(async move {
            locus_proto::net::serve_http(l, app, Default::default(), http_tls, stopped(rx)).await;
        });
    }
    if let Some(path) = &cfg.addr_file {
        let tmp = path.with_extension("tmp");
        let mut text = format!("grpc={bound}\n");
        if let Some(h) = http_addr {
            text.push_str(&format!("http={h}\n"));
        }
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| NodeError::Config(format!("cannot write {}: {e}", path.display())))?;
    }
    tracing::info!(node = %cfg.id, %bound, %advertise, "cache node ready");

    let agent = agent::Agent::new(
        cfg.clone(),
        advertise,
        identity,
        store.clone(),
        peers.clone(),
        refill.clone(),
        metrics.clone(),
        fatal_tx,
    );
    // The first registration before anything else runs: a node whose id another live
    // process holds, or whose data dir belongs to another cluster, stops here.
    agent.first_registration().await?;
    let background = [
        tokio::spawn(agent.clone().heartbeats(stop_rx.clone())),
        tokio::spawn(agent.clone().pin_sync(stop_rx.clone())),
        tokio::spawn(
            refill
                .clone()
                .run(store.clone(), peers.clone(), metrics.clone(), stop_rx.clone()),
        ),
    ];
    let scrubber = tokio::spawn(scrub::run(
        store.clone(),
        cfg.scrub_rate,
        metrics.clone(),
        stop_rx.clone(),
    ));

    // Blob bytes take the bulk path on this same port; with TLS on, inside TLS.
    let bulk_tls = match &cfg.tls {
        Some(t) => Some(
            t.bulk_config()
                .map_err(|e| NodeError::Config(format!("TLS: {e}")))?,
        ),
        None => None,
    };
    let bulk = Some(bulk::BulkServer::new(
        store.clone(),
        peers.clone(),
        cfg.require_grants,
        metrics.clone(),
        cfg.peer_idle,
        bulk_tls,
    ));
    let incoming = bulk::incoming(listener, bulk, stop_rx.clone());
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.tls {
        builder = builder
            .tls_config(tls.tonic())
            .map_err(|e| NodeError::Config(format!("TLS: {}", locus_proto::client::error_chain(&e))))?;
    }
    let server = builder
        .initial_stream_window_size(locus_proto::client::BLOB_STREAM_WINDOW)
        .initial_connection_window_size(locus_proto::client::BLOB_CONNECTION_WINDOW)
        .max_frame_size(locus_proto::client::BLOB_MAX_FRAME)
        .layer(locus_proto::auth::AuthLayer::new(
            // No token is accepted (every method takes a grant); an empty set turns the
            // check on.
            cfg.require_grants
                .then(|| Arc::new(locus_proto::auth::TokenSet::from_pairs([]))),
            Arc::new(NodePolicy(peers.clone())),
        ))
        .add_service(node_server(svc))
        .serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone()));
    match locus_proto::net::serve_with_grace(server, stop_rx.clone(), Duration::from_secs(10)).await {
        Some(r) => r.map_err(|e| NodeError::Serve(locus_proto::client::error_chain(&e)))?,
        None => tracing::warn!("transfers still running after 10 s; stopping anyway"),
    }
    let [heartbeats, pins, refilling] = background;
    // The heartbeat task says goodbye on its way out (the id given up); a moment for it.
    let _ = tokio::time::timeout(Duration::from_secs(3), heartbeats).await;
    pins.abort();
    refilling.abort();
    scrubber.abort();
    if let Some(u) = uds {
        let _ = tokio::time::timeout(Duration::from_secs(2), u).await;
    }
    if let Some(p) = &cfg.local_socket {
        let _ = std::fs::remove_file(p);
        let _ = std::fs::remove_file(locus_proto::open_socket::path_of(p));
    }
    if let Some(why) = fatal.borrow().clone() {
        tracing::error!("cache node stopped: {why}");
        return Err(NodeError::Identity(why));
    }
    tracing::info!("cache node stopped");
    Ok(())
}

/// Serves the open socket beside the local socket `p` (`open_socket`). Where the node
/// requires grants anyone on the host may connect (mode 0666): every request is checked
/// as a remote caller's would be. Otherwise it admits whom the local socket admits.
fn open_socket(
    p: &std::path::Path,
    cfg: &NodeConfig,
    svc: &NodeService,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), NodeError> {
    let path = locus_proto::open_socket::path_of(p);
    let _ = std::fs::remove_file(&path);
    let fail = |e: std::io::Error| NodeError::Bind {
        addr: path.display().to_string(),
        reason: e.to_string(),
    };
    let l = tokio::net::UnixListener::bind(&path).map_err(fail)?;
    let gid = if cfg.require_grants {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(fail)?;
        None
    } else {
        Some(restrict_socket(&path, cfg.local_socket_gid)?)
    };
    let server = Arc::new(open_socket::OpenSocket {
        svc: NodeService {
            local: true,
            ..svc.clone()
        },
        require_grants: cfg.require_grants,
        rt: tokio::runtime::Handle::current(),
        scopes: cfg
            .socket_scopes
            .iter()
            .map(|(u, s)| (*u, Arc::new(s.clone())))
            .collect(),
        live: Default::default(),
    });
    tokio::spawn(async move {
        let stopped = async move {
            let mut stop = stop;
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::pin!(stopped);
        loop {
            let s = tokio::select! {
                _ = &mut stopped => return,
                c = l.accept() => match c {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!("open socket: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            if gid.is_some_and(|g| !peer_allowed(&s, g)) {
                continue;
            }
            let uid = s.peer_cred().ok().map(|c| c.uid());
            let Ok(s) = s.into_std().and_then(|s| s.set_nonblocking(false).map(|_| s)) else {
                continue;
            };
            use std::sync::atomic::Ordering;
            if server.live.fetch_add(1, Ordering::SeqCst) >= open_socket::MAX_CONNECTIONS {
                server.live.fetch_sub(1, Ordering::SeqCst);
                let busy = locus_proto::nodepb::OpenBlobResponse {
                    code: tonic::Code::ResourceExhausted as u32,
                    message: format!(
                        "the open socket serves {} connections at once; close one",
                        open_socket::MAX_CONNECTIONS
                    ),
                    ..Default::default()
                };
                let _ = locus_proto::open_socket::send_response(&s, &busy, &[]);
                continue;
            }
            let srv = server.clone();
            let spawned = std::thread::Builder::new().name("open-socket".into()).spawn({
                let srv = srv.clone();
                move || {
                    srv.clone().connection(s, uid);
                    srv.live.fetch_sub(1, Ordering::SeqCst);
                }
            });
            if let Err(e) = spawned {
                srv.live.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("open socket: cannot start a thread for a connection: {e}");
            }
        }
    });
    Ok(())
}

fn node_server(svc: NodeService) -> nodepb::node_server::NodeServer<NodeService> {
    nodepb::node_server::NodeServer::new(svc)
        .max_decoding_message_size(locus_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(locus_proto::MAX_MESSAGE_BYTES)
}
