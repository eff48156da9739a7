//! Where a mounted file's bytes come from when the kernel cannot read a local file
//! directly: remote replicas, chunk by chunk, each chunk checked against its hash from
//! the manifest before anyone sees it.
//!
//! Sources are tried cheapest first (same host, rack, zone, then anywhere), spreading
//! equal-cost replicas across blobs so parallel readers do not all hit one node. A node
//! that fails is skipped for a while and the next replica is tried; when every known
//! replica has failed, the metadata service is asked where the blob lives now (repair
//! may have moved it). Nothing but verified bytes ever leaves this module: a chunk no
//! source can serve is an error, which the mount turns into EIO.
//!
//! When no live node serves a chunk, a backup the metadata service names (by blob hash),
//! then the version's origin (`origin`) are the last sources,
//! under the same rule: its bytes are used only if they hash right.
//!
//! Verified chunks stay in a bounded in-memory cache; concurrent readers of one chunk
//! share a single fetch. Sequential readers get read-ahead: the next chunks are fetched
//! in the background, in parallel, while the current one is consumed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

pub use crate::pieces::Pieces;
pub use locus_proto::bulk::{RangeRequest, Ranged};
use locus_proto::chunks::{ChunkAt, ChunkKind};
use locus_proto::client::MetadataClient;
use locus_proto::{outboard, pb, BlobHash};

use crate::metrics::Metrics;

/// Longest a background refresh of replica locations may take.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a node that failed a read is passed over.
const BAD_NODE_PAUSE: Duration = Duration::from_secs(10);

/// This host's place in the cluster, for pricing replicas.
#[derive(Debug, Clone, Default)]
pub struct Place {
    pub host: String,
    pub rack: Option<String>,
    pub zone: Option<String>,
}

