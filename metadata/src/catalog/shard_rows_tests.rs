//! The shard → blob index in both of its forms: a row per manifest page and shard
//! (schema version 2) and a row per blob (version 1, still read, still written for a
//! version's sealed namespace).

use locus_proto::manifest::{BlobHash, Entry, EntryKind};

use super::tests::{dir, file, fixture, name, register, shard, Fixture};
use super::*;

fn file_with_blob(p: &str, size: u64, shard: u32, blob: BlobHash) -> Entry {
    let mut e = file(p, size, shard);
    if let EntryKind::File { blob: b, .. } = &mut e.kind {
        *b = blob;
    }
    e
}

fn rows(f: &Fixture, t: Table, uid: u64) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (from, to) = keys::uid_range(uid);
    f.cat
        .store
        .scan(t, &from, Some(&to))
        .map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
        .collect()
}

fn schema(f: &Fixture) -> u32 {
    let v = f.cat.store.get(Table::Meta, keys::META_SCHEMA).unwrap().unwrap();
    u32::from_be_bytes(v[..].try_into().unwrap())
}

fn blob_shard_rows(f: &Fixture, h: &BlobHash) -> usize {
    let end = crate::store::prefix_end(&h.0);
    f.cat.store.scan(Table::BlobShards, &h.0, end.as_deref()).count()
}

/// Two pages over two shards, one blob named by two files of one page and again by the
/// next page: a row per (page, shard), each blob listed once per shard in hash order,
/// and sizes found through the blob → shard rows alone.
#[test]
fn a_manifest_page_writes_one_row_per_shard_and_each_blob_is_listed_once() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    let shared = BlobHash::of(b"shared bytes");
    f.cat
        .put_entries(
            s,
            0,
            vec![
                dir("a"),
                file_with_blob("a/p", 7, 0, shared),
                file_with_blob("a/q", 7, 0, shared),
                file("a/r", 3, 1),
            ],
        )
        .unwrap();
    f.cat
        .put_entries(s, 1, vec![file_with_blob("a/s", 7, 0, shared), file("a/t", 5, 0)])
        .unwrap();
    let before: Vec<u16> = rows(&f, Table::ShardBlobs, s)
        .iter()
        .map(|(k, _)| k.len() as u16)
        .collect();
    assert_eq!(
        before,
        vec![16, 16, 16],
        "page 0: shards 0 and 1; page 1: shard 0"
    );

    f.cat
        .put_shards(s, 0, vec![shard(0, 26, 4, &["n1"]), shard(1, 3, 1, &["n1"])])
        .unwrap();
    let ns = f.cat.session_namespace(s).unwrap();
    let v = f.cat.commit(s, "t", Some(ns)).unwrap();
    let uid = f.cat.resolve(&"ds@latest".parse().unwrap()).unwrap().1.uid;

    let mut want0 = vec![
        (shared, 7, 4 << 20),
        (BlobHash::of(b"a/t"), 5, 4 << 20),
        (ns.0, ns.1, 4 << 20),
    ];
    want0.sort_by_key(|b| b.0 .0);
    assert_eq!(f.cat.shard_blobs(uid, 0).unwrap(), want0);
    assert_eq!(
        f.cat.shard_blobs(uid, 1).unwrap(),
        vec![(BlobHash::of(b"a/r"), 3, 4 << 20)]
    );
    assert_eq!(f.cat.locate_blobs(&[shared]).unwrap()[0].2, Some((7, 4 << 20)));
    assert_eq!(blob_shard_rows(&f, &shared), 1, "one blob → shard row per shard");
    assert_eq!(schema(&f), SCHEMA_VERSION);

    // Deleting the version deletes both indexes, whichever row named a blob.
    f.cat.delete_version(&name("ds"), v.version).unwrap();
    assert!(rows(&f, Table::ShardBlobs, uid).is_empty());
    for h in [shared, BlobHash::of(b"a/r"), BlobHash::of(b"a/t"), ns.0] {
        assert_eq!(blob_shard_rows(&f, &h), 0, "{h:?} still indexed");
    }
}

