//! Unit tests of the blob store on real files in a temp dir.

use super::*;

pub(super) fn open(dir: &Path, capacity: u64) -> Arc<BlobStore> {
    open_reporting(dir, capacity).0
}

/// `open`, with what the start found.
pub(super) fn open_reporting(dir: &Path, capacity: u64) -> (Arc<BlobStore>, Reconcile) {
    BlobStore::open(StoreConfig {
        dirs: vec![dir.to_path_buf()],
        capacity,
        reserve: 0,
        readers_gid: None,
    })
    .unwrap()
}

pub(super) fn put(s: &Arc<BlobStore>, data: &[u8], pin: impl Into<Keep>) -> Result<BlobHash, StoreError> {
    let h = BlobHash::of(data);
    if let Some(mut w) = s.begin_write(h, data.len() as u64, 1 << 16, pin)? {
        for part in data.chunks(10_000) {
            w.write(part)?;
        }
        w.finish()?;
    }
    Ok(h)
}

#[test]
fn writes_verify_and_read_back() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let h = put(&s, &data, true).unwrap();
    assert_eq!(s.read_range(&h, 0, 1 << 30).unwrap(), data);
    assert_eq!(s.read_range(&h, 65_530, 20).unwrap(), data[65_530..65_550]);
    assert_eq!(s.read_range(&h, 199_990, 100).unwrap(), data[199_990..]);
    assert!(s.read_range(&h, 300_000, 1).unwrap().is_empty());
    let empty = put(&s, b"", false).unwrap();
    assert!(s.read_range(&empty, 0, 10).unwrap().is_empty());
    assert!(s.is_pinned(&h));
    assert_eq!(s.stats().used, 200_000);

    // A chunk size that would blow up the index is refused.
    assert!(matches!(
        s.begin_write(BlobHash::of(b"x"), 1, 1, false),
        Err(StoreError::Mismatch { .. })
    ));

    // Wrong bytes never become visible.
    let fake = BlobHash::of(b"something else");
    let mut w = s.begin_write(fake, 3, 0, false).unwrap().unwrap();
    w.write(b"abc").unwrap();
    assert!(matches!(w.finish(), Err(StoreError::Mismatch { .. })));
    assert!(!s.contains(&fake));
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    assert_eq!(s.stats().used, 200_000);
}

#[test]
fn corruption_is_quarantined_and_never_served() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let data = vec![42u8; 150_000];
    let h = put(&s, &data, true).unwrap();
    let p = s.locate(&h).unwrap().path;
    let mut bytes = fs::read(&p).unwrap();
    bytes[140_000] ^= 1;
    fs::write(&p, bytes).unwrap();
    // The first chunk is intact and may be read; the damaged one is not.
    assert_eq!(s.read_range(&h, 0, 10).unwrap(), vec![42u8; 10]);
    assert!(matches!(
        s.read_range(&h, 139_000, 2000),
        Err(StoreError::Corrupt { .. })
    ));
    assert!(!s.contains(&h));
    assert!(!p.exists());
    assert_eq!(fs::read_dir(d.path().join("quarantine")).unwrap().count(), 1);
    assert!(matches!(s.read_range(&h, 0, 10), Err(StoreError::NotFound(_))));
}

#[test]
fn capacity_evicts_unpinned_and_refuses_beyond_pinned() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 300_000);
    let a = put(&s, &vec![1u8; 100_000], true).unwrap();
    let b = put(&s, &vec![2u8; 100_000], false).unwrap();
    let c = put(&s, &vec![3u8; 100_000], false).unwrap();
    let _ = s.read_range(&b, 0, 1).unwrap(); // b is now more recent than c
    let e = put(&s, &vec![4u8; 100_000], false).unwrap();
    assert!(s.contains(&a) && s.contains(&b) && s.contains(&e));
    assert!(!s.contains(&c), "least recently used unpinned blob evicted");
    s.set_pinned(&b, true).unwrap();
    s.set_pinned(&e, true).unwrap();
    let err = put(&s, &vec![5u8; 100_000], false).unwrap_err();
    assert!(matches!(err, StoreError::Full { .. }), "{err}");
    assert_eq!(s.stats().used, 300_000);
    assert_eq!(s.stats().placeable, 0);
}

