//! Paths the local node verified, learned a shard at a time. The first open of a file asks
//! the node, in the background, for the verified paths of every file of the same shard in
//! one call (`LocalPaths`), so later opens of its siblings open the node's file directly
//! instead of each waiting on an `EnsureLocal` round trip: that round trip was most of
//! the cost of a cold small file. Shards group files in path order and inodes follow path
//! order, so a shard's files are found by walking the inodes on either side of the first
//! one opened.
//!
//! A learned path stays usable for the reopen window from when it was learned, however
//! often it is used: a version holds more files than a mount keeps open (a quarter of
//! its open-file limit), so a job's next pass within the window finds most of its files
//! closed again, and reopening them from their paths (a pack's files from its shared
//! descriptors) is what spares each its own round trip to the node and a hash of its
//! bytes there. A shard is asked about again once the window has passed since it was
//! last asked, so a pass after the window (a job's next epoch) asks in one call per
//! shard, not per file. With the window at zero (the node asked at every open) a learned
//! path serves one open.
//!
//! A learned path is used only if the file opened there still has the identity the node
//! verified (inode, ctime, size): any write since changes the ctime, so a stale or
//! tampered file falls back to `EnsureLocal`, which hashes it again.
//!
//! Small blobs are packed on the node, so most learned paths name a pack. The files of
//! one pack share its descriptors (and the O_DIRECT one its direct reads use) for as long
//! as any of them is open here: a pack is never written again, so the identity the node
//! verified is checked against the one the shared descriptors were opened with, and a
//! pack replaced at its path is opened afresh.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use locus_proto::BlobHash;

use super::{Core, Descriptors, NodeFile};
use crate::namespace::Kind;

/// A blob file the node verified, and the file's identity at that check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownPath {
    pub path: PathBuf,
    pub ino: u64,
    pub ctime_s: i64,
    pub ctime_ns: i64,
    pub size: u64,
    /// Where the blob starts in the file; `packed`: the file holds other blobs too.
    pub offset: u64,
    pub packed: bool,
}

/// What the mount has learned: paths by inode (with when), and the shards already asked
/// about.
#[derive(Default)]
pub(crate) struct Known {
    paths: HashMap<u64, (KnownPath, Instant)>,
    /// When each shard was last asked about (`Known::ask`).
    shards: HashMap<u32, Instant>,
    /// When each inode window was last asked of a node that hands out files.
    windows: HashMap<u64, Instant>,
    /// Packs held open, by path: every blob of a pack read from learned paths shares one
    /// pair of descriptors (`Known::pack_file`), kept while a file of the pack is open here.
    packs: HashMap<PathBuf, Pack>,
}

/// A pack's descriptors and the identity the file had when they were opened.
#[derive(Debug)]
struct Pack {
    fd: Weak<Descriptors>,
    /// (inode, ctime, ctime ns, size), as `KnownPath` has them.
    id: (u64, i64, i64, u64),
    /// `NodeFile::seen` for files of this pack.
    seen: Option<(u64, u64, i64, i64)>,
}

/// Packs remembered before entries whose descriptors are closed are swept out.
const PACKS_SWEEP: usize = 4_096;

impl Known {
    /// A file of the pack at `k.path` on the descriptors already open here, when the file
    /// had the identity the node verified when they were opened (a pack is never written
    /// again, so that identity is the file's for as long as it exists).
    fn pack_file(&self, k: &KnownPath) -> Option<NodeFile> {
        let p = self.packs.get(&k.path)?;
        if p.id != (k.ino, k.ctime_s, k.ctime_ns, k.size) {
            return None;
        }
        Some(NodeFile {
            fd: p.fd.upgrade()?,
            seen: p.seen,
            base: k.offset,
            packed: true,
        })
    }

    /// Forgets which inode windows were asked of a node that hands out files: their
    /// files were closed for room (`Core::remember`).
    pub(crate) fn forget_windows(&mut self) {
        self.windows.clear();
    }

    fn keep_pack(&mut self, path: PathBuf, f: &NodeFile, id: (u64, i64, i64, u64)) {
        if self.packs.len() >= PACKS_SWEEP {
            self.packs.retain(|_, p| p.fd.strong_count() > 0);
        }
        self.packs.insert(
            path,
            Pack {
                fd: Arc::downgrade(&f.fd),
                id,
                seen: f.seen,
            },
        );
    }
}