/// A catalogue written by a build of schema version 1 (a row per blob, empty blob → shard
/// values) opens as it is, lists, locates and deletes its versions as before, and is
/// marked version 2 by the first manifest page stored after it. A version this build
/// does not know is refused by name.
#[test]
fn a_schema_1_catalogue_is_read_as_it_is_and_marked_2_by_its_next_import() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("old"), 0, "", 1, false, "t").unwrap();
    f.cat
        .put_entries(s, 0, vec![dir("a"), file("a/x", 10, 0), file("a/y", 20, 0)])
        .unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 30, 2, &["n1"])]).unwrap();
    let ns = f.cat.session_namespace(s).unwrap();
    let v = f.cat.commit(s, "t", Some(ns)).unwrap();
    let uid = f.cat.resolve(&"old@latest".parse().unwrap()).unwrap().1.uid;
    let listed = f.cat.shard_blobs(uid, 0).unwrap();

    // Rewrite the rows as a version-1 build wrote them.
    let mut b = Batch::default();
    for (k, val) in rows(&f, Table::ShardBlobs, uid) {
        let (shard, blobs) = keys::shard_blobs_row(&k, &val).unwrap();
        b.delete(Table::ShardBlobs, &k);
        for (h, size, chunk) in blobs {
            b.put(
                Table::ShardBlobs,
                keys::shard_blob(uid, shard, &h),
                keys::blob_shard_value(size, chunk),
            );
            b.put(
                Table::BlobShards,
                keys::blob_shard(&h, uid, shard),
                Vec::<u8>::new(),
            );
        }
    }
    b.put(Table::Meta, keys::META_SCHEMA, 1u32.to_be_bytes());
    f.cat.store.write(b, true).unwrap();
    assert!(rows(&f, Table::ShardBlobs, uid)
        .iter()
        .all(|(k, _)| k.len() == 44));

    let reopened = Catalog::open(f.cat.store.clone(), f.clock.clone(), f.cat.config.clone()).unwrap();
    assert_eq!(reopened.shard_blobs(uid, 0).unwrap(), listed);
    let x = BlobHash::of(b"a/x");
    assert_eq!(reopened.locate_blobs(&[x]).unwrap()[0].2, Some((10, 4 << 20)));
    assert_eq!(schema(&f), 1, "opening alone writes nothing");

    let (s2, _) = reopened
        .begin_version(&name("new"), 0, "", 1, false, "t")
        .unwrap();
    reopened.put_entries(s2, 0, vec![file("z", 1, 0)]).unwrap();
    assert_eq!(
        schema(&f),
        2,
        "the first page in the new form marks the catalogue"
    );

    reopened.delete_version(&name("old"), v.version).unwrap();
    assert!(rows(&f, Table::ShardBlobs, uid).is_empty());
    assert_eq!(blob_shard_rows(&f, &x), 0);

    let mut b = Batch::default();
    b.put(Table::Meta, keys::META_SCHEMA, 3u32.to_be_bytes());
    f.cat.store.write(b, true).unwrap();
    match Catalog::open(f.cat.store.clone(), f.clock.clone(), f.cat.config.clone()) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("schema version 3"), "{m}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a catalogue of schema version 3 was opened"),
    }
}

/// A row of neither form is reported as damage, never read as blobs.
#[test]
fn a_malformed_shard_row_is_corruption() {
    let f = fixture();
    let mut b = Batch::default();
    let mut k = keys::shard_blob_page(9, 0, 0);
    b.put(Table::ShardBlobs, &k, keys::shard_blob_page_value(4 << 20, &[]));
    f.cat.store.write(b, true).unwrap();
    assert!(matches!(
        f.cat.shard_blobs(9, 0),
        Err(CatalogError::Corrupt { .. })
    ));
    k.truncate(14);
    assert!(keys::shard_blobs_row(&k, &[0; 44]).is_none());
    assert!(keys::shard_blobs_row(&keys::shard_blob_page(9, 0, 1), &[0; 4 + 39]).is_none());
}

/// The blob → shard rows of an upload: none until a window of files has been stored, then
/// those of every page so far, and the rest with the commit; one row per (blob, shard),
/// with the blob's size and chunk size, however many pages name the blob.
#[test]
fn the_blob_index_is_derived_a_window_of_pages_at_a_time_and_the_rest_at_the_commit() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    let shared = BlobHash::of(b"in pages 0 and 2");
    let index = |f: &Fixture| -> Vec<([u8; 32], u32, u64)> {
        f.cat
            .store
            .scan(Table::BlobShards, b"", None)
            .map(|kv| kv.unwrap())
            .filter(|(k, _)| keys::u64_value(&k[32..40]) == Some(s))
            .map(|(k, v)| {
                assert_eq!(v[8..12], (4u32 << 20).to_be_bytes(), "chunk size");
                let shard = u32::from_be_bytes(k[40..44].try_into().unwrap());
                (
                    k[..32].try_into().unwrap(),
                    shard,
                    keys::u64_value(&v[..8]).unwrap(),
                )
            })
            .collect()
    };
    let row = |p: &str, size: u64| (BlobHash::of(p.as_bytes()).0, 0u32, size);
    // Page 0: 5 files, under the window (8 in tests): no rows yet.
    let page0: Vec<Entry> = (0..4)
        .map(|i| file(&format!("a/f{i}"), 3, 0))
        .chain([file_with_blob("a/g", 9, 0, shared)])
        .collect();
    f.cat.put_entries(s, 0, [vec![dir("a")], page0].concat()).unwrap();
    assert!(index(&f).is_empty(), "rows before a window was full");
    // Page 1: 5 more, the window is full: the rows of pages 0 and 1.
    let page1: Vec<Entry> = (0..5).map(|i| file(&format!("b/f{i}"), 4, 0)).collect();
    f.cat.put_entries(s, 1, [vec![dir("b")], page1].concat()).unwrap();
    let mut want: Vec<_> = (0..4)
        .map(|i| row(&format!("a/f{i}"), 3))
        .chain((0..5).map(|i| row(&format!("b/f{i}"), 4)))
        .chain([(shared.0, 0, 9)])
        .collect();
    want.sort();
    assert_eq!(index(&f), want);
    // Page 2 names the shared blob again; the commit derives its rows.
    f.cat
        .put_entries(
            s,
            2,
            vec![dir("c"), file("c/x", 5, 0), file_with_blob("c/y", 9, 0, shared)],
        )
        .unwrap();
    assert_eq!(index(&f), want, "page 2 is under the window");
    f.cat
        .put_shards(s, 0, vec![shard(0, 12 + 20 + 9 + 5 + 9, 12, &["n1"])])
        .unwrap();
    let ns = f.cat.session_namespace(s).unwrap();
    f.cat.commit(s, "t", Some(ns)).unwrap();
    want.push(row("c/x", 5));
    want.push((ns.0 .0, 0, ns.1));
    want.sort();
    assert_eq!(
        index(&f),
        want,
        "the shared blob once, page 2's file, the namespace"
    );
}

