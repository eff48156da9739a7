//! Reading the node's blob files: what the page cache already holds without waiting
//! (`pread_cached`), the ordinary read that does not keep a second copy of the bytes
//! (`pread`, `RWF_DONTCACHE`), and the direct read of a file's end into the reply's own
//! buffer (`pread_direct`). Split from `core` because these are the system-call edge of
//! the read path, each with its own `unsafe` block.

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

/// The `want` bytes at `offset` that end the file, read with O_DIRECT into `buf` (the
/// reply's own buffer): no page cache on the way. Returns how many were read (short if
/// the file shrank). None when this file, filesystem or buffer cannot (then the caller
/// reads the ordinary way): `buf` must start on a page and hold `want` rounded up to one.
#[allow(unsafe_code)]
pub(crate) fn pread_direct(
    file: &File,
    offset: u64,
    want: usize,
    buf: &mut [u8],
) -> Option<std::io::Result<usize>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let len = want.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    if !offset.is_multiple_of(DIRECT_ALIGN as u64)
        || buf.len() < len
        || !(buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
    {
        return None;
    }
    // A second open file description of the same inode: the flag must not change the one
    // other readers share.
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()?;
    let mut got = 0;
    while got < want {
        let off = libc::off_t::try_from(offset + got as u64).ok()?;
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
    Some(Ok(got.min(want)))
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
