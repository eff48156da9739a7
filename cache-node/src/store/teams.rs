//! Teams' shares of the cache: whose reads brought each cached blob here, and how much of
//! the node's cache room each team keeps against the others.
//!
//! A read grant issued for a version of a team's dataset names the team and its share
//! (`GrantBody.team`, `cache_permille`, from the metadata service's
//! `[[metadata_server.team]] cache`). A blob the node caches for such a reader is tagged
//! with the team (`BlobRecord.team`, an id into the table kept here and in the index
//! under [`TEAMS_KEY`]). The cache room is what is not pinned nor reserved:
//! `capacity − pinned − reserved`; a team's share is its permille of that room, so
//! replicas (which quotas bound) shrink every share alike and are never refused room
//! because of shares. A replica takes first what the shares of the room as it stands do
//! not protect, and only then what its own bytes shrink them by.
//!
//! When room must be made for a write, the writer's eviction takes, least recently used
//! first, only from: its own team's blobs, untagged blobs (cached by unscoped readers or
//! before teams existed), and other teams' blobs beyond their share. So a team's cached
//! bytes within its share survive any other team's reads and imports; a team over its
//! share pays for its own new reads with its own older blobs. A write that cannot find
//! room so is refused as the node being full, saying whose shares hold the rest.
//!
//! Each team keeps its own eviction order (`Lru`), so choosing a victim among the allowed
//! teams costs O(shards × teams + log n), never a scan past protected blobs.

use std::collections::BTreeSet;

use locus_proto::BlobHash;
use prost::Message;

use super::{lock, BlobStore};

/// Index key of the team table (not a blob hash: the index loader skips it).
pub(super) const TEAMS_KEY: &[u8] = b"teams";
/// Most teams a node tags blobs for; more are served untagged (and said so in the log).
const MAX_TEAMS: usize = 4096;

/// A team's id in this store: 0 is "no team" (untagged); others index the team table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TeamId(pub(super) u16);

impl TeamId {
    pub const NONE: TeamId = TeamId(0);
}

/// How a write keeps its blob: pinned (a replica), and for whom it is cached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keep {
    pub pin: bool,
    pub team: TeamId,
}

impl From<bool> for Keep {
    fn from(pin: bool) -> Self {
        Keep {
            pin,
            team: TeamId::NONE,
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
struct TeamsRecord {
    #[prost(message, repeated, tag = "1")]
    rows: Vec<TeamRow>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TeamRow {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(uint32, tag = "2")]
    permille: u32,
}

/// The teams this node has seen in grants: row i is team id i + 1.
#[derive(Debug, Default)]
pub(super) struct Teams {
    rows: Vec<(String, u32)>,
}

impl Teams {
    pub(super) fn load(index: &rocksdb::DB) -> Self {
        let rows = match index.get(TEAMS_KEY) {
            Ok(Some(v)) => match TeamsRecord::decode(&v[..]) {
                Ok(r) => r
                    .rows
                    .into_iter()
                    .map(|r| (r.name, r.permille.min(1000)))
                    .collect(),
                Err(e) => {
                    // Tags then name no team: the blobs count as untagged until grants
                    // name their teams again. Nothing is lost but the protection.
                    tracing::warn!("team table in the index unreadable ({e}); starting it afresh");
                    Vec::new()
                }
            },
            _ => Vec::new(),
        };
        Teams { rows }
    }

    /// Each team's share in permille, by id (index 0: no team, no share).
    pub(super) fn permilles(&self) -> Vec<u32> {
        std::iter::once(0).chain(self.rows.iter().map(|r| r.1)).collect()
    }

    fn name(&self, t: TeamId) -> Option<&str> {
        (t.0 as usize)
            .checked_sub(1)
            .and_then(|i| self.rows.get(i))
            .map(|r| r.0.as_str())
    }
}

/// One shard's eviction order, per team: `sets[t]` holds team t's unpinned blobs by
/// (last access, hash). Ticks are global, so the store's least recently used blob of a
/// set of teams is the smallest of those teams' first entries over the shards.
#[derive(Default)]
pub(super) struct Lru {
    sets: Vec<BTreeSet<(u64, BlobHash)>>,
}

impl Lru {
    fn set(&mut self, t: TeamId) -> &mut BTreeSet<(u64, BlobHash)> {
        let i = t.0 as usize;
        if self.sets.len() <= i {
            self.sets.resize_with(i + 1, BTreeSet::new);
        }
        &mut self.sets[i]
    }

    pub(super) fn insert(&mut self, t: TeamId, key: (u64, BlobHash)) {
        self.set(t).insert(key);
    }

    pub(super) fn remove(&mut self, t: TeamId, key: &(u64, BlobHash)) -> bool {
        self.sets.get_mut(t.0 as usize).is_some_and(|s| s.remove(key))
    }

    pub(super) fn append(&mut self, t: TeamId, keys: &mut BTreeSet<(u64, BlobHash)>) {
        let set = self.set(t);
        // Into an empty set (a start's load): taken whole, not merged and rebuilt.
        match set.is_empty() {
            true => std::mem::swap(set, keys),
            false => set.append(keys),
        }
    }

    /// The oldest entry of each team that `allowed` admits.
    pub(super) fn firsts(
        &self,
        allowed: &dyn Fn(TeamId) -> bool,
    ) -> impl Iterator<Item = ((u64, BlobHash), TeamId)> + '_ {
        let ok: Vec<bool> = (0..self.sets.len()).map(|i| allowed(TeamId(i as u16))).collect();
        self.sets
            .iter()
            .enumerate()
            .filter(move |(i, _)| ok[*i])
            .filter_map(|(i, s)| s.first().map(|k| (*k, TeamId(i as u16))))
    }

    /// Every entry, with its team (for checks of the books).
    #[cfg(test)]
    pub(super) fn all(&self) -> impl Iterator<Item = ((u64, BlobHash), TeamId)> + '_ {
        self.sets
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.iter().map(move |k| (*k, TeamId(i as u16))))
    }
}

