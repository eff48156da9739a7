//! Reading blobs: ranges verified chunk by chunk before a byte is returned, whole-blob
//! verification (scrub, first direct reads) and the verified path same-host readers get.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use locus_proto::{outboard, BlobHash};
use prost::Message;

use super::*;

impl BlobStore {
    /// Reads `[offset, offset + len)` of a blob, verifying every chunk it touches first.
    /// A chunk that fails sends the blob to quarantine. The whole range is returned at
    /// once: for ranges of any size use [`BlobStore::open_reader`].
    pub fn read_range(self: &Arc<Self>, h: &BlobHash, offset: u64, len: u64) -> Result<Vec<u8>, StoreError> {
        let mut r = self.open_reader(h, offset, len)?;
        let mut out = Vec::with_capacity(r.remaining().min(64 << 20) as usize);
        while let Some(piece) = r.next_piece()? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }

    /// Opens `[offset, offset + len)` of a blob (`len == 0`: to its end) for reading in
    /// verified pieces. Fails at once if the blob is absent or a chunk of the range is not
    /// here yet.
    pub fn open_reader(
        self: &Arc<Self>,
        h: &BlobHash,
        offset: u64,
        len: u64,
    ) -> Result<BlobReader, StoreError> {
        let (rec, at) = {
            let mut st = self.shard(h);
            let tick = self.tick.fetch_add(1, Ordering::Relaxed);
            let (rec, at) = if let Some(m) = st.blobs.get(h) {
                (m.rec.clone(), self.location(h, &m.rec))
            } else {
                let m = st.partials.get(h).ok_or(StoreError::NotFound(*h))?;
                let path = self.partial_path_in(m.rec.dir, h);
                (
                    m.rec.clone(),
                    Located {
                        path,
                        offset: 0,
                        packed: false,
                    },
                )
            };
            st.touch(h, tick);
            (rec, at)
        };
        let Located {
            path, offset: base, ..
        } = at;
        let end = if len == 0 {
            rec.size
        } else {
            offset.saturating_add(len).min(rec.size)
        };
        let cs = u64::from(rec.chunk_size);
        if rec.partial && offset < end {
            let missing: Vec<u64> = (offset / cs..=(end - 1) / cs)
                .filter(|c| !rec.has_chunk(*c))
                .collect();
            if !missing.is_empty() {
                return Err(StoreError::NotPresent { hash: *h, missing });
            }
        }
        let file = File::open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                self.forget(h);
                StoreError::NotFound(*h)
            } else {
                io(e)
            }
        })?;
        // A complete blob whose file is unchanged since it was last hashed whole (its
        // write, a scrub, a verify) is served without hashing it again: the reader checks
        // every chunk itself, and bit rot under an unchanged stamp is the scrub's to find,
        // as for the same-host clients that read the file directly.
        let trusted = match (rec.partial, record::stamp_file(&file)) {
            (false, Ok(now)) if self.shard(h).verified.get(h) == Some(&now) => Some(now),
            _ => None,
        };
        Ok(BlobReader {
            trusted,
            store: self.clone(),
            hash: *h,
            hashes: rec.chunk_hashes(h),
            kind: ChunkKind::from_tree(rec.tree_chunks),
            chunk_size: cs,
            size: rec.size,
            path,
            file,
            base,
            pos: offset.min(end),
            end,
            checked: None,
        })
    }

    /// Re-hashes a whole blob, a chunk at a time, through one open file read front to
    /// back (so the kernel's read-ahead works and the page cache it fills is laid out
    /// for fast sequential readers, who usually come next). Ok(false) (and quarantine)
    /// when it no longer matches; partly present blobs are checked chunk by chunk on
    /// every read instead.
    pub fn verify(&self, h: &BlobHash) -> Result<bool, StoreError> {
        let (
            rec,
            Located {
                path,
                offset: base,
                packed,
            },
        ) = {
            let st = self.shard(h);
            match st.blobs.get(h) {
                Some(m) => (m.rec.clone(), self.location(h, &m.rec)),
                None => return Ok(true),
            }
        };
        let f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(h);
                return Ok(true);
            }
            Err(e) => return Err(io(e)),
        };
        self.whole_hashes.fetch_add(1, Ordering::Relaxed);
        // Bytes appended to the file would be read by the kernel through passthrough.
        let len = f.metadata().map_err(io)?.len();
        let fits = if packed {
            len >= base + rec.size
        } else {
            len == rec.size
        };
        if !fits {
            self.corrupt(
                h,
                &path,
                format!("file is {len} bytes, the blob {} at {base}", rec.size),
            );
            return Ok(false);
        }
        let mut at = base;
        let hashes = rec.chunk_hashes(h);
        let cs = u64::from(rec.chunk_size);
        // A blob that should keep an outboard and has none (stored by an earlier build,
        // or its file was lost): built in this pass, so the scrub converts an old store
        // in one round, whatever the blobs' sizes.
        let mut tree = self
            .missing_outboard(h)
            .map(|f| outboard::Builder::new(rec.size, f));
        // Hashed through a bounded buffer whatever the chunk size (up to 1 GiB).
        let mut buf = vec![0u8; cs.min(rec.size).min(WHOLE_CHUNK_MAX) as usize];
        let mut start = 0;
        let mut c = 0usize;
        while start < rec.size {
            let clen = cs.min(rec.size - start);
            let mut hasher = rec.chunk_at(c as u64).hasher();
            let mut done = 0;
            while done < clen {
                let n = (buf.len() as u64).min(clen - done) as usize;
                if let Err(e) = f.read_exact_at(&mut buf[..n], at) {
                    self.corrupt(h, &path, format!("chunk {c} unreadable: {e}"));
                    return Ok(false);
                }
                hasher.update(&buf[..n]);
                if let Some(t) = &mut tree {
                    t.update(&buf[..n]);
                }
                done += n as u64;
                at += n as u64;
            }
            if hashes.get(c) != Some(&hasher.finish()) {
                self.corrupt(h, &path, format!("chunk {c} hash mismatch"));
                return Ok(false);
            }
            start += clen;
            c += 1;
        }
        if let Some((root, f)) = tree.and_then(outboard::Builder::finish) {
            // Equal, as every chunk matched; checked anyway, as it is kept.
            match (root == *h, f.done()) {
                (true, Ok(tmp)) => self.publish_outboard(&tmp, rec.dir, h),
                (_, Ok(tmp)) => {
                    let _ = std::fs::remove_file(tmp);
                }
                (_, Err(e)) => tracing::warn!(blob = %h, "cannot write the blob's outboard: {e}"),
            }
        }
        Ok(true)
    }

    /// How many blobs `verify` has hashed whole since the store was opened.
    pub fn whole_hashes(&self) -> u64 {
        self.whole_hashes.load(Ordering::Relaxed)
    }

    /// The path of a complete local blob whose file is known to hold the right bytes,
    /// for clients that read the file directly (the mount hands it to the kernel, which
    /// then reads it without us). The first request after any change to the file hashes
    /// it whole; later ones only compare the file's stamp. None when the blob is absent
    /// or failed the check (it is then quarantined and must be fetched again).
    pub fn verified_path(&self, h: &BlobHash) -> Result<Option<Located>, StoreError> {
        let Some(at) = self.locate(h) else {
            return Ok(None);
        };
        let before = match stamp(&at.path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(h);
                return Ok(None);
            }
            Err(e) => return Err(io(e)),
        };
        if self.shard(h).verified.get(h) == Some(&before) {
            return Ok(Some(at));
        }
        if !self.verify(h)? {
            return Ok(None);
        }
        // The stamp from before hashing: a write during the hash changes the ctime, so
        // the next request hashes again.
        self.record_stamp(h, before);
        Ok(Some(at))
    }

    /// The path of a complete blob whose file still has the stamp of its last whole-blob
    /// check, with that stamp; None when it is absent, partial or changed since (the
    /// caller then asks `verified_path`, which hashes). Marks it recently used. Never
    /// hashes: one stat per blob.
    pub fn trusted_path(&self, h: &BlobHash) -> Option<(Located, FileStamp)> {
        let at = self.locate(h)?;
        let now = stamp(&at.path).ok()?;
        (self.shard(h).verified.get(h) == Some(&now)).then_some((at, now))
    }

    /// Remembers a verified file's stamp, in memory and in the blob's index record.
    fn record_stamp(&self, h: &BlobHash, s: FileStamp) {
        let mut st = self.shard(h);
        st.verified.insert(*h, s);
        let Some(m) = st.blobs.get_mut(h) else {
            return;
        };
        m.rec.verified = Some(s.into());
        let rec = m.rec.encode_to_vec();
        drop(st);
        // Losing it only costs one hash after a restart.
        if let Err(e) = self.index.put(h.0, rec) {
            tracing::warn!(blob = %h, "cannot record the blob's verification: {}", e.into_string());
        }
    }
}

