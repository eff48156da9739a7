//! The catalogue: every rule about nodes, datasets, versions, manifests, shards, replicas
//! and import sessions, on top of the `KvStore` interface.
//!
//! Invariants it keeps:
//! - a version exists only once its whole manifest passed the commit checks, and becomes
//!   visible in the same atomic write that records it (entries are uploaded beforehand under
//!   an internal uid no version points to, so an abandoned session is invisible garbage
//!   that the reaper removes);
//! - version numbers of a dataset are consecutive in commit order and never reused;
//! - `resident` (version, node) counters always equal the sum of the bytes of the shards
//!   whose replica set holds that node, because both change in one batch.
//!
//! Methods block on storage I/O; the gRPC layer calls them from blocking threads. Writers
//! serialise on two locks, always taken in the order `versions` then `sessions`.
//!
//! One file per concern, all methods of `Catalog`: `nodes` (registration, liveness),
//! `versions` (what readers list), `sessions` (import sessions and commit), `replicas`
//! (deletion, replica-set changes), `location` (placement, blob location, what a node must
//! hold, the repair plan), `scheduling` (locality, assign, warm) and `backups`. The types
//! they share, the open path and the helpers are here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use locus_proto::manifest::{BlobHash, Entry, EntryKind};
use locus_proto::{pb, DatasetName, DatasetRef, InvalidInput, NodeId, VersionSel};
use prost::Message;

use crate::keys;
use crate::placement;
use crate::records::*;
use crate::store::{Batch, KvStore, StoreError, Table};
use crate::Clock;

mod backups;
mod location;
mod nodes;
mod preseal;
mod replicas;
mod scheduling;
mod sessions;
mod versions;

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Precondition(String),
    /// The id is held by another live process.
    #[error("{0}")]
    Taken(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("corrupt metadata record in {table}: {reason}")]
    Corrupt { table: &'static str, reason: String },
    /// A fault of this service (a task that panicked), not of the request.
    #[error("{0}")]
    Internal(String),
}

type Result<T, E = CatalogError> = std::result::Result<T, E>;

/// A version's shards as (id, bytes and replicas), shared by the cache and its readers.
type VersionShards = Arc<Vec<(u32, crate::locality::ShardBytes)>>;
/// Every node record by id.
type NodeRecords = Arc<Vec<(String, NodeRecord)>>;

/// The registered nodes (in id order) and, built on first use, their topology for
/// locality: both change only at registration and drain.
pub(super) struct NodeView {
    records: NodeRecords,
    topo: std::sync::OnceLock<crate::locality::Topology>,
}

impl NodeView {
    pub(super) fn records(&self) -> &[(String, NodeRecord)] {
        &self.records
    }

    pub(super) fn topology(&self) -> &crate::locality::Topology {
        self.topo.get_or_init(|| {
            crate::locality::Topology::new(self.records.iter().map(|(id, r)| {
                let label = |k: &str| r.labels.get(k).map_or("", String::as_str);
                let host = r.labels.get("host").map_or(id.as_str(), String::as_str);
                (id.as_str(), host, label("rack"), label("zone"))
            }))
        })
    }
}

/// Most files an Assign answer lists (its message must stay under the size limit).
pub const MAX_ASSIGN_FILES: u64 = 200_000;

/// The versions a locality question resolved to (name, number) and the shards it weighs.
pub type LocalityShards = (Vec<(String, u64)>, Vec<ShardSet>);

/// Shards a locality question weighs: a whole version straight from the cache, or a
/// filtered selection.
pub enum ShardSet {
    All(VersionShards),
    Some(Vec<crate::locality::ShardBytes>),
}

impl ShardSet {
    pub fn iter(&self) -> Box<dyn Iterator<Item = &crate::locality::ShardBytes> + '_> {
        match self {
            ShardSet::All(v) => Box::new(v.iter().map(|(_, s)| s)),
            ShardSet::Some(v) => Box::new(v.iter()),
        }
    }
}

/// Shards placed (shard, nodes) and shards that could not be (shard, reason).
pub type PlacementResult = (Vec<(u32, Vec<String>)>, Vec<(u32, String)>);

