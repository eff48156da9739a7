//! The node's view of the rest of the cluster, through the metadata service: where blobs
//! are (LocateBlobs, batched), which nodes are registered (a source named in a request
//! must be one), which backup targets and origins it may read, and its connections to
//! peers (gRPC and the bulk path, each presenting a read grant, never this node's token).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::client::{ClientOptions, MetadataClient};
use locus_proto::{pb, BlobHash};
use tonic::Status;

/// Names the metadata service listed, and when (see `Peers::in_listing`).
type Listing = std::sync::Mutex<(std::collections::HashSet<String>, Option<std::time::Instant>)>;

/// The node's view of the rest of the cluster, through the metadata service.
pub struct Peers {
    opts: ClientOptions,
    /// The cluster's grant keys, set at each registration and heartbeat.
    pub grants: locus_proto::grant::Verifier,
    client: tokio::sync::Mutex<Option<MetadataClient>>,
    /// Connections to peers, each presenting a read grant (never this node's token).
    links: tokio::sync::OnceCell<locus_proto::grant::NodeLinks>,
    /// Backup targets opened so far, by URL (opening one builds an HTTP client).
    targets: std::sync::Mutex<HashMap<String, locus_backup::Target>>,
    /// Version origins opened so far, by URL.
    origins: std::sync::Mutex<HashMap<String, Arc<locus_backup::origin::Origin>>>,
    /// Addresses of registered nodes, as last listed, and when.
    registered: Listing,
    /// Backup targets the metadata service lists, and when they were read.
    backup_targets: Listing,
    /// Where `file://` origins may be read (`NodeConfig::origin_roots`).
    origin_roots: Vec<PathBuf>,
    /// Blobs the metadata service said belong to a narrowed read grant's versions, and
    /// when: a grant's versions never change what they hold (a delete only takes blobs
    /// away, and is seen again after MEMBER_FOR).
    members: std::sync::Mutex<HashMap<(Vec<u64>, BlobHash), std::time::Instant>>,
}

/// How long a blob found in a narrowed grant's versions is served without asking again.
const MEMBER_FOR: Duration = Duration::from_secs(600);
/// Most (versions, blob) answers kept; the map is emptied when full (a refill of answers
/// costs one metadata call per blob read).
const MEMBERS_KEPT: usize = 200_000;

/// Where a blob can be copied from: live replicas (id, address), then backups (URLs).
#[derive(Debug, Default, Clone)]
pub struct Sources {
    pub nodes: Vec<(String, String)>,
    pub backups: Vec<String>,
    /// (size, chunk size) as a committed manifest records the blob; None: no committed
    /// version holds it.
    pub size: Option<(u64, u32)>,
}

impl Peers {
    pub fn new(opts: ClientOptions, node: &str) -> Self {
        Self::with_origin_roots(opts, node, Vec::new())
    }

    pub fn with_origin_roots(opts: ClientOptions, node: &str, origin_roots: Vec<PathBuf>) -> Self {
        Self {
            origin_roots,
            grants: locus_proto::grant::Verifier::new(node),
            opts,
            client: tokio::sync::Mutex::new(None),
            links: tokio::sync::OnceCell::new(),
            targets: std::sync::Mutex::new(HashMap::new()),
            origins: std::sync::Mutex::new(HashMap::new()),
            registered: std::sync::Mutex::new((Default::default(), None)),
            backup_targets: std::sync::Mutex::new((Default::default(), None)),
            members: Default::default(),
        }
    }

    /// Whether the grant a call came with opens blob `h`: every blob for a grant not
    /// narrowed to versions; for one that is (issued to a token narrowed to datasets),
    /// only its versions' namespaces and the blobs their shards hold, as the metadata
    /// service says. A blob it does not open is answered as one this node does not have
    /// (the store's own words), so a hash in hand tells another team nothing.
    pub async fn grant_opens(&self, g: &locus_proto::grant::GrantBody, h: &BlobHash) -> Result<(), Status> {
        self.grant_opens_if(g, h, g.scoped).await
    }

