//! The FUSE filesystem: kernel requests answered from the immutable namespace and the
//! read path.
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
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use locus_proto::client::NodeClient;
use locus_proto::{nodepb, BlobHash};

use crate::metrics::Metrics;
use crate::namespace::{Attr, Kind, Namespace};
use crate::reader::{ChunkRef, Remote};

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

/// A blob file the local node verified, as this mount opened it.
struct NodeFile {
    file: File,
    /// (inode, size, mtime) when opened, right after the node's check.
    seen: Option<(u64, u64, i64, i64)>,
}

impl NodeFile {
    fn open(path: &std::path::Path) -> std::io::Result<NodeFile> {
        let file = File::open(path)?;
        let seen = file_id(&file);
        Ok(NodeFile { file, seen })
    }

    /// Whether the file is as it was when opened. Read after the bytes were: any write
    /// or truncation before that point has changed the mtime. (Not the ctime, which the
    /// node's own eviction changes by unlinking the file, leaving its bytes intact.)
    fn unchanged(&self) -> bool {
        self.seen.is_some() && file_id(&self.file) == self.seen
    }
}

fn file_id(f: &File) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().ok()?;
    Some((m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// A fetch of one inode's file from the local node, which readers wait for.
struct Pending {
    /// Set once the node answered: the file, or None (read from replicas).
    done: Mutex<Option<Option<Arc<NodeFile>>>>,
    cv: std::sync::Condvar,
    /// Readers wait for the node until `started + local_patience`, not each for the
    /// whole patience: a hung node costs a file one wait, not one per read request.
    started: Instant,
}

/// Sequential-read detection for one open file.
#[derive(Debug, Default)]
struct ReadAhead {
    /// The furthest chunk read so far.
    next_chunk: u64,
    window: usize,
    /// Chunks before this one have already been asked for in the background.
    ahead_to: u64,
}

pub struct Settings {
    /// Let the kernel open files without asking this process (it then never sends OPEN,
    /// FLUSH or RELEASE, and keeps pages across opens): a cached small file costs no
    /// round trip at all. Reads arrive without a handle and are served by inode; nothing
    /// is passed through, so large files are read through the mount's page cache.
    pub kernel_opens: bool,
    /// Ask the kernel for passthrough (it may still refuse).
    pub passthrough: bool,
    /// Smaller local files are read here and kept in the mount's page cache instead of
    /// being handed to the kernel: a passthrough open opens the backing file again in the
    /// kernel, which costs more than reading a small file from cache.
    pub passthrough_min_size: u64,
    /// Most chunks fetched ahead of a sequential reader.
    pub readahead_chunks: usize,
    /// How long open may wait for the local node to make a blob present.
    pub open_timeout: Duration,
    /// How long a read or open waits for the local node before reading that file from
    /// remote replicas instead; the node's work goes on and later reads use its file.
    pub local_patience: Duration,
    /// How long a local file the node verified may be reopened without asking it again
    /// (zero: ask on every open).
    pub reopen_ttl: Duration,
    /// Generation number for every inode (the version number: inode numbers are stable
    /// within a version only).
    pub generation: u64,
}

/// The filesystem handed to fuser; its state is shared with the work it moves off the
/// session threads.
pub struct LocusFs {
    core: Arc<Core>,
}

impl std::ops::Deref for LocusFs {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

pub struct Core {
    ns: Arc<Namespace>,
    rt: tokio::runtime::Handle,
    local: Option<NodeClient>,
    remote: Arc<Remote>,
    metrics: Arc<Metrics>,
    settings: Settings,
    uid: u32,
    gid: u32,
    /// Whether backing files are being handed to the kernel (set at init, cleared if
    /// the kernel refuses one).
    passthrough: Arc<AtomicBool>,
    /// Whether the kernel opens files by itself (`Settings::kernel_opens`, if the kernel
    /// offers it; set at init).
    kernel_opens: Arc<AtomicBool>,
    next_fh: AtomicU64,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    /// The kernel wants one backing file per inode while any handle of it is open.
    backing: Mutex<HashMap<u64, (Arc<BackingId>, usize)>>,
    /// Local files the node verified recently, by inode: reopening one within
    /// `Settings::reopen_ttl` skips the round trip to the node (what makes re-reading many small
    /// files fast). An open file keeps its bytes even if the node drops the blob.
    recent: Mutex<HashMap<u64, (Arc<NodeFile>, Instant)>>,
    recent_max: usize,
    /// The fetch from the node in flight for an inode (see `local_file`).
    fetching: Mutex<HashMap<u64, Arc<Pending>>>,
    /// When the mount last said the node is slow (said once a minute at most).
    slow_node_warned: Mutex<Option<Instant>>,
    /// Sequential-read state of remote files the kernel opened without asking, by inode.
    inode_readahead: Mutex<HashMap<u64, Arc<Mutex<ReadAhead>>>>,
}

/// Most fetches from the local node in flight at once. Each holds a blocking thread for
/// as long as the node takes to answer; with a hung node that is the whole open timeout,
/// and without a bound a reader going through many files would tie up the runtime's
/// blocking pool (512 threads), which every read also needs. Beyond it, files are read
/// from replicas until fetches finish.
const MAX_FETCHES: usize = 32;

/// Most recently verified local files kept open. Each holds a file descriptor, so the
/// real bound is a quarter of the process's open-file limit (often only 1,024).
const RECENT_MAX: usize = 65_536;

fn recent_capacity() -> usize {
    let soft = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|x| x.starts_with("Max open files"))
                .and_then(|x| x.split_whitespace().nth(3))
                .and_then(|v| v.parse::<usize>().ok())
        })
        .unwrap_or(1024);
    (soft / 4).clamp(16, RECENT_MAX)
}

