//! What a start does with what the last process left: the index loaded into memory
//! (before the node serves), and the blob directories compared with it (after, beside
//! serving).

use super::*;

/// Hands the memory the load staged and freed back to the system: glibc keeps freed heap
/// in its arenas, so without this the node's RSS stays at the load's peak (+19% at a
/// million blobs).
#[allow(unsafe_code)]
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl BlobStore {
    pub(super) fn reconcile(&self) -> Result<Reconcile, StoreError> {
        let mut rep = Reconcile::default();
        // The index is the node's only view of what it holds, so all of it is read before
        // the node serves: on two threads (each half of the key space), into maps sized
        // from RocksDB's estimate up front (growing them is a rehash of everything so
        // far, several times over).
        let estimate = self
            .index
            .property_int_value("rocksdb.estimate-num-keys")
            .ok()
            .flatten()
            .unwrap_or(0) as usize;
        for sh in &self.shards {
            let mut sh = lock(sh);
            sh.blobs.reserve(estimate / SHARDS + 1);
            sh.verified.reserve(estimate / SHARDS + 1);
        }
        let halves = std::thread::scope(|sc| {
            let a = sc.spawn(|| self.load_index(0x00, 0x80));
            let b = sc.spawn(|| self.load_index(0x80, 0x100));
            [a.join(), b.join()]
        });
        let mut packs: HashMap<u64, (u32, u32)> = HashMap::new();
        for h in halves {
            let (indexed, books, live) =
                h.map_err(|_| StoreError::Index("loading the index panicked".into()))??;
            rep.indexed += indexed;
            let mut b = self.books();
            b.merge(books);
            for (id, (dir, n)) in live {
                packs.entry(id).or_insert((dir, 0)).1 += n;
            }
        }
        release_freed_memory();
        // Packs are few (thousands of blobs each): compared with the index before serving.
        let (dropped, adopted, removed) = self.reconcile_packs(packs)?;
        rep.missing += dropped;
        rep.adopted += adopted;
        rep.tmp_removed += removed;
        // The cheap part of the comparison with the directories, before serving: leftover
        // partial and temporary files (a write this process has not started yet cannot
        // own them). The blob directories themselves are compared by `check_dirs`, in the
        // background once the node serves: with millions of blobs that walk takes
        // minutes, and nothing a reader needs waits for it (a read that finds a file gone
        // forgets the blob then).
        for d in &self.cfg.dirs {
            // Partial files the index does not know (a crash before the index write).
            for f in fs::read_dir(d.join("partial")).map_err(io)?.flatten() {
                let known = f
                    .file_name()
                    .to_str()
                    .and_then(|n| BlobHash::from_hex(n).ok())
                    .is_some_and(|h| self.shard(&h).partials.contains_key(&h));
                if !known {
                    let _ = fs::remove_file(f.path());
                    rep.tmp_removed += 1;
                }
            }
            for t in fs::read_dir(d.join("tmp")).map_err(io)?.flatten() {
                let _ = fs::remove_file(t.path());
                rep.tmp_removed += 1;
            }
            rep.quarantined += fs::read_dir(d.join("quarantine")).map_err(io)?.count();
        }
        self.books().quarantined = rep.quarantined as u64;
        Ok(rep)
    }

    /// Loads the index records whose keys start with a byte in `from..to`: the blobs
    /// complete and partial, their verified stamps and eviction order. Returns the
    /// complete blobs counted and the bytes they hold (added to the books by the caller).
    ///
    /// Records are staged per shard and each shard is locked once at the end, not once
    /// per record (the two loading threads otherwise trade shard locks millions of
    /// times). Keys arrive in hash order and every loaded blob's tick is 0, so each
    /// shard's eviction order is built from a sorted run and merged in bulk
    /// (`BTreeSet::append`), not inserted key by key.
    #[allow(clippy::type_complexity)]
    fn load_index(&self, from: u16, to: u16) -> Result<(usize, Books, HashMap<u64, (u32, u32)>), StoreError> {
        #[derive(Default)]
        struct Staged {
            blobs: Vec<(BlobHash, Meta)>,
            partials: Vec<(BlobHash, Meta)>,
            verified: Vec<(BlobHash, FileStamp)>,
            lru: Vec<(TeamId, (u64, BlobHash))>,
        }
        let team_count = lock(&self.teams).permilles().len() - 1;
        let mut staged: Vec<Staged> = (0..SHARDS).map(|_| Staged::default()).collect();
        let mut indexed = 0;
        let mut books = Books::default();
        // Live blobs per pack (and the pack's data dir).
        let mut packs: HashMap<u64, (u32, u32)> = HashMap::new();
        let start = [from as u8];
        let mode = rocksdb::IteratorMode::From(&start, rocksdb::Direction::Forward);
        let mut opts = rocksdb::ReadOptions::default();
        // One pass over the whole index: read ahead, and leave the block cache to the
        // point reads that serve (a scan would only evict them).
        opts.set_readahead_size(4 << 20);
        opts.fill_cache(false);
        for kv in self.index.iterator_opt(mode, opts) {
            let (k, v) = kv.map_err(|e| StoreError::Index(e.into_string()))?;
            if u16::from(k.first().copied().unwrap_or(0)) >= to {
                break;
            }
            // Keys that are not a blob's hash are the store's own (the scrub cursor).
            let Ok(h) = <[u8; 32]>::try_from(&k[..]) else {
                continue;
            };
            let rec = match BlobRecord::decode_checked(&v[..]) {
                Ok(r) => r,
                Err(why) => {
                    // Not a record this build can use: dropped, so the blob counts as
                    // missing and pin sync fetches it again (its file, if any, is adopted
                    // or removed as a stray).
                    tracing::warn!(blob = %hex_lossy(&k), %why, "index record unusable; dropping it");
                    let _ = self.index.delete(&k);
                    continue;
                }
            };
            let h = BlobHash(h);
            if rec.dir as usize >= self.cfg.dirs.len() {
                continue;
            }
            if rec.partial && !self.partial_path_in(rec.dir, &h).exists() {
                let _ = self.index.delete(h.0);
                continue;
            }
            let mut rec = rec;
            rec.compact();
            // A tag naming no team in the table (the table was lost): untagged.
            rec.team = u32::from(teams::known(rec.team, team_count).0);
            books.add(rec.size, rec.pinned, rec.team_id());
            if rec.pack != 0 {
                packs.entry(rec.pack).or_insert((rec.dir, 0)).1 += 1;
            }
            let st = &mut staged[usize::from(h.0[0]) % SHARDS];
            // Only a hint: `verified_path` compares it with the file as it is now, and any
            // change while the node was down (a write, a copy, a restored file) differs.
            if let (false, Some(v)) = (rec.partial, &rec.verified) {
                st.verified.push((h, v.into()));
            }
            if !rec.pinned {
                st.lru.push((rec.team_id(), (0, h)));
            }
            let m = Meta { rec, last_access: 0 };
            if m.rec.partial {
                st.partials.push((h, m));
            } else {
                st.blobs.push((h, m));
                indexed += 1;
            }
        }
        for (i, st) in staged.into_iter().enumerate() {
            // Each team's keys stay in hash order: its set is built from a sorted run.
            let mut by_team: Vec<Vec<(u64, BlobHash)>> = Vec::new();
            for (t, k) in st.lru {
                let i = usize::from(t.0);
                if by_team.len() <= i {
                    by_team.resize_with(i + 1, Vec::new);
                }
                by_team[i].push(k);
            }
            let mut sh = lock(&self.shards[i]);
            sh.blobs.extend(st.blobs);
            sh.partials.extend(st.partials);
            sh.verified.extend(st.verified);
            for (t, keys) in by_team.into_iter().enumerate().filter(|(_, k)| !k.is_empty()) {
                let mut keys: BTreeSet<(u64, BlobHash)> = keys.into_iter().collect();
                sh.lru.append(TeamId(t as u16), &mut keys);
            }
        }
        Ok((indexed, books, packs))
    }

    /// Compares the blob directories with the index, by names (no indexed blob is read):
    /// a blob the index names whose file is gone is forgotten (pin sync fetches it again
    /// if pinned); a file the index does not name, left by a crash between its rename and
    /// the index write, is re-hashed and adopted, or quarantined. Safe while the store
    /// serves and writes: files written since `open` are not strays, and a blob is
    /// forgotten only if its file is still absent when the walk ends.
    pub fn check_dirs(&self) -> Result<Reconcile, StoreError> {
        let mut rep = Reconcile::default();
        let mut on_disk: HashSet<BlobHash> = HashSet::new();
        let mut strays: Vec<(u32, PathBuf)> = Vec::new();
        for (di, d) in self.cfg.dirs.iter().enumerate() {
            for sub in fs::read_dir(d.join("blobs")).map_err(io)?.flatten() {
                for f in fs::read_dir(sub.path()).map_err(io)?.flatten() {
                    let name = f.file_name();
                    let Some(h) = name.to_str().and_then(|n| BlobHash::from_hex(n).ok()) else {
                        continue;
                    };
                    let indexed_in = self.shard(&h).blobs.get(&h).map(|m| m.rec.dir as usize);
                    if indexed_in == Some(di) {
                        on_disk.insert(h);
                    } else {
                        let older = f
                            .metadata()
                            .and_then(|m| m.modified())
                            .is_ok_and(|t| t < self.opened);
                        if older {
                            strays.push((di as u32, f.path()));
                        }
                    }
                }
            }
        }
        let mut missing = Vec::new();
        self.each_meta(|h, m, partial| {
            // Packs were compared with the index when the store opened.
            if !partial && m.rec.pack == 0 && !on_disk.contains(h) {
                missing.push((*h, m.rec.dir));
            }
        });
        drop(on_disk);
        for (h, dir) in &missing {
            if !self.blob_path_in(*dir, h).exists() {
                self.forget(h);
                rep.missing += 1;
            }
        }
        for (di, p) in strays {
            // A crash after the rename but before the index write: the file was verified
            // before the rename, but re-check it since nothing vouches for it now.
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            let h = BlobHash::from_hex(&name).expect("filtered above");
            if self.contains(&h) {
                continue;
            }
            match hash_file(&p, locus_proto::DEFAULT_CHUNK_SIZE, ChunkKind::Tree) {
                Ok((size, whole, chunks)) if whole == h => {
                    let chunks = (ChunkKind::Tree, &chunks[..]);
                    let rec = BlobRecord::complete(size, di, false, locus_proto::DEFAULT_CHUNK_SIZE, chunks);
                    self.insert(h, rec)?;
                    rep.adopted += 1;
                }
                _ => {
                    self.move_to_quarantine(&p, &h);
                    rep.quarantined += 1;
                }
            }
        }
        rep.stray_outboards = self.sweep_outboards();
        Ok(rep)
    }
}

