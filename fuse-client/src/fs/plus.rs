//! What a directory listing tells the kernel: names only, or names with attributes.
//!
//! An entry a READDIRPLUS answer gives attributes for becomes a dentry and an inode in
//! the kernel (`fuse_iget`, ~5 µs each here): a walk that then stats every entry needs no
//! LOOKUP round trip (~34 µs) per entry, and a walk that reads names alone (`find`,
//! `os.walk`, `scandir`) pays for inodes it never uses — 4× slower than a names-only
//! listing over a million entries, cold. Neither fixed answer suits both walks, and the
//! kernel's own READDIRPLUS_AUTO only learns per directory after the directory was read
//! (a walk lists a directory whole before it stats what is in it).
//!
//! `Adaptive` learns per mount instead, from what follows listings. Every READDIRPLUS
//! answer carries every entry that fits; each entry has its attributes only while the
//! mount is in "attributes wanted" mode, otherwise it is a name and type only (nodeid 0,
//! which the kernel reads as "nothing to link"). A LOOKUP of a file (not a directory: a
//! names-only walk looks up the directories it descends into) in a directory recently
//! listed without attributes is evidence that listings are being followed by stats or
//! opens; `EVIDENCE` of them turn the mode on for `HOLD`. While on, no such lookups come
//! (the kernel has the attributes), so the mode lapses after `HOLD` and one directory is
//! listed bare again to check: a stat walk pays one directory's lookups every `HOLD`, a
//! names-only walk after a stat walk pays `HOLD` of inodes.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use fuser::{Errno, FileType, Generation, INodeNo, ReplyDirectory, ReplyDirectoryPlus};

use super::{file_type, READDIRPLUS_ENTRIES, TTL};

/// The policy (`Settings::readdirplus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Readdirplus {
    /// Attributes while listings are seen to be followed by stats or opens.
    #[default]
    Adaptive,
    /// Every entry with its attributes.
    All,
    /// The first entries of each answer with attributes, then the kernel's
    /// READDIRPLUS_AUTO decides per directory.
    Auto,
}

/// File lookups in recently bare-listed directories that turn attributes on.
const EVIDENCE: u32 = 16;
/// How long attributes stay on after the evidence (ms).
const HOLD_MS: u64 = 3_000;
/// Directories remembered as listed without attributes.
const RECENT: usize = 16;
/// How long a bare listing counts as recent (ms).
const RECENT_MS: u64 = 5_000;

/// The adaptive policy's state, shared by the mount's threads.
pub struct Adaptive {
    epoch: Instant,
    /// Attributes are given while the mount's clock (ms since `epoch`) is below this.
    on_until: AtomicU64,
    evidence: AtomicU32,
    /// (directory, when listed) of the last directories listed without attributes.
    bare: Mutex<[(u64, u64); RECENT]>,
    /// Next slot of `bare` to overwrite.
    next: AtomicU32,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            epoch: Instant::now(),
            on_until: AtomicU64::new(0),
            evidence: AtomicU32::new(0),
            bare: Mutex::new([(0, 0); RECENT]),
            next: AtomicU32::new(0),
        }
    }
}