/// A team's share of `room` bytes.
pub(super) fn share_of(room: u64, permille: u32) -> u64 {
    (u128::from(room) * u128::from(permille) / 1000) as u64
}

/// What a node reports per team: (name, share in permille, cached bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TeamUse {
    pub name: String,
    pub permille: u32,
    pub cached: u64,
}

impl BlobStore {
    /// The id of team `name` with share `permille` (as the latest grant says), adding it to
    /// the table or updating its share. An empty name is no team.
    pub fn team(&self, name: &str, permille: u32) -> TeamId {
        if name.is_empty() {
            return TeamId::NONE;
        }
        let permille = permille.min(1000);
        let mut t = lock(&self.teams);
        let id = match t.rows.iter().position(|r| r.0 == name) {
            Some(i) if t.rows[i].1 == permille => return TeamId(i as u16 + 1),
            Some(i) => {
                t.rows[i].1 = permille;
                i
            }
            None if t.rows.len() >= MAX_TEAMS => {
                tracing::warn!(
                    team = name,
                    "{MAX_TEAMS} teams known already; caching for it untagged"
                );
                return TeamId::NONE;
            }
            None => {
                t.rows.push((name.to_string(), permille));
                t.rows.len() - 1
            }
        };
        let rec = TeamsRecord {
            rows: t
                .rows
                .iter()
                .map(|(name, permille)| TeamRow {
                    name: name.clone(),
                    permille: *permille,
                })
                .collect(),
        };
        // Under the lock, so two updates cannot land in the wrong order. Losing it costs
        // only the tags' protection after a restart, until grants name the teams again.
        if let Err(e) = self.index.put(TEAMS_KEY, rec.encode_to_vec()) {
            tracing::warn!("cannot record the team table: {e}");
        }
        TeamId(id as u16 + 1)
    }

    /// Cached bytes per team that has any or a share.
    pub fn team_use(&self) -> Vec<TeamUse> {
        let t = lock(&self.teams);
        let b = self.books();
        t.rows
            .iter()
            .enumerate()
            .map(|(i, (name, permille))| TeamUse {
                name: name.clone(),
                permille: *permille,
                cached: b.team_cached.get(i + 1).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Why a write for `team` found no room: what the protected shares hold.
    pub(super) fn held_by_shares(
        &self,
        team: TeamId,
        room: u64,
        cached: &[u64],
        permilles: &[u32],
    ) -> String {
        let t = lock(&self.teams);
        let held: Vec<String> = cached
            .iter()
            .enumerate()
            .filter(|(i, c)| *i != 0 && *i != team.0 as usize && **c > 0)
            .map(|(i, c)| {
                let share = share_of(room, permilles.get(i).copied().unwrap_or(0));
                format!(
                    "team {} holds {} within its share of {}",
                    t.name(TeamId(i as u16)).unwrap_or("?"),
                    (*c).min(share),
                    share
                )
            })
            .collect();
        if held.is_empty() {
            String::new()
        } else {
            format!("; other teams' cache shares are kept: {}", held.join(", "))
        }
    }
}

/// Cached bytes of `t` that a writer for `writer` may evict now.
pub(super) fn evictable(t: usize, writer: TeamId, cached: u64, room: u64, permilles: &[u32]) -> u64 {
    if t == 0 || t == writer.0 as usize {
        return cached;
    }
    cached.saturating_sub(share_of(room, permilles.get(t).copied().unwrap_or(0)))
}

/// Checked by `BlobRecord` users: a record's team id is one the table knows, else none.
pub(super) fn known(t: u32, teams: usize) -> TeamId {
    match t as usize {
        0 => TeamId::NONE,
        i if i <= teams && i <= u16::MAX as usize => TeamId(i as u16),
        _ => TeamId::NONE,
    }
}

#[cfg(test)]
mod tests;
