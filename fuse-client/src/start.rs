//! A mount, from its options to serving the kernel, in one call (`start`): the version,
//! where its shards are, the remote reader, the sealed namespace (from the local node or
//! peers), the version's origin as the last source, who opens files, the file system
//! built on all of it, the FUSE session (a fresh mount, or the live connection a
//! predecessor left, `handoff`), the transport (io_uring or /dev/fuse), the hand-off
//! reports to the process holding the connection, and the background refresh of replica
//! locations. `locus mount` parses its arguments into `MountOptions`, calls `start`, and
//! keeps only the process around the result (daemonizing, the holder, signals, the
//! status file, the lease).

use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::client::{MetadataClient, NodeClient};
use locus_proto::pb;

use crate::core::Settings;
use crate::fs::OpenCounts;
use crate::handoff::{Holder, SessionState, Takeover};
use crate::metrics::Metrics;
use crate::namespace::Namespace;
use crate::reader::{GrpcReplicas, Place, Remote, Topology};
use crate::{LoadError, LocusFs};

/// Who opens files of a mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Opens {
    /// By what the version holds (`Opens::kernel`).
    #[default]
    Auto,
    /// The kernel, without asking the mount.
    Kernel,
    /// The mount, for every open.
    Mount,
}

impl Opens {
    /// Whether the kernel should open files by itself. Per open, passthrough costs two
    /// round trips to the mount (~25 µs of CPU here); the kernel's own opens cost none
    /// but read large files through the mount's small pages (~7 vs ~16 GB/s warm). The
    /// two break even around a 0.5 MiB file, so a version whose files are mostly small
    /// is better opened by the kernel. Without passthrough every read goes through the
    /// mount's pages anyway, and the round trips buy nothing.
    pub fn kernel(self, passthrough: bool, files: u64, bytes: u64, min_size: u64) -> bool {
        match self {
            Opens::Kernel => true,
            Opens::Mount => false,
            Opens::Auto => !passthrough || files == 0 || bytes / files < min_size,
        }
    }
}

/// What a mount is of, and how it reads.
pub struct MountOptions {
    pub dataset: String,
    /// 0: the latest.
    pub version: u64,
    /// Where this host is (replicas are ordered by it).
    pub place: Place,
    /// The same host's cache node.
    pub local: Option<NodeClient>,
    /// The node's open socket, used where `local` is None: blobs as descriptors under
    /// this mount's read grants (a user the node does not trust with its data dir).
    pub local_open: Option<std::path::PathBuf>,
    /// Presented to nodes (for grants) by remote reads.
    pub token: Option<String>,
    /// The chunk cache's bytes.
    pub cache_bytes: usize,
    /// How far ahead of a sequential reader chunks are fetched.
    pub readahead: u64,
    /// Where namespaces fetched from peers are kept for this user's next mounts.
    pub cache_dir: Option<PathBuf>,
    pub opens: Opens,
    /// The core's settings; `kernel_opens`, `readahead_chunks` and `generation` are
    /// decided here from the options and the version.
    pub settings: Settings,
    /// Where to mount (where the connection taken over is mounted already).
    pub mountpoint: PathBuf,
    /// Let other users read the mount.
    pub allow_other: bool,
    /// Threads reading requests from /dev/fuse (io_uring has one queue per CPU).
    pub threads: usize,
    /// Ask for FUSE over io_uring; /dev/fuse serves where the kernel does not offer it.
    pub io_uring: bool,
    /// How often replica locations are read again (repair moves them), in the
    /// background so that no read waits for it.
    pub replica_refresh: Duration,
    /// The most the kernel reads ahead of a sequential reader (when root may set it).
    pub kernel_readahead: u64,
}

impl MountOptions {
    /// What `locus mount` uses unless told otherwise, for `dataset` (the latest version)
    /// at `mountpoint`, with no local node.
    pub fn new(dataset: &str, mountpoint: PathBuf, place: Place) -> Self {
        MountOptions {
            dataset: dataset.to_string(),
            version: 0,
            place,
            local: None,
            local_open: None,
            token: None,
            cache_bytes: 1 << 30,
            readahead: 32 << 20,
            cache_dir: None,
            opens: Opens::Auto,
            settings: Settings::default(),
            mountpoint,
            allow_other: false,
            threads: default_threads(),
            io_uring: false,
            replica_refresh: Duration::from_secs(30),
            // A kernel window as deep as the mount's own read-ahead (32 MiB) only parked
            // up to 32 requests on blocking threads at once, and reading the node's files
            // through kernel opens took 30–45% more of the mount's CPU per MiB than with
            // 1–4 MiB here, for no more speed (512 MiB read cold, 3 rounds).
            kernel_readahead: 4 << 20,
        }
    }
}

