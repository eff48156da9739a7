//! FUSE over io_uring (Linux 6.14+; Locus addition, see vendor/README.md).
//!
//! Once INIT has negotiated `FUSE_OVER_IO_URING`, the kernel sends each request to the
//! queue of the CPU its caller runs on. A queue here is one thread pinned to that CPU with
//! its own ring and `depth` entries; an entry is a header page and a payload buffer that
//! the kernel fills with a request. The thread answers an entry with one
//! `COMMIT_AND_FETCH` command, which hands the kernel the reply and the entry back for
//! the next request: one `io_uring_enter` per request instead of a `read` and a `writev`,
//! and no wake-up on another CPU.
//!
//! `/dev/fuse` stays in use beside the rings: the kernel still sends FORGET and INTERRUPT
//! there, and notifications (and the passthrough ioctls) go through the descriptor.
//!
//! The kernel writes a request as three pieces (the `fuse_in_header`, the operation's
//! fixed argument in `op_in`, the rest in the payload). The entry's header page is laid
//! out so that the first two can be copied in front of the payload, which makes the
//! request one contiguous slice in the layout a `/dev/fuse` read gives; only the
//! (at most 168-byte) headers are copied.
//!
//! The entries' memory outlives the server that registered them, so that the next server
//! of the same connection (see `RingMemory`) can answer what a dead one held: the kernel
//! finds a request by its id on COMMIT_AND_FETCH from any ring, and reads the reply from
//! the addresses the entry was registered with, in whichever process commits. So the
//! memory is a memfd the mount's holder keeps, mapped at the same address in each server;
//! each entry's header page also keeps a copy of the request being answered (`keep`),
//! since a reply overwrites the kernel's copy.
//!
//! The queues stay in one file (past 700 lines) on purpose: the entries, the commands
//! that point into them and the thread that owns each are one set of `unsafe` rules, kept
//! in one place. The memory under them (`uring/memory.rs`) and what a server taking over
//! reads from it (`uring/held.rs`) sit beside it; a move to a newer fuser carries the three
//! over whole (vendor/README.md).

use std::cell::Cell;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types::Fd;
use log::debug;
use log::warn;
use parking_lot::Mutex;

use crate::Filesystem;
use crate::channel::ChannelSender;
use crate::ll::Operation;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

mod held;
mod memory;
pub mod prefetch;

use held::Held;
pub use memory::RingLayout;
use memory::RingMemory;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: `in_out[128]`, `op_in[128]`, `fuse_uring_ent_in_out`.
const HEADER_LEN: usize = 288;
const OP_IN: usize = 128;
const OP_IN_LEN: usize = 128;
const ENT_IN_OUT: usize = 256;
const IN_HEADER_LEN: usize = 40;
const OUT_HEADER_LEN: usize = 16;
/// Each entry's header page; the request is rebuilt at its end, before the payload.
const PAGE: usize = 4096;
/// Marks the completion of a read of a file that an entry's request started
/// (`RingReply::read`), not of a FUSE command: the rest of its `user_data` is the slot.
const FILE_READ: u64 = 1 << 63;
/// Marks the completion of the queue thread's poll of its wake-up eventfd.
const WAKE: u64 = 1 << 62;
/// Marks the end of the wait before a held request whose entry a dead server was reading
/// a file into is answered again (see `serve_queue`).
const RECOVER: u64 = 1 << 61;
/// Marks a request that reached a frozen queue and waits there, if the queue thaws
/// (`RingControl::thaw`), to be served.
const STASHED: u64 = 1 << 60;
/// How long a frozen server that nobody has stopped waits before it serves again: its
/// holder kills it within seconds of a freeze, unless the holder itself is gone.
const THAW_AFTER: std::time::Duration = std::time::Duration::from_secs(15);
/// How long a held request whose entry was being read into waits before it is answered
/// again: the dead server's ring ends only once its reads have completed, which must not
/// land in a reply of the next server.
const READ_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// What answers a request once the read of a file it started has completed: the read's
/// outcome and the entry's payload, which holds what was read; gives the bytes of the
/// reply at the payload's start, or an errno.
pub(crate) type ReadDone = Box<dyn FnOnce(io::Result<usize>, &mut [u8]) -> Result<usize, i32> + Send>;

/// A read of a file in flight for an entry, on its queue's ring.
struct FileRead {
    reply: RingReply,
    unique: u64,
    len: usize,
    done: ReadDone,
}

/// Whether this process may create an io_uring with 128-byte entries (the kernel can
/// forbid it: `kernel.io_uring_disabled`, seccomp). Asked before INIT is answered,
/// because once INIT negotiates io_uring the kernel holds every request until the rings
/// are registered.
pub(crate) fn available() -> io::Result<()> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .build(2)
        .map(drop)
}

/// The number of queues the kernel expects: one per possible CPU
/// (`num_possible_cpus()`), every one registered before the ring is used.
fn possible_cpus() -> usize {
    let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/possible") else {
        return std::thread::available_parallelism().map_or(1, |n| n.get());
    };
    s.trim()
        .split(',')
        .filter_map(|r| match r.split_once('-') {
            Some((a, b)) => Some(b.parse::<usize>().ok()? - a.parse::<usize>().ok()? + 1),
            None => r.parse::<usize>().ok().map(|_| 1),
        })
        .sum::<usize>()
        .max(1)
}

