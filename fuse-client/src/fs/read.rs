//! The read path's adapter: a READ answered from the local node's file (from the page
//! cache on the session thread, from the disk on the io_uring queue the request came in
//! on, or on the blocking pool), or from remote replicas off the session thread.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use fuser::ReplyData;

use super::{errno, Mount};
use crate::core::ops::ByInode;
use crate::core::{
    cached, direct_room, pread_cached, DirectFile, FsError, NodeFile, ReadAhead, DIRECT_ALIGN,
};

impl Mount {
    /// Answers a read with what `read` puts in the reply's own buffer (`len` bytes of
    /// room, starting on a page; the ring entry under io_uring), counted as served by the
    /// source `read` names. `None` from `read` declines: the reply comes back unsent.
    pub(super) fn try_finish_read(
        &self,
        len: usize,
        started: Instant,
        reply: ReplyData,
        read: impl FnOnce(&mut [u8]) -> Option<Result<(usize, &'static str), FsError>>,
    ) -> Result<(), ReplyData> {
        reply.try_fill(len, |buf| {
            Some(match read(buf)? {
                Ok((n, how)) => {
                    self.core.metrics.read(how, n, started.elapsed());
                    Ok(n)
                }
                Err(e) => {
                    self.core.metrics.read_error();
                    Err(errno("read", &e))
                }
            })
        })
    }

    pub(super) fn finish_read(
        &self,
        len: usize,
        started: Instant,
        reply: ReplyData,
        read: impl FnOnce(&mut [u8]) -> Result<(usize, &'static str), FsError>,
    ) {
        let _ = self.try_finish_read(len, started, reply, |buf| Some(read(buf)));
    }

    /// Reads `want` bytes of the node's verified file: here when the page cache holds
    /// them, else from the disk off the session thread, so readers of uncached files keep
    /// as many reads in flight as they like (there are few session threads, and a disk
    /// wants a deep queue). Either way the bytes go straight into the reply's buffer.
    pub(super) fn read_local(
        self: &Arc<Self>,
        ino: u64,
        file: Arc<NodeFile>,
        offset: u64,
        want: u64,
        started: Instant,
        reply: ReplyData,
    ) {
        let want = want as usize;
        let reply = match self.take_read_ahead(ino, &file, offset, want, started, reply) {
            Ok(()) => return,
            Err(reply) => reply,
        };
        // A read that ends a blob none of which is cached (a small file's one read, a
        // large one's last) goes direct: asked first, as an attempt from the page cache
        // would start the kernel's read-ahead of the same bytes.
        let direct = self.core.ends_blob(ino, offset, want)
            && cached(file.file(), file.base + offset, want) == Some(false);
        if direct {
            self.read_ahead.cold_read();
        }
        let reply = match direct {
            true => match self.read_by_ring(ino, &file, offset, want, started, reply) {
                Ok(()) => return,
                Err(reply) => reply,
            },
            false => {
                let cached = self.try_finish_read(want, started, reply, |buf| {
                    pread_cached(file.file(), file.base + offset, buf)
                        .then(|| self.core.check_unchanged(ino, &file).map(|()| (want, "local")))
                });
                let Err(reply) = cached else { return };
                reply
            }
        };
        let mount = self.clone();
        self.core.rt.spawn_blocking(move || {
            // Otherwise not direct: the cached read above has started the kernel's
            // read-ahead into the page cache, which this read then finds (a direct read
            // would read twice).
            let len = if direct {
                direct_room(file.base + offset, want)
            } else {
                want
            };
            mount.finish_read(len, started, reply, |buf| {
                mount
                    .core
                    .pread_local(ino, &file, offset, want, direct, buf)
                    .map(|n| (n, "local"))
            })
        });
    }

    /// A direct read of a packed blob's end on the ring its request came in through
    /// (FUSE over io_uring, on that ring's thread): the request waits for the disk with no
    /// thread of its own, and the ring's thread answers it when the read completes. A
    /// blocking-pool read costs a hand-off to a pool thread, and the pool thread's commit
    /// then ties the entry's next request to a wake-up of that thread (the kernel runs a
    /// ring command's completion on the thread that submitted it). The reply comes back
    /// where that cannot be (`/dev/fuse`, a blob in a file of its own).
    pub(super) fn read_by_ring(
        self: &Arc<Self>,
        ino: u64,
        file: &Arc<NodeFile>,
        offset: u64,
        want: usize,
        started: Instant,
        reply: ReplyData,
    ) -> Result<(), ReplyData> {
        use std::os::fd::AsRawFd;
        // A pack's direct descriptor lives as long as its files: the one moved into
        // `done` keeps it open until the read completes. (Asked only of a pack: a file of
        // its own would open a descriptor just to be turned away.)
        if !file.packed {
            return Err(reply);
        }
        let Some(DirectFile::Shared(direct)) = file.direct() else {
            return Err(reply);
        };
        let fd = direct.as_raw_fd();
        let at = file.base + offset;
        let skip = (at % DIRECT_ALIGN as u64) as usize;
        let (mount, file) = (self.clone(), file.clone());
        let metrics = self.core.metrics.clone();
        let submitted = reply.read_by_ring(fd, at - skip as u64, direct_room(at, want), move |got, buf| {
            let read = match got {
                // The pages around the blob's bytes came: its own to the reply's start.
                Ok(n) if n >= skip + want => {
                    if skip > 0 {
                        buf.copy_within(skip..skip + want, 0);
                    }
                    mount.core.judge_local(ino, &file, want, Ok(want))
                }
                // Fewer: the file shrank since its check, or the disk gave less at once.
                // The ordinary read tells which.
                Ok(_) => mount.core.pread_local(ino, &file, offset, want, false, buf),
                Err(e) => mount.core.judge_local(ino, &file, want, Err(e)),
            };
            mount.local_read_done(read, started)
        });
        if submitted.is_ok() {
            metrics.ring_read();
        }
        submitted
    }

    /// Answers a read with bytes from remote replicas: a slice of the verified chunk,
    /// sent from where it is (through /dev/fuse one copy fewer than filling the reply's
    /// buffer; under io_uring the one copy into the ring entry either way).
    pub(super) fn send_remote(
        &self,
        got: Result<bytes::Bytes, FsError>,
        size: u32,
        started: Instant,
        reply: ReplyData,
    ) {
        match got {
            Ok(data) => {
                let n = data.len().min(size as usize);
                self.core.metrics.read("remote", n, started.elapsed());
                reply.data(&data[..n]);
            }
            Err(e) => {
                self.core.metrics.read_error();
                reply.error(errno("read", &e));
            }
        }
    }

    /// Reads from remote replicas, which waits for the network: off the session thread.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_remote_off_thread(
        self: &Arc<Self>,
        ino: u64,
        ra: Arc<Mutex<ReadAhead>>,
        offset: u64,
        size: u32,
        keeps: bool,
        started: Instant,
        reply: ReplyData,
    ) {
        let mount = self.clone();
        self.core.rt.spawn_blocking(move || {
            let got = mount.core.read_remote(ino, &ra, offset, size, keeps);
            mount.send_remote(got, size, started, reply)
        });
    }

    /// A read of a file the kernel opened by itself (`Settings::kernel_opens`): a file
    /// the node verified recently is read here when the page cache has the bytes; the
    /// rest (choosing the source, waiting for the node or the network) runs off the
    /// session thread (`Core::read_by_inode`).
    pub(super) fn read_inode(
        self: &Arc<Self>,
        ino: u64,
        offset: u64,
        size: u32,
        keeps: bool,
        started: Instant,
        reply: ReplyData,
    ) {
        // What needs no source is answered here, without a trip to the blocking pool.
        let want = match self.core.read_len(ino, offset, size) {
            Err(e) => return reply.error(errno("read", &e)),
            Ok((want, _)) => want as u64,
        };
        if want == 0 {
            return self.finish_read(0, started, reply, |_| Ok((0, "local")));
        }
        if self.core.local.is_some() {
            if let Some(file) = self.core.recent_file(ino) {
                return self.read_local(ino, file, offset, want, started, reply);
            }
            // A path the node listed with the file's shard: opened here (a sibling's pack
            // is open already), so a cold file's read can go straight to the disk.
            if let Some(file) = self.core.known_file(ino) {
                self.core.metrics.opened("local");
                return self.read_local(ino, file, offset, want, started, reply);
            }
        }
        let mount = self.clone();
        self.core
            .rt
            .spawn_blocking(move || match mount.core.read_by_inode(ino, offset, size, keeps) {
                Ok(ByInode::Local { file, want }) => {
                    // Room for a direct read, which goes by whole pages.
                    let len = direct_room(file.base + offset, want);
                    mount.finish_read(len, started, reply, |buf| {
                        mount
                            .core
                            .pread_local(ino, &file, offset, want, true, buf)
                            .map(|n| (n, "local"))
                    })
                }
                Ok(ByInode::Remote(data)) => mount.send_remote(Ok(data), size, started, reply),
                Err(e) => mount.send_remote(Err(e), size, started, reply),
            });
    }
}

/// Files read ahead at their LOOKUP are at most this large: a cold small file, which the
/// kernel reads in one READ.
const READ_AHEAD_MAX: u64 = 256 << 10;
/// How far the gate's score goes either way: reading ahead stops after about this many
/// reads ahead went untaken more than were taken, and starts again after as many reads.
const GATE: i64 = 8;

/// Whether LOOKUPs of small files are followed by their READs, so that reading a file
/// ahead at its LOOKUP pays: a score raised by each read ahead a READ took and each cold
/// READ that found none, lowered by each read ahead dropped untaken (a walk that only
/// stats files). Approximate under concurrency, which is all it needs to be.
#[derive(Default)]
pub(crate) struct ReadAheadGate {
    score: std::sync::atomic::AtomicI64,
    seen_used: std::sync::atomic::AtomicU64,
    seen_unused: std::sync::atomic::AtomicU64,
}

impl ReadAheadGate {
    fn open(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let (_, used, unused) = fuser::prefetch::counts();
        let taken = used.saturating_sub(self.seen_used.swap(used, Relaxed)) as i64;
        let dropped = unused.saturating_sub(self.seen_unused.swap(unused, Relaxed)) as i64;
        let s = (self.score.load(Relaxed) + taken - dropped).clamp(-GATE, GATE);
        self.score.store(s, Relaxed);
        s > -GATE
    }