/// Whether `key` is to be asked about now, noting it as asked if so: never asked, or
/// asked longer ago than the reopen window. Learned paths serve the window; after it the
/// files of the shard are needed again (a training job's next epoch), and asking for them
/// again in one call is what spares each file its own round trip to the node. With the
/// window at zero (ask at every open) a shard is asked once.
fn ask<K: std::hash::Hash + Eq>(asked: &mut HashMap<K, Instant>, key: K, reopen: Duration) -> bool {
    match asked.get(&key) {
        Some(at) if reopen.is_zero() || at.elapsed() < reopen => false,
        _ => {
            asked.insert(key, Instant::now());
            true
        }
    }
}

#[cfg(test)]
impl Known {
    /// Paths learned less than `window` ago (and, with a zero window, not yet used).
    pub(crate) fn fresh(&self, window: Duration) -> usize {
        self.paths
            .values()
            .filter(|(_, at)| window.is_zero() || at.elapsed() < window)
            .count()
    }
}

/// Most learned paths kept (about 150 bytes each); past it they are dropped and relearned.
const KNOWN_MAX: usize = 65_536;
/// Most files of one shard asked about at once.
const SHARD_BATCH: usize = 8_192;
/// Inodes per window a node that hands out files is asked for at once: a reader's next
/// files (inode order is path order), one request instead of one per open.
const WINDOW: u64 = 64;
/// Windows remembered as asked; past it the set starts again.
const WINDOWS_MAX: usize = 100_000;
/// Inodes walked past (directories, other kinds) before a shard's run is taken as ended.
const WALK_MAX: usize = 4 * SHARD_BATCH;

impl Core {
    /// The node's file for `ino` from a learned path, opened and checked against the
    /// identity the node verified; None when nothing is learned or the file changed.
    pub(crate) fn known_file(&self, ino: u64) -> Option<Arc<NodeFile>> {
        let window = self.settings.reopen_ttl;
        let (k, shared) = {
            let mut known = self.known.lock().unwrap();
            let k = match known.paths.get(&ino) {
                None => return None,
                Some(_) if window.is_zero() => known.paths.remove(&ino)?.0,
                Some((_, at)) if at.elapsed() >= window => {
                    known.paths.remove(&ino);
                    return None;
                }
                Some((k, _)) => k.clone(),
            };
            let shared = if k.packed { known.pack_file(&k) } else { None };
            (k, shared)
        };
        // A sibling's pack already open: no system call at all.
        let f = match shared {
            Some(f) => f,
            None => {
                // A path gone or changed is forgotten: kept for the window, it would be
                // opened and turned away at every open of its file.
                let opened = std::fs::File::open(&k.path).and_then(|f| f.metadata().map(|m| (f, m)));
                let Ok((file, m)) = opened else {
                    self.known.lock().unwrap().paths.remove(&ino);
                    return None;
                };
                let id = (m.ino(), m.ctime(), m.ctime_nsec(), m.len());
                if id != (k.ino, k.ctime_s, k.ctime_ns, k.size) {
                    tracing::debug!(ino, path = %k.path.display(), "the node's file changed since it was verified; asking the node");
                    self.known.lock().unwrap().paths.remove(&ino);
                    return None;
                }
                let f = NodeFile {
                    seen: Some((m.ino(), m.len(), m.mtime(), m.mtime_nsec())),
                    fd: Descriptors::new(file),
                    base: k.offset,
                    packed: k.packed,
                };
                if k.packed {
                    self.known.lock().unwrap().keep_pack(k.path, &f, id);
                }
                f
            }
        };
        let f = Arc::new(f);
        self.remember(ino, f.clone());
        Some(f)
    }

