//! A replicated metadata group: three (or five) `locus metadata serve` processes that keep
//! one catalogue through Raft, so the loss of a machine loses neither the service nor a
//! committed write.
//!
//! The consensus is openraft (pinned, see docs/architecture.md) behind this module; the
//! rest of the service sees only:
//! - a `KvStore` (`ReplicatedStore`) whose `write` is a log entry: the catalogue's batches
//!   go through the log unchanged and each applies on every member as one RocksDB
//!   `WriteBatch`, together with the index of the entry, so a batch is applied exactly
//!   once even across crashes. Large uploads stay small entries: a manifest page is one
//!   batch (under `ENTRY_PAGE_BYTES` of rows), and the commit that publishes a version is a
//!   small batch of its own, as on a single service;
//! - whether this member may act (`acting`): the leader serves every call (after
//!   confirming with a quorum that it still leads) and runs the repair loop and the
//!   reaper; followers forward every call to it (`forward`);
//! - the group's view for `GetClusterInfo` and membership changes.
//!
//! Files: `log` (the Raft log, its own RocksDB), `state` (the state machine: applying
//! entries to the catalogue's RocksDB, snapshots), `network` (the members' Raft RPCs over
//! gRPC, client and server), `forward` (followers passing calls to the leader).

pub mod forward;
mod leading;
mod log;
mod network;
mod ready;
mod segments;
mod state;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use locus_proto::pb;
use openraft::{ChangeMembers, ServerState};
use tonic::Status;

use crate::store::{Batch, KvStore, RocksStore, ScanIter, StoreError, Table};
pub use ready::GroupRing;

pub use network::{decode_for_fuzzing, RaftPolicy, RaftService};

openraft::declare_raft_types!(
    /// The group's Raft types: a log entry carries one catalogue batch.
    pub TypeConfig:
        D = Batch,
        R = (),
        NodeId = u64,
        Node = Member,
        SnapshotData = tokio::fs::File,
);

pub type Raft = openraft::Raft<TypeConfig>;

/// Runs storage I/O (fsyncs, RocksDB batches of megabytes) from Raft's tasks without
/// holding up the runtime's other tasks on this worker: heartbeats must go out on time
/// while a manifest page is written, or followers start needless elections.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// A member as the group records it: its name and where the others reach its Raft port.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Member {
    pub name: String,
    pub addr: String,
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

/// The Raft id of a member: derived from its name, so every member computes the same id
/// for a name without agreeing on anything first.
pub fn member_id(name: &str) -> u64 {
    let h = blake3::hash(name.as_bytes());
    u64::from_be_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// Parses `--cluster m1=HOST:PORT,m2=HOST:PORT,...`.
pub fn parse_cluster(s: &str) -> Result<Vec<Member>, String> {
    let mut out: Vec<Member> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not NAME=HOST:PORT"))?;
        check_member_name(name)?;
        let port_ok = addr
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
        if !port_ok {
            return Err(format!("{addr:?} (member {name}) is not HOST:PORT"));
        }
        if out.iter().any(|m| m.name == name) {
            return Err(format!("member {name} is listed twice"));
        }
        if out.iter().any(|m| member_id(&m.name) == member_id(name)) {
            return Err(format!("member names {name} and another hash alike; rename one"));
        }
        out.push(Member {
            name: name.to_string(),
            addr: addr.to_string(),
        });
    }
    if out.is_empty() {
        return Err("no members given".into());
    }
    Ok(out)
}

pub fn check_member_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "member name {name:?}: 1 to 63 letters, digits, '-' or '_'"
        ))
    }
}

