//! Shard-to-rank assignment: which shards each rank of a distributed job should read so
//! that every shard is read exactly once, work is balanced by bytes, and as many bytes
//! as possible are read from the rank's own node.
//!
//! Every rank gets a byte budget of `mean + largest shard`, and no placement ever
//! exceeds it, which bounds the imbalance by one shard. Placement runs twice, first with
//! the mean itself as the budget (so an exactly balanced local answer is preferred),
//! then with the slack; each round:
//! 1. largest shards first, each goes to the least-loaded rank on a node holding a
//!    replica (if one has room);
//! 2. a shard that found no room is placed by an augmenting path: some rank on one of its
//!    nodes makes room by handing one of its local shards to another rank that holds
//!    that shard locally and has room, possibly through a chain of such moves (the
//!    classic bipartite-matching search, with budgets as capacities). For shards of
//!    equal size this finds an all-local assignment whenever one exists within the
//!    budgets; for mixed sizes it is a strong heuristic (the exact problem is bin
//!    packing);
//! 3. what is still unplaced goes to the least-loaded rank anywhere (always within the
//!    budget: the least-loaded rank is at or below the mean).

use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone)]
pub struct ShardIn {
    pub id: u32,
    pub bytes: u64,
    /// Nodes holding a live replica.
    pub replicas: Vec<String>,
}

/// What one rank should read.
#[derive(Debug, Clone, PartialEq)]
pub struct RankPlan {
    pub rank: u32,
    pub node: String,
    pub shards: Vec<u32>,
    pub bytes: u64,
    pub local_bytes: u64,
}

impl RankPlan {
    pub fn local_fraction(&self) -> f64 {
        if self.bytes == 0 {
            1.0
        } else {
            self.local_bytes as f64 / self.bytes as f64
        }
    }
}

/// Assigns `shards` to ranks; `rank_nodes[r]` is the node rank r runs on.
pub fn assign(shards: &[ShardIn], rank_nodes: &[String]) -> Vec<RankPlan> {
    let nr = rank_nodes.len();
    let mut plans: Vec<RankPlan> = rank_nodes
        .iter()
        .enumerate()
        .map(|(r, n)| RankPlan {
            rank: r as u32,
            node: n.clone(),
            shards: Vec::new(),
            bytes: 0,
            local_bytes: 0,
        })
        .collect();
    if nr == 0 || shards.is_empty() {
        return plans;
    }
    let total: u128 = shards.iter().map(|s| u128::from(s.bytes)).sum();
    let largest = shards.iter().map(|s| s.bytes).max().unwrap_or(0);
    let mean = total.div_ceil(nr as u128) as u64;
    let budget = mean.saturating_add(largest);

    let mut ranks_on: HashMap<&str, Vec<usize>> = HashMap::new();
    for (r, n) in rank_nodes.iter().enumerate() {
        ranks_on.entry(n.as_str()).or_default().push(r);
    }
    // The ranks that would read each shard locally.
    let local: Vec<Vec<usize>> = shards
        .iter()
        .map(|s| {
            let mut v: Vec<usize> = s
                .replicas
                .iter()
                .filter_map(|n| ranks_on.get(n.as_str()))
                .flatten()
                .copied()
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect();

    let mut load = vec![0u64; nr];
    // Each rank's local placements (the search moves those).
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); nr];
    let mut order: Vec<usize> = (0..shards.len()).collect();
    order.sort_by(|a, b| {
        shards[*b]
            .bytes
            .cmp(&shards[*a].bytes)
            .then(shards[*a].id.cmp(&shards[*b].id))
    });

    // Two rounds: first aim at the mean exactly (the balanced answer when the sizes
    // allow it), then let what did not fit use the slack of one shard.
    let mut pending = order;
    for cap in [mean, budget] {
        let mut unplaced = Vec::new();
        for s in pending {
            let b = shards[s].bytes;
            let best = local[s]
                .iter()
                .copied()
                .filter(|&r| load[r] + b <= cap)
                .min_by_key(|&r| (load[r], r));
            match best {
                Some(r) => {
                    load[r] += b;
                    held[r].push(s);
                }
                None => unplaced.push(s),
            }
        }
        pending = Vec::new();
        for s in unplaced {
            if !augment(s, shards, &local, &mut load, &mut held, cap) {
                pending.push(s);
            }
        }
    }
    let still = pending;

    for (r, list) in held.iter().enumerate() {
        for &s in list {
            plans[r].shards.push(shards[s].id);
            plans[r].bytes += shards[s].bytes;
            plans[r].local_bytes += shards[s].bytes;
        }
    }
    // Remote reads, largest first onto the least-loaded rank.
    for s in still {
        let r = (0..nr).min_by_key(|&r| (plans[r].bytes, r)).unwrap();
        plans[r].shards.push(shards[s].id);
        plans[r].bytes += shards[s].bytes;
    }
    for p in &mut plans {
        p.shards.sort_unstable();
    }
    plans
}

const SEARCH_STEPS: usize = 20_000;