/// One session thread per CPU: each kernel round trip wakes a thread, and on a busy host
/// extra threads only trade places with the readers (16 threads on 2 CPUs served 40k
/// small-file opens a second, 2 threads 66k).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 32)
}

/// A mount ready to be handed to the kernel.
struct Prepared {
    pub fs: LocusFs,
    pub version: pb::Version,
    pub namespace: Arc<Namespace>,
    pub remote: Arc<Remote>,
    pub metrics: Arc<Metrics>,
    /// Where the namespace came from, and how long the whole preparation took.
    pub namespace_from: String,
    pub took: Duration,
}

/// Prepares a mount: reads the version and its topology from the metadata service, its
/// namespace from the cheapest node, and builds the file system. The metadata service's
/// work is `GetVersion`, `ListShards` and `ListNodes`, whatever the version's size.
async fn prepare(client: &mut MetadataClient, o: &MountOptions) -> Result<Prepared, LoadError> {
    let started = Instant::now();
    let v = crate::load::version(client, &o.dataset, o.version).await?;
    let vref = pb::VersionRef {
        dataset: o.dataset.clone(),
        version: v.version,
    };
    let topology = Topology::load(client, &vref, &o.place).await?;
    let replicas = GrpcReplicas::new(client.clone(), vref, o.token.clone());
    let metrics = Arc::new(Metrics::default());
    let remote = Arc::new(
        Remote::new(
            Arc::new(replicas),
            o.place.clone(),
            topology,
            o.cache_bytes,
            metrics.clone(),
        )
        // Four readers' full windows; more readers share them, so memory does not grow
        // with the number of readers.
        .with_readahead_budget((o.readahead as usize).saturating_mul(4)),
    );
    let sources = crate::Sources {
        local: o.local.clone(),
        remote: &remote,
        cache_dir: o.cache_dir.clone(),
    };
    let opened = crate::load::namespace(&v, sources).await?;
    let ns = Arc::new(opened.namespace);
    match locus_backup::origin::Origin::parse(&v.origin) {
        Ok(Some(origin)) => {
            tracing::info!(
                "origin {} is the last source for chunks no node serves",
                origin.describe()
            );
            remote.set_origin(origin, ns.clone());
        }
        Ok(None) => {}
        Err(e) => tracing::warn!("the version's origin cannot be used: {e}"),
    }
    let mut settings = o.settings.clone();
    let local: Option<Arc<dyn crate::core::LocalNode>> = match (&o.local, &o.local_open) {
        (Some(client), _) => Some(Arc::new(crate::core::GrpcLocalNode {
            client: client.clone(),
            rt: tokio::runtime::Handle::current(),
            chunk_size: ns.chunk_size(),
        })),
        (None, Some(path)) => {
            let grants = locus_proto::grant::Grants::new(client.clone(), o.token.as_deref());
            let target = format!("{}@{}", v.dataset, v.version);
            let rt = tokio::runtime::Handle::current();
            Some(Arc::new(crate::core::OpenSocketNode {
                path: path.clone(),
                chunk_size: ns.chunk_size(),
                grant: Box::new(move || {
                    rt.block_on(grants.get("*", locus_proto::grant::Op::Read, &target))
                        .map(Option::unwrap_or_default)
                        .map_err(|e| format!("no read grant for the open socket: {}", e.message()))
                }),
                idle: Default::default(),
            }))
        }
        (None, None) => None,
    };
    settings.kernel_opens = o.opens.kernel(
        local.is_some() && settings.passthrough,
        v.files,
        v.bytes,
        settings.passthrough_min_size,
    );
    settings.readahead_chunks = (o.readahead / u64::from(v.chunk_size.max(1))).max(1) as usize;
    settings.generation = v.version;
    let fs = LocusFs::new(
        ns.clone(),
        tokio::runtime::Handle::current(),
        local,
        remote.clone(),
        metrics.clone(),
        settings,
    );
    Ok(Prepared {
        fs,
        version: v,
        namespace: ns,
        remote,
        metrics,
        namespace_from: format!("{} in {:.2}s", opened.from, opened.took.as_secs_f64()),
        took: started.elapsed(),
    })
}