#[test]
fn eviction_takes_the_least_recently_used_blobs_of_the_whole_store_not_of_one_shard() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 8 * 10_000);
    let hs: Vec<BlobHash> = (0..8u8)
        .map(|i| put(&s, &vec![i; 10_000], false).unwrap())
        .collect();
    let shards: HashSet<usize> = hs.iter().map(|h| usize::from(h.0[0]) % SHARDS).collect();
    assert!(
        shards.len() > 3,
        "the blobs spread over several shards: {shards:?}"
    );
    // Read all but blobs 5 and 2, in an order unrelated to the hashes or the write order.
    for i in [7, 0, 3, 6, 1, 4] {
        s.read_range(&hs[i], 0, 1).unwrap();
    }
    put(&s, &[9u8; 10_000], false).unwrap();
    put(&s, &[10u8; 10_000], false).unwrap();
    let gone: Vec<usize> = (0..8).filter(|i| !s.contains(&hs[*i])).collect();
    assert_eq!(gone, [2, 5], "the two blobs not read since they were written");
    put(&s, &[11u8; 10_000], false).unwrap();
    assert!(!s.contains(&hs[7]), "then the first one read");
    check_books(&s);
}

#[test]
fn concurrent_writers_readers_and_pinners_leave_exact_books_and_never_exceed_capacity() {
    let d = tempfile::tempdir().unwrap();
    let cap = 12 * 10_000;
    let s = open(d.path(), cap);
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let s = &s;
            scope.spawn(move || {
                for i in 0..150u32 {
                    let n = ((i * 7 + u32::from(t) * 13) % 40) as u8;
                    let data = vec![n; 10_000];
                    match i % 4 {
                        0 | 1 => match put(s, &data, n.is_multiple_of(9)) {
                            Ok(_) | Err(StoreError::Full { .. }) => {}
                            Err(e) => panic!("{e}"),
                        },
                        2 => {
                            let _ = s.read_range(&BlobHash::of(&data), 0, 10);
                        }
                        _ => {
                            s.set_pinned(&BlobHash::of(&data), false).unwrap();
                        }
                    }
                    assert!(s.stats().used <= cap, "over capacity");
                }
            });
        }
    });
    check_books(&s);
    assert!(s.hashes().len() <= 12);
}

