//! Packs: many small blobs written as one file, for the small files an import sends by
//! the thousand.
//!
//! A blob in a file of its own costs the file system an inode, a directory entry in
//! `tmp/`, a rename into `blobs/` and, when it goes, an unlink: on ext4 that was most of a
//! node's CPU while it took 1 KiB files (inode allocation and the directory locks, about
//! 35% and 13% of its profile; after a large deletion, inode allocation alone slowed
//! 20-fold), where the bytes themselves cost next to nothing. A pack is one `WriteBlobs`
//! batch in one file, written once and never changed:
//!
//! `packs/<id>`: `LOCUSPK1`, the blob count and the chunk size (u32 LE each), then per blob
//! its hash (32 bytes), offset and size (u64 LE each), then the blobs' bytes at their
//! offsets.
//!
//! The table makes a pack readable without the index (adoption after a crash, tests); the
//! index stays the authority: a blob is in the store when its record names the pack and
//! offset.
//! Rules, on top of the store's:
//! - a pack is visible (renamed from `tmp/` into `packs/`) only after every blob in it
//!   hashed to its name and the file was synced; then its directory is synced and the
//!   records are written in one synced index batch;
//! - a pack is never written to again: no hole is punched when one of its blobs goes,
//!   because that would change the file under mounts reading its neighbours (they check
//!   the file is unchanged since the node verified it). The file is removed when its last
//!   blob is forgotten; until then the bytes of forgotten blobs stay on disk (counted by
//!   the file system, not by the books);
//! - a packed blob that fails verification is copied to `quarantine/` and forgotten; its
//!   neighbours stay (each is checked on its own);
//! - at a start, a pack no record names (a crash between its rename and the index write)
//!   is adopted like a stray blob file: each blob in it re-hashed against its name and
//!   indexed unpinned (pin sync pins what is needed), the pack removed if none is good;
//!   records naming a pack that is gone are dropped (pin sync fetches those blobs again).

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use locus_proto::BlobHash;
use prost::Message;

use super::record::stamp;
use super::*;

const MAGIC: &[u8; 8] = b"LOCUSPK1";
/// Bytes of a pack's table per blob.
const ROW: u64 = 32 + 8 + 8;
/// The directory packs live in, in each data dir.
pub(super) const PACKS: &str = "packs";

/// Where the first blob's bytes start in a pack of `n` blobs.
pub(super) const fn header_len(n: u64) -> u64 {
    16 + n * ROW
}

/// The packs the index names, with how many of their blobs it still holds.
#[derive(Default)]
pub(super) struct Packs {
    pub(super) live: HashMap<u64, (u32, u32)>,
    /// The next pack's id: above every id seen on disk or in the index, so a new pack
    /// never replaces an old one.
    pub(super) next: u64,
}

/// What a `write_packed` call did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PackedWrite {
    /// Blobs stored by this call.
    pub stored: u32,
    /// Blobs the store held already (pinned if asked).
    pub already_present: u32,
    /// Bytes of the stored blobs.
    pub bytes: u64,
}

/// One blob of a pack as a pack's table lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackRow {
    pub hash: BlobHash,
    pub offset: u64,
    pub size: u64,
}

