//! A metadata service with nodes, and helpers that read the catalogue (manifests, shards, waits).

use std::time::Duration;

use locus_proto::client::MetadataClient;
use locus_proto::manifest::{BlobHash, Entry, EntryKind, RelPath};
use locus_proto::pb;

use super::*;

// ---------------------------------------------------------------------------------------
// Manifests

/// A deterministic synthetic manifest: `files` files spread over directories of
/// `per_dir` files each, under `top/`; sizes vary from 0 to a few chunks. Files go into
/// shards of `files_per_shard` in path order. Returns the entries and shard records.
pub fn synthetic_manifest(
    seed: &str,
    files: usize,
    per_dir: usize,
    files_per_shard: usize,
    chunk_size: u32,
) -> (Vec<pb::Entry>, Vec<pb::Shard>) {
    let mut entries = vec![dir_entry("top")];
    let mut shards: Vec<pb::Shard> = Vec::new();
    for i in 0..files {
        if i % per_dir == 0 {
            entries.push(dir_entry(&format!("top/d{:05}", i / per_dir)));
        }
        let size = match i % 7 {
            0 => 0,
            1 => u64::from(chunk_size) * 2 + 17,
            _ => (i as u64 * 7919) % 200_000,
        };
        let shard = (i / files_per_shard) as u32;
        if shards.len() <= shard as usize {
            shards.push(pb::Shard {
                id: shard,
                ..Default::default()
            });
        }
        let s = &mut shards[shard as usize];
        s.bytes += size;
        s.files += 1;
        let name = format!("top/d{:05}/{seed}-f{i:07}.bin", i / per_dir);
        let blob = BlobHash::of(name.as_bytes());
        // As in real data, a file of one chunk has the blob's hash as its chunk's.
        let chunks = match size.div_ceil(u64::from(chunk_size)) {
            1 => vec![blob],
            n => (0..n)
                .map(|c| BlobHash::of(format!("{name}#{c}").as_bytes()))
                .collect(),
        };
        entries.push(pb::Entry::from(Entry {
            path: RelPath::try_from(name).unwrap(),
            kind: EntryKind::File {
                size,
                blob,
                chunks,
                shard,
            },
            mode: 0o644,
            mtime_ns: 1_700_000_000_000_000_000 + i as i64,
        }));
    }
    // The order importers upload in (the catalogue's).
    entries.sort_unstable_by(|a, b| locus_proto::sealed::canonical_cmp(&a.path, &b.path));
    (entries, shards)
}

pub fn dir_entry(path: &str) -> pb::Entry {
    pb::Entry {
        path: path.into(),
        kind: pb::EntryKind::Dir as i32,
        mode: 0o755,
        mtime_ns: 1_700_000_000_000_000_000,
        ..Default::default()
    }
}

/// Commits a version of `dataset` holding one file, `blob`, with these chunk hashes: what
/// makes a blob known to the cluster (nodes take a blob's size only from a committed
/// manifest) without importing real bytes.
pub async fn commit_blob(
    c: &mut MetadataClient,
    dataset: &str,
    blob: &[u8],
    size: u64,
    chunk_size: u32,
    chunks: Vec<Vec<u8>>,
) -> Result<pb::Version, tonic::Status> {
    let entry = pb::Entry {
        path: "blob".into(),
        kind: pb::EntryKind::File as i32,
        size,
        mode: 0o644,
        mtime_ns: 1_700_000_000_000_000_000,
        blob: blob.to_vec(),
        chunks,
        shard: 0,
        ..Default::default()
    };
    let shard = pb::Shard {
        id: 0,
        bytes: size,
        files: 1,
        replicas: Vec::new(),
    };
    commit(c, dataset, chunk_size, vec![entry], vec![shard]).await
}

/// Opens a session, uploads the manifest in pages and commits it, with its sealed
/// namespace's hash as an importer sends it (the blob itself stored nowhere: a version
/// to list and locate, not to mount; `commit_mountable` stores it).
pub async fn commit(
    c: &mut MetadataClient,
    dataset: &str,
    chunk_size: u32,
    entries: Vec<pb::Entry>,
    shards: Vec<pb::Shard>,
) -> Result<pb::Version, tonic::Status> {
    commit_with(c, dataset, chunk_size, entries, shards, None).await
}

