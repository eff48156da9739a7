//! The node's blob files as this mount holds them: where the node keeps a verified blob
//! (a file of its own or a range of a pack), the file opened, and the descriptors a pack's
//! files share.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use super::{open_direct, DirectFile};

/// Where the node keeps a verified blob: a file of its own, or a range of a pack of
/// small blobs (`packed`: only `[offset, offset + size)` of the file is the blob's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeBlob {
    pub path: PathBuf,
    pub offset: u64,
    pub packed: bool,
}

impl NodeBlob {
    /// A blob in a file of its own.
    pub fn whole(path: PathBuf) -> Self {
        NodeBlob {
            path,
            offset: 0,
            packed: false,
        }
    }
}

/// A blob file the local node verified, as this mount opened it.
#[derive(Debug)]
pub struct NodeFile {
    /// The file's descriptors: one per blob file, or one per pack shared by every blob
    /// of it this mount reads (`known::Known::pack_file`).
    pub(crate) fd: Arc<Descriptors>,
    /// (inode, size, mtime) when opened, right after the node's check.
    pub(crate) seen: Option<(u64, u64, i64, i64)>,
    /// Where the blob starts in the file, and whether the file holds other blobs too
    /// (a pack: never the kernel's backing file, never read past the blob).
    pub(crate) base: u64,
    pub(crate) packed: bool,
}

/// A node file as this mount holds it open: for reads through the page cache, and for a
/// pack, the second descriptor its direct reads go through, opened once and kept while
/// any of its blobs is open here (a cold small file used to pay both opens, ~11 µs of the
/// mount's CPU, for one read).
#[derive(Debug)]
pub(crate) struct Descriptors {
    pub(crate) file: File,
    /// The O_DIRECT descriptor of a pack (None inside: this file or filesystem will not).
    direct: std::sync::OnceLock<Option<File>>,
}

impl Descriptors {
    pub(crate) fn new(file: File) -> Arc<Descriptors> {
        Arc::new(Descriptors {
            file,
            direct: std::sync::OnceLock::new(),
        })
    }
}

impl NodeFile {
    pub(crate) fn open(at: &NodeBlob) -> std::io::Result<NodeFile> {
        Ok(NodeFile::of(File::open(&at.path)?, at.offset, at.packed))
    }

    /// A file opened (or received) just after the node's check.
    pub(crate) fn of(file: File, base: u64, packed: bool) -> NodeFile {
        NodeFile {
            seen: file_id(&file),
            fd: Descriptors::new(file),
            base,
            packed,
        }
    }

    pub(crate) fn file(&self) -> &File {
        &self.fd.file
    }

    /// A descriptor of the same file that reads with O_DIRECT: a pack's is opened once and
    /// shared; a file of its own is opened for the read (a mount keeps thousands of those
    /// open for the reopen window, and a second descriptor each would halve that). None
    /// when the file or its filesystem refuses.
    pub(crate) fn direct(&self) -> Option<DirectFile<'_>> {
        if self.packed {
            return self
                .fd
                .direct
                .get_or_init(|| open_direct(&self.fd.file))
                .as_ref()
                .map(DirectFile::Shared);
        }
        open_direct(&self.fd.file).map(DirectFile::Own)
    }

    /// Whether the file is as it was when opened. Read after the bytes were: any write
    /// or truncation before that point has changed the mtime. (Not the ctime, which the
    /// node's own eviction changes by unlinking the file, leaving its bytes intact.)
    pub(crate) fn unchanged(&self) -> bool {
        self.seen.is_some() && file_id(&self.fd.file) == self.seen
    }
}

pub(crate) fn file_id(f: &File) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().ok()?;
    Some((m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}