#[test]
fn a_verified_blob_is_not_hashed_again_until_its_file_changes() {
    let d = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let s = open(d.path(), 1 << 30);
    let h = put(&s, &data, true).unwrap();
    // Hashed on the way in: the first direct read needs no second pass.
    let path = s.verified_path(&h).unwrap().unwrap();
    assert_eq!(s.whole_hashes(), 0);
    drop(s);
    // Nor after a restart: the stamp is in the index.
    let s = open(d.path(), 1 << 30);
    assert_eq!(s.verified_path(&h).unwrap(), Some(path.clone()));
    assert_eq!(s.whole_hashes(), 0);
    drop(s);
    // A byte changed in place while the node was down changes the file's ctime: the
    // stamp no longer matches, the blob is hashed, fails and is quarantined.
    let mut bytes = fs::read(&path.path).unwrap();
    bytes[123_456] ^= 1;
    fs::OpenOptions::new()
        .write(true)
        .open(&path.path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
        .unwrap();
    let s = open(d.path(), 1 << 30);
    assert_eq!(s.verified_path(&h).unwrap(), None);
    assert_eq!(s.whole_hashes(), 1);
    assert_eq!(s.stats().quarantined, 1);
}

#[test]
fn restart_reconciles_index_and_directory() {
    let d = tempfile::tempdir().unwrap();
    let (a, b);
    {
        let s = open(d.path(), 1 << 30);
        a = put(&s, b"first blob", true).unwrap();
        b = put(&s, b"second blob", false).unwrap();
        fs::remove_file(s.locate(&b).unwrap().path).unwrap();
        fs::write(d.path().join("tmp/leftover"), b"partial").unwrap();
    }
    // A verified blob that reached the directory but not the index is adopted.
    let c = BlobHash::of(b"third blob");
    let x = c.to_hex();
    fs::create_dir_all(d.path().join("blobs").join(&x[..2])).unwrap();
    fs::write(d.path().join("blobs").join(&x[..2]).join(&x), b"third blob").unwrap();
    // Left before this process opened the store: only such a file is a crash's stray.
    let back = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let f = fs::File::options()
        .write(true)
        .open(d.path().join("blobs").join(&x[..2]).join(&x))
        .unwrap();
    f.set_modified(back).unwrap();
    drop(f);
    let (s, rep) = open_reporting(d.path(), 1 << 30);
    assert_eq!((rep.indexed, rep.tmp_removed), (2, 1), "{rep:?}");
    // Open serves at once, from the index: the directories are walked after.
    assert!(s.contains(&a) && s.is_pinned(&a));
    assert!(!s.contains(&c), "not adopted before the walk");
    // A blob written while the walk has not run is neither a stray nor missing.
    let during = put(&s, b"written while serving", false).unwrap();
    let rep = s.check_dirs().unwrap();
    assert_eq!((rep.missing, rep.adopted, rep.quarantined), (1, 1, 0), "{rep:?}");
    assert!(s.contains(&a) && s.is_pinned(&a));
    assert!(!s.contains(&b));
    assert!(s.contains(&during));
    assert_eq!(s.read_range(&c, 0, 100).unwrap(), b"third blob");
}

#[test]
fn a_blob_missing_on_disk_before_the_walk_is_forgotten_when_read() {
    let d = tempfile::tempdir().unwrap();
    let b;
    {
        let s = open(d.path(), 1 << 30);
        b = put(&s, b"soon gone", false).unwrap();
        fs::remove_file(s.locate(&b).unwrap().path).unwrap();
    }
    let s = open(d.path(), 1 << 30);
    assert!(s.contains(&b), "the index still names it");
    assert!(s.read_range(&b, 0, 10).is_err(), "a read finds the file gone");
    assert!(!s.contains(&b), "and forgets the blob");
}

#[test]
fn a_batch_is_durable_and_visible_together_and_a_bad_blob_is_refused_before_it() {
    let d = tempfile::tempdir().unwrap();
    let blobs: Vec<Vec<u8>> = (0..50u32)
        .map(|i| format!("small file {i}").into_bytes())
        .collect();
    {
        let s = open(d.path(), 1 << 30);
        let mut staged = Vec::new();
        for data in &blobs {
            let h = BlobHash::of(data);
            let mut w = s
                .begin_write(h, data.len() as u64, 1 << 16, true)
                .unwrap()
                .unwrap();
            w.write(data).unwrap();
            staged.push(w.finish_staged().unwrap());
        }
        assert!(
            !s.contains(&BlobHash::of(&blobs[0])),
            "nothing is visible before the commit"
        );
        // A blob whose bytes do not match its name never reaches a batch.
        let mut bad = s
            .begin_write(BlobHash::of(b"claimed"), 5, 1 << 16, true)
            .unwrap()
            .unwrap();
        bad.write(b"other").unwrap();
        assert!(matches!(bad.finish_staged(), Err(StoreError::Mismatch { .. })));
        let stored = s.commit_batch(staged).unwrap();
        assert_eq!(stored.len(), blobs.len());
        assert!(stored.iter().all(|x| !x.already_present));
        assert_eq!(
            s.stats().pinned,
            blobs.iter().map(|b| b.len() as u64).sum::<u64>()
        );
    }
    // After a restart every blob is there, pinned, from the index alone.
    let s = open(d.path(), 1 << 30);
    for data in &blobs {
        let h = BlobHash::of(data);
        assert!(s.is_pinned(&h));
        assert_eq!(s.read_range(&h, 0, 100).unwrap(), *data);
    }
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
}

#[test]
fn a_partial_blob_asked_to_be_pinned_holds_no_space_it_cannot_give_back() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 300_000);
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 239) as u8).collect();
    let h = BlobHash::of(&data);
    let chunks: Vec<BlobHash> = data.chunks(1 << 16).map(BlobHash::of).collect();
    // A transfer that asks for a pin, stores one chunk, and never comes back.
    s.begin_partial(h, 200_000, 1 << 16, (ChunkKind::Plain, &chunks), true)
        .unwrap();
    assert!(!s.write_chunk(&h, 0, &data[..1 << 16]).unwrap());
    assert_eq!(s.stats().pinned, 0, "not pinned while incomplete");
    // Space is needed: the abandoned partial is evicted instead of the write refused.
    let other = put(&s, &vec![9u8; 200_000], true).unwrap();
    assert!(s.contains(&other));
    assert_eq!(s.missing_chunks(&h), None, "the partial is gone");
    assert_eq!(s.stats().used, 200_000);
}

