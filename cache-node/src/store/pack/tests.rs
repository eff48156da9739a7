//! Packs on real files: written once, read by offset, checked blob by blob, reconciled
//! at a start, removed with their last blob.

use super::super::tests::{check_books, open, open_reporting};
use super::*;

/// `n` distinct small blobs, `tag` making each call's set different.
fn blobs(n: usize, tag: u8) -> Vec<(BlobHash, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let data: Vec<u8> = (0..1000 + i).map(|x| (x as u8) ^ tag ^ (i as u8)).collect();
            (BlobHash::of(&data), data)
        })
        .collect()
}

fn refs(b: &[(BlobHash, Vec<u8>)]) -> Vec<(BlobHash, &[u8])> {
    b.iter().map(|(h, d)| (*h, &d[..])).collect()
}

fn files_in(d: &Path, sub: &str) -> usize {
    walk(&d.join(sub))
}

fn walk(p: &Path) -> usize {
    fs::read_dir(p).map_or(0, |r| {
        r.flatten()
            .map(|e| if e.path().is_dir() { walk(&e.path()) } else { 1 })
            .sum()
    })
}

#[test]
fn a_batch_is_one_pack_file_whose_blobs_read_back_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let b = blobs(100, 1);
    let w = s.write_packed(&refs(&b), 0, true).unwrap();
    assert_eq!((w.stored, w.already_present), (100, 0));
    assert_eq!(w.bytes, b.iter().map(|(_, d)| d.len() as u64).sum::<u64>());
    assert_eq!(files_in(d.path(), PACKS), 1, "one file for the batch");
    assert_eq!(files_in(d.path(), "blobs"), 0, "no file per blob");
    assert_eq!(files_in(d.path(), "tmp"), 0);
    // The pack's own table lists every blob where the index says it is.
    let pack = s.locate(&b[0].0).unwrap().path;
    let (chunk_size, table) = read_pack_table(&pack).unwrap();
    assert_eq!(chunk_size, locus_proto::DEFAULT_CHUNK_SIZE);
    assert_eq!(table.len(), 100);
    for row in &table {
        let at = s.locate(&row.hash).unwrap();
        assert_eq!(
            (at.path.as_path(), at.offset, at.packed),
            (pack.as_path(), row.offset, true)
        );
    }
    for (h, data) in &b {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data);
        assert_eq!(s.read_range(h, 10, 5).unwrap(), data[10..15]);
        assert!(s.is_pinned(h));
    }
    check_books(&s);
    // The same blobs again are not written twice.
    let again = s.write_packed(&refs(&b), 0, true).unwrap();
    assert_eq!((again.stored, again.already_present), (0, 100));
    assert_eq!(files_in(d.path(), PACKS), 1);
    drop(s);

    let s = open(d.path(), 1 << 30);
    for (h, data) in &b {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data, "after a restart");
        // The stamp taken at the write still holds: served without hashing it whole.
        assert!(s.verified_path(h).unwrap().is_some_and(|at| at.packed));
    }
    assert_eq!(s.whole_hashes(), 0);
    assert_eq!(s.stats().blobs, 100);
    check_books(&s);
}

#[test]
fn a_pack_holds_empty_blobs_and_more_than_one_writev_of_blobs() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let mut b = blobs(3000, 9);
    b.push((BlobHash::of(b""), Vec::new()));
    b.swap(0, 3000);
    s.write_packed(&refs(&b), 0, false).unwrap();
    assert_eq!(files_in(d.path(), PACKS), 1);
    for (h, data) in &b {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data);
    }
    check_books(&s);
}

#[test]
fn a_batch_with_one_wrong_blob_stores_nothing() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let mut b = blobs(20, 2);
    b[13].1[7] ^= 1;
    match s.write_packed(&refs(&b), 0, false) {
        Err(StoreError::Mismatch { hash, .. }) => assert_eq!(hash, b[13].0),
        other => panic!("a wrong blob must refuse the batch naming it: {other:?}"),
    }
    assert!(b.iter().all(|(h, _)| !s.contains(h)));
    assert_eq!(files_in(d.path(), PACKS) + files_in(d.path(), "tmp"), 0);
    assert_eq!(s.stats().used, 0);
}