impl Place {
    /// 0 same host, 1 same rack, 2 same zone, 3 elsewhere.
    fn cost(&self, labels: &HashMap<String, String>) -> u8 {
        let same = |k: &str, mine: Option<&String>| mine.is_some() && labels.get(k) == mine;
        if labels.get("host") == Some(&self.host) {
            0
        } else if same("rack", self.rack.as_ref()) {
            1
        } else if same("zone", self.zone.as_ref()) {
            2
        } else {
            3
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct NodeInfo {
    pub(crate) addr: String,
    pub(crate) cost: u8,
}

/// Shard replica sets and node addresses of the mounted version.
#[derive(Debug, Default)]
pub struct Topology {
    shards: HashMap<u32, Vec<String>>,
    nodes: HashMap<String, NodeInfo>,
}

impl Topology {
    /// Reads the version's shards and the cluster's nodes.
    pub async fn load(
        client: &mut MetadataClient,
        r: &pb::VersionRef,
        place: &Place,
    ) -> Result<Self, tonic::Status> {
        let mut t = Topology::default();
        let mut start = 0;
        loop {
            let resp = client
                .list_shards(pb::ListShardsRequest {
                    r#ref: Some(r.clone()),
                    start,
                    limit: 10_000,
                })
                .await?
                .into_inner();
            for s in &resp.shards {
                t.shards.insert(s.id, s.replicas.clone());
                start = start.max(s.id + 1);
            }
            if !resp.more || resp.shards.is_empty() {
                break;
            }
        }
        for n in client
            .list_nodes(pb::ListNodesRequest {})
            .await?
            .into_inner()
            .nodes
        {
            t.nodes.insert(
                n.id.clone(),
                NodeInfo {
                    addr: n.address.clone(),
                    cost: place.cost(&n.labels),
                },
            );
        }
        Ok(t)
    }

    /// A topology given outright: shard → replica node ids, and each node's (id,
    /// address, cost from 0 = same host to 3 = elsewhere).
    pub fn from_parts(shards: HashMap<u32, Vec<String>>, nodes: Vec<(String, String, u8)>) -> Self {
        Topology {
            shards,
            nodes: nodes
                .into_iter()
                .map(|(id, addr, cost)| (id, NodeInfo { addr, cost }))
                .collect(),
        }
    }

    /// The lowest-numbered shard, whose blobs include the version's namespace.
    pub(crate) fn first_shard(&self) -> Option<u32> {
        self.shards.keys().min().copied()
    }

    pub(crate) fn candidates(&self, shard: u32) -> Vec<(String, NodeInfo)> {
        self.shards
            .get(&shard)
            .into_iter()
            .flatten()
            .filter_map(|id| self.nodes.get(id).map(|n| (id.clone(), n.clone())))
            .collect()
    }
}

/// What identifies one chunk of one file.
#[derive(Debug, Clone, Copy)]
pub struct ChunkRef {
    /// The file's inode (its path, for the origin, is looked up only when needed).
    pub ino: u64,
    pub blob: BlobHash,
    pub shard: u32,
    pub index: u32,
    pub offset: u64,
    pub len: u64,
    pub hash: BlobHash,
    /// The whole blob's size (ranges are verified against the blob's tree).
    pub size: u64,
    /// What `hash` is: the version's kind of chunk hashes.
    pub kind: ChunkKind,
}

impl ChunkRef {
    /// How this chunk's bytes are hashed to compare with `hash`.
    pub fn at(&self) -> ChunkAt {
        ChunkAt::new(self.kind, self.offset, self.len, self.size)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("chunk {index} of blob {blob}: no source could serve it ({last})")]
    Unavailable {
        blob: BlobHash,
        index: u32,
        last: String,
    },
}

mod cache;
mod memory;
use cache::ChunkCache;

/// A boxed future, for the object-safe source traits.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Where remote chunks come from, behind a trait so the read path (ordering, failover,
/// verification, caching, read-ahead) is unit-tested against injected faults. Nothing a
/// source returns is trusted: `Remote` checks length and hash before anyone sees it.
pub trait Replicas: Send + Sync + 'static {
    /// Bytes `[c.offset, c.offset + c.len)` of blob `c.blob` as the node at `addr` sends
    /// them; a node silent for `idle` is an error.
    fn read<'a>(
        &'a self,
        addr: &'a str,
        c: ChunkRef,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Pieces, SourceError>>;
    /// The bytes and proof of range `r` (whole verification groups of the blob, see
    /// `bulk::RangeRequest`) as the node at `addr` sends them, unchecked. `Ok(None)`:
    /// this source serves no ranges, read the whole chunk.
    fn read_range<'a>(
        &'a self,
        addr: &'a str,
        r: RangeRequest,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Option<Ranged>, SourceError>> {
        let _ = (addr, r, idle);
        Box::pin(async { Ok(None) })
    }
    /// The node at `addr` failed: drop whatever connection is kept to it.
    fn forget<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, ()>;
    /// Where `blob` is now: live (node id, address) pairs, and backup URLs. An error is
    /// the metadata service's (`Unreachable`: down or slow; `Grant`: it refused this
    /// mount's token).
    fn locate<'a>(&'a self, blob: BlobHash, timeout: Duration)
        -> BoxFuture<'a, Result<Located, SourceError>>;
    /// The version's shard replica sets and the cluster's nodes, afresh.
    fn topology<'a>(&'a self, place: &'a Place) -> BoxFuture<'a, Result<Topology, SourceError>>;
}

/// Why a node did not serve a chunk: what decides whether it is passed over for a while.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SourceError {
    /// Not reachable, timed out, stalled, or failing: skipped for `BAD_NODE_PAUSE`, its
    /// connection dropped.
    #[error("{0}")]
    Unreachable(String),
    /// It answered that it does not hold the blob (evicted, not copied yet): a healthy
    /// node, asked again for the next chunk.
    #[error("does not hold it: {0}")]
    Missing(String),
    /// No grant to present (the metadata service's side), or the node refused the one
    /// presented (expired, signed by a revoked key): a fresh grant is asked for next
    /// time; the node is healthy.
    #[error("grant: {0}")]
    Grant(String),
    /// It sent bytes that are not the chunk's: skipped for a while.
    #[error("{0}")]
    Wrong(String),
}

