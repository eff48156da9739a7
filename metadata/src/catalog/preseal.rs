//! The commit's pass over a manifest — parents exist, tallies per shard, the sealed
//! namespace built entry by entry — done while the manifest is uploaded when it can be.
//!
//! Importers send pages in catalogue order, which is the namespace's order. While a
//! session's pages arrive so, each stored page is handed to a sealing thread of that
//! session, which runs on the core the upload leaves idle (the service stores a page on
//! one thread); the commit then only finishes the namespace. At 10M entries this takes the
//! 12 s pass off the commit. The state lives in memory only: a page out of order, a missed
//! page, a sealing error, a restarted service or a new group leader each fall back to the
//! one pass over the stored manifest at commit (`scan`), which gives the same answer and
//! reports errors in its words.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread::JoinHandle;

use super::sessions::{sealable, sealing, split_entry};
use super::*;
use locus_proto::chunks::ChunkKind;
use locus_proto::sealed::Writer;

/// Sessions sealed during upload at once; further sessions are sealed at their commit.
const MAX_SESSIONS: usize = 16;

/// Pages queued for a session's sealing thread before the upload waits for it.
const QUEUED_PAGES: usize = 8;

/// Entries handed to the scan's sealing thread at a time.
const SEAL_BATCH: usize = 4096;

pub(super) type Sealer = Writer<std::io::Sink>;

/// A manifest's counts, as its version records them.
#[derive(Default)]
pub(super) struct Tally {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Shard → (bytes, files).
    pub per_shard: BTreeMap<u32, (u64, u64)>,
}

impl Tally {
    fn count(&mut self, e: &EntryRecord) {
        match e.kind {
            KIND_FILE => {
                self.files += 1;
                self.bytes += e.size;
                let t = self.per_shard.entry(e.shard).or_default();
                t.0 += e.size;
                t.1 += 1;
            }
            KIND_DIR => self.dirs += 1,
            _ => self.symlinks += 1,
        }
    }
}

struct Session {
    /// The entry page it expects next; the session's own count, or a page was missed.
    next_page: u64,
    entries: u64,
    tx: SyncSender<Vec<Entry>>,
    thread: JoinHandle<std::result::Result<(Tally, Sealer), locus_proto::sealed::SealError>>,
}

/// The sessions being sealed during their upload.
#[derive(Default)]
pub(super) struct Preseals(Mutex<HashMap<u64, Session>>);

impl Preseals {
    /// Page `page` of session `uid` was stored. `ordered`: its entries are in catalogue
    /// order and above every entry stored before them. Called under the sessions lock,
    /// so pages come one at a time; blocks while the session's thread is `QUEUED_PAGES`
    /// behind.
    pub fn stored(&self, uid: u64, page: u64, ordered: bool, entries: Vec<Entry>, chunks: (u32, ChunkKind)) {
        let mut sessions = lock(&self.0);
        if !ordered {
            sessions.remove(&uid);
            return;
        }
        if page == 0 && sessions.len() < MAX_SESSIONS {
            let (tx, rx) = sync_channel::<Vec<Entry>>(QUEUED_PAGES);
            let thread = std::thread::Builder::new()
                .name(format!("seal-{uid}"))
                .spawn(move || {
                    let mut sealer = Writer::with_kind(std::io::sink(), chunks.0, chunks.1)?;
                    let mut tally = Tally::default();
                    for page in rx {
                        for e in page {
                            // Through the stored record, as the scan at commit sees it.
                            let r = entry_record(&e);
                            tally.count(&r);
                            let e = Entry::try_from(entry_pb(e.path.as_str().to_string(), r, true))
                                .map_err(|x| locus_proto::sealed::SealError::Io(x.to_string()))?;
                            sealer.push(&e)?;
                        }
                    }
                    Ok((tally, sealer))
                });
            match thread {
                Ok(thread) => {
                    sessions.insert(
                        uid,
                        Session {
                            next_page: 0,
                            entries: 0,
                            tx,
                            thread,
                        },
                    );
                }
                Err(e) => tracing::warn!("no thread to seal session {uid} during its upload: {e}"),
            }
        }
        let Some(s) = sessions.get_mut(&uid) else {
            return;
        };
        let n = entries.len() as u64;
        if s.next_page != page || s.tx.send(entries).is_err() {
            // A missed page, or the thread stopped on an error: the commit's scan decides.
            sessions.remove(&uid);
            return;
        }
        s.next_page += 1;
        s.entries += n;
    }

