//! The mount's core: which source serves each read, and the reads themselves, with typed
//! errors and no fuser types. The fuser adapter (`fs`) turns its results into replies
//! and its errors into errno values, in one place.
//!
//! Sources sit behind traits so this is unit-tested against injected faults: the local
//! cache node (`LocalNode`: make a blob present and verified, give its path) and remote
//! replicas (`reader::Replicas`). Rules it keeps:
//! - only verified bytes are returned: the node's file as the node verified it (and
//!   unchanged since, else the read fails and the file is forgotten), or chunks
//!   `reader::Remote` checked against the manifest;
//! - a node that is slow or hung costs a file one wait of `Settings::local_patience`,
//!   after which its reads go to remote replicas while the node's answer is awaited in
//!   the background (one fetch per inode);
//! - a read no source can serve is an error (EIO to the reader), never zeros.
//!
//! Blocking: `local_file`, `read_by_inode` and `read_remote` wait for the network or the
//! node; callers run them off the FUSE session threads.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use locus_proto::BlobHash;

use crate::metrics::Metrics;
use crate::namespace::{Kind, Namespace};
use crate::reader::{ChunkRef, Remote};
pub use listing::Readdirplus;

/// Why a filesystem operation failed; `fs` maps each to one errno. Every failure to
/// give verified bytes is EIO to the reader; the variants keep why, for the log.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such entry")]
    NotFound,
    #[error("is a directory")]
    IsDir,
    #[error("not a directory")]
    NotDir,
    #[error("not a symbolic link")]
    NotSymlink,
    #[error("the file system is read-only")]
    ReadOnly,
    /// No source could serve verified bytes.
    #[error(transparent)]
    Unavailable(#[from] crate::reader::ReadError),
    /// The node's verified file is no longer what it verified (shorter, or written to).
    #[error("the node's local file {0}")]
    LocalChanged(&'static str),
    #[error("reading the node's local file: {0}")]
    LocalRead(#[source] std::io::Error),
    /// A read's task died (a panic in it, or the runtime shutting down).
    #[error("a read task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The namespace says something impossible (a file without a blob, ...).
    #[error("the namespace is damaged: {0}")]
    Damaged(&'static str),
}

impl FsError {
    /// Whether the failure is the reader's answer (a missing name, a wrong kind), not a
    /// fault worth a log line.
    pub fn is_answer(&self) -> bool {
        matches!(
            self,
            FsError::NotFound | FsError::IsDir | FsError::NotDir | FsError::NotSymlink | FsError::ReadOnly
        )
    }
}

/// The same host's cache node, as the mount uses it.
pub trait LocalNode: Send + Sync + 'static {
    /// Has the node make `blob` present and verified and returns its file's path, within
    /// `limit`. Blocking (it may copy the blob from a peer first).
    fn ensure_local(&self, blob: BlobHash, size: u64, limit: Duration) -> Result<NodeBlob, LocalError>;
    /// For each blob, the node's verified file and its identity at the check, if the node
    /// has it verified now (it fetches and hashes nothing); within `limit`. Blocking.
    fn local_paths(&self, blobs: &[BlobHash], limit: Duration) -> Result<Vec<Option<KnownPath>>, LocalError> {
        let _ = (blobs, limit);
        Err(LocalError::Refused("this node lists no paths".into()))
    }
    /// `ensure_local`, and the blob's file opened: what an open or a read needs. A node
    /// that hands out descriptors (the open socket) answers with the file itself.
    fn open_local(&self, blob: BlobHash, size: u64, limit: Duration) -> Result<NodeFile, LocalError> {
        let at = self.ensure_local(blob, size, limit)?;
        NodeFile::open(&at).map_err(|e| {
            LocalError::Refused(format!(
                "cannot open the node's blob file {}: {e}",
                at.path.display()
            ))
        })
    }
    /// Whether `open_many` hands out files (the open socket); a node that lists paths
    /// is asked for those instead (`local_paths`).
    fn hands_out_files(&self) -> bool {
        false
    }
    /// For each blob the node holds verified now, its file opened (it fetches and hashes
    /// nothing); within `limit`. Blocking.
    fn open_many(&self, blobs: &[BlobHash], limit: Duration) -> Result<Vec<Option<NodeFile>>, LocalError> {
        let _ = (blobs, limit);
        Err(LocalError::Refused("this node hands out no files".into()))
    }
}

/// Why the same host's node gave no file for a blob: what the log says, and whether the
/// node itself is in trouble (`Unreachable`) or only this blob is (`Missing`, `Corrupt`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalError {
    /// Not answering, or not within the time allowed.
    #[error("the node is not answering: {0}")]
    Unreachable(String),
    /// Neither the node nor any source it can reach holds the blob (NOT_FOUND).
    #[error("no source the node can reach holds it: {0}")]
    Missing(String),
    /// Every copy the node found failed verification (DATA_LOSS).
    #[error("no copy the node found was intact: {0}")]
    Corrupt(String),
    /// It refused: a full data dir, a client it does not serve, a packed blob for a client
    /// that reads whole files.
    #[error("the node refused: {0}")]
    Refused(String),
}

impl LocalError {
    /// A node's gRPC answer, sorted by what it means for the mount.
    pub fn from_status(s: &tonic::Status) -> Self {
        let m = format!("{:?}: {}", s.code(), s.message());
        match s.code() {
            tonic::Code::NotFound => LocalError::Missing(m),
            tonic::Code::DataLoss => LocalError::Corrupt(m),
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unknown
            | tonic::Code::Cancelled => LocalError::Unreachable(m),
            _ => LocalError::Refused(m),
        }
    }
}

/// A fetch of one inode's file from the local node, which readers wait for.
pub(crate) struct Pending {
    /// Set once the node answered: the file, or None (read from replicas).
    pub(crate) done: Mutex<Option<Option<Arc<NodeFile>>>>,
    pub(crate) cv: std::sync::Condvar,
    /// Readers wait for the node until `started + local_patience`, not each for the
    /// whole patience: a hung node costs a file one wait, not one per read request.
    pub(crate) started: Instant,
}

#[derive(Clone)]
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
    /// What directory listings tell the kernel (see `fs::plus`).
    pub readdirplus: Readdirplus,
}