/// Why a mount could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The version, its topology or its namespace.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The kernel's side: mounting, or taking over the connection.
    #[error("cannot mount on {}: {source}{}", mountpoint.display(), mount_hint(source))]
    Mount {
        mountpoint: PathBuf,
        source: std::io::Error,
    },
}

/// What the usual causes of a failed mount mean for the operator.
fn mount_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            " (not allowed: check /dev/fuse permissions, fusermount3, and user_allow_other for --allow-other)"
        }
        Some(libc::ENOENT) => " (is fusermount3 installed? Debian: apt-get install fuse3)",
        Some(libc::EBUSY) => " (something is already mounted there)",
        _ => "",
    }
}

/// A mount serving the kernel. Dropping it stops the replica refresh; the session
/// serves until it is unmounted or joined.
pub struct Serving {
    pub session: fuser::BackgroundSession,
    /// This mount's connection and its device in the mount table: what tells it from a
    /// later mount at the same path.
    pub fuse: OwnedFd,
    pub device: Option<String>,
    /// Requests come through FUSE-over-io_uring queues (else /dev/fuse).
    pub ring: bool,
    /// Freezes those queues before a planned restart.
    pub control: Option<Arc<fuser::RingControl>>,
    /// This server took over a live connection from a predecessor.
    pub took_over: bool,
    pub version: pb::Version,
    pub namespace: Arc<Namespace>,
    pub metrics: Arc<Metrics>,
    /// What INIT negotiated (or the predecessor's INIT): passthrough; the kernel opens
    /// files by itself.
    pub passthrough: Arc<AtomicBool>,
    pub kernel_opens: Arc<AtomicBool>,
    /// From the call to the namespace being ready (before the kernel was met).
    pub load_took: Duration,
    _refresh: AbortOnDrop,
}

impl Serving {
    /// "io_uring" or "/dev/fuse".
    pub fn transport(&self) -> &'static str {
        if self.ring {
            "io_uring"
        } else {
            "/dev/fuse"
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts a mount: prepares it (`prepare`), then serves the kernel at `o.mountpoint`,
/// either as a fresh mount or, with `takeover`, on the live connection a previous
/// server of this mount left. `holder`, when a process holds the connection for the
/// next server, hears of the session, its ring memory and its backing ids.
pub async fn start(
    client: &mut MetadataClient,
    o: MountOptions,
    takeover: Option<Takeover>,
    holder: Option<Arc<dyn Holder>>,
) -> Result<Serving, StartError> {
    let mut o = o;
    // A server taking over a live mount must serve the version the kernel has been
    // shown, never a newer one that "latest" would now name.
    if let Some(t) = &takeover {
        o.version = t.state.version;
    }
    let p = prepare(client, &o).await?;
    let ns = &p.namespace;
    tracing::info!(
        dataset = %o.dataset,
        version = p.version.version,
        entries = ns.len(),
        "namespace ({}) from {}{}; ready to mount after {:.2}s",
        locus_proto::human::format_size(ns.sealed_bytes() as u64),
        p.namespace_from,
        if ns.is_mapped() { ", mapped" } else { ", in memory" },
        p.took.as_secs_f64(),
    );
    let passthrough = p.fs.passthrough_state();
    let kernel_opens = p.fs.kernel_opens_state();
    let source = format!("{}{}@{}", crate::SOURCE_PREFIX, o.dataset, p.version.version);
    let config = crate::session_config(&source, o.allow_other, o.threads, o.io_uring);
    let mut takeover = takeover;
    let (counts, counted) = open_counts(holder.as_deref(), takeover.as_mut(), ns.len() + 1);
    let fs = match &holder {
        Some(h) => {
            let h = h.clone();
            p.fs.with_handoff(Arc::new(move |ino, id| h.backing(ino, id)), counts)
        }
        None => p.fs,
    };
    let took_over = takeover.is_some();
    let mp = o.mountpoint.clone();
    let version = p.version.version;
    let started = tokio::task::spawn_blocking(move || {
        session(fs, &mp, config, takeover.map(|t| (t, counted)), holder, version)
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r)
    .map_err(|source| StartError::Mount {
        mountpoint: o.mountpoint.clone(),
        source,
    })?;
    if o.io_uring && !started.ring && !took_over {
        tracing::info!(
            "FUSE over io_uring is not available here; serving through /dev/fuse (see `locus doctor`)"
        );
    }
    tracing::info!(
        "kernel requests come through {}",
        if started.ring { "io_uring" } else { "/dev/fuse" }
    );
    if took_over {
        tracing::info!("took over the live mount at {}", o.mountpoint.display());
    }
    raise_readahead(&o.mountpoint, o.readahead.min(o.kernel_readahead));
    let remote = p.remote.clone();
    let every = o.replica_refresh.max(Duration::from_secs(1));
    let refresh = tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = remote.refresh().await {
                tracing::warn!("cannot refresh replica locations: {e}");
            }
        }
    });
    Ok(Serving {
        session: started.session,
        fuse: started.fuse,
        device: started.device,
        ring: started.ring,
        control: started.control,
        took_over,
        version: p.version,
        namespace: p.namespace,
        metrics: p.metrics,
        passthrough,
        kernel_opens,
        load_took: p.took,
        _refresh: AbortOnDrop(refresh),
    })
}

