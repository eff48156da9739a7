//! Runs the metadata service: opens the store, binds the gRPC and HTTP listeners (TLS
//! optional), refuses an unauthenticated service on a non-loopback address, reaps idle
//! import sessions, and shuts down cleanly (stop accepting, drain calls, close the store)
//! when the given shutdown future completes.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::audit::AuditLog;
use crate::auth::TokenSet;
use crate::catalog::{Catalog, CatalogConfig};
use crate::metrics::{Metrics, StateLabel};
use crate::service::MetadataService;
use crate::store::RocksStore;
use crate::SystemClock;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// Metrics and health; None disables the HTTP port.
    pub http_listen: Option<SocketAddr>,
    pub tokens_file: Option<PathBuf>,
    /// TLS for the gRPC and HTTP ports (mutual TLS on gRPC when it names a client CA).
    pub tls: Option<locus_proto::tls::ServerTls>,
    /// Allow serving without tokens on a non-loopback address.
    pub insecure: bool,
    pub catalog: CatalogConfig,
    /// Written once listening: `grpc=ADDR` and `http=ADDR` lines, for supervisors and tests
    /// that bind port 0.
    pub addr_file: Option<PathBuf>,
    /// Default: DATA_DIR/audit.log.
    pub audit_log: Option<PathBuf>,
    /// Connection cap and header deadline of the HTTP port (the scheduler's, tokenless).
    pub http_limits: locus_proto::net::HttpLimits,
    /// Run as a member of a replicated group; None: a single service.
    pub group: Option<crate::group::GroupConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "refusing to serve {0} without tokens: anyone who can reach it could delete data. \
         Configure tokens (--tokens-file), listen on a loopback address, or pass --insecure"
    )]
    InsecureBind(SocketAddr),
    #[error(transparent)]
    Tokens(#[from] crate::auth::TokenFileError),
    #[error("cannot use data dir {path}: {reason}")]
    DataDir { path: String, reason: String },
    #[error(transparent)]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: SocketAddr, reason: String },
    #[error("TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    GrantKeys(#[from] crate::grant_keys::KeyRingError),
    #[error("gRPC server failed: {0}")]
    Serve(String),
    #[error("metadata group: {0}")]
    Group(#[from] crate::group::GroupError),
}

fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    locus_proto::net::bind_tcp(addr).map_err(|e| ServerError::Bind {
        addr,
        reason: e.to_string(),
    })
}

