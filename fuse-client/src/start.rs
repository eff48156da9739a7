//! Everything a mount does before it answers the kernel, as one call from one options
//! struct: the version, where its shards are, the remote reader, the sealed namespace
//! (from the local node or peers), the version's origin as the last source, who opens
//! files, and the file system built on all of it. `locus mount` parses its arguments into
//! `MountOptions`, calls `prepare`, and keeps only the process around the result
//! (daemonizing, the holder's hand-off, signals, the status file).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locus_proto::client::{MetadataClient, NodeClient};
use locus_proto::pb;

use crate::core::Settings;
use crate::metrics::Metrics;
use crate::namespace::Namespace;
use crate::reader::{GrpcReplicas, Place, Remote, Topology};
use crate::{LoadError, LocusFs};

/// Who opens files of a mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Opens {
    /// By what the version holds (`Opens::kernel`).
    #[default]
    Auto,
    /// The kernel, without asking the mount.
    Kernel,
    /// The mount, for every open.
    Mount,
}

impl Opens {
    /// Whether the kernel should open files by itself. Per open, passthrough costs two
    /// round trips to the mount (~25 µs of CPU here); the kernel's own opens cost none
    /// but read large files through the mount's small pages (~7 vs ~16 GB/s warm). The
    /// two break even around a 0.5 MiB file, so a version whose files are mostly small
    /// is better opened by the kernel. Without passthrough every read goes through the
    /// mount's pages anyway, and the round trips buy nothing.
    pub fn kernel(self, passthrough: bool, files: u64, bytes: u64, min_size: u64) -> bool {
        match self {
            Opens::Kernel => true,
            Opens::Mount => false,
            Opens::Auto => !passthrough || files == 0 || bytes / files < min_size,
        }
    }
}

/// What a mount is of, and how it reads.
pub struct MountOptions {
    pub dataset: String,
    /// 0: the latest.
    pub version: u64,
    /// Where this host is (replicas are ordered by it).
    pub place: Place,
    /// The same host's cache node.
    pub local: Option<NodeClient>,
    /// The node's open socket, used where `local` is None: blobs as descriptors under
    /// this mount's read grants (a user the node does not trust with its data dir).
    pub local_open: Option<std::path::PathBuf>,
    /// Presented to nodes (for grants) by remote reads.
    pub token: Option<String>,
    /// The chunk cache's bytes.
    pub cache_bytes: usize,
    /// How far ahead of a sequential reader chunks are fetched.
    pub readahead: u64,
    /// Where namespaces fetched from peers are kept for this user's next mounts.
    pub cache_dir: Option<PathBuf>,
    pub opens: Opens,
    /// The core's settings; `kernel_opens`, `readahead_chunks` and `generation` are
    /// decided here from the options and the version.
    pub settings: Settings,
}

/// A mount ready to be handed to the kernel.
pub struct Prepared {
    pub fs: LocusFs,
    pub version: pb::Version,
    pub namespace: Arc<Namespace>,
    pub remote: Arc<Remote>,
    pub metrics: Arc<Metrics>,
    /// Whether the kernel is to open files by itself (if it offers to).
    pub kernel_opens: bool,
    /// Where the namespace came from, and how long the whole preparation took.
    pub namespace_from: String,
    pub took: Duration,
}