/// A session started, before it is a `Serving`.
struct Started {
    session: fuser::BackgroundSession,
    fuse: OwnedFd,
    device: Option<String>,
    ring: bool,
    control: Option<Arc<fuser::RingControl>>,
}

/// Starts serving the kernel: a fresh mount at `mp` (its connection reported to the
/// holder, if there is one, with what INIT negotiated), or the live connection a
/// previous server left (`takeover`), whose lost requests are asked again. Blocking (the
/// mount's handshake).
fn session(
    fs: LocusFs,
    mp: &Path,
    config: fuser::Config,
    takeover: Option<(Takeover, bool)>,
    holder: Option<Arc<dyn Holder>>,
    mounted_version: u64,
) -> std::io::Result<Started> {
    let (pt, ko) = (fs.passthrough_state(), fs.kernel_opens_state());
    let Some((t, counted)) = takeover else {
        let mut s = fuser::Session::new(fs, mp, &config)?;
        // Read now, while nothing else can have mounted over it.
        let device = crate::mount_device(mp);
        let io_uring_payload = s.io_uring_payload();
        let ring = start_rings(&mut s);
        let fuse = s.as_fd().try_clone_to_owned()?;
        let control = s.ring_control();
        if let Some(h) = &holder {
            let v = s.proto_version().unwrap_or(fuser::Version(7, 0));
            let state = SessionState {
                version: mounted_version,
                proto_major: v.0,
                proto_minor: v.1,
                negotiated: crate::fs::Negotiated {
                    // Set by init, during the handshake `Session::new` ran.
                    passthrough: pt.load(Ordering::Relaxed),
                    kernel_opens: ko.load(Ordering::Relaxed),
                },
                backing: Default::default(),
                open_counts: None,
                device: device.clone(),
                io_uring_payload: io_uring_payload.filter(|_| ring),
                ring_memory: None,
            };
            h.session(s.as_fd(), &state)?;
            hand_over_rings(&s, h.as_ref());
        }
        return Ok(Started {
            session: s.spawn()?,
            fuse,
            device,
            ring,
            control,
        });
    };
    fs.restore(
        t.state.negotiated,
        t.state.backing.clone().into_iter().collect(),
        counted,
        t.fuse.try_clone()?,
    );
    let acl = config.acl;
    let v = fuser::Version(t.state.proto_major, t.state.proto_minor);
    let mut s = fuser::Session::from_initialized_fd(fs, t.fuse, acl, config, v);
    if let Some(p) = t.state.io_uring_payload {
        s = s.with_io_uring(p);
        if let (Some(fd), Some(layout)) = (t.ring, t.state.ring_memory) {
            s = s.adopt_ring_memory(fd, layout.into());
        }
    }
    let ring = start_rings(&mut s);
    if let Some(h) = &holder {
        hand_over_rings(&s, h.as_ref());
    }
    let control = s.ring_control();
    let fuse = s.as_fd().try_clone_to_owned()?;
    let session = s.spawn()?;
    if let Err(e) = crate::handoff::resend_lost_requests(fuse.as_fd()) {
        tracing::warn!(
            "this kernel cannot resend requests the previous server read ({e}; Linux 6.9+): their readers wait until unmount"
        );
    }
    if ring {
        crate::handoff::wake_ring_queues(mp);
    }
    Ok(Started {
        session,
        fuse,
        device: t.state.device.clone(),
        ring,
        control,
    })
}

