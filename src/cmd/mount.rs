//! `locus mount` and `locus umount`: a dataset version as a read-only file tree.
//!
//! Without `--foreground`, `locus mount` starts itself again in the foreground as a
//! detached child and waits until that child reports the mount ready (or fails), so the
//! command returns only once the tree can be read, and its exit status says whether it
//! can. The child logs to a file next to its status file.
//!
//! The process that stays is the mount's holder (`holder`): it keeps the FUSE connection
//! and runs the server (`--serve`, the `serve` function here), restarting it on the same
//! live connection when it dies.
//!
//! The status file (`<runtime dir>/mounts/<name>.json`, rewritten every two seconds)
//! carries the mount's totals for `locus status`; the runtime dir is `$LOCUS_RUNTIME_DIR`,
//! else `/tmp/locus-<uid>`.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use locus_fuse::{Place, Settings};

use crate::config::{size_arg, Resolved};
use crate::output;

#[derive(Args, Debug)]
pub struct MountArgs {
    /// DATASET, DATASET@VERSION or DATASET@latest (latest when no version is given).
    pub target: String,
    /// An existing, empty directory to mount on.
    pub mountpoint: PathBuf,
    /// The local cache node's Unix socket. With it, files are made present on this
    /// host's NVMe and read at local-disk speed (FUSE passthrough); without it, or when
    /// the node fails, bytes come from remote replicas.
    #[arg(long, env = "LOCUS_NODE_SOCKET", value_name = "PATH")]
    pub node_socket: Option<PathBuf>,
    /// Stay in the foreground (for systemd, containers and debugging). This process is
    /// the mount's holder: it stays while the mount does, restarts the server process if
    /// it dies, unmounts on SIGTERM and restarts the server from the executable at the
    /// same path on SIGHUP (an upgrade; `ExecReload=kill -HUP $MAINPID` under systemd).
    #[arg(long)]
    pub foreground: bool,
    /// Let other users read the mount (needs user_allow_other in /etc/fuse.conf unless
    /// run as root).
    #[arg(long)]
    pub allow_other: bool,
    /// Mount even over a directory that has files in it (hidden while mounted).
    #[arg(long)]
    pub nonempty: bool,
    /// Who opens files. kernel: the kernel opens them by itself, with no round trip to
    /// the mount per open or close (the fastest for many small files); their pages are
    /// cached by the mount and nothing is passed through. mount: every open asks the
    /// mount, which passes large local files through to the kernel (the fastest for large
    /// files). auto: mount when a local node and passthrough are in use and the version's
    /// mean file size is at least --passthrough-min-size, else kernel.
    #[arg(long, value_enum, value_name = "WHO", default_value = "auto")]
    pub opens: Opens,
    /// What a directory listing tells the kernel. adaptive: names only, until stats or
    /// opens of the files listed show attributes are wanted, then every entry with its
    /// attributes for a while: walks of names alone (find, os.walk, scandir) and walks
    /// that stat or open every file (ls -l, du, rsync, a job reading all it lists) both
    /// run near their best. all: every entry with its attributes (the kernel makes an
    /// inode for each, which names-only walks pay for). auto: the first entries of each
    /// listing with attributes, the rest as the kernel's per-directory heuristic decides.
    #[arg(long, value_enum, value_name = "WHAT", default_value = "adaptive")]
    pub readdirplus: Readdirplus,
    /// Never hand local files to the kernel; read them with pread instead.
    #[arg(long)]
    pub no_passthrough: bool,
    /// Local files smaller than this are read by the mount and kept in its page cache
    /// rather than handed to the kernel: opening a passthrough file costs more than
    /// reading a small one from cache ("0": every local file is passed through).
    #[arg(long, value_name = "SIZE", default_value = "1MiB")]
    pub passthrough_min_size: String,
    /// Threads serving kernel requests [default: one per CPU, at least 2, at most 32].
    /// More threads than CPUs only add context switches: slow work (fetching a blob,
    /// remote reads) never runs on these threads.
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Memory for verified chunks read from remote replicas: chunks read ahead, or read
    /// only in part. A chunk whose every page went to the kernel's page cache leaves it
    /// at once (the kernel answers those reads itself).
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    pub cache_size: String,
    /// How far ahead of a sequential reader to fetch from remote replicas. All readers
    /// together keep at most four times this in flight, however many there are.
    #[arg(long, value_name = "SIZE", default_value = "32MiB")]
    pub readahead: String,
    /// This host's topology labels, used to read from the cheapest replica
    /// (host defaults to the host name).
    #[arg(
        long,
        env = "LOCUS_MOUNT_LABELS",
        value_name = "K=V,...",
        default_value = "",
        hide_default_value = true
    )]
    pub labels: String,
    /// A local file the node verified is reused for this long without asking the node
    /// again: by reopens, and by reads the page cache lacks when the kernel opens files
    /// ("0s": ask every time).
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    pub reopen_cache: String,
    /// How the kernel's requests reach the mount. dev-fuse: read from /dev/fuse by the
    /// session threads. io-uring: FUSE over io_uring where the kernel offers it (Linux
    /// 6.14+ with the fuse module's enable_uring parameter on; `locus doctor` says how),
    /// each request answered on the CPU that made it with one system call, else
    /// /dev/fuse (said once in the log). It pays off for metadata: a stat of a file not
    /// yet looked up costs 3-5x less (walks and stats of many files); cold reads of small
    /// files are no faster (bench/RESULTS.md). A server restarted in place (SIGHUP) or
    /// killed hands the requests it held to the next one either way; not the default
    /// because a server that crashes (kill -9, the OOM killer) under io_uring fails the
    /// reads that reach it while it dies with ECANCELED, where /dev/fuse resends them
    /// (docs/architecture.md).
    #[arg(
        long,
        env = "LOCUS_FUSE_TRANSPORT",
        value_enum,
        value_name = "HOW",
        default_value = "dev-fuse"
    )]
    pub fuse_transport: FuseTransport,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Where the background mount logs [default: next to its status file].
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Internal: print one line on stdout when ready (used by the non-foreground parent).
    #[arg(long, hide = true)]
    pub notify_ready: bool,
    /// Internal: be the server the mount's holder process starts (see `holder`).
    #[arg(long, hide = true)]
    pub serve: bool,
}