/// Pages stay cached across opens (nothing changes), and close does not send a flush
/// (nothing is ever written), saving a round trip per file.
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_KEEP_CACHE.union(FopenFlags::FOPEN_NOFLUSH);

impl LocusFs {
    pub fn new(
        ns: Arc<Namespace>,
        rt: tokio::runtime::Handle,
        local: Option<NodeClient>,
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
            core: Arc::new(Core {
                ns,
                rt,
                local,
                remote,
                metrics,
                settings,
                uid,
                gid,
                passthrough: Arc::new(AtomicBool::new(false)),
                kernel_opens: Arc::new(AtomicBool::new(false)),
                next_fh: AtomicU64::new(1),
                handles: Mutex::new(HashMap::new()),
                backing: Mutex::new(HashMap::new()),
                recent: Mutex::new(HashMap::new()),
                recent_max: recent_capacity(),
                fetching: Mutex::new(HashMap::new()),
                slow_node_warned: Mutex::new(None),
                inode_readahead: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Whether passthrough is in use; readable after the filesystem moved into its
    /// session (the kernel's answer comes at init).
    pub fn passthrough_state(&self) -> Arc<AtomicBool> {
        self.passthrough.clone()
    }

    /// Whether the kernel opens files by itself; readable like `passthrough_state`.
    pub fn kernel_opens_state(&self) -> Arc<AtomicBool> {
        self.kernel_opens.clone()
    }
}

impl Core {
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
            perm: a.mode,
            nlink: a.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        }
    }

    fn add_handle(&self, h: Handle) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().unwrap().insert(fh, Arc::new(h));
        FileHandle(fh)
    }

    /// Asks the local node for a verified local copy of the blob.
    fn ensure_local(&self, node: &NodeClient, blob: BlobHash, size: u64) -> Result<PathBuf, String> {
        let mut node = node.clone();
        let req = nodepb::EnsureLocalRequest {
            hash: blob.0.to_vec(),
            size,
            chunk_size: self.ns.chunk_size(),
        };
        let limit = self.settings.open_timeout;
        self.rt.block_on(async move {
            match tokio::time::timeout(limit, node.ensure_local(req)).await {
                Ok(Ok(r)) => Ok(PathBuf::from(r.into_inner().path)),
                Ok(Err(s)) => Err(format!("{:?}: {}", s.code(), s.message())),
                Err(_) => Err(format!("no answer within {limit:?}")),
            }
        })
    }

