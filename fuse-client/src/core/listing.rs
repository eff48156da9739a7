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

/// Children per READDIRPLUS answer under `Readdirplus::Auto`. The kernel makes an inode
/// and a dentry for every entry such an answer carries, which costs a walk that reads
/// only names (`find`, `os.walk`, `scandir`) far more than the walk itself when one answer
/// holds a whole large directory (newer kernels ask with buffers of many pages).
/// Answering a page's worth lets the kernel's READDIRPLUS_AUTO do what it was made for:
/// the rest of the directory comes as plain READDIR unless lookups in it show that
/// attributes are wanted, in which case the next answers carry them again.
pub const READDIRPLUS_ENTRIES: usize = 32;

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
