//! Outboards kept beside blobs, on real files in a temp dir.

use std::fs;

use locus_proto::outboard::{self, GROUP};
use locus_proto::BlobHash;

use super::super::tests::open;
use super::super::{hex, StoreError};

fn data(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| ((i ^ seed).wrapping_mul(2654435761) >> 11) as u8)
        .collect()
}

fn put(s: &std::sync::Arc<super::BlobStore>, data: &[u8], chunk: u32, pin: bool) -> BlobHash {
    let h = BlobHash::of(data);
    let mut w = s.begin_write(h, data.len() as u64, chunk, pin).unwrap().unwrap();
    for part in data.chunks(100_000) {
        w.write(part).unwrap();
    }
    w.finish().unwrap();
    h
}

fn kept_path(d: &std::path::Path, h: &BlobHash) -> std::path::PathBuf {
    let x = hex(h);
    d.join("outboards").join(&x[..2]).join(x)
}

#[test]
fn a_written_blob_keeps_the_outboard_of_its_bytes_and_a_small_one_keeps_none() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let big = data(3 * (1 << 20) + 12_345, 1);
    let h = put(&s, &big, 1 << 20, false);
    let (root, ob) = outboard::outboard(&big);
    assert_eq!(root, h);
    assert_eq!(fs::read(kept_path(d.path(), &h)).unwrap(), ob);
    // Its chunk hashes, taken in the same pass, check every chunk on the way back.
    assert_eq!(s.read_range(&h, 0, 1 << 30).unwrap(), big);
    let len = big.len() as u64;
    for (a, b) in [(0, GROUP), (GROUP * 70, GROUP * 75), (len - 1, len), (0, len)] {
        let (a, b) = outboard::rounded(a, b, len);
        let p = s.kept_proof(&h, a, b).unwrap();
        assert_eq!(p, outboard::proof(&ob, len, a, b).unwrap(), "{a}..{b}");
        assert_eq!(
            outboard::verify(&h, len, a, b, &big[a as usize..b as usize], &p),
            Ok(())
        );
    }
    // A blob of 1 MiB or less keeps none; one of a single chunk is hashed once, its
    // chunk hash its own (read back through the chunk check).
    for n in [1 << 20, 300_000, 0] {
        let small = data(n, 2 + n as u64);
        let hs = put(&s, &small, 1 << 20, false);
        assert!(!kept_path(d.path(), &hs).exists(), "{n} bytes");
        assert!(s.kept_proof(&hs, 0, GROUP.min(n as u64)).is_none());
        assert_eq!(s.read_range(&hs, 0, 1 << 30).unwrap(), small, "{n} bytes");
    }
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
}

#[test]
fn a_blob_that_fails_its_hash_leaves_no_outboard() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let big = data(2 << 20, 3);
    let claimed = BlobHash([5; 32]);
    let mut w = s
        .begin_write(claimed, big.len() as u64, 0, false)
        .unwrap()
        .unwrap();
    w.write(&big).unwrap();
    assert!(matches!(w.finish(), Err(StoreError::Mismatch { .. })));
    assert!(!kept_path(d.path(), &claimed).exists());
    assert!(!kept_path(d.path(), &BlobHash::of(&big)).exists());
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    // Dropped half-written: nothing left either.
    let mut w = s
        .begin_write(BlobHash::of(&big), big.len() as u64, 0, false)
        .unwrap()
        .unwrap();
    w.write(&big[..1 << 20]).unwrap();
    drop(w);
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
}

#[test]
fn a_wrong_sized_outboard_is_dropped_and_one_computed_later_is_kept() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let big = data(5 << 20, 4);
    let h = put(&s, &big, 0, false);
    let path = kept_path(d.path(), &h);
    let ob = fs::read(&path).unwrap();
    fs::write(&path, &ob[..ob.len() - 1]).unwrap();
    assert!(s.kept_proof(&h, 0, GROUP).is_none());
    assert!(!path.exists(), "a torn outboard is removed");
    // What a range computes from the verified bytes is kept again; a foreign size is not.
    s.keep_outboard(&h, &ob[..64]);
    assert!(!path.exists());
    s.keep_outboard(&h, &ob);
    assert_eq!(fs::read(&path).unwrap(), ob);
    assert!(s.kept_proof(&h, 0, GROUP).is_some());
}

