//! Reads a file system starts ahead of the request that will want them (Locus addition):
//! a LOOKUP of a small file is followed by its READ a few dozen microseconds later, and
//! the read of the file's bytes can start with the LOOKUP's answer instead of with the
//! READ. The read goes on the queue's own ring, submitted with the queue's next wait (no
//! system call of its own), into a buffer of its own; the READ, on whichever queue it
//! comes (its reader may have woken on another CPU), takes the bytes from there, or waits
//! for the read without a thread: its completion answers it (through the READ's queue's
//! thread when that is another).
//!
//! Per queue at most `MAX` reads ahead are kept; one not taken within `STALE` is dropped
//! and counted (`unused`), so a file system can stop reading ahead when lookups are not
//! followed by reads (a walk that only stats files). A buffer lives until its read has
//! completed, whatever becomes of its request: the queue's thread does not end before.

use std::alloc::Layout;
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, types::Fd};
use log::warn;
use parking_lot::Mutex;

use super::{ON_QUEUE, Queue, RingReply};

/// Marks the completion of a read ahead: the rest of its `user_data` is its key.
pub(super) const PREFETCH: u64 = 1 << 59;
/// Reads ahead one queue keeps at once.
const MAX: usize = 8;
/// The largest read ahead.
pub const MAX_LEN: usize = 260 << 10;
/// A read ahead nobody took within this long is dropped.
const STALE: Duration = Duration::from_secs(1);

/// Reads ahead dropped untaken, on every queue of the process.
static UNUSED: AtomicU64 = AtomicU64::new(0);
/// Reads ahead a request took.
static USED: AtomicU64 = AtomicU64::new(0);
/// Reads ahead started.
static STARTED: AtomicU64 = AtomicU64::new(0);

/// (started, taken, dropped untaken) reads ahead so far, on every queue of the process.
pub fn counts() -> (u64, u64, u64) {
    (
        STARTED.load(Ordering::Relaxed),
        USED.load(Ordering::Relaxed),
        UNUSED.load(Ordering::Relaxed),
    )
}

/// What answers the request that took a read ahead: its outcome (the bytes read) and the
/// entry's payload; gives the bytes of the reply at the payload's start, or an errno.
pub(crate) type TakeDone = Box<dyn FnOnce(io::Result<&[u8]>, &mut [u8]) -> Result<usize, i32> + Send>;

struct Buf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is owned memory; the kernel's write into it is over before anyone
// reads it (`Ahead::res`).
unsafe impl Send for Buf {}