/// Chunks up to this size are read and checked in one buffer. A larger chunk (chunk sizes
/// go up to 1 GiB) is hashed in pieces first and then served in pieces while its file is
/// unchanged, so a read never holds more than this much of a blob in memory.
pub const WHOLE_CHUNK_MAX: u64 = 8 << 20;
/// Piece size for chunks larger than `WHOLE_CHUNK_MAX`.
const LARGE_PIECE: u64 = 2 << 20;

/// A verified read of part of a blob, a piece at a time (see [`BlobStore::open_reader`]).
/// Each `next_piece` is blocking file I/O: call it from a blocking thread.
pub struct BlobReader {
    store: Arc<BlobStore>,
    hash: BlobHash,
    hashes: Vec<BlobHash>,
    kind: ChunkKind,
    chunk_size: u64,
    size: u64,
    path: std::path::PathBuf,
    file: File,
    /// Where the blob starts in `file` (0 unless packed).
    base: u64,
    pos: u64,
    end: u64,
    /// A large chunk already hashed whole, and the file's stamp from before that hash:
    /// its pieces are served only while the stamp still matches.
    checked: Option<(u64, FileStamp)>,
    /// The file's stamp when it matched its last whole-blob verification: pieces are read
    /// without hashing while it still matches.
    trusted: Option<FileStamp>,
}