/// What a directory listing tells the kernel (`--readdirplus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Readdirplus {
    Adaptive,
    All,
    Auto,
}

/// How the kernel's requests reach the mount (`--fuse-transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FuseTransport {
    DevFuse,
    IoUring,
}

/// Who opens files of a mount (`--opens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Opens {
    Auto,
    Kernel,
    Mount,
}

#[derive(Args, Debug)]
pub struct UmountArgs {
    /// Where a Locus version is mounted.
    pub mountpoint: PathBuf,
}

/// What `locus status` shows of a mount.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct MountStatus {
    pub mountpoint: PathBuf,
    pub dataset: String,
    pub version: u64,
    /// The process that keeps the mount (the holder): TERM unmounts, HUP restarts the
    /// server.
    pub pid: u32,
    /// The process serving the kernel's requests now; it may be restarted under a live
    /// mount (0 in status files older than restartable mounts).
    #[serde(default)]
    pub server_pid: u32,
    pub files: u64,
    pub bytes: u64,
    pub passthrough: bool,
    /// The kernel opens files by itself (`--opens`); older status files lack it.
    #[serde(default)]
    pub kernel_opens: bool,
    pub local_node: bool,
    pub started_unix_ms: u64,
    pub totals: locus_fuse::metrics::Totals,
    /// How the kernel's requests reach the mount: "io_uring" or "/dev/fuse" ("" in older
    /// status files).
    #[serde(default)]
    pub transport: String,
    /// The cluster the mount reads from ("" in older status files): `locus status` shows
    /// only its own cluster's mounts.
    #[serde(default)]
    pub cluster_id: String,
    /// When this server took over io_uring queues from a previous one: the requests that
    /// one held unanswered, run again here, and the answers it had written, sent again
    /// (a request run twice would open a handle nobody releases). 0 otherwise.
    #[serde(default)]
    pub takeover_rerun: u64,
    #[serde(default)]
    pub takeover_resent: u64,
}

