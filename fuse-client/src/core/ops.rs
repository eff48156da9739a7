//! What each file-system operation means for a mounted version, with no kernel in sight:
//! the adapter (`fs`) asks here, gets a `Result<_, FsError>` and only translates it into
//! a reply. Everything that is policy lives here — which source an open uses, whether a
//! file goes to the kernel as a backing file, how long a closed file keeps it, what a
//! listing tells the kernel — so it is unit-tested for every operation (`tests/ops.rs`).

use std::ffi::OsStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::listing::{Readdirplus, READDIRPLUS_ENTRIES};
use super::{Core, FsError, NodeFile};
use crate::namespace::{Attr, Kind};

/// How an open is to be answered.
#[derive(Debug)]
pub(crate) enum OpenPlan {
    /// The kernel opens files by itself on this mount: it is told so (ENOSYS: never ask
    /// again) and reads come by inode.
    KernelOpens,
    /// From remote replicas (no local node, or an empty file).
    Remote { ino: u64, size: u64 },
    /// The node's verified file, recently verified: no need to ask the node.
    Local {
        ino: u64,
        size: u64,
        file: Arc<NodeFile>,
    },
    /// Ask the node first (`Core::open_fetched`, which blocks: off the session thread).
    AskNode {
        ino: u64,
        size: u64,
        blob: locus_proto::BlobHash,
    },
}

/// Where a read of a file the kernel opened comes from (`Core::read_by_inode`).
pub(crate) enum ByInode {
    /// The node's verified file: `want` bytes of it are to be read.
    Local { file: Arc<NodeFile>, want: usize },
    /// Bytes from remote replicas, verified (empty at or past the end of the file).
    Remote(bytes::Bytes),
}

/// How a local file is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOpen {
    /// As the kernel's backing file: reads never reach this process.
    Passthrough,
    /// Read here with pread, into pages the kernel keeps across opens.
    Pread,
}

/// One entry of a listing as the kernel is to see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed<'a> {
    pub ino: u64,
    /// The position after this entry (where the next answer starts).
    pub offset: u64,
    pub name: &'a str,
    pub kind: Kind,
    /// For READDIRPLUS: the entry's attributes (the kernel makes an inode of it when the
    /// listing gives attributes, `Listing::attributes`).
    pub attr: Option<Attr>,
}

/// A directory's entries from a position on.
pub struct Listing<'a> {
    pub entries: Box<dyn Iterator<Item = Listed<'a>> + 'a>,
    /// READDIRPLUS: whether this answer gives the children's attributes (else names
    /// only); `.` and `..` always have theirs.
    pub attributes: bool,
}

/// The file system's numbers (`statfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Statfs {
    pub blocks: u64,
    pub files: u64,
    pub block_size: u32,
    pub name_max: u32,
}