#[test]
fn partial_blobs_fill_chunk_by_chunk_and_survive_restarts() {
    partial_blob_fills_and_survives_restarts(ChunkKind::Tree);
}

#[test]
fn partial_blobs_of_a_version_with_plain_chunk_hashes_fill_and_survive_restarts() {
    partial_blob_fills_and_survives_restarts(ChunkKind::Plain);
}

fn partial_blob_fills_and_survives_restarts(kind: ChunkKind) {
    let d = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
    let h = BlobHash::of(&data);
    let cs = 1u64 << 16;
    let (_, _, chunks) = locus_proto::manifest::hash_bytes(&data, cs as u32, kind);
    let piece = |i: u64| &data[(i * cs) as usize..((i + 1) * cs).min(200_000) as usize];
    {
        let s = open(d.path(), 1 << 30);
        s.begin_partial(h, 200_000, 1 << 16, (kind, &chunks), true)
            .unwrap();
        assert!(!s.contains(&h), "a partial blob is not a blob yet");
        assert_eq!(s.missing_chunks(&h).unwrap(), vec![0, 1, 2, 3]);
        assert!(!s.write_chunk(&h, 2, piece(2)).unwrap());
        // A wrong chunk is refused and changes nothing.
        assert!(matches!(
            s.write_chunk(&h, 1, piece(2)),
            Err(StoreError::Mismatch { .. })
        ));
        assert_eq!(
            s.read_range(&h, 2 * cs + 5, 10).unwrap(),
            data[(2 * cs + 5) as usize..(2 * cs + 15) as usize]
        );
        match s.read_range(&h, cs, 2 * cs) {
            Err(StoreError::NotPresent { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.stats().used, 200_000, "its space is held");
    }
    // After a restart the chunks already written are still known.
    let s = open(d.path(), 1 << 30);
    assert_eq!(s.missing_chunks(&h).unwrap(), vec![0, 1, 3]);
    assert!(!s.write_chunk(&h, 0, piece(0)).unwrap());
    assert!(!s.write_chunk(&h, 3, piece(3)).unwrap());
    assert!(
        s.write_chunk(&h, 1, piece(1)).unwrap(),
        "the last chunk completes it"
    );
    assert!(s.contains(&h) && s.is_pinned(&h));
    assert_eq!(s.missing_chunks(&h), None);
    assert_eq!(s.read_range(&h, 0, 1 << 30).unwrap(), data);
    assert_eq!(fs::read_dir(d.path().join("partial")).unwrap().count(), 0);
    assert_eq!(s.stats().used, 200_000);
    // Hashed whole as it completed: a direct read needs no second pass, now or after
    // a restart.
    assert!(s.verified_path(&h).unwrap().is_some());
    drop(s);
    let s = open(d.path(), 1 << 30);
    assert!(s.verified_path(&h).unwrap().is_some());
    assert_eq!(s.whole_hashes(), 0);
}

#[test]
fn unpinned_partial_blobs_are_evictable() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 300_000);
    let data = vec![9u8; 200_000];
    let chunks: Vec<BlobHash> = data.chunks(1 << 16).map(BlobHash::of).collect();
    let h = BlobHash::of(&data);
    s.begin_partial(h, 200_000, 1 << 16, (ChunkKind::Plain, &chunks), false)
        .unwrap();
    let other = put(&s, &vec![3u8; 200_000], true).unwrap();
    assert!(s.contains(&other));
    assert_eq!(s.missing_chunks(&h), None, "the abandoned partial blob made room");
    assert_eq!(fs::read_dir(d.path().join("partial")).unwrap().count(), 0);
}