/// Prepares a mount: reads the version and its topology from the metadata service, its
/// namespace from the cheapest node, and builds the file system. The metadata service's
/// work is `GetVersion`, `ListShards` and `ListNodes`, whatever the version's size.
pub async fn prepare(client: &mut MetadataClient, o: MountOptions) -> Result<Prepared, LoadError> {
    let started = Instant::now();
    let v = crate::load::version(client, &o.dataset, o.version).await?;
    let vref = pb::VersionRef {
        dataset: o.dataset.clone(),
        version: v.version,
    };
    let topology = Topology::load(client, &vref, &o.place).await?;
    let replicas = GrpcReplicas::new(client.clone(), vref, o.token.clone());
    let metrics = Arc::new(Metrics::default());
    let remote = Arc::new(
        Remote::new(
            Arc::new(replicas),
            o.place,
            topology,
            o.cache_bytes,
            metrics.clone(),
        )
        // Four readers' full windows; more readers share them, so memory does not grow
        // with the number of readers.
        .with_readahead_budget((o.readahead as usize).saturating_mul(4)),
    );
    let sources = crate::Sources {
        local: o.local.clone(),
        remote: &remote,
        cache_dir: o.cache_dir,
    };
    let opened = crate::load::namespace(&v, sources).await?;
    let ns = Arc::new(opened.namespace);
    match locus_backup::origin::Origin::parse(&v.origin) {
        Ok(Some(origin)) => {
            tracing::info!(
                "origin {} is the last source for chunks no node serves",
                origin.describe()
            );
            remote.set_origin(origin, ns.clone());
        }
        Ok(None) => {}
        Err(e) => tracing::warn!("the version's origin cannot be used: {e}"),
    }
    let mut settings = o.settings;
    let local: Option<Arc<dyn crate::core::LocalNode>> = match (&o.local, &o.local_open) {
        (Some(client), _) => Some(Arc::new(crate::core::GrpcLocalNode {
            client: client.clone(),
            rt: tokio::runtime::Handle::current(),
            chunk_size: ns.chunk_size(),
        })),
        (None, Some(path)) => {
            let grants = locus_proto::grant::Grants::new(client.clone(), o.token.as_deref());
            let target = format!("{}@{}", v.dataset, v.version);
            let rt = tokio::runtime::Handle::current();
            Some(Arc::new(crate::core::OpenSocketNode {
                path: path.clone(),
                chunk_size: ns.chunk_size(),
                grant: Box::new(move || {
                    rt.block_on(grants.get("*", locus_proto::grant::Op::Read, &target))
                        .map(Option::unwrap_or_default)
                        .map_err(|e| format!("no read grant for the open socket: {}", e.message()))
                }),
                idle: Default::default(),
            }))
        }
        (None, None) => None,
    };
    settings.kernel_opens = o.opens.kernel(
        local.is_some() && settings.passthrough,
        v.files,
        v.bytes,
        settings.passthrough_min_size,
    );
    settings.readahead_chunks = (o.readahead / u64::from(v.chunk_size.max(1))).max(1) as usize;
    settings.generation = v.version;
    let kernel_opens = settings.kernel_opens;
    let fs = LocusFs::new(
        ns.clone(),
        tokio::runtime::Handle::current(),
        local,
        remote.clone(),
        metrics.clone(),
        settings,
    );
    Ok(Prepared {
        fs,
        version: v,
        namespace: ns,
        remote,
        metrics,
        kernel_opens,
        namespace_from: format!("{} in {:.2}s", opened.from, opened.took.as_secs_f64()),
        took: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_lets_the_kernel_open_versions_of_small_files() {
        const MIB: u64 = 1 << 20;
        // 2,000 × 128 KiB: small files, the kernel opens them.
        assert!(Opens::Auto.kernel(true, 2_000, 2_000 * 128 * 1024, MIB));
        // 4 × 256 MiB: passthrough pays.
        assert!(!Opens::Auto.kernel(true, 4, 4 * 256 * MIB, MIB));
        // Without passthrough (or a local node) the mount's round trips buy nothing.
        assert!(Opens::Auto.kernel(false, 4, 4 * 256 * MIB, MIB));
        // "--passthrough-min-size 0": every file passed through.
        assert!(!Opens::Auto.kernel(true, 2_000, 2_000 * 128 * 1024, 0));
        assert!(Opens::Auto.kernel(true, 0, 0, MIB));
        assert!(Opens::Kernel.kernel(true, 4, 4 * 256 * MIB, MIB));
        assert!(!Opens::Mount.kernel(false, 2_000, 2_000, MIB));
    }
}
