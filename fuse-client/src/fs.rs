//! The fuser adapter: each kernel request is handed to the core (`core::ops`, the read
//! path), and its answer — or its `FsError`, through `errno`, the one mapping — becomes
//! the reply. What stays here is what only the kernel's side has: file handles, backing
//! ids and what INIT negotiated (the core reads the latter through `Negotiation`).
//!
//! Metadata operations never leave this process: the namespace was loaded at mount and
//! cannot change, so entries and attributes are given to the kernel with long timeouts
//! and file pages are kept cached across opens.
//!
//! Who opens files is the mount's first choice (`Settings::kernel_opens`):
//! - **the kernel**: open answers ENOSYS once, and from then on the kernel opens and
//!   closes files without asking (no OPEN, FLUSH or RELEASE) and keeps their pages; a
//!   cached file costs no round trip at all. Reads arrive without a handle, and the first
//!   read of a file the page cache lacks picks its source as an open would: the local
//!   node's verified file (read here), else remote replicas. Nothing is passed through.
//! - **the mount**: every open asks, and picks how the file will be read, best first:
//!   1. *passthrough*: the local cache node makes the blob present and verified and
//!      returns its path; the file is registered with the kernel as the backing file,
//!      and reads never reach this process;
//!   2. *local*: the same file read here with pread (small files, a kernel without
//!      passthrough, or not allowed to register backing files);
//!   3. *remote*: no local node, or it failed: verified chunks from remote replicas
//!      (`reader`), with read-ahead for sequential readers.
//!
//! The fuser session calls these methods from a few threads, about one per CPU: every
//! round trip through the kernel costs a context switch, and more threads than CPUs only
//! add switches (measured: 16 threads on 2 CPUs served half as many small-file opens per
//! second as 2). Nothing slow may therefore run on a session thread: fetching a blob the
//! node does not have yet, reads from remote replicas and reads that wait for the disk
//! move to the runtime's blocking pool and reply from there (fuser replies may be sent
//! from any thread).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};

use crate::core::ops::{LocalOpen, OpenPlan};
pub use crate::core::Settings;
use crate::core::{Core, FsError, NodeFile, ReadAhead};
use crate::metrics::Metrics;
use crate::namespace::{Attr, Kind, Namespace};
use crate::reader::Remote;

mod open_counts;
mod plus;
mod read;
mod takeover;

pub use crate::core::Readdirplus;
pub use open_counts::OpenCounts;
pub use takeover::{Backing, BackingObserver, Negotiated};

/// The one place a core error becomes what the kernel sees, and the one log rule: an
/// answer (ENOENT, EISDIR, ...) is not logged; a fault is, at debug level (the core has
/// logged it with its context where it happened).
fn errno(op: &'static str, e: &FsError) -> Errno {
    if !e.is_answer() {
        tracing::debug!(op, "{e}");
    }
    match e {
        FsError::NotFound => Errno::ENOENT,
        FsError::IsDir => Errno::EISDIR,
        FsError::NotDir => Errno::ENOTDIR,
        FsError::NotSymlink => Errno::EINVAL,
        FsError::ReadOnly => Errno::EROFS,
        FsError::Unavailable(_)
        | FsError::LocalChanged(_)
        | FsError::LocalRead(_)
        | FsError::Task(_)
        | FsError::Damaged(_) => Errno::EIO,
    }
}

/// Nothing in a mounted version ever changes, so the kernel may keep what it learns.
const TTL: Duration = Duration::from_secs(24 * 3600);

/// How a file was opened.
enum Handle {
    /// The kernel reads the backing file; `file` stays open so the backing id does.
    Passthrough { ino: u64, _file: Arc<NodeFile> },
    /// pread of the node's verified local file.
    Local { file: Arc<NodeFile> },
    /// Chunks from remote replicas.
    Remote { ino: u64, ra: Arc<Mutex<ReadAhead>> },
}

/// The filesystem handed to fuser; its state is shared with the work it moves off the
/// session threads.
pub struct LocusFs {
    mount: Arc<Mount>,
}

/// What the adapter keeps beside the core: the kernel's view (ids, open handles, backing
/// files) and what init negotiated.
pub struct Mount {
    core: Arc<Core>,
    uid: u32,
    gid: u32,
    next_fh: AtomicU64,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    /// The kernel wants one backing file per inode while any handle of it is open.
    backing: Mutex<HashMap<u64, (Arc<BackingId>, usize)>>,
    /// Backing ids a previous process of this mount registered, by inode: files it opened
    /// may still be open, and the kernel refuses a second backing file for their inode
    /// (`takeover`).
    inherited: Mutex<HashMap<u64, takeover::Inherited>>,
    /// The connection taken over, for closing inherited ids no reply is at hand for.
    connection: Mutex<Option<std::os::fd::OwnedFd>>,
    /// Files open with passthrough per inode, kept for the next server (`open_counts`).
    open_counts: Option<Arc<OpenCounts>>,
    /// Told of every backing id registered (`Some`) or closed (`None`), before the kernel
    /// hears of it: the holder of the connection keeps the list for the next process.
    backing_observer: Option<BackingObserver>,
    /// Whether lookups are followed by reads (`read::ReadAheadGate`).
    read_ahead: read::ReadAheadGate,
}