/// `commit`, with the sealed namespace stored on `node` and `node` a replica of the first
/// shard, so the version can be mounted (its files need not exist anywhere).
pub async fn commit_mountable(
    c: &mut MetadataClient,
    node: &Node,
    dataset: &str,
    chunk_size: u32,
    entries: Vec<pb::Entry>,
    shards: Vec<pb::Shard>,
) -> Result<pb::Version, tonic::Status> {
    commit_with(c, dataset, chunk_size, entries, shards, Some(node)).await
}

/// The sealed namespace of a manifest built by hand, as an importer builds it. Err when
/// the service does not answer (the cluster id is its): a caller that commits under
/// kills and freezes counts that as a failed attempt, like any other call.
pub async fn seal_manifest(
    c: &mut MetadataClient,
    dataset: &str,
    chunk_size: u32,
    entries: &[pb::Entry],
) -> Result<(Vec<u8>, locus_proto::BlobHash), tonic::Status> {
    let cluster = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await?
        .into_inner()
        .cluster_id;
    let entries: Vec<Entry> = entries
        .iter()
        .cloned()
        .map(|e| Entry::try_from(e).unwrap())
        .collect();
    Ok(locus_proto::sealed::seal(entries, chunk_size, dataset, &cluster).expect("a sealable manifest"))
}

async fn commit_with(
    c: &mut MetadataClient,
    dataset: &str,
    chunk_size: u32,
    entries: Vec<pb::Entry>,
    mut shards: Vec<pb::Shard>,
    store_on: Option<&Node>,
) -> Result<pb::Version, tonic::Status> {
    let (sealed, hash) = seal_manifest(c, dataset, chunk_size, &entries).await?;
    if let Some(node) = store_on {
        if let Some(first) = shards.iter_mut().min_by_key(|s| s.id) {
            first.replicas = vec![node.id.clone()];
        }
        node.client()
            .await
            .write_blob(tokio_stream::iter(vec![
                locus_proto::nodepb::WriteBlobMessage {
                    msg: Some(locus_proto::nodepb::write_blob_message::Msg::Header(
                        locus_proto::nodepb::WriteBlobHeader {
                            hash: hash.0.to_vec(),
                            size: sealed.len() as u64,
                            chunk_size,
                            pin: true,
                        },
                    )),
                },
                locus_proto::nodepb::WriteBlobMessage {
                    msg: Some(locus_proto::nodepb::write_blob_message::Msg::Data(
                        sealed.clone().into(),
                    )),
                },
            ]))
            .await?;
    }
    let s = c
        .begin_version(pb::BeginVersionRequest {
            dataset: dataset.into(),
            replication: 1,
            chunk_size,
            ..Default::default()
        })
        .await?
        .into_inner();
    locus_proto::client::put_entries_paged(c, s.session_id, entries).await?;
    locus_proto::client::put_shards_paged(c, s.session_id, shards).await?;
    let v = c
        .commit_version(pb::CommitVersionRequest {
            session_id: s.session_id,
            namespace_blob: hash.0.to_vec(),
            namespace_size: sealed.len() as u64,
        })
        .await?
        .into_inner();
    Ok(v.version.expect("commit returns the version"))
}

/// A version's shards (first page of 10,000).
pub async fn shards(c: &mut locus_proto::client::MetadataClient, ds: &str, v: u64) -> Vec<pb::Shard> {
    c.list_shards(pb::ListShardsRequest {
        r#ref: Some(pb::VersionRef {
            dataset: ds.into(),
            version: v,
        }),
        start: 0,
        limit: 10_000,
    })
    .await
    .unwrap()
    .into_inner()
    .shards
}

/// Waits until every shard of `ds@1` has two replicas, none on `node` (after a drain or
/// a kill and repair).
pub async fn wait_moved_off(m: &Metadata, ds: &str, node: &str) {
    wait_moved_off_to(m, ds, node, 2).await
}