/// One queue's ring and entries, shared by its thread and by whoever answers one of its
/// requests later (a reply sent from another thread commits through the same ring).
struct Queue {
    qid: u16,
    dev: RawFd,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Serializes pushes to the submission queue (the queue's thread and repliers), and
    /// lists what was pushed and not yet taken by the kernel, in order: whether each is
    /// an entry's command (see `consumed`).
    sq: Mutex<std::collections::VecDeque<bool>>,
    /// Set by `RingControl::freeze`: nothing more is submitted.
    control: Arc<RingControl>,
    /// Holds the entries' memory mapped while the queue lives.
    _memory: Arc<RingMemory>,
    payload_cap: usize,
    /// Per entry: the iovecs (header page, payload) the REGISTER command points at.
    iovs: Vec<[libc::iovec; 2]>,
    /// Written by a thread that answered a request elsewhere, to wake the queue's thread
    /// to submit the answer (see `fetch_next`).
    wake: std::os::fd::OwnedFd,
}

// SAFETY: the ring's submission side is only touched under `sq`, its completion side only
// by the queue's thread; an entry's memory belongs to whoever holds its request (the
// kernel until a completion, then exactly one reply).
unsafe impl Send for Queue {}
unsafe impl Sync for Queue {}

thread_local! {
    /// The queue whose thread this is (its address), or 0: a reply sent on the queue's
    /// own thread is submitted with its next wait, one sent elsewhere wakes it to submit.
    static ON_QUEUE: Cell<usize> = const { Cell::new(0) };
    /// Reads of files in flight on this thread's queue, by entry.
    static FILE_READS: RefCell<HashMap<usize, FileRead>> = RefCell::new(HashMap::new());
}

impl Queue {
    fn new(qid: u16, dev: RawFd, memory: Arc<RingMemory>, control: Arc<RingControl>) -> io::Result<Queue> {
        let depth = memory.layout.depth;
        // Room for a command per entry and the wake-up poll.
        let entries = (u32::from(depth) + 1).next_power_of_two();
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(entries * 2)
            .build(entries)?;
        let payload_cap = memory.layout.payload_cap as usize;
        let stride = PAGE + payload_cap;
        let mem = memory.queue_base(usize::from(qid));
        let iovs = (0..usize::from(depth))
            .map(|i| {
                // SAFETY: within the mapping.
                let base = unsafe { mem.add(i * stride) };
                [
                    libc::iovec {
                        iov_base: base.cast(),
                        iov_len: HEADER_LEN,
                    },
                    libc::iovec {
                        iov_base: unsafe { base.add(PAGE) }.cast(),
                        iov_len: payload_cap,
                    },
                ]
            })
            .collect();
        // SAFETY: eventfd(2) with valid flags; the descriptor is owned from here on.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let wake = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake) };
        Ok(Queue {
            qid,
            dev,
            ring,
            sq: Mutex::new(std::collections::VecDeque::new()),
            control,
            _memory: memory,
            payload_cap,
            iovs,
            wake,
        })
    }

    fn header(&self, slot: usize) -> *mut u8 {
        self.iovs[slot][0].iov_base.cast()
    }

    fn payload(&self, slot: usize) -> *mut u8 {
        self.iovs[slot][1].iov_base.cast()
    }

