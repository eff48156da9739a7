//! Reads of files with no local copy: which chunks a read needs, whether its reader
//! goes front to back (whole chunks and read-ahead) or jumps around (verified ranges of
//! the groups it reads), and the bytes, from the chunk cache or the replicas.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

use super::{Core, FsError};
use crate::reader::ChunkRef;

/// Sequential-read detection for one open file.
#[derive(Debug, Default)]
pub(crate) struct ReadAhead {
    /// The furthest chunk read so far.
    pub(crate) next_chunk: u64,
    pub(crate) window: usize,
    /// Chunks before this one have already been asked for in the background.
    pub(crate) ahead_to: u64,
    /// Where the last reads ended, newest last: several readers of one file (data
    /// loader workers, each going through its own part) each go on from their own.
    pub(crate) ends: VecDeque<u64>,
    /// Up for each read far from all of them, down for each that goes on from one: a
    /// reader that jumped is a random reader until it goes on from where it read, even
    /// when a read lands near an earlier one by chance.
    pub(crate) jumps: u8,
}

/// Readers of one file told apart by where their reads end.
pub(crate) const READERS: usize = 8;

/// How far a read may start from where an earlier one ended and not count as a jump: the
/// kernel's read-ahead (up to 4 MiB here) sends reads a little out of order.
const NEAR: u64 = 4 << 20;
/// A read that starts this little before an earlier one's end goes on from it (reads of
/// unaligned ranges share a page with the one before).
const GOES_ON: u64 = 128 << 10;

impl Core {
    /// Bytes `[offset, offset + size)` of a file from remote replicas (the chunk cache,
    /// read-ahead for sequential readers, verified ranges for random ones). `keeps`: the
    /// kernel keeps what this read returns in its page cache (a READ that fills it, not
    /// an O_DIRECT one), so a chunk handed over whole leaves the chunk cache. Blocking.
    pub(crate) fn read_remote(
        &self,
        ino: u64,
        ra: &Mutex<ReadAhead>,
        offset: u64,
        size: u32,
        keeps: bool,
    ) -> Result<Bytes, FsError> {
        let a = self.ns.attr(ino).ok_or(FsError::NotFound)?;
        let end = offset.saturating_add(u64::from(size)).min(a.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        let cs = u64::from(self.ns.chunk_size());
        let (first, last) = (offset / cs, (end - 1) / cs);
        let (ahead_from, ahead_to, jumped) = {
            // Sequential means moving forward through the chunks: the kernel's own
            // read-ahead sends several reads at once, slightly out of order.
            let mut st = ra.lock().unwrap();
            // Going on from where an earlier read ended (or starting the file) is what a
            // sequential reader does; within the kernel's read-ahead of one it may be
            // one arriving out of order; anything else is a jump.
            let goes_on = offset == 0 || st.ends.iter().any(|e| offset <= *e && *e - offset < GOES_ON);
            let near = goes_on || st.ends.iter().any(|e| offset.abs_diff(*e) <= NEAR);
            if st.ends.len() == READERS {
                st.ends.pop_front();
            }
            st.ends.push_back(end);
            st.jumps = match (goes_on, near) {
                (true, _) => st.jumps.saturating_sub(1),
                (false, true) => st.jumps,
                (false, false) => (st.jumps + 1).min(4),
            };
            // A random reader gets what it reads (verified ranges), no read-ahead.
            let random = st.jumps > 0;
            let forward =
                !random && first >= st.next_chunk && first <= st.next_chunk + 1 && (first > 0 || offset > 0);
            st.window = if forward {
                (st.window * 2).clamp(1, self.settings.readahead_chunks)
            } else {
                0
            };
            st.next_chunk = st.next_chunk.max(last);
            // Only chunks not already asked for: a read-ahead task per chunk, not per read.
            let from = (last + 1).max(st.ahead_to);
            let to = last + 1 + st.window as u64;
            if to > st.ahead_to {
                st.ahead_to = to;
            }
            (from, to, random)
        };
        let wanted: Vec<ChunkRef> = (first..=last).filter_map(|i| self.chunk_ref(ino, i)).collect();
        let ahead: Vec<ChunkRef> = (ahead_from..ahead_to)
            .filter_map(|i| self.chunk_ref(ino, i))
            .collect();
        let remote = self.remote.clone();
        let parts = self.rt.block_on(async move {
            remote.prefetch(ahead);
            let tasks: Vec<_> = wanted
                .into_iter()
                .map(|c| {
                    let r = remote.clone();
                    let (from, to) = (
                        offset.max(c.offset) - c.offset,
                        end.min(c.offset + c.len) - c.offset,
                    );
                    // A jump into a chunk nobody has fetched: only the groups read (with
                    // their proof), unless they are most of the chunk anyway.
                    let (s, e) = locus_proto::outboard::rounded(from, to, c.len);
                    let ranged = jumped && (e - s) * 2 <= c.len && !r.has(&c);
                    tokio::spawn(async move {
                        let piece = match ranged {
                            true => r.range(c, from, to).await.map(|b| (b, false)),
                            false => r.chunk(c).await.map(|(p, cached)| {
                                if keeps {
                                    r.handed(&c, from, to);
                                }
                                (p.range(from as usize, to as usize), cached)
                            }),
                        };
                        (c, piece)
                    })
                })
                .collect();
            let mut parts = Vec::with_capacity(tasks.len());
            for t in tasks {
                parts.push(t.await);
            }
            parts
        });
        // One chunk (the usual case): a slice of it, no copy.
        let single = parts.len() == 1;
        let mut out = Vec::new();
        for p in parts {
            let (_, data) = p.map_err(FsError::Task)?;
            let (piece, cached) = data.map_err(|e| {
                tracing::error!(ino, "read failed: {e}");
                FsError::Unavailable(e)
            })?;
            if cached {
                self.metrics.cache_hit(piece.len());
            }
            if single {
                return Ok(piece);
            }
            if out.is_empty() {
                out.reserve((end - offset) as usize);
            }
            out.extend_from_slice(&piece);
        }
        Ok(out.into())
    }
}
