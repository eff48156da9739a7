//! WRITE on the bulk path, end to end: an import hands real `locus node serve` processes
//! its local files over the bulk path (no WriteBlob stream); the node verifies every
//! blob before it keeps it, refuses a grant that does not open writes, and keeps nothing
//! of bytes that are not the blob's.

use locus_testkit as support;

use std::time::Duration;

use locus_proto::bulk::{self, Body, BulkError, Pool, WriteRequest};
use locus_proto::BlobHash;
use support::*;

const IDLE: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_sends_local_files_over_the_bulk_path_and_over_grpc_when_it_is_off() {
    let h = Harness::new("bulk-write-import");
    let (m, nodes) = cluster_with(&h, MetadataOpts::default(), 1, NodeOpts::host).await;
    let n = &nodes[0];
    let src = h.path("src");
    make_tree(&src, 20);
    let big = [pseudo_random(51, 9 << 20), pseudo_random(52, (5 << 20) + 12_345)];
    for (i, b) in big.iter().enumerate() {
        std::fs::write(src.join(format!("big-{i}.bin")), b).unwrap();
    }
    let large: u64 = big.iter().map(|b| b.len() as u64).sum();
    let before = counter(n, "locus_node_bulk_received_bytes_total").await;
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let received = counter(n, "locus_node_bulk_received_bytes_total").await - before;
    // Small files go in WriteBlobs batches; every large one took the bulk path.
    assert!(
        received >= large,
        "the node received {received} bytes over the bulk path; the large files are {large}"
    );
    // What the node kept is exactly the files: its blob files, and a mount of them.
    let kept = n.blob_files();
    for b in &big {
        let hex = BlobHash(*blake3::hash(b).as_bytes()).to_hex();
        let f = kept.get(&hex).expect("the node keeps every large file");
        assert_eq!(&std::fs::read(&f.path).unwrap(), b);
    }
    let mnt = m.mount("mnt", "ds@1", Some(n), &[]);
    assert_same_tree(&src, &mnt.path);
    drop(mnt);

    // `LOCUS_BULK=off`: the same import of new bytes goes over WriteBlob.
    let src2 = h.path("src2");
    std::fs::create_dir_all(&src2).unwrap();
    std::fs::write(src2.join("big.bin"), pseudo_random(53, 6 << 20)).unwrap();
    let before = counter(n, "locus_node_bulk_received_bytes_total").await;
    let out = m.cli_env(
        &[
            "dataset",
            "import",
            "ds2",
            src2.to_str().unwrap(),
            "--replicas",
            "1",
        ],
        &[(bulk::ENV_SWITCH, "off".to_string())],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        counter(n, "locus_node_bulk_received_bytes_total").await,
        before,
        "LOCUS_BULK=off still wrote over the bulk path"
    );
    let mnt = m.mount("mnt2", "ds2@1", Some(n), &[]);
    assert_same_tree(&src2, &mnt.path);
}

