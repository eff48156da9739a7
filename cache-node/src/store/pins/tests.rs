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