impl SourceError {
    /// A node's gRPC answer, sorted by whose fault it is.
    pub fn from_status(s: &tonic::Status) -> Self {
        let m = format!("{:?}: {}", s.code(), s.message());
        match s.code() {
            tonic::Code::NotFound => SourceError::Missing(m),
            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => SourceError::Grant(m),
            _ => SourceError::Unreachable(m),
        }
    }

    /// Whether the node itself is at fault, so other replicas go first for a while.
    pub fn blames_node(&self) -> bool {
        matches!(self, SourceError::Unreachable(_) | SourceError::Wrong(_))
    }
}

/// An answer to `Replicas::locate`.
#[derive(Debug, Default, Clone)]
pub struct Located {
    pub nodes: Vec<(String, String)>,
    pub backups: Vec<String>,
}

mod grpc;
pub use grpc::GrpcReplicas;

pub struct Remote {
    sources: Arc<dyn Replicas>,
    place: Place,
    topology: RwLock<Topology>,
    bad: Mutex<HashMap<String, Instant>>,
    cache: ChunkCache,
    metrics: Arc<Metrics>,
    /// Set once the namespace is open (the namespace itself may be fetched through here).
    origin: std::sync::OnceLock<(locus_backup::origin::Origin, Arc<crate::namespace::Namespace>)>,
    /// Backups the metadata service named in its last `LocateBlobs` answer, opened.
    backups: Mutex<Vec<locus_backup::Target>>,
    /// A source silent for this long during a chunk is given up on.
    pub timeout: Duration,
    /// KiB of read-ahead fetches in flight, shared by every reader: memory stays bounded
    /// however many sequential readers there are (each would otherwise keep its own
    /// window in flight). Read-ahead that finds no room is skipped; the reader fetches
    /// those chunks when it reaches them.
    ahead: Arc<tokio::sync::Semaphore>,
    /// KiB of fetches readers are waiting on, in flight at once; a reader beyond it waits
    /// for room (the kernel sends up to 64 background reads per mount, each asking for a
    /// chunk, and the node would otherwise have all of them in flight).
    demand: tokio::sync::Semaphore,
    demand_kib: u32,
}

/// Default for [`Remote::with_readahead_budget`].
pub const READAHEAD_BUDGET: usize = 128 << 20;
/// Bytes of fetches readers wait on, in flight at once.
pub const DEMAND_BUDGET: usize = 32 << 20;

impl Remote {
    pub fn new(
        sources: Arc<dyn Replicas>,
        place: Place,
        topology: Topology,
        cache_bytes: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Remote {
            sources,
            place,
            topology: RwLock::new(topology),
            bad: Default::default(),
            cache: ChunkCache {
                budget: cache_bytes,
                inner: Default::default(),
            },
            metrics,
            origin: std::sync::OnceLock::new(),
            backups: Mutex::new(Vec::new()),
            timeout: Duration::from_secs(10),
            ahead: Arc::new(tokio::sync::Semaphore::new(READAHEAD_BUDGET >> 10)),
            demand: tokio::sync::Semaphore::new(DEMAND_BUDGET >> 10),
            demand_kib: (DEMAND_BUDGET >> 10) as u32,
        }
    }

    /// Most bytes of read-ahead in flight at once, over all readers.
    pub fn with_readahead_budget(mut self, bytes: usize) -> Self {
        self.ahead = Arc::new(tokio::sync::Semaphore::new((bytes >> 10).max(1)));
        self
    }

    /// Makes the version's origin the last source; `ns` gives files' paths. Once: a
    /// second call changes nothing.
    pub fn set_origin(&self, origin: locus_backup::origin::Origin, ns: Arc<crate::namespace::Namespace>) {
        let _ = self.origin.set((origin, ns));
    }

    /// The version's lowest-numbered shard (whose blobs include its namespace).
    pub fn first_shard(&self) -> Option<u32> {
        self.topology.read().unwrap().first_shard()
    }