    /// Learns, in the background, the node's verified paths for the files of `ino`'s
    /// shard; once per shard and reopen window (and again after the learned paths were
    /// dropped for room).
    pub(crate) fn learn_shard(self: &Arc<Self>, ino: u64) {
        if self.local.as_ref().is_some_and(|n| n.hands_out_files()) {
            return self.open_ahead(ino);
        }
        let (Some(node), Some(shard)) = (self.local.clone(), self.ns.shard(ino)) else {
            return;
        };
        if !ask(
            &mut self.known.lock().unwrap().shards,
            shard,
            self.settings.reopen_ttl,
        ) {
            return;
        }
        let core = self.clone();
        self.rt.spawn_blocking(move || {
            let inos = core.shard_files(ino, shard);
            if inos.is_empty() {
                return;
            }
            let blobs: Vec<BlobHash> = inos
                .iter()
                .filter_map(|i| core.ns.blob(*i).map(|b| b.0))
                .collect();
            let asked = Instant::now();
            match node.local_paths(&blobs, core.settings.open_timeout) {
                Ok(paths) => {
                    tracing::debug!(
                        shard,
                        files = blobs.len(),
                        verified = paths.iter().flatten().count(),
                        ms = asked.elapsed().as_millis() as u64,
                        "learned the node's verified paths of a shard"
                    );
                    let mut k = core.known.lock().unwrap();
                    if k.paths.len() + paths.len() > KNOWN_MAX {
                        k.paths.clear();
                        k.shards.clear();
                        k.shards.insert(shard, Instant::now());
                    }
                    // Dated from the question: the node vouched for them no later.
                    for (i, p) in inos.into_iter().zip(paths) {
                        if let Some(p) = p {
                            k.paths.insert(i, (p, asked));
                        }
                    }
                }
                Err(e) => {
                    // Opens go on through EnsureLocal; a later open may ask again.
                    tracing::debug!(shard, "the node did not list the shard's paths: {e}");
                    core.known.lock().unwrap().shards.remove(&shard);
                }
            }
        });
    }

    /// For a node that hands out files (the open socket, which lists no paths): the files
    /// of the window after `ino` (and of `ino`'s own), opened by the node in one request
    /// each, in the background, and kept for the reopen window; each window asked once.
    fn open_ahead(self: &Arc<Self>, ino: u64) {
        let Some(node) = self.local.clone() else { return };
        let windows: Vec<u64> = {
            let mut k = self.known.lock().unwrap();
            if k.windows.len() >= WINDOWS_MAX {
                k.windows.clear();
            }
            let reopen = self.settings.reopen_ttl;
            [ino / WINDOW, ino / WINDOW + 1]
                .into_iter()
                .filter(|w| ask(&mut k.windows, *w, reopen))
                .collect()
        };
        if windows.is_empty() {
            return;
        }
        let core = self.clone();
        self.rt.spawn_blocking(move || {
            for w in windows {
                let (inos, blobs): (Vec<u64>, Vec<BlobHash>) = (w * WINDOW..(w + 1) * WINDOW)
                    .filter(|i| *i != ino && core.recent_file(*i).is_none())
                    .filter(|i| {
                        core.ns
                            .attr(*i)
                            .is_some_and(|a| a.kind == Kind::File && a.size > 0)
                    })
                    .filter_map(|i| core.ns.blob(i).map(|b| (i, b.0)))
                    .unzip();
                if blobs.is_empty() {
                    continue;
                }
                match node.open_many(&blobs, core.settings.open_timeout) {
                    Ok(files) => {
                        for (i, f) in inos.into_iter().zip(files) {
                            if let Some(f) = f {
                                core.remember(i, Arc::new(f));
                            }
                        }
                    }
                    Err(e) => {
                        // Opens go on one at a time; a later open may ask again.
                        tracing::debug!(window = w, "the node did not hand out the window's files: {e}");
                        core.known.lock().unwrap().windows.remove(&w);
                    }
                }
            }
        });
    }

    /// Non-empty files of `shard` around `ino` (not `ino` itself), at most `SHARD_BATCH`.
    fn shard_files(&self, ino: u64, shard: u32) -> Vec<u64> {
        let mut out = Vec::new();
        for dir in [-1i64, 1] {
            let mut at = ino as i64;
            let mut walked = 0;
            while out.len() < SHARD_BATCH && walked < WALK_MAX {
                at += dir;
                walked += 1;
                let Some(a) = (at > 0).then(|| self.ns.attr(at as u64)).flatten() else {
                    break;
                };
                if a.kind != Kind::File {
                    continue;
                }
                if self.ns.shard(at as u64) != Some(shard) {
                    break;
                }
                if a.size > 0 {
                    out.push(at as u64);
                }
            }
        }
        out
    }
}