/// Counts the changes of the batches written through it.
struct Counting(Arc<dyn KvStore>, std::sync::Mutex<Vec<usize>>);

impl KvStore for Counting {
    fn get(&self, t: Table, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, StoreError> {
        self.0.get(t, key)
    }
    fn scan<'a>(&'a self, t: Table, from: &[u8], to: Option<&[u8]>) -> crate::store::ScanIter<'a> {
        self.0.scan(t, from, to)
    }
    fn write(&self, batch: Batch, sync: bool) -> std::result::Result<(), StoreError> {
        self.1.lock().unwrap().push(batch.len());
        self.0.write(batch, sync)
    }
    fn size_on_disk(&self) -> u64 {
        self.0.size_on_disk()
    }
    fn export(
        &self,
        tables: &[Table],
        visit: &mut crate::store::ExportVisitor<'_>,
    ) -> std::result::Result<(), StoreError> {
        self.0.export(tables, visit)
    }
}

/// Deleting a version, or aborting an upload, names the blob → shard rows to go rather
/// than listing them (a 10M-entry version's list was a ~500 MB batch, past what a group's
/// log sends in one message): the batch does not grow with the files, and every row of
/// the version goes, those of other versions stay.
#[test]
fn a_version_delete_or_an_abort_is_a_batch_that_does_not_grow_with_its_files() {
    let store = Arc::new(Counting(
        Arc::new(crate::store::MemStore::default()),
        Default::default(),
    ));
    let f = super::tests::fixture_on(store.clone());
    register(&f.cat, "n1");
    let upload = |ds: &str, files: usize| {
        let (s, _) = f.cat.begin_version(&name(ds), 0, "", 1, false, "t").unwrap();
        for page in 0..4 {
            let entries: Vec<Entry> = (0..files / 4)
                .map(|i| file(&format!("p{page}/f{i:05}"), 3, (i % 2) as u32))
                .collect();
            f.cat
                .put_entries(s, page, [vec![dir(&format!("p{page}"))], entries].concat())
                .unwrap();
        }
        s
    };
    let indexed = |uid: u64| {
        f.cat
            .store
            .scan(Table::BlobShards, b"", None)
            .filter(|kv| kv.as_ref().unwrap().0[32..40] == uid.to_be_bytes())
            .count()
    };
    let kept = upload("kept", 40);
    for (s, n) in [(upload("big", 400), 400), (kept, 40)] {
        let half = n as u64 / 2;
        let shards = vec![
            shard(0, 3 * half, half, &["n1"]),
            shard(1, 3 * half, half, &["n1"]),
        ];
        f.cat.put_shards(s, 0, shards).unwrap();
        let ns = f.cat.session_namespace(s).unwrap();
        f.cat.commit(s, "t", Some(ns)).unwrap();
    }
    let uid = |ds: &str| {
        f.cat
            .resolve(&format!("{ds}@latest").parse().unwrap())
            .unwrap()
            .1
            .uid
    };
    let (big, small) = (uid("big"), uid("kept"));
    assert!(indexed(big) > 400 && indexed(small) > 40);
    store.1.lock().unwrap().clear();
    f.cat.delete_version(&name("big"), 1).unwrap();
    let batches = store.1.lock().unwrap().clone();
    assert_eq!(batches.len(), 1);
    assert!(batches[0] < 20, "a delete of 400 files in {} changes", batches[0]);
    assert_eq!(indexed(big), 0);
    assert!(indexed(small) > 40, "the other version keeps its rows");

    // An upload aborted after a window was derived: its rows go the same way.
    let s = upload("aborted", 400);
    assert!(indexed(s) > 0, "a window was derived");
    store.1.lock().unwrap().clear();
    f.cat.abort(s).unwrap();
    let batches = store.1.lock().unwrap().clone();
    assert!(batches.iter().all(|n| *n < 20), "{batches:?}");
    assert_eq!(indexed(s), 0);
    assert!(indexed(small) > 40);
}