mod detach;
mod holder;
mod lease;
mod runtime;
pub use detach::umount;
use detach::{check_empty, check_mountpoint, check_node_socket, local_node, spawn_background};
use runtime::{private_runtime_dir, status_path};

/// Statuses of this host's live Locus mounts.
pub fn statuses() -> Vec<MountStatus> {
    locus_fuse::mounts()
        .into_iter()
        .filter_map(|m| {
            let s = std::fs::read(status_path(&m)).ok()?;
            serde_json::from_slice(&s).ok()
        })
        .collect()
}

/// DATASET, DATASET@latest or DATASET@N, through the domain type every command uses;
/// (name, wire version: 0 = latest).
pub fn parse_target(t: &str) -> anyhow::Result<(String, u64)> {
    let r: locus_proto::DatasetRef = t
        .parse()
        .map_err(|e: locus_proto::InvalidInput| anyhow::anyhow!("{t:?}: {}", e.reason))?;
    Ok((r.name.to_string(), r.version.to_wire()))
}

pub async fn run(a: MountArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let mountpoint = crate::absolute(a.mountpoint.clone());
    parse_target(&a.target)?;
    if a.serve {
        // Started by the holder, which checked the mountpoint (mounted already, when this
        // server replaces one that died).
        return serve(a, mountpoint, cfg).await;
    }
    check_mountpoint(&mountpoint)?;
    check_empty(&mountpoint, a.nonempty)?;
    if let Some(sock) = &a.node_socket {
        check_node_socket(&crate::absolute(sock.clone()))?;
    }
    if a.foreground || a.notify_ready {
        private_runtime_dir()?;
        holder::run(&mountpoint, a.notify_ready, cfg.token.as_deref()).await
    } else {
        spawn_background(&a, &mountpoint, cfg.token.as_deref())
    }
}