    /// A FUSE ring command for entry `slot` (an SQE128: the command goes in its 80-byte
    /// area, the iovec array in `addr`, its length, 2, in `len`).
    fn command(&self, cmd_op: u32, slot: usize, commit_id: u64) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 pad[6]; }
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        let sqe = opcode::UringCmd80::new(Fd(self.dev), cmd_op)
            .cmd(cmd)
            .addr(Some(self.iovs[slot].as_ptr() as u64))
            .build()
            .user_data(slot as u64);
        // The crate has no setter for `len` on a command (offset 24 of the SQE, a u32).
        // SAFETY: `Entry128` is `repr(C)`, 128 bytes: an `io_uring_sqe` and its extension.
        let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
        unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
    }

    fn push(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        self.push_as(sqe, false)
    }

    /// Pushes an entry's command (REGISTER, COMMIT_AND_FETCH).
    fn push_command(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        self.push_as(sqe, true)
    }

    fn push_as(&self, sqe: &squeue::Entry128, command: bool) -> io::Result<()> {
        let mut log = self.sq.lock();
        // SAFETY: the lock makes this the only submission-queue handle alive.
        let mut sq = unsafe { self.ring.submission_shared() };
        // Never full: each entry has at most one command waiting to be submitted, and
        // the queue has room for every entry.
        unsafe { sq.push(sqe) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
        log.push_back(command);
        Ok(())
    }

    /// How many entries' commands were among the `n` submissions the kernel just took
    /// (it takes them in the order they were pushed).
    fn consumed(&self, n: usize) -> usize {
        let mut log = self.sq.lock();
        let n = n.min(log.len());
        log.drain(..n).filter(|&c| c).count()
    }

    /// Answers the request in `slot`: the reply into the entry, then COMMIT_AND_FETCH.
    fn commit(self: &Arc<Self>, slot: usize, commit_id: u64, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let header = self.header(slot);
        let payload = self.payload(slot);
        let result = if total < OUT_HEADER_LEN || total - OUT_HEADER_LEN > self.payload_cap {
            // Cannot happen with fuser's replies; answer EIO rather than leave the
            // caller waiting.
            let mut h = [0u8; OUT_HEADER_LEN];
            h[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_ne_bytes());
            h[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            h[8..16].copy_from_slice(&commit_id.to_ne_bytes());
            // SAFETY: the entry is ours until committed; 16 bytes fit its header.
            unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), header, OUT_HEADER_LEN) };
            self.set_payload_len(slot, 0);
            Err(io::Error::other(format!(
                "reply of {total} bytes does not fit the ring entry"
            )))
        } else {
            let mut at = 0usize;
            for b in bufs {
                let mut src: &[u8] = b;
                if at < OUT_HEADER_LEN {
                    let n = src.len().min(OUT_HEADER_LEN - at);
                    // SAFETY: within the header's in_out area.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), header.add(at), n) };
                    at += n;
                    src = &src[n..];
                }
                if !src.is_empty() {
                    let off = at - OUT_HEADER_LEN;
                    // SAFETY: `total - 16 <= payload_cap` was checked.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), payload.add(off), src.len()) };
                    at += src.len();
                }
            }
            self.set_payload_len(slot, (total - OUT_HEADER_LEN) as u32);
            Ok(())
        };
        self.fetch_next(slot, commit_id)?;
        result
    }

    /// Answers the request in `slot` with the `n` bytes already in its payload (or with
    /// `-error` and none): only the 16-byte out header is written.
    fn commit_in_place(
        self: &Arc<Self>,
        slot: usize,
        commit_id: u64,
        unique: u64,
        error: i32,
        n: usize,
    ) -> io::Result<()> {
        let n = if error == 0 { n.min(self.payload_cap) } else { 0 };
        let mut h = [0u8; OUT_HEADER_LEN];
        h[0..4].copy_from_slice(&((OUT_HEADER_LEN + n) as u32).to_ne_bytes());
        h[4..8].copy_from_slice(&error.to_ne_bytes());
        h[8..16].copy_from_slice(&unique.to_ne_bytes());
        // SAFETY: the entry is ours until committed; 16 bytes fit its header.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), self.header(slot), OUT_HEADER_LEN) };
        self.set_payload_len(slot, n as u32);
        self.fetch_next(slot, commit_id)
    }

    /// Hands the entry back with COMMIT_AND_FETCH, always submitted by the queue's own
    /// thread: with its next wait when this is that thread; from any other, the command is
    /// queued and that thread woken to submit it.
    ///
    /// Why never from another thread: the kernel completes a ring command on the task
    /// that submitted it. A command submitted by a blocking-pool thread tied the entry's
    /// next request to that thread, which was woken only to pass it on to this queue's
    /// thread; and once that thread had ended (a pool thread idle for a few seconds
    /// does), the next request on the entry failed its reader with ECANCELED and the entry
    /// was lost to the queue.
    fn fetch_next(self: &Arc<Self>, slot: usize, commit_id: u64) -> io::Result<()> {
        // The answer is whole in the entry: a server taking over sends it again rather
        // than run the request again (see `held`).
        self.replied(slot);
        self.push_command(&self.command(CMD_COMMIT_AND_FETCH, slot, commit_id))?;
        if ON_QUEUE.get() != Arc::as_ptr(self) as usize {
            self.wake_thread()?;
        }
        Ok(())
    }

    fn wake_thread(&self) -> io::Result<()> {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write from a local to the queue's own eventfd.
        let n = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            // EAGAIN: the counter is at its maximum, so the thread is being woken anyway.
            if e.raw_os_error() != Some(libc::EAGAIN) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Polls the wake-up eventfd (multishot: one completion per wake-up, armed until it
    /// ends); the queue's thread arms it.
    fn arm_wake(&self) -> io::Result<()> {
        let sqe = opcode::PollAdd::new(Fd(self.wake.as_raw_fd()), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(WAKE);
        self.push(&sqe.into())
    }

    /// Empties the wake-up counter, so the next write wakes the thread again.
    fn drain_wake(&self) {
        let mut b = [0u8; 8];
        // SAFETY: an 8-byte read into a local from the queue's own eventfd.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) };
    }

    /// Answers the request in `slot` with EIO (one the parser could not read).
    fn refuse(self: &Arc<Self>, slot: usize, commit_id: u64) {
        let _ = self.commit(slot, commit_id, &[]);
    }

    fn set_payload_len(&self, slot: usize, n: u32) {
        // SAFETY: `fuse_uring_ent_in_out.payload_sz` at offset 16 of its struct.
        unsafe {
            std::ptr::write_unaligned(self.header(slot).add(ENT_IN_OUT + 16).cast::<u32>(), n);
        }
    }

    /// The request the kernel put in `slot`, rebuilt as one slice (see the module's
    /// notes), and its commit id.
    #[allow(clippy::type_complexity)]
    fn request(&self, slot: usize, scratch: &mut Vec<u8>) -> Result<(*const u8, usize, u64, bool), u64> {
        let header = self.header(slot);
        // SAFETY: the kernel wrote the entry's header before completing its command.
        let (len, payload_sz, commit_id) = unsafe {
            (
                std::ptr::read_unaligned(header.cast::<u32>()) as usize,
                std::ptr::read_unaligned(header.add(ENT_IN_OUT + 16).cast::<u32>()) as usize,
                std::ptr::read_unaligned(header.add(ENT_IN_OUT + 8).cast::<u64>()),
            )
        };
        let op_len = len.checked_sub(IN_HEADER_LEN + payload_sz).ok_or(commit_id)?;
        if op_len > OP_IN_LEN || payload_sz > self.payload_cap {
            return Err(commit_id);
        }
        let start = PAGE - IN_HEADER_LEN - op_len;
        if start % 8 == 0 {
            // SAFETY: `start..PAGE` lies in the header page past the kernel's header
            // (288 bytes); the payload follows at PAGE.
            unsafe {
                std::ptr::copy_nonoverlapping(header, header.add(start), IN_HEADER_LEN);
                std::ptr::copy_nonoverlapping(header.add(OP_IN), header.add(start + IN_HEADER_LEN), op_len);
                Ok((header.add(start).cast_const(), len, commit_id, payload_sz == 0))
            }
        } else {
            // An operation header of odd size: rebuilt in an aligned copy instead.
            scratch.clear();
            scratch.resize(len + 8, 0);
            let off = scratch.as_ptr().align_offset(8);
            unsafe {
                let dst = scratch.as_mut_ptr().add(off);
                std::ptr::copy_nonoverlapping(header, dst, IN_HEADER_LEN);
                std::ptr::copy_nonoverlapping(header.add(OP_IN), dst.add(IN_HEADER_LEN), op_len);
                std::ptr::copy_nonoverlapping(
                    self.payload(slot),
                    dst.add(IN_HEADER_LEN + op_len),
                    payload_sz,
                );
                Ok((dst.cast_const(), len, commit_id, true))
            }
        }
    }
}

/// A reply's way back through a ring entry (see `ReplySender::Ring`).
#[derive(Clone)]
pub(crate) struct RingReply {
    queue: Arc<Queue>,
    slot: usize,
    commit_id: u64,
    /// The request came with no payload (a READ does not), so the reply may be written
    /// into the payload buffer while the request is still borrowed.
    payload_free: bool,
    /// The `/dev/fuse` descriptor, for the passthrough ioctls a reply may need.
    pub(crate) dev: ChannelSender,
}

impl std::fmt::Debug for RingReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RingReply(q{} e{} #{})",
            self.queue.qid, self.slot, self.commit_id
        )
    }
}

