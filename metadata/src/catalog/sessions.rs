//! Import sessions: a version is built under an internal uid (entries and shards uploaded in pages) and
//! becomes visible in the one atomic write of its commit; abandoned sessions are reaped.

use super::*;
use locus_proto::chunks::ChunkKind;

/// Largest sealed namespace the catalogue keeps itself (a version without files).
pub const MAX_INLINE_NAMESPACE: u64 = 4 << 20;

/// How long an entry page that arrives one ahead of the next waits for its predecessor.
const PAGE_AHEAD_WAIT: Duration = Duration::from_secs(10);

/// A commit of at least this many entries flushes the store (`KvStore::flush`).
const FLUSH_AFTER_ENTRIES: u64 = 100_000;

/// Files whose blob → shard rows are derived at once during an upload: one table file
/// of ~56 MiB per window (`store::derive`), few enough that compactions stay cheap, and
/// a commit derives at most this many.
const INDEX_WINDOW: u64 = if cfg!(test) { 8 } else { 1 << 20 };

/// A version's namespace fields, as `bind_namespace` checked them.
pub(super) struct NamespaceFields {
    blob: Vec<u8>,
    size: u64,
    chunks: Vec<u8>,
    inline: Vec<u8>,
}

/// A stored entry as the sealed namespace's writer takes it.
pub(super) fn sealable(path: String, e: EntryRecord) -> Result<Entry> {
    Entry::try_from(entry_pb(path, e, true)).map_err(|x| CatalogError::Corrupt {
        table: "entries",
        reason: x.to_string(),
    })
}

/// An entry key's directory and name, or the table is corrupt.
pub(super) fn split_entry(k: &[u8]) -> Result<(&str, &str)> {
    keys::split_entry(k).ok_or_else(|| CatalogError::Corrupt {
        table: "entries",
        reason: "malformed key".into(),
    })
}

pub(super) fn sealing(e: locus_proto::sealed::SealError) -> CatalogError {
    CatalogError::Precondition(format!("the manifest cannot be sealed: {e}"))
}

impl Catalog {
    pub(super) fn session(&self, id: u64) -> Result<SessionRecord> {
        let v = self
            .store
            .get(Table::Sessions, &keys::uid(id))?
            .ok_or_else(|| self.no_session(id))?;
        decode(Table::Sessions, &v)
    }

    /// What a caller is told of a session that is not open (or, to a scoped token, not its
    /// own: the same words, so a session id reveals nothing of another team's import).
    pub fn no_session(&self, id: u64) -> CatalogError {
        CatalogError::NotFound(format!(
            "no open import session {id} (it was committed, aborted, or expired after {}s idle)",
            self.config.session_timeout.as_secs()
        ))
    }

    /// The dataset an open import session adds a version to.
    pub fn session_dataset(&self, id: u64) -> Result<String> {
        self.session(id).map(|s| s.dataset)
    }

    /// Records that `bytes` replicated bytes were placed for import session `id` (they
    /// replace what an earlier placement of the session held).
    pub fn hold_for_session(&self, id: u64, bytes: u64) -> Result<()> {
        let _s = lock(&self.sessions_lock);
        let mut rec = self.session(id)?;
        rec.placed_bytes = bytes;
        rec.last_active_ms = self.clock.now_ms();
        let mut b = Batch::default();
        b.put(Table::Sessions, keys::uid(id), rec.encode_to_vec());
        self.store.write(b, false)?;
        Ok(())
    }