    fn cold_read(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.score.load(Relaxed);
        self.score.store((s + 1).min(GATE), Relaxed);
    }
}

impl Mount {
    /// At the LOOKUP of a small file the local node holds in a pack, not in the page
    /// cache: its bytes read from the disk on the queue's ring from now, not from its
    /// READ, which comes a few dozen microseconds later (`fuser::prefetch`). Only under
    /// FUSE over io_uring (elsewhere nothing starts), and while the gate says lookups are
    /// followed by reads.
    pub(super) fn read_ahead_on_lookup(&self, a: &crate::namespace::Attr) {
        use std::os::fd::AsRawFd;
        // Nothing is opened, counted or asked unless a read ahead can start here.
        if !fuser::prefetch::possible()
            || a.kind != crate::namespace::Kind::File
            || a.size == 0
            || a.size > READ_AHEAD_MAX
            || self.core.local.is_none()
            || !self.read_ahead.open()
        {
            return;
        }
        let file = match self.core.recent_file(a.ino) {
            Some(f) => f,
            None => {
                // Opened from the path the node listed, as the READ would have (and
                // counted as it would have been there).
                let Some(f) = self.core.known_file(a.ino) else {
                    return;
                };
                self.core.metrics.opened("local");
                f
            }
        };
        if !file.packed || cached(file.file(), file.base, a.size as usize) != Some(false) {
            return;
        }
        let Some(DirectFile::Shared(direct)) = file.direct() else {
            return;
        };
        let fd = direct.as_raw_fd();
        let skip = file.base % DIRECT_ALIGN as u64;
        let len = direct_room(file.base, a.size as usize);
        let keep: Box<dyn std::any::Any + Send> = Box::new(file.clone());
        fuser::prefetch::start(fd, file.base - skip, len, a.ino, keep);
    }