/// The counts of files open with passthrough for a mount with a holder: the
/// predecessor's when it left them (then `true`: they can be trusted to close the ids it
/// registered), else new ones; either way the holder is told where they are.
fn open_counts(
    holder: Option<&dyn Holder>,
    takeover: Option<&mut Takeover>,
    inodes: usize,
) -> (Option<Arc<OpenCounts>>, bool) {
    let h = match holder {
        Some(h) => h,
        None => return (None, false),
    };
    let left = takeover.and_then(|t| Some((t.open_counts.take()?, t.state.open_counts?)));
    let (counts, counted) = match left {
        Some((fd, len)) if len == inodes as u64 => match OpenCounts::adopt(fd, inodes) {
            Ok(c) => (Some(c), true),
            Err(e) => {
                tracing::warn!(
                    "cannot use the previous server's open counts ({e}): its backing ids are kept"
                );
                (OpenCounts::create(inodes).ok(), false)
            }
        },
        _ => (OpenCounts::create(inodes).ok(), false),
    };
    let Some(counts) = counts.map(Arc::new) else {
        tracing::warn!("cannot keep open counts for the next server: its backing ids will be kept");
        return (None, false);
    };
    if let Err(e) = h.open_counts(counts.memory(), counts.len()) {
        tracing::warn!("cannot hand the holder the open counts: {e}");
    }
    (Some(counts), counted)
}

/// Tells the holder where the ring queues' entries are, for the next server (a taken-over
/// server whose memory is the holder's already sends it again: harmless).
fn hand_over_rings(s: &fuser::Session<LocusFs>, h: &dyn Holder) {
    if let Some((fd, layout)) = s.ring_memory() {
        if let Err(e) = h.rings(fd, layout.into()) {
            tracing::warn!("cannot hand the holder the ring entries' memory: {e}");
        }
    }
}

/// Registers the connection's FUSE-over-io_uring queues when INIT negotiated them:
/// whether requests come through them (else /dev/fuse serves, the kernel having been
/// told so by the refused registration).
fn start_rings(s: &mut fuser::Session<LocusFs>) -> bool {
    match s.start_io_uring() {
        Ok(on) => on,
        Err(e) => {
            tracing::warn!("the kernel refused FUSE over io_uring queues ({e}); serving through /dev/fuse");
            false
        }
    }
}

/// The kernel caps a FUSE mount's read-ahead at 128 KiB whatever the filesystem asks for
/// at init, so sequential reads that reach us (remote and pread modes) arrive in 128 KiB
/// requests. Root may raise it through the mount's backing device in sysfs; others keep
/// the default (passthrough reads use the backing file's own read-ahead either way).
fn raise_readahead(mountpoint: &Path, bytes: u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(mountpoint) else {
        return;
    };
    let dev = md.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let kb = (bytes / 1024).max(128);
    match std::fs::write(&knob, kb.to_string()) {
        Ok(()) => tracing::debug!("read-ahead set to {kb} KiB ({knob})"),
        Err(e) => tracing::debug!("cannot raise read-ahead ({knob}): {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_lets_the_kernel_open_versions_of_small_files() {
        const MIB: u64 = 1 << 20;
        // 2,000 × 128 KiB: small files, the kernel opens them.
        assert!(Opens::Auto.kernel(true, 2_000, 2_000 * 128 * 1024, MIB));
        // 4 × 256 MiB: passthrough pays.
        assert!(!Opens::Auto.kernel(true, 4, 4 * 256 * MIB, MIB));
        // Without passthrough (or a local node) the mount's round trips buy nothing.
        assert!(Opens::Auto.kernel(false, 4, 4 * 256 * MIB, MIB));
        // "--passthrough-min-size 0": every file passed through.
        assert!(!Opens::Auto.kernel(true, 2_000, 2_000 * 128 * 1024, 0));
        assert!(Opens::Auto.kernel(true, 0, 0, MIB));
        assert!(Opens::Kernel.kernel(true, 4, 4 * 256 * MIB, MIB));
        assert!(!Opens::Mount.kernel(false, 2_000, 2_000, MIB));
    }
}