/// How a member of a group is run.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// This member's name; it must be one of `members` when the group is new.
    pub me: String,
    /// The members a new group starts with (all of them: every member is given the same
    /// list). Ignored once this member holds a log: membership then changes only through
    /// `ChangeMembers`.
    pub members: Vec<Member>,
    /// Where this member's Raft port listens (default: its own entry's address).
    pub raft_listen: Option<SocketAddr>,
    /// The member secret: a token of role `member`, the same on every member, presented
    /// on the other members' Raft ports once they proved they hold it too.
    pub token: Option<String>,
    /// Members may talk in clear off loopback (`--insecure`: a trusted network).
    pub insecure: bool,
    /// Raft timing: followers start an election after this long without a heartbeat
    /// (randomised up to twice it); heartbeats go out at a fifth of it.
    pub election_timeout: Duration,
    /// A snapshot is taken after this many log entries, and the log kept behind it is at
    /// most this long (at most 1000): a member further behind catches up from a snapshot.
    pub snapshot_every: u64,
    /// This member lost its data (a replaced disk) and rejoins an existing group: it
    /// waits for the leader to send it a snapshot and the log instead of starting a group.
    pub join: bool,
    /// The raft ports speak TLS (set from the service's own TLS: a service with TLS never
    /// lets its members talk in clear). Members then verify each other with the process's
    /// client TLS (`--ca-cert`, and its own certificate where peers demand one).
    pub tls: bool,
}

/// A running member.
pub struct Group {
    raft: Raft,
    id: u64,
    name: String,
    state: Arc<RocksStore>,
    outside: Arc<std::sync::atomic::AtomicU64>,
    /// Each member's API URL by Raft id, learnt from its Raft port's `Hello`.
    api_urls: Mutex<HashMap<u64, String>>,
    token: Option<String>,
    handle: tokio::runtime::Handle,
    /// When a follower last took the leader's liveness view.
    liveness_at: Mutex<Option<std::time::Instant>>,
    /// The catalogue predates the log (see `seal_preexisting`).
    preexisting: bool,
    tls: bool,
    insecure: bool,
    /// One more than the highest commit index a leader's AppendEntries told this member
    /// (0: none yet); see `stay_out_of_elections_until_caught_up`.
    leader_commit: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({})", self.name)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("{0}")]
    Config(String),
    #[error("cannot open the Raft log at {path}: {reason}")]
    Log { path: String, reason: String },
    #[error("{0}")]
    State(String),
    #[error("Raft failed to start: {0}")]
    Raft(String),
}