    /// A verified chunk from the cheapest source that serves it, kept out of the chunk
    /// cache: for bytes read once (the namespace), which would only push readers' chunks
    /// out.
    pub async fn fetch_uncached(&self, c: ChunkRef) -> Result<Pieces, ReadError> {
        self.fetch(c).await
    }

    /// Re-reads shard replica sets and nodes (after repair, nodes joining).
    pub async fn refresh(&self) -> Result<(), SourceError> {
        let t = self.sources.topology(&self.place).await?;
        *self.topology.write().unwrap() = t;
        Ok(())
    }

    /// A verified chunk, from the cache or the cheapest source that serves it, and
    /// whether it was already in memory when asked for.
    pub async fn chunk(self: &Arc<Self>, c: ChunkRef) -> Result<(Pieces, bool), ReadError> {
        self.chunk_for(c, true).await
    }

    /// `chunk`, for a reader waiting on it (`demand`: it takes room in the demand budget)
    /// or for read-ahead (which holds its own room).
    async fn chunk_for(self: &Arc<Self>, c: ChunkRef, demand: bool) -> Result<(Pieces, bool), ReadError> {
        let key = (c.blob, c.index);
        let cell = self.cache.cell(key);
        if let Some(b) = cell.get() {
            return Ok((b.clone(), true));
        }
        let mut fetched = false;
        let r = cell
            .get_or_try_init(|| async {
                fetched = true;
                // A chunk larger than the whole budget takes all of it.
                let kib = u32::try_from(c.len.div_ceil(1024)).unwrap_or(u32::MAX);
                let _room = match demand {
                    true => self.demand.acquire_many(kib.min(self.demand_kib)).await.ok(),
                    false => None,
                };
                self.fetch(c).await
            })
            .await
            .cloned();
        match &r {
            Ok(b) if fetched => self.cache.filled(key, &cell, b.len()),
            Ok(_) => {}
            Err(_) => self.cache.failed(key),
        }
        r.map(|b| (b, !fetched))
    }

    /// Starts fetching chunks in the background (read-ahead); errors are left for the
    /// reader that actually needs the chunk.
    pub fn prefetch(self: &Arc<Self>, chunks: Vec<ChunkRef>) {
        for c in chunks {
            if self.cache.known(&(c.blob, c.index)) {
                continue;
            }
            let kib = u32::try_from(c.len.div_ceil(1024)).unwrap_or(u32::MAX);
            let Ok(permit) = self.ahead.clone().try_acquire_many_owned(kib) else {
                self.metrics.readahead_skipped();
                return;
            };
            let me = self.clone();
            tokio::spawn(async move {
                let _ = me.chunk_for(c, false).await;
                drop(permit);
            });
        }
    }

    /// Bytes `[from, to)` of chunk `c` (offsets within it) were handed to the kernel
    /// for its page cache: a chunk every byte of which was is let go (`cache`).
    pub fn handed(&self, c: &ChunkRef, from: u64, to: u64) {
        self.cache.handed((c.blob, c.index), c.len, from, to);
    }

    /// Whether a chunk is in the cache or being fetched into it.
    pub fn has(&self, c: &ChunkRef) -> bool {
        self.cache.known(&(c.blob, c.index))
    }