/// Tunables of the catalogue.
#[derive(Debug, Clone)]
pub struct CatalogConfig {
    /// A node silent this long is down.
    pub liveness_timeout: Duration,
    /// An import session idle this long is discarded.
    pub session_timeout: Duration,
    /// How often under-replicated shards are looked for and repaired.
    pub repair_interval: Duration,
    /// Locality's price of a byte by where it would come from.
    pub cost: crate::locality::CostWeights,
    /// Teams' limits on the bytes their datasets pin (`crate::quota`).
    pub teams: Vec<crate::quota::Team>,
}

impl Default for CatalogConfig {
    fn default() -> Self {
        Self {
            liveness_timeout: Duration::from_secs(30),
            session_timeout: Duration::from_secs(3600),
            repair_interval: Duration::from_secs(10),
            cost: Default::default(),
            teams: Vec::new(),
        }
    }
}

/// What the service knows about a node between heartbeats; not persisted, a restarted
/// service gives every node one liveness timeout of grace.
#[derive(Debug, Clone, Copy, Default)]
struct Live {
    last_seen_ms: i64,
    stats: NodeStats,
    /// Heard from by this process (or by the leader it took the view from), not only
    /// granted a liveness timeout at start.
    heard: bool,
}

/// What a node reports with each heartbeat.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct NodeStats {
    pub free: u64,
    pub used: u64,
    pub pinned: u64,
    pub cached: u64,
    pub blobs: u64,
    pub quarantined: u64,
    /// Pinned blobs the node lacks and is copying back: still to go, bytes, its copy
    /// rate (bytes/s) and blobs waiting for a retry.
    pub refill_blobs: u64,
    pub refill_bytes: u64,
    pub refill_rate: u64,
    pub refill_failing: u64,
}

/// One shard to re-replicate: copy it from `source` to `target`, then drop `drop`.
#[derive(Debug, Clone)]
pub struct RepairTask {
    pub dataset: String,
    pub version: u64,
    pub shard: u32,
    pub bytes: u64,
    /// The live replica to copy from (id, address); None when none is left, and the
    /// target copies each blob from wherever it still is (a recorded backup).
    pub source: Option<(String, String)>,
    pub target: (String, String),
    pub drop: Vec<String>,
}

/// What warming takes; see `Catalog::warm_plan`.
#[derive(Debug, Default)]
pub struct WarmPlan {
    pub version: u64,
    pub tasks: Vec<RepairTask>,
    pub bytes_already: u64,
    /// Copies of shards with no live replica to copy from (no source): only a recorded
    /// backup or the version's origin can provide them.
    pub origin: Vec<RepairTask>,
    /// Whether the version has an origin (or a backup is recorded) to read them from.
    pub outside_source: bool,
}

/// A shard as an import session reports it.
#[derive(Debug, Clone)]
pub struct ShardSpec {
    pub id: u32,
    pub bytes: u64,
    pub files: u64,
    pub replicas: Vec<NodeId>,
}

impl TryFrom<pb::Shard> for ShardSpec {
    type Error = InvalidInput;
    fn try_from(s: pb::Shard) -> std::result::Result<Self, InvalidInput> {
        let mut replicas = Vec::with_capacity(s.replicas.len());
        for r in s.replicas {
            let n = NodeId::try_from(r).map_err(|e| e.within(format_args!("shards[{}]", s.id)))?;
            if replicas.contains(&n) {
                return Err(InvalidInput::new(
                    format!("shards[{}].replicas", s.id),
                    format!("node {n} is listed twice"),
                ));
            }
            replicas.push(n);
        }
        Ok(ShardSpec {
            id: s.id,
            bytes: s.bytes,
            files: s.files,
            replicas,
        })
    }
}

/// A node registration as the node reports it.
#[derive(Debug, Clone)]
pub struct NodeRegistration {
    pub id: NodeId,
    pub address: String,
    pub labels: HashMap<String, String>,
    pub capacity: u64,
    pub free: u64,
    pub used: u64,
    /// The node's persistent identity; empty from nodes that predate identities.
    pub instance: String,
}