    /// `grant_opens`, checking the grant's versions when `narrow` (a scoped token's grant,
    /// or a host user the node's socket table narrows) and passing any blob otherwise.
    pub async fn grant_opens_if(
        &self,
        g: &locus_proto::grant::GrantBody,
        h: &BlobHash,
        narrow: bool,
    ) -> Result<(), Status> {
        if !narrow || self.grant_filter(g, &[*h]).await?[0] {
            return Ok(());
        }
        tracing::info!(blob = %h, who = %g.issued_to, "a read grant narrowed to versions does not open this blob");
        Err(Status::not_found(format!("blob {h} is not on this node")))
    }

    /// For each hash, whether grant `g` opens it (see `grant_opens`): one metadata call
    /// for all that are not known already.
    pub async fn grant_filter(
        &self,
        g: &locus_proto::grant::GrantBody,
        hashes: &[BlobHash],
    ) -> Result<Vec<bool>, Status> {
        if g.versions.is_empty() {
            // Only a grant that names versions narrows anything; one that must and does
            // not (`grant_opens_if` for a scoped caller) opens nothing.
            return Ok(vec![!g.scoped; hashes.len()]);
        }
        let now = std::time::Instant::now();
        let mut out: Vec<bool> = {
            let kept = self.members.lock().unwrap();
            hashes
                .iter()
                .map(|h| {
                    g.namespaces.iter().any(|n| n.as_slice() == h.0)
                        || kept
                            .get(&(g.versions.clone(), *h))
                            .is_some_and(|at| now.duration_since(*at) < MEMBER_FOR)
                })
                .collect()
        };
        let unknown: Vec<usize> = (0..hashes.len()).filter(|i| !out[*i]).collect();
        if unknown.is_empty() {
            return Ok(out);
        }
        let mut m = self.metadata().await?;
        for batch in unknown.chunks(10_000) {
            let ask = m.blobs_in_versions(pb::BlobsInVersionsRequest {
                versions: g.versions.clone(),
                hashes: batch.iter().map(|i| hashes[*i].0.to_vec()).collect(),
            });
            let member = tokio::time::timeout(LOCATE_TIMEOUT, ask)
                .await
                .map_err(|_| {
                    Status::unavailable(format!(
                        "the metadata service did not answer within {LOCATE_TIMEOUT:?} (checking \
                         a read grant narrowed to versions)"
                    ))
                })??
                .into_inner()
                .member;
            let mut kept = self.members.lock().unwrap();
            for (i, yes) in batch.iter().zip(member) {
                if yes {
                    if kept.len() >= MEMBERS_KEPT {
                        kept.clear();
                    }
                    kept.insert((g.versions.clone(), hashes[*i]), now);
                    out[*i] = true;
                }
            }
        }
        Ok(out)
    }

