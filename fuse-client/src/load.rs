//! What a mount reads before it can answer the kernel: the version (one `GetVersion`),
//! its shard replica sets and the cluster's nodes (`Topology`), and its sealed namespace.
//!
//! The namespace is data, not metadata: the metadata service names it (hash and size)
//! and the mount gets its bytes the way it gets a file's, cheapest first:
//!
//! 1. kept inline in the version (a version without files, a few KiB);
//! 2. the local cache node's verified blob file (`EnsureLocal`: the node copies it from a
//!    peer if it lacks it), memory-mapped — every mount of the version on the host
//!    shares those pages;
//! 3. without a usable local node, fetched chunk by chunk through the mount's own
//!    remote reader (`Remote`): the first shard's replicas cheapest first, then wherever
//!    the metadata service says it is now, then a backup — each chunk checked against
//!    the version's chunk hashes for the namespace before it is written — into a file in
//!    the mount's private runtime dir, kept there under its hash for the host's next
//!    mount.
//!
//! The node's copy is the node's to check: `EnsureLocal` answers only with a file whose
//! stamp (inode, size, ctime) is the one its last whole-blob hash saw, and hashes again
//! (quarantining and refetching a bad copy) when the file changed since — as for every
//! file a mount reads from its node. A fetched copy is checked chunk by chunk as it
//! arrives. A namespace that does not open (damaged) or names another dataset is passed
//! over for the next source. The metadata service's work per mount is therefore a few small
//! answers, whatever the number of files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::chunks::ChunkKind;
use locus_proto::client::{MetadataClient, NodeClient};
use locus_proto::{nodepb, pb, BlobHash};

use crate::namespace::Namespace;
use crate::reader::{ChunkRef, Remote};
use crate::LoadError;

/// A kept namespace no mount has opened for this long is removed (a mount that has it
/// mapped keeps its pages; only the next mount fetches it again).
const KEEP_UNUSED: Duration = Duration::from_secs(24 * 3600);
/// Longest the local node may take to make the namespace present (it may copy it).
const LOCAL_LIMIT: Duration = Duration::from_secs(300);

/// Where a mount may get its namespace's bytes.
pub struct Sources<'a> {
    /// The local cache node (its Unix socket).
    pub local: Option<NodeClient>,
    /// The mount's remote reader, for a host without a usable local node.
    pub remote: &'a Arc<Remote>,
    /// A private directory to keep namespaces fetched from peers in (shared by this
    /// user's mounts on the host); none: a temporary file, removed when the mount ends.
    pub cache_dir: Option<PathBuf>,
}

/// A mount's namespace, opened, and where it came from (for the mount's log).
pub struct Opened {
    pub namespace: Namespace,
    pub from: String,
    pub took: Duration,
}

/// Version `version` of `dataset` (0: the latest), refused if it has no sealed
/// namespace.
pub async fn version(
    client: &mut MetadataClient,
    dataset: &str,
    version: u64,
) -> Result<pb::Version, LoadError> {
    let v = client
        .get_version(pb::GetVersionRequest {
            r#ref: Some(pb::VersionRef {
                dataset: dataset.to_string(),
                version,
            }),
        })
        .await?
        .into_inner();
    if v.namespace_blob.is_empty() {
        return Err(LoadError::Unsealed(format!(
            "{dataset}@{} was committed before versions carried a sealed namespace; seal it \
             once with `locus dataset seal {dataset}@{}`, then mount it",
            v.version, v.version
        )));
    }
    Ok(v)
}