impl TryFrom<pb::RegisterNodeRequest> for NodeRegistration {
    type Error = InvalidInput;
    fn try_from(r: pb::RegisterNodeRequest) -> std::result::Result<Self, InvalidInput> {
        let id = NodeId::try_from(r.id)?;
        if r.address.is_empty() || r.address.len() > 255 || r.address.contains(char::is_whitespace) {
            return Err(InvalidInput::new("address", "must be HOST:PORT"));
        }
        let port_ok = r
            .address
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !port_ok {
            return Err(InvalidInput::new(
                "address",
                format!("{:?} is not HOST:PORT", r.address),
            ));
        }
        for (k, v) in &r.labels {
            locus_proto::names::check_label(k, v)?;
        }
        if r.labels.len() > 64 {
            return Err(InvalidInput::new("labels", "at most 64 labels"));
        }
        if r.instance.len() > 64 || !r.instance.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(InvalidInput::new(
                "instance",
                "at most 64 letters, digits and dashes",
            ));
        }
        Ok(NodeRegistration {
            id,
            address: r.address,
            labels: r.labels,
            capacity: r.capacity_bytes,
            free: r.free_bytes,
            used: r.used_bytes,
            instance: r.instance,
        })
    }
}

pub struct Catalog {
    store: Arc<dyn KvStore>,
    clock: Arc<dyn Clock>,
    config: CatalogConfig,
    cluster_id: String,
    started_ms: i64,
    versions_lock: Mutex<()>,
    sessions_lock: Mutex<()>,
    /// Signalled (with `sessions_lock`) when an entry page is stored.
    page_stored: std::sync::Condvar,
    /// By node id, FNV-hashed: a locality question looks up every node (10,000 at a time).
    live: Mutex<crate::locality::FastMap<String, Live>>,
    /// Shard sizes and replica sets per version uid, for locality questions (asked far
    /// more often than replicas change). An entry is valid only while `replica_gen` still
    /// has the value it was loaded under; every replica change bumps it.
    shard_cache: Mutex<HashMap<u64, (u64, VersionShards)>>,
    replica_gen: std::sync::atomic::AtomicU64,
    /// Node records (they change only at registration and drain), same scheme.
    node_cache: Mutex<Option<(u64, Arc<NodeView>)>>,
    node_gen: std::sync::atomic::AtomicU64,
    /// Whether this process runs the cluster's background duties (repair, reaping) and
    /// judges liveness: always for a single service, only the leader in a group.
    acting: std::sync::atomic::AtomicBool,
    /// When `tick` last ran (0: no ticker, as in unit tests): the service's own proof
    /// that it was running (see `notice_pause`).
    last_tick: Mutex<i64>,
    /// Import sessions whose manifest is sealed while it is uploaded.
    preseals: preseal::Preseals,
}

/// How often the server ticks the catalogue, and the silence between ticks that counts
/// as the service itself having been paused.
pub const TICK_EVERY: Duration = Duration::from_millis(200);