impl Group {
    /// Opens the log and the state machine under `data_dir` (the catalogue's store is
    /// `state`), starts Raft, and initialises a new group when this member holds no log yet.
    /// The Raft port is served by the caller (`RaftService`).
    pub async fn start(
        cfg: &GroupConfig,
        data_dir: &Path,
        state: Arc<RocksStore>,
    ) -> Result<Arc<Group>, GroupError> {
        check_member_name(&cfg.me).map_err(GroupError::Config)?;
        if !cfg.tls && cfg.token.is_some() && !cfg.insecure {
            for m in cfg.members.iter().filter(|m| m.name != cfg.me) {
                if locus_proto::tls::check_plaintext(&format!("http://{}", m.addr), true).is_err() {
                    return Err(GroupError::Config(format!(
                        "member {} at {} is not on this host and the members have no TLS: they would \
                         send the member secret, every catalogue change and the grant keys in clear. \
                         Give every member --tls-cert and --tls-key (and --ca-cert), or pass \
                         --insecure if this network is trusted",
                        m.name, m.addr
                    )));
                }
            }
        }
        let id = member_id(&cfg.me);
        let log = log::LogStore::open(&data_dir.join("raft-log"), state.clone())?;
        let outside = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sm = state::StateMachine::open(state.clone(), &data_dir.join("raft-snapshots"), outside.clone())?;
        let t = cfg.election_timeout.as_millis().max(50) as u64;
        let config = openraft::Config {
            cluster_name: "locus-metadata".into(),
            election_timeout_min: t,
            election_timeout_max: 2 * t,
            // openraft gives every AppendEntries one heartbeat interval to complete, and a
            // manifest page is an entry of up to 4 MiB: one entry per message, and a third
            // of the election timeout, so a page is sent, decoded and fsynced in time even
            // on a busy machine. (At a fifth with 8 entries per message, a follower that fell
            // behind during a 1,000,000-entry upload was never caught up again: every
            // message timed out and the group stalled.)
            heartbeat_interval: (t / 3).max(10),
            max_payload_entries: 1,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(cfg.snapshot_every.max(1)),
            max_in_snapshot_log_to_keep: cfg.snapshot_every.clamp(1, 1000),
            snapshot_max_chunk_size: 4 << 20,
            install_snapshot_timeout: 10_000,
            ..Default::default()
        }
        .validate()
        .map_err(|e| GroupError::Config(e.to_string()))?;
        let network = network::Network::new(cfg.token.clone(), cfg.tls, cfg.me.clone());
        let raft = Raft::new(id, Arc::new(config), network, log.clone(), sm)
            .await
            .map_err(|e| GroupError::Raft(e.to_string()))?;
        let fresh = log.is_empty()?;
        // A catalogue that is here before any log (a restored backup, a single service
        // becoming a group) is in no log entry: members that join must get it as a snapshot.
        let preexisting = fresh
            && !cfg.join
            && state
                .get(Table::Meta, crate::keys::META_SCHEMA)
                .map_err(|e| GroupError::State(e.to_string()))?
                .is_some();
        if preexisting && cfg.members.len() > 1 {
            return Err(GroupError::Config(
                "this data dir already holds a catalogue, so it can only start a group of one: \
                 give --cluster only this member, then add the others with `locus metadata \
                 members add-learner` and `promote` (they receive the catalogue as a snapshot)"
                    .into(),
            ));
        }
        if fresh && !cfg.join {
            // An empty member among members that hold a log was wiped: starting a new
            // group here would split the cluster's history. The operator says --join.
            for m in cfg.members.iter().filter(|m| m.name != cfg.me) {
                if let Ok(h) =
                    network::hello(&m.addr, cfg.token.as_deref(), cfg.tls, &cfg.me, Some(&m.name)).await
                {
                    if h.asker_had_data {
                        return Err(GroupError::Config(format!(
                            "this member holds no data but the group's leader {} has had log entries \
                             from it: its data was lost. Start it with --join to have the leader send \
                             it a snapshot and the log (or, safest, `locus metadata members remove \
                             {me}`, start it with --join, then `members add-learner {me} ADDR` and \
                             `members promote {me}`)",
                            m.name,
                            me = cfg.me
                        )));
                    }
                }
            }
        }
        if fresh && !cfg.join {
            if !cfg.members.iter().any(|m| m.name == cfg.me) {
                return Err(GroupError::Config(format!(
                    "--id {} is not among the --cluster members ({})",
                    cfg.me,
                    cfg.members
                        .iter()
                        .map(|m| m.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            let members: BTreeMap<u64, Member> = cfg
                .members
                .iter()
                .map(|m| (member_id(&m.name), m.clone()))
                .collect();
            // Every member of a new group proposes the same first membership; Raft lets
            // all of them do so (the entries are identical), so no member is special.
            if let Err(e) = raft.initialize(members).await {
                tracing::info!("group already initialised elsewhere: {e}");
            }
        }
        let leader_commit = Arc::new(std::sync::atomic::AtomicU64::new(0));
        if fresh && cfg.join {
            leading::stay_out_of_elections_until_caught_up(&raft, leader_commit.clone());
        }
        Ok(Arc::new(Group {
            leader_commit,
            raft,
            id,
            name: cfg.me.clone(),
            state,
            outside,
            api_urls: Mutex::new(HashMap::new()),
            token: cfg.token.clone(),
            handle: tokio::runtime::Handle::current(),
            liveness_at: Mutex::new(None),
            preexisting,
            tls: cfg.tls,
            insecure: cfg.insecure,
        }))
    }

    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// Where the Raft port records the commit index leaders send this member.
    pub fn leader_commit(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.leader_commit.clone()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The catalogue's store on this member: reads are local, writes go through the log.
    pub fn store(self: &Arc<Self>) -> Arc<dyn KvStore> {
        Arc::new(ReplicatedStore(self.clone()))
    }

    /// Whether this member believes it leads (a quorum may already have moved on:
    /// `linearize` confirms).
    pub fn is_leader(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader && m.current_leader == Some(self.id)
    }

    /// The current leader as this member knows it.
    pub fn leader(&self) -> Option<(u64, Member)> {
        let m = self.raft.metrics();
        let m = m.borrow();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id)?.clone();
        Some((id, node))
    }

    /// Whether the catalogue's schema has reached this member (the first leader writes it).
    pub fn has_schema(&self) -> bool {
        self.state
            .get(Table::Meta, crate::keys::META_SCHEMA)
            .ok()
            .flatten()
            .is_some()
    }

    /// The index of the last entry this member applied.
    pub fn applied_index(&self) -> u64 {
        self.raft.metrics().borrow().last_applied.map_or(0, |l| l.index)
    }

    /// The members, their roles, the leader's name and this member's name.
    pub fn info(&self) -> (Vec<pb::GroupMember>, String, String) {
        let m = self.raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let mut members: Vec<pb::GroupMember> = membership
            .nodes()
            .map(|(id, node)| pb::GroupMember {
                name: node.name.clone(),
                raft_address: node.addr.clone(),
                role: if voters.contains(id) { "voter" } else { "learner" }.into(),
            })
            .collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        let leader = m
            .current_leader
            .and_then(|id| membership.get_node(&id))
            .map(|n| n.name.clone())
            .unwrap_or_default();
        (members, leader, self.name.clone())
    }

    /// Applies a `ChangeMembers` request (on the leader).
    pub async fn change_members(&self, req: pb::ChangeMembersRequest) -> Result<(), Status> {
        let current: BTreeMap<u64, Member> = {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.membership_config
                .membership()
                .nodes()
                .map(|(id, n)| (*id, n.clone()))
                .collect()
        };
        let known = |name: &str| -> Result<u64, Status> {
            let id = member_id(name);
            if current.contains_key(&id) {
                Ok(id)
            } else {
                Err(Status::not_found(format!(
                    "{name:?} is not a member of this group"
                )))
            }
        };
        let fail = |e: String| Status::failed_precondition(format!("membership change refused: {e}"));
        match req.op.as_str() {
            "add-learner" => {
                let [name] = req.names.as_slice() else {
                    return Err(Status::invalid_argument("add-learner takes one name"));
                };
                check_member_name(name).map_err(Status::invalid_argument)?;
                let addr = &req.raft_address;
                parse_cluster(&format!("{name}={addr}")).map_err(Status::invalid_argument)?;
                if !self.tls && self.token.is_some() && !self.insecure {
                    locus_proto::tls::check_plaintext(&format!("http://{addr}"), true)
                        .map_err(|e| Status::failed_precondition(format!("add-learner {name}: {e}")))?;
                }
                if let Some((id, _)) = current
                    .iter()
                    .find(|(id, n)| n.name != *name && **id == member_id(name))
                {
                    return Err(Status::invalid_argument(format!(
                        "{name:?} hashes like member {id}; rename it"
                    )));
                }
                let node = Member {
                    name: name.clone(),
                    addr: addr.clone(),
                };
                // Before the group sends it a byte: the learner must prove it holds the
                // member secret (and answer as the member named), or it would receive the
                // catalogue and the grant keys — an add-learner naming a host someone
                // else controls hands that host nothing.
                // A learner still starting is waited for (a minute); one that answers
                // without proving membership is refused at once.
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    match network::hello(addr, self.token.as_deref(), self.tls, &self.name, Some(name)).await
                    {
                        Ok(_) => break,
                        Err(s)
                            if s.code() == tonic::Code::Unavailable
                                && std::time::Instant::now() < deadline =>
                        {
                            tokio::time::sleep(Duration::from_millis(250)).await
                        }
                        Err(s) => return Err(fail(s.message().to_string())),
                    }
                }
                // Blocking: answers once the learner has caught up (a snapshot plus the log).
                self.raft
                    .add_learner(member_id(name), node, true)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
            }
            "promote" | "remove" => {
                if req.names.is_empty() {
                    return Err(Status::invalid_argument(format!("{} needs member names", req.op)));
                }
                let ids: BTreeSet<u64> = req.names.iter().map(|n| known(n)).collect::<Result<_, _>>()?;
                let change = if req.op == "promote" {
                    ChangeMembers::AddVoterIds(ids.clone())
                } else {
                    if ids.contains(&self.id) {
                        return Err(Status::failed_precondition(
                            "the leader cannot remove itself; remove it from another member after \
                             stopping it, or ask while another member leads",
                        ));
                    }
                    ChangeMembers::RemoveVoters(ids.clone())
                };
                self.raft
                    .change_membership(change, false)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                if req.op == "remove" {
                    self.raft
                        .change_membership(ChangeMembers::RemoveNodes(ids), false)
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                }
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "op {other:?}: expected add-learner, promote or remove"
                )))
            }
        }
        Ok(())
    }

    /// When the group was started over a catalogue that no log entry holds: snapshots it and
    /// purges the log up to the snapshot, so a member that joins later catches up from the
    /// snapshot (which holds that catalogue) instead of replaying a log that lacks it.
    pub async fn seal_preexisting(&self) -> Result<(), GroupError> {
        if !self.preexisting {
            return Ok(());
        }
        let fail =
            |e: String| GroupError::Raft(format!("snapshotting the catalogue this group started with: {e}"));
        // A group of one: it leads once its first entries are applied.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while self.linearize().await.is_err() || self.applied_index() == 0 {
            if std::time::Instant::now() > deadline {
                return Err(fail("this member did not become leader within 60 s".into()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let applied = self.applied_index();
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut m = self.raft.metrics();
        let snap = tokio::time::timeout(Duration::from_secs(600), async {
            loop {
                if let Some(s) = m.borrow().snapshot.filter(|s| s.index >= applied) {
                    return Ok(s.index);
                }
                if m.changed().await.is_err() {
                    return Err("Raft stopped".to_string());
                }
            }
        })
        .await
        .map_err(|_| fail("no snapshot within 10 minutes".into()))?
        .map_err(fail)?;
        self.raft
            .trigger()
            .purge_log(snap)
            .await
            .map_err(|e| fail(e.to_string()))?;
        tracing::info!(
            index = snap,
            "the catalogue this group started with is in a snapshot; joining members receive it"
        );
        Ok(())
    }

    /// On a follower: pulls the leader's view of node liveness every half second into
    /// `catalog`, so locality is answered here. Records when it last succeeded.
    pub async fn follow_liveness(
        self: Arc<Self>,
        catalog: Arc<crate::Catalog>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            if self.is_leader() {
                continue;
            }
            let Some((_, leader)) = self.leader() else {
                continue;
            };
            match network::liveness(&leader.addr, self.token.as_deref(), self.tls).await {
                Ok(rows) => {
                    catalog.adopt_liveness(rows);
                    *self.liveness_at.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(std::time::Instant::now());
                }
                Err(e) => tracing::debug!("liveness from the leader {}: {}", leader.name, e.message()),
            }
        }
    }

    /// The URL of member `id`'s Metadata service (asked of its Raft port once, then kept).
    pub async fn api_url(&self, id: u64, member: &Member) -> Result<String, Status> {
        if let Some(u) = self.api_urls.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            return Ok(u.clone());
        }
        // Proved a member before any caller's call (and token) is forwarded there.
        let hello = network::hello(
            &member.addr,
            self.token.as_deref(),
            self.tls,
            &self.name,
            Some(&member.name),
        )
        .await?;
        self.api_urls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, hello.api_url.clone());
        Ok(hello.api_url)
    }
}

/// The catalogue's store on a member: reads from the local state machine, writes proposed
/// to the group and returned once committed and applied here.
struct ReplicatedStore(Arc<Group>);

impl KvStore for ReplicatedStore {
    fn get(&self, t: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.state.get(t, key)
    }
    fn scan<'a>(&'a self, t: Table, from: &[u8], to: Option<&[u8]>) -> ScanIter<'a> {
        self.0.state.scan(t, from, to)
    }
    fn write(&self, batch: Batch, _sync: bool) -> Result<(), StoreError> {
        // Durability is the log's: an entry is committed once a quorum has it on disk.
        network::fits_one_message(&batch)?;
        let raft = self.0.raft.clone();
        let handle = self.0.handle.clone();
        // Out of the async worker first (a write from one would otherwise panic in
        // block_on), then wait for the commit.
        let r = blocking(move || {
            handle.block_on(async move {
                tokio::time::timeout(Duration::from_secs(30), raft.client_write(batch)).await
            })
        });
        match r {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!(
                "the metadata group did not commit the change: {e}"
            ))),
            Err(_) => Err(StoreError::Unavailable(
                "the metadata group did not commit the change within 30 s (no quorum?)".into(),
            )),
        }
    }
    fn size_on_disk(&self) -> u64 {
        self.0.state.size_on_disk()
    }
    fn export(
        &self,
        tables: &[Table],
        visit: &mut crate::store::ExportVisitor<'_>,
    ) -> Result<(), StoreError> {
        self.0.state.export(tables, visit)
    }
    fn outside_writes(&self) -> u64 {
        self.0.outside.load(std::sync::atomic::Ordering::SeqCst)
    }
}