impl Core {
    /// LOOKUP: the child `name` of `parent`. A name that is not UTF-8 names nothing (no
    /// version holds one). Counted, and told to the listing policy.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        let found = name
            .to_str()
            .and_then(|n| self.ns.lookup(parent, n))
            .and_then(|ino| self.ns.attr(ino));
        self.metrics.looked_up();
        if let (Readdirplus::Adaptive, Some(a)) = (self.settings.readdirplus, &found) {
            self.listing.looked_up(parent, a.kind != Kind::Dir);
        }
        found.ok_or(FsError::NotFound)
    }

    /// GETATTR.
    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        self.ns.attr(ino).ok_or(FsError::NotFound)
    }

    /// READLINK.
    pub fn readlink(&self, ino: u64) -> Result<&str, FsError> {
        match self.ns.attr(ino) {
            None => Err(FsError::NotFound),
            Some(a) if a.kind != Kind::Symlink => Err(FsError::NotSymlink),
            Some(_) => self
                .ns
                .readlink(ino)
                .ok_or(FsError::Damaged("a symbolic link without a target")),
        }
    }

    /// OPEN: where the file's bytes will come from. `write`: the caller asked to write.
    /// Blocks on nothing: a file the node must be asked for comes back as `AskNode`.
    pub(crate) fn open(&self, ino: u64, write: bool) -> Result<OpenPlan, FsError> {
        if write {
            return Err(FsError::ReadOnly);
        }
        if self.negotiated.kernel_opens.load(Ordering::Relaxed) {
            return Ok(OpenPlan::KernelOpens);
        }
        let a = self.ns.attr(ino).ok_or(FsError::NotFound)?;
        if a.kind != Kind::File {
            return Err(FsError::IsDir);
        }
        let (blob, _) = self
            .ns
            .blob(ino)
            .ok_or(FsError::Damaged("a file without a blob"))?;
        let size = a.size;
        if self.local.is_none() || size == 0 {
            return Ok(OpenPlan::Remote { ino, size });
        }
        // A path the node listed with the file's shard is opened here, on the session
        // thread (its pack is usually open already): only a file the node has not vouched
        // for yet goes to the blocking pool to ask it.
        match self.recent_file(ino).or_else(|| self.known_file(ino)) {
            Some(file) => Ok(OpenPlan::Local { ino, size, file }),
            None => Ok(OpenPlan::AskNode { ino, size, blob }),
        }
    }

    /// The end of an `AskNode` open: the node's file, or remote replicas when the node
    /// cannot give one within its patience. Blocking.
    pub(crate) fn open_fetched(
        self: &Arc<Self>,
        ino: u64,
        size: u64,
        blob: locus_proto::BlobHash,
    ) -> OpenPlan {
        match self.local_file(ino, blob, size) {
            Some((file, _)) => OpenPlan::Local { ino, size, file },
            None => OpenPlan::Remote { ino, size },
        }
    }

    /// How a local file of `size` bytes is handed out: to the kernel when passthrough is
    /// on and the file is large enough (a passthrough open opens the backing file again
    /// in the kernel, which costs more than reading a small file from cache), never a
    /// pack (the kernel would read past this blob's end into its neighbours).
    pub(crate) fn local_open(&self, size: u64, file: &NodeFile) -> LocalOpen {
        match size >= self.settings.passthrough_min_size
            && !file.packed
            && self.negotiated.passthrough.load(Ordering::Relaxed)
        {
            true => LocalOpen::Passthrough,
            false => LocalOpen::Pread,
        }
    }

    /// The kernel refused a backing file (typically EPERM: it needs CAP_SYS_ADMIN):
    /// local files are read with pread from now on.
    pub fn passthrough_refused(&self, why: &dyn std::fmt::Display) {
        tracing::warn!(
            "the kernel refused a backing file ({why}); reading local files with pread from now on"
        );
        self.negotiated.passthrough.store(false, Ordering::Relaxed);
    }

    /// Whether a file whose last handle just closed keeps its backing id: while it is
    /// likely to be reopened soon (verified within the reopen window), registering and
    /// closing one again would cost two more system calls per open.
    pub fn keeps_backing(&self, ino: u64) -> bool {
        self.recent_file(ino).is_some()
    }

    /// OPENDIR. `Ok(true)`: the kernel opens directories by itself on this mount.
    pub fn opendir(&self, ino: u64) -> Result<bool, FsError> {
        if self.negotiated.kernel_opens.load(Ordering::Relaxed) {
            return Ok(true);
        }
        match self.ns.attr(ino) {
            Some(a) if a.kind == Kind::Dir => Ok(false),
            Some(_) => Err(FsError::NotDir),
            None => Err(FsError::NotFound),
        }
    }

    /// READDIR (`plus` false) or READDIRPLUS of `dir` from position `offset`: 0 is `.`,
    /// 1 is `..`, 2 on the children in name order. What a READDIRPLUS answer carries is
    /// the listing policy's (`Settings::readdirplus`).
    pub fn list(&self, dir: u64, offset: u64, plus: bool) -> Result<Listing<'_>, FsError> {
        let me = self.ns.attr(dir).ok_or(FsError::NotFound)?;
        if me.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let parent = self.ns.parent(dir).ok_or(FsError::NotFound)?;
        let up = if parent == 0 { dir } else { parent };
        let pos = offset as usize;
        let up_attr = match plus {
            true => Some(
                self.ns
                    .attr(up)
                    .ok_or(FsError::Damaged("a directory without a parent"))?,
            ),
            false => None,
        };
        let dots = [(dir, ".", plus.then_some(me)), (up, "..", up_attr)]
            .into_iter()
            .enumerate()
            .skip(pos.min(2))
            .map(|(i, (ino, name, attr))| Listed {
                ino,
                offset: i as u64 + 1,
                name,
                kind: Kind::Dir,
                attr,
            });
        let start = pos.saturating_sub(2);
        let children = self.ns.readdir(dir, start).ok_or(FsError::NotDir)?;
        let (limit, attributes) = match (plus, self.settings.readdirplus) {
            (false, _) => (usize::MAX, false),
            (true, Readdirplus::Auto) => (READDIRPLUS_ENTRIES, true),
            (true, Readdirplus::All) => (usize::MAX, true),
            (true, Readdirplus::Adaptive) => (usize::MAX, self.listing.attributes_for(dir)),
        };
        let children = children
            .enumerate()
            .take(limit)
            .filter_map(move |(i, (ino, name, kind))| {
                let attr = match plus {
                    // An entry whose record does not read is left out, not listed wrong.
                    true => Some(self.ns.attr(ino)?),
                    false => None,
                };
                Some(Listed {
                    ino,
                    offset: (start + i + 3) as u64,
                    name,
                    kind,
                    attr,
                })
            });
        Ok(Listing {
            entries: Box::new(dots.chain(children)),
            attributes,
        })
    }

    /// STATFS: the version's bytes in 4 KiB blocks and its entries; nothing free.
    pub fn statfs(&self) -> Statfs {
        Statfs {
            blocks: self.ns.total_bytes().div_ceil(4096),
            files: self.ns.len() as u64,
            block_size: 4096,
            name_max: 255,
        }
    }
}