    /// A local read's outcome as the reply gets it, counted.
    fn local_read_done(&self, read: Result<usize, FsError>, started: Instant) -> Result<usize, fuser::Errno> {
        match read {
            Ok(n) => {
                self.core.metrics.read("local", n, started.elapsed());
                Ok(n)
            }
            Err(e) => {
                self.core.metrics.read_error();
                Err(errno("read", &e))
            }
        }
    }

    /// Answers a read with what was read ahead for its file at its LOOKUP (on whichever
    /// queue); else the reply comes back.
    fn take_read_ahead(
        self: &Arc<Self>,
        ino: u64,
        file: &Arc<NodeFile>,
        offset: u64,
        want: usize,
        started: Instant,
        reply: ReplyData,
    ) -> Result<(), ReplyData> {
        let from = (file.base % DIRECT_ALIGN as u64) as usize + offset as usize;
        let (mount, file) = (self.clone(), file.clone());
        reply.take_read_ahead(ino, want, move |got, buf| {
            let read = match got {
                Ok(src) if src.len() >= from + want => {
                    buf[..want].copy_from_slice(&src[from..from + want]);
                    mount.core.judge_local(ino, &file, want, Ok(want))
                }
                // Fewer (the file shrank since its check) or the read failed: the
                // ordinary read tells (a read ahead another READ took first never comes
                // here: the reply comes back to read as if none had been started).
                _ => mount.core.pread_local(ino, &file, offset, want, false, buf),
            };
            mount.local_read_done(read, started)
        })
    }
}