impl RingReply {
    pub(crate) fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        self.queue.commit(self.slot, self.commit_id, bufs)
    }

    /// The entry's payload buffer, `len` bytes of it starting on a page boundary, for a
    /// reply written in place (`ReplyData::fill`); None when the request's own bytes are
    /// there or `len` does not fit.
    ///
    /// # Safety
    /// Only the one reply that will commit this entry may call it, once, and must not
    /// keep the slice past `commit_in_place`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn payload(&self, len: usize) -> Option<&mut [u8]> {
        if !self.payload_free || len > self.queue.payload_cap {
            return None;
        }
        // SAFETY: the mapping is initialised memory that lives as long as the queue, the
        // entry belongs to this reply until it commits (the caller's promise).
        Some(unsafe { std::slice::from_raw_parts_mut(self.queue.payload(self.slot), len) })
    }

    /// Commits a reply written by way of `payload`: `n` bytes, or `-error` with none.
    pub(crate) fn commit_in_place(&self, unique: u64, error: i32, n: usize) -> io::Result<()> {
        self.queue
            .commit_in_place(self.slot, self.commit_id, unique, error, n)
    }

    /// Whether `read` may take this reply: on its queue's own thread, for a request
    /// whose payload buffer is free and holds `len` bytes.
    pub(crate) fn can_read(&self, len: usize) -> bool {
        ON_QUEUE.get() == Arc::as_ptr(&self.queue) as usize
            && self.payload_free
            && len <= self.queue.payload_cap
            && u32::try_from(len).is_ok()
    }

    /// Reads `len` bytes of the file `fd` at `offset` into the entry's payload by this
    /// queue's own ring, and answers the request with what `done` makes of them when the
    /// read completes (on this thread). The request waits for the disk with no thread
    /// of its own and no wake-up elsewhere: one completion, then one commit. `fd` must
    /// stay open until then (`done` can own what keeps it open). Only after `can_read`.
    pub(crate) fn read(self, fd: RawFd, offset: u64, len: usize, unique: u64, done: ReadDone) {
        let sqe = opcode::Read::new(Fd(fd), self.queue.payload(self.slot), len as u32)
            .offset(offset)
            .build()
            .user_data(FILE_READ | self.slot as u64);
        self.queue.set_reading(self.slot, true);
        if let Err(e) = self.queue.push(&sqe.into()) {
            self.queue.set_reading(self.slot, false);
            warn!("queue {} entry {}: {e}", self.queue.qid, self.slot);
            let _ = self.commit_in_place(unique, -libc::EIO, 0);
            return;
        }
        let slot = self.slot;
        FILE_READS.with(|r| {
            r.borrow_mut().insert(
                slot,
                FileRead {
                    reply: self,
                    unique,
                    len,
                    done,
                },
            )
        });
    }
}