    /// Drops what was sealed of session `uid` (aborted, reaped, or sent out of order).
    pub fn forget(&self, uid: u64) {
        lock(&self.0).remove(&uid);
    }

    /// Whether session `uid` is being sealed during its upload.
    #[cfg(test)]
    pub fn active(&self, uid: u64) -> bool {
        lock(&self.0).contains_key(&uid)
    }

    /// The finished pass of session `uid`, if every one of its `pages` pages (`entries`
    /// entries) went through it without error.
    fn take(&self, uid: u64, pages: u64, entries: u64) -> Option<(Tally, Sealer)> {
        let s = lock(&self.0).remove(&uid)?;
        if (s.next_page, s.entries) != (pages, entries) {
            return None;
        }
        drop(s.tx);
        match s.thread.join() {
            Ok(Ok(done)) => Some(done),
            Ok(Err(e)) => {
                tracing::debug!("session {uid} sealed during upload failed ({e}); its commit scans");
                None
            }
            Err(_) => None,
        }
    }
}

impl Catalog {
    /// The commit's pass over session `uid`'s manifest: from its sealing during upload, or
    /// by reading the stored manifest.
    pub(super) fn manifest_pass(&self, uid: u64, rec: &SessionRecord) -> Result<(Tally, Sealer)> {
        let chunks = (rec.chunk_size, ChunkKind::from_tree(rec.tree_chunks));
        if let Some(done) = self.preseals.take(uid, rec.next_entry_page, rec.entries) {
            return Ok(done);
        }
        self.scan(uid, chunks)
    }

    /// One pass over the stored manifest: parents exist and are directories, tallies per
    /// shard, and the sealed namespace built as it goes (entries come in its order). The
    /// sealing (each entry converted, checked, encoded and hashed) runs on a second thread
    /// fed in batches while this one reads the store.
    fn scan(&self, uid: u64, chunks: (u32, ChunkKind)) -> Result<(Tally, Sealer)> {
        let (from, to) = keys::uid_range(uid);
        let mut tally = Tally::default();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(String, EntryRecord)>>(8);
        let (read, sealed) = std::thread::scope(|scope| {
            let sealing_thread = scope.spawn(move || {
                let mut sealer = Writer::with_kind(std::io::sink(), chunks.0, chunks.1).map_err(sealing)?;
                for batch in rx {
                    for (path, e) in batch {
                        sealer.push(&sealable(path, e)?).map_err(sealing)?;
                    }
                }
                Ok::<_, CatalogError>(sealer)
            });
            let read = (|| {
                let mut group: Option<Vec<u8>> = None;
                let mut batch = Vec::with_capacity(SEAL_BATCH);
                for kv in self.store.scan(Table::Entries, &from, Some(&to)) {
                    let (k, v) = kv?;
                    let (dir, name) = split_entry(&k)?;
                    let dir_key = &k[..8 + dir.len()];
                    if group.as_deref() != Some(dir_key) {
                        if !dir.is_empty() {
                            let parent = self
                                .store
                                .get(Table::Entries, &keys::entry(uid, dir))?
                                .map(|b| decode::<EntryRecord>(Table::Entries, &b))
                                .transpose()?;
                            if parent.as_ref().map(|p| p.kind) != Some(KIND_DIR) {
                                return Err(CatalogError::Precondition(format!(
                                    "manifest is incomplete: {} is inside {dir:?}, which is not a \
                                     directory in the manifest",
                                    keys::join(dir, name)
                                )));
                            }
                        }
                        group = Some(dir_key.to_vec());
                    }
                    let e: EntryRecord = decode(Table::Entries, &v)?;
                    tally.count(&e);
                    batch.push((keys::join(dir, name), e));
                    if batch.len() == SEAL_BATCH && tx.send(std::mem::take(&mut batch)).is_err() {
                        // The sealing thread stopped on an error, which is the one reported.
                        return Ok(());
                    }
                    if batch.capacity() == 0 {
                        batch.reserve(SEAL_BATCH);
                    }
                }
                if !batch.is_empty() {
                    let _ = tx.send(batch);
                }
                Ok(())
            })();
            drop(tx);
            let sealer = sealing_thread.join().expect("the sealing thread does not panic");
            (read, sealer)
        });
        read?;
        Ok((tally, sealed?))
    }
}