async fn serve(a: MountArgs, mountpoint: PathBuf, cfg: &Resolved) -> anyhow::Result<()> {
    // The holder's "freeze before I kill you" for a planned restart (holder.rs). Taken
    // first thing: SIGUSR2's default action ends the process, and the status file that
    // names this server (and so lets anyone signal it) is written before the loop below.
    // One that arrives early waits in the stream until the loop takes it.
    let mut freeze = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
    let (dataset, version) = parse_target(&a.target)?;
    let takeover = holder::takeover_from_env()?;
    private_runtime_dir()?;
    let mut options = mount_options(&a, &dataset, version, &mountpoint, cfg)?;
    let place_host = options.place.host.clone();
    let passthrough_min_size = options.settings.passthrough_min_size;
    let mut client = cfg.connect().await?;
    let lease_client = client.clone();
    let cluster_id = client
        .get_cluster_info(locus_proto::pb::GetClusterInfoRequest {})
        .await
        .map(|r| r.into_inner().cluster_id)
        .unwrap_or_default();
    (options.local, options.local_open) = match &a.node_socket {
        Some(p) => local_node(&crate::absolute(p.clone())).await,
        None => (None, None),
    };
    // The mount keeps recently verified local files open, up to a quarter of its
    // open-file limit: the usual soft limit of 1,024 would remember only 256 files.
    super::raise_open_file_limit();
    let holder = holder::Channel::from_env().map(Arc::new);
    let reports = holder.clone().map(|h| h as Arc<dyn locus_fuse::handoff::Holder>);
    let serving = locus_fuse::start::start(&mut client, options, takeover, reports)
        .await
        .map_err(|e| match e {
            locus_fuse::start::StartError::Load(e) => anyhow::anyhow!("cannot load {}: {e}", a.target),
            e => anyhow::anyhow!("{e}"),
        })?;
    let v = &serving.version;
    let transport = serving.transport();
    let metrics = serving.metrics.clone();
    if let Some(addr) = &a.metrics_listen {
        serve_metrics(addr, metrics.clone()).await?;
    }
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let holder_pid = if holder.is_some() {
        std::os::unix::process::parent_id()
    } else {
        std::process::id()
    };
    // Final once the session has started: every queue settled what it adopted first.
    let (rerun, resent) = serving.control.as_ref().map_or((0, 0), |c| c.taken_over());
    let status = MountStatus {
        takeover_rerun: rerun as u64,
        takeover_resent: resent as u64,
        mountpoint: mountpoint.clone(),
        dataset: dataset.clone(),
        version: v.version,
        pid: holder_pid,
        server_pid: std::process::id(),
        files: v.files,
        bytes: v.bytes,
        passthrough: false,
        kernel_opens: false,
        local_node: a.node_socket.is_some(),
        transport: transport.to_string(),
        started_unix_ms,
        totals: Default::default(),
        cluster_id: cluster_id.clone(),
    };
    let negotiated = (serving.passthrough.clone(), serving.kernel_opens.clone());
    let write_status = status_writer(status, metrics.clone(), negotiated, serving.fuse.try_clone()?);
    write_status();

    let how = reading_how(
        a.node_socket.is_some(),
        serving.kernel_opens.load(Ordering::Relaxed),
        serving.passthrough.load(Ordering::Relaxed),
        passthrough_min_size,
    );
    let msg = format!(
        "mounted {dataset}@{} at {} ({} files, {}; loaded in {:.2}s; {how}; requests through {transport})\n",
        v.version,
        mountpoint.display(),
        v.files,
        output::size(v.bytes),
        serving.load_took.as_secs_f64(),
    );
    match &holder {
        Some(h) => h.ready(&msg)?,
        None => eprint!("{msg}"),
    }
    let mut lease = lease::Lease::new(lease_client, &dataset, v.version, &place_host, &mountpoint);
    lease.tick().await;

    let mut tick = tokio::time::interval(TICK);
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = freeze.recv() => {
                match (&serving.control, &holder) {
                    (Some(c), Some(h)) => {
                        tracing::info!("freezing the io_uring queues for a restart");
                        let held = h.clone();
                        c.freeze(move || held.held());
                        h.freezing();
                    }
                    _ => tracing::info!("SIGUSR2 ignored: no io_uring queues to freeze"),
                }
            }
            _ = &mut shutdown => {
                tracing::info!("unmounting {}", mountpoint.display());
                if serving.took_over {
                    // Only the server that mounted holds fuser's unmount handle.
                    holder::unmount_if_ours(&mountpoint, std::os::fd::AsFd::as_fd(&serving.fuse), serving.device.as_deref());
                }
                let session = serving.session;
                let r = tokio::task::spawn_blocking(move || session.umount_and_join()).await?;
                if let Err(e) = r {
                    tracing::warn!("unmount: {e}");
                }
                break;
            }
            _ = tick.tick() => {
                if serving.session.guard.is_finished() {
                    tracing::info!("{} was unmounted", mountpoint.display());
                    let session = serving.session;
                    let _ = tokio::task::spawn_blocking(move || session.join()).await;
                    break;
                }
                write_status();
                lease.tick().await;
            }
        }
    }
    // Before the status file goes: `locus umount` waits for that, so a script's
    // `dataset rm` right after it finds the lease withdrawn.
    lease.end().await;
    runtime::remove_status_of(&mountpoint, holder_pid);
    Ok(())
}