#[test]
fn refuses_foreign_directories() {
    let d = tempfile::tempdir().unwrap();
    fs::write(d.path().join("precious.txt"), b"not ours").unwrap();
    let r = BlobStore::open(StoreConfig {
        dirs: vec![d.path().to_path_buf()],
        capacity: 1,
        reserve: 0,
        readers_gid: None,
    });
    assert!(matches!(r, Err(StoreError::DataDir { .. })));
}

#[test]
fn older_formats_open_marked_3_their_full_records_load_compact_and_a_later_format_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let h = put(&s, b"kept across the upgrade", true).unwrap();
    drop(s);
    // The record as format 2 wrote it: the one chunk's hash listed.
    {
        let db = rocksdb::DB::open_default(d.path().join("index")).unwrap();
        let mut rec = BlobRecord::decode_checked(&db.get(h.0).unwrap().unwrap()).unwrap();
        assert!(
            rec.chunks.is_empty(),
            "format 3 keeps no chunk list for one chunk"
        );
        rec.chunks = h.0.to_vec();
        db.put(h.0, rec.encode_to_vec()).unwrap();
    }
    let marker = d.path().join(FORMAT_FILE);
    for old in [1, 2] {
        fs::write(&marker, format!("locus-blobstore {old}\n")).unwrap();
        let s = open(d.path(), 1 << 30);
        assert_eq!(s.read_range(&h, 0, 100).unwrap(), b"kept across the upgrade");
        assert_eq!(fs::read_to_string(&marker).unwrap(), "locus-blobstore 3\n");
        assert!(s.shard(&h).blobs[&h].rec.chunks.is_empty(), "loaded compact");
        assert!(s.verify(&h).unwrap(), "and still verifies whole");
        check_books(&s);
    }
    fs::write(&marker, "locus-blobstore 4\n").unwrap();
    let Err(StoreError::DataDir { reason, .. }) = BlobStore::open(StoreConfig {
        dirs: vec![d.path().to_path_buf()],
        capacity: 1 << 30,
        reserve: 0,
        readers_gid: None,
    }) else {
        panic!("a store of a later format must be refused");
    };
    assert!(reason.contains("format 4"), "{reason}");
}

#[test]
fn a_large_chunk_is_served_in_bounded_pieces_and_checked_before_any_byte() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    // One 32 MiB chunk plus a 4 MiB tail chunk; every piece stays at or under 8 MiB.
    let cs: u32 = 32 << 20;
    let data: Vec<u8> = (0..(36u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let h = BlobHash::of(&data);
    let mut w = s.begin_write(h, data.len() as u64, cs, true).unwrap().unwrap();
    w.write(&data).unwrap();
    w.finish().unwrap();
    let mut r = s.open_reader(&h, 3, 0).unwrap();
    let mut got = Vec::new();
    while let Some(p) = r.next_piece().unwrap() {
        assert!(
            p.len() as u64 <= read::WHOLE_CHUNK_MAX,
            "a piece of {} bytes",
            p.len()
        );
        got.extend_from_slice(&p);
    }
    assert_eq!(got, data[3..]);
    assert_eq!(
        s.read_range(&h, (31 << 20) + 7, 2 << 20).unwrap(),
        data[(31 << 20) + 7..(33 << 20) + 7]
    );

    // A flipped byte at the end of the large chunk fails the read of its first byte.
    let path = s.locate(&h).unwrap().path;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(32 << 20) - 1] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let mut r = s.open_reader(&h, 0, 10).unwrap();
    assert!(matches!(r.next_piece(), Err(StoreError::Corrupt { .. })));
    assert!(!s.contains(&h), "the blob was quarantined");
}