impl Buf {
    fn new(len: usize) -> Option<Buf> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: a layout of non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        (!ptr.is_null()).then_some(Buf { ptr, layout })
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout; no read is in flight into it (see `Ahead`).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

struct Waiting {
    reply: RingReply,
    unique: u64,
    want: usize,
    done: TakeDone,
}

/// One read ahead. Dropped only once `res` is set: the kernel writes `buf` until then.
struct Ahead {
    buf: Buf,
    res: Option<i32>,
    started: Instant,
    waiting: Option<Waiting>,
    /// The queue whose ring reads it (its address): that queue's thread ends only after.
    queue: usize,
    _keep: Box<dyn std::any::Any + Send>,
}

/// Every queue's reads ahead, by key. One table for the process, so that a READ finds
/// its file's read ahead whichever queue started it; `start` scans it (at most `MAX` per
/// queue), which is cheap at a few queues and wants sharding at hundreds.
static AHEAD: std::sync::LazyLock<Mutex<HashMap<u64, Ahead>>> =
    std::sync::LazyLock::new(|| Mutex::new(HashMap::new()));
/// How many `AHEAD` holds, written under its lock: a READ of a mount that reads nothing
/// ahead (large files, `/dev/fuse`, the gate closed) asks without taking it.
static KEPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether this thread is an io_uring queue's, where `start` can start a read ahead.
pub fn possible() -> bool {
    ON_QUEUE.get() != 0
}

/// Starts reading `len` bytes of `fd` at `offset` (O_DIRECT alignment is the caller's)
/// under `key`, on the ring of the queue whose thread this is, submitted with its next
/// wait; `keep` keeps `fd` open until the read has completed. False when this is no
/// queue's thread, a read under `key` is kept already, `len` is past `MAX_LEN`, or the
/// queue keeps as many as it may, none of them done.
pub fn start(fd: RawFd, offset: u64, len: usize, key: u64, keep: Box<dyn std::any::Any + Send>) -> bool {
    let q = ON_QUEUE.get();
    if q == 0 || len > MAX_LEN || key >= PREFETCH || u32::try_from(len).is_err() {
        return false;
    }
    // SAFETY: set by this thread to its queue, which its thread holds while it serves.
    let queue = unsafe { &*(q as *const Queue) };
    let mut a = AHEAD.lock();
    if a.contains_key(&key) {
        return false;
    }
    let before = a.len();
    a.retain(|_, x| x.res.is_none() || x.waiting.is_some() || x.started.elapsed() < STALE);
    let mut dropped = (before - a.len()) as u64;
    if a.values().filter(|x| x.queue == q).count() >= MAX {
        let oldest = a
            .iter()
            .filter(|(_, x)| x.queue == q && x.res.is_some() && x.waiting.is_none())
            .min_by_key(|(_, x)| x.started)
            .map(|(k, _)| *k);
        match oldest {
            Some(k) => {
                a.remove(&k);
                dropped += 1;
            }
            None => {
                UNUSED.fetch_add(dropped, Ordering::Relaxed);
                KEPT.store(a.len(), Ordering::Relaxed);
                return false;
            }
        }
    }
    UNUSED.fetch_add(dropped, Ordering::Relaxed);
    KEPT.store(a.len(), Ordering::Relaxed);
    let Some(buf) = Buf::new(len) else {
        return false;
    };
    let sqe = opcode::Read::new(Fd(fd), buf.ptr, len as u32)
        .offset(offset)
        .build()
        .user_data(PREFETCH | key);
    if let Err(e) = queue.push(&sqe.into()) {
        warn!("queue {}: a read ahead: {e}", queue.qid);
        return false;
    }
    STARTED.fetch_add(1, Ordering::Relaxed);
    a.insert(
        key,
        Ahead {
            buf,
            res: None,
            started: Instant::now(),
            waiting: None,
            queue: q,
            _keep: keep,
        },
    );
    KEPT.store(a.len(), Ordering::Relaxed);
    true
}

/// Whether a read ahead under `key` is kept, and not yet taken.
pub(crate) fn kept(key: u64) -> bool {
    KEPT.load(Ordering::Relaxed) > 0 && AHEAD.lock().get(&key).is_some_and(|x| x.waiting.is_none())
}

/// The read ahead under `key` (`kept`) answers the request of `reply` with `want` bytes
/// at most, now if it has completed, else when it does.
pub(crate) fn take(key: u64, reply: RingReply, unique: u64, want: usize, done: TakeDone) {
    let waiting = Waiting {
        reply,
        unique,
        want,
        done,
    };
    let ready = {
        let mut a = AHEAD.lock();
        match a.get_mut(&key) {
            Some(x) if x.waiting.is_none() => {
                USED.fetch_add(1, Ordering::Relaxed);
                x.waiting = Some(waiting);
                let done = if x.res.is_some() { a.remove(&key) } else { None };
                KEPT.store(a.len(), Ordering::Relaxed);
                done
            }
            // Taken or dropped since `kept`: answered as a failed read, which the
            // caller's `done` turns into the ordinary read.
            _ => {
                drop(a);
                return answer_with(waiting, Err(io::Error::from_raw_os_error(libc::EAGAIN)));
            }
        }
    };
    if let Some(x) = ready {
        answer(x);
    }
}

/// The read ahead under `key` completed with `res`.
pub(super) fn completed(key: u64, res: i32) {
    let ready = {
        let mut a = AHEAD.lock();
        let Some(x) = a.get_mut(&key) else { return };
        x.res = Some(res);
        let done = if x.waiting.is_some() { a.remove(&key) } else { None };
        KEPT.store(a.len(), Ordering::Relaxed);
        done
    };
    if let Some(x) = ready {
        answer(x);
    }
}

/// Whether a read ahead of this thread's queue is still in flight (its buffer must live).
pub(super) fn in_flight() -> bool {
    let q = ON_QUEUE.get();
    AHEAD.lock().values().any(|x| x.queue == q && x.res.is_none())
}

fn answer(x: Ahead) {
    let (Some(res), Some(w)) = (x.res, x.waiting) else {
        return;
    };
    let got = if res >= 0 {
        // SAFETY: the kernel wrote `res` bytes from the buffer's start before completing.
        Ok(unsafe { std::slice::from_raw_parts(x.buf.ptr as *const u8, res as usize) })
    } else {
        Err(io::Error::from_raw_os_error(-res))
    };
    answer_with(w, got);
}

fn answer_with(w: Waiting, got: io::Result<&[u8]>) {
    // SAFETY: this request's reply, committed below, drops the slice first.
    let (error, n) = match unsafe { w.reply.payload(w.want) } {
        Some(payload) => match (w.done)(got, payload) {
            Ok(n) => (0, n.min(w.want)),
            Err(e) => (-e, 0),
        },
        None => (-libc::EIO, 0),
    };
    if let Err(e) = w.reply.commit_in_place(w.unique, error, n) {
        warn!("a reply from a read ahead: {e}");
    }
}
