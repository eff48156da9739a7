//! Outboards kept beside the blobs (`locus_proto::outboard`): `outboards/<h[0..2]>/<hash>`
//! in the blob's data dir, the pairs of the whole blob's BLAKE3 tree, so a range of the
//! blob is checked against the blob's own name without reading the rest of it.
//!
//! Written as the blob arrives, in the pass that hashes it (`BlobWriter`): no read and no
//! hash of their own. Kept only for blobs over [`KEEP_ABOVE`]; a smaller blob's outboard
//! costs one read of at most that much, and a file per small blob would cost an import of
//! small files a file creation each. A blob stored before this existed gets its outboard
//! from the first whole check of it (`verify`: the scrub's pass, or a passthrough open),
//! or the first time a range of it is asked for (`crate::ranges`).
//!
//! Derived data: never fsynced, never trusted. A missing or wrong-sized file is computed
//! again; a range whose bytes do not match a kept outboard is checked again against an
//! outboard computed from the blob's verified bytes before the blob is blamed, so a torn
//! or damaged outboard costs a recomputation, never a good blob. The file goes with the
//! blob (eviction, quarantine, a blob found missing); one whose blob is not held is
//! removed by the walk after a restart (`sweep_outboards`).

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use locus_proto::outboard::{self, Sink, PAIR};
use locus_proto::BlobHash;

use super::{hex, BlobStore};

/// Blobs larger than this keep their outboard on disk.
pub const KEEP_ABOVE: u64 = 1 << 20;

/// The bytes a blob of `size` takes in a data dir: the blob, and above `KEEP_ABOVE` its
/// outboard (about 0.4% of it). What capacity, pinned bytes and eviction count, so a
/// node filled to its capacity does not overrun it by its outboards.
pub(crate) fn footprint(size: u64) -> u64 {
    if size > KEEP_ABOVE {
        size + locus_proto::outboard::outboard_len(size) as u64
    } else {
        size
    }
}

/// Outboard bytes gathered before a write to the file.
const FLUSH: usize = 64 << 10;

/// An outboard being written to its temporary file as a `Builder` makes it. Its first
/// I/O error is kept and reported by `done`; dropped before `done`, the file is removed.
pub(super) struct OutboardFile {
    file: File,
    path: PathBuf,
    buf: Vec<u8>,
    /// Bytes of the outboard already in the file.
    flushed: u64,
    err: Option<std::io::Error>,
    kept: bool,
}

impl OutboardFile {
    pub(super) fn create(path: PathBuf) -> std::io::Result<Self> {
        Ok(OutboardFile {
            file: File::create(&path)?,
            path,
            buf: Vec::with_capacity(FLUSH),
            flushed: 0,
            err: None,
            kept: false,
        })
    }

    fn flush(&mut self) {
        if self.err.is_none() && !self.buf.is_empty() {
            if let Err(e) = self.file.write_all_at(&self.buf, self.flushed) {
                self.err = Some(e);
            }
        }
        self.flushed += self.buf.len() as u64;
        self.buf.clear();
    }

    /// The written file's path, once everything reached it.
    pub(super) fn done(mut self) -> std::io::Result<PathBuf> {
        self.flush();
        if let Some(e) = self.err.take() {
            return Err(e);
        }
        self.kept = true;
        Ok(std::mem::take(&mut self.path))
    }
}

impl Sink for OutboardFile {
    fn append(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= FLUSH {
            self.flush();
        }
    }

    fn patch(&mut self, at: u64, pair: &[u8; PAIR]) {
        if at >= self.flushed {
            let i = (at - self.flushed) as usize;
            self.buf[i..i + PAIR].copy_from_slice(pair);
        } else if self.err.is_none() {
            if let Err(e) = self.file.write_all_at(pair, at) {
                self.err = Some(e);
            }
        }
    }
}

impl Drop for OutboardFile {
    fn drop(&mut self) {
        if !self.kept {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Reads the pairs of a kept outboard a page at a time: the pairs one range needs are a
/// path from the root plus the contiguous pairs below it.
struct Pages<'a> {
    file: &'a File,
    page: Vec<u8>,
    at: Option<u64>,
}

impl Pages<'_> {
    fn pair(&mut self, off: usize) -> std::io::Result<[u8; PAIR]> {
        const PAGE: u64 = 4096;
        let (no, within) = (off as u64 / PAGE, (off as u64 % PAGE) as usize);
        if self.at != Some(no) {
            self.page.resize(PAGE as usize, 0);
            let mut got = 0;
            while got < PAGE as usize {
                match self.file.read_at(&mut self.page[got..], no * PAGE + got as u64)? {
                    0 => break,
                    n => got += n,
                }
            }
            self.page.truncate(got);
            self.at = Some(no);
        }
        let p = self
            .page
            .get(within..within + PAIR)
            .ok_or_else(|| std::io::Error::other("the outboard ends early"))?;
        Ok(p.try_into().expect("a slice of PAIR bytes"))
    }
}

impl BlobStore {
    fn outboard_path_in(&self, dir: u32, h: &BlobHash) -> PathBuf {
        let x = hex(h);
        self.cfg.dirs[dir as usize]
            .join("outboards")
            .join(&x[..2])
            .join(x)
    }

    /// Where blob `h`'s outboard is kept, with the blob's size; None when it has none to
    /// keep (not here, partial, packed, or small).
    fn kept_outboard(&self, h: &BlobHash) -> Option<(PathBuf, u64)> {
        let sh = self.shard(h);
        let m = sh.blobs.get(h)?;
        (m.rec.pack == 0 && m.rec.size > KEEP_ABOVE)
            .then(|| (self.outboard_path_in(m.rec.dir, h), m.rec.size))
    }