/// Waits until every shard of `ds@1` has `replicas` replicas, none on `node`.
pub async fn wait_moved_off_to(m: &Metadata, ds: &str, node: &str, replicas: usize) {
    // The admin's token where the service has tokens (listing shards needs one).
    let opts = m.client_options(m.token("admin"));
    wait_until(
        &format!("{node} to hold no replicas of {ds}"),
        Duration::from_secs(90),
        || {
            let opts = opts.clone();
            async move {
                let mut c = locus_proto::client::connect(&opts).await.ok()?;
                let s = shards(&mut c, ds, 1).await;
                s.iter()
                    .all(|s| s.replicas.len() == replicas && !s.replicas.iter().any(|r| r == node))
                    .then_some(())
            }
        },
    )
    .await;
}

/// Waits until the metadata service reports `node` down.
pub async fn wait_node_down(m: &Metadata, node: &str) {
    let opts = m.client_options(m.token("admin"));
    wait_until(&format!("{node} to be down"), Duration::from_secs(30), || {
        let opts = opts.clone();
        async move {
            let mut c = locus_proto::client::connect(&opts).await.ok()?;
            let n = c
                .list_nodes(pb::ListNodesRequest {})
                .await
                .ok()?
                .into_inner()
                .nodes;
            n.iter()
                .any(|n| n.id == node && n.state == pb::NodeState::Down as i32)
                .then_some(())
        }
    })
    .await;
}

/// Every entry of a version, sorted by path.
pub async fn all_entries(c: &mut MetadataClient, dataset: &str, version: u64) -> Vec<pb::Entry> {
    let (_, mut e) = locus_proto::client::list_all_entries(
        c,
        pb::VersionRef {
            dataset: dataset.into(),
            version,
        },
        None,
        false,
    )
    .await
    .expect("list entries");
    e.sort_by(|a, b| a.path.cmp(&b.path));
    e
}

pub fn sorted(mut e: Vec<pb::Entry>) -> Vec<pb::Entry> {
    e.sort_by(|a, b| a.path.cmp(&b.path));
    e
}

/// A metadata service (2 s liveness, fast repair) and `nodes` cache nodes n1, n2, ….
pub async fn cluster(h: &Harness, nodes: usize, opts: impl Fn(usize) -> NodeOpts) -> (Metadata, Vec<Node>) {
    cluster_with(h, MetadataOpts::default(), nodes, opts).await
}

/// `cluster` with the service's options given (tokens, say); the short liveness timeout
/// and repair interval unless they set their own.
pub async fn cluster_with(
    h: &Harness,
    meta: MetadataOpts,
    nodes: usize,
    opts: impl Fn(usize) -> NodeOpts,
) -> (Metadata, Vec<Node>) {
    let mut meta = meta;
    meta.liveness_timeout = meta.liveness_timeout.or(Some("2s"));
    if !meta.extra.iter().any(|a| a == "--repair-interval") {
        meta.extra.extend(["--repair-interval".into(), "500ms".into()]);
    }
    let m = h.start_metadata("meta", meta).await;
    let mut ns = Vec::new();
    for i in 1..=nodes {
        ns.push(h.start_node(&format!("n{i}"), &m, opts(i)).await);
    }
    (m, ns)
}

/// A cluster whose nodes count as up for two minutes after they fall silent: a node
/// stopped with SIGSTOP is still offered as a placement target and a source, so only the
/// caller's own timeouts can save the work (the hung-peer tests).
pub async fn patient_cluster(h: &Harness, nodes: usize) -> (Metadata, Vec<Node>) {
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("120s"),
                extra: vec!["--repair-interval".into(), "500ms".into()],
                ..Default::default()
            },
        )
        .await;
    let mut ns = Vec::new();
    for i in 1..=nodes {
        ns.push(h.start_node(&format!("n{i}"), &m, NodeOpts::host(i)).await);
    }
    (m, ns)
}