/// A pack file's chunk size and table, read from its start (for adoption after a crash
/// and for tests: a readable pack is otherwise found through the index).
pub fn read_pack_table(path: &std::path::Path) -> std::io::Result<(u32, Vec<PackRow>)> {
    use std::io::Read;
    let bad = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    let mut f = fs::File::open(path)?;
    let mut head = [0u8; 16];
    f.read_exact(&mut head)?;
    if &head[..8] != MAGIC {
        return Err(bad("not a Locus pack"));
    }
    let n = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    let chunk_size = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
    let len = f.metadata()?.len();
    if header_len(u64::from(n)) > len {
        return Err(bad("its table runs past its end"));
    }
    let mut table = vec![0u8; (u64::from(n) * ROW) as usize];
    f.read_exact(&mut table)?;
    let rows = table
        .chunks(ROW as usize)
        .map(|r| {
            let row = PackRow {
                hash: BlobHash(r[..32].try_into().expect("32 bytes")),
                offset: u64::from_le_bytes(r[32..40].try_into().expect("8 bytes")),
                size: u64::from_le_bytes(r[40..48].try_into().expect("8 bytes")),
            };
            match row.offset.checked_add(row.size) {
                Some(end) if end <= len => Ok(row),
                _ => Err(bad("a blob runs past its end")),
            }
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok((chunk_size, rows))
}

impl BlobStore {
    pub(super) fn pack_path_in(&self, dir: u32, id: u64) -> PathBuf {
        self.cfg.dirs[dir as usize].join(PACKS).join(format!("{id:016x}"))
    }

    /// Stores small blobs as one pack: each checked against its name, the pack written
    /// and synced, published, and indexed in one synced batch. After it returns Ok every
    /// new blob is durable and visible; on an error none is. Blobs the store holds
    /// already are not written again (and are pinned if asked).
    pub fn write_packed(
        self: &Arc<Self>,
        blobs: &[(BlobHash, &[u8])],
        chunk_size: u32,
        pin: bool,
    ) -> Result<PackedWrite, StoreError> {
        let mut out = PackedWrite::default();
        let Some(first) = blobs.first() else {
            return Ok(out);
        };
        let chunk_size = checked_chunk_size(first.0, chunk_size)?;
        // Checked first, all of them: a batch with one wrong blob stores nothing.
        let mut new: Vec<(BlobHash, &[u8], Vec<BlobHash>)> = Vec::with_capacity(blobs.len());
        let mut seen = HashSet::with_capacity(blobs.len());
        for (h, data) in blobs {
            let (_, got, chunks) = locus_proto::manifest::hash_bytes(data, chunk_size, ChunkKind::Tree);
            if got != *h {
                return Err(mismatch(*h, got));
            }
            if !seen.insert(*h) {
                continue;
            }
            if self.contains(h) {
                if pin {
                    self.set_pinned(h, true)?;
                }
                out.already_present += 1;
                continue;
            }
            new.push((*h, data, chunks));
        }
        if new.is_empty() {
            return Ok(out);
        }
        // In key order: each index insert then starts from where the last one ended in
        // RocksDB's memtable instead of from the top (random 32-byte keys made that
        // search a third of a node's CPU while it took 1 KiB blobs).
        new.sort_unstable_by_key(|(h, ..)| h.0);
        let data_bytes: u64 = new.iter().map(|(_, d, _)| d.len() as u64).sum();
        let head = header_len(new.len() as u64);
        let (dir, _reservation) = self.reserve(head + data_bytes, pin.into())?;
        let id = {
            let mut p = lock(&self.packs);
            p.next += 1;
            p.next
        };
        // The header and table are built here; the blobs go from the buffers they arrived
        // in straight to the file (one `writev` per 1,024 of them): copying them into one
        // new buffer first cost a node a copy and a fresh, zeroed page per 4 KiB of it.
        let mut table = Vec::with_capacity(head as usize);
        table.extend_from_slice(MAGIC);
        table.extend_from_slice(&(new.len() as u32).to_le_bytes());
        table.extend_from_slice(&chunk_size.to_le_bytes());
        let mut at = head;
        for (h, d, _) in &new {
            table.extend_from_slice(&h.0);
            table.extend_from_slice(&at.to_le_bytes());
            table.extend_from_slice(&(d.len() as u64).to_le_bytes());
            at += d.len() as u64;
        }
        let tmp = self.cfg.dirs[dir as usize]
            .join("tmp")
            .join(format!("pack.{id:016x}"));
        let dest = self.pack_path_in(dir, id);
        let written = (|| {
            let mut f = fs::File::create_new(&tmp)?;
            let mut parts: Vec<std::io::IoSlice<'_>> = std::iter::once(&table[..])
                .chain(new.iter().map(|(_, d, _)| *d))
                // An empty slice would read as a write of nothing at the end.
                .filter(|d| !d.is_empty())
                .map(std::io::IoSlice::new)
                .collect();
            write_all_vectored(&mut f, &mut parts)?;
            f.sync_data()?;
            fs::rename(&tmp, &dest)?;
            Ok(stamp(&dest).ok())
        })();
        let renamed = match written {
            Ok(r) => r,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(io(e));
            }
        };
        let published = fsync_dir(dest.parent().expect("packs have a parent")).and_then(|()| {
            // The stamp after the rename (which changes the ctime), if nobody wrote since:
            // the bytes were hashed on the way in, as for a blob written alone
            // (`BlobWriter::record`).
            let verified = record::stamp_published(renamed, &dest).map(Into::into);
            let mut batch = rocksdb::WriteBatch::default();
            let mut records = Vec::with_capacity(new.len());
            let mut at = head;
            for (h, d, chunks) in &new {
                let mut rec =
                    BlobRecord::complete(d.len() as u64, dir, pin, chunk_size, (ChunkKind::Tree, chunks));
                rec.pack = id;
                rec.offset = at;
                rec.verified = verified.clone();
                at += d.len() as u64;
                batch.put(h.0, rec.encode_to_vec());
                records.push((*h, rec));
            }
            let mut opts = rocksdb::WriteOptions::default();
            opts.set_sync(true);
            self.index
                .write_opt(batch, &opts)
                .map_err(|e| StoreError::Index(e.into_string()))?;
            Ok(records)
        });
        let records = match published {
            Ok(r) => r,
            Err(e) => {
                // Nothing names it: not acknowledged, not kept.
                let _ = fs::remove_file(&dest);
                return Err(e);
            }
        };
        lock(&self.packs).live.insert(id, (dir, records.len() as u32));
        out.stored = records.len() as u32;
        out.bytes = data_bytes;
        for (h, rec) in records {
            self.remember(h, rec);
        }
        Ok(out)
    }

    /// One blob of pack `id` is gone from the index: the pack's path when that was its
    /// last, for the caller to remove (outside its locks).
    pub(super) fn release_packed(&self, id: u64) -> Option<PathBuf> {
        let mut p = lock(&self.packs);
        let (dir, live) = p.live.get_mut(&id)?;
        *live = live.saturating_sub(1);
        if *live > 0 {
            return None;
        }
        let dir = *dir;
        p.live.remove(&id);
        drop(p);
        Some(self.pack_path_in(dir, id))
    }

    /// A packed blob's bytes copied to `quarantine/` (its pack stays: the neighbours are
    /// fine until their own checks say otherwise).
    pub(super) fn copy_to_quarantine(&self, pack: &std::path::Path, offset: u64, size: u64, h: &BlobHash) {
        use std::os::unix::fs::FileExt;
        let dest = self.quarantine_dest(pack, h);
        let mut buf = vec![0u8; size.min(64 << 20) as usize];
        let read = fs::File::open(pack).and_then(|f| {
            let n = f.read_at(&mut buf, offset)?;
            buf.truncate(n);
            Ok(())
        });
        if let Err(e) = read.and_then(|()| fs::write(&dest, &buf)) {
            tracing::warn!(blob = %h, "cannot keep the packed blob's bytes in quarantine: {e}");
        }
    }

    /// At a start, after the index is loaded: drops records of packs that are gone and
    /// adopts packs no record names. Returns (records dropped, blobs adopted, packs
    /// removed).
    pub(super) fn reconcile_packs(
        &self,
        counts: HashMap<u64, (u32, u32)>,
    ) -> Result<(usize, usize, usize), StoreError> {
        let mut gone = HashSet::new();
        let mut top = 0u64;
        for (id, (dir, _)) in &counts {
            top = top.max(*id);
            if !self.pack_path_in(*dir, *id).exists() {
                gone.insert(*id);
            }
        }
        let mut strays = Vec::new();
        for (di, d) in self.cfg.dirs.iter().enumerate() {
            for f in fs::read_dir(d.join(PACKS)).map_err(io)?.flatten() {
                let id = f
                    .file_name()
                    .to_str()
                    .filter(|n| n.len() == 16)
                    .and_then(|n| u64::from_str_radix(n, 16).ok());
                match id {
                    Some(id) if counts.contains_key(&id) => {}
                    Some(id) => {
                        top = top.max(id);
                        strays.push((di as u32, id, f.path()));
                    }
                    None => {
                        let _ = fs::remove_file(f.path());
                    }
                }
            }
        }
        {
            let mut p = lock(&self.packs);
            p.next = p.next.max(top);
            p.live = counts;
            for id in &gone {
                p.live.remove(id);
            }
        }
        let mut dropped = Vec::new();
        if !gone.is_empty() {
            self.each_meta(|h, m, _| {
                if gone.contains(&m.rec.pack) {
                    dropped.push(*h);
                }
            });
            for h in &dropped {
                self.forget(h);
            }
            tracing::warn!(
                packs = gone.len(),
                blobs = dropped.len(),
                "packs named by the index are gone; their blobs are forgotten"
            );
        }
        let (mut adopted, mut removed) = (0, 0);
        for (dir, id, path) in strays {
            match self.adopt_pack(dir, id, &path) {
                Ok(0) => {
                    let _ = fs::remove_file(&path);
                    removed += 1;
                }
                Ok(n) => adopted += n,
                Err(e) => {
                    tracing::warn!(pack = %path.display(), "cannot adopt a pack the index does not name, removing it: {e}");
                    let _ = fs::remove_file(&path);
                    removed += 1;
                }
            }
        }
        Ok((dropped.len(), adopted, removed))
    }

    /// Indexes the blobs of a pack the index does not name that hash to their names and
    /// are not held already; how many.
    fn adopt_pack(&self, dir: u32, id: u64, path: &std::path::Path) -> Result<usize, StoreError> {
        use std::os::unix::fs::FileExt;
        let (chunk_size, rows) = read_pack_table(path).map_err(io)?;
        let chunk_size = checked_chunk_size(BlobHash([0; 32]), chunk_size)?;
        let f = fs::File::open(path).map_err(io)?;
        let verified = stamp(path).ok().map(Into::into);
        let mut batch = rocksdb::WriteBatch::default();
        let mut records = Vec::new();
        for row in rows {
            if self.contains(&row.hash) || records.iter().any(|(h, _)| *h == row.hash) {
                continue;
            }
            let mut data = vec![0u8; row.size as usize];
            f.read_exact_at(&mut data, row.offset).map_err(io)?;
            let (_, got, chunks) = locus_proto::manifest::hash_bytes(&data, chunk_size, ChunkKind::Tree);
            if got != row.hash {
                tracing::warn!(pack = %path.display(), blob = %row.hash, "a blob in an unindexed pack does not match its name; not adopted");
                continue;
            }
            let mut rec = BlobRecord::complete(row.size, dir, false, chunk_size, (ChunkKind::Tree, &chunks));
            rec.pack = id;
            rec.offset = row.offset;
            rec.verified = verified.clone();
            batch.put(row.hash.0, rec.encode_to_vec());
            records.push((row.hash, rec));
        }
        if records.is_empty() {
            return Ok(0);
        }
        self.index
            .write(batch)
            .map_err(|e| StoreError::Index(e.into_string()))?;
        lock(&self.packs).live.insert(id, (dir, records.len() as u32));
        let n = records.len();
        for (h, rec) in records {
            self.remember(h, rec);
        }
        Ok(n)
    }
}

/// Writes every slice, in as few `writev` calls as the kernel allows (at most 1,024
/// slices each).
fn write_all_vectored(f: &mut fs::File, mut parts: &mut [std::io::IoSlice<'_>]) -> std::io::Result<()> {
    use std::io::Write;
    while !parts.is_empty() {
        let n = parts.len().min(1024);
        match f.write_vectored(&parts[..n]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => std::io::IoSlice::advance_slices(&mut parts, written),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn mismatch(want: BlobHash, got: BlobHash) -> StoreError {
    StoreError::Mismatch {
        hash: want,
        what: format!("the bytes hash to {got}"),
    }
}

#[cfg(test)]
mod tests;