    /// The local file the node verified for this inode within the reopen window, if any.
    fn recent_file(&self, ino: u64) -> Option<Arc<NodeFile>> {
        let recent = self.recent.lock().unwrap();
        recent
            .get(&ino)
            .filter(|(_, at)| at.elapsed() < self.settings.reopen_ttl)
            .map(|(f, _)| f.clone())
    }

    /// Has the local node make the blob present and verified, and opens its file. `None`
    /// when the caller must read from remote replicas instead. Blocks for as long as the
    /// node needs (a copy from a peer), so never called on a session thread.
    fn fetch_local(&self, node: &NodeClient, ino: u64, blob: BlobHash, size: u64) -> Option<Arc<NodeFile>> {
        let path = match self.ensure_local(node, blob, size) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(ino, blob = %blob, "the local node cannot provide the blob, reading from replicas: {e}");
                return None;
            }
        };
        let file = match NodeFile::open(&path) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                tracing::warn!(path = %path.display(), "cannot open the node's blob file, reading from replicas: {e}");
                return None;
            }
        };
        let ttl = self.settings.reopen_ttl;
        let mut recent = self.recent.lock().unwrap();
        if recent.len() >= self.recent_max {
            recent.retain(|_, (_, at)| at.elapsed() < ttl);
            if recent.len() >= self.recent_max {
                recent.clear();
            }
        }
        if !ttl.is_zero() {
            recent.insert(ino, (file.clone(), Instant::now()));
        }
        Some(file)
    }

    /// The node's verified file for this inode: the one verified within the reopen
    /// window, else the result of a `fetch_local`, waiting for it at most
    /// `Settings::local_patience`. A node slow to answer (a hung process, or a long copy
    /// from a peer) must not hold up a reader who can have the same verified bytes from
    /// remote replicas meanwhile; the fetch goes on in the background and later reads
    /// and opens use its result. One fetch per inode at a time: a cold file's first reads
    /// (or opens) arrive together, and all wait for the same answer rather than each
    /// asking the node (or each holding a thread while a hung node does not answer).
    /// None: read from replicas. The flag says whether this call started the fetch.
    fn local_file(
        self: &Arc<Self>,
        node: &NodeClient,
        ino: u64,
        blob: BlobHash,
        size: u64,
    ) -> Option<(Arc<NodeFile>, bool)> {
        if let Some(f) = self.recent_file(ino) {
            return Some((f, false));
        }
        let (pending, first) = {
            let mut fetching = self.fetching.lock().unwrap();
            match fetching.get(&ino) {
                Some(p) => (p.clone(), false),
                None if fetching.len() >= MAX_FETCHES => {
                    self.warn_slow_node(ino, blob, "has too many files to fetch");
                    return None;
                }
                None => {
                    let p = Arc::new(Pending {
                        done: Mutex::new(None),
                        cv: std::sync::Condvar::new(),
                        started: Instant::now(),
                    });
                    fetching.insert(ino, p.clone());
                    (p, true)
                }
            }
        };
        if first {
            let (core, node, p) = (self.clone(), node.clone(), pending.clone());
            self.rt.spawn_blocking(move || {
                let r = core.fetch_local(&node, ino, blob, size);
                core.fetching.lock().unwrap().remove(&ino);
                *p.done.lock().unwrap() = Some(r);
                p.cv.notify_all();
            });
        }
        let patience = self.settings.local_patience;
        let left = patience.saturating_sub(pending.started.elapsed());
        let done = pending.done.lock().unwrap();
        let (done, _) = pending
            .cv
            .wait_timeout_while(done, left, |d| d.is_none())
            .unwrap();
        if let Some(r) = &*done {
            return r.clone().map(|f| (f, first));
        }
        self.warn_slow_node(ino, blob, &format!("has not answered within {patience:?}"));
        None
    }

    /// Logs that reads bypass a slow node, once a minute at most: a hung node would
    /// otherwise log every read.
    fn warn_slow_node(&self, ino: u64, blob: BlobHash, why: &str) {
        let mut last = self.slow_node_warned.lock().unwrap();
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(ino, blob = %blob, "the local node {why}; reading from replicas meanwhile");
        }
    }

    /// Forgets the node's file for `ino` if it is still `file` (a newer one another
    /// reader fetched meanwhile stays), so the next read or open asks the node again.
    fn forget(&self, ino: u64, file: &NodeFile) {
        let mut recent = self.recent.lock().unwrap();
        if recent.get(&ino).is_some_and(|(f, _)| std::ptr::eq(&**f, file)) {
            recent.remove(&ino);
        }
    }

    /// Answers an open with the node's verified local file: as the kernel's backing file
    /// (passthrough) when allowed and the file is large enough, else read here with pread
    /// into pages the kernel keeps across opens.
    fn open_file(&self, ino: u64, size: u64, file: Arc<NodeFile>, reply: ReplyOpen) {
        if size >= self.settings.passthrough_min_size && self.passthrough.load(Ordering::Relaxed) {
            let mut backing = self.backing.lock().unwrap();
            let id = match backing.get_mut(&ino) {
                Some((id, n)) => {
                    *n += 1;
                    Some(id.clone())
                }
                None => match reply.open_backing(&file.file) {
                    Ok(id) => {
                        let id = Arc::new(id);
                        if backing.len() >= 2 * self.recent_max {
                            // Closed files keep their backing id only while recent.
                            let recent = self.recent.lock().unwrap();
                            backing.retain(|ino, (_, n)| *n > 0 || recent.contains_key(ino));
                        }
                        backing.insert(ino, (id.clone(), 1));
                        Some(id)
                    }
                    Err(e) => {
                        // Typically EPERM: registering backing files needs CAP_SYS_ADMIN.
                        tracing::warn!("the kernel refused a backing file ({e}); reading local files with pread from now on");
                        self.passthrough.store(false, Ordering::Relaxed);
                        None
                    }
                },
            };
            if let Some(id) = id {
                drop(backing);
                let fh = self.add_handle(Handle::Passthrough { ino, _file: file });
                self.metrics.opened("passthrough");
                // The kernel refuses passthrough opens with any flag outside its small
                // allowed set (KEEP_CACHE included: the backing file's own page cache
                // is what gets used); NOFLUSH is allowed.
                reply.opened_passthrough(fh, FopenFlags::FOPEN_NOFLUSH, &id);
                return;
            }
        }
        let fh = self.add_handle(Handle::Local { file });
        self.metrics.opened("local");
        reply.opened(fh, OPEN_FLAGS);
    }

    /// Answers an open whose bytes come from remote replicas (or an empty file).
    fn open_remote(&self, ino: u64, size: u64, reply: ReplyOpen) {
        // Start on the first chunk now; the reader almost always wants it.
        if let Some(c) = self.chunk_ref(ino, 0) {
            let remote = self.remote.clone();
            let _guard = self.rt.enter();
            remote.prefetch(vec![c]);
        }
        let fh = self.add_handle(Handle::Remote {
            ino,
            ra: Arc::new(Mutex::new(ReadAhead::default())),
        });
        self.metrics.opened(if size == 0 { "empty" } else { "remote" });
        reply.opened(fh, OPEN_FLAGS);
    }

    /// pread of the node's verified file, which must give all `want` bytes.
    fn pread_local(
        &self,
        ino: u64,
        file: &NodeFile,
        offset: u64,
        size: u32,
        want: u64,
    ) -> Result<Vec<u8>, Errno> {
        match pread(&file.file, offset, size) {
            // Short means the node's file shrank after it was verified: the kernel would
            // take it for the end of the file.
            Ok(data) if (data.len() as u64) < want => {
                tracing::error!(ino, offset, "the node's local file is shorter than the blob");
                self.forget(ino, file);
                Err(Errno::EIO)
            }
            Ok(data) => self.check_unchanged(ino, file).map(|()| data),
            Err(e) => {
                tracing::error!("reading the node's local file failed: {e}");
                Err(Errno::EIO)
            }
        }
    }

    /// Bytes just read from the node's file count only if nothing wrote to it since the
    /// node checked it; else EIO, and the file is forgotten so the next read or open has
    /// the node check it again (the kernel retries a failed page at once).
    fn check_unchanged(&self, ino: u64, file: &NodeFile) -> Result<(), Errno> {
        if file.unchanged() {
            return Ok(());
        }
        tracing::error!(ino, "the node's local file changed after it was verified");
        self.forget(ino, file);
        Err(Errno::EIO)
    }

    fn finish_read(&self, how: &'static str, r: Result<Vec<u8>, Errno>, started: Instant, reply: ReplyData) {
        match r {
            Ok(data) => {
                self.metrics.read(how, data.len(), started.elapsed());
                reply.data(&data)
            }
            Err(e) => {
                self.metrics.read_error();
                reply.error(e)
            }
        }
    }

    /// Reads `want` bytes of the node's verified file: here when the page cache holds
    /// them, else from the disk off the session thread, so readers of uncached files keep
    /// as many reads in flight as they like (there are few session threads, and a disk
    /// wants a deep queue).
    #[allow(clippy::too_many_arguments)]
    fn read_local(
        self: &Arc<Self>,
        ino: u64,
        file: Arc<NodeFile>,
        offset: u64,
        size: u32,
        want: u64,
        started: Instant,
        reply: ReplyData,
    ) {
        if want == 0 {
            return self.finish_read("local", Ok(Vec::new()), started, reply);
        }
        if let Some(data) = pread_cached(&file.file, offset, want as usize) {
            let r = self.check_unchanged(ino, &file).map(|()| data);
            return self.finish_read("local", r, started, reply);
        }
        let core = self.clone();
        self.rt.spawn_blocking(move || {
            let r = core.pread_local(ino, &file, offset, size, want);
            core.finish_read("local", r, started, reply)
        });
    }

    /// Reads from remote replicas, which waits for the network: off the session thread.
    fn read_remote_off_thread(
        self: &Arc<Self>,
        ino: u64,
        ra: Arc<Mutex<ReadAhead>>,
        offset: u64,
        size: u32,
        started: Instant,
        reply: ReplyData,
    ) {
        let core = self.clone();
        self.rt.spawn_blocking(move || {
            let r = core.read_remote(ino, &ra, offset, size);
            core.finish_read("remote", r, started, reply)
        });
    }

    /// A read of a file the kernel opened by itself (`Settings::kernel_opens`): the
    /// source is chosen as an open would choose it, at the first read the page cache
    /// cannot serve, and remembered by inode (the node's file for the reopen window).
    fn read_inode(self: &Arc<Self>, ino: u64, offset: u64, size: u32, started: Instant, reply: ReplyData) {
        let Some(a) = self.ns.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if a.kind != Kind::File {
            return reply.error(Errno::EISDIR);
        }
        let want = a.size.saturating_sub(offset).min(u64::from(size));
        let node = match &self.local {
            _ if want == 0 => return self.finish_read("local", Ok(Vec::new()), started, reply),
            Some(node) => node.clone(),
            None => {
                return self.read_remote_off_thread(
                    ino,
                    self.inode_readahead(ino),
                    offset,
                    size,
                    started,
                    reply,
                )
            }
        };
        if let Some(file) = self.recent_file(ino) {
            return self.read_local(ino, file, offset, size, want, started, reply);
        }
        let Some((blob, _)) = self.ns.blob(ino) else {
            return reply.error(Errno::EIO);
        };
        let core = self.clone();
        self.rt
            .spawn_blocking(move || match core.local_file(&node, ino, blob, a.size) {
                Some((file, fetched)) => {
                    if fetched {
                        core.metrics.opened("local");
                    }
                    let r = core.pread_local(ino, &file, offset, size, want);
                    core.finish_read("local", r, started, reply)
                }
                None => {
                    let r = core.read_remote(ino, &core.inode_readahead(ino), offset, size);
                    core.finish_read("remote", r, started, reply)
                }
            });
    }

    /// The read-ahead state of a remote file read without a handle; the first read of a
    /// file counts as its open.
    fn inode_readahead(&self, ino: u64) -> Arc<Mutex<ReadAhead>> {
        let mut all = self.inode_readahead.lock().unwrap();
        if let Some(ra) = all.get(&ino) {
            return ra.clone();
        }
        if all.len() >= self.recent_max {
            // Forgetting only costs a reader its read-ahead window, which regrows.
            all.clear();
        }
        self.metrics.opened("remote");
        all.entry(ino).or_default().clone()
    }

    fn chunk_ref(&self, ino: u64, index: u64) -> Option<ChunkRef> {
        let a = self.ns.attr(ino)?;
        let (blob, chunks) = self.ns.blob(ino)?;
        let cs = u64::from(self.ns.chunk_size());
        let offset = index * cs;
        if offset >= a.size {
            return None;
        }
        Some(ChunkRef {
            ino,
            blob,
            shard: self.ns.shard(ino)?,
            index: index as u32,
            offset,
            len: cs.min(a.size - offset),
            hash: *chunks.get(index as usize)?,
        })
    }

    fn read_remote(&self, ino: u64, ra: &Mutex<ReadAhead>, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        let a = self.ns.attr(ino).ok_or(Errno::ENOENT)?;
        let end = offset.saturating_add(u64::from(size)).min(a.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let cs = u64::from(self.ns.chunk_size());
        let (first, last) = (offset / cs, (end - 1) / cs);
        let (ahead_from, ahead_to) = {
            // Sequential means moving forward through the chunks: the kernel's own
            // read-ahead sends several reads at once, slightly out of order.
            let mut st = ra.lock().unwrap();
            let forward = first >= st.next_chunk && first <= st.next_chunk + 1 && (first > 0 || offset > 0);
            st.window = if forward {
                (st.window * 2).clamp(1, self.settings.readahead_chunks)
            } else {
                0
            };
            st.next_chunk = st.next_chunk.max(last);
            // Only chunks not already asked for: a read-ahead task per chunk, not per read.
            let from = (last + 1).max(st.ahead_to);
            let to = last + 1 + st.window as u64;
            if to > st.ahead_to {
                st.ahead_to = to;
            }
            (from, to)
        };
        let wanted: Vec<ChunkRef> = (first..=last).filter_map(|i| self.chunk_ref(ino, i)).collect();
        let ahead: Vec<ChunkRef> = (ahead_from..ahead_to)
            .filter_map(|i| self.chunk_ref(ino, i))
            .collect();
        let remote = self.remote.clone();
        let parts = self.rt.block_on(async move {
            remote.prefetch(ahead);
            let tasks: Vec<_> = wanted
                .into_iter()
                .map(|c| {
                    let r = remote.clone();
                    tokio::spawn(async move { (c, r.chunk(c).await) })
                })
                .collect();
            let mut parts = Vec::with_capacity(tasks.len());
            for t in tasks {
                parts.push(t.await);
            }
            parts
        });
        let mut out = Vec::with_capacity((end - offset) as usize);
        for p in parts {
            let (c, data) = p.map_err(|_| Errno::EIO)?;
            let (data, cached) = data.map_err(|e| {
                tracing::error!(ino, "read failed: {e}");
                Errno::EIO
            })?;
            let from = offset.max(c.offset) - c.offset;
            let to = end.min(c.offset + c.len) - c.offset;
            if cached {
                self.metrics.cache_hit((to - from) as usize);
            }
            out.extend_from_slice(&data[from as usize..to as usize]);
        }
        Ok(out)
    }
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
    }
}