    /// Refuses an origin URL that is not what version `dataset@version` recorded as its
    /// origin: a caller may have a node read only origins an admin's import recorded,
    /// never a URL of its own choosing with the node's credentials.
    pub async fn check_origin(&self, url: &str, dataset: &str, version: u64) -> Result<(), Status> {
        let mut m = self.metadata().await?;
        let v = tokio::time::timeout(
            LOCATE_TIMEOUT,
            m.get_version(pb::GetVersionRequest {
                r#ref: Some(pb::VersionRef {
                    dataset: dataset.to_string(),
                    version,
                }),
            }),
        )
        .await
        .map_err(|_| Status::unavailable("the metadata service did not answer"))??
        .into_inner();
        if v.origin != url || version == 0 {
            return Err(Status::permission_denied(format!(
                "origin: not the recorded origin of {dataset}@{version}; a node reads only origins \
                 an import recorded"
            )));
        }
        Ok(())
    }

    /// Refuses a copy source that is not a registered node's address: a caller may name
    /// where a node copies from only among the cluster's nodes, never an address of its
    /// own choosing (the node would present its token there and store what it sends,
    /// verified or not). The list is re-read when an address is not in it, at most once
    /// a second.
    pub async fn check_source(&self, addr: &str) -> Result<(), Status> {
        let listed = self
            .in_listing(
                &self.registered,
                Duration::from_secs(1),
                addr,
                |mut m| async move {
                    let nodes = m.list_nodes(pb::ListNodesRequest {}).await?.into_inner().nodes;
                    Ok(nodes.into_iter().map(|n| n.address).collect())
                },
            )
            .await?;
        if listed {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{addr} is not a registered node's address; copies come only from the cluster's nodes"
        )))
    }

    /// Whether `key` is in a listing the metadata service gives (`fetch`), kept in
    /// `cache` and re-read on a miss at most once per `every`: a flood of misses costs the
    /// service one call per `every`, and something just listed is found within it.
    async fn in_listing<F, Fut>(
        &self,
        cache: &Listing,
        every: Duration,
        key: &str,
        fetch: F,
    ) -> Result<bool, Status>
    where
        F: FnOnce(MetadataClient) -> Fut,
        Fut: Future<Output = Result<std::collections::HashSet<String>, Status>>,
    {
        {
            let r = cache.lock().unwrap_or_else(|p| p.into_inner());
            if r.0.contains(key) {
                return Ok(true);
            }
            if r.1.is_some_and(|at| at.elapsed() < every) {
                return Ok(false);
            }
        }
        let m = self.metadata().await?;
        let fresh = tokio::time::timeout(LOCATE_TIMEOUT, fetch(m))
            .await
            .map_err(|_| Status::unavailable("the metadata service did not answer"))??;
        let mut r = cache.lock().unwrap_or_else(|p| p.into_inner());
        *r = (fresh, Some(std::time::Instant::now()));
        Ok(r.0.contains(key))
    }

    /// Refuses an upload target the metadata service has not recorded as a backup target
    /// (`locus backup run` records its target before any node uploads): the node's
    /// object-store credentials write only where the cluster's own backups go.
    pub async fn check_backup_target(&self, url: &str) -> Result<(), Status> {
        let listed = self
            // Re-read on every miss: a run records its target just before its first
            // upload, and only admins may ask for uploads, so misses cannot flood.
            .in_listing(&self.backup_targets, Duration::ZERO, url, |mut m| async move {
                let b = m
                    .list_backups(pb::ListBackupsRequest {})
                    .await?
                    .into_inner()
                    .backups;
                Ok(b.into_iter().map(|b| b.url).collect())
            })
            .await?;
        if listed {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{url} is not a backup target of this cluster; nodes upload only where `locus backup run` records"
        )))
    }

    /// The version origin at `url`, opened once, for reading `rel`: a local directory
    /// only under this node's origin roots.
    pub fn origin_for(&self, url: &str, rel: &str) -> Result<Arc<locus_backup::origin::Origin>, Status> {
        let o = self.origin(url)?;
        o.check_within(rel, &self.origin_roots).map_err(|e| {
            tracing::warn!("refused to read an origin: {e}");
            Status::permission_denied(e)
        })?;
        Ok(o)
    }

    /// The version origin at `url`, opened once.
    fn origin(&self, url: &str) -> Result<Arc<locus_backup::origin::Origin>, Status> {
        let mut o = self.origins.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(x) = o.get(url) {
            return Ok(x.clone());
        }
        let x = match locus_backup::origin::Origin::parse(url) {
            Ok(Some(x)) => Arc::new(x),
            Ok(None) => return Err(Status::invalid_argument(format!("{url:?} names no origin"))),
            Err(e) => return Err(Status::failed_precondition(format!("origin {url}: {e}"))),
        };
        o.insert(url.to_string(), x.clone());
        Ok(x)
    }

    /// The backup target at `url`, opened once.
    pub fn target(&self, url: &str) -> Result<locus_backup::Target, Status> {
        let mut t = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(x) = t.get(url) {
            return Ok(x.clone());
        }
        let x = locus_backup::Target::open(url).map_err(|e| Status::failed_precondition(e.to_string()))?;
        t.insert(url.to_string(), x.clone());
        Ok(x)
    }

    /// A connection to the peer at `addr` for reading its blobs, under a read grant the
    /// metadata service issued to this node.
    pub async fn peer(
        &self,
        addr: &str,
        connect_timeout: Duration,
    ) -> Result<locus_proto::client::NodeClient, Status> {
        self.links()
            .await?
            .get("*", addr, locus_proto::grant::Op::Read, "", connect_timeout)
            .await
            .map_err(Status::unavailable)
    }

    async fn links(&self) -> Result<&locus_proto::grant::NodeLinks, Status> {
        self.links
            .get_or_try_init(|| async {
                let m = self.metadata().await?;
                Ok::<_, Status>(locus_proto::grant::NodeLinks::new(
                    locus_proto::grant::Grants::new(m, self.opts.token.as_deref()),
                ))
            })
            .await
    }

    /// Bytes `[offset, offset+len)` of blob `h` from the peer at `addr` over the bulk
    /// path (`len` 0: to its end), presenting a read grant. `Unsupported`: ask it over
    /// gRPC ([`Peers::peer`]).
    pub async fn bulk_read(
        &self,
        addr: &str,
        h: &BlobHash,
        offset: u64,
        len: u64,
        idle: Duration,
    ) -> Result<locus_proto::bulk::Reading, locus_proto::bulk::BulkError> {
        let links = self
            .links()
            .await
            .map_err(|s| locus_proto::bulk::BulkError::Unreachable(s.message().to_string()))?;
        let r = links
            .bulk_read("*", addr, locus_proto::grant::Op::Read, "", h, offset, len, idle)
            .await;
        if let Err(e) = &r {
            if !matches!(
                e,
                locus_proto::bulk::BulkError::Unsupported(_) | locus_proto::bulk::BulkError::Missing(_)
            ) {
                links.failed(addr);
            }
        }
        r
    }

    /// The peer at `addr` refused the grant this node presented: the next `peer` call
    /// asks for a fresh one.
    pub async fn peer_refused(&self, addr: &str) {
        if let Some(l) = self.links.get() {
            l.refused("*", addr, locus_proto::grant::Op::Read, "").await;
        }
    }

    pub async fn metadata(&self) -> Result<MetadataClient, Status> {
        let mut c = self.client.lock().await;
        if let Some(c) = c.as_ref() {
            return Ok(c.clone());
        }
        let fresh = locus_proto::client::connect(&self.opts)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        *c = Some(fresh.clone());
        Ok(fresh)
    }

    /// Live nodes holding `h` as a replica, and the cluster's backups.
    pub async fn locate(&self, h: &BlobHash) -> Result<Sources, Status> {
        let mut all = self.locate_many(&[*h]).await?;
        Ok(all.pop().map(|(_, s)| s).unwrap_or_default())
    }

    /// `locate` for many blobs, in requests of at most 10,000 (a refill of a whole disk
    /// asks once per batch, not once per blob). Each call is bounded: a hung metadata
    /// service costs one timeout.
    pub async fn locate_many(&self, hashes: &[BlobHash]) -> Result<Vec<(BlobHash, Sources)>, Status> {
        let mut m = self.metadata().await?;
        let mut out = Vec::with_capacity(hashes.len());
        for batch in hashes.chunks(10_000) {
            let ask = m.locate_blobs(pb::LocateBlobsRequest {
                hashes: batch.iter().map(|h| h.0.to_vec()).collect(),
            });
            let r = tokio::time::timeout(LOCATE_TIMEOUT, ask)
                .await
                .map_err(|_| {
                    Status::unavailable(format!(
                        "the metadata service did not answer within {LOCATE_TIMEOUT:?}"
                    ))
                })??
                .into_inner();
            for (h, b) in batch.iter().zip(r.blobs) {
                out.push((
                    *h,
                    Sources {
                        size: b.known.then_some((b.size, b.chunk_size)),
                        nodes: b.nodes.into_iter().zip(b.addresses).collect(),
                        backups: r.backups.clone(),
                    },
                ));
            }
        }
        Ok(out)
    }
}

/// Longest one LocateBlobs request may take.
const LOCATE_TIMEOUT: Duration = Duration::from_secs(30);