/// Finds room for shard `s` on one of its local ranks by moving other local shards along
/// a chain of local ranks (breadth first, each rank visited once). True if placed.
fn augment(
    s: usize,
    shards: &[ShardIn],
    local: &[Vec<usize>],
    load: &mut [u64],
    held: &mut [Vec<usize>],
    budget: u64,
) -> bool {
    let nr = load.len();
    // For each rank reached: (shard that would move into it, rank it comes from).
    let mut came: Vec<Option<(usize, Option<usize>)>> = vec![None; nr];
    let mut queue = VecDeque::new();
    for &r in &local[s] {
        if came[r].is_none() {
            came[r] = Some((s, None));
            queue.push_back(r);
        }
    }
    // Bounded work per shard: the search is exact on the instances it finishes, and a
    // pathological one (thousands of full ranks) costs at most this many steps.
    let mut steps = 0usize;
    while let Some(r) = queue.pop_front() {
        let (incoming, _) = came[r].unwrap();
        if load[r] + shards[incoming].bytes <= budget {
            // Apply the chain backwards from r.
            let mut at = r;
            loop {
                let (sh, from) = came[at].unwrap();
                load[at] += shards[sh].bytes;
                held[at].push(sh);
                match from {
                    None => return true,
                    Some(f) => {
                        load[f] -= shards[sh].bytes;
                        held[f].retain(|x| *x != sh);
                        at = f;
                    }
                }
            }
        }
        // r is full: one of its shards could move on to another of its local ranks,
        // if that frees enough for the incoming one.
        for &moved in &held[r] {
            steps += 1;
            if steps > SEARCH_STEPS {
                return false;
            }
            if load[r] - shards[moved].bytes + shards[incoming].bytes > budget {
                continue;
            }
            for &next in &local[moved] {
                if came[next].is_none() {
                    came[next] = Some((moved, Some(r)));
                    queue.push_back(next);
                }
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nodes_of(ranks: &[usize]) -> Vec<String> {
        ranks.iter().map(|n| format!("n{n}")).collect()
    }

    fn check_exactly_once_and_bound(shards: &[ShardIn], plans: &[RankPlan]) -> Result<(), TestCaseError> {
        let mut seen: Vec<u32> = plans.iter().flat_map(|p| p.shards.iter().copied()).collect();
        seen.sort_unstable();
        let mut want: Vec<u32> = shards.iter().map(|s| s.id).collect();
        want.sort_unstable();
        prop_assert_eq!(seen, want, "every shard exactly once");
        let total: u64 = shards.iter().map(|s| s.bytes).sum();
        let largest = shards.iter().map(|s| s.bytes).max().unwrap_or(0);
        let mean = total.div_ceil(plans.len().max(1) as u64);
        for p in plans {
            prop_assert!(
                p.bytes <= mean + largest,
                "rank {} has {} > mean {} + {}",
                p.rank,
                p.bytes,
                mean,
                largest
            );
            let real: u64 = p
                .shards
                .iter()
                .map(|id| shards.iter().find(|s| s.id == *id).unwrap().bytes)
                .sum();
            prop_assert_eq!(real, p.bytes);
        }
        Ok(())
    }

    #[test]
    fn sixteen_ranks_on_four_nodes_read_locally() {
        let rank_nodes = nodes_of(&[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
        // 64 shards, two replicas each on neighbouring nodes.
        let shards: Vec<ShardIn> = (0..64)
            .map(|i| ShardIn {
                id: i,
                bytes: 1000,
                replicas: vec![format!("n{}", i % 4), format!("n{}", (i + 1) % 4)],
            })
            .collect();
        let plans = assign(&shards, &rank_nodes);
        assert!(plans.iter().all(|p| p.shards.len() == 4), "{plans:?}");
        assert!(plans.iter().all(|p| p.local_fraction() == 1.0));
    }

    proptest! {
        #[test]
        fn every_shard_once_and_within_one_shard_of_the_mean(
            rank_node in prop::collection::vec(0usize..6, 1..20),
            shards in prop::collection::vec((1u64..1_000_000, prop::collection::vec(0usize..8, 0..3)), 0..80),
        ) {
            let shards: Vec<ShardIn> = shards
                .into_iter()
                .enumerate()
                .map(|(i, (b, r))| ShardIn { id: i as u32 * 3, bytes: b, replicas: r.iter().map(|n| format!("n{n}")).collect() })
                .collect();
            let plans = assign(&shards, &nodes_of(&rank_node));
            check_exactly_once_and_bound(&shards, &plans)?;
            for p in &plans {
                let local: u64 = p.shards.iter()
                    .map(|id| shards.iter().find(|s| s.id == *id).unwrap())
                    .filter(|s| s.replicas.contains(&p.node))
                    .map(|s| s.bytes)
                    .sum();
                prop_assert_eq!(local, p.local_bytes);
            }
        }

        /// A planted all-local, balanced assignment (equal shard sizes) is always found,
        /// whatever other replicas muddle the picture.
        #[test]
        fn a_perfectly_local_balanced_assignment_is_found(
            rank_node in prop::collection::vec(0usize..5, 1..12),
            per_rank in 1usize..6,
            extra in prop::collection::vec(prop::collection::vec(0usize..5, 0..2), 60),
        ) {
            let rank_nodes = nodes_of(&rank_node);
            let mut shards = Vec::new();
            for (r, node) in rank_nodes.iter().enumerate() {
                for k in 0..per_rank {
                    let i = r * per_rank + k;
                    let mut replicas = vec![node.clone()];
                    replicas.extend(extra[i % extra.len()].iter().map(|n| format!("n{n}")));
                    shards.push(ShardIn { id: i as u32, bytes: 4096, replicas });
                }
            }
            let plans = assign(&shards, &rank_nodes);
            check_exactly_once_and_bound(&shards, &plans)?;
            for p in &plans {
                prop_assert_eq!(p.local_bytes, p.bytes, "rank {} reads remotely: {:?}", p.rank, plans);
            }
        }
    }
}
