//! How many files are open with passthrough on each inode, in memory the holder of the
//! connection keeps across servers (a memfd): a server that takes over reads what its
//! predecessor left and closes the backing ids no file uses (`takeover`).
//!
//! Counted in shared memory, not told to the holder: a message per open and per close
//! cost the holder ~16 µs of CPU per passthrough open (two wake-ups of its receiving
//! thread), as much again as the open itself; an atomic add here costs nothing
//! measurable, and the memory outlives a server that dies at any instruction. A count is
//! raised before the kernel hears of the open, so it is never lower than the truth.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// One u32 per inode, mapped shared.
pub struct OpenCounts {
    fd: OwnedFd,
    ptr: *mut AtomicU32,
    len: usize,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics; it lives
// until drop.
#[allow(unsafe_code)]
unsafe impl Send for OpenCounts {}
#[allow(unsafe_code)]
unsafe impl Sync for OpenCounts {}

impl OpenCounts {
    /// Zeroed counts for inodes `0..len`, in a new memfd (sparse: a page is only made
    /// for inodes opened).
    pub fn create(len: usize) -> std::io::Result<OpenCounts> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(c"locus-open-counts", MFdFlags::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, (len.max(1) * 4) as libc::off_t)?;
        Self::map(fd, len)
    }

    /// The counts a predecessor left in `fd`, for inodes `0..len` (refused when the memory
    /// is shorter: it belongs to another namespace).
    pub fn adopt(fd: OwnedFd, len: usize) -> std::io::Result<OpenCounts> {
        let size = std::fs::File::from(fd.try_clone()?).metadata()?.len();
        if size < (len.max(1) * 4) as u64 {
            return Err(std::io::Error::other(format!(
                "open counts of {size} bytes, {len} inodes expected"
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> std::io::Result<OpenCounts> {
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let bytes = std::num::NonZeroUsize::new(len.max(1) * 4).expect("at least 4 bytes");
        // SAFETY: maps the memfd's first `bytes` shared; only atomics touch it, until
        // `drop` unmaps it.
        #[allow(unsafe_code)]
        let ptr = unsafe {
            mmap(
                None,
                bytes,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )?
        };
        Ok(OpenCounts {
            fd,
            ptr: ptr.as_ptr().cast(),
            len,
        })
    }

    /// The memory, for the holder to keep for the next server.
    pub fn memory(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Inodes counted.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(&self, ino: u64) -> Option<&AtomicU32> {
        let i = usize::try_from(ino).ok().filter(|&i| i < self.len)?;
        // SAFETY: i is within the mapping, which lives as long as self.
        #[allow(unsafe_code)]
        Some(unsafe { &*self.ptr.add(i) })
    }

    /// A file opened with passthrough on `ino`.
    pub fn opened(&self, ino: u64) {
        if let Some(c) = self.at(ino) {
            c.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A file opened with passthrough on `ino` released: how many are left.
    pub fn released(&self, ino: u64) -> u32 {
        self.at(ino).map_or(0, |c| {
            let mut left = 0;
            let _ = c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                left = n.saturating_sub(1);
                Some(left)
            });
            left
        })
    }

    /// Files open with passthrough on `ino` now.
    pub fn get(&self, ino: u64) -> u32 {
        self.at(ino).map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

impl Drop for OpenCounts {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing borrows it past self.
        #[allow(unsafe_code)]
        unsafe {
            let _ = nix::sys::mman::munmap(
                std::ptr::NonNull::new_unchecked(self.ptr.cast()),
                self.len.max(1) * 4,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_made_by_one_server_are_read_by_the_next() {
        let a = OpenCounts::create(1000).unwrap();
        a.opened(7);
        a.opened(7);
        a.opened(999);
        a.opened(5000); // past the namespace: not counted
        assert_eq!(a.released(999), 0);
        let b = OpenCounts::adopt(a.memory().try_clone_to_owned().unwrap(), 1000).unwrap();
        drop(a);
        assert_eq!((b.get(7), b.get(999), b.get(5000)), (2, 0, 0));
        assert_eq!(b.released(7), 1);
        assert_eq!(b.released(7), 0);
        assert_eq!(b.released(7), 0, "never below zero");
        let fd = b.memory().try_clone_to_owned().unwrap();
        assert!(
            OpenCounts::adopt(fd, 2000).is_err(),
            "a longer namespace's counts are refused"
        );
    }
}