/// Whether preadv2 accepts RWF_DONTCACHE here (kernel ≥ 6.14 and a filesystem that
/// supports it); cleared at the first refusal.
static DONTCACHE: AtomicBool = AtomicBool::new(true);

/// One preadv2 into `buf` of the node's file. The bytes are about to become the mount's
/// own pages, so the node's copy is read without caching it (RWF_DONTCACHE, also for the
/// read-ahead it starts) rather than kept twice; pages of it already cached stay.
#[allow(unsafe_code)]
fn preadv2(file: &File, buf: &mut [u8], offset: u64, flags: libc::c_int) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let off = libc::off_t::try_from(offset).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let call = |flags: libc::c_int| loop {
        // SAFETY: the one iovec points into `buf`, live and that long for the whole call;
        // the descriptor belongs to `file`, borrowed for the call.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, off, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    };
    if !DONTCACHE.load(Ordering::Relaxed) {
        return call(flags);
    }
    match call(flags | libc::RWF_DONTCACHE) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
            let r = call(flags);
            if r.is_ok() {
                // The same read without it works: the flag is what was refused.
                DONTCACHE.store(false, Ordering::Relaxed);
            }
            r
        }
        r => r,
    }
}

/// Reads `want` bytes at `offset` only if the page cache already holds them (RWF_NOWAIT),
/// so a session thread never waits for the disk; `None` means the read would have to
/// wait (or this kernel or filesystem cannot say), and belongs off the session thread.
fn pread_cached(file: &File, offset: u64, want: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; want];
    // Short (partly cached) or failed: the caller's ordinary read decides.
    (preadv2(file, &mut buf, offset, libc::RWF_NOWAIT).ok()? == want).then_some(buf)
}