/// Opens the namespace of version `v` (from `version`), cheapest source first.
pub async fn namespace(v: &pb::Version, sources: Sources<'_>) -> Result<Opened, LoadError> {
    let started = Instant::now();
    let want = BlobHash::from_slice("namespace_blob", &v.namespace_blob)
        .map_err(|e| LoadError::Invalid(e.to_string()))?;
    let (namespace, from) = if v.namespace_inline.is_empty() {
        open_namespace(v, want, sources).await?
    } else {
        let bytes = v.namespace_inline.clone();
        if bytes.len() as u64 != v.namespace_size || BlobHash::of(&bytes) != want {
            return Err(LoadError::Invalid(
                "the namespace the metadata service keeps for this version does not hash to its name".into(),
            ));
        }
        let ns = Namespace::from_bytes(bytes).map_err(|e| LoadError::Invalid(e.to_string()))?;
        check_dataset(&ns, &v.dataset).map_err(LoadError::Invalid)?;
        (ns, "the version itself".to_string())
    };
    Ok(Opened {
        namespace,
        from,
        took: started.elapsed(),
    })
}

/// The dataset the namespace was sealed for must be the one mounted: its hash binds it
/// to one version's tree, and the name guards against a catalogue mix-up. (The cluster
/// it was sealed in may differ: a catalogue restored from another cluster keeps its
/// versions' namespaces.)
fn check_dataset(ns: &Namespace, dataset: &str) -> Result<(), String> {
    match ns.identity() {
        (d, _) if d == dataset => Ok(()),
        (d, c) => Err(format!(
            "the namespace is dataset {d}'s (sealed in cluster {c}), not {dataset}'s"
        )),
    }
}