impl std::fmt::Debug for BlobReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobReader")
            .field("hash", &self.hash)
            .field("pos", &self.pos)
            .field("end", &self.end)
            .finish()
    }
}

impl BlobReader {
    fn chunk_at(&self, c: u64, clen: u64) -> locus_proto::chunks::ChunkAt {
        locus_proto::chunks::ChunkAt::new(self.kind, c * self.chunk_size, clen, self.size)
    }

    /// Bytes not yet returned.
    pub fn remaining(&self) -> u64 {
        self.end - self.pos
    }

    /// For a range that needs no hashing on the way out (the file is unchanged since
    /// its last whole-blob check): the open file and where the remaining bytes start in
    /// it, for a caller that hands them to the kernel (`sendfile`) instead of reading
    /// them through [`BlobReader::next_piece`]. None: pieces must be hashed.
    pub fn trusted_span(&self) -> Option<(&File, u64)> {
        self.trusted.map(|_| (&self.file, self.base + self.pos))
    }

    /// After the rest of a trusted span was sent by the caller: whether the file kept the
    /// stamp it was trusted under while it was read (a changed file goes to quarantine,
    /// and the bytes sent must be thrown away by whoever got them).
    pub fn finish_span(&mut self) -> Result<(), StoreError> {
        let Some(before) = self.trusted else {
            return Ok(());
        };
        if record::stamp_file(&self.file).map_err(io)? != before {
            let c = self.pos / self.chunk_size;
            return Err(self.corrupt(format!("chunk {c} changed while it was being read")));
        }
        self.pos = self.end;
        Ok(())
    }

    fn corrupt(&self, what: String) -> StoreError {
        self.store.corrupt(&self.hash, &self.path, what)
    }