/// Marks a handle opened with passthrough. A server that took the connection over
/// gets RELEASEs of its predecessor's handles, and must know which held a backing id.
const PASSTHROUGH_FH: u64 = 1 << 63;

/// The first handle of this process: its pid (23 bits, Linux's largest) above a 40-bit
/// count, so a server that took the connection over never hands out a handle of its
/// predecessor's, whose RELEASE would otherwise close one of its own.
fn first_fh() -> u64 {
    (u64::from(std::process::id()) & 0x7f_ffff) << 40 | 1
}

/// Pages stay cached across opens (nothing changes), and close does not send a flush
/// (nothing is ever written), saving a round trip per file.
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_KEEP_CACHE.union(FopenFlags::FOPEN_NOFLUSH);

impl LocusFs {
    pub fn new(
        ns: Arc<Namespace>,
        rt: tokio::runtime::Handle,
        local: Option<Arc<dyn crate::core::LocalNode>>,
        remote: Arc<Remote>,
        metrics: Arc<Metrics>,
        settings: Settings,
    ) -> Self {
        // Files belong to whoever mounted them; /proc/self is owned by our own ids.
        let (uid, gid) = std::fs::metadata("/proc/self")
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.uid(), m.gid())
            })
            .unwrap_or((0, 0));
        LocusFs {
            mount: Arc::new(Mount {
                core: Arc::new(Core::new(ns, rt, local, remote, metrics, settings)),
                uid,
                gid,
                next_fh: AtomicU64::new(first_fh()),
                handles: Mutex::new(HashMap::new()),
                backing: Mutex::new(HashMap::new()),
                inherited: Mutex::new(HashMap::new()),
                connection: Mutex::new(None),
                open_counts: None,
                backing_observer: None,
                read_ahead: read::ReadAheadGate::default(),
            }),
        }
    }

    /// Whether passthrough is in use; readable after the filesystem moved into its
    /// session (the kernel's answer comes at init).
    pub fn passthrough_state(&self) -> Arc<AtomicBool> {
        self.mount.core.negotiated.passthrough.clone()
    }

    /// Whether the kernel opens files by itself; readable like `passthrough_state`.
    pub fn kernel_opens_state(&self) -> Arc<AtomicBool> {
        self.mount.core.negotiated.kernel_opens.clone()
    }
}