async fn open_namespace(
    v: &pb::Version,
    want: BlobHash,
    sources: Sources<'_>,
) -> Result<(Namespace, String), LoadError> {
    let (dataset, size) = (v.dataset.as_str(), v.namespace_size);
    let mut failures = Vec::new();
    if let Some(mut node) = sources.local.clone() {
        let opened = match local_path(&mut node, want, size, v.chunk_size).await {
            Ok(path) => open_checked(&path, size, dataset).map(|ns| (ns, path)),
            Err(e) => Err(e),
        };
        match opened {
            Ok((ns, path)) => return Ok((ns, format!("the local node ({})", path.display()))),
            Err(e) => {
                tracing::warn!(
                    "the local node cannot give this mount its namespace ({e}); fetching it from replicas"
                );
                failures.push(format!("local node: {e}"));
            }
        }
    }
    // A copy fetched by an earlier mount of this host.
    let kept = sources.cache_dir.as_ref().map(|d| d.join(format!("{want}.ns")));
    if let Some(d) = &sources.cache_dir {
        prune_kept(d, KEEP_UNUSED);
    }
    if let Some(p) = kept.as_ref().filter(|p| p.exists()) {
        match open_checked(p, size, dataset) {
            Ok(ns) => {
                // Used: not pruned for another KEEP_UNUSED.
                if let Ok(f) = std::fs::File::options().write(true).open(p) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                return Ok((ns, format!("this host's copy ({})", p.display())));
            }
            Err(e) => {
                tracing::warn!("{}: {e}; fetching it again", p.display());
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let chunks = chunk_hashes(v)?;
    let file = fetch(
        sources.remote,
        want,
        size,
        v.chunk_size,
        &chunks,
        sources.cache_dir.as_deref(),
    )
    .await
    .map_err(|e| {
        failures.push(e);
        LoadError::Namespace(failures.join("; "))
    })?;
    let ns = open_checked(file.path(), size, dataset).map_err(|e| {
        // Every chunk hashed right, so the namespace the catalogue names is itself bad.
        LoadError::Invalid(format!("its namespace does not open: {e}"))
    })?;
    let from = match &kept {
        // Named by its hash only once every chunk of it was checked.
        Some(k) => match file.persist(k) {
            Ok(_) => format!("the cluster's nodes, kept at {}", k.display()),
            Err(e) => {
                tracing::warn!("cannot keep the namespace at {}: {}", k.display(), e.error);
                "the cluster's nodes".to_string()
            }
        },
        // Unlinked while mapped: the mapping keeps its pages.
        None => "the cluster's nodes".to_string(),
    };
    Ok((ns, from))
}

/// Maps the namespace file at `path` and checks it is the mounted dataset's.
fn open_checked(path: &Path, size: u64, dataset: &str) -> Result<Namespace, String> {
    let ns = Namespace::map(path, size).map_err(|e| e.to_string())?;
    check_dataset(&ns, dataset)?;
    Ok(ns)
}

/// The namespace's chunk hashes as the version gives them.
fn chunk_hashes(v: &pb::Version) -> Result<Vec<BlobHash>, LoadError> {
    let n = v.namespace_size.div_ceil(u64::from(v.chunk_size.max(1)));
    if v.namespace_chunks.len() as u64 != 32 * n {
        return Err(LoadError::Invalid(format!(
            "the version lists {} bytes of namespace chunk hashes, not {} for {} chunks",
            v.namespace_chunks.len(),
            32 * n,
            n
        )));
    }
    v.namespace_chunks
        .chunks(32)
        .map(|c| BlobHash::from_slice("namespace_chunks", c).map_err(|e| LoadError::Invalid(e.to_string())))
        .collect()
}

async fn local_path(
    node: &mut NodeClient,
    want: BlobHash,
    size: u64,
    chunk_size: u32,
) -> Result<PathBuf, String> {
    let ask = node.ensure_local(nodepb::EnsureLocalRequest {
        hash: want.0.to_vec(),
        size,
        chunk_size,
        // The namespace is mapped whole from the path: a packed copy is read from
        // replicas instead (namespaces are written alone, never packed, by this build).
        packed_ok: false,
    });
    let r = tokio::time::timeout(LOCAL_LIMIT, ask)
        .await
        .map_err(|_| format!("no answer within {LOCAL_LIMIT:?}"))?
        .map_err(|s| s.message().to_string())?;
    Ok(PathBuf::from(r.into_inner().path))
}

/// Chunks fetched at once: enough to keep a few replicas busy, bounded memory.
const FETCH_AHEAD: usize = 4;

/// Fetches the namespace chunk by chunk through the mount's remote reader (every chunk
/// checked against its hash, from whichever source has it) into a new file in `dir` (or
/// the temporary dir).
async fn fetch(
    remote: &Arc<Remote>,
    want: BlobHash,
    size: u64,
    chunk_size: u32,
    chunks: &[BlobHash],
    dir: Option<&Path>,
) -> Result<tempfile::NamedTempFile, String> {
    use std::io::Write;
    let shard = remote
        .first_shard()
        .ok_or("the version has no shard to hold it")?;
    let file = match dir {
        Some(d) => tempfile::NamedTempFile::new_in(d),
        None => tempfile::NamedTempFile::new(),
    }
    .map_err(|e| format!("cannot create a file for it: {e}"))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file.as_file());
    let cs = u64::from(chunk_size.max(1));
    let mut pending = std::collections::VecDeque::new();
    let mut next = 0usize;
    loop {
        while pending.len() < FETCH_AHEAD && next < chunks.len() {
            let offset = next as u64 * cs;
            let c = ChunkRef {
                ino: 0,
                blob: want,
                shard,
                index: next as u32,
                offset,
                len: cs.min(size - offset),
                hash: chunks[next],
                size,
                // A namespace's own chunk hashes are plain (`sealed::Writer`).
                kind: ChunkKind::Plain,
            };
            let r = remote.clone();
            pending.push_back(tokio::spawn(async move { r.fetch_uncached(c).await }));
            next += 1;
        }
        let Some(task) = pending.pop_front() else { break };
        let got = task
            .await
            .map_err(|e| format!("fetching it: {e}"))?
            .map_err(|e| e.to_string())?;
        for piece in got.parts() {
            out.write_all(piece)
                .map_err(|e| format!("cannot write it: {e}"))?;
        }
    }
    out.flush().map_err(|e| format!("cannot write it: {e}"))?;
    drop(out);
    Ok(file)
}

/// Removes kept namespaces unused for `unused`, and fetches abandoned half way.
fn prune_kept(dir: &Path, unused: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = std::time::SystemTime::now();
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > unused);
        if old {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