fn decode<M: Message + Default>(table: Table, bytes: &[u8]) -> Result<M> {
    M::decode(bytes).map_err(|e| CatalogError::Corrupt {
        table: table.name(),
        reason: e.to_string(),
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a catalogue lock cannot leave the store half-written (every
    // change is one batch), so the data behind a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Catalog {
    /// Opens the catalogue, initialising a fresh store or checking an existing one's
    /// schema version.
    pub fn open(store: Arc<dyn KvStore>, clock: Arc<dyn Clock>, config: CatalogConfig) -> Result<Self> {
        let cluster_id = match store.get(Table::Meta, keys::META_SCHEMA)? {
            None => {
                let id = new_cluster_id();
                let mut b = Batch::default();
                b.put(Table::Meta, keys::META_SCHEMA, SCHEMA_VERSION.to_be_bytes());
                b.put(Table::Meta, keys::META_CLUSTER_ID, id.clone().into_bytes());
                b.put(Table::Meta, keys::META_NEXT_UID, 1u64.to_be_bytes());
                store.write(b, true)?;
                id
            }
            Some(v) => {
                let found = <[u8; 4]>::try_from(v.as_slice())
                    .map(u32::from_be_bytes)
                    .map_err(|_| CatalogError::Corrupt {
                        table: "meta",
                        reason: "schema_version is not 4 bytes".into(),
                    })?;
                // Version 1 lacks only the rows version 2 added (a `shard_blobs` row per
                // manifest page, sizes in `blob_shards`), which are read beside the old
                // ones: it needs no migration, and the first page stored marks it 2.
                if !(1..=SCHEMA_VERSION).contains(&found) {
                    return Err(CatalogError::Precondition(format!(
                        "the metadata store has schema version {found}; this build reads version \
                         {SCHEMA_VERSION} and has no migration from it"
                    )));
                }
                let id = store.get(Table::Meta, keys::META_CLUSTER_ID)?.unwrap_or_default();
                String::from_utf8(id).map_err(|_| CatalogError::Corrupt {
                    table: "meta",
                    reason: "cluster_id is not UTF-8".into(),
                })?
            }
        };
        let started_ms = clock.now_ms();
        let cat = Catalog {
            store,
            clock,
            config,
            cluster_id,
            started_ms,
            versions_lock: Mutex::new(()),
            sessions_lock: Mutex::new(()),
            page_stored: Default::default(),
            live: Mutex::new(Default::default()),
            shard_cache: Mutex::new(HashMap::new()),
            replica_gen: std::sync::atomic::AtomicU64::new(0),
            node_cache: Mutex::new(None),
            node_gen: std::sync::atomic::AtomicU64::new(0),
            acting: std::sync::atomic::AtomicBool::new(true),
            last_tick: Mutex::new(0),
            preseals: Default::default(),
        };
        cat.grace()?;
        Ok(cat)
    }

    /// Grace period: every known node counts as seen now (at startup, and when a group
    /// member becomes leader: heartbeats went to the old leader until then).
    fn grace(&self) -> Result<()> {
        let now = self.clock.now_ms();
        let nodes = self.node_records()?;
        let mut live = lock(&self.live);
        for (id, rec) in nodes.iter() {
            let e = live.entry(id.clone()).or_insert_with(|| Live {
                last_seen_ms: now,
                stats: NodeStats {
                    free: rec.free_bytes,
                    used: rec.used_bytes,
                    ..Default::default()
                },
                heard: false,
            });
            e.last_seen_ms = e.last_seen_ms.max(now);
        }
        Ok(())
    }

    /// Makes this process the one that acts (a group member that became leader) or not.
    /// Taking over grants every node a liveness timeout of grace, so nodes are not
    /// declared down for heartbeats the previous leader received.
    pub fn set_acting(&self, on: bool) -> Result<()> {
        let was = self.acting.swap(on, std::sync::atomic::Ordering::SeqCst);
        if on && !was {
            self.grace()?;
        }
        Ok(())
    }

    /// Called every `TICK_EVERY` by the server: the service's own heartbeat.
    pub fn tick(&self) {
        self.notice_pause(true);
    }

    /// A service that did not run for a while (stopped, a VM frozen, a long stall, a
    /// clock jump) has heard no heartbeat in that time through no fault of the nodes:
    /// judging them by it would declare every node down and start repairing everything
    /// at once. So when the ticks show such a gap, every node gets a fresh liveness
    /// timeout of grace, as a new leader gives — before anything is judged: every
    /// liveness judgment (`list_nodes`, and through it placement and repair) looks here
    /// first, whichever runs first after the pause.
    pub(super) fn notice_pause(&self, ticking: bool) {
        let now = self.clock.now_ms();
        let mut last = lock(&self.last_tick);
        if *last == 0 {
            // Only the ticker's first tick turns the check on (unit tests run none).
            if ticking {
                *last = now;
            }
            return;
        }
        let gap = now - *last;
        let allowed = (self.config.liveness_timeout.as_millis() as i64 / 3).clamp(1000, 5000);
        if gap > allowed {
            tracing::warn!(
                paused_ms = gap,
                "this service did not run for {gap} ms: every node gets a fresh liveness timeout \
                 before any is declared down"
            );
            drop(last);
            if let Err(e) = self.grace_all_now() {
                tracing::error!("granting nodes grace after a pause: {e}");
            }
            *lock(&self.last_tick) = self.clock.now_ms();
            return;
        }
        if ticking {
            *last = now;
        }
    }

    /// Every known node counts as heard now (after the service's own pause).
    fn grace_all_now(&self) -> Result<()> {
        let now = self.clock.now_ms();
        for l in lock(&self.live).values_mut() {
            l.last_seen_ms = l.last_seen_ms.max(now);
        }
        self.grace()
    }

    pub fn acting(&self) -> bool {
        self.acting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// What this process knows of each node's liveness: (node, ms since last heard, the
    /// figures it last reported). A group's leader hands this to its followers.
    pub fn liveness(&self) -> Vec<(String, u64, NodeStats)> {
        let now = self.clock.now_ms();
        lock(&self.live)
            .iter()
            .map(|(id, l)| (id.clone(), (now - l.last_seen_ms).max(0) as u64, l.stats))
            .collect()
    }

    /// Takes over the leader's view of node liveness (a follower, every half second), so
    /// its locality answers count the same nodes as up.
    pub fn adopt_liveness(&self, rows: Vec<(String, u64, NodeStats)>) {
        let now = self.clock.now_ms();
        let mut live = lock(&self.live);
        for (id, ago, stats) in rows {
            live.insert(
                id,
                Live {
                    last_seen_ms: now - ago as i64,
                    stats,
                    heard: true,
                },
            );
        }
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    pub fn config(&self) -> &CatalogConfig {
        &self.config
    }

    pub fn uptime_ms(&self) -> u64 {
        (self.clock.now_ms() - self.started_ms).max(0) as u64
    }

    pub fn size_on_disk(&self) -> u64 {
        self.store.size_on_disk()
    }
}

fn check_origin(origin: &str) -> Result<(), InvalidInput> {
    if origin == "cluster" {
        return Ok(());
    }
    let ok = origin.split_once("://").is_some_and(|(scheme, rest)| {
        matches!(scheme, "s3" | "gs" | "az" | "abfs" | "file" | "http" | "https")
            && !rest.is_empty()
            && !rest.contains(char::is_whitespace)
    });
    if !ok || origin.len() > 2048 {
        return Err(InvalidInput::new(
            "origin",
            format!("{origin:?} is neither \"cluster\" nor an object-store URL (s3://, gs://, az://, file://, https://)"),
        ));
    }
    Ok(())
}

fn entry_record(e: &Entry) -> EntryRecord {
    let mut r = EntryRecord {
        mode: e.mode,
        mtime_ns: e.mtime_ns,
        ..Default::default()
    };
    match &e.kind {
        EntryKind::File {
            size,
            blob,
            chunks,
            shard,
        } => {
            r.kind = KIND_FILE;
            r.size = *size;
            r.blob = blob.0.to_vec();
            // A single chunk is the blob itself (`EntryRecord::chunk_hashes`).
            if !(chunks.len() == 1 && chunks[0].0 == blob.0) {
                r.chunks = chunks.iter().flat_map(|c| c.0).collect();
            }
            r.shard = *shard;
        }
        EntryKind::Dir => r.kind = KIND_DIR,
        EntryKind::Symlink { target } => {
            r.kind = KIND_SYMLINK;
            r.target = target.clone();
        }
    }
    r
}

pub(crate) fn entry_pb(path: String, r: EntryRecord, with_chunks: bool) -> pb::Entry {
    let kind = match r.kind {
        KIND_FILE => pb::EntryKind::File,
        KIND_DIR => pb::EntryKind::Dir,
        _ => pb::EntryKind::Symlink,
    };
    let chunks = if with_chunks && kind == pb::EntryKind::File {
        r.chunk_hashes()
    } else {
        Vec::new()
    };
    pb::Entry {
        path,
        kind: kind as i32,
        size: r.size,
        mode: r.mode,
        mtime_ns: r.mtime_ns,
        blob: r.blob,
        chunks,
        symlink_target: r.target,
        shard: r.shard,
    }
}

fn new_cluster_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS's random source: enough for an identifier.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    let a = h.finish();
    let b = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{a:016x}{b:016x}")
}

#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod shard_rows_tests;
#[cfg(test)]
mod tests;