/// Runs the service until `shutdown` completes.
pub async fn serve(
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let tokens = match &config.tokens_file {
        Some(p) => Some(Arc::new(TokenSet::load(p)?)),
        None => None,
    };
    if tokens.is_none() && !config.listen.ip().is_loopback() && !config.insecure {
        return Err(ServerError::InsecureBind(config.listen));
    }
    if tokens.is_none() {
        tracing::warn!("no tokens configured: every caller may do everything (loopback or --insecure)");
    }

    let dd = |e: std::io::Error| ServerError::DataDir {
        path: config.data_dir.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(&config.data_dir).map_err(dd)?;
    // The catalogue, the grant keys, the raft log and the audit log are this service's
    // alone (set again at every start: an older, wider directory is narrowed).
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&config.data_dir, std::fs::Permissions::from_mode(0o700)).map_err(dd)?;
    }
    let db = config.data_dir.join("db");
    let rocks = match config.group {
        Some(_) => RocksStore::open_replicated(&db),
        None => RocksStore::open(&db),
    };
    let rocks = Arc::new(rocks.map_err(crate::catalog::CatalogError::from)?);
    let audit_path = config
        .audit_log
        .clone()
        .unwrap_or_else(|| config.data_dir.join("audit.log"));
    let audit = Arc::new(AuditLog::open(&audit_path).map_err(dd)?);
    let metrics = Arc::new(Metrics::new(crate::metrics::MetricsShape {
        group: config.group.is_some(),
        tls_not_after: config.tls.as_ref().and_then(|t| t.not_after()),
    }));

    let grpc_listener = bind(config.listen)?;
    let grpc_addr = grpc_listener.local_addr().map_err(|e| ServerError::Bind {
        addr: config.listen,
        reason: e.to_string(),
    })?;
    let http_listener = match config.http_listen {
        Some(a) => Some(bind(a)?),
        None => None,
    };
    let http_addr = http_listener.as_ref().and_then(|l| l.local_addr().ok());

    // One shutdown signal fanned out to every task.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let catalog_slot: Arc<std::sync::OnceLock<Arc<Catalog>>> = Default::default();
    let (store, group, raft_addr, raft_server): (Arc<dyn crate::store::KvStore>, _, _, _) =
        match &config.group {
            None => (rocks as Arc<dyn crate::store::KvStore>, None, None, None),
            Some(g) => {
                let (group, raft_addr, task) = start_group(
                    g,
                    &config,
                    rocks,
                    grpc_addr,
                    tokens.clone(),
                    stop_rx.clone(),
                    catalog_slot.clone(),
                )
                .await?;
                (group.store(), Some(group), Some(raft_addr), Some(task))
            }
        };
    if let Some(g) = &group {
        g.catalogue_ready(stop_rx.clone()).await?;
    }
    let catalog = {
        let (store, config) = (store.clone(), config.catalog.clone());
        Arc::new(
            tokio::task::spawn_blocking(move || Catalog::open(store, Arc::new(SystemClock), config))
                .await
                .map_err(|e| ServerError::Serve(e.to_string()))??,
        )
    };
    // Kept beside the store, never in it: a catalogue export (a backup) must not carry it.
    // A group shares one key, replicated in its own state (also never exported).
    let grant_keys = Arc::new(match &group {
        None => {
            let (store, ring) = crate::grant_keys::FileRing::open(&config.data_dir)?;
            crate::grant_keys::GrantKeys::new(Arc::new(store), ring)
        }
        Some(g) => {
            let ring = g.grant_keys(stop_rx.clone()).await?;
            crate::grant_keys::GrantKeys::new(Arc::new(crate::group::GroupRing(g.clone())), ring)
        }
    });
    if let Some(g) = &group {
        let _ = catalog_slot.set(catalog.clone());
        tokio::spawn(follow_leadership(
            g.clone(),
            catalog.clone(),
            metrics.clone(),
            stop_rx.clone(),
        ));
        tokio::spawn(g.clone().follow_liveness(catalog.clone(), stop_rx.clone()));
    }

    // Copy orders (repair, warm) carry grants this service signs; without tokens, none.
    let orders = crate::repair::CopyOrders {
        keys: tokens.is_some().then(|| grant_keys.clone()),
        cluster_id: catalog.cluster_id().to_string(),
    };
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .tcp_nodelay(true);
    let mut http_tls = None;
    if let Some(tls) = &config.tls {
        server = server
            .tls_config(tls.tonic())
            .map_err(|e| ServerError::Tls(locus_proto::client::error_chain(&e)))?;
        http_tls = Some(tls.http_acceptor().map_err(ServerError::Tls)?);
    }
    let svc = pb_server(
        MetadataService::new(
            catalog.clone(),
            audit.clone(),
            metrics.clone(),
            grant_keys.clone(),
        )
        .with_copy_orders(orders.clone())
        .with_group(group.clone()),
    );

    if let Some(path) = &config.addr_file {
        let mut s = format!("grpc={grpc_addr}\n");
        if let Some(h) = http_addr {
            s.push_str(&format!("http={h}\n"));
        }
        if let Some(r) = raft_addr {
            s.push_str(&format!("raft={r}\n"));
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, s)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(dd)?;
    }
    tracing::info!(
        grpc = %grpc_addr,
        http = ?http_addr,
        tls = config.tls.is_some(),
        mutual_tls = config.tls.as_ref().is_some_and(|t| t.client_ca_pem.is_some()),
        auth = tokens.is_some(),
        cluster = catalog.cluster_id(),
        "metadata service ready"
    );

    let reaper = tokio::spawn(reap_sessions(catalog.clone(), metrics.clone(), stop_rx.clone()));
    // The service's own heartbeat: a gap in it is a pause of the service, not of the
    // nodes (`Catalog::tick`).
    let ticker = {
        let (catalog, mut stop) = (catalog.clone(), stop_rx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(crate::catalog::TICK_EVERY) => catalog.tick(),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    };
    let repairer = tokio::spawn(crate::repair::run(
        catalog.clone(),
        metrics.clone(),
        orders,
        stop_rx.clone(),
    ));
    let http = http_listener.map(|l| {
        let app = http_router(
            catalog.clone(),
            metrics.clone(),
            grant_keys.clone(),
            group.clone(),
            tokens.clone(),
        );
        let rx = stop_rx.clone();
        let limits = config.http_limits;
        tokio::spawn(locus_proto::net::serve_http(
            l,
            app,
            limits,
            http_tls,
            stopped(rx),
        ))
    });

    let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
    let mut router = server.layer(crate::auth::layer(tokens, metrics, audit.clone()));
    let router = match &group {
        None => router.add_service(svc),
        Some(g) => router.add_service(crate::group::forward::Forward::new(svc, g.clone())),
    };
    let grpc = router.serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone()));
    // Once shutdown is asked for, in-flight calls get a bounded time to finish.
    match locus_proto::net::serve_with_grace(grpc, stop_rx.clone(), Duration::from_secs(10)).await {
        Some(r) => r.map_err(|e| ServerError::Serve(locus_proto::client::error_chain(&e)))?,
        None => tracing::warn!("calls still running after 10 s; stopping anyway"),
    }
    reaper.abort();
    repairer.abort();
    ticker.abort();
    if let Some(g) = &group {
        // Leaves the group's log and state consistent on disk; the others elect anew.
        let _ = tokio::time::timeout(Duration::from_secs(5), g.raft().shutdown()).await;
    }
    if let Some(t) = raft_server {
        t.abort();
    }
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(5), h).await;
    }
    // Dropping the last catalogue reference closes RocksDB (memtables are in the WAL,
    // which every acknowledged commit synced).
    drop(catalog);
    tracing::info!("metadata service stopped");
    Ok(())
}