    /// Bytes `[from, to)` of chunk `c` (offsets within the chunk), for a reader that
    /// jumps around: only the verification groups they fall in are fetched, with the
    /// proof that checks them against the blob's own hash (the whole blob's tree, whose
    /// outboard nodes keep on disk), and nothing is cached (the kernel keeps what it
    /// read). A source that serves no ranges, or none that can, and the read takes the
    /// whole chunk by the usual path (every replica, backups, the origin), so a range is
    /// never less available than its chunk.
    pub async fn range(self: &Arc<Self>, c: ChunkRef, from: u64, to: u64) -> Result<Bytes, ReadError> {
        let (from_b, to_b) = (c.offset + from, c.offset + to);
        let (start, end) = outboard::rounded(from_b, to_b, c.size);
        let r = RangeRequest {
            hash: c.blob,
            chunk_offset: 0,
            chunk_len: c.size,
            start,
            end,
        };
        let started = Instant::now();
        for (id, info) in self.ordered(c.shard, &c.blob) {
            let why = match self.sources.read_range(&info.addr, r, self.timeout).await {
                Ok(None) => break,
                Ok(Some(got)) => match outboard::verify(&c.blob, c.size, start, end, &got.data, &got.proof) {
                    Ok(()) => {
                        self.metrics
                            .remote_read(got.data.len() + got.proof.len(), started.elapsed());
                        self.metrics.range_read();
                        return Ok(got.data.slice((from_b - start) as usize..(to_b - start) as usize));
                    }
                    Err(e) => {
                        self.metrics.corrupt();
                        SourceError::Wrong(format!("range {start}..{end}: {e}"))
                    }
                },
                Err(e) => e,
            };
            tracing::warn!(node = %id, blob = %c.blob, chunk = c.index, "range read failed, trying another replica: {why}");
            self.metrics.source_failure();
            self.failed(&id, &info.addr, &why).await;
        }
        let (p, _) = self.chunk(c).await?;
        Ok(p.range(from as usize, to as usize))
    }

    /// A node failed a read: passed over for a while if it is at fault, its connection
    /// (and the grant it presents) dropped unless it merely lacks the blob.
    async fn failed(&self, id: &str, addr: &str, e: &SourceError) {
        if e.blames_node() {
            self.bad
                .lock()
                .unwrap()
                .insert(id.to_string(), Instant::now() + BAD_NODE_PAUSE);
        }
        if !matches!(e, SourceError::Missing(_)) {
            self.sources.forget(addr).await;
        }
    }

    fn ordered(&self, shard: u32, blob: &BlobHash) -> Vec<(String, NodeInfo)> {
        let mut cands = self.topology.read().unwrap().candidates(shard);
        let now = Instant::now();
        let bad = self.bad.lock().unwrap();
        // Equal-cost replicas take turns by blob, so readers spread over them.
        let spread = u64::from_le_bytes(blob.0[..8].try_into().unwrap());
        let n = cands.len().max(1) as u64;
        let mut keyed: Vec<_> = cands
            .drain(..)
            .enumerate()
            .map(|(i, (id, info))| {
                let penalised = bad.get(&id).is_some_and(|until| *until > now);
                let turn = (i as u64 + spread) % n;
                ((penalised, info.cost, turn), id, info)
            })
            .collect();
        keyed.sort_by_key(|k| k.0);
        keyed.into_iter().map(|(_, id, info)| (id, info)).collect()
    }

    async fn fetch(&self, c: ChunkRef) -> Result<Pieces, ReadError> {
        let started = Instant::now();
        let mut tried = HashSet::new();
        let mut last = String::from("no replica is known");
        for round in 0..2 {
            let cands = if round == 0 {
                self.ordered(c.shard, &c.blob)
            } else {
                // Every replica we knew of failed: ask where the blob is now.
                match self.locate(&c.blob).await {
                    Ok(v) => v,
                    Err(e) => {
                        last = format!("locating the blob failed: {e}");
                        break;
                    }
                }
            };
            for (id, info) in cands {
                if !tried.insert(id.clone()) {
                    continue;
                }
                match self.read_from(&info.addr, c).await {
                    Ok(b) => {
                        self.metrics.remote_read(b.len(), started.elapsed());
                        return Ok(b);
                    }
                    Err(e) => {
                        tracing::warn!(node = %id, blob = %c.blob, chunk = c.index, "read failed, trying another replica: {e}");
                        self.metrics.source_failure();
                        self.failed(&id, &info.addr, &e).await;
                        last = format!("{id}: {e}");
                    }
                }
            }
        }
        // Backups hold blobs by hash and never change: before the origin, which may have.
        let backups = self.backups.lock().unwrap().clone();
        for t in backups {
            match self.read_backup(&t, c).await {
                Ok(b) => {
                    self.metrics.origin_read(b.len(), started.elapsed());
                    return Ok(b.into());
                }
                Err(e) => {
                    tracing::warn!(blob = %c.blob, chunk = c.index, backup = %t.url, "the backup cannot serve it: {e}");
                    last = format!("{last}; backup {}: {e}", t.url);
                }
            }
        }
        if let Some((origin, ns)) = self.origin.get() {
            match self.read_origin(origin, ns, c).await {
                Ok(b) => {
                    self.metrics.origin_read(b.len(), started.elapsed());
                    return Ok(b.into());
                }
                Err(e) => {
                    tracing::warn!(blob = %c.blob, chunk = c.index, "the origin cannot serve it either: {e}");
                    last = format!("{last}; origin: {e}");
                }
            }
        }
        Err(ReadError::Unavailable {
            blob: c.blob,
            index: c.index,
            last,
        })
    }