#[test]
fn a_corrupt_packed_blob_is_quarantined_alone_and_its_neighbours_still_read() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let b = blobs(30, 3);
    s.write_packed(&refs(&b), 0, true).unwrap();
    let bad = s.locate(&b[5].0).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&bad.path).unwrap();
        f.write_all_at(&[b[5].1[100] ^ 0xff], bad.offset + 100).unwrap();
    }
    assert!(matches!(
        s.read_range(&b[5].0, 0, 0),
        Err(StoreError::Corrupt { .. })
    ));
    assert!(!s.contains(&b[5].0));
    assert_eq!(s.stats().quarantined, 1);
    let kept = fs::read_dir(d.path().join("quarantine"))
        .unwrap()
        .flatten()
        .next()
        .unwrap();
    let mut want = b[5].1.clone();
    want[100] ^= 0xff;
    assert_eq!(
        fs::read(kept.path()).unwrap(),
        want,
        "the damaged blob's bytes are kept"
    );
    // The pack stays for the others, each checked on its own.
    assert!(bad.path.exists());
    for (h, data) in b.iter().filter(|(h, _)| *h != b[5].0) {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data);
    }
    // Stored again (fetched from a replica), it goes to a new pack.
    s.write_packed(&refs(&b[5..6]), 0, true).unwrap();
    assert_eq!(s.read_range(&b[5].0, 0, 0).unwrap(), b[5].1);
    check_books(&s);
}

#[test]
fn a_pack_goes_with_its_last_blob_and_eviction_frees_packed_blobs() {
    let d = tempfile::tempdir().unwrap();
    let b1 = blobs(40, 4);
    let b2 = blobs(40, 5);
    let one: u64 = b1.iter().map(|(_, d)| d.len() as u64).sum();
    // Room for one batch and a half: the second evicts the first (unpinned).
    let s = open(d.path(), one * 3 / 2 + 4096);
    s.write_packed(&refs(&b1), 0, false).unwrap();
    let first = s.locate(&b1[0].0).unwrap().path;
    s.write_packed(&refs(&b2), 0, false).unwrap();
    let left = b1.iter().filter(|(h, _)| s.contains(h)).count();
    assert!(left < 40, "the second batch made room by evicting packed blobs");
    assert_eq!(
        first.exists(),
        left > 0,
        "the first pack stays while any of its blobs does"
    );
    check_books(&s);
    for (h, _) in b1.iter().filter(|(h, _)| s.contains(h)) {
        s.forget(h);
    }
    assert!(!first.exists(), "its last blob gone, the pack is removed");
    for (h, data) in &b2 {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data);
    }
    // Forgotten blobs are not brought back by a restart.
    drop(s);
    let s = open(d.path(), one * 3 / 2 + 4096);
    assert!(b1.iter().all(|(h, _)| !s.contains(h)));
    assert!(b2.iter().all(|(h, _)| s.contains(h)));
    check_books(&s);
}

#[test]
fn a_start_drops_records_of_a_lost_pack_adopts_an_unindexed_one_and_removes_a_redundant_one() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let (a, b, c) = (blobs(20, 6), blobs(20, 7), blobs(20, 8));
    s.write_packed(&refs(&a), 0, true).unwrap();
    s.write_packed(&refs(&b), 0, true).unwrap();
    s.write_packed(&refs(&c), 1 << 16, true).unwrap();
    let pa = s.locate(&a[0].0).unwrap().path;
    let pb = s.locate(&b[0].0).unwrap().path;
    let pc = s.locate(&c[0].0).unwrap().path;
    // A crash between a pack's rename and its index write leaves a pack the index does
    // not name: here, c's pack with c's records gone.
    let kept = fs::read(&pc).unwrap();
    for (h, _) in &c {
        s.forget(h);
    }
    drop(s);
    fs::write(&pc, kept).unwrap();
    fs::remove_file(&pa).unwrap();
    // And a pack nothing in which is new.
    let redundant = pb.with_file_name("00000000000000ff");
    fs::copy(&pb, &redundant).unwrap();
    let (s, rep) = open_reporting(d.path(), 1 << 30);
    assert_eq!(rep.missing, 20, "the lost pack's blobs");
    assert_eq!(rep.adopted, 20, "the unindexed pack's blobs");
    assert_eq!(rep.tmp_removed, 1, "the redundant pack");
    assert!(!redundant.exists());
    assert!(a.iter().all(|(h, _)| !s.contains(h)));
    for (h, data) in b.iter().chain(&c) {
        assert_eq!(&s.read_range(h, 0, 0).unwrap(), data);
    }
    // Adopted unpinned (pin sync pins what the cluster needs), at the pack's chunk size.
    assert!(c.iter().all(|(h, _)| !s.is_pinned(h)));
    assert_eq!(s.chunk_size_of(&c[0].0), Some(1 << 16));
    let held: u64 = b.iter().chain(&c).map(|(_, d)| d.len() as u64).sum();
    assert_eq!(s.stats().used, held);
    // A new pack never takes an old one's name.
    s.write_packed(&refs(&a), 0, true).unwrap();
    let pa2 = s.locate(&a[0].0).unwrap().path;
    assert!(pa2 != pb && pa2 != pc && pa2 != redundant);
    assert!(pb.exists() && pc.exists());
    // The walk of the blob directories leaves packed blobs alone.
    let walked = s.check_dirs().unwrap();
    assert_eq!((walked.missing, walked.adopted, walked.quarantined), (0, 0, 0));
    assert!(a.iter().chain(&b).chain(&c).all(|(h, _)| s.contains(h)));
    check_books(&s);
}