    /// The rest of the range read from the file as it is, unhashed: for a caller that
    /// checks the bytes itself (a verified range, against the chunk's outboard) and calls
    /// [`BlobReader::reject`] when they fail. At most `WHOLE_CHUNK_MAX` bytes.
    pub fn unchecked_rest(&mut self) -> Result<Vec<u8>, StoreError> {
        let n = self.remaining();
        if n > WHOLE_CHUNK_MAX {
            return Err(StoreError::Io(format!(
                "{n} bytes are more than one unchecked read may take"
            )));
        }
        let mut buf = vec![0u8; n as usize];
        let c = self.pos / self.chunk_size;
        self.read_at(&mut buf, self.pos, c)?;
        self.pos = self.end;
        Ok(buf)
    }

    /// The caller found the bytes it read wrong: the blob goes to quarantine, as when a
    /// chunk fails its hash here.
    pub fn reject(&self, what: String) -> StoreError {
        self.corrupt(what)
    }

    /// Reads blob bytes at `at` (an offset in the blob).
    fn read_at(&self, buf: &mut [u8], at: u64, c: u64) -> Result<(), StoreError> {
        self.file
            .read_exact_at(buf, self.base + at)
            .map_err(|e| self.corrupt(format!("chunk {c} unreadable: {e}")))
    }

    /// The next verified piece of the range (at most one chunk, or `LARGE_PIECE` of a
    /// large one); None at the end.
    pub fn next_piece(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        if self.pos >= self.end {
            return Ok(None);
        }
        let cs = self.chunk_size;
        let c = self.pos / cs;
        let start = c * cs;
        let clen = cs.min(self.size - start);
        let want = self.hashes.get(c as usize).copied();
        let stop = self.end.min(start + clen);
        if let Some(before) = self.trusted {
            // Only the asked-for bytes, in bounded pieces.
            let n = (stop - self.pos).min(WHOLE_CHUNK_MAX);
            let mut buf = vec![0u8; n as usize];
            self.read_at(&mut buf, self.pos, c)?;
            if record::stamp_file(&self.file).map_err(io)? != before {
                return Err(self.corrupt(format!("chunk {c} changed while it was being read")));
            }
            self.pos += n;
            return Ok(Some(buf));
        }
        if clen <= WHOLE_CHUNK_MAX {
            let mut buf = vec![0u8; clen as usize];
            self.read_at(&mut buf, start, c)?;
            if want != Some(self.chunk_at(c, clen).hash(&buf)) {
                return Err(self.corrupt(format!("chunk {c} hash mismatch")));
            }
            buf.truncate((stop - start) as usize);
            buf.drain(..(self.pos - start) as usize);
            self.pos = stop;
            return Ok(Some(buf));
        }
        let before = match self.checked {
            Some((k, s)) if k == c => s,
            _ => {
                let before = record::stamp_file(&self.file).map_err(io)?;
                let mut hasher = self.chunk_at(c, clen).hasher();
                let mut buf = vec![0u8; LARGE_PIECE as usize];
                let mut at = start;
                while at < start + clen {
                    let n = LARGE_PIECE.min(start + clen - at) as usize;
                    self.read_at(&mut buf[..n], at, c)?;
                    hasher.update(&buf[..n]);
                    at += n as u64;
                }
                if want != Some(hasher.finish()) {
                    return Err(self.corrupt(format!("chunk {c} hash mismatch")));
                }
                self.checked = Some((c, before));
                before
            }
        };
        let n = LARGE_PIECE.min(stop - self.pos);
        let mut buf = vec![0u8; n as usize];
        self.read_at(&mut buf, self.pos, c)?;
        // Any write to the file since the hash changed its ctime: the bytes just read may
        // not be the ones that were checked.
        if record::stamp_file(&self.file).map_err(io)? != before {
            return Err(self.corrupt(format!("chunk {c} changed while it was being read")));
        }
        self.pos += n;
        Ok(Some(buf))
    }
}