/// Every complete blob a store's index names whose bytes are on disk, with where they
/// are and its size: for tests and tools that look at a node's data dirs from outside the
/// node. Opens the index read-only, so it works while the node runs (a snapshot of that
/// moment) and after it died. No index yet: nothing.
pub fn indexed_blobs(dirs: &[PathBuf]) -> Result<Vec<(BlobHash, Located, u64)>, StoreError> {
    let Some(first) = dirs.first() else {
        return Ok(Vec::new());
    };
    let index_dir = first.join("index");
    if !index_dir.join("CURRENT").exists() {
        return Ok(Vec::new());
    }
    let db = rocksdb::DB::open_for_read_only(&rocksdb::Options::default(), &index_dir, false)
        .map_err(|e| StoreError::Index(e.into_string()))?;
    let mut out = Vec::new();
    for kv in db.iterator(rocksdb::IteratorMode::Start) {
        let (k, v) = kv.map_err(|e| StoreError::Index(e.into_string()))?;
        let (Ok(h), Ok(rec)) = (<[u8; 32]>::try_from(&k[..]), BlobRecord::decode_checked(&v)) else {
            continue;
        };
        let Some(d) = dirs.get(rec.dir as usize).filter(|_| !rec.partial) else {
            continue;
        };
        let h = BlobHash(h);
        let hex = hex(&h);
        let at = if rec.pack != 0 {
            Located {
                path: d.join(super::pack::PACKS).join(format!("{:016x}", rec.pack)),
                offset: rec.offset,
                packed: true,
            }
        } else {
            Located {
                path: d.join("blobs").join(&hex[..2]).join(&hex),
                offset: 0,
                packed: false,
            }
        };
        if at.path.exists() {
            out.push((h, at, rec.size));
        }
    }
    Ok(out)
}
