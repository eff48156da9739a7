//! Pin sync against writers' pins, on a real store in a temp dir.

use std::collections::HashSet;

use locus_proto::BlobHash;

use super::unix_secs;
use crate::store::tests::{open, put};

#[test]
fn pin_sync_keeps_what_writers_pinned_since_keep_since_and_unpins_the_rest() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let written = put(&s, b"written pinned by an import", true).unwrap();
    let listed = put(&s, b"pinned by a listing only", false).unwrap();
    let packed: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 100]).collect();
    let refs: Vec<(BlobHash, &[u8])> = packed.iter().map(|d| (BlobHash::of(d), &d[..])).collect();
    s.write_packed(&refs, 1 << 16, true).unwrap();
    let none = HashSet::new();
    // The listing pins `listed`: a pin with no writer's time.
    let (changed, _) = s.sync_pins(&HashSet::from([listed]), u32::MAX).unwrap();
    assert_eq!(
        changed,
        1 + 21,
        "listed pinned, the writers' pins dropped (keep_since in the future)"
    );
    assert!(s.is_pinned(&listed) && !s.is_pinned(&written));

    // Pinned again by writers: a sync whose open import began before the writes keeps
    // them (and takes `listed`'s pin, which no writer gave).
    s.set_pinned(&written, true).unwrap();
    s.write_packed(&refs, 1 << 16, true).unwrap();
    let since = unix_secs() - 5;
    let (changed, kept) = s.sync_pins(&none, since).unwrap();
    assert_eq!((changed, kept), (1, 21));
    assert!(!s.is_pinned(&listed));
    assert!(s.is_pinned(&written) && refs.iter().all(|(h, _)| s.is_pinned(h)));

    // The writer's time survives a restart (it is in the index record).
    drop(s);
    let s = open(d.path(), 1 << 30);
    assert_eq!(s.sync_pins(&none, since).unwrap(), (0, 21));
    // Once no open import could name them, they are unpinned; a second sync changes
    // nothing (no record written again).
    assert_eq!(s.sync_pins(&none, unix_secs() + 1).unwrap(), (21, 0));
    assert!(!s.is_pinned(&written));
    assert_eq!(s.sync_pins(&none, unix_secs() + 1).unwrap(), (0, 0));
}

/// A blob its listing pinned (no writer's time) that an open import finds held and pins
/// again (HaveBlobs with `pin`) is kept when the version that listed it is deleted before
/// that import commits: the import's pin carries its time.
#[test]
fn a_listed_blob_an_open_import_pins_again_outlives_its_listing() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let reused = put(&s, b"listed by an old version, reused by a new import", false).unwrap();
    let other = put(&s, b"listed by the old version only", false).unwrap();
    let listing = HashSet::from([reused, other]);
    assert_eq!(s.sync_pins(&listing, u32::MAX).unwrap(), (2, 0));
    let import_began = unix_secs() - 5;
    assert!(s.set_pinned(&reused, true).unwrap());
    // The old version is deleted: its listing is gone while the import is open.
    assert_eq!(s.sync_pins(&HashSet::new(), import_began).unwrap(), (1, 1));
    assert!(s.is_pinned(&reused), "kept for the open import");
    assert!(!s.is_pinned(&other), "no one wants it: evictable again");
}