/// Starts this member's Raft (and its Raft port) and waits until the catalogue can be
/// opened: the schema has reached this member, or it leads a new group and writes it.
async fn start_group(
    g: &crate::group::GroupConfig,
    config: &ServerConfig,
    rocks: Arc<RocksStore>,
    grpc_addr: SocketAddr,
    tokens: Option<Arc<TokenSet>>,
    stop: tokio::sync::watch::Receiver<bool>,
    catalog_slot: Arc<std::sync::OnceLock<Arc<Catalog>>>,
) -> Result<(Arc<crate::group::Group>, SocketAddr, tokio::task::JoinHandle<()>), ServerError> {
    use crate::group::{Group, GroupError, RaftService};
    let me = g.members.iter().find(|m| m.name == g.me);
    let raft_listen = match (g.raft_listen, me) {
        (Some(a), _) => a,
        (None, Some(m)) => tokio::net::lookup_host(&m.addr)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| GroupError::Config(format!("cannot resolve this member's address {}", m.addr)))?,
        (None, None) => {
            return Err(GroupError::Config(format!(
                "--id {} is not among the --cluster members; give its raft address there",
                g.me
            ))
            .into())
        }
    };
    if tokens.is_none() && !raft_listen.ip().is_loopback() && !config.insecure {
        return Err(ServerError::InsecureBind(raft_listen));
    }
    let raft_listener = bind(raft_listen)?;
    let raft_addr = raft_listener.local_addr().map_err(|e| ServerError::Bind {
        addr: raft_listen,
        reason: e.to_string(),
    })?;
    // What followers forward to: this member's own Metadata port, by the host the others
    // reach its raft port at when it listens on every address.
    let host = if grpc_addr.ip().is_unspecified() {
        me.and_then(|m| m.addr.rsplit_once(':').map(|(h, _)| h.to_string()))
            .unwrap_or_else(|| raft_addr.ip().to_string())
    } else {
        grpc_addr.ip().to_string()
    };
    let scheme = if config.tls.is_some() { "https" } else { "http" };
    let api_url = format!("{scheme}://{host}:{}", grpc_addr.port());

    let mut g = g.clone();
    g.tls = config.tls.is_some();
    g.insecure = config.insecure;
    // The raft port opens only to the member role: the secret this member presents must
    // be one, or the others (holding the same tokens file) would refuse it.
    if let Some(t) = &tokens {
        let role = g
            .token
            .as_deref()
            .and_then(|s| t.authenticate(s.as_bytes()))
            .and_then(|p| p.role);
        match role {
            Some(crate::auth::Role::Member) => {}
            None => {
                return Err(GroupError::Config(
                    "a group whose members check tokens needs a member secret: add a [[token]] with \
                     role = \"member\" to every member's tokens file (the same one everywhere) and \
                     give its secret as LOCUS_METADATA_MEMBER_TOKEN or --member-token-file"
                        .into(),
                )
                .into())
            }
            Some(other) => {
                return Err(GroupError::Config(format!(
                    "the member secret is a token of role {} in the tokens file; members present \
                     a token of role \"member\", which opens the raft ports and nothing else (an \
                     admin token there would hand every peer admin rights)",
                    other.as_str()
                ))
                .into())
            }
        }
    }
    let g = &g;
    let group = Group::start(g, &config.data_dir, rocks).await?;
    let svc = RaftService::new(
        group.raft().clone(),
        g.me.clone(),
        api_url,
        g.token.clone(),
        catalog_slot,
        group.leader_commit(),
    )
    .server();
    let auth = locus_proto::auth::AuthLayer::new(tokens, Arc::new(crate::group::RaftPolicy));
    let incoming = tonic::transport::server::TcpIncoming::from(raft_listener).with_nodelay(Some(true));
    let mut stop2 = stop.clone();
    // The raft port speaks TLS whenever the Metadata port does (the same certificate and,
    // with mutual TLS, the same client CA).
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &config.tls {
        builder = builder
            .tls_config(tls.tonic())
            .map_err(|e| ServerError::Tls(locus_proto::client::error_chain(&e)))?;
    }
    let task = tokio::spawn(async move {
        let r = builder
            .layer(auth)
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop2.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!("the raft port failed: {}", locus_proto::client::error_chain(&e));
        }
    });
    tracing::info!(member = %g.me, raft = %raft_addr, "metadata group member started; waiting for the catalogue");
    let mut waited = 0u64;
    loop {
        if group.has_schema() {
            break;
        }
        // A new group: its first leader writes the schema, once it has applied
        // everything committed before it (an earlier leader may have written it already).
        if group.is_leader() && group.linearize().await.is_ok() && !group.has_schema() {
            break;
        }
        if *stop.borrow() {
            return Err(ServerError::Serve(
                "stopped while waiting for the metadata group".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
        if waited.is_multiple_of(100) {
            tracing::warn!(
                "still waiting for the metadata group ({} s): is a majority of --cluster members running?",
                waited / 10
            );
        }
    }
    group.seal_preexisting().await?;
    Ok((group, raft_addr, task))
}

/// Keeps the catalogue's acting flag equal to this member's leadership.
async fn follow_leadership(
    group: Arc<crate::group::Group>,
    catalog: Arc<Catalog>,
    gauges: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut metrics = group.raft().metrics();
    loop {
        let leading = group.is_leader();
        if let Some(g) = &gauges.group {
            g.is_leader.set(i64::from(leading));
            g.has_leader.set(i64::from(group.leader().is_some()));
            g.applied_index.set(group.applied_index() as i64);
        }
        if leading != catalog.acting() {
            tracing::info!(
                member = group.name(),
                leading,
                "metadata group leadership changed"
            );
            let c = catalog.clone();
            let _ = tokio::task::spawn_blocking(move || c.set_acting(leading)).await;
        }
        tokio::select! {
            r = metrics.changed() => if r.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

fn pb_server(svc: MetadataService) -> locus_proto::pb::metadata_server::MetadataServer<MetadataService> {
    locus_proto::pb::metadata_server::MetadataServer::new(svc)
        .max_decoding_message_size(locus_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(locus_proto::MAX_MESSAGE_BYTES)
}

async fn reap_sessions(
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let every =
        (catalog.config().session_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // In a group only the leader reaps.
        if !catalog.acting() {
            continue;
        }
        let c = catalog.clone();
        match tokio::task::spawn_blocking(move || c.reap_sessions()).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => {
                metrics.sessions_reaped.inc_by(n as u64);
                tracing::info!(sessions = n, "discarded idle import sessions");
            }
            Ok(Err(e)) => tracing::error!("reaping import sessions failed: {e}"),
            Err(e) => tracing::error!("reaper task failed: {e}"),
        }
    }
}

fn http_router(
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    grant_keys: Arc<crate::grant_keys::GrantKeys>,
    group: Option<Arc<crate::group::Group>>,
    tokens: Option<Arc<TokenSet>>,
) -> axum::Router {
    use axum::routing::{get, post};
    let page = {
        let (catalog, metrics, tokens) = (catalog.clone(), metrics.clone(), tokens.clone());
        move |headers: axum::http::HeaderMap| {
            let (catalog, metrics, group, tokens) =
                (catalog.clone(), metrics.clone(), group.clone(), tokens.clone());
            async move { overview_page(catalog, metrics, group, tokens, headers).await }
        }
    };
    let (api_catalog, assign_catalog) = (catalog.clone(), catalog.clone());
    let locality_tokens = tokens.clone();
    // The extender's routes, with its token in a header or in the path.
    let extender = |filter: bool| {
        let (catalog, tokens) = (catalog.clone(), tokens.clone());
        move |path: Option<axum::extract::Path<String>>,
              headers: axum::http::HeaderMap,
              body: axum::body::Bytes| {
            let (catalog, tokens) = (catalog.clone(), tokens.clone());
            async move {
                use axum::response::IntoResponse;
                let t = path.map(|p| p.0);
                let who = match crate::http_api::authorize_extender(tokens.as_deref(), &headers, t.as_deref())
                {
                    Ok(p) => p,
                    Err(r) => return *r,
                };
                if filter {
                    crate::k8s::filter(catalog, who, body).await
                } else {
                    crate::k8s::prioritize(catalog, who, body).await
                }
                .into_response()
            }
        }
    };
    axum::Router::new()
        .route("/", get(page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/k8s/prioritize", post(extender(false)))
        .route("/k8s/filter", post(extender(true)))
        .route("/k8s/{token}/prioritize", post(extender(false)))
        .route("/k8s/{token}/filter", post(extender(true)))
        .route(
            "/v1/locality",
            post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                crate::http_api::locality(api_catalog.clone(), locality_tokens.clone(), headers, body)
            }),
        )
        .route(
            "/v1/assign",
            post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                crate::http_api::assign(assign_catalog.clone(), tokens.clone(), headers, body)
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let catalog = catalog.clone();
                let metrics = metrics.clone();
                let keys = grant_keys.clone();
                async move { render_metrics(catalog, metrics, keys).await }
            }),
        )
}

async fn overview_page(
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    group: Option<Arc<crate::group::Group>>,
    tokens: Option<Arc<TokenSet>>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Err(r) = crate::http_api::authorize_page(tokens.as_deref(), &headers) {
        return *r;
    }
    let view = group.map(|g| {
        let (members, leader, _) = g.info();
        (members, leader)
    });
    let now = locus_proto::grant::now_ms() as i64;
    let html =
        tokio::task::spawn_blocking(move || crate::overview::render(&catalog, &metrics, view, now)).await;
    match html {
        Ok(Ok(html)) => (
            [
                (http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
                // No script may run on this page, whatever a value in it holds.
                (
                    http::header::CONTENT_SECURITY_POLICY,
                    "default-src 'none'; style-src 'unsafe-inline'",
                ),
                (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            html,
        )
            .into_response(),
        Ok(Err(e)) => (http::StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
        Err(e) => (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("task failed: {e}\n"),
        )
            .into_response(),
    }
}

async fn render_metrics(
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    keys: Arc<crate::grant_keys::GrantKeys>,
) -> impl axum::response::IntoResponse {
    let m = metrics.clone();
    let _ = tokio::task::spawn_blocking(move || {
        let now = locus_proto::grant::now_ms();
        m.signing_key_created
            .set((keys.ring().signer_created_ms(now) / 1000) as i64);
        if let Ok(nodes) = catalog.list_nodes() {
            let up = nodes
                .iter()
                .filter(|n| n.state == locus_proto::pb::NodeState::Up as i32)
                .count();
            m.nodes
                .get_or_create(&StateLabel { state: "up".into() })
                .set(up as i64);
            m.nodes
                .get_or_create(&StateLabel { state: "down".into() })
                .set((nodes.len() - up) as i64);
        }
        if let Ok(n) = catalog.open_sessions() {
            m.open_sessions.set(n as i64);
        }
        for t in &catalog.config().teams {
            let label = crate::metrics::TeamLabel { team: t.name.clone() };
            if let Ok(used) = catalog.pinned_by(|d| t.covers(d)) {
                m.team_pinned.get_or_create(&label).set(used as i64);
            }
            m.team_pinned_limit
                .get_or_create(&label)
                .set(t.pinned_limit.min(i64::MAX as u64) as i64);
        }
        m.store_bytes.set(catalog.size_on_disk() as i64);
        if let Ok(b) = catalog.list_backups() {
            let last = b
                .iter()
                .filter(|(_, r)| !r.restored)
                .map(|(_, r)| r.recorded_at_ms)
                .max();
            m.last_backup.set(last.unwrap_or(0) / 1000);
        }
    })
    .await;
    (
        [(
            http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.encode(),
    )
}