    /// Moves a written outboard (`OutboardFile::done`) to its place for blob `h` in data
    /// dir `dir`. A failure only costs a recomputation later.
    pub(super) fn publish_outboard(&self, tmp: &Path, dir: u32, h: &BlobHash) {
        let dest = self.outboard_path_in(dir, h);
        let moved = dest
            .parent()
            .map_or(Ok(()), fs::create_dir_all)
            .and_then(|()| fs::rename(tmp, &dest));
        if let Err(e) = moved {
            tracing::warn!(blob = %h, "cannot keep the blob's outboard: {e}");
            let _ = fs::remove_file(tmp);
        }
    }

    /// The proof of `[start, end)` of blob `h` (whole groups) from its kept outboard.
    /// None when no outboard of the right size is kept (a wrong-sized one is removed).
    /// Blocking I/O.
    pub fn kept_proof(&self, h: &BlobHash, start: u64, end: u64) -> Option<Vec<u8>> {
        let (path, size) = self.kept_outboard(h)?;
        let file = File::open(&path).ok()?;
        let len = file.metadata().ok()?.len();
        if len != outboard::outboard_len(size) as u64 {
            tracing::warn!(blob = %h, "its kept outboard is {len} bytes, not {}; computing it again", outboard::outboard_len(size));
            let _ = fs::remove_file(&path);
            return None;
        }
        let mut pages = Pages {
            file: &file,
            page: Vec::new(),
            at: None,
        };
        match outboard::proof_with(size, start, end, |off| pages.pair(off)) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(blob = %h, "cannot read its kept outboard: {e}");
                None
            }
        }
    }

    /// Keeps an outboard computed from blob `h`'s verified bytes (a blob stored before
    /// outboards were, or whose kept one was wrong). Nothing when the blob keeps none.
    pub fn keep_outboard(&self, h: &BlobHash, pairs: &[u8]) {
        let Some((dest, size)) = self.kept_outboard(h) else {
            return;
        };
        if pairs.len() != outboard::outboard_len(size) {
            return;
        }
        let dir = self.dir_of(&dest);
        let tmp = self.outboard_tmp(dir, h);
        match fs::write(&tmp, pairs) {
            Ok(()) => self.publish_outboard(&tmp, dir as u32, h),
            Err(e) => {
                tracing::warn!(blob = %h, "cannot keep the blob's outboard: {e}");
                let _ = fs::remove_file(&tmp);
            }
        }
    }

    /// A file to write blob `h`'s outboard to, when it should keep one and has none.
    pub(super) fn missing_outboard(&self, h: &BlobHash) -> Option<OutboardFile> {
        let (dest, _) = self.kept_outboard(h)?;
        if dest.exists() {
            return None;
        }
        let tmp = self.outboard_tmp(self.dir_of(&dest), h);
        OutboardFile::create(tmp)
            .map_err(|e| tracing::warn!(blob = %h, "cannot start its outboard: {e}"))
            .ok()
    }

    /// Removes blob `h`'s kept outboard (found wrong), so the next range computes it.
    pub fn drop_outboard(&self, h: &BlobHash) {
        if let Some((p, _)) = self.kept_outboard(h) {
            let _ = fs::remove_file(p);
        }
    }

    /// Removes the outboard kept beside the blob file at `blob` (`<dir>/blobs/xx/<hash>`),
    /// if any: the blob is gone.
    pub(super) fn remove_outboard_of(blob: &Path) {
        let (Some(name), Some(sub)) = (blob.file_name(), blob.parent()) else {
            return;
        };
        let (Some(sub_name), Some(blobs)) = (sub.file_name(), sub.parent()) else {
            return;
        };
        if blobs.file_name() != Some(std::ffi::OsStr::new("blobs")) {
            return;
        }
        if let Some(d) = blobs.parent() {
            let _ = fs::remove_file(d.join("outboards").join(sub_name).join(name));
        }
    }

    /// Removes outboards whose blob this data dir does not hold (older than the store's
    /// opening: one written since may belong to a blob being published right now).
    /// Derived data only: a wrong guess costs a recomputation. Returns how many went.
    pub(super) fn sweep_outboards(&self) -> usize {
        let mut removed = 0;
        for (di, d) in self.cfg.dirs.iter().enumerate() {
            let Ok(subs) = fs::read_dir(d.join("outboards")) else {
                continue;
            };
            for f in subs
                .flatten()
                .filter_map(|s| fs::read_dir(s.path()).ok())
                .flatten()
                .flatten()
            {
                let h = f.file_name().to_str().and_then(|n| BlobHash::from_hex(n).ok());
                let held = h.is_some_and(|h| {
                    self.shard(&h)
                        .blobs
                        .get(&h)
                        .is_some_and(|m| m.rec.dir as usize == di && m.rec.pack == 0)
                });
                let older = f
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t < self.opened);
                if !held && older && fs::remove_file(f.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// A fresh temporary file name for blob `h`'s outboard in data dir `dir`.
    fn outboard_tmp(&self, dir: usize, h: &BlobHash) -> PathBuf {
        let n = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.cfg.dirs[dir].join("tmp").join(format!("{}.{n}.ob", hex(h)))
    }

    /// The index of the data dir a path is in.
    fn dir_of(&self, p: &Path) -> usize {
        self.cfg.dirs.iter().position(|d| p.starts_with(d)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;