impl Mount {
    fn file_attr(&self, a: &Attr) -> FileAttr {
        let t = if a.mtime_ns >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_nanos(a.mtime_ns as u64)
        } else {
            SystemTime::UNIX_EPOCH - Duration::from_nanos(a.mtime_ns.unsigned_abs())
        };
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind: file_type(a.kind),
            // Never setuid or setgid, whatever the source had: the mount is nosuid, but a
            // bind of it elsewhere (a container's view) may not be, and the bits would
            // make a dataset's file run with the mounting user's (root's) rights.
            perm: a.mode & !0o6000,
            nlink: a.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        }
    }

    fn add_handle(&self, h: Handle) -> FileHandle {
        let mut fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        if matches!(h, Handle::Passthrough { .. }) {
            fh |= PASSTHROUGH_FH;
        }
        self.handles.lock().unwrap().insert(fh, Arc::new(h));
        FileHandle(fh)
    }

    /// Answers an open with the node's verified local file: as the kernel's backing file
    /// (passthrough) when allowed and the file is large enough, else read here with pread
    /// into pages the kernel keeps across opens.
    fn open_file(&self, ino: u64, size: u64, file: Arc<NodeFile>, reply: ReplyOpen) {
        if self.core.local_open(size, &file) == LocalOpen::Passthrough {
            let mut backing = self.backing.lock().unwrap();
            let id = match backing.get_mut(&ino) {
                Some((id, n)) => {
                    *n += 1;
                    Some(id.clone())
                }
                None if self.inherited.lock().unwrap().contains_key(&ino) => {
                    let old = self.inherited.lock().unwrap().remove(&ino).expect("checked");
                    // SAFETY: the id was registered on this connection by the previous
                    // process and never closed (the holder hears of every close); it is
                    // wrapped once, and counted with the predecessor's files still open
                    // on it (kept while we live when that count is unknown).
                    #[allow(unsafe_code)]
                    let id = Arc::new(unsafe { reply.wrap_backing(old.id) });
                    let n = old.open.map_or(usize::MAX / 2, |n| n as usize + 1);
                    backing.insert(ino, (id.clone(), n));
                    Some(id)
                }
                None => match reply.open_backing(file.file()) {
                    Ok(id) => {
                        let id = Arc::new(id);
                        // The holder must know of the id before the kernel can use it.
                        if let Some(f) = &self.backing_observer {
                            f(ino, Backing::Registered(id.raw()));
                        }
                        if backing.len() >= 2 * self.core.recent_max {
                            // Closed files keep their backing id only while recent.
                            let recent = self.core.recent.lock().unwrap();
                            backing.retain(|ino, (_, n)| {
                                let keep = *n > 0 || recent.contains_key(ino);
                                if let (false, Some(f)) = (keep, &self.backing_observer) {
                                    f(*ino, Backing::Closed);
                                }
                                keep
                            });
                        }
                        backing.insert(ino, (id.clone(), 1));
                        Some(id)
                    }
                    Err(e) => {
                        self.core.passthrough_refused(&e);
                        None
                    }
                },
            };
            if let Some(id) = id {
                drop(backing);
                // Before the kernel hears of it: a holder must never count fewer files
                // open on an id than there are (the next server would close it in use).
                if let Some(c) = &self.open_counts {
                    c.opened(ino);
                }
                let fh = self.add_handle(Handle::Passthrough { ino, _file: file });
                self.core.metrics.opened("passthrough");
                // The kernel refuses passthrough opens with any flag outside its small
                // allowed set (KEEP_CACHE included: the backing file's own page cache
                // is what gets used); NOFLUSH is allowed.
                reply.opened_passthrough(fh, FopenFlags::FOPEN_NOFLUSH, &id);
                return;
            }
        }
        let fh = self.add_handle(Handle::Local { file });
        self.core.metrics.opened("local");
        reply.opened(fh, OPEN_FLAGS);
    }

    /// Carries out an open the core planned (`AskNode` is resolved by the caller).
    fn opened(&self, plan: OpenPlan, reply: ReplyOpen) {
        match plan {
            // The kernel takes ENOSYS as "never ask again" and opens every file itself
            // from now on (the read-only mount refuses writers before they get here).
            OpenPlan::KernelOpens => reply.error(Errno::ENOSYS),
            OpenPlan::Remote { ino, size } => self.open_remote(ino, size, reply),
            OpenPlan::Local { ino, size, file } => self.open_file(ino, size, file, reply),
            OpenPlan::AskNode { .. } => unreachable!("resolved by open"),
        }
    }

    /// Answers an open whose bytes come from remote replicas (or an empty file).
    fn open_remote(&self, ino: u64, size: u64, reply: ReplyOpen) {
        // Start on the first chunk now; the reader almost always wants it.
        if let Some(c) = self.core.chunk_ref(ino, 0) {
            let remote = self.core.remote.clone();
            let _guard = self.core.rt.enter();
            remote.prefetch(vec![c]);
        }
        let fh = self.add_handle(Handle::Remote {
            ino,
            ra: Arc::new(Mutex::new(ReadAhead::default())),
        });
        self.core
            .metrics
            .opened(if size == 0 { "empty" } else { "remote" });
        reply.opened(fh, OPEN_FLAGS);
    }
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
    }
}