/// The mount's options from its arguments (the local node's clients are added once
/// connected).
fn mount_options(
    a: &MountArgs,
    dataset: &str,
    version: u64,
    mountpoint: &std::path::Path,
    cfg: &Resolved,
) -> anyhow::Result<locus_fuse::start::MountOptions> {
    let mut labels = crate::cmd::node::parse_labels(&a.labels)?;
    let place_host = labels.remove("host").unwrap_or_else(crate::cmd::node::hostname);
    let place = Place {
        host: place_host,
        rack: labels.remove("rack"),
        zone: labels.remove("zone"),
    };
    let mut options = locus_fuse::start::MountOptions::new(dataset, mountpoint.to_path_buf(), place);
    options.version = version;
    options.cache_bytes = size_arg("--cache-size", &a.cache_size)? as usize;
    options.readahead = size_arg("--readahead", &a.readahead)?;
    options.token = cfg.token.clone();
    options.cache_dir = Some(runtime::namespace_dir()?);
    options.opens = match a.opens {
        Opens::Auto => locus_fuse::start::Opens::Auto,
        Opens::Kernel => locus_fuse::start::Opens::Kernel,
        Opens::Mount => locus_fuse::start::Opens::Mount,
    };
    options.settings = Settings {
        passthrough: !a.no_passthrough,
        passthrough_min_size: size_arg("--passthrough-min-size", &a.passthrough_min_size)?,
        reopen_ttl: locus_proto::human::parse_duration(&a.reopen_cache)
            .map_err(|e| anyhow::anyhow!("--reopen-cache: {}", e.reason))?,
        readdirplus: match a.readdirplus {
            Readdirplus::Adaptive => locus_fuse::Readdirplus::Adaptive,
            Readdirplus::All => locus_fuse::Readdirplus::All,
            Readdirplus::Auto => locus_fuse::Readdirplus::Auto,
        },
        ..Settings::default()
    };
    options.allow_other = a.allow_other;
    if let Some(n) = a.threads {
        options.threads = n;
    }
    options.io_uring = a.fuse_transport != FuseTransport::DevFuse;
    Ok(options)
}

/// Writes the mount's status file (what `locus status` and `locus umount` read) when
/// called: `status` with what INIT negotiated and the metrics' totals as of now, unless
/// the connection `fuse` has ended (a mount made at the same path since owns the file).
fn status_writer(
    status: MountStatus,
    metrics: Arc<locus_fuse::metrics::Metrics>,
    (passthrough, kernel_opened): (
        Arc<std::sync::atomic::AtomicBool>,
        Arc<std::sync::atomic::AtomicBool>,
    ),
    fuse: std::os::fd::OwnedFd,
) -> impl Fn() {
    let path = status_path(&status.mountpoint);
    let holder_pid = status.pid;
    move || {
        let s = MountStatus {
            passthrough: passthrough.load(Ordering::Relaxed),
            kernel_opens: kernel_opened.load(Ordering::Relaxed),
            totals: metrics.totals(),
            mountpoint: status.mountpoint.clone(),
            dataset: status.dataset.clone(),
            cluster_id: status.cluster_id.clone(),
            transport: status.transport.clone(),
            ..status
        };
        if let Some(d) = path.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        // Once ours ended from outside (`fusermount3 -u`), a mount made here since owns
        // the file; ours may have a last tick before it notices.
        if !holder::connection_alive(std::os::fd::AsFd::as_fd(&fuse)) {
            return;
        }
        let tmp = path.with_extension(format!("{holder_pid}.json.tmp"));
        if std::fs::write(&tmp, serde_json::to_vec(&s).unwrap_or_default()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
}

/// How a mount reads its files, for the line `locus mount` prints.
fn reading_how(local: bool, kernel_opens: bool, passthrough: bool, passthrough_min_size: u64) -> String {
    match (local, kernel_opens, passthrough) {
        (true, true, _) => "local node, opened by the kernel".to_string(),
        (true, false, true) if passthrough_min_size == 0 => "local node, passthrough".to_string(),
        (true, false, true) => format!(
            "local node, passthrough for files of {} or more",
            output::size(passthrough_min_size)
        ),
        (true, false, false) => "local node, pread".to_string(),
        (false, true, _) => "remote replicas, opened by the kernel".to_string(),
        (false, false, _) => "remote replicas".to_string(),
    }
}

/// How often the server checks the kernel still has the mount, writes its status file
/// (what `locus status` and `locus umount` read) and renews its lease when due.
const TICK: Duration = Duration::from_secs(2);
async fn serve_metrics(addr: &str, metrics: Arc<locus_fuse::metrics::Metrics>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics-listen {addr}"))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move { m.encode() }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(())
}
