//! Import sessions' page rules and the entry record's compact form.

use locus_proto::manifest::{BlobHash, EntryKind};

use super::tests::{dir, file, fixture, name, Fixture};
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
