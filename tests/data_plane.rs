//! The bulk path for blob bytes, end to end: real `locus node serve` processes serving it
//! on their gRPC port, read by the client the mount and peer copies use; what it refuses
//! and why; and that a mount's remote reads take it (and still work over gRPC without).

use locus_testkit as support;

use std::io::{Read, Write};
use std::time::Duration;

use locus_proto::bulk::{self, BulkError, Pool};
use locus_proto::{pb, BlobHash};
use support::*;

const IDLE: Duration = Duration::from_secs(10);

/// One file imported as its own blob on one node: (metadata, node, the bytes, their hash).
async fn one_blob(h: &Harness, m_opts: MetadataOpts, size: usize) -> (Metadata, Node, Vec<u8>, BlobHash) {
    let (m, mut nodes) = cluster_with(h, m_opts, 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pseudo_random(31, size);
    std::fs::write(src.join("big.bin"), &data).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let hash = BlobHash(*blake3::hash(&data).as_bytes());
    (m, nodes.remove(0), data, hash)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_read_returns_exactly_the_asked_range_and_reuses_its_connection() {
    let h = Harness::new("bulk-range");
    let (_m, n, data, hash) = one_blob(&h, MetadataOpts::default(), 3 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    assert!(pool.speaks(&addr));
    // Ranges: inside one chunk, across chunks, to the end (len 0), empty at the end.
    for (off, len) in [(0u64, 100u64), (65_000, 200_000), (1 << 20, 0), (3 << 20, 0)] {
        let r = pool.open(&addr, None, &hash, off, len, IDLE).await.unwrap();
        let end = if len == 0 { data.len() as u64 } else { off + len };
        assert_eq!(r.len(), end - off);
        let got = r.all().await.unwrap();
        assert_eq!(&got[..], &data[off as usize..end as usize], "range {off}+{len}");
    }
    // Four reads, one after another, held one connection open: the node counts one.
    let open = http_get(n.http, "/metrics").await;
    assert!(
        open.lines().any(|l| l == "locus_node_bulk_connections 1"),
        "{}",
        open.lines()
            .filter(|l| l.contains("bulk"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        counter(&n, "locus_node_bulk_sent_bytes_total").await,
        100 + 200_000 + (2 << 20)
    );
    // Streaming in pieces gives the same bytes, each piece exactly as long as asked: a
    // piece size that is not a buffer size class (300,000 in a 512 KiB buffer) must not
    // take the next piece's bytes.
    let mut r = pool.open(&addr, None, &hash, 0, 0, IDLE).await.unwrap();
    let mut all = Vec::new();
    while let Some(b) = r.next(300_000).await.unwrap() {
        assert!(
            b.len() == 300_000 || all.len() + b.len() == data.len(),
            "{}",
            b.len()
        );
        all.extend_from_slice(&b);
    }
    assert_eq!(all, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_requests_are_refused_for_the_right_reason_and_grpc_shares_the_port() {
    let h = Harness::new("bulk-refusals");
    let (_m, n, data, hash) = one_blob(&h, MetadataOpts::default(), 1 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    match pool.open(&addr, None, &BlobHash([9; 32]), 0, 0, IDLE).await {
        Err(BulkError::Missing(m)) => assert!(m.contains("not found") || m.contains("0909"), "{m}"),
        other => panic!("an unknown blob: {other:?}"),
    }
    match pool
        .open(&addr, None, &hash, data.len() as u64 + 1, 0, IDLE)
        .await
    {
        Err(BulkError::Refused(m)) => assert!(m.contains("past the blob's end"), "{m}"),
        other => panic!("an offset past the end: {other:?}"),
    }
    // The connection that carried those refusals still serves.
    let got = pool
        .open(&addr, None, &hash, 0, 10, IDLE)
        .await
        .unwrap()
        .all()
        .await
        .unwrap();
    assert_eq!(&got[..], &data[..10]);

    // By hand: a grant longer than allowed, and an operation that does not exist.
    let mut s = std::net::TcpStream::connect(n.grpc).unwrap();
    s.set_read_timeout(Some(IDLE)).unwrap();
    s.write_all(&bulk::MAGIC).unwrap();
    s.write_all(&(u16::MAX).to_le_bytes()).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert_eq!(&back[..8], &bulk::MAGIC);
    assert_eq!(back[8], bulk::Code::Invalid as u8);
    assert!(String::from_utf8_lossy(&back[11..]).contains("too long"));

    let mut s = std::net::TcpStream::connect(n.grpc).unwrap();
    s.set_read_timeout(Some(IDLE)).unwrap();
    s.write_all(&bulk::MAGIC).unwrap();
    s.write_all(&0u16.to_le_bytes()).unwrap();
    let mut hello = [0u8; 9];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(hello[8], bulk::Code::Ok as u8);
    s.write_all(&[77u8; 49]).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert_eq!(back[0], bulk::Code::Invalid as u8);
    assert!(String::from_utf8_lossy(&back[3..]).contains("unknown operation 77"));

    // gRPC on the same port is untouched by all of that.
    let mut c = n.client().await;
    let have = c
        .have_blobs(locus_proto::nodepb::HaveBlobsRequest {
            hashes: vec![hash.0.to_vec()],
            pin: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(have.present, vec![true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_checks_grants_refuses_a_bulk_connection_without_a_valid_read_grant() {
    let h = Harness::new("bulk-grants");
    let (m, n, data, hash) = one_blob(&h, MetadataOpts::with_tokens(), 1 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    match pool.open(&addr, None, &hash, 0, 0, IDLE).await {
        Err(BulkError::Grant(m)) => assert!(m.contains("grant"), "{m}"),
        other => panic!("no grant: {other:?}"),
    }
    match pool.open(&addr, Some("lg1.not-a-grant"), &hash, 0, 0, IDLE).await {
        Err(BulkError::Grant(_)) => {}
        other => panic!("a forged grant: {other:?}"),
    }
    // A token is not a grant, whatever its role.
    let admin = m.token("admin").unwrap();
    assert!(matches!(
        pool.open(&addr, Some(&admin), &hash, 0, 0, IDLE).await,
        Err(BulkError::Grant(_))
    ));
    let mut c = m.client(Some("admin")).await;
    let issue = |op: &str| pb::IssueGrantRequest {
        node: "*".into(),
        operation: op.into(),
        target: String::new(),
        ttl_ms: 0,
    };
    // An import grant opens writes, not reads.
    let import = c.issue_grant(pb::IssueGrantRequest {
        node: n.id.clone(),
        ..issue("import")
    });
    let import = import.await.unwrap().into_inner().grant;
    match pool.open(&addr, Some(&import), &hash, 0, 0, IDLE).await {
        Err(BulkError::Grant(m)) => assert!(m.contains("does not allow"), "{m}"),
        other => panic!("an import grant: {other:?}"),
    }
    let read = c.issue_grant(issue("read")).await.unwrap().into_inner().grant;
    let got = pool
        .open(&addr, Some(&read), &hash, 0, 0, IDLE)
        .await
        .unwrap()
        .all()
        .await
        .unwrap();
    assert_eq!(&got[..], &data[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_is_never_sent_over_the_bulk_path_and_is_quarantined() {
    let h = Harness::new("bulk-corrupt");
    let (_m, mut nodes) = cluster(&h, 1, NodeOpts::host).await;
    let n = nodes.remove(0);
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let (a, b) = (pseudo_random(41, 1 << 20), pseudo_random(42, 1 << 20));
    std::fs::write(src.join("a.bin"), &a).unwrap();
    std::fs::write(src.join("b.bin"), &b).unwrap();
    // 64 KiB chunks: the node checks each before it sends it.
    let out = import(&_m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (ha, hb) = (
        BlobHash(*blake3::hash(&a).as_bytes()),
        BlobHash(*blake3::hash(&b).as_bytes()),
    );
    let mut files = n.blob_files();
    let (fa, fb) = (
        files.remove(&ha.to_hex()).unwrap(),
        files.remove(&hb.to_hex()).unwrap(),
    );
    // A later clock tick than the node's write: file times move in ticks of a few ms,
    // and a change within the write's own tick would leave the file's stamp as it was
    // (the node would then send the file as trusted, and the receiver's check, not this
    // node, would catch it: bit rot's case, which the scrub covers).
    tokio::time::sleep(Duration::from_millis(50)).await;
    fa.flip(1_000); // in the first chunk
    fb.flip(300_000); // in the fifth
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    // A range whose first chunk fails is refused before any byte is promised.
    match pool.open(&addr, None, &ha, 0, 0, IDLE).await {
        Err(BulkError::DataLoss(m)) => assert!(m.contains("mismatch"), "{m}"),
        other => panic!("a blob corrupt in its first chunk: {other:?}"),
    }
    // One that fails later ends the connection after the good chunks: the reader gets
    // an error, never the damaged chunk.
    let mut r = pool.open(&addr, None, &hb, 0, 0, IDLE).await.unwrap();
    let mut got = Vec::new();
    let e = loop {
        match r.next(64 << 10).await {
            Ok(Some(p)) => got.extend_from_slice(&p),
            Ok(None) => panic!("the whole corrupt blob was sent"),
            Err(e) => break e,
        }
    };
    assert!(matches!(e, BulkError::Unreachable(_)), "{e:?}");
    assert!(
        got.len() <= 256 << 10,
        "{} bytes came before the bad chunk",
        got.len()
    );
    assert_eq!(&got[..], &b[..got.len()]);
    assert_eq!(n.quarantined(), 2);
    for h in [ha, hb] {
        assert!(matches!(
            pool.open(&addr, None, &h, 0, 0, IDLE).await,
            Err(BulkError::Missing(_))
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_only_speaks_grpc_is_told_apart_and_asked_over_grpc() {
    // What an older node looks like to the bulk client: a gRPC server on the port.
    let old = EndlessPeer::start().await;
    let pool = Pool::new();
    let addr = old.addr.to_string();
    match pool.open(&addr, None, &BlobHash([1; 32]), 0, 0, IDLE).await {
        Err(BulkError::Unsupported(_)) => {}
        other => panic!("a gRPC-only server: {other:?}"),
    }
    assert!(
        !pool.speaks(&addr),
        "remembered, so the next read goes to gRPC at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_reads_remote_files_over_the_bulk_path_and_over_grpc_when_it_is_off() {
    let h = Harness::new("bulk-mount");
    let (m, n, data, _hash) = one_blob(&h, MetadataOpts::default(), 5 << 20).await;
    let before = counter(&n, "locus_node_bulk_sent_bytes_total").await;
    let mnt = m.mount("bulk", "ds@1", None, &[]);
    assert_eq!(std::fs::read(mnt.path.join("big.bin")).unwrap(), data);
    let sent = counter(&n, "locus_node_bulk_sent_bytes_total").await - before;
    assert!(
        sent >= data.len() as u64,
        "the mount's reads sent {sent} bytes over the bulk path, the file is {}",
        data.len()
    );
    drop(mnt);

    let mnt = m.mount_with_env("grpc", "ds@1", None, &[], &[(bulk::ENV_SWITCH, "off")]);
    let read_before = counter(&n, "locus_node_read_bytes_total").await;
    let bulk_before = counter(&n, "locus_node_bulk_sent_bytes_total").await;
    assert_eq!(std::fs::read(mnt.path.join("big.bin")).unwrap(), data);
    assert_eq!(
        counter(&n, "locus_node_bulk_sent_bytes_total").await,
        bulk_before,
        "LOCUS_BULK=off still took the bulk path"
    );
    assert!(counter(&n, "locus_node_read_bytes_total").await - read_before >= data.len() as u64);
}

/// A RANGE request for `[start, end)` of the chunk `[chunk_offset, +chunk_len)`.
fn range_of(hash: BlobHash, chunk_offset: u64, chunk_len: u64, start: u64, end: u64) -> bulk::RangeRequest {
    bulk::RangeRequest {
        hash,
        chunk_offset,
        chunk_len,
        start,
        end,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_comes_with_the_proof_that_checks_it_against_its_chunk_and_bad_ones_are_refused() {
    use locus_proto::outboard::{self, GROUP};
    let h = Harness::new("bulk-ranges");
    // 6 MiB: two chunks of the import's 4 MiB.
    let (_m, n, data, hash) = one_blob(&h, MetadataOpts::default(), 6 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    let sent = || counter(&n, "locus_node_bulk_sent_bytes_total");
    // The chunk geometry is the reader's: the import's 4 MiB chunks, or 1 MiB ones (the
    // same blob imported by another version with another chunk size).
    for (c_off, c_len) in [(0u64, 4u64 << 20), (4 << 20, 2 << 20), (1 << 20, 1 << 20)] {
        let chunk = &data[c_off as usize..(c_off + c_len) as usize];
        let chunk_hash = BlobHash(*blake3::hash(chunk).as_bytes());
        for (s, e) in [(0, GROUP), (5 * GROUP, 9 * GROUP), (c_len - GROUP, c_len)] {
            let before = sent().await;
            let r = pool
                .range(&addr, None, &range_of(hash, c_off, c_len, s, e), IDLE)
                .await
                .unwrap();
            assert_eq!(
                &r.data[..],
                &chunk[s as usize..e as usize],
                "{c_off}+{c_len} {s}..{e}"
            );
            assert_eq!(
                outboard::verify(&chunk_hash, c_len, s, e, &r.data, &r.proof),
                Ok(())
            );
            // The group and its proof, not the chunk.
            let moved = sent().await - before;
            assert_eq!(moved, 4 + r.proof.len() as u64 + (e - s));
            assert!(r.proof.len() <= 12 * 64, "a proof of {} bytes", r.proof.len());
        }
    }
    // Refused for what is wrong with them, and the connection goes on serving.
    let refused = |r: Result<bulk::Ranged, BulkError>| match r {
        Err(BulkError::Refused(m)) => m,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let m = refused(
        pool.range(&addr, None, &range_of(hash, 0, 4 << 20, 100, GROUP), IDLE)
            .await,
    );
    assert!(m.contains("whole groups"), "{m}");
    let m = refused(
        pool.range(&addr, None, &range_of(hash, 4 << 20, 4 << 20, 0, GROUP), IDLE)
            .await,
    );
    assert!(m.contains("not within the blob"), "{m}");
    let m = refused(
        pool.range(&addr, None, &range_of(hash, 0, 1 << 20, GROUP, GROUP), IDLE)
            .await,
    );
    assert!(m.contains("whole groups"), "{m}");
    // What one request may cost the node is bounded: no range past 8 MiB (and no
    // outboard computed for a chunk past the largest chunk size: `wire.rs`'s tests).
    let m = refused(
        pool.range(&addr, None, &range_of(hash, 0, 1 << 30, 0, 9 << 20), IDLE)
            .await,
    );
    assert!(m.contains("longer than"), "{m}");
    match pool
        .range(
            &addr,
            None,
            &range_of(BlobHash([7; 32]), 0, 1 << 20, 0, GROUP),
            IDLE,
        )
        .await
    {
        Err(BulkError::Missing(_)) => {}
        other => panic!("an unknown blob: {other:?}"),
    }
    let r = pool
        .range(&addr, None, &range_of(hash, 0, 4 << 20, 0, GROUP), IDLE)
        .await
        .unwrap();
    assert_eq!(&r.data[..], &data[..GROUP as usize]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_a_corrupt_blob_is_never_sent_and_the_blob_is_quarantined() {
    use locus_proto::outboard::GROUP;
    let h = Harness::new("bulk-range-corrupt");
    let (_m, n, _data, hash) = one_blob(&h, MetadataOpts::default(), 3 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    // A chunk's outboard (not the whole blob's, which the store keeps on disk) is
    // computed and kept in memory by the first range...
    let len = 2 << 20;
    pool.range(&addr, None, &range_of(hash, 0, len, 0, GROUP), IDLE)
        .await
        .unwrap();
    // ...then a bit of group 40 rots: that group's bytes no longer match the tree.
    tokio::time::sleep(Duration::from_millis(50)).await;
    n.blob_files()
        .remove(&hash.to_hex())
        .unwrap()
        .flip(40 * GROUP + 3);
    match pool
        .range(&addr, None, &range_of(hash, 0, len, 40 * GROUP, 41 * GROUP), IDLE)
        .await
    {
        Err(BulkError::DataLoss(m)) => assert!(m.contains("do not match"), "{m}"),
        other => panic!("a range with a flipped bit: {other:?}"),
    }
    assert_eq!(n.quarantined(), 1);
    assert!(matches!(
        pool.range(&addr, None, &range_of(hash, 0, len, 0, GROUP), IDLE)
            .await,
        Err(BulkError::Missing(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_reader_through_a_mount_moves_the_groups_it_reads_not_whole_chunks() {
    use std::os::unix::fs::FileExt;
    let h = Harness::new("bulk-random");
    let size = 64usize << 20;
    let (m, n, data, _hash) = one_blob(&h, MetadataOpts::default(), size).await;
    let mnt = m.mount("random", "ds@1", None, &[]);
    let f = std::fs::File::open(mnt.path.join("big.bin")).unwrap();
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_RANDOM).unwrap();
    let mut x = 0x9e3779b97f4a7c15u64;
    for read in [64usize << 10, 4 << 10] {
        let before = counter(&n, "locus_node_bulk_sent_bytes_total").await;
        let count = 40;
        let mut buf = vec![0u8; read];
        for _ in 0..count {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let at = (x >> 8) as usize % (size - read);
            f.read_exact_at(&mut buf, at as u64).unwrap();
            assert!(buf[..] == data[at..at + read], "{read} bytes at {at}");
        }
        let moved = counter(&n, "locus_node_bulk_sent_bytes_total").await - before;
        let ratio = moved as f64 / (count * read) as f64;
        // 4 MiB chunks would be 64× and 1,024×: the verification groups read (16 KiB,
        // two where a read straddles them) and their proofs are what moved.
        let most = if read == 4096 { 8.0 } else { 1.5 };
        assert!(
            ratio >= 1.0 && ratio <= most,
            "{read}-byte reads moved {ratio:.2}× their bytes"
        );
    }
}

fn kept_outboard(n: &Node, hash: &BlobHash) -> std::path::PathBuf {
    let x = hash.to_hex();
    n.data_dir.join("outboards").join(&x[..2]).join(x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_an_imported_blob_is_proved_from_the_outboard_kept_on_disk_without_reading_the_blob() {
    use locus_proto::outboard::{self, GROUP};
    let h = Harness::new("bulk-kept-outboard");
    let (_m, mut n, data, hash) = one_blob(&h, MetadataOpts::default(), 6 << 20).await;
    let len = data.len() as u64;
    let path = kept_outboard(&n, &hash);
    // Written by the import, in the pass that hashed the blob.
    let (_, tree) = outboard::outboard(&data);
    assert_eq!(std::fs::read(&path).unwrap(), tree);
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    let kept = || counter(&n, "locus_node_range_kept_outboard_total");
    let computed = || counter(&n, "locus_node_range_outboards_computed_total");
    let read = || counter(&n, "locus_node_read_bytes_total");
    for (s, e) in [(0, GROUP), (200 * GROUP, 203 * GROUP), (len - GROUP, len)] {
        let before = read().await;
        let r = pool
            .range(&addr, None, &range_of(hash, 0, len, s, e), IDLE)
            .await
            .unwrap();
        assert_eq!(&r.data[..], &data[s as usize..e as usize]);
        assert_eq!(outboard::verify(&hash, len, s, e, &r.data, &r.proof), Ok(()));
        // Only the range's bytes were read, not the blob to compute its tree.
        assert_eq!(read().await - before, e - s);
    }
    assert_eq!((kept().await, computed().await), (3, 0));

    // A damaged outboard (one pair's byte flipped, same size) costs a recomputation from
    // the blob's verified bytes, never the blob: the range is right, nothing quarantined,
    // and the file is replaced by the right one.
    let mut bad = tree.clone();
    bad[tree.len() - 10] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    let (s, e) = (len - GROUP, len);
    let r = pool
        .range(&addr, None, &range_of(hash, 0, len, s, e), IDLE)
        .await
        .unwrap();
    assert_eq!(outboard::verify(&hash, len, s, e, &r.data, &r.proof), Ok(()));
    assert_eq!(n.quarantined(), 0);
    assert_eq!(computed().await, 1);
    assert_eq!(std::fs::read(&path).unwrap(), tree);

    // A blob stored with no outboard (a store of an earlier build; restarted, so none is
    // in memory either) gets one kept by the first range of it, which the next range is
    // proved from.
    std::fs::remove_file(&path).unwrap();
    n.daemon.kill9();
    n.restart().await;
    let addr = n.grpc.to_string();
    let r = pool
        .range(&addr, None, &range_of(hash, 0, len, 0, GROUP), IDLE)
        .await
        .unwrap();
    assert_eq!(&r.data[..], &data[..GROUP as usize]);
    let computed = || counter(&n, "locus_node_range_outboards_computed_total");
    let kept = || counter(&n, "locus_node_range_kept_outboard_total");
    assert_eq!((kept().await, computed().await), (0, 1));
    assert_eq!(std::fs::read(&path).unwrap(), tree);
    pool.range(&addr, None, &range_of(hash, 0, len, GROUP, 2 * GROUP), IDLE)
        .await
        .unwrap();
    assert_eq!((kept().await, computed().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_a_blob_rotten_under_its_kept_outboard_is_never_sent_and_the_blob_is_quarantined() {
    use locus_proto::outboard::GROUP;
    let h = Harness::new("bulk-range-rot");
    let (_m, n, _data, hash) = one_blob(&h, MetadataOpts::default(), 3 << 20).await;
    let pool = Pool::new();
    let addr = n.grpc.to_string();
    let len = 3 << 20;
    assert!(kept_outboard(&n, &hash).exists());
    n.blob_files()
        .remove(&hash.to_hex())
        .unwrap()
        .flip(100 * GROUP + 3);
    // The bytes do not match the kept tree; the node checks the blob itself before it
    // blames either, and the blob fails.
    match pool
        .range(
            &addr,
            None,
            &range_of(hash, 0, len, 100 * GROUP, 101 * GROUP),
            IDLE,
        )
        .await
    {
        Err(BulkError::DataLoss(m)) => assert!(m.contains("failed verification"), "{m}"),
        other => panic!("a range with a flipped bit: {other:?}"),
    }
    assert_eq!(n.quarantined(), 1);
    assert!(
        !kept_outboard(&n, &hash).exists(),
        "the outboard went with its blob"
    );
}

/// What a node of the previous build does with a RANGE: hello OK, then "unknown
/// operation" and the connection closed (its code, byte for byte). Counts connections.
fn previous_build_node() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = conns.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut hello = [0u8; 10];
            if s.read_exact(&mut hello).is_err() {
                continue;
            }
            let mut grant = vec![0u8; u16::from_le_bytes([hello[8], hello[9]]) as usize];
            let _ = s.read_exact(&mut grant);
            let mut back = bulk::MAGIC.to_vec();
            back.push(bulk::Code::Ok as u8);
            let _ = s.write_all(&back);
            let mut op = [0u8; 1];
            if s.read_exact(&mut op).is_ok() && op[0] != bulk::OP_READ {
                let _ = s.write_all(&bulk::encode_error(
                    bulk::Code::Invalid,
                    &format!("unknown operation {}", op[0]),
                ));
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        }
    });
    (addr, conns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_previous_build_is_told_to_serve_no_ranges_and_is_not_asked_again() {
    use locus_proto::outboard::GROUP;
    let (addr, conns) = previous_build_node();
    let addr = addr.to_string();
    let pool = Pool::new();
    let r = range_of(BlobHash([3; 32]), 0, 4 << 20, 0, GROUP);
    match pool.range(&addr, None, &r, IDLE).await {
        Err(BulkError::Unsupported(m)) => assert!(m.contains("unknown operation 2"), "{m}"),
        other => panic!("a node without ranges: {other:?}"),
    }
    // Remembered: the mount reads whole chunks from it without asking again.
    match pool.range(&addr, None, &r, IDLE).await {
        Err(BulkError::Unsupported(_)) => {}
        other => panic!("asked again: {other:?}"),
    }
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(pool.speaks(&addr), "whole reads still take the bulk path");
}