/// Answers the request whose read of a file (`RingReply::read`) completed with `res`.
fn file_read_done(queue: &Queue, slot: usize, res: i32) {
    let Some(r) = FILE_READS.with(|r| r.borrow_mut().remove(&slot)) else {
        warn!(
            "queue {} entry {slot}: a read completed that no request started",
            queue.qid
        );
        return;
    };
    queue.set_reading(slot, false);
    let got = match res {
        n if n >= 0 => Ok(n as usize),
        e => Err(io::Error::from_raw_os_error(-e)),
    };
    // SAFETY: the kernel wrote the payload before completing the read; the entry belongs
    // to this request until the commit below, and nothing else holds the slice.
    let buf = unsafe { std::slice::from_raw_parts_mut(queue.payload(slot), r.len) };
    let (error, n) = match (r.done)(got, buf) {
        Ok(n) => (0, n.min(r.len)),
        Err(e) => (-e, 0),
    };
    if let Err(e) = r.reply.commit_in_place(r.unique, error, n) {
        warn!("queue {} entry {slot}: {e}", queue.qid);
    }
}

/// Stops a connection's queues before a planned restart, so that no request meets an
/// entry of a dying server (the kernel fails such a request with ECANCELED). Once frozen,
/// a queue submits and serves nothing more; each entry the kernel still holds free is
/// taken by the next request to arrive, which stays there for the next server to answer
/// (`held.rs`), and requests beyond those wait in the kernel's queue. When no queue has
/// a free entry left, `freeze`'s callback runs: the server may then be killed losing
/// nothing. Whoever freezes must make requests arrive on every CPU (a STATFS from a
/// thread pinned to each, `depth` of them), or idle queues keep free entries.
pub struct RingControl {
    frozen: std::sync::atomic::AtomicBool,
    queues: Mutex<Vec<std::sync::Weak<Queue>>>,
    total: usize,
    held: std::sync::atomic::AtomicUsize,
    on_held: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// At takeover: requests a previous server held unanswered, run again here, and
    /// answers it had written, sent again (see `serve_queue`).
    rerun: std::sync::atomic::AtomicUsize,
    resent: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for RingControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RingControl({} queues)", self.total)
    }
}

impl RingControl {
    /// Freezes every queue; `on_held` runs once none has a free entry left. A server
    /// still alive `THAW_AFTER` later (nobody came to kill it) thaws and serves what
    /// reached it meanwhile: frozen for good, its readers would wait until unmount.
    pub fn freeze(self: &Arc<Self>, on_held: impl FnOnce() + Send + 'static) {
        *self.on_held.lock() = Some(Box::new(on_held));
        self.held.store(0, std::sync::atomic::Ordering::SeqCst);
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake_all();
        let me = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("fuse-ring-thaw".into())
            .spawn(move || {
                std::thread::sleep(THAW_AFTER);
                if let Some(c) = me.upgrade() {
                    if c.is_frozen() {
                        warn!("the io_uring queues were frozen {THAW_AFTER:?} ago and nobody restarted this server: serving again");
                        c.frozen.store(false, std::sync::atomic::Ordering::SeqCst);
                        c.wake_all();
                    }
                }
            });
    }

    fn wake_all(&self) {
        for q in self.queues.lock().iter().filter_map(std::sync::Weak::upgrade) {
            if let Err(e) = q.wake_thread() {
                warn!("queue {}: cannot wake it: {e}", q.qid);
            }
        }
    }

    /// What this server did with the requests a previous one held in the queues:
    /// (run again, answers sent again). Final once the session has started.
    pub fn taken_over(&self) -> (usize, usize) {
        (
            self.rerun.load(std::sync::atomic::Ordering::SeqCst),
            self.resent.load(std::sync::atomic::Ordering::SeqCst),
        )
    }