#[test]
fn a_blob_counts_against_capacity_with_its_outboard_and_the_count_survives_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let (big, small) = (data(3 * (1 << 20) + 12_345, 8), data(300_000, 9));
    let ob = outboard::outboard_len(big.len() as u64) as u64;
    let (used, pinned) = (big.len() as u64 + ob + small.len() as u64, big.len() as u64 + ob);
    let h = {
        let s = open(d.path(), 1 << 30);
        let h = put(&s, &big, 1 << 20, true);
        put(&s, &small, 1 << 20, false);
        assert_eq!(fs::metadata(kept_path(d.path(), &h)).unwrap().len(), ob);
        let st = s.stats();
        assert_eq!((st.used, st.pinned), (used, pinned), "the outboard is counted");
        h
    };
    let s = open(d.path(), 1 << 30);
    let st = s.stats();
    assert_eq!((st.used, st.pinned), (used, pinned), "the same after a restart");
    s.set_pinned(&h, false).unwrap();
    assert_eq!(s.stats().pinned, 0, "unpinned with its outboard");
    // Room for two blobs' bytes and one outboard: the second blob's write evicts the
    // first (its outboard would not fit), and the node stays within its capacity.
    let tight = tempfile::tempdir().unwrap();
    let cap = 2 * big.len() as u64 + ob;
    let s = open(tight.path(), cap);
    let first = put(&s, &data(big.len(), 10), 1 << 20, false);
    put(&s, &big, 1 << 20, false);
    assert!(!s.contains(&first), "two blobs and their outboards do not fit");
    assert!(s.stats().used <= cap, "{} used of {cap}", s.stats().used);
}

#[test]
fn the_outboard_goes_with_its_blob_when_evicted_or_quarantined() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 5 << 20);
    let a = put(&s, &data(2 << 20, 5), 0, false);
    let b = put(&s, &data(2 << 20, 6), 0, true);
    assert!(kept_path(d.path(), &a).exists() && kept_path(d.path(), &b).exists());
    // Room for c only by evicting a.
    let c = put(&s, &data(2 << 20, 7), 0, true);
    assert!(!s.contains(&a));
    assert!(!kept_path(d.path(), &a).exists(), "evicted with its blob");
    assert!(kept_path(d.path(), &c).exists());
    // b's bytes damaged on disk: quarantined by the read that finds it, outboard too.
    let p = s.locate(&b).unwrap().path;
    let mut bytes = fs::read(&p).unwrap();
    bytes[100] ^= 1;
    fs::write(&p, bytes).unwrap();
    assert!(matches!(s.read_range(&b, 0, 10), Err(StoreError::Corrupt { .. })));
    assert!(!kept_path(d.path(), &b).exists(), "quarantined with its blob");
}

#[test]
fn a_whole_check_of_a_blob_without_its_outboard_writes_it_in_the_same_pass() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    // Chunks of 1 MiB: the check hashes each, the outboard's builder sees every byte.
    let big = data((6 << 20) + 5_000, 8);
    let h = put(&s, &big, 1 << 20, false);
    let path = kept_path(d.path(), &h);
    let want = fs::read(&path).unwrap();
    fs::remove_file(&path).unwrap();
    let before = s.whole_hashes();
    assert!(s.verify(&h).unwrap());
    assert_eq!(s.whole_hashes(), before + 1);
    assert_eq!(fs::read(&path).unwrap(), want, "the scrub's pass kept it again");
    // A blob that fails the check keeps none, and leaves nothing in tmp/.
    let bad = put(&s, &data(3 << 20, 9), 1 << 20, false);
    fs::remove_file(kept_path(d.path(), &bad)).unwrap();
    let p = s.locate(&bad).unwrap().path;
    let mut bytes = fs::read(&p).unwrap();
    bytes[(2 << 20) + 7] ^= 1;
    fs::write(&p, bytes).unwrap();
    assert!(!s.verify(&bad).unwrap());
    assert!(!kept_path(d.path(), &bad).exists());
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
}

#[test]
fn the_walk_after_a_restart_removes_outboards_whose_blob_is_not_here_and_keeps_the_rest() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 1 << 30);
    let big = data(2 << 20, 10);
    let h = put(&s, &big, 0, false);
    drop(s);
    // Left by a crash between the outboard's rename and the blob's, or by a build that
    // evicted the blob without knowing about outboards.
    let gone = BlobHash([0xab; 32]);
    let stray = kept_path(d.path(), &gone);
    fs::create_dir_all(stray.parent().unwrap()).unwrap();
    fs::write(&stray, vec![0u8; 64]).unwrap();
    let s = open(d.path(), 1 << 30);
    let rep = s.check_dirs().unwrap();
    assert_eq!(rep.stray_outboards, 1, "{rep:?}");
    assert!(!stray.exists());
    assert_eq!(
        fs::read(kept_path(d.path(), &h)).unwrap(),
        outboard::outboard(&big).1
    );
}
