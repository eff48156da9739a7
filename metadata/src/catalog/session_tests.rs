//! Import sessions' page rules and the entry record's compact form.

use locus_proto::manifest::{BlobHash, EntryKind};

use super::tests::{dir, file, fixture, fixture_on, name, register, shard, Fixture};
use super::*;

#[test]
fn duplicates_are_refused_whether_pages_come_in_catalogue_order_or_not() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    // Catalogue order: a's children before b's ("a\0…" < "b\0…"), names ascending.
    f.cat.put_entries(s, 0, vec![dir("a"), dir("b")]).unwrap();
    f.cat
        .put_entries(s, 1, vec![file("a/x", 1, 0), file("a/y", 1, 0)])
        .unwrap();
    let ordered = |f: &Fixture| !f.cat.session(s).unwrap().ordered_up_to.is_empty();
    assert!(ordered(&f), "stored without lookups so far");
    // The next page repeats the last key: out of order, looked up, refused.
    let e = f
        .cat
        .put_entries(s, 2, vec![file("a/y", 1, 0), file("a/z", 1, 0)]);
    assert!(matches!(e, Err(CatalogError::Invalid(_))), "{e:?}");
    // Ascending again, but a duplicate of an earlier page.
    let e = f.cat.put_entries(s, 2, vec![file("a/x", 1, 0)]);
    assert!(matches!(e, Err(CatalogError::Invalid(_))), "{e:?}");
    assert!(ordered(&f), "refused pages change nothing");
    // Out of order but new: stored; from then on every entry is looked up.
    f.cat
        .put_entries(s, 2, vec![file("b/q", 1, 0), file("a/w", 1, 0)])
        .unwrap();
    assert!(!ordered(&f));
    let e = f
        .cat
        .put_entries(s, 3, vec![file("b/r", 1, 0), file("b/q", 1, 0)]);
    assert!(matches!(e, Err(CatalogError::Invalid(_))), "{e:?}");
    let e = f.cat.put_entries(s, 3, vec![file("a/w", 1, 0)]);
    assert!(matches!(e, Err(CatalogError::Invalid(_))), "{e:?}");
    assert_eq!(f.cat.put_entries(s, 3, vec![file("b/r", 1, 0)]).unwrap(), (7, 4));
}

#[test]
fn a_single_chunk_is_stored_once_as_the_blob_and_read_back_whole() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    let mut one = file("one", 10, 0);
    let mut odd = file("odd", 10, 0);
    if let EntryKind::File { blob, chunks, .. } = &mut one.kind {
        *chunks = vec![*blob];
    }
    if let EntryKind::File { chunks, .. } = &mut odd.kind {
        *chunks = vec![BlobHash::of(b"not the blob")];
    }
    let two = file("two", 5 << 20, 0);
    f.cat
        .put_entries(s, 0, vec![one.clone(), odd.clone(), two.clone()])
        .unwrap();
    for e in [&one, &odd, &two] {
        let raw = f
            .cat
            .store
            .get(Table::Entries, &keys::entry(s, e.path.as_str()))
            .unwrap()
            .unwrap();
        let r: EntryRecord = decode(Table::Entries, &raw).unwrap();
        let EntryKind::File { chunks, .. } = &e.kind else {
            unreachable!()
        };
        let stored = if e.path.as_str() == "one" {
            0
        } else {
            chunks.len() * 32
        };
        assert_eq!(r.chunks.len(), stored, "{}", e.path);
        let back = entry_pb(e.path.to_string(), r, true);
        let want: Vec<Vec<u8>> = chunks.iter().map(|c| c.0.to_vec()).collect();
        assert_eq!(back.chunks, want, "{} reads back with its chunks", e.path);
    }
}

/// A manifest uploaded in catalogue order is sealed while it arrives (on its own thread):
/// the commit takes that pass, and it must be the one the stored manifest gives.
#[test]
fn a_manifest_sealed_during_upload_commits_to_what_the_stored_manifest_seals_to() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    let link = Entry {
        path: "l".try_into().unwrap(),
        kind: EntryKind::Symlink { target: "a/x".into() },
        mode: 0o777,
        mtime_ns: 3,
    };
    f.cat.put_entries(s, 0, vec![dir("a"), dir("b"), link]).unwrap();
    // A page acknowledged twice is applied (and sealed) once.
    f.cat.put_entries(s, 0, vec![dir("a"), dir("b")]).unwrap();
    f.cat
        .put_entries(s, 1, vec![file("a/x", 10, 0), file("a/y", 9 << 20, 1)])
        .unwrap();
    f.cat.put_entries(s, 2, vec![file("b/z", 0, 0)]).unwrap();
    f.cat
        .put_shards(
            s,
            0,
            vec![shard(0, 10, 2, &["n1"]), shard(1, 9 << 20, 1, &["n1"])],
        )
        .unwrap();
    assert!(f.cat.preseals.active(s), "sealed during upload");
    // What the importer claims is computed from the stored manifest, by the scan.
    let ns = f.cat.session_namespace(s).unwrap();
    let v = f.cat.commit(s, "t", Some(ns)).unwrap();
    assert!(!f.cat.preseals.active(s), "taken by the commit");
    assert_eq!((v.files, v.dirs, v.symlinks, v.bytes), (3, 2, 1, 10 + (9 << 20)));
    assert_eq!(
        (v.namespace_blob.as_slice(), v.namespace_size),
        (&ns.0 .0[..], ns.1)
    );
}