    /// (dataset, bytes placed) of every open import session but `except`.
    pub fn held_by_sessions(&self, except: u64) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Sessions, b"", None) {
            let (k, v) = kv?;
            if keys::u64_value(&k).unwrap_or(0) == except {
                continue;
            }
            let rec: SessionRecord = decode(Table::Sessions, &v)?;
            if rec.placed_bytes > 0 {
                out.push((rec.dataset, rec.placed_bytes));
            }
        }
        Ok(out)
    }

    pub fn open_sessions(&self) -> Result<u64> {
        let mut n = 0;
        for kv in self.store.scan(Table::Sessions, b"", None) {
            kv?;
            n += 1;
        }
        Ok(n)
    }

    /// When the oldest open import session was begun (ms since the epoch); None when
    /// none is open. Nodes keep the pins of what was written since (`ListNodeBlobs`).
    pub fn oldest_open_session_ms(&self) -> Result<Option<i64>> {
        let mut oldest: Option<i64> = None;
        for kv in self.store.scan(Table::Sessions, b"", None) {
            let (_, v) = kv?;
            let rec: SessionRecord = decode(Table::Sessions, &v)?;
            oldest = Some(oldest.map_or(rec.created_at_ms, |o| o.min(rec.created_at_ms)));
        }
        Ok(oldest)
    }

    /// Opens an import session for the next version of `dataset`.
    pub fn begin_version(
        &self,
        dataset: &DatasetName,
        chunk_size: u32,
        origin: &str,
        replication: u32,
        tree_chunks: bool,
        principal: &str,
    ) -> Result<(u64, u32)> {
        let chunk_size = if chunk_size == 0 {
            locus_proto::DEFAULT_CHUNK_SIZE
        } else {
            chunk_size
        };
        if !chunk_size.is_power_of_two()
            || !(locus_proto::MIN_CHUNK_SIZE..=locus_proto::MAX_CHUNK_SIZE).contains(&chunk_size)
        {
            return Err(InvalidInput::new(
                "chunk_size",
                format!("{chunk_size} is not a power of two from 64 KiB to 1 GiB"),
            )
            .into());
        }
        let origin = if origin.is_empty() { "cluster" } else { origin };
        check_origin(origin)?;
        if replication > 16 {
            return Err(InvalidInput::new("replication", "at most 16 replicas").into());
        }
        let _s = lock(&self.sessions_lock);
        let uid = self
            .store
            .get(Table::Meta, keys::META_NEXT_UID)?
            .and_then(|v| keys::u64_value(&v))
            .ok_or_else(|| CatalogError::Corrupt {
                table: "meta",
                reason: "next_uid missing".into(),
            })?;
        let now = self.clock.now_ms();
        let rec = SessionRecord {
            dataset: dataset.to_string(),
            created_at_ms: now,
            last_active_ms: now,
            chunk_size,
            origin: origin.to_string(),
            replication: replication.max(1),
            next_entry_page: 0,
            next_shard_page: 0,
            entries: 0,
            opened_by: principal.to_string(),
            ordered_up_to: Vec::new(),
            tree_chunks,
            placed_bytes: 0,
            indexed_pages: 0,
            unindexed_files: 0,
        };
        let mut b = Batch::default();
        b.put(Table::Meta, keys::META_NEXT_UID, (uid + 1).to_be_bytes());
        b.put(Table::Sessions, keys::uid(uid), rec.encode_to_vec());
        self.store.write(b, true)?;
        Ok((uid, chunk_size))
    }

    /// Stores one page of a session's manifest. A page already applied is acknowledged
    /// again without effect; the page after the next waits up to `PAGE_AHEAD_WAIT` for
    /// its predecessor; a page further ahead (or one whose predecessor never came) is
    /// refused.
    pub fn put_entries(&self, session: u64, page: u64, entries: Vec<Entry>) -> Result<(u64, u64)> {
        let mut held = lock(&self.sessions_lock);
        let mut rec = self.session(session)?;
        // Uploaders keep two pages in flight: the one after the next waits (a while) for
        // its predecessor rather than being refused.
        let deadline = std::time::Instant::now() + PAGE_AHEAD_WAIT;
        while page == rec.next_entry_page + 1 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            held = self
                .page_stored
                .wait_timeout(held, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            rec = self.session(session)?;
        }
        if page < rec.next_entry_page {
            return Ok((rec.entries, rec.next_entry_page));
        }
        if page > rec.next_entry_page {
            return Err(CatalogError::Precondition(format!(
                "session {session} expects entry page {}, got page {page}",
                rec.next_entry_page
            )));
        }
        let mut b = Batch::default();
        // (shard, blob, size) of the page's files: one `shard_blobs` row per shard.
        let mut files: Vec<(u32, [u8; 32], u64)> = Vec::with_capacity(entries.len());
        let keys: Vec<Vec<u8>> = entries
            .iter()
            .map(|e| keys::entry(session, e.path.as_str()))
            .collect();
        // Importers send the catalogue's key order. While every key is above the last one
        // stored, none can be a duplicate, and a 10M-entry upload skips 10M lookups (each
        // searching the memtable and every level's filters). Out of order, every entry of
        // this and later pages is looked up (`ordered_up_to` then stays empty).
        let was_ordered = !rec.ordered_up_to.is_empty() || rec.entries == 0;
        let ordered = was_ordered
            && keys.first().is_none_or(|k| *k > rec.ordered_up_to)
            && keys.windows(2).all(|w| w[0] < w[1]);
        let mut seen = HashSet::new();
        for (i, (e, key)) in entries.iter().zip(keys).enumerate() {
            e.check_chunks(rec.chunk_size, ChunkKind::from_tree(rec.tree_chunks))
                .map_err(|x| x.within(format_args!("entries[{i}]")))?;
            if !ordered && (!seen.insert(key.clone()) || self.store.get(Table::Entries, &key)?.is_some()) {
                return Err(InvalidInput::new(
                    format!("entries[{i}].path"),
                    format!("{} appears more than once in the manifest", e.path),
                )
                .into());
            }
            if ordered {
                rec.ordered_up_to.clone_from(&key);
            }
            b.put(Table::Entries, key, entry_record(e).encode_to_vec());
            if let EntryKind::File {
                size, blob, shard, ..
            } = &e.kind
            {
                files.push((*shard, blob.0, *size));
            }
        }
        // A shard's blobs of this page go into one row (hash order, no duplicates).
        files.sort_unstable();
        files.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
        let page_no = u32::try_from(page).map_err(|_| InvalidInput::new("page", "beyond 2^32 pages"))?;
        for group in files.chunk_by(|a, b| a.0 == b.0) {
            let blobs: Vec<([u8; 32], u64)> = group.iter().map(|(_, h, s)| (*h, *s)).collect();
            b.put(
                Table::ShardBlobs,
                keys::shard_blob_page(session, group[0].0, page_no),
                keys::shard_blob_page_value(rec.chunk_size, &blobs),
            );
        }
        // The blob → shard index is derived from these rows a window of pages at a time,
        // after this page's batch (`index_window`), and the rest at the commit.
        rec.unindexed_files += files.len() as u64;
        if page == 0 {
            // Rows per page are schema version 2: from now on builds that read only
            // version 1 refuse this catalogue rather than misread it.
            b.put(Table::Meta, keys::META_SCHEMA, SCHEMA_VERSION.to_be_bytes());
        }
        if ordered {
            // The page's entries may go in as a table file ahead of the rest: should the
            // service stop between the two, the page is not recorded, its uploader sends
            // it again, and an ordered page is put again without any lookup (an unordered
            // one would find its own rows and be refused as duplicates). An aborted or
            // reaped session's entries are deleted with its range.
            b.ingest_first(Table::Entries);
        } else {
            rec.ordered_up_to.clear();
        }
        rec.entries += entries.len() as u64;
        rec.next_entry_page += 1;
        rec.last_active_ms = self.clock.now_ms();
        b.put(Table::Sessions, keys::uid(session), rec.encode_to_vec());
        self.store.write(b, false)?;
        if rec.unindexed_files >= INDEX_WINDOW {
            self.index_window(session, &mut rec)?;
        }
        let chunks = (rec.chunk_size, ChunkKind::from_tree(rec.tree_chunks));
        self.preseals.stored(session, page, ordered, entries, chunks);
        drop(held);
        self.page_stored.notify_all();
        Ok((rec.entries, rec.next_entry_page))
    }

    /// Derives the blob → shard rows of the session's pages not indexed yet, and records
    /// that in the same batch (`Op::Derive` goes first: a crash between leaves rows that a
    /// later window or the commit derives again, the same).
    fn index_window(&self, session: u64, rec: &mut SessionRecord) -> Result<()> {
        let mut b = Batch::default();
        b.derive(Table::BlobShards, index_pages(session, rec)?);
        rec.indexed_pages = rec.next_entry_page;
        rec.unindexed_files = 0;
        b.put(Table::Sessions, keys::uid(session), rec.encode_to_vec());
        self.store.write(b, false)?;
        Ok(())
    }

    /// Stores one page of a session's shard records.
    pub fn put_shards(&self, session: u64, page: u64, shards: Vec<ShardSpec>) -> Result<u64> {
        let _s = lock(&self.sessions_lock);
        let mut rec = self.session(session)?;
        if page < rec.next_shard_page {
            return Ok(rec.next_shard_page);
        }
        if page > rec.next_shard_page {
            return Err(CatalogError::Precondition(format!(
                "session {session} expects shard page {}, got page {page}",
                rec.next_shard_page
            )));
        }
        let mut b = Batch::default();
        let mut seen = HashSet::new();
        for s in &shards {
            let key = keys::shard(session, s.id);
            if !seen.insert(s.id) || self.store.get(Table::Shards, &key)?.is_some() {
                return Err(
                    InvalidInput::new("shards", format!("shard {} is sent more than once", s.id)).into(),
                );
            }
            for n in &s.replicas {
                if !self.node_exists(n)? {
                    return Err(InvalidInput::new(
                        format!("shards[{}].replicas", s.id),
                        format!("node {n} is not registered"),
                    )
                    .into());
                }
            }
            let r = ShardRecord {
                bytes: s.bytes,
                files: s.files,
                replicas: s.replicas.iter().map(|n| n.to_string()).collect(),
            };
            b.put(Table::Shards, key, r.encode_to_vec());
        }
        rec.next_shard_page += 1;
        rec.last_active_ms = self.clock.now_ms();
        b.put(Table::Sessions, keys::uid(session), rec.encode_to_vec());
        self.store.write(b, false)?;
        Ok(rec.next_shard_page)
    }

    /// Checks the session's whole manifest and makes it the dataset's next version.
    /// `namespace`: the sealed namespace the importer built and stored with its first
    /// shard's blobs (hash, size); the same is built here from the manifest, and must match.
    pub fn commit(
        &self,
        session: u64,
        principal: &str,
        namespace: Option<(BlobHash, u64)>,
    ) -> Result<pb::Version> {
        let _v = lock(&self.versions_lock);
        let _s = lock(&self.sessions_lock);
        let rec = self.session(session)?;
        let uid = session;

        let chunks = (rec.chunk_size, ChunkKind::from_tree(rec.tree_chunks));
        let (tally, sealer) = self.manifest_pass(uid, &rec)?;
        let preseal::Tally {
            files,
            dirs,
            symlinks,
            bytes,
            mut per_shard,
        } = tally;

        let mut shards: Vec<(u32, ShardRecord)> = Vec::new();
        let (from, to) = keys::uid_range(uid);
        for kv in self.store.scan(Table::Shards, &from, Some(&to)) {
            let (k, v) = kv?;
            shards.push((keys::shard_id(&k).unwrap_or(0), decode(Table::Shards, &v)?));
        }
        for (id, s) in &shards {
            let (b, f) = per_shard.remove(id).unwrap_or((0, 0));
            if f == 0 {
                return Err(CatalogError::Precondition(format!("shard {id} has no files")));
            }
            if (b, f) != (s.bytes, s.files) {
                return Err(CatalogError::Precondition(format!(
                    "shard {id} was declared with {} files and {} bytes, the manifest puts {f} \
                     files and {b} bytes in it",
                    s.files, s.bytes
                )));
            }
        }
        if let Some((id, (_, f))) = per_shard.into_iter().next() {
            return Err(CatalogError::Precondition(format!(
                "{f} files belong to shard {id}, which was never sent"
            )));
        }

        // The namespace: what the importer stored must be what this manifest seals to.
        let sealed = sealer.finish(&rec.dataset, &self.cluster_id).map_err(sealing)?;
        let mut b = Batch::default();
        // The pages' blob → shard rows not derived during the upload (the store applies
        // this before the rest of the batch).
        if rec.indexed_pages < rec.next_entry_page {
            b.derive(Table::BlobShards, index_pages(uid, &rec)?);
        }
        let ns = self.bind_namespace(
            &mut b,
            uid,
            shards.first().map(|(id, _)| *id),
            (&rec.dataset, chunks),
            sealed,
            namespace,
        )?;

        let now = self.clock.now_ms();
        let mut ds = self.dataset_record(&rec.dataset)?.unwrap_or(DatasetRecord {
            created_at_ms: now,
            next_version: 1,
            latest: 0,
            deleted: false,
        });
        if ds.deleted {
            ds = DatasetRecord {
                created_at_ms: now,
                next_version: ds.next_version,
                latest: 0,
                deleted: false,
            };
        }
        let number = ds.next_version.max(1);
        ds.next_version = number + 1;
        ds.latest = number;
        let vrec = VersionRecord {
            uid,
            created_at_ms: now,
            origin: rec.origin.clone(),
            replication: rec.replication,
            chunk_size: rec.chunk_size,
            files,
            dirs,
            symlinks,
            bytes,
            shards: shards.len() as u32,
            committed_by: principal.to_string(),
            namespace_blob: ns.blob,
            namespace_size: ns.size,
            namespace_inline: ns.inline,
            namespace_chunks: ns.chunks,
            tree_chunks: rec.tree_chunks,
        };
        let mut resident: BTreeMap<&str, u64> = BTreeMap::new();
        for (id, s) in &shards {
            for n in &s.replicas {
                b.put(Table::NodeShards, keys::node_shard(n, uid, *id), Vec::new());
                *resident.entry(n).or_default() += s.bytes;
            }
        }
        for (n, bytes) in resident {
            b.put(Table::Resident, keys::resident(uid, n), bytes.to_be_bytes());
        }
        b.put(
            Table::Versions,
            keys::version(&rec.dataset, number),
            vrec.encode_to_vec(),
        );
        b.put(Table::Datasets, rec.dataset.as_bytes(), ds.encode_to_vec());
        b.delete(Table::Sessions, keys::uid(uid));
        self.store.write(b, true)?;
        if files + dirs + symlinks >= FLUSH_AFTER_ENTRIES {
            // The version's rows are in the tables from here on, not also in the log.
            if let Err(e) = self.store.flush() {
                tracing::warn!(
                    "flushing after the commit of {} entries: {e}",
                    files + dirs + symlinks
                );
            }
        }
        Ok(Self::version_pb(&rec.dataset, number, &vrec))
    }

    /// Checks an importer's claim (`claim`: hash and size of what it stored) against the
    /// namespace this catalogue seals `uid`'s entries to, and writes what makes it a blob
    /// of the first shard into `b`: its replicas hold it, and pin syncs, repairs, refills
    /// and backups carry it like the files. A version without files keeps it inline.
    pub(super) fn bind_namespace(
        &self,
        b: &mut Batch,
        uid: u64,
        first_shard: Option<u32>,
        (dataset, chunks): (&str, (u32, ChunkKind)),
        sealed: locus_proto::sealed::Sealed,
        claim: Option<(BlobHash, u64)>,
    ) -> Result<NamespaceFields> {
        let (hash, size) = (sealed.hash, sealed.size);
        let mut inline = Vec::new();
        match (first_shard, claim) {
            (Some(_), Some(got)) if got == (hash, size) => {}
            (Some(_), Some((h, n))) => {
                return Err(CatalogError::Precondition(format!(
                    "the sealed namespace the importer stored ({h}, {n} bytes) is not this \
                     manifest's ({hash}, {size} bytes); nothing was committed"
                )))
            }
            (Some(_), None) => {
                return Err(CatalogError::Precondition(
                    "no sealed namespace came with the commit: this client predates them \
                     (upgrade it); nothing was committed"
                        .into(),
                ))
            }
            (None, _) => {
                // No file, so no shard to hold it: kept here, small by nature (directories
                // and symlinks only), within a bound.
                if size > MAX_INLINE_NAMESPACE {
                    return Err(CatalogError::Precondition(format!(
                        "a version without files whose namespace is {size} bytes (at most \
                         {MAX_INLINE_NAMESPACE}): add a file, or split the tree"
                    )));
                }
                inline = self.seal_bytes(uid, dataset, chunks)?;
            }
        }
        if let Some(first) = first_shard {
            let mut v = size.to_be_bytes().to_vec();
            v.extend_from_slice(&chunks.0.to_be_bytes());
            b.put(Table::ShardBlobs, keys::shard_blob(uid, first, &hash.0), v);
            b.put(
                Table::BlobShards,
                keys::blob_shard(&hash.0, uid, first),
                keys::blob_shard_value(size, chunks.0),
            );
        }
        Ok(NamespaceFields {
            blob: hash.0.to_vec(),
            size,
            chunks: sealed.chunk_bytes(),
            inline,
        })
    }

    /// Gives a committed version from before sealed namespaces the one `claim` names
    /// (which the caller stored on its first shard's replicas), once it is checked against
    /// the catalogue's own sealing of the version's entries.
    pub fn seal_version(&self, r: &DatasetRef, claim: (BlobHash, u64)) -> Result<pb::Version> {
        let _v = lock(&self.versions_lock);
        let (number, mut v) = self.resolve(r)?;
        let name = r.name.as_str();
        if !v.namespace_blob.is_empty() {
            if v.namespace_blob != claim.0 .0 || v.namespace_size != claim.1 {
                return Err(CatalogError::Precondition(format!(
                    "{name}@{number} is sealed already, with another namespace ({} bytes)",
                    v.namespace_size
                )));
            }
            return Ok(Self::version_pb(name, number, &v));
        }
        let chunks = (v.chunk_size, ChunkKind::from_tree(v.tree_chunks));
        let sealed = self.seal_entries(v.uid, name, chunks, std::io::sink())?;
        let first = self.first_shard(v.uid)?;
        let mut b = Batch::default();
        let ns = self.bind_namespace(&mut b, v.uid, first, (name, chunks), sealed, Some(claim))?;
        v.namespace_blob = ns.blob;
        v.namespace_size = ns.size;
        v.namespace_inline = ns.inline;
        v.namespace_chunks = ns.chunks;
        b.put(Table::Versions, keys::version(name, number), v.encode_to_vec());
        self.store.write(b, true)?;
        Ok(Self::version_pb(name, number, &v))
    }

    /// The lowest shard id of the version stored under `uid`.
    fn first_shard(&self, uid: u64) -> Result<Option<u32>> {
        let (from, to) = keys::uid_range(uid);
        match self.store.scan(Table::Shards, &from, Some(&to)).next() {
            Some(kv) => Ok(keys::shard_id(&kv?.0)),
            None => Ok(None),
        }
    }

    /// What an importer would send with the commit of `session`: its sealed namespace's
    /// hash and size (tests, which build manifests by hand).
    #[cfg(test)]
    pub(crate) fn session_namespace(&self, session: u64) -> Result<(BlobHash, u64)> {
        let rec = self.session(session)?;
        let chunks = (rec.chunk_size, ChunkKind::from_tree(rec.tree_chunks));
        let s = self.seal_entries(session, &rec.dataset, chunks, std::io::sink())?;
        Ok((s.hash, s.size))
    }

    /// The sealed namespace of the entries under `uid`, as bytes (for a small one).
    fn seal_bytes(&self, uid: u64, dataset: &str, chunks: (u32, ChunkKind)) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.seal_entries(uid, dataset, chunks, &mut out)?;
        Ok(out)
    }

    /// Seals the entries stored under `uid` (catalogue order is the namespace's) to `out`.
    fn seal_entries<W: std::io::Write>(
        &self,
        uid: u64,
        dataset: &str,
        (chunk_size, kind): (u32, ChunkKind),
        out: W,
    ) -> Result<locus_proto::sealed::Sealed> {
        let mut w = locus_proto::sealed::Writer::with_kind(out, chunk_size, kind).map_err(sealing)?;
        let (from, to) = keys::uid_range(uid);
        for kv in self.store.scan(Table::Entries, &from, Some(&to)) {
            let (k, v) = kv?;
            let (dir, name) = split_entry(&k)?;
            let e: EntryRecord = decode(Table::Entries, &v)?;
            w.push(&sealable(keys::join(dir, name), e)?).map_err(sealing)?;
        }
        w.finish(dataset, &self.cluster_id).map_err(sealing)
    }

    pub(super) fn discard_session(&self, b: &mut Batch, uid: u64) -> Result<()> {
        self.preseals.forget(uid);
        let (from, to) = keys::uid_range(uid);
        self.delete_shard_blobs(b, uid);
        b.delete_range(Table::Entries, from.clone(), to.clone());
        b.delete_range(Table::Shards, from, to);
        b.delete(Table::Sessions, keys::uid(uid));
        Ok(())
    }

    /// Deletes the shard → blob and blob → shard rows of one version or session. The
    /// blob → shard rows are named, not listed: the store computes them from the shard →
    /// blob rows before the range goes (one point delete per blob made a 10M-entry
    /// version's delete a ~500 MB batch, more than a group's log sends in a message).
    pub(super) fn delete_shard_blobs(&self, b: &mut Batch, uid: u64) {
        let (from, to) = keys::uid_range(uid);
        b.derive(Table::BlobShards, crate::store::forget_blob_shards(uid));
        b.delete_range(Table::ShardBlobs, from, to);
    }

    pub fn abort(&self, session: u64) -> Result<()> {
        let _v = lock(&self.versions_lock);
        let _s = lock(&self.sessions_lock);
        self.session(session)?;
        let mut b = Batch::default();
        self.discard_session(&mut b, session)?;
        self.store.write(b, true)?;
        Ok(())
    }

    /// Discards sessions idle longer than the session timeout. Returns how many.
    pub fn reap_sessions(&self) -> Result<usize> {
        let _v = lock(&self.versions_lock);
        let _s = lock(&self.sessions_lock);
        let deadline = self.clock.now_ms() - self.config.session_timeout.as_millis() as i64;
        let mut stale = Vec::new();
        for kv in self.store.scan(Table::Sessions, b"", None) {
            let (k, v) = kv?;
            let rec: SessionRecord = decode(Table::Sessions, &v)?;
            if rec.last_active_ms < deadline {
                stale.push(keys::u64_value(&k).unwrap_or(0));
            }
        }
        if stale.is_empty() {
            return Ok(0);
        }
        let mut b = Batch::default();
        for uid in &stale {
            self.discard_session(&mut b, *uid)?;
        }
        self.store.write(b, true)?;
        Ok(stale.len())
    }
}

/// What derives the blob → shard rows of `rec`'s pages from `indexed_pages` on.
fn index_pages(uid: u64, rec: &SessionRecord) -> Result<Vec<u8>> {
    let page = |p: u64| u32::try_from(p).map_err(|_| InvalidInput::new("page", "beyond 2^32 pages"));
    Ok(crate::store::derive_blob_shards(
        uid,
        page(rec.indexed_pages)?,
        page(rec.next_entry_page)?,
    ))
}
