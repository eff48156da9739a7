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
//!
//! What it costs at scale: a LOOKUP that starts one takes one shard's lock of `SHARDS`
//! (and, once its queue keeps `MAX`, the shards of its own up to `MAX`), a READ takes
//! its file's shard's lock only when that shard holds anything; nothing scans other
//! queues' reads ahead, so a host with hundreds of queues pays what one with two does.

use std::alloc::Layout;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
    waiting: Option<Waiting>,
    /// The queue whose ring reads it (its address).
    queue: usize,
    _keep: Box<dyn std::any::Any + Send>,
}

/// Shards of the table of reads ahead: a power of two. A READ finds its file's read ahead
/// whichever queue started it, so the table is the process's; its shards keep a host with
/// hundreds of queues from meeting on one lock.
const SHARDS: usize = 64;

/// A part of the table, alone on its cache lines.
#[repr(align(128))]
struct Shard {
    map: Mutex<HashMap<u64, Ahead>>,
    /// How many `map` holds, written under its lock: a READ of a mount that reads nothing
    /// ahead (large files, `/dev/fuse`, the gate closed) asks without taking it.
    len: AtomicUsize,
}

static TABLE: std::sync::LazyLock<Vec<Shard>> = std::sync::LazyLock::new(|| {
    (0..SHARDS)
        .map(|_| Shard {
            map: Mutex::new(HashMap::new()),
            len: AtomicUsize::new(0),
        })
        .collect()
});

fn shard(key: u64) -> &'static Shard {
    // Keys are inode numbers, often consecutive: Fibonacci hashing spreads them.
    &TABLE[(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARDS.trailing_zeros())) as usize]
}

thread_local! {
    /// The keys this thread's queue started reads ahead under, oldest first, with when:
    /// only the queue's thread starts them, so its bound (`MAX`) and its stale ones are
    /// found here, without a look at any other queue's.
    static MINE: RefCell<VecDeque<(u64, Instant)>> = const { RefCell::new(VecDeque::new()) };
    /// Reads ahead in flight on this thread's queue (their buffers must live): they
    /// complete on this queue's ring, so on this thread.
    static IN_FLIGHT: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is an io_uring queue's, where `start` can start a read ahead.
pub fn possible() -> bool {
    ON_QUEUE.get() != 0
}

/// Settles the reads ahead queue `q` started (`mine`): forgets those taken meanwhile and
/// drops its own not taken within `STALE`; for `room`, also its oldest that completed
/// untaken when it keeps `MAX`. Gives whether it keeps fewer than `MAX`.
fn settle(mine: &mut VecDeque<(u64, Instant)>, q: usize, now: Instant, room: bool) -> bool {
    let mut dropped = 0;
    // Drops the read ahead under `key` if it is this queue's, done, not taken, and
    // `drop_it`; gives whether `mine` is to forget it.
    let mut forget = |key: u64, drop_it: bool| -> bool {
        let s = shard(key);
        let mut m = s.map.lock();
        match m.get(&key) {
            // Taken and answered, or started again since by another queue.
            None => true,
            Some(x) if x.queue != q => true,
            Some(x) if drop_it && x.res.is_some() && x.waiting.is_none() => {
                m.remove(&key);
                s.len.store(m.len(), Ordering::Relaxed);
                dropped += 1;
                true
            }
            Some(_) => false,
        }
    };
    mine.retain(|&(key, at)| !forget(key, now.duration_since(at) >= STALE));
    if room && mine.len() >= MAX {
        if let Some(i) = mine.iter().position(|&(key, _)| forget(key, true)) {
            mine.remove(i);
        }
    }
    UNUSED.fetch_add(dropped, Ordering::Relaxed);
    mine.len() < MAX
}

/// Before this queue's thread waits: its reads ahead not taken within `STALE` are
/// dropped, and while it keeps any that may yet go stale, how long it may wait before it
/// looks again, so an idle queue does not hold their buffers. A stale one still kept is
/// in flight (or a READ waits on it): its completion on this queue's ring wakes the
/// thread, so it sets no timer (on a slow disk it would wake the thread every few
/// milliseconds until the read completes).
pub(super) fn before_wait() -> Option<Duration> {
    let q = ON_QUEUE.get();
    MINE.with(|m| {
        let mut m = m.borrow_mut();
        let oldest = m.front()?.1;
        let now = Instant::now();
        if now.duration_since(oldest) >= STALE {
            settle(&mut m, q, now, false);
        }
        let age = m
            .iter()
            .map(|&(_, at)| now.duration_since(at))
            .find(|&age| age < STALE)?;
        Some((STALE - age).max(Duration::from_millis(1)))
    })
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
    let s = shard(key);
    if s.len.load(Ordering::Relaxed) > 0 && s.map.lock().contains_key(&key) {
        return false;
    }
    let now = Instant::now();
    if !MINE.with(|m| settle(&mut m.borrow_mut(), q, now, true)) {
        return false;
    }
    // Looked for again under the shard's lock, held until the entry is in: LOOKUPs of one
    // file on two CPUs must not both start one, or the second entry would replace the
    // first and free its buffer while the first's read still writes into it.
    let mut m = s.map.lock();
    if m.contains_key(&key) {
        return false;
    }
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
    // Its completion comes on this thread's ring, so after this.
    m.insert(
        key,
        Ahead {
            buf,
            res: None,
            waiting: None,
            queue: q,
            _keep: keep,
        },
    );
    s.len.store(m.len(), Ordering::Relaxed);
    drop(m);
    IN_FLIGHT.set(IN_FLIGHT.get() + 1);
    MINE.with(|m| m.borrow_mut().push_back((key, now)));
    STARTED.fetch_add(1, Ordering::Relaxed);
    true
}

/// The read ahead under `key`, kept and not yet taken, answers the request of `reply`
/// with `want` bytes at most: now if it has completed, else when it does. Without one
/// the reply comes back untouched.
pub(crate) fn take(
    key: u64,
    reply: RingReply,
    unique: u64,
    want: usize,
    done: TakeDone,
) -> Result<(), RingReply> {
    let s = shard(key);
    if s.len.load(Ordering::Relaxed) == 0 {
        return Err(reply);
    }
    let ready = {
        let mut m = s.map.lock();
        let Some(x) = m.get_mut(&key).filter(|x| x.waiting.is_none()) else {
            return Err(reply);
        };
        USED.fetch_add(1, Ordering::Relaxed);
        x.waiting = Some(Waiting {
            reply,
            unique,
            want,
            done,
        });
        if x.res.is_some() {
            let a = m.remove(&key);
            s.len.store(m.len(), Ordering::Relaxed);
            a
        } else {
            None
        }
    };
    if let Some(x) = ready {
        answer(x);
    }
    Ok(())
}

/// The read ahead under `key` completed with `res`, on this thread's queue's ring.
pub(super) fn completed(key: u64, res: i32) {
    IN_FLIGHT.set(IN_FLIGHT.get().saturating_sub(1));
    let s = shard(key);
    let ready = {
        let mut m = s.map.lock();
        let Some(x) = m.get_mut(&key) else { return };
        x.res = Some(res);
        if x.waiting.is_some() {
            let a = m.remove(&key);
            s.len.store(m.len(), Ordering::Relaxed);
            a
        } else {
            None
        }
    };
    if let Some(x) = ready {
        answer(x);
    }
}

/// Whether a read ahead of this thread's queue is still in flight (its buffer must live).
pub(super) fn in_flight() -> bool {
    IN_FLIGHT.get() > 0
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
