//! Verified ranges for readers that jump around: what is asked for, and what happens
//! when a replica sends a bad range.

use std::time::Duration;

use super::*;

/// Chunk size for the range tests: many verification groups per chunk.
const BIG: u32 = 256 << 10;

/// `len` bytes at `at` through the core, checked against the file.
fn read_at(f: &Fixture, at: u64, len: u32) -> Result<(), FsError> {
    let (b, _) = f.core.read_by_inode_bytes(f.ino, at, len)?;
    assert!(
        b[..] == f.data[at as usize..at as usize + len as usize],
        "bytes at {at}"
    );
    Ok(())
}

#[test]
fn a_reader_that_jumps_is_sent_the_groups_it_reads_and_a_sequential_one_whole_chunks() {
    // 64 MiB: reads far apart are further than the kernel's read-ahead reorders reads.
    let f = fixture_sized(BIG, 256, Behave::Good, Behave::Good, None);
    // Far into the file: 4 KiB that straddle two verification groups, then 64 KiB.
    read_at(&f, 200 * u64::from(BIG) + 16_000, 4096).unwrap();
    read_at(&f, 10 * u64::from(BIG) + 100_000, 65_536).unwrap();
    assert_eq!(
        *f.replicas.range_log.lock().unwrap(),
        vec![
            (
                "a1".to_string(),
                200 * u64::from(BIG),
                200 * u64::from(BIG) + (32 << 10)
            ),
            (
                "a1".to_string(),
                10 * u64::from(BIG) + (96 << 10),
                10 * u64::from(BIG) + (176 << 10)
            )
        ]
    );
    assert!(
        f.replicas.log.lock().unwrap().is_empty(),
        "no whole chunk was fetched"
    );
    let m = f.core.metrics.encode();
    assert!(m.contains("locus_mount_range_reads_total 2"), "{m}");
    // A reader going front to back from the start takes whole chunks and reads ahead.
    let g = fixture_sized(BIG, 256, Behave::Good, Behave::Good, None);
    for i in 0..8u64 {
        read_at(&g, i * (128 << 10), 128 << 10).unwrap();
    }
    assert!(g.replicas.range_log.lock().unwrap().is_empty());
    assert!(g.replicas.requests_for(0) == 1 && g.replicas.requests_for(3) == 1);
    // A random reader stays one when a read lands near an earlier one by chance (24
    // near 20, 45 near 60, then 45 again): no whole chunk, no read-ahead.
    let r = fixture_sized(BIG, 256, Behave::Good, Behave::Good, None);
    let at = [200u64, 100, 20, 150, 24, 60, 45, 45];
    for c in at {
        read_at(&r, c * u64::from(BIG) + 70_000, 4096).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        r.replicas.log.lock().unwrap().is_empty(),
        "{:?}",
        r.replicas.log.lock().unwrap()
    );
    assert_eq!(r.replicas.range_log.lock().unwrap().len(), at.len());
}

#[test]
fn a_range_with_a_flipped_bit_a_wrong_proof_node_or_cut_short_is_dropped_for_another_replica() {
    for bad in [
        Behave::Corrupt,
        Behave::WrongProof,
        Behave::Truncated,
        Behave::Hang,
    ] {
        let f = fixture_sized(BIG, 64, bad, Behave::Good, None);
        read_at(&f, 30 * u64::from(BIG) + 5_000, 8192).unwrap();
        let asked: Vec<String> = f
            .replicas
            .range_log
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.0.clone())
            .collect();
        assert_eq!(asked, ["a1", "a2"], "{bad:?}");
        let m = f.core.metrics.encode();
        let corrupt = bad != Behave::Hang;
        assert_eq!(
            m.contains("locus_mount_corrupt_chunks_total 1"),
            corrupt,
            "{bad:?}: {m}"
        );
    }
}

#[test]
fn a_range_no_replica_serves_right_is_read_as_a_whole_chunk_or_fails_eio() {
    // Both send bad ranges; whole chunks from the second are right.
    let f = fixture_sized(BIG, 64, Behave::WrongProof, Behave::Truncated, None);
    read_at(&f, 30 * u64::from(BIG) + 5_000, 8192).unwrap();
    assert_eq!(f.replicas.requests_for(30), 1, "the whole chunk, once");
    // A node without ranges: the whole chunk from it, no range asked of the next.
    let g = fixture_sized(BIG, 64, Behave::NoRanges, Behave::Good, None);
    read_at(&g, 30 * u64::from(BIG) + 5_000, 8192).unwrap();
    assert!(g.replicas.range_log.lock().unwrap().is_empty());
    assert_eq!(first_asked(&g, 30), "a1");
    // Nothing right anywhere: EIO, never wrong bytes.
    let h = fixture_sized(BIG, 64, Behave::Corrupt, Behave::Corrupt, None);
    match h
        .core
        .read_by_inode_bytes(h.ino, 30 * u64::from(BIG) + 5_000, 8192)
    {
        Err(FsError::Unavailable(why)) => {
            assert!(why.to_string().contains("no source could serve it"), "{why}")
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}
