//! The ring entries' memory: a memfd mapped at one address in every server of a
//! connection, so that the next server can answer what a dead one held (see `held.rs`).

use std::io;
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;

use log::warn;

use super::PAGE;

/// Where the entries' memory is mapped first: far from where a process's libraries, heap
/// and stacks go, so that the next server finds the address free.
const FIXED_BASE: usize = 0x1000_0000_0000;

/// Where a connection's ring entries live, so that a later server can map them again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// The address the memory is mapped at (the kernel keeps the entries' addresses).
    pub addr: u64,
    /// Bytes mapped: every queue's entries.
    pub len: u64,
    /// Queues, one per possible CPU.
    pub queues: u32,
    /// Entries per queue.
    pub depth: u16,
    /// Each entry's payload buffer, after its 4 KiB header page.
    pub payload_cap: u64,
}

impl RingLayout {
    pub(super) fn new(addr: usize, queues: usize, depth: u16, payload_cap: usize) -> RingLayout {
        let payload_cap = payload_cap.next_multiple_of(PAGE);
        RingLayout {
            addr: addr as u64,
            len: ((PAGE + payload_cap) * queues * usize::from(depth)) as u64,
            queues: queues as u32,
            depth,
            payload_cap: payload_cap as u64,
        }
    }

    pub(super) fn queue_len(&self) -> usize {
        (PAGE + self.payload_cap as usize) * usize::from(self.depth)
    }
}

/// Every queue's entries: a memfd shared with whoever keeps it for the next server (the
/// mount's holder), or private memory where a memfd cannot be had.
pub(crate) struct RingMemory {
    pub(super) fd: Option<OwnedFd>,
    base: *mut u8,
    pub(super) layout: RingLayout,
}

// SAFETY: the mapping is plain memory; who may touch which entry is the queues' business.
unsafe impl Send for RingMemory {}
unsafe impl Sync for RingMemory {}

impl Drop for RingMemory {
    fn drop(&mut self) {
        // SAFETY: mapped in `create` or `adopt` with this length; every queue (and with it
        // every command that pointed here) is gone, since each holds this memory.
        unsafe { libc::munmap(self.base.cast(), self.layout.len as usize) };
    }
}

impl RingMemory {
    pub(super) fn create(queues: usize, depth: u16, payload_cap: usize) -> io::Result<RingMemory> {
        let want = RingLayout::new(0, queues, depth, payload_cap);
        let len = want.len as usize;
        // SAFETY: memfd_create with a valid name and flags; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"fuse-ring".as_ptr(), libc::MFD_CLOEXEC) };
        let fd = (raw >= 0).then(|| {
            // SAFETY: a fresh descriptor nothing else owns.
            unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) }
        });
        let fd = fd.filter(|f| {
            // SAFETY: sizing a memfd we own.
            unsafe { libc::ftruncate(f.as_raw_fd(), len as libc::off_t) == 0 }
        });
        let Some(fd) = fd else {
            warn!(
                "no shared memory for the ring entries: a restarted server cannot answer what this one holds"
            );
            let base = map(
                std::ptr::null_mut(),
                len,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
            )?;
            return Ok(RingMemory {
                fd: None,
                base,
                layout: RingLayout {
                    addr: base as u64,
                    ..want
                },
            });
        };
        let shared = libc::MAP_SHARED | libc::MAP_NORESERVE;
        let base = map(
            FIXED_BASE as *mut u8,
            len,
            shared | libc::MAP_FIXED_NOREPLACE,
            fd.as_raw_fd(),
        )
        .or_else(|_| map(std::ptr::null_mut(), len, shared, fd.as_raw_fd()))?;
        Ok(RingMemory {
            fd: Some(fd),
            base,
            layout: RingLayout {
                addr: base as u64,
                ..want
            },
        })
    }

    /// Maps the memory a previous server of the connection left, at its address.
    pub(super) fn adopt(fd: OwnedFd, layout: RingLayout) -> io::Result<RingMemory> {
        let len = layout.len as usize;
        // Mapped past the memfd's end, the entries would fault (SIGBUS) when touched.
        let size = std::fs::File::from(fd.try_clone()?).metadata()?.len();
        if size < layout.len {
            return Err(io::Error::other(format!(
                "the ring memory holds {size} bytes, its layout says {}",
                layout.len
            )));
        }
        let at = layout.addr as usize as *mut u8;
        let base = map(
            at,
            len,
            libc::MAP_SHARED | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
            fd.as_raw_fd(),
        )?;
        if base != at {
            // A kernel that takes MAP_FIXED_NOREPLACE as a hint (before 4.17).
            // SAFETY: just mapped with this length, not shared yet.
            unsafe { libc::munmap(base.cast(), len) };
            return Err(io::Error::other(
                "the ring memory's address is taken in this process",
            ));
        }
        Ok(RingMemory {
            fd: Some(fd),
            base,
            layout,
        })
    }

    pub(super) fn queue_base(&self, qid: usize) -> *mut u8 {
        // SAFETY: within the mapping for qid < queues.
        unsafe { self.base.add(qid * self.layout.queue_len()) }
    }
}

fn map(at: *mut u8, len: usize, flags: i32, fd: RawFd) -> io::Result<*mut u8> {
    // SAFETY: a new mapping; MAP_FIXED_NOREPLACE never replaces one that exists.
    let p = unsafe { libc::mmap(at.cast(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

impl std::fmt::Debug for RingMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RingMemory({:?})", self.layout)
    }
}