impl Adaptive {
    fn now_ms(&self) -> u64 {
        // +1: a slot's time 0 means "empty".
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Whether the answer being built for `dir` gives attributes; if not, `dir` is
    /// remembered as listed bare.
    pub fn attributes_for(&self, dir: u64) -> bool {
        let now = self.now_ms();
        if now < self.on_until.load(Ordering::Relaxed) {
            return true;
        }
        let mut bare = self.bare.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = bare.iter_mut().find(|(d, _)| *d == dir) {
            slot.1 = now;
        } else {
            let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % RECENT;
            bare[i] = (dir, now);
        }
        false
    }

    /// A LOOKUP of a child of `parent` (a file when `is_file`).
    pub fn looked_up(&self, parent: u64, is_file: bool) {
        if !is_file {
            return;
        }
        let now = self.now_ms();
        if now < self.on_until.load(Ordering::Relaxed) {
            return;
        }
        let listed_bare = {
            let bare = self.bare.lock().unwrap_or_else(|p| p.into_inner());
            bare.iter()
                .any(|&(d, at)| d == parent && at != 0 && now.saturating_sub(at) < RECENT_MS)
        };
        if listed_bare && self.evidence.fetch_add(1, Ordering::Relaxed) + 1 >= EVIDENCE {
            self.evidence.store(0, Ordering::Relaxed);
            self.on_until.store(now + HOLD_MS, Ordering::Relaxed);
        }
    }

    #[cfg(test)]
    /// Whether attributes are on now.
    pub fn is_on(&self) -> bool {
        self.now_ms() < self.on_until.load(Ordering::Relaxed)
    }
}

impl super::Mount {
    /// READDIR: names and types.
    pub(super) fn list(&self, ino: u64, offset: u64, mut reply: ReplyDirectory) {
        let Some(parent) = self.ns.parent(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // Positions: 0 ".", 1 "..", 2.. the children; an entry's offset is the next position.
        let mut pos = offset as usize;
        if pos == 0 {
            if reply.add(INodeNo(ino), 1, FileType::Directory, ".") {
                return reply.ok();
            }
            pos = 1;
        }
        if pos == 1 {
            let up = if parent == 0 { ino } else { parent };
            if reply.add(INodeNo(up), 2, FileType::Directory, "..") {
                return reply.ok();
            }
            pos = 2;
        }
        let Some(children) = self.ns.readdir(ino, pos - 2) else {
            return reply.error(Errno::ENOTDIR);
        };
        for (i, (child, name, kind)) in children.enumerate() {
            if reply.add(INodeNo(child), (pos + i + 1) as u64, file_type(kind), name) {
                break;
            }
        }
        reply.ok();
    }

    /// READDIRPLUS: names with attributes or without, as the policy decides.
    pub(super) fn list_plus(&self, ino: u64, offset: u64, mut reply: ReplyDirectoryPlus) {
        let gen = Generation(self.settings.generation);
        let (Some(parent), Some(me)) = (self.ns.parent(ino), self.ns.attr(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        let mut pos = offset as usize;
        if pos == 0 {
            if reply.add(INodeNo(ino), 1, ".", &TTL, &self.file_attr(&me), gen) {
                return reply.ok();
            }
            pos = 1;
        }
        if pos == 1 {
            let up = if parent == 0 { ino } else { parent };
            let Some(ua) = self.ns.attr(up) else {
                return reply.error(Errno::EIO);
            };
            if reply.add(INodeNo(up), 2, "..", &TTL, &self.file_attr(&ua), gen) {
                return reply.ok();
            }
            pos = 2;
        }
        let Some(children) = self.ns.readdir(ino, pos - 2) else {
            return reply.error(Errno::ENOTDIR);
        };
        let (limit, attributes) = match self.settings.readdirplus {
            Readdirplus::Auto => (READDIRPLUS_ENTRIES, true),
            Readdirplus::All => (usize::MAX, true),
            Readdirplus::Adaptive => (usize::MAX, self.listing.attributes_for(ino)),
        };
        let mut listed = 0;
        for (i, (child, name, _)) in children.enumerate() {
            if i >= limit {
                break;
            }
            let Some(a) = self.ns.attr(child) else { continue };
            let (offset, attr) = ((pos + i + 1) as u64, self.file_attr(&a));
            let full = if attributes {
                reply.add(INodeNo(child), offset, name, &TTL, &attr, gen)
            } else {
                reply.add_name_only(INodeNo(child), offset, name, &attr)
            };
            if full {
                break;
            }
            listed += 1;
        }
        self.metrics.listed(attributes, listed);
        reply.ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_lookups_after_a_bare_listing_turn_attributes_on_and_directory_lookups_do_not() {
        let a = Adaptive::default();
        // A names-only walk: listings, then lookups of the subdirectories it descends into.
        for dir in 1..100 {
            assert!(!a.attributes_for(dir));
            for _ in 0..100 {
                a.looked_up(dir, false);
            }
        }
        assert!(!a.is_on(), "descending into directories is not evidence");
        // Lookups of files in a directory nobody listed (a job opening known paths).
        for _ in 0..100 {
            a.looked_up(5_000, true);
        }
        assert!(!a.is_on(), "only directories listed bare count");
        // A stat walk: a listing, then a stat of each file in it.
        assert!(!a.attributes_for(7));
        for i in 0..EVIDENCE {
            assert!(!a.is_on(), "on after {i} lookups");
            a.looked_up(7, true);
        }
        assert!(a.is_on());
        assert!(a.attributes_for(8), "the next listing carries attributes");
    }

    #[test]
    fn attributes_lapse_after_the_hold_and_the_next_listing_is_bare_again() {
        let a = Adaptive::default();
        a.on_until.store(a.now_ms() + 30, Ordering::Relaxed);
        assert!(a.attributes_for(1));
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(!a.is_on());
        assert!(!a.attributes_for(1), "after the hold, a listing checks again");
    }
}