    fn is_frozen(&self) -> bool {
        self.frozen.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn queue_held(&self) {
        let n = self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n == self.total {
            if let Some(f) = self.on_held.lock().take() {
                f();
            }
        }
    }
}

/// The running queues of one connection.
#[derive(Debug)]
pub(crate) struct Rings {
    threads: Vec<JoinHandle<()>>,
    memory: Option<Arc<RingMemory>>,
    control: Option<Arc<RingControl>>,
}

impl Rings {
    /// Registers `depth` entries on every queue, each served by its own thread through
    /// `se`'s filesystem. Returns once every queue has registered (or failed to: then
    /// the kernel goes back to `/dev/fuse` for this connection, and so does the error).
    ///
    /// With `adopt`, the memory a previous server of this connection registered its
    /// entries in: its entries are taken over, and the requests it held answered.
    pub(crate) fn start<FS: Filesystem + 'static>(
        se: impl Fn(usize) -> SessionEventLoop<FS>,
        dev: &ChannelSender,
        depth: u16,
        payload_cap: usize,
        adopt: Option<(std::os::fd::OwnedFd, RingLayout)>,
    ) -> (Rings, io::Result<()>) {
        let n = possible_cpus();
        let adopted = adopt.and_then(|(fd, layout)| {
            let fits = RingLayout::new(layout.addr as usize, n, depth, payload_cap) == layout;
            let m = if fits {
                RingMemory::adopt(fd, layout)
            } else {
                Err(io::Error::other(format!("its layout {layout:?} is not this server's")))
            };
            m.map_err(|e| {
                warn!("cannot take over the previous server's ring entries ({e}): the requests it held wait until unmount")
            })
            .ok()
        });
        let adopting = adopted.is_some();
        let memory = match adopted.map_or_else(|| RingMemory::create(n, depth, payload_cap), Ok) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                return (
                    Rings {
                        threads: Vec::new(),
                        memory: None,
                        control: None,
                    },
                    Err(e),
                );
            }
        };
        let control = Arc::new(RingControl {
            frozen: std::sync::atomic::AtomicBool::new(false),
            queues: Mutex::new(Vec::with_capacity(n)),
            total: n,
            held: std::sync::atomic::AtomicUsize::new(0),
            on_held: Mutex::new(None),
            rerun: std::sync::atomic::AtomicUsize::new(0),
            resent: std::sync::atomic::AtomicUsize::new(0),
        });
        let (tx, rx) = mpsc::channel::<io::Result<()>>();
        let mut threads = Vec::with_capacity(n);
        let mut first_err = None;
        for qid in 0..n {
            let se = se(qid);
            let dev = dev.clone();
            let tx = tx.clone();
            let (memory, control) = (memory.clone(), control.clone());
            match std::thread::Builder::new()
                .name(format!("fuse-ring-{qid}"))
                .spawn(move || serve_queue(qid as u16, se, dev, memory, control, adopting, tx))
            {
                Ok(t) => threads.push(t),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        drop(tx);
        // One answer per thread; a thread that could not start sends none.
        for r in rx.iter().take(threads.len()) {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        // Queues that did register when another failed are torn down by the kernel at
        // unmount, which ends their threads: whoever joins the session joins them.
        let rings = Rings {
            threads,
            memory: Some(memory),
            control: Some(control),
        };
        (rings, first_err.map_or(Ok(()), Err))
    }

    /// The entries' memory and where it is mapped, for the next server of this
    /// connection; None when it is private to this process.
    pub(crate) fn memory(&self) -> Option<(std::os::fd::BorrowedFd<'_>, RingLayout)> {
        let m = self.memory.as_ref()?;
        Some((std::os::fd::AsFd::as_fd(m.fd.as_ref()?), m.layout))
    }

    /// What freezes the queues before a planned restart.
    pub(crate) fn control(&self) -> Option<Arc<RingControl>> {
        self.control.clone()
    }

    pub(crate) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays within it for cpu < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < 1024 {
            libc::CPU_SET(cpu, &mut set);
            let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

fn serve_queue<FS: Filesystem>(
    qid: u16,
    se: SessionEventLoop<FS>,
    dev: ChannelSender,
    memory: Arc<RingMemory>,
    control: Arc<RingControl>,
    adopting: bool,
    registered: mpsc::Sender<io::Result<()>>,
) {
    // The kernel picks the queue by the caller's CPU: answering on that CPU keeps the
    // request and its reply there.
    pin_to_cpu(usize::from(qid));
    let depth = memory.layout.depth;
    let queue = match Queue::new(qid, dev.as_raw_fd(), memory, control) {
        Ok(q) => Arc::new(q),
        Err(e) => {
            let _ = registered.send(Err(e));
            return;
        }
    };
    ON_QUEUE.set(Arc::as_ptr(&queue) as usize);
    queue.control.queues.lock().push(Arc::downgrade(&queue));
    // Entries whose command the kernel has taken and which have not come back with a
    // request: the free ones a freeze waits for (see `RingControl`).
    let mut in_kernel = 0usize;
    let mut reported = false;
    // What reached the queue while it was frozen (see `RingControl::freeze`).
    let mut stash: Vec<(u64, i32, u32)> = Vec::new();
    let mut live = usize::from(depth);
    let mut pending: Vec<(u64, i32, u32)> = Vec::with_capacity(usize::from(depth) + 1);
    let mut scratch = Vec::new();
    // Entries a previous server registered whose last request is being answered again:
    // if the kernel no longer knows it (answered, or the entry ended with that server),
    // the commit fails with ENOENT and the entry's memory is registered afresh.
    let mut recovering = std::collections::HashSet::new();
    let mut settling: HashMap<usize, (u64, Vec<u8>)> = HashMap::new();
    let settle = io_uring::types::Timespec::from(READ_SETTLE);
    let mut held = Vec::new();
    let mut replayed = 0usize;
    let setup = (|| {
        for slot in 0..usize::from(depth) {
            match if adopting {
                queue.held(slot, &mut scratch)
            } else {
                Held::Unused
            } {
                Held::Unused => queue.push_command(&queue.command(CMD_REGISTER, slot, 0))?,
                Held::Request {
                    unique,
                    bytes,
                    reading,
                } => {
                    recovering.insert(slot);
                    if reading {
                        let t = opcode::Timeout::new(&settle)
                            .build()
                            .user_data(RECOVER | slot as u64);
                        queue.push(&t.into())?;
                        settling.insert(slot, (unique, bytes));
                    } else {
                        held.push((slot, unique, bytes));
                    }
                }
                Held::Replied(unique) => {
                    recovering.insert(slot);
                    replayed += 1;
                    queue.push_command(&queue.command(CMD_COMMIT_AND_FETCH, slot, unique))?;
                }
                Held::Unreadable(unique) => {
                    recovering.insert(slot);
                    queue.refuse(slot, unique);
                }
            }
        }
        queue.arm_wake()?;
        let n = queue.ring.submitter().submit()?;
        in_kernel += queue.consumed(n);
        Ok::<(), io::Error>(())
    })();
    if !recovering.is_empty() {
        // The opcodes say what was held (FUSE_READ 15, FUSE_STATFS 17, ...).
        let opcode = |b: &Vec<u8>| b.get(4..8).map(|o| u32::from_ne_bytes(o.try_into().unwrap()));
        let ops: Vec<u32> = held
            .iter()
            .map(|(_, _, b)| b)
            .chain(settling.values().map(|(_, b)| b))
            .filter_map(opcode)
            .collect();
        log::info!(
            "queue {qid}: {} requests a previous server held: {} answered again (opcodes {ops:?}), {} answers sent again",
            recovering.len(),
            ops.len(),
            replayed,
        );
        let control = &queue.control;
        control
            .rerun
            .fetch_add(held.len() + settling.len(), std::sync::atomic::Ordering::SeqCst);
        control
            .resent
            .fetch_add(replayed, std::sync::atomic::Ordering::SeqCst);
    }
    for (slot, unique, bytes) in held.drain(..) {
        serve(&queue, &se, &dev, slot, unique, &bytes, &mut scratch);
    }
    // A refused registration completes at once; an accepted one only when a request
    // arrives (which the loop below then serves). So does an answer to a request the
    // kernel no longer knows: that entry is registered again before the queue counts as
    // ready, so that every queue has entries when the caller wakes it.
    loop {
        if let Ok(n) = queue.ring.submitter().submit() {
            in_kernel += queue.consumed(n);
        }
        // SAFETY: only this thread reads the completion queue.
        pending.extend(
            unsafe { queue.ring.completion_shared() }.map(|c| (c.user_data(), c.result(), c.flags())),
        );
        let before = pending.len();
        pending.retain(|&(u, r, _)| {
            let gone = u & (WAKE | FILE_READ | RECOVER | prefetch::PREFETCH) == 0
                && r == -libc::ENOENT
                && recovering.remove(&(u as usize));
            if gone {
                in_kernel = in_kernel.saturating_sub(1);
                let _ = queue.push_command(&queue.command(CMD_REGISTER, u as usize, 0));
            }
            !gone
        });
        if pending.len() == before {
            break;
        }
    }
    let refused = pending
        .iter()
        .find(|(u, r, _)| *u & (WAKE | FILE_READ | RECOVER | prefetch::PREFETCH) == 0 && *r < 0)
        .map(|(_, r, _)| io::Error::from_raw_os_error(-r));
    match (setup, refused) {
        (Err(e), _) => {
            let _ = registered.send(Err(e));
            return;
        }
        (Ok(()), Some(e)) => {
            let _ = registered.send(Err(e));
        }
        (Ok(()), None) => {
            let _ = registered.send(Ok(()));
        }
    }
    loop {
        // SAFETY: only this thread reads the completion queue.
        pending.extend(
            unsafe { queue.ring.completion_shared() }.map(|c| (c.user_data(), c.result(), c.flags())),
        );
        let frozen = queue.control.is_frozen();
        if !frozen && !stash.is_empty() {
            // Thawed: what reached the queue while it was frozen is served now.
            reported = false;
            pending.append(&mut stash);
        }
        if frozen && !reported {
            debug!("queue {qid}: frozen, {in_kernel} entries free");
        }
        if frozen && in_kernel == 0 && !reported {
            reported = true;
            log::info!("queue {qid}: frozen with every entry held");
            queue.control.queue_held();
        }
        if pending.is_empty() {
            let look_again = prefetch::before_wait();
            let waited = if frozen {
                // Completions only: nothing more goes to the kernel.
                // SAFETY: io_uring_enter with no submission, waiting for one completion.
                unsafe { queue.ring.submitter().enter::<libc::sigset_t>(0, 1, 1, None) }
            } else if let Some(after) = look_again {
                let ts = io_uring::types::Timespec::from(after);
                let args = io_uring::types::SubmitArgs::new().timespec(&ts);
                queue.ring.submitter().submit_with_args(1, &args)
            } else {
                queue.ring.submitter().submit_and_wait(1)
            };
            match waited {
                Ok(n) if !frozen => in_kernel += queue.consumed(n),
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                // The wait for reads ahead to go stale (`prefetch::before_wait`) ended.
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
                Err(e) => {
                    warn!("queue {qid}: io_uring_enter: {e}");
                    return;
                }
            }
            continue;
        }
        for (slot, res, flags) in pending.drain(..) {
            if slot == WAKE {
                // Answers queued by other threads are submitted with the next wait.
                queue.drain_wake();
                if !io_uring::cqueue::more(flags) && live > 0 {
                    if let Err(e) = queue.arm_wake() {
                        warn!("queue {qid}: the wake-up poll: {e}");
                    }
                }
                continue;
            }
            if slot & FILE_READ != 0 {
                file_read_done(&queue, (slot & !FILE_READ) as usize, res);
                continue;
            }
            if slot & prefetch::PREFETCH != 0 {
                prefetch::completed(slot & !prefetch::PREFETCH, res);
                continue;
            }
            if slot & RECOVER != 0 {
                if frozen {
                    stash.push((slot, res, flags));
                    continue;
                }
                let slot = (slot & !RECOVER) as usize;
                if let Some((unique, bytes)) = settling.remove(&slot) {
                    serve(&queue, &se, &dev, slot, unique, &bytes, &mut scratch);
                }
                continue;
            }
            // Came back from the kernel when it arrived (counted then), or now.
            if slot & STASHED == 0 {
                in_kernel = in_kernel.saturating_sub(1);
            }
            if frozen && res >= 0 {
                // Left to the next server, which finds it in the entry; kept here in
                // case the queue thaws instead.
                stash.push((slot | STASHED, res, flags));
                continue;
            }
            let slot = (slot & !STASHED) as usize;
            if res < 0 {
                if res == -libc::ENOENT && recovering.remove(&slot) {
                    if let Err(e) = queue.push_command(&queue.command(CMD_REGISTER, slot, 0)) {
                        warn!("queue {qid} entry {slot}: {e}");
                        live = live.saturating_sub(1);
                    }
                    continue;
                }
                // The connection ended (ENOTCONN at unmount, ECANCELED when this thread's
                // ring goes) or the kernel refused the entry: it takes no more requests.
                if res != -libc::ENOTCONN && res != -libc::ECANCELED && res != -libc::ECONNABORTED {
                    warn!("queue {qid} entry {slot}: {}", io::Error::from_raw_os_error(-res));
                }
                live = live.saturating_sub(1);
                continue;
            }
            recovering.remove(&slot);
            let (ptr, len, commit_id, payload_free) = match queue.request(slot, &mut scratch) {
                Ok(r) => r,
                Err(commit_id) => {
                    warn!("queue {qid} entry {slot}: malformed request");
                    queue.refuse(slot, commit_id);
                    continue;
                }
            };
            // SAFETY: rebuilt by `request` in memory this entry owns until its reply.
            let data = unsafe { std::slice::from_raw_parts(ptr, len) };
            queue.keep(slot, commit_id, data);
            dispatch(&queue, &se, &dev, slot, commit_id, payload_free, data);
        }
        // A file read still in flight writes into this queue's memory: wait for it.
        if live == 0 && FILE_READS.with(|r| r.borrow().is_empty()) && !prefetch::in_flight() {
            debug!("queue {qid}: every entry has ended");
            return;
        }
    }
}

/// Answers again a request a previous server held in `slot` (see `Queue::held`).
fn serve<FS: Filesystem>(
    queue: &Arc<Queue>,
    se: &SessionEventLoop<FS>,
    dev: &ChannelSender,
    slot: usize,
    unique: u64,
    bytes: &[u8],
    scratch: &mut Vec<u8>,
) {
    // In an aligned copy, as the parser wants; the payload buffer is then free.
    scratch.clear();
    scratch.resize(bytes.len() + 8, 0);
    let off = scratch.as_ptr().align_offset(8);
    scratch[off..off + bytes.len()].copy_from_slice(bytes);
    queue.keep(slot, unique, bytes);
    dispatch(
        queue,
        se,
        dev,
        slot,
        unique,
        true,
        &scratch[off..off + bytes.len()],
    );
}

fn dispatch<FS: Filesystem>(
    queue: &Arc<Queue>,
    se: &SessionEventLoop<FS>,
    dev: &ChannelSender,
    slot: usize,
    commit_id: u64,
    payload_free: bool,
    data: &[u8],
) {
    let reply = RingReply {
        queue: queue.clone(),
        slot,
        commit_id,
        payload_free,
        dev: dev.clone(),
    };
    match RequestWithSender::new(ReplySender::Ring(reply), data) {
        Some(req) => {
            if let Ok(Operation::Destroy(_)) = req.request.operation() {
                req.reply::<crate::ReplyEmpty>().ok();
            } else {
                req.dispatch(se);
            }
        }
        None => {
            warn!("queue {} entry {slot}: request not understood", queue.qid);
            queue.refuse(slot, commit_id);
        }
    }
}