    async fn read_origin(
        &self,
        origin: &locus_backup::origin::Origin,
        ns: &crate::namespace::Namespace,
        c: ChunkRef,
    ) -> Result<Bytes, String> {
        let rel = ns.path(c.ino).ok_or("the file is not in the namespace")?;
        let b = tokio::time::timeout(self.timeout * 3, origin.read(&rel, c.offset, c.len))
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout * 3))??;
        if b.len() as u64 != c.len {
            return Err(format!("{rel}: got {} of {} bytes", b.len(), c.len));
        }
        if c.at().hash(&b) != c.hash {
            self.metrics.corrupt();
            return Err(format!(
                "{rel}: bytes at {} no longer match the version (changed since the import?)",
                c.offset
            ));
        }
        Ok(b)
    }

    async fn read_backup(&self, t: &locus_backup::Target, c: ChunkRef) -> Result<Bytes, String> {
        let b = tokio::time::timeout(
            self.timeout * 3,
            locus_backup::blob::read_range(t, &c.blob, c.offset, c.len),
        )
        .await
        .map_err(|_| format!("no answer within {:?}", self.timeout * 3))?
        .map_err(|e| e.to_string())?;
        if b.len() as u64 != c.len || c.at().hash(&b) != c.hash {
            self.metrics.corrupt();
            return Err(format!(
                "blob {} at {}: stored bytes do not match",
                c.blob, c.offset
            ));
        }
        Ok(b)
    }

    async fn locate(&self, blob: &BlobHash) -> Result<Vec<(String, NodeInfo)>, SourceError> {
        let r = self.sources.locate(*blob, self.timeout).await?;
        {
            let mut known = self.backups.lock().unwrap();
            if known.iter().map(|t| &t.url).ne(r.backups.iter()) {
                *known = r
                    .backups
                    .iter()
                    .filter_map(|u| match locus_backup::Target::open(u) {
                        Ok(t) => Some(t),
                        Err(e) => {
                            tracing::warn!("backup {u} cannot be read from here: {e}");
                            None
                        }
                    })
                    .collect();
            }
        }
        let topo = self.topology.read().unwrap();
        Ok(r.nodes
            .into_iter()
            .map(|(id, addr)| {
                let cost = topo.nodes.get(&id).map_or(3, |n| n.cost);
                (id, NodeInfo { addr, cost })
            })
            .collect())
    }

    /// One chunk from one node, verified: only bytes of the right length that hash to
    /// the manifest's chunk hash count.
    async fn read_from(&self, addr: &str, c: ChunkRef) -> Result<Pieces, SourceError> {
        let buf = self.sources.read(addr, c, self.timeout).await?;
        if buf.len() as u64 != c.len {
            return Err(SourceError::Wrong(format!(
                "sent {} of {} bytes",
                buf.len(),
                c.len
            )));
        }
        if buf.hash(c.at()) != c.hash {
            self.metrics.corrupt();
            return Err(SourceError::Wrong("bytes do not match the chunk's hash".into()));
        }
        Ok(buf)
    }
}