impl Default for Settings {
    /// What `locus mount` uses unless told otherwise.
    fn default() -> Self {
        Settings {
            kernel_opens: false,
            passthrough: true,
            passthrough_min_size: 1 << 20,
            readahead_chunks: 8,
            // A copy of a large blob from a peer over a slow link, which the reader would
            // otherwise fail on.
            open_timeout: Duration::from_secs(600),
            // Long enough for a node that is busy, short enough that a hung one costs a
            // reader a moment, not its job (the node's copy goes on; later reads use it).
            local_patience: Duration::from_secs(3),
            reopen_ttl: Duration::from_secs(30),
            generation: 1,
            readdirplus: Readdirplus::Adaptive,
        }
    }
}

/// What INIT negotiated with the kernel (or a predecessor's INIT, on a takeover), which
/// the core's policy depends on. Shared with whoever reports it (`locus status`).
#[derive(Default)]
pub struct Negotiation {
    /// Backing files are handed to the kernel (cleared if it refuses one).
    pub passthrough: Arc<AtomicBool>,
    /// The kernel opens files by itself.
    pub kernel_opens: Arc<AtomicBool>,
}

pub struct Core {
    pub(crate) ns: Arc<Namespace>,
    pub(crate) rt: tokio::runtime::Handle,
    pub(crate) local: Option<Arc<dyn LocalNode>>,
    pub(crate) remote: Arc<Remote>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) settings: Settings,
    /// Local files the node verified recently, by inode: reopening one within
    /// `Settings::reopen_ttl` skips the round trip to the node (what makes re-reading many small
    /// files fast). An open file keeps its bytes even if the node drops the blob.
    pub(crate) recent: Mutex<HashMap<u64, (Arc<NodeFile>, Instant)>>,
    pub(crate) recent_max: usize,
    /// The fetch from the node in flight for an inode (see `local_file`).
    pub(crate) fetching: Mutex<HashMap<u64, Arc<Pending>>>,
    /// When the mount last said the node is slow (said once a minute at most).
    pub(crate) slow_node_warned: Mutex<Option<Instant>>,
    /// Sequential-read state of remote files the kernel opened without asking, by inode.
    pub(crate) inode_readahead: Mutex<HashMap<u64, Arc<Mutex<ReadAhead>>>>,
    /// Verified paths learned from the node a shard at a time (see `known`).
    pub(crate) known: Mutex<known::Known>,
    pub(crate) negotiated: Negotiation,
    /// Whether listings carry attributes now (`Readdirplus::Adaptive`).
    pub(crate) listing: listing::Adaptive,
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

