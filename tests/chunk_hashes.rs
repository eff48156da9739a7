//! Tree chunk hashes, end to end: an import records each file's chunk hashes as nodes of
//! the file's own BLAKE3 tree (one pass over the bytes), the catalogue refuses chunk
//! hashes that are not the file's, and versions committed before, with plain chunk
//! hashes, still mount and read — with real processes, a real mount and a node that
//! serves the bytes.

use locus_testkit as support;

use locus_proto::chunks::{tree_chunks_match, ChunkKind};
use locus_proto::manifest::hash_bytes;
use locus_proto::{nodepb, pb, BlobHash};
use support::*;

const MIB: usize = 1 << 20;

fn hashes(v: &[Vec<u8>]) -> Vec<BlobHash> {
    v.iter()
        .map(|c| BlobHash::from_slice("chunk", c).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_records_tree_chunk_hashes_and_a_mount_with_no_local_node_reads_them() {
    let h = Harness::new("tree-chunks-import");
    let (m, nodes) = cluster_with(&h, MetadataOpts::default(), 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let big = pseudo_random(71, 9 * MIB + 4321);
    let small = pseudo_random(72, 300_000);
    std::fs::write(src.join("big.bin"), &big).unwrap();
    std::fs::write(src.join("small.bin"), &small).unwrap();
    // 64 KiB chunks (the harness's import): 145 of them for the large file.
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    let mut c = m.client(None).await;
    let v = c
        .get_version(pb::GetVersionRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "ds".into(),
                version: 1,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(v.tree_chunks, "the version records tree chunk hashes");
    let entries = all_entries(&mut c, "ds", 1).await;
    let e = entries.iter().find(|e| e.path == "big.bin").unwrap();
    let chunks = hashes(&e.chunks);
    assert_eq!(chunks, hash_bytes(&big, 64 << 10, ChunkKind::Tree).2);
    assert_eq!(chunks.len(), 145);
    assert!(tree_chunks_match(&BlobHash::of(&big), &chunks));
    // Not the BLAKE3 of each chunk's bytes: that is what earlier builds recorded.
    assert_ne!(chunks[0], BlobHash::of(&big[..64 << 10]));

    // A mount with no local node checks every chunk it fetches against these.
    let mnt = m.mount("remote", "ds@1", None, &[]);
    assert_eq!(std::fs::read(mnt.path.join("big.bin")).unwrap(), big);
    assert_eq!(std::fs::read(mnt.path.join("small.bin")).unwrap(), small);
    drop(mnt);
    drop(nodes);
}

/// A version as a build before tree chunk hashes committed it: plain chunk hashes,
/// format 1 namespace. Its bytes are on a node of this build (which keeps its own tree
/// chunk hashes for them); a mount with no local node reads and checks them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_with_plain_chunk_hashes_from_an_earlier_build_still_mounts_and_reads() {
    let h = Harness::new("plain-chunks-version");
    let (m, nodes) = cluster_with(&h, MetadataOpts::default(), 1, NodeOpts::host).await;
    let n = &nodes[0];
    let data = pseudo_random(81, 9 * MIB + 777);
    let blob = BlobHash::of(&data);
    let mut node = n.client().await;
    node.write_blob(tokio_stream::iter(vec![
        nodepb::WriteBlobMessage {
            msg: Some(nodepb::write_blob_message::Msg::Header(nodepb::WriteBlobHeader {
                hash: blob.0.to_vec(),
                size: data.len() as u64,
                chunk_size: 0,
                pin: true,
            })),
        },
        nodepb::WriteBlobMessage {
            msg: Some(nodepb::write_blob_message::Msg::Data(data.clone().into())),
        },
    ]))
    .await
    .unwrap();
    let plain: Vec<Vec<u8>> = data
        .chunks(MIB)
        .map(|c| blake3::hash(c).as_bytes().to_vec())
        .collect();
    let entry = pb::Entry {
        path: "old.bin".into(),
        kind: pb::EntryKind::File as i32,
        size: data.len() as u64,
        mode: 0o644,
        mtime_ns: 1_700_000_000_000_000_000,
        blob: blob.0.to_vec(),
        chunks: plain,
        shard: 0,
        ..Default::default()
    };
    let shard = pb::Shard {
        id: 0,
        bytes: data.len() as u64,
        files: 1,
        replicas: vec![n.id.clone()],
    };
    let mut c = m.client(None).await;
    let v = commit_mountable(&mut c, n, "old", 1 << 20, vec![entry], vec![shard])
        .await
        .unwrap();
    assert!(!v.tree_chunks);
    let mnt = m.mount("remote", "old@1", None, &[]);
    assert_eq!(std::fs::read(mnt.path.join("old.bin")).unwrap(), data);
    drop(mnt);
    // And through a mount beside the node.
    let mnt = m.mount("local", "old@1", Some(n), &[]);
    assert_eq!(std::fs::read(mnt.path.join("old.bin")).unwrap(), data);
}

/// A session that records tree chunk hashes refuses chunk hashes that are not those of
/// the file's hash — plain ones, or one changed — naming the entry, so no mount ever
/// finds a whole version's chunks wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalogue_refuses_tree_chunk_hashes_that_are_not_the_files() {
    let h = Harness::new("tree-chunks-refused");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    let data = pseudo_random(91, 3 * MIB + 5);
    let blob = BlobHash::of(&data);
    let tree = hash_bytes(&data, 1 << 20, ChunkKind::Tree).2;
    let entry = |chunks: Vec<BlobHash>| pb::Entry {
        path: "f.bin".into(),
        kind: pb::EntryKind::File as i32,
        size: data.len() as u64,
        mode: 0o644,
        blob: blob.0.to_vec(),
        chunks: chunks.iter().map(|c| c.0.to_vec()).collect(),
        ..Default::default()
    };
    let mut bent = tree.clone();
    bent[2].0[5] ^= 1;
    let plain: Vec<BlobHash> = data.chunks(MIB).map(BlobHash::of).collect();
    let begin = || pb::BeginVersionRequest {
        dataset: "ds".into(),
        chunk_size: 1 << 20,
        replication: 1,
        tree_chunks: true,
        ..Default::default()
    };
    for bad in [plain, bent] {
        let s = c.begin_version(begin()).await.unwrap().into_inner();
        assert!(s.tree_chunks, "the service records tree chunk hashes");
        let e = c
            .put_entries(pb::PutEntriesRequest {
                session_id: s.session_id,
                page: 0,
                entries: vec![entry(bad)],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains("f.bin") && e.message().contains("tree chunk hashes"),
            "{}",
            e.message()
        );
    }
    // The right ones are taken.
    let s = c.begin_version(begin()).await.unwrap().into_inner();
    c.put_entries(pb::PutEntriesRequest {
        session_id: s.session_id,
        page: 0,
        entries: vec![entry(tree)],
    })
    .await
    .unwrap();
}