/// Objects the client reads from a bucket itself (`--read-by client`) go to the node over
/// the bulk path from the client's memory (up to 16 MiB) or its spill file (larger), not
/// as WriteBlob streams; the node keeps exactly them and a mount reads them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_the_client_reads_from_a_bucket_go_to_the_node_over_the_bulk_path() {
    let h = Harness::new("bulk-write-objects");
    let s3 = h.start_s3().await;
    let bucket = s3.bucket("objects").await;
    let objects = [
        ("data/a.bin", pseudo_random(71, (3 << 20) + 5)),
        ("data/b.bin", pseudo_random(72, 700_000)),
        ("data/big.bin", pseudo_random(73, (17 << 20) + 9)),
    ];
    for (k, v) in &objects {
        let p = object_store::path::Path::from(*k);
        object_store::ObjectStoreExt::put(bucket.as_ref(), &p, v.clone().into())
            .await
            .unwrap();
    }
    let (m, nodes) = cluster_with(&h, MetadataOpts::default(), 1, NodeOpts::host).await;
    let n = &nodes[0];
    let before = counter(n, "locus_node_bulk_received_bytes_total").await;
    let out = m.cli_env(
        &[
            "dataset",
            "import",
            "ds",
            "s3://objects/data",
            "--replicas",
            "1",
            "--read-by",
            "client",
        ],
        &s3.env(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let received = counter(n, "locus_node_bulk_received_bytes_total").await - before;
    let total: u64 = objects.iter().map(|(_, v)| v.len() as u64).sum();
    assert!(
        received >= total,
        "the node received {received} bytes over the bulk path; the objects are {total}"
    );
    let mnt = m.mount("mnt", "ds@1", Some(n), &[]);
    for (k, v) in &objects {
        let name = k.strip_prefix("data/").unwrap();
        assert_eq!(&std::fs::read(mnt.path.join(name)).unwrap(), v, "{name}");
    }
}

/// `size` pseudo-random bytes in a file of the harness: the bytes, the file opened, and
/// the WRITE that stores them as their blob (pinned, 1 MiB chunks).
fn blob_file(h: &Harness, seed: u64, size: usize) -> (Vec<u8>, std::fs::File, WriteRequest) {
    let data = pseudo_random(seed, size);
    let path = h.path(&format!("blob-{seed}.bin"));
    std::fs::write(&path, &data).unwrap();
    let w = WriteRequest {
        hash: BlobHash(*blake3::hash(&data).as_bytes()),
        size: data.len() as u64,
        chunk_size: 1 << 20,
        pin: true,
    };
    (data, std::fs::File::open(&path).unwrap(), w)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_write_needs_an_import_grant_and_keeps_nothing_that_is_not_the_blob() {
    let h = Harness::new("bulk-write-refusals");
    let (m, nodes) = cluster_with(&h, MetadataOpts::with_tokens(), 1, NodeOpts::host).await;
    let n = &nodes[0];
    let addr = n.address();
    let (data, file, w) = blob_file(&h, 61, (3 << 20) + 7);
    let hash = w.hash;
    let read = m.grant("read", "*").await;
    let import = m.grant("import", &n.id).await;
    let pool = Pool::new();
    let nothing = |_: u64| {};

    // A read grant opens reads, not writes; no grant opens nothing.
    match pool
        .write(&addr, Some(&read), w, Body::File(&file), IDLE, &nothing)
        .await
    {
        Err(BulkError::Grant(m)) => assert!(m.contains("does not allow writes"), "{m}"),
        other => panic!("a read grant wrote: {other:?}"),
    }
    assert!(matches!(
        pool.write(&addr, None, w, Body::File(&file), IDLE, &nothing)
            .await,
        Err(BulkError::Grant(_))
    ));
    // And an import grant opens no reads.
    match pool.open(&addr, Some(&import), &hash, 0, 0, IDLE).await {
        Err(BulkError::Grant(m)) => assert!(m.contains("does not allow reads"), "{m}"),
        other => panic!("an import grant read: {other:?}"),
    }

    // Bytes that are not the named blob: refused after they arrive, nothing kept.
    let wrong = WriteRequest {
        hash: BlobHash([7; 32]),
        ..w
    };
    match pool
        .write(&addr, Some(&import), wrong, Body::File(&file), IDLE, &nothing)
        .await
    {
        Err(BulkError::Refused(m)) => assert!(m.contains("match") || m.contains("hash"), "{m}"),
        other => panic!("a wrong blob: {other:?}"),
    }
    assert!(!n.blob_files().contains_key(&BlobHash([7; 32]).to_hex()));

    // The right bytes: stored, counted as they went out; a second time, nothing is sent.
    let sent = std::sync::atomic::AtomicU64::new(0);
    let count = |k: u64| {
        sent.fetch_add(k, std::sync::atomic::Ordering::Relaxed);
    };
    assert!(pool
        .write(&addr, Some(&import), w, Body::File(&file), IDLE, &count)
        .await
        .unwrap());
    assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), data.len() as u64);
    let kept = n.blob_files();
    assert_eq!(std::fs::read(&kept[&hash.to_hex()].path).unwrap(), data);
    let before = counter(n, "locus_node_bulk_received_bytes_total").await;
    assert!(!pool
        .write(&addr, Some(&import), w, Body::File(&file), IDLE, &nothing)
        .await
        .unwrap());
    assert_eq!(counter(n, "locus_node_bulk_received_bytes_total").await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_write_larger_than_the_node_has_room_for_is_refused_before_any_byte_moves() {
    let h = Harness::new("bulk-write-full");
    let (_m, nodes) = cluster_with(&h, MetadataOpts::default(), 1, |i| {
        NodeOpts::host(i).with_capacity("4MiB")
    })
    .await;
    let n = &nodes[0];
    let (_data, file, w) = blob_file(&h, 71, 6 << 20);
    let hash = w.hash;
    let sent = std::sync::atomic::AtomicU64::new(0);
    let count = |k: u64| {
        sent.fetch_add(k, std::sync::atomic::Ordering::Relaxed);
    };
    let before = counter(n, "locus_node_bulk_received_bytes_total").await;
    match Pool::new()
        .write(&n.address(), None, w, Body::File(&file), IDLE, &count)
        .await
    {
        Err(BulkError::Full(m)) => assert!(m.contains("capacity"), "{m}"),
        other => panic!("a blob larger than the node: {other:?}"),
    }
    assert_eq!(
        sent.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no byte was sent"
    );
    assert_eq!(counter(n, "locus_node_bulk_received_bytes_total").await, before);
    assert!(!n.blob_files().contains_key(&hash.to_hex()));
}