pub(crate) fn recent_capacity() -> usize {
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

impl Core {
    /// The local file the node verified for this inode within the reopen window, if any.
    pub(crate) fn recent_file(&self, ino: u64) -> Option<Arc<NodeFile>> {
        let recent = self.recent.lock().unwrap();
        recent
            .get(&ino)
            .filter(|(_, at)| at.elapsed() < self.settings.reopen_ttl)
            .map(|(f, _)| f.clone())
    }

    /// Has the local node make the blob present and verified, and opens its file. `None`
    /// when the caller must read from remote replicas instead. Blocks for as long as the
    /// node needs (a copy from a peer), so never called on a session thread.
    pub(crate) fn fetch_local(
        &self,
        node: &dyn LocalNode,
        ino: u64,
        blob: BlobHash,
        size: u64,
    ) -> Option<Arc<NodeFile>> {
        let file = match node.open_local(blob, size, self.settings.open_timeout) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                tracing::warn!(ino, blob = %blob, "the local node cannot provide the blob, reading from replicas: {e}");
                return None;
            }
        };
        self.remember(ino, file.clone());
        Some(file)
    }

    /// Keeps a verified local file open for reopens within the reopen window (where that
    /// window is applied to open files, with `recent_file`: whether the node is asked
    /// again, and whether a closed file keeps its backing id, `ops::keeps_backing`; the
    /// paths the node listed keep it in `known`).
    pub(crate) fn remember(&self, ino: u64, file: Arc<NodeFile>) {
        let ttl = self.settings.reopen_ttl;
        if ttl.is_zero() {
            return;
        }
        let mut recent = self.recent.lock().unwrap();
        let mut dropped = false;
        if recent.len() >= self.recent_max {
            recent.retain(|_, (_, at)| at.elapsed() < ttl);
            if recent.len() >= self.recent_max {
                recent.clear();
                dropped = true;
            }
        }
        recent.insert(ino, (file, Instant::now()));
        drop(recent);
        if dropped {
            // Files a node handed out live only here: their windows are to be asked for
            // again, or each would now be opened by the node alone until the window ends.
            self.known.lock().unwrap().forget_windows();
        }
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
    pub(crate) fn local_file(
        self: &Arc<Self>,
        ino: u64,
        blob: BlobHash,
        size: u64,
    ) -> Option<(Arc<NodeFile>, bool)> {
        if let Some(f) = self.recent_file(ino) {
            return Some((f, false));
        }
        if let Some(f) = self.known_file(ino) {
            return Some((f, true));
        }
        self.learn_shard(ino);
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
            let (core, p) = (self.clone(), pending.clone());
            self.rt.spawn_blocking(move || {
                let r = match &core.local {
                    Some(node) => core.fetch_local(&**node, ino, blob, size),
                    None => None,
                };
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
    pub(crate) fn warn_slow_node(&self, ino: u64, blob: BlobHash, why: &str) {
        let mut last = self.slow_node_warned.lock().unwrap();
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(ino, blob = %blob, "the local node {why}; reading from replicas meanwhile");
        }
    }

    /// Forgets the node's file for `ino` if it is still `file` (a newer one another
    /// reader fetched meanwhile stays), so the next read or open asks the node again.
    pub(crate) fn forget(&self, ino: u64, file: &NodeFile) {
        let mut recent = self.recent.lock().unwrap();
        if recent.get(&ino).is_some_and(|(f, _)| std::ptr::eq(&**f, file)) {
            recent.remove(&ino);
        }
    }

    /// pread of the node's verified file into `buf`, which must give all of it (the
    /// `want` bytes a read asks for that the file has). `direct`: a read that ends the
    /// blob may go straight from the disk into `buf` (`io::pread_direct`; `buf` then
    /// starts on a page and has `io::direct_room(file.base + offset, want)` of room).
    pub(crate) fn pread_local(
        &self,
        ino: u64,
        file: &NodeFile,
        offset: u64,
        want: usize,
        direct: bool,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        // A read that ends the blob has nothing to read ahead for: read it straight into
        // the reply's buffer (no page-cache pages to allocate, fill, copy and drop again;
        // a quarter less mount CPU per cold small file), a blob inside a pack too (the
        // pages around it are read, its own bytes returned). Other reads keep the
        // kernel's read-ahead.
        let direct = direct && self.ends_blob(ino, offset, want);
        let read = match direct
            .then(|| file.direct())
            .flatten()
            .and_then(|d| pread_direct(&d, file.base + offset, want, buf))
        {
            Some(r) => r,
            // A packed blob's neighbour starts where it ends: never more than the blob.
            None => pread(file.file(), file.base + offset, &mut buf[..want]),
        };
        self.judge_local(ino, file, want, read)
    }

    /// What a read of `want` bytes of the node's file gave, as the reader is to have it:
    /// the bytes only if all came and nothing wrote to the file since the node checked it.
    pub(crate) fn judge_local(
        &self,
        ino: u64,
        file: &NodeFile,
        want: usize,
        read: std::io::Result<usize>,
    ) -> Result<usize, FsError> {
        match read {
            // Short means the node's file shrank after it was verified: the kernel would
            // take it for the end of the file.
            Ok(n) if n < want => {
                tracing::error!(ino, want, n, "the node's local file is shorter than the blob");
                self.forget(ino, file);
                Err(FsError::LocalChanged("is shorter than the blob"))
            }
            Ok(n) => self.check_unchanged(ino, file).map(|()| n),
            Err(e) => {
                tracing::error!("reading the node's local file failed: {e}");
                Err(FsError::LocalRead(e))
            }
        }
    }

    /// Whether `want` bytes at `offset` reach the end of `ino`'s blob.
    pub(crate) fn ends_blob(&self, ino: u64, offset: u64, want: usize) -> bool {
        self.ns.attr(ino).is_some_and(|a| offset + want as u64 == a.size)
    }

    /// Bytes just read from the node's file count only if nothing wrote to it since the
    /// node checked it; else EIO, and the file is forgotten so the next read or open has
    /// the node check it again (the kernel retries a failed page at once).
    pub(crate) fn check_unchanged(&self, ino: u64, file: &NodeFile) -> Result<(), FsError> {
        if file.unchanged() {
            return Ok(());
        }
        tracing::error!(ino, "the node's local file changed after it was verified");
        self.forget(ino, file);
        Err(FsError::LocalChanged("changed after it was verified"))
    }

    /// The read-ahead state of a remote file read without a handle; the first read of a
    /// file counts as its open.
    pub(crate) fn inode_readahead(&self, ino: u64) -> Arc<Mutex<ReadAhead>> {
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

    pub(crate) fn chunk_ref(&self, ino: u64, index: u64) -> Option<ChunkRef> {
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
            hash: chunks.get(index as usize)?,
            size: a.size,
            kind: self.ns.chunk_kind(),
        })
    }
}

impl Core {
    pub fn new(
        ns: Arc<Namespace>,
        rt: tokio::runtime::Handle,
        local: Option<Arc<dyn LocalNode>>,
        remote: Arc<Remote>,
        metrics: Arc<Metrics>,
        settings: Settings,
    ) -> Self {
        Core {
            ns,
            rt,
            local,
            remote,
            metrics,
            settings,
            recent: Mutex::new(HashMap::new()),
            recent_max: recent_capacity(),
            fetching: Mutex::new(HashMap::new()),
            slow_node_warned: Mutex::new(None),
            inode_readahead: Mutex::new(HashMap::new()),
            known: Mutex::default(),
            negotiated: Negotiation::default(),
            listing: listing::Adaptive::default(),
        }
    }

    /// The bytes a read of `size` at `offset` gets from file `ino` (0 at or past its end),
    /// and the file's size; an error for what is not a file.
    pub(crate) fn read_len(&self, ino: u64, offset: u64, size: u32) -> Result<(usize, u64), FsError> {
        let a = self.ns.attr(ino).ok_or(FsError::NotFound)?;
        if a.kind != Kind::File {
            return Err(FsError::IsDir);
        }
        Ok((
            a.size.saturating_sub(offset).min(u64::from(size)) as usize,
            a.size,
        ))
    }

    /// A read of a file nobody opened through the mount (the kernel opened it): from the
    /// node's verified file if the node provides it within its patience (the caller
    /// reads `want` bytes of it, with `pread_local`, into the reply's buffer), else the
    /// bytes from remote replicas, as a slice of the verified chunk (the caller sends
    /// them from where they are: no copy into a buffer of its own). `keeps`: as for
    /// `read_remote`. Blocking.
    pub(crate) fn read_by_inode(
        self: &Arc<Self>,
        ino: u64,
        offset: u64,
        size: u32,
        keeps: bool,
    ) -> Result<ops::ByInode, FsError> {
        let (want, file_size) = self.read_len(ino, offset, size)?;
        if want == 0 {
            return Ok(ops::ByInode::Remote(bytes::Bytes::new()));
        }
        if self.local.is_some() {
            let (blob, _) = self
                .ns
                .blob(ino)
                .ok_or(FsError::Damaged("a file without a blob"))?;
            if let Some((file, fetched)) = self.local_file(ino, blob, file_size) {
                if fetched {
                    self.metrics.opened("local");
                }
                return Ok(ops::ByInode::Local { file, want });
            }
        }
        let ra = self.inode_readahead(ino);
        Ok(ops::ByInode::Remote(
            self.read_remote(ino, &ra, offset, size, keeps)?,
        ))
    }

    /// `read_by_inode`'s bytes in a buffer of their own, and which source served them
    /// (as a read the kernel does not keep: the chunk cache holds on to what it read).
    #[cfg(test)]
    pub(crate) fn read_by_inode_bytes(
        self: &Arc<Self>,
        ino: u64,
        offset: u64,
        size: u32,
    ) -> Result<(bytes::Bytes, &'static str), FsError> {
        self.read_by_inode_copied(ino, offset, size, false)
    }

    /// `read_by_inode_bytes`, for a read the kernel keeps or not (`keeps`).
    #[cfg(test)]
    pub(crate) fn read_by_inode_copied(
        self: &Arc<Self>,
        ino: u64,
        offset: u64,
        size: u32,
        keeps: bool,
    ) -> Result<(bytes::Bytes, &'static str), FsError> {
        match self.read_by_inode(ino, offset, size, keeps)? {
            ops::ByInode::Remote(b) => Ok((b, "remote")),
            ops::ByInode::Local { file, want } => {
                let align = io::DIRECT_ALIGN;
                let mut v = vec![0u8; io::direct_room(file.base + offset, want) + align];
                let at = v.as_ptr().align_offset(align);
                let end = v.len() - align + at;
                let n = self.pread_local(ino, &file, offset, want, true, &mut v[at..end])?;
                Ok((bytes::Bytes::from(v).slice(at..at + n), "local"))
            }
        }
    }
}

mod grpc_node;
mod io;
mod known;
mod node_file;
mod open_node;
pub use grpc_node::GrpcLocalNode;
pub use open_node::OpenSocketNode;
pub mod listing;
pub mod ops;
mod remote;
pub(crate) use io::DIRECT_ALIGN;
pub(crate) use io::{cached, direct_room, open_direct, pread, pread_cached, pread_direct, DirectFile};
pub use known::KnownPath;
pub(crate) use node_file::Descriptors;
pub use node_file::{NodeBlob, NodeFile};
pub(crate) use remote::ReadAhead;

#[cfg(test)]
mod tests;