impl Filesystem for LocusFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let (settings, negotiated) = (&self.mount.core.settings, &self.mount.core.negotiated);
        // Capabilities are wishes: what this kernel lacks is simply not used.
        let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Adaptive decides per entry in every READDIRPLUS answer, so the kernel is to ask
        // READDIRPLUS always; Auto leaves the choice per directory to the kernel.
        let _ = config.add_capabilities(match settings.readdirplus {
            Readdirplus::Auto => InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO,
            Readdirplus::All | Readdirplus::Adaptive => InitFlags::FUSE_DO_READDIRPLUS,
        });
        let _ = config
            .set_max_readahead(u32::MAX)
            .or_else(|max| config.set_max_readahead(max));
        let _ = config.set_max_background(64);
        // Nothing is written; what this sets is the size of a FUSE-over-io_uring entry's
        // payload (the kernel sizes it by max_write) and the largest READ (256 pages, the
        // kernel's own limit), so 1 MiB keeps every ring entry at 1 MiB instead of 16.
        let _ = config.set_max_write(1 << 20);
        if settings.kernel_opens {
            // Offered since Linux 5.1; without them ENOSYS would fail the open.
            let both = InitFlags::FUSE_NO_OPEN_SUPPORT | InitFlags::FUSE_NO_OPENDIR_SUPPORT;
            if config.capabilities().contains(both) {
                negotiated.kernel_opens.store(true, Ordering::Relaxed);
            } else {
                tracing::info!("this kernel cannot open files by itself; every open asks the mount");
            }
        }
        if settings.passthrough && !negotiated.kernel_opens.load(Ordering::Relaxed) {
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) => {
                    // Backing files may live on a stacked filesystem (overlayfs) themselves.
                    let _ = config.set_max_stack_depth(2);
                    negotiated.passthrough.store(true, Ordering::Relaxed);
                }
                Err(_) => {
                    tracing::info!("this kernel has no FUSE passthrough; local files are read with pread")
                }
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.mount.core.lookup(parent.0, name) {
            Ok(a) => {
                self.mount.read_ahead_on_lookup(&a);
                reply.entry(
                    &TTL,
                    &self.mount.file_attr(&a),
                    Generation(self.mount.core.settings.generation),
                )
            }
            Err(e) => reply.error(errno("lookup", &e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.mount.core.getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &self.mount.file_attr(&a)),
            Err(e) => reply.error(errno("getattr", &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.mount.core.readlink(ino.0) {
            Ok(t) => reply.data(t.as_bytes()),
            Err(e) => reply.error(errno("readlink", &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self
            .mount
            .core
            .open(ino.0, flags.acc_mode() != OpenAccMode::O_RDONLY)
        {
            Err(e) => reply.error(errno("open", &e)),
            Ok(OpenPlan::AskNode { ino, size, blob }) => {
                // The node may copy the blob from a peer first: off the session thread.
                let mount = self.mount.clone();
                self.mount
                    .core
                    .rt
                    .spawn_blocking(move || mount.opened(mount.core.open_fetched(ino, size, blob), reply));
            }
            Ok(plan) => self.mount.opened(plan, reply),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let started = Instant::now();
        // What the kernel reads for its page cache it answers again itself; an O_DIRECT
        // read it does not keep.
        let keeps = flags.0 & libc::O_DIRECT == 0;
        if fh.0 == 0 {
            return self.mount.read_inode(ino.0, offset, size, keeps, started, reply);
        }
        let Some(h) = self.mount.handles.lock().unwrap().get(&fh.0).cloned() else {
            // Opened by a previous process of this mount (which was restarted): the
            // inode says everything a read needs.
            return self.mount.read_inode(ino.0, offset, size, keeps, started, reply);
        };
        match &*h {
            Handle::Passthrough { _file: file, .. } | Handle::Local { file } => {
                let want = self
                    .mount
                    .core
                    .ns
                    .attr(ino.0)
                    .map_or(0, |a| a.size.saturating_sub(offset).min(u64::from(size)));
                self.mount
                    .read_local(ino.0, file.clone(), offset, want, started, reply)
            }
            Handle::Remote { ino, ra } => {
                self.mount
                    .read_remote_off_thread(*ino, ra.clone(), offset, size, keeps, started, reply)
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is ever written, so there is nothing to flush; ENOSYS tells the kernel
        // never to send a flush again (a round trip saved on every close).
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.mount.handles.lock().unwrap().remove(&fh.0);
        // Answered before the counts are lowered: a server killed in between leaves a
        // count high (an id kept longer), never low, as lowering first would when the
        // kernel resends the unanswered RELEASE to the next server (an id closed while
        // a file uses it, and the next open of that file failing with EIO).
        reply.ok();
        if h.is_none() && fh.0 & PASSTHROUGH_FH != 0 {
            // Opened by the process this one took over from.
            self.mount.release_inherited(ino.0);
        }
        if let Some(h) = h {
            if let Handle::Passthrough { ino, .. } = &*h {
                if let Some(c) = &self.mount.open_counts {
                    c.released(*ino);
                }
                let mut backing = self.mount.backing.lock().unwrap();
                if let Some((_, n)) = backing.get_mut(ino) {
                    *n -= 1;
                    if *n == 0 && !self.mount.core.keeps_backing(*ino) {
                        backing.remove(ino);
                        if let Some(f) = &self.mount.backing_observer {
                            f(*ino, Backing::Closed);
                        }
                    }
                }
            }
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.mount.core.opendir(ino.0) {
            // As for files: the kernel opens directories itself from now on, and keeps
            // their listings cached.
            Ok(true) => reply.error(Errno::ENOSYS),
            Ok(false) => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectory) {
        self.mount.list(ino.0, offset, reply);
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        self.mount.list_plus(ino.0, offset, reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.mount.core.statfs();
        reply.statfs(s.blocks, 0, 0, s.files, 0, s.block_size, s.name_max, s.block_size);
    }
}