/// Pages out of order, a shard tally that disagrees, an abort: the sealing during upload
/// is dropped or not trusted, and the commit's scan decides in its own words.
#[test]
fn a_manifest_not_sealed_during_upload_is_checked_by_the_commits_scan() {
    let f = fixture();
    register(&f.cat, "n1");
    // Out of order: not sealed during upload, still committed right.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat
        .put_entries(s, 0, vec![dir("a"), file("a/x", 1, 0)])
        .unwrap();
    assert!(f.cat.preseals.active(s));
    f.cat.put_entries(s, 1, vec![file("z", 1, 0)]).unwrap();
    assert!(!f.cat.preseals.active(s), "z comes before a/x in catalogue order");
    f.cat.put_shards(s, 0, vec![shard(0, 2, 2, &["n1"])]).unwrap();
    let ns = f.cat.session_namespace(s).unwrap();
    let v = f.cat.commit(s, "t", Some(ns)).unwrap();
    assert_eq!((v.files, v.dirs, v.namespace_size), (2, 1, ns.1));
    // An orphan found while sealing during upload is reported by the scan's check.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("nodir/x", 1, 0)]).unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 1, 1, &["n1"])]).unwrap();
    match f.cat.commit(s, "t", None) {
        Err(CatalogError::Precondition(m)) => assert!(
            m.contains("manifest is incomplete: nodir/x is inside \"nodir\""),
            "{m}"
        ),
        other => panic!("an orphan was committed: {other:?}"),
    }
    // Tallies from the sealing during upload are held against the declared shards.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("x", 1, 0)]).unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 2, 1, &["n1"])]).unwrap();
    assert!(f.cat.preseals.active(s));
    match f.cat.commit(s, "t", None) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("declared with 1 files and 2 bytes"), "{m}"),
        other => panic!("a wrong shard tally was committed: {other:?}"),
    }
    // An aborted session's sealing is dropped with it.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("x", 1, 0)]).unwrap();
    assert!(f.cat.preseals.active(s));
    f.cat.abort(s).unwrap();
    assert!(!f.cat.preseals.active(s));
}

/// Uploaders keep two pages in flight, so the later one can arrive first: it waits for
/// its predecessor and is then stored, in order; a page two ahead is still refused.
#[test]
fn a_page_arriving_one_ahead_waits_for_its_predecessor() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    std::thread::scope(|scope| {
        let ahead = scope.spawn(|| f.cat.put_entries(s, 1, vec![file("a/x", 1, 0)]));
        // Give page 1 the lock first, where it must wait rather than fail.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!ahead.is_finished(), "page 1 waits for page 0");
        assert_eq!(f.cat.put_entries(s, 0, vec![dir("a")]).unwrap(), (1, 1));
        assert_eq!(ahead.join().unwrap().unwrap(), (2, 2));
    });
    assert!(f.cat.preseals.active(s), "still in catalogue order");
    match f.cat.put_entries(s, 4, vec![file("a/y", 1, 0)]) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("expects entry page 2, got page 4"), "{m}"),
        other => panic!("a page two ahead was taken: {other:?}"),
    }
}

/// An ordered page's entries go into RocksDB as a table file ahead of its record, so a
/// service stopped between the two leaves them stored and the page unrecorded: the
/// uploader sends the page again and it is accepted. Out of order, a page is written as
/// one batch (its retry would find its own rows and be refused as duplicates).
#[test]
fn an_ordered_page_lands_ahead_of_its_record_and_its_retry_is_accepted() {
    let d = tempfile::tempdir().unwrap();
    let store = Arc::new(crate::store::RocksStore::open(d.path()).unwrap());
    let f = fixture_on(store.clone());
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    let n = crate::store::rocks::INGEST_AT_LEAST + 5;
    let page = |from: usize| -> Vec<Entry> {
        (from..from + n)
            .map(|i| file(&format!("f{i:07}"), 1, 0))
            .collect()
    };
    f.cat.put_entries(s, 0, page(0)).unwrap();
    assert_eq!(
        store.memtable_rows(Table::Entries),
        0,
        "the ordered page was ingested"
    );
    // What a stop between the two writes leaves: page 1's entries, page 1 unrecorded.
    let mut rows = Batch::default();
    for e in page(n) {
        rows.put(
            Table::Entries,
            keys::entry(s, e.path.as_str()),
            entry_record(&e).encode_to_vec(),
        );
    }
    store.write(rows, true).unwrap();
    assert_eq!(f.cat.put_entries(s, 1, page(n)).unwrap(), (2 * n as u64, 2));
    // Out of order from here on: every entry looked up, the page written in one batch.
    let before = store.memtable_rows(Table::Entries);
    f.cat.put_entries(s, 2, vec![file("a", 1, 0)]).unwrap();
    let mut late: Vec<Entry> = (0..n).map(|i| file(&format!("g{i:07}"), 1, 0)).collect();
    late.push(file("b", 1, 0));
    late.sort_by(|a, b| a.path.as_str().cmp(b.path.as_str()));
    f.cat.put_entries(s, 3, late).unwrap();
    assert_eq!(
        store.memtable_rows(Table::Entries),
        before + 2 + n as u64,
        "unordered pages use the memtable"
    );
}
