//! Reading the node's blob files: what the page cache already holds without waiting
//! (`pread_cached`) or whether it holds them at all (`cached`), the ordinary read that
//! does not keep a second copy of the bytes (`pread`, `RWF_DONTCACHE`), and the direct
//! read of a blob's end into the reply's own buffer (`pread_direct`). Split from `core`
//! because these are the system-call edge of the read path, each with its own `unsafe`
//! block.

use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether preadv2 accepts RWF_DONTCACHE here (kernel ≥ 6.14 and a filesystem that
/// supports it); cleared at the first refusal.
static DONTCACHE: AtomicBool = AtomicBool::new(true);

/// One preadv2 into `buf` of the node's file. The bytes are about to become the mount's
/// own pages, so the node's copy is read without caching it (RWF_DONTCACHE, also for the
/// read-ahead it starts) rather than kept twice; pages of it already cached stay.
#[allow(unsafe_code)]
pub(crate) fn preadv2(
    file: &File,
    buf: &mut [u8],
    offset: u64,
    flags: libc::c_int,
) -> std::io::Result<usize> {
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

/// Fills `buf` from `offset` only if the page cache already holds those bytes
/// (RWF_NOWAIT), so a session thread never waits for the disk; `false` means the read
/// would have to wait (or this kernel or filesystem cannot say), and belongs off the
/// session thread.
pub(crate) fn pread_cached(file: &File, offset: u64, buf: &mut [u8]) -> bool {
    // Short (partly cached) or failed: the caller's ordinary read decides.
    preadv2(file, buf, offset, libc::RWF_NOWAIT).is_ok_and(|n| n == buf.len())
}

/// Direct reads go by pages: offsets, lengths and the buffer's address.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// The room a direct read of `want` bytes at `offset` of the file needs in its buffer:
/// the whole pages the range touches (a blob inside a pack starts anywhere). Never more,
/// so a 1 MiB read from a page boundary still fits an io_uring entry's 1 MiB payload.
pub(crate) const fn direct_room(offset: u64, want: usize) -> usize {
    ((offset % DIRECT_ALIGN as u64) as usize + want).next_multiple_of(DIRECT_ALIGN)
}

/// A second open file description of `file`'s inode that reads with O_DIRECT (the flag
/// must not change the description other readers share). Reopening checks the file's
/// own permissions again; where they refuse (a descriptor the node handed over its open
/// socket to a user the file's mode does not admit), None: reads go the ordinary way.
pub(crate) fn open_direct(file: &File) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

/// An O_DIRECT descriptor for one read: a pack's shared one, or one opened for the read.
pub(crate) enum DirectFile<'a> {
    Shared(&'a File),
    Own(File),
}

impl std::ops::Deref for DirectFile<'_> {
    type Target = File;

    fn deref(&self) -> &File {
        match self {
            DirectFile::Shared(f) => f,
            DirectFile::Own(f) => f,
        }
    }
}

/// The `want` bytes at `offset` that end the blob, read with O_DIRECT into `buf` (the
/// reply's own buffer): no page cache on the way. An offset off a page boundary (a blob
/// inside a pack) reads the whole pages around the range and moves the bytes to the
/// buffer's start; the neighbours' bytes read with them are never returned. Returns how
/// many were read (short if the file shrank). None when this file, filesystem or buffer
/// cannot (then the caller reads the ordinary way): `buf` must start on a page and hold
/// the pages the range touches (`direct_room(offset, want)`). `direct` is the file opened
/// with O_DIRECT (`open_direct`).
#[allow(unsafe_code)]
pub(crate) fn pread_direct(
    direct: &File,
    offset: u64,
    want: usize,
    buf: &mut [u8],
) -> Option<std::io::Result<usize>> {
    use std::os::fd::AsRawFd;
    let skip = (offset % DIRECT_ALIGN as u64) as usize;
    let start = offset - skip as u64;
    let len = (skip + want).next_multiple_of(DIRECT_ALIGN);
    if buf.len() < len || !(buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN) {
        return None;
    }
    let mut got = 0;
    while got < skip + want {
        let off = libc::off_t::try_from(start + got as u64).ok()?;
        // SAFETY: `got < len <= buf.len()`, so the range written is inside `buf`, which
        // lives for the call; the descriptor is `direct`'s.
        let n = unsafe {
            libc::pread(
                direct.as_raw_fd(),
                buf.as_mut_ptr().add(got).cast(),
                len - got,
                off,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // Alignment this device does not take: read the ordinary way.
                Some(libc::EINVAL) if got == 0 => return None,
                _ => return Some(Err(e)),
            }
        }
        got += n as usize;
        // Short only at the end of the file (which came early if the file shrank: the
        // caller checks the length); a next read from an unaligned offset would fail.
        if n == 0 || !got.is_multiple_of(DIRECT_ALIGN) {
            break;
        }
    }
    let n = got.saturating_sub(skip).min(want);
    if skip > 0 {
        buf.copy_within(skip..skip + n, 0);
    }
    Some(Ok(n))
}

/// Whether this kernel answers `cachestat` (Linux 6.5+); cleared at the first refusal.
static CACHESTAT: AtomicBool = AtomicBool::new(true);

/// Whether the page cache holds every page of `len` bytes at `offset` of `file`, asked
/// without reading anything (`cachestat`). A read with RWF_NOWAIT would say so too, but
/// it starts the kernel's read-ahead of what is missing, and a direct read of the same
/// bytes after it reads them twice. None when this kernel cannot say.
#[allow(unsafe_code)]
pub(crate) fn cached(file: &File, offset: u64, len: usize) -> Option<bool> {
    use std::os::fd::AsRawFd;
    // The same number on every architecture: it came after the tables were unified.
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    if len == 0 || !CACHESTAT.load(Ordering::Relaxed) {
        return None;
    }
    let page = DIRECT_ALIGN as u64;
    let first = offset / page;
    let pages = (offset + len as u64).div_ceil(page) - first;
    let range = Range {
        off: first * page,
        len: pages * page,
    };
    let mut stat = Stat::default();
    // SAFETY: both structs are the kernel's layout, live for the call; the descriptor is
    // `file`'s, borrowed for the call.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0 as libc::c_uint,
        )
    };
    if r != 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            CACHESTAT.store(false, Ordering::Relaxed);
        }
        return None;
    }
    Some(stat.nr_cache >= pages)
}

/// Fills `buf` from `offset`; short only at the end of the file.
pub(crate) fn pread(file: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match preadv2(file, &mut buf[got..], offset + got as u64, 0)? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}