/// The store's in-memory books, checked against its maps: bytes used and pinned, and the
/// eviction order holding exactly the unpinned blobs at their last access.
pub(super) fn check_books(s: &BlobStore) {
    let (mut used, mut pinned) = (0, 0);
    let mut want = std::collections::BTreeSet::new();
    let mut cached: Vec<u64> = Vec::new();
    s.each_meta(|h, m, _| {
        let f = outboards::footprint(m.rec.size);
        used += f;
        if m.rec.pinned {
            pinned += f;
        } else {
            want.insert(((m.last_access, *h), m.rec.team_id()));
            let t = m.rec.team as usize;
            cached.resize(cached.len().max(t + 1), 0);
            cached[t] += f;
        }
    });
    let b = s.books();
    assert_eq!(b.used, used, "used");
    assert_eq!(b.pinned, pinned, "pinned");
    let mut books_cached = b.team_cached.clone();
    drop(b);
    while books_cached.last() == Some(&0) && books_cached.len() > cached.len() {
        books_cached.pop();
    }
    cached.resize(books_cached.len().max(cached.len()), 0);
    assert_eq!(books_cached, cached, "cached bytes per team");
    let mut lru = std::collections::BTreeSet::new();
    for (i, sh) in s.shards.iter().enumerate() {
        for (k, t) in lock(sh).lru.all() {
            assert_eq!(usize::from(k.1 .0[0]) % SHARDS, i, "a blob in the wrong shard");
            lru.insert((k, t));
        }
    }
    assert_eq!(lru, want, "eviction order, by team");
}

#[derive(Debug, Clone)]
enum StoreOp {
    Put(u8, bool),
    Read(u8),
    Pin(u8, bool),
    Forget(u8),
}