/// Up to `size` bytes at `offset`, short only at the end of the file.
fn pread(file: &File, offset: u64, size: u32) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; size as usize];
    let mut got = 0;
    while got < buf.len() {
        match preadv2(file, &mut buf[got..], offset + got as u64, 0)? {
            0 => break,
            n => got += n,
        }
    }
    buf.truncate(got);
    Ok(buf)
}

impl Filesystem for LocusFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Capabilities are wishes: what this kernel lacks is simply not used.
        let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        let _ = config
            .set_max_readahead(u32::MAX)
            .or_else(|max| config.set_max_readahead(max));
        let _ = config.set_max_background(64);
        if self.settings.kernel_opens {
            // Offered since Linux 5.1; without them ENOSYS would fail the open.
            let both = InitFlags::FUSE_NO_OPEN_SUPPORT | InitFlags::FUSE_NO_OPENDIR_SUPPORT;
            if config.capabilities().contains(both) {
                self.kernel_opens.store(true, Ordering::Relaxed);
            } else {
                tracing::info!("this kernel cannot open files by itself; every open asks the mount");
            }
        }
        if self.settings.passthrough && !self.kernel_opens.load(Ordering::Relaxed) {
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) => {
                    // Backing files may live on a stacked filesystem (overlayfs) themselves.
                    let _ = config.set_max_stack_depth(2);
                    self.passthrough.store(true, Ordering::Relaxed);
                }
                Err(_) => {
                    tracing::info!("this kernel has no FUSE passthrough; local files are read with pread")
                }
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = name
            .to_str()
            .and_then(|n| self.ns.lookup(parent.0, n))
            .and_then(|ino| self.ns.attr(ino));
        match found {
            Some(a) => reply.entry(&TTL, &self.file_attr(&a), Generation(self.settings.generation)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.ns.attr(ino.0) {
            Some(a) => reply.attr(&TTL, &self.file_attr(&a)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.ns.readlink(ino.0) {
            Some(t) => reply.data(t.as_bytes()),
            None => reply.error(Errno::EINVAL),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let ino = ino.0;
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        if self.kernel_opens.load(Ordering::Relaxed) {
            // The kernel takes ENOSYS as "never ask again" and opens every file itself
            // from now on (the read-only mount refuses writers before they get here).
            return reply.error(Errno::ENOSYS);
        }
        let Some(a) = self.ns.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if a.kind != Kind::File {
            return reply.error(Errno::EISDIR);
        }
        let Some((blob, _)) = self.ns.blob(ino) else {
            return reply.error(Errno::EIO);
        };
        let node = match &self.local {
            Some(node) if a.size > 0 => node.clone(),
            _ => return self.open_remote(ino, a.size, reply),
        };
        if let Some(file) = self.recent_file(ino) {
            return self.open_file(ino, a.size, file, reply);
        }
        let core = self.core.clone();
        self.rt
            .spawn_blocking(move || match core.local_file(&node, ino, blob, a.size) {
                Some((file, _)) => core.open_file(ino, a.size, file, reply),
                None => core.open_remote(ino, a.size, reply),
            });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let started = Instant::now();
        if fh.0 == 0 {
            return self.core.read_inode(ino.0, offset, size, started, reply);
        }
        let Some(h) = self.handles.lock().unwrap().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        match &*h {
            Handle::Passthrough { _file: file, .. } | Handle::Local { file } => {
                let want = self
                    .ns
                    .attr(ino.0)
                    .map_or(0, |a| a.size.saturating_sub(offset).min(u64::from(size)));
                self.core
                    .read_local(ino.0, file.clone(), offset, size, want, started, reply)
            }
            Handle::Remote { ino, ra } => {
                self.core
                    .read_remote_off_thread(*ino, ra.clone(), offset, size, started, reply)
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
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.handles.lock().unwrap().remove(&fh.0);
        if let Some(h) = h {
            if let Handle::Passthrough { ino, .. } = &*h {
                let mut backing = self.backing.lock().unwrap();
                if let Some((_, n)) = backing.get_mut(ino) {
                    *n -= 1;
                    // A file likely to be reopened soon keeps its backing id: registering
                    // and closing one costs two more system calls per open.
                    let ttl = self.settings.reopen_ttl;
                    let fresh = || {
                        self.recent
                            .lock()
                            .unwrap()
                            .get(ino)
                            .is_some_and(|(_, at)| at.elapsed() < ttl)
                    };
                    if *n == 0 && !fresh() {
                        backing.remove(ino);
                    }
                }
            }
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.kernel_opens.load(Ordering::Relaxed) {
            // As for files: the kernel opens directories itself from now on, and keeps
            // their listings cached.
            return reply.error(Errno::ENOSYS);
        }
        match self.ns.attr(ino.0) {
            Some(a) if a.kind == Kind::Dir => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Some(_) => reply.error(Errno::ENOTDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let ino = ino.0;
        let Some(parent) = self.ns.parent(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // Positions: 0 ".", 1 "..", 2.. the children; an entry's offset is the next position.
        let mut pos = offset as usize;
        if pos == 0 {
            if reply.add(INodeNo(ino), 1, FileType::Directory, ".") {
                return reply.ok();
            }
            pos = 1;
        }
        if pos == 1 {
            let up = if parent == 0 { ino } else { parent };
            if reply.add(INodeNo(up), 2, FileType::Directory, "..") {
                return reply.ok();
            }
            pos = 2;
        }
        let Some(children) = self.ns.readdir(ino, pos - 2) else {
            return reply.error(Errno::ENOTDIR);
        };
        for (i, (child, name, kind)) in children.enumerate() {
            if reply.add(INodeNo(child), (pos + i + 1) as u64, file_type(kind), name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ino = ino.0;
        let gen = Generation(self.settings.generation);
        let (Some(parent), Some(me)) = (self.ns.parent(ino), self.ns.attr(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        let mut pos = offset as usize;
        if pos == 0 {
            if reply.add(INodeNo(ino), 1, ".", &TTL, &self.file_attr(&me), gen) {
                return reply.ok();
            }
            pos = 1;
        }
        if pos == 1 {
            let up = if parent == 0 { ino } else { parent };
            let Some(ua) = self.ns.attr(up) else {
                return reply.error(Errno::EIO);
            };
            if reply.add(INodeNo(up), 2, "..", &TTL, &self.file_attr(&ua), gen) {
                return reply.ok();
            }
            pos = 2;
        }
        let Some(children) = self.ns.readdir(ino, pos - 2) else {
            return reply.error(Errno::ENOTDIR);
        };
        for (i, (child, name, _)) in children.enumerate() {
            let Some(a) = self.ns.attr(child) else { continue };
            if reply.add(
                INodeNo(child),
                (pos + i + 1) as u64,
                name,
                &TTL,
                &self.file_attr(&a),
                gen,
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bytes = self.ns.total_bytes();
        reply.statfs(
            bytes.div_ceil(4096),
            0,
            0,
            self.ns.len() as u64,
            0,
            4096,
            255,
            4096,
        );
    }
}
