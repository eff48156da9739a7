//! Reading the node's blob files: what the page cache already holds without waiting
//! (`pread_cached`), the ordinary read that does not keep a second copy of the bytes
//! (`pread`, `RWF_DONTCACHE`), and the direct read of a file's end into the reply's own
//! buffer (`pread_direct`). Split from `core` because these are the system-call edge of
//! the read path, each with its own `unsafe` block.

use bytes::Bytes;
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

/// Reads `want` bytes at `offset` only if the page cache already holds them (RWF_NOWAIT),
/// so a session thread never waits for the disk; `None` means the read would have to
/// wait (or this kernel or filesystem cannot say), and belongs off the session thread.
pub(crate) fn pread_cached(file: &File, offset: u64, want: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; want];
    // Short (partly cached) or failed: the caller's ordinary read decides.
    (preadv2(file, &mut buf, offset, libc::RWF_NOWAIT).ok()? == want).then_some(buf)
}

/// The `want` bytes at `offset` that end the file, read with O_DIRECT into the returned
/// buffer: no page cache on the way. None when this file or filesystem cannot (then the
/// caller reads the ordinary way).
#[allow(unsafe_code)]
pub(crate) fn pread_direct(file: &File, offset: u64, want: usize) -> Option<std::io::Result<Bytes>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    const ALIGN: usize = 4096;
    if !offset.is_multiple_of(ALIGN as u64) {
        return None;
    }
    // A second open file description of the same inode: the flag must not change the one
    // other readers share.
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()?;
    let len = want.div_ceil(ALIGN) * ALIGN;
    // Not zeroed: the kernel fills what is kept (zeroing 128 KiB costs as much as the
    // page-cache copy this saves).
    let mut buf: Vec<u8> = Vec::with_capacity(len + ALIGN);
    let start = buf.as_ptr().align_offset(ALIGN);
    let mut got = 0;
    while got < want {
        let off = libc::off_t::try_from(offset + got as u64).ok()?;
        // SAFETY: `start + len` ≤ the capacity, so the range written is inside the
        // allocation, which lives for the call; the descriptor is `direct`'s.
        let n = unsafe {
            libc::pread(
                direct.as_raw_fd(),
                buf.as_mut_ptr().add(start + got).cast(),
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
        if n == 0 || !got.is_multiple_of(ALIGN) {
            break;
        }
    }
    let got = got.min(want);
    // SAFETY: the bytes before `start` are zeroed here and the `got` after it were
    // written by the kernel, so every byte up to the new length is initialised.
    unsafe {
        std::ptr::write_bytes(buf.as_mut_ptr(), 0, start);
        buf.set_len(start + got);
    }
    Some(Ok(Bytes::from(buf).slice(start..)))
}

/// Up to `size` bytes at `offset`, short only at the end of the file.
pub(crate) fn pread(file: &File, offset: u64, size: u32) -> std::io::Result<Vec<u8>> {
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
