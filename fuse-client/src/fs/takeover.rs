//! What a mount server needs to take over a live FUSE connection from a predecessor
//! that died (see `locus mount`'s holder): the state INIT negotiated, the passthrough
//! backing ids it registered (reported to the holder as they come and go), and how many
//! files are open on each (`OpenCounts`, memory the holder keeps).
//!
//! An inherited id must be reused for its inode while any file the predecessor opened
//! with it is open: the kernel refuses a second backing file for an inode in use (the
//! reader's open fails with EIO). Once none is, keeping it only pins the node's blob
//! file in the kernel (its disk space too, should the node evict it), so an inherited id is
//! closed as soon as its count of open files is known to be zero: at takeover for ids
//! no file uses, at the last RELEASE of the predecessor's handles for the others. Where
//! the count is unknown (a holder from before counts were kept) it is kept for the
//! server's life, as before.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{LocusFs, OpenCounts};

/// What happens to an inode's passthrough backing id, as the holder is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Registered with the kernel (before any open uses it).
    Registered(u32),
    /// Closed (no file is open with it).
    Closed,
}

/// See `Mount::backing_observer`: (inode, what happened to its backing id).
pub type BackingObserver = Arc<dyn Fn(u64, Backing) + Send + Sync>;

/// An id a predecessor registered, and how many files it opened with it are still open
/// (`None`: not known).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Inherited {
    pub(crate) id: u32,
    pub(crate) open: Option<u32>,
}

// FUSE_DEV_IOC_BACKING_CLOSE: `_IOW(229, 2, uint32_t)` in <linux/fuse.h>.
nix::ioctl_write_ptr!(backing_close, 229, 2, u32);

/// Closes a backing id registered on the connection `fuse`.
pub(crate) fn close_backing(fuse: &OwnedFd, id: u32) -> std::io::Result<()> {
    // SAFETY: the ioctl reads one u32 from the pointer, which outlives the call.
    #[allow(unsafe_code)]
    unsafe {
        backing_close(fuse.as_raw_fd(), &id)?;
    }
    Ok(())
}

/// What init negotiated with the kernel, which a process taking over a live connection
/// must restore (the kernel sends INIT once per connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Negotiated {
    pub passthrough: bool,
    pub kernel_opens: bool,
}

impl LocusFs {
    /// Reports backing ids to `f` (see `Mount::backing_observer`) and counts files
    /// opened with passthrough in `counts` (shared with the next server). Call before
    /// mounting.
    pub fn with_handoff(mut self, f: BackingObserver, counts: Option<Arc<OpenCounts>>) -> Self {
        let m = Arc::get_mut(&mut self.mount).expect("set before the filesystem is shared");
        m.backing_observer = Some(f);
        m.open_counts = counts;
        self
    }

    /// Takes over a connection another process of this mount initialized (`fuse`): what
    /// it negotiated, and the backing ids it registered. With the counts of files open
    /// on each (`with_handoff`, adopted from the predecessor: `counted`), ids no file
    /// uses are closed now, and the others are reused for their inode and closed once
    /// the last of those files is released; without, every id is kept.
    pub fn restore(&self, n: Negotiated, inherited: HashMap<u64, u32>, counted: bool, fuse: OwnedFd) {
        let m = &self.mount;
        m.core
            .negotiated
            .passthrough
            .store(n.passthrough, Ordering::Relaxed);
        m.core
            .negotiated
            .kernel_opens
            .store(n.kernel_opens, Ordering::Relaxed);
        let mut kept = HashMap::new();
        for (ino, id) in inherited {
            let count = match (&m.open_counts, counted) {
                (Some(c), true) => Some(c.get(ino)),
                _ => None,
            };
            if count == Some(0) {
                m.close_inherited(ino, id, &fuse);
            } else {
                kept.insert(ino, Inherited { id, open: count });
            }
        }
        *m.inherited.lock().unwrap() = kept;
        *m.connection.lock().unwrap() = Some(fuse);
    }
}

impl super::Mount {
    /// Closes an inherited id no open file uses, and tells the holder.
    pub(crate) fn close_inherited(&self, ino: u64, id: u32, fuse: &OwnedFd) {
        match close_backing(fuse, id) {
            Ok(()) => tracing::debug!(ino, id, "closed an inherited backing id no file uses"),
            // Already gone with its files, or never ours: nothing is pinned either way.
            Err(e) => tracing::debug!(ino, id, "closing an inherited backing id: {e}"),
        }
        if let Some(f) = &self.backing_observer {
            f(ino, Backing::Closed);
        }
    }

    /// A RELEASE of a handle a predecessor opened with passthrough on `ino`: one file
    /// fewer on its backing id, which is closed with the last.
    pub(crate) fn release_inherited(&self, ino: u64) {
        if let Some(c) = &self.open_counts {
            c.released(ino);
        }
        let mut backing = self.backing.lock().unwrap();
        if let Some((_, n)) = backing.get_mut(&ino) {
            // Reused since: counted with this server's own opens.
            *n = n.saturating_sub(1);
            if *n == 0 && !self.core.keeps_backing(ino) {
                backing.remove(&ino);
                if let Some(f) = &self.backing_observer {
                    f(ino, Backing::Closed);
                }
            }
            return;
        }
        drop(backing);
        let mut inherited = self.inherited.lock().unwrap();
        let Some(Inherited { id, open: Some(n) }) = inherited.get_mut(&ino).map(|i| *i) else {
            return;
        };
        if n > 1 {
            inherited.insert(
                ino,
                Inherited {
                    id,
                    open: Some(n - 1),
                },
            );
            return;
        }
        inherited.remove(&ino);
        drop(inherited);
        if let Some(fuse) = &*self.connection.lock().unwrap() {
            self.close_inherited(ino, id, fuse);
        }
    }
}