fn store_op() -> impl proptest::strategy::Strategy<Value = StoreOp> {
    use proptest::prelude::*;
    prop_oneof![
        (0u8..10, any::<bool>()).prop_map(|(n, p)| StoreOp::Put(n, p)),
        (0u8..10).prop_map(StoreOp::Read),
        (0u8..10, any::<bool>()).prop_map(|(n, p)| StoreOp::Pin(n, p)),
        (0u8..10).prop_map(StoreOp::Forget),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Writes (evicting least recently used unpinned blobs once 5 of 10 fill the
    /// capacity), reads, pin changes and forgotten blobs in any order keep the books
    /// exact; eviction never takes a pinned blob, nor a blob of a team other than the
    /// writer's while that team is within its share of the cache room (blob n is cached
    /// for team n % 3: none, a with 30%, b with 40%).
    #[test]
    fn the_books_stay_exact_through_writes_reads_pins_and_evictions(
        ops in proptest::collection::vec(store_op(), 1..40)
    ) {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path(), 5 * 10_000);
        let teams = [TeamId::NONE, s.team("a", 300), s.team("b", 400)];
        let shares = [0u32, 300, 400];
        let data = |n: u8| vec![n; 10_000];
        for o in ops {
            match o {
                StoreOp::Put(n, pin) => {
                    let writer = teams[usize::from(n % 3)];
                    let mut pinned_before = Vec::new();
                    let mut cached_before: Vec<(BlobHash, TeamId)> = Vec::new();
                    s.each_meta(|h, m, partial| {
                        if m.rec.pinned && !partial {
                            pinned_before.push(*h)
                        } else if !m.rec.pinned {
                            cached_before.push((*h, m.rec.team_id()))
                        }
                    });
                    let (room, by_team) = {
                        let b = s.books();
                        let held = b.pinned + if pin { 10_000 } else { 0 };
                        (s.cfg.capacity.saturating_sub(held), b.team_cached.clone())
                    };
                    let keep = Keep { pin, team: writer };
                    match put(&s, &data(n), keep) {
                        Ok(_) | Err(StoreError::Full { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    for h in pinned_before {
                        proptest::prop_assert!(s.contains(&h), "a pinned blob was evicted");
                    }
                    for (h, t) in cached_before {
                        let i = usize::from(t.0);
                        let within = by_team.get(i).copied().unwrap_or(0)
                            <= teams::share_of(room, shares[i]);
                        if t != TeamId::NONE && t != writer && within {
                            proptest::prop_assert!(
                                s.contains(&h),
                                "a blob of a team within its share was evicted by another's write"
                            );
                        }
                    }
                }
                StoreOp::Read(n) => {
                    let _ = s.read_range(&BlobHash::of(&data(n)), 0, 10);
                }
                StoreOp::Pin(n, p) => {
                    s.set_pinned(&BlobHash::of(&data(n)), p).unwrap();
                }
                StoreOp::Forget(n) => s.forget(&BlobHash::of(&data(n))),
            }
            check_books(&s);
        }
    }
}

#[test]
fn the_scrub_walks_blobs_in_hash_order_and_its_place_survives_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    {
        let s = open(d.path(), 1 << 30);
        for i in 0..7u8 {
            all.push(put(&s, &vec![i; 1000 + usize::from(i)], false).unwrap());
        }
        all.sort();
        let first = s.scrub_batch(None, 3).unwrap();
        assert_eq!(first.iter().map(|x| x.0).collect::<Vec<_>>(), all[..3]);
        assert_eq!(first[0].1, s.size_of(&all[0]).unwrap());
        s.set_scrub_cursor(Some(first[2].0));
    }
    // Reopened: the cursor key is not taken for a blob, and the walk goes on after it.
    let s = open(d.path(), 1 << 30);
    assert_eq!(s.hashes().len(), 7);
    let at = s.scrub_cursor();
    assert_eq!(at, Some(all[2]));
    let rest = s.scrub_batch(at, 100).unwrap();
    assert_eq!(rest.iter().map(|x| x.0).collect::<Vec<_>>(), all[3..]);
    s.set_scrub_cursor(None);
    assert_eq!(s.scrub_cursor(), None);
}

/// What a caller announces evicts nothing: a write of a huge blob that sends no byte
/// leaves every cached blob in place, and one that sends bytes evicts only for them.
#[test]
fn an_announced_size_evicts_nothing_until_its_bytes_arrive() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 20);
    let cached: Vec<BlobHash> = (0..4u8)
        .map(|i| put(&s, &vec![i; 200_000], false).unwrap())
        .collect();
    assert_eq!(s.stats().used, 800_000);
    // Nearly the whole capacity announced, nothing sent: nothing goes.
    let w = s
        .begin_write(BlobHash::of(b"never sent"), (1 << 20) - 1, 0, false)
        .unwrap()
        .unwrap();
    assert!(
        cached.iter().all(|h| s.contains(h)),
        "an announcement evicted blobs"
    );
    drop(w);
    // Beyond what could ever fit (all but pinned): refused at once, nothing evicted.
    assert!(matches!(
        s.begin_write(BlobHash::of(b"too big"), 2 << 20, 0, false),
        Err(StoreError::Full { .. })
    ));
    assert!(cached.iter().all(|h| s.contains(h)));
    // Bytes that arrive make room for themselves, oldest first, and no more.
    let data = vec![9u8; 300_000];
    put(&s, &data, false).unwrap();
    let gone = cached.iter().filter(|h| !s.contains(h)).count();
    assert!((1..=2).contains(&gone), "{gone} evicted for 300,000 bytes");
    assert!(!s.contains(&cached[0]), "the least recently used went first");
    check_books(&s);
}
