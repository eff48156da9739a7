//! Writing blobs: whole (`BlobWriter`, verified before the rename that publishes it) or
//! chunk by chunk into a sparse partial file (`begin_partial`, `write_chunk`).

use std::fs::{self, File};
use std::path::PathBuf;
use std::sync::Arc;

use locus_proto::chunks::{ChunkHasher, ChunkKind, Chunks};
use locus_proto::{outboard, BlobHash};
use prost::Message;

use super::outboards::OutboardFile;
use super::*;

impl BlobStore {
    /// Starts a blob that will arrive chunk by chunk (a reader wants a range before the
    /// whole blob, or a transfer resumes). Its space is held from now on. Nothing to do
    /// when it is already complete or started.
    pub fn begin_partial(
        self: &Arc<Self>,
        hash: BlobHash,
        size: u64,
        chunk_size: u32,
        (kind, chunks): (ChunkKind, &[BlobHash]),
        keep: impl Into<Keep>,
    ) -> Result<(), StoreError> {
        let Keep { pin, team } = keep.into();
        if self.contains(&hash) || self.shard(&hash).partials.contains_key(&hash) {
            return Ok(());
        }
        let chunk_size = checked_chunk_size(hash, chunk_size)?;
        let want = locus_proto::manifest::chunk_count(size, chunk_size);
        if chunks.len() as u64 != want {
            return Err(StoreError::Mismatch {
                hash,
                what: format!(
                    "{} chunk hashes for a blob of {size} bytes ({want} chunks)",
                    chunks.len()
                ),
            });
        }
        let (dir, reservation) = self.reserve(size, Keep { pin: false, team })?;
        let path = self.partial_path_in(dir, &hash);
        let f = File::create(&path).map_err(io)?;
        f.set_len(size).map_err(io)?;
        f.sync_all().map_err(io)?;
        fsync_dir(path.parent().expect("partial paths have a parent"))?;
        let rec = BlobRecord {
            size,
            dir,
            pinned: false,
            chunk_size,
            chunks: chunks.iter().flat_map(|c| c.0).collect(),
            partial: true,
            present: vec![0u8; want.div_ceil(8) as usize],
            verified: None,
            pin_when_complete: pin,
            pack: 0,
            offset: 0,
            tree_chunks: kind.is_tree(),
            team: u32::from(team.0),
            pinned_at: 0,
        };
        self.index
            .put(hash.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let mut st = self.shard(&hash);
        // The reservation becomes use, evictable until the blob is complete.
        self.books().add(size, false, team);
        let m = Meta {
            rec,
            last_access: self.tick.fetch_add(1, Ordering::Relaxed),
        };
        st.track(hash, &m);
        st.partials.insert(hash, m);
        drop(st);
        drop(reservation);
        Ok(())
    }

    /// Stores chunk `i` of a partly present blob after checking it against its hash. The
    /// bit is set only once the bytes are synced. When the last chunk arrives the whole
    /// blob is re-hashed and moved into `blobs/`. Returns true when the blob is complete.
    pub fn write_chunk(&self, h: &BlobHash, i: u64, data: &[u8]) -> Result<bool, StoreError> {
        use std::os::unix::fs::FileExt;
        let rec = match self.shard(h).partials.get(h) {
            Some(m) => m.rec.clone(),
            None if self.contains(h) => return Ok(true),
            None => return Err(StoreError::NotFound(*h)),
        };
        let cs = u64::from(rec.chunk_size);
        if i >= rec.chunk_count() {
            return Err(StoreError::Mismatch {
                hash: *h,
                what: format!("chunk {i} of a blob with {} chunks", rec.chunk_count()),
            });
        }
        let expect_len = cs.min(rec.size - i * cs);
        let want = rec.chunk_hashes(h)[i as usize];
        if data.len() as u64 != expect_len || rec.chunk_at(i).hash(data) != want {
            return Err(StoreError::Mismatch {
                hash: *h,
                what: format!("chunk {i} does not match its hash"),
            });
        }
        if rec.has_chunk(i) {
            return Ok(false);
        }
        let path = self.partial_path_in(rec.dir, h);
        let f = std::fs::OpenOptions::new().write(true).open(&path).map_err(io)?;
        f.write_all_at(data, i * cs).map_err(io)?;
        f.sync_data().map_err(io)?;
        let mut st = self.shard(h);
        let Some(m) = st.partials.get_mut(h) else {
            return Err(StoreError::NotFound(*h));
        };
        m.rec.present[(i / 8) as usize] |= 1 << (i % 8);
        let rec = m.rec.clone();
        drop(st);
        self.index
            .put(h.0, rec.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        if !rec.missing().is_empty() {
            return Ok(false);
        }
        // Complete: the whole-blob hash is the final word before it becomes visible.
        let (_, whole, _) = hash_file(&path, rec.chunk_size, ChunkKind::Tree).map_err(io)?;
        if whole != *h {
            self.move_to_quarantine(&path, h);
            self.forget(h);
            return Err(StoreError::Corrupt {
                hash: *h,
                what: "all chunks matched but the whole blob does not".into(),
            });
        }
        let dest = self.blob_path_in(rec.dir, h);
        let parent = dest.parent().expect("blob paths have a parent");
        fs::create_dir_all(parent).map_err(io)?;
        fs::rename(&path, &dest).map_err(io)?;
        let renamed = stamp(&dest).ok();
        fsync_dir(parent)?;
        // Just hashed whole (see `BlobWriter::finish`).
        let verified = record::stamp_published(renamed, &dest);
        let pin = rec.pin_when_complete;
        let mut done = BlobRecord {
            partial: false,
            present: Vec::new(),
            verified: verified.map(Into::into),
            pin_when_complete: false,
            ..rec
        };
        done.compact();
        self.index
            .put(h.0, done.encode_to_vec())
            .map_err(|e| StoreError::Index(e.into_string()))?;
        let mut st = self.shard(h);
        if let Some(m) = st.partials.remove(h) {
            st.blobs.insert(h.to_owned(), Meta { rec: done, ..m });
            if let Some(v) = verified {
                st.verified.insert(*h, v);
            }
        }
        drop(st);
        if pin {
            self.set_pinned(h, true)?;
        }
        Ok(true)
    }

    /// Starts writing a blob. `None` when it is already here (it is pinned if asked).
    pub fn begin_write(
        self: &Arc<Self>,
        hash: BlobHash,
        size: u64,
        chunk_size: u32,
        keep: impl Into<Keep>,
    ) -> Result<Option<BlobWriter>, StoreError> {
        let keep = keep.into();
        if self.contains(&hash) {
            if keep.pin {
                self.set_pinned(&hash, true)?;
            }
            return Ok(None);
        }
        // Named: the store's own chunk hashes, the kind it gets in one pass.
        self.writer(Some(hash), size, (chunk_size, ChunkKind::Tree), keep)
            .map(Some)
    }

    /// Starts writing a blob whose name is not known yet: it is named by the hash of
    /// what arrives (an object this node reads from a version's origin for an import,
    /// whose chunk hashes, of the kind the version records, go into its manifest).
    pub fn begin_unnamed_write(
        self: &Arc<Self>,
        size: u64,
        (chunk_size, kind): (u32, ChunkKind),
        keep: impl Into<Keep>,
    ) -> Result<BlobWriter, StoreError> {
        self.writer(None, size, (chunk_size, kind), keep.into())
    }

    fn writer(
        self: &Arc<Self>,
        hash: Option<BlobHash>,
        size: u64,
        (chunk_size, kind): (u32, ChunkKind),
        Keep { pin, team }: Keep,
    ) -> Result<BlobWriter, StoreError> {
        let chunk_size = checked_chunk_size(hash.unwrap_or(BlobHash([0; 32])), chunk_size)?;
        let (dir, reservation) = self.reserve_as_written(size, Keep { pin, team })?;
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let name = match &hash {
            Some(h) => format!("{}.{tick}", hex(h)),
            None => format!("unnamed.{tick}"),
        };
        let tmp = self.cfg.dirs[dir as usize].join("tmp").join(&name);
        let file = super::direct::BlobFile::create(&tmp, size).map_err(io)?;
        // A blob of one chunk has the same chunk hash under both kinds (its own): hashed
        // once, as a tree.
        let kind = match size > u64::from(chunk_size) {
            true => kind,
            false => ChunkKind::Tree,
        };
        let hashes = || Whole::Hashes(Box::new(ChunkHasher::new(chunk_size, kind)));
        let whole = match size > super::outboards::KEEP_ABOVE {
            true => match OutboardFile::create(tmp.with_file_name(format!("{name}.ob"))) {
                Ok(f) => {
                    let mut b = outboard::Builder::new(size, f);
                    if kind.is_tree() {
                        b.keep_chunks(chunk_size);
                    }
                    Whole::Tree(Box::new(b))
                }
                Err(e) => {
                    tracing::warn!("cannot start an outboard file; the blob keeps none: {e}");
                    hashes()
                }
            },
            false => hashes(),
        };
        // Plain chunk hashes beside a tree: their own pass (versions recorded before tree
        // chunk hashes, imported by a node from an origin).
        let chunks = (matches!(whole, Whole::Tree(_)) && !kind.is_tree()).then(|| Chunks::new(chunk_size));
        Ok(BlobWriter {
            store: self.clone(),
            hash,
            size,
            chunk_size,
            pin,
            dir,
            tmp,
            file: Some(file),
            whole,
            kind,
            chunks,
            written: 0,
            reservation,
        })
    }
}

/// What a finished write stored: the blob's hashes, and whether the blob was here
/// already (an unnamed write of bytes the store held: nothing new was kept).
#[derive(Debug)]
pub struct Stored {
    pub hash: BlobHash,
    pub chunks: Vec<BlobHash>,
    pub already_present: bool,
}

/// A blob being written. Nothing is visible until `finish` verified it; dropping an
/// unfinished writer removes its temporary file and releases its space.
pub struct BlobWriter {
    store: Arc<BlobStore>,
    /// The name the bytes must hash to; None: whatever they hash to.
    hash: Option<BlobHash>,
    size: u64,
    chunk_size: u32,
    pin: bool,
    dir: u32,
    tmp: PathBuf,
    file: Option<super::direct::BlobFile>,
    /// The whole blob's hash and its chunk hashes, with its outboard for a blob that keeps
    /// one.
    whole: Whole,
    kind: ChunkKind,
    /// Plain chunk hashes beside a tree (which yields only tree ones).
    chunks: Option<Chunks>,
    written: u64,
    /// Grows as bytes arrive.
    reservation: Reservation,
}

enum Whole {
    Hashes(Box<ChunkHasher>),
    Tree(Box<outboard::Builder<OutboardFile>>),
    Taken,
}

impl BlobWriter {
    pub fn write(&mut self, data: &[u8]) -> Result<(), StoreError> {
        self.admit(data.len())?;
        self.file
            .as_mut()
            .expect("open until finish")
            .write_all(data)
            .map_err(io)?;
        self.absorb(data);
        Ok(())
    }

    /// `write` of a block a receiver filled straight from its socket: a full one goes to
    /// the device from the block's own buffer, with no copy.
    pub fn write_block(&mut self, b: &super::direct::Block) -> Result<(), StoreError> {
        self.admit(b.data().len())?;
        self.file
            .as_mut()
            .expect("open until finish")
            .write_block(b)
            .map_err(io)?;
        self.absorb(b.data());
        Ok(())
    }

    /// Room for `n` more bytes: no more than announced, and their space reserved.
    fn admit(&mut self, n: usize) -> Result<(), StoreError> {
        if self.written + n as u64 > self.size {
            return Err(StoreError::Mismatch {
                hash: self.hash.unwrap_or(BlobHash([0; 32])),
                what: "more bytes than announced".into(),
            });
        }
        // The last bytes hold the outboard's room too (`outboards::footprint`), so the
        // published blob never takes more than was reserved for it.
        let total = match self.written + n as u64 {
            t if t == self.size => super::outboards::footprint(t),
            t => t,
        };
        let cap = super::outboards::footprint(self.size);
        self.reservation.grow_to(self.written, total, cap)
    }

    /// Hashes bytes written: the whole blob's hash (and outboard) and the chunks'.
    fn absorb(&mut self, data: &[u8]) {
        self.written += data.len() as u64;
        match &mut self.whole {
            Whole::Hashes(h) => h.update(data),
            Whole::Tree(b) => b.update(data),
            Whole::Taken => {}
        }
        if let Some(c) = &mut self.chunks {
            c.update(data);
        }
    }

    /// Verifies, syncs and publishes the blob.
    pub fn finish(self) -> Result<(), StoreError> {
        self.finish_stored().map(|_| ())
    }

    /// `finish`, saying what was stored.
    pub fn finish_stored(mut self) -> Result<Stored, StoreError> {
        let (got, chunks, file, outboard) = match self.verify()? {
            Verified::Here(stored) => return Ok(stored),
            Verified::Written {
                got,
                chunks,
                file,
                outboard,
            } => (got, chunks, file, outboard),
        };
        file.sync_all().map_err(io)?;
        drop(file);
        if let Some(ob) = outboard {
            self.store.publish_outboard(&ob, self.dir, &got);
        }
        let dest = self.store.blob_path_in(self.dir, &got);
        let parent = dest.parent().expect("blob paths have a parent");
        fs::create_dir_all(parent).map_err(io)?;
        fs::rename(&self.tmp, &dest).map_err(io)?;
        let renamed = stamp(&dest).ok();
        fsync_dir(parent)?;
        let rec = self.record(&chunks, &dest, renamed);
        self.store.insert(got, rec)?;
        Ok(Stored {
            hash: got,
            chunks,
            already_present: false,
        })
    }

    /// Checks what arrived: the announced size, and the name it must hash to. A blob
    /// named only now that the store holds already is dropped here (and pinned if asked).
    pub(super) fn verify(&mut self) -> Result<Verified, StoreError> {
        if self.written != self.size {
            // Not how many arrived: for a write the node fills from an origin that would
            // tell the caller the size of a file it may not read.
            return Err(StoreError::Mismatch {
                hash: self.hash.unwrap_or(BlobHash([0; 32])),
                what: "fewer bytes than announced".into(),
            });
        }
        let (got, chunks, outboard) = match std::mem::replace(&mut self.whole, Whole::Taken) {
            Whole::Hashes(h) => {
                let (_, got, chunks) = h.finish();
                (got, chunks, None)
            }
            Whole::Tree(b) => {
                let (root, f, tree) = b.finish_with_chunks().expect("the announced size arrived");
                let chunks = match self.chunks.take() {
                    Some(c) => c.finish(),
                    None => tree,
                };
                (root, chunks, Some(f))
            }
            Whole::Taken => unreachable!("verified once"),
        };
        match self.hash {
            Some(want) if got != want => {
                return Err(StoreError::Mismatch {
                    hash: want,
                    what: format!("the bytes hash to {got}"),
                })
            }
            None if self.store.contains(&got) => {
                // Named only now, and held already: keep the copy we have.
                drop(self.file.take());
                let _ = fs::remove_file(&self.tmp);
                if self.pin {
                    self.store.set_pinned(&got, true)?;
                }
                return Ok(Verified::Here(Stored {
                    hash: got,
                    chunks,
                    already_present: true,
                }));
            }
            _ => {}
        }
        let file = self
            .file
            .take()
            .expect("open until finish")
            .finish()
            .map_err(io)?;
        // Derived data: a failed outboard write costs a recomputation, not the blob.
        let outboard = outboard.and_then(|f| {
            f.done()
                .map_err(|e| tracing::warn!(blob = %got, "cannot write the blob's outboard: {e}"))
                .ok()
        });
        Ok(Verified::Written {
            got,
            chunks,
            file,
            outboard,
        })
    }

    /// The index record of the blob now at `dest`.
    fn record(&self, chunks: &[BlobHash], dest: &std::path::Path, renamed: Option<FileStamp>) -> BlobRecord {
        let mut rec = BlobRecord::complete(
            self.size,
            self.dir,
            self.pin,
            self.chunk_size,
            (self.kind, chunks),
        );
        rec.team = u32::from(self.reservation.keep.team.0);
        // The bytes were hashed on the way in, so the first `verified_path` after an
        // import or a copy from a peer need not read the file whole again (what made a
        // cold passthrough open of a large file cost a full read before the kernel's
        // own). Only if nobody wrote to the file between its rename and now: the
        // directory's fsync in between once let a file truncated by someone else right
        // after the rename be recorded as verified, and served short.
        rec.verified = record::stamp_published(renamed, dest).map(Into::into);
        rec
    }
}

impl BlobWriter {
    /// Verifies the blob like `finish`, but leaves it unsynced and unpublished: one of a
    /// batch that `BlobStore::commit_batch` makes durable and visible at once.
    pub fn finish_staged(mut self) -> Result<super::batch::Staged, StoreError> {
        let (hash, chunks, tmp, reservation) = match self.verify()? {
            Verified::Here(s) => (s.hash, s.chunks, None, None),
            Verified::Written {
                got,
                chunks,
                file,
                outboard,
            } => {
                drop(file);
                // Before the batch commits: an outboard of a blob that then fails to
                // commit is only a file for bytes this node does not hold.
                if let Some(ob) = outboard {
                    self.store.publish_outboard(&ob, self.dir, &got);
                }
                // The batch owns the file and the space now (this writer's drop
                // removes a file only while it still holds it open).
                (
                    got,
                    chunks,
                    Some(std::mem::take(&mut self.tmp)),
                    Some(self.reservation.take()),
                )
            }
        };
        Ok(super::batch::Staged {
            hash,
            chunks,
            kind: self.kind,
            size: self.size,
            chunk_size: self.chunk_size,
            pin: self.pin,
            dir: self.dir,
            tmp,
            _reservation: reservation,
        })
    }
}

pub(super) enum Verified {
    /// The store had it already.
    Here(Stored),
    /// Verified, written to its temporary file, not synced.
    Written {
        got: BlobHash,
        chunks: Vec<BlobHash>,
        file: File,
        /// The blob's outboard, written to its temporary file.
        outboard: Option<PathBuf>,
    },
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}
