//! Graded locality: for each candidate node, how much of a dataset version is already on
//! it and what the rest would cost to bring there from the cheapest sources.
//!
//! Pure functions over shard replica sets and node topology (labels `host`, `rack`,
//! `zone`), so they are tested without a cluster and answer in O(shards × replicas +
//! nodes): bytes are first summed per host, rack and zone that holds a live replica, and
//! each node then reads its figures off those sums — no per-(node, shard) loop.
//!
//! The cost model prices one GiB by where it would come from. Defaults (configurable in
//! the metadata service's config, `[metadata_server.cost]`):
//!
//! | source | default per GiB | why |
//! |---|---|---|
//! | this node | 0 | already there |
//! | another node on the same host | 0.1 | a local copy between disks |
//! | same rack | 1 | one top-of-rack switch |
//! | same zone | 2 | crosses the spine |
//! | another zone | 8 | cross-zone links are scarce and often billed |
//! | object store (no live replica) | 20 | egress and the slowest source |

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// What one locality question may ask, the same over gRPC, `/v1/locality` and the
/// Kubernetes extender: its cost is versions × shards × nodes on the shared blocking
/// pool, and the extender and the HTTP API take no token.
pub const MAX_REFS: usize = 64;
pub const MAX_PATH_PREFIXES: usize = 1_000;
pub const MAX_SHARDS: usize = 100_000;
pub const MAX_NODES: usize = 100_000;

/// Refuses a locality question over the caps, naming them.
pub fn check_request(refs: usize, prefixes: usize, shards: usize, nodes: usize) -> Result<(), String> {
    if refs > MAX_REFS || prefixes > MAX_PATH_PREFIXES || shards > MAX_SHARDS || nodes > MAX_NODES {
        return Err(format!(
            "at most {MAX_REFS} versions, {MAX_PATH_PREFIXES} path prefixes, {MAX_SHARDS} shards \
             and {MAX_NODES} nodes per question (asked: {refs}, {prefixes}, {shards}, {nodes})"
        ));
    }
    Ok(())
}

/// FNV-1a: node ids are short strings looked up once per replica per call, where
/// SipHash's start-up cost dominates; nothing here is keyed by untrusted input that
/// could be chosen to collide (ids come from registered nodes).
#[derive(Default)]
pub(crate) struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

/// A map keyed by node ids (see `Fnv`).
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<Fnv>>;

/// Price per GiB by source. See the module table for the defaults.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostWeights {
    pub same_host: f64,
    pub same_rack: f64,
    pub same_zone: f64,
    pub other_zone: f64,
    pub object_store: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            same_host: 0.1,
            same_rack: 1.0,
            same_zone: 2.0,
            other_zone: 8.0,
            object_store: 20.0,
        }
    }
}

impl CostWeights {
    pub fn check(&self) -> Result<(), String> {
        let all = [
            self.same_host,
            self.same_rack,
            self.same_zone,
            self.other_zone,
            self.object_store,
        ];
        if all.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err("cost weights must be finite and not negative".into());
        }
        Ok(())
    }
}

/// A node as locality sees it.
#[derive(Debug, Clone)]
pub struct NodeTopo {
    pub id: String,
    pub host: String,
    pub rack: String,
    pub zone: String,
    /// Only live nodes serve as sources.
    pub live: bool,
}

/// A shard's bytes (of the part of the version asked about) and its replicas.
#[derive(Debug, Clone)]
pub struct ShardBytes {
    pub bytes: u64,
    pub replicas: Vec<String>,
}

/// One node's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeLocality {
    /// Index of the node in the `nodes` given to `compute`.
    pub index: usize,
    pub node: String,
    pub resident_bytes: u64,
    pub resident_fraction: f64,
    /// Of the bytes not on the node, how many the cheapest source has on the same host,
    /// rack, zone, another zone, or only the object store.
    pub same_host_bytes: u64,
    pub same_rack_bytes: u64,
    pub same_zone_bytes: u64,
    pub other_zone_bytes: u64,
    pub origin_bytes: u64,
    /// Σ bytes / GiB × weight of their cheapest source.
    pub transfer_cost: f64,
    /// 1 = best.
    pub rank: u32,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Nodes with their places as small integers, and their ids' sort order: what `compute`
/// needs of the node set, built once per change of it (the catalogue keeps one), so that
/// a question over 10,000 nodes only sums and ranks instead of hashing 40,000 strings.
#[derive(Debug)]
pub struct Topology {
    ids: Vec<String>,
    by_id: FastMap<String, usize>,
    /// (host, rack within its zone, zone) of each node.
    place: Vec<(u32, u32, u32)>,
    /// Each node's position in id order: ties are broken by id without comparing strings.
    order: Vec<u32>,
    counts: (usize, usize, usize),
}

impl Topology {
    /// From (id, host, rack, zone) per node; a node's index is its position here.
    pub fn new<'a>(nodes: impl IntoIterator<Item = (&'a str, &'a str, &'a str, &'a str)>) -> Topology {
        let mut hosts: FastMap<&str, u32> = FastMap::default();
        let mut racks: FastMap<(&str, &str), u32> = FastMap::default();
        let mut zones: FastMap<&str, u32> = FastMap::default();
        let mut ids = Vec::new();
        let mut place = Vec::new();
        for (id, host, rack, zone) in nodes {
            let h = hosts.len() as u32;
            let h = *hosts.entry(host).or_insert(h);
            let r = racks.len() as u32;
            let r = *racks.entry((zone, rack)).or_insert(r);
            let z = zones.len() as u32;
            let z = *zones.entry(zone).or_insert(z);
            place.push((h, r, z));
            ids.push(id.to_string());
        }
        let counts = (hosts.len(), racks.len(), zones.len());
        let mut sorted: Vec<usize> = (0..ids.len()).collect();
        sorted.sort_unstable_by(|&a, &b| ids[a].cmp(&ids[b]));
        let mut order = vec![0u32; ids.len()];
        for (rank, i) in sorted.into_iter().enumerate() {
            order[i] = rank as u32;
        }
        let by_id = ids.iter().enumerate().map(|(i, id)| (id.clone(), i)).collect();
        Topology {
            ids,
            by_id,
            place,
            order,
            counts,
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn index(&self, id: &str) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    pub fn id(&self, i: usize) -> &str {
        &self.ids[i]
    }
}

/// Locality of `candidates` (indexes into `nodes`) for `shards`, ranked: cheapest rest
/// first, then most resident bytes, then node id.
pub fn compute<'a>(
    shards: impl IntoIterator<Item = &'a ShardBytes>,
    nodes: &[NodeTopo],
    candidates: &[usize],
    w: &CostWeights,
) -> Vec<NodeLocality> {
    let topo = Topology::new(
        nodes
            .iter()
            .map(|n| (n.id.as_str(), n.host.as_str(), n.rack.as_str(), n.zone.as_str())),
    );
    let live: Vec<bool> = nodes.iter().map(|n| n.live).collect();
    compute_on(shards, &topo, &live, candidates, w, usize::MAX)
}

/// `compute` over a prepared topology, answering the best `limit`; `live[i]`: whether
/// node `i` is up (only live nodes serve as sources or count what they hold).
pub fn compute_on<'a>(
    shards: impl IntoIterator<Item = &'a ShardBytes>,
    topo: &Topology,
    live: &[bool],
    candidates: &[usize],
    w: &CostWeights,
    limit: usize,
) -> Vec<NodeLocality> {
    let place: Vec<(usize, usize, usize)> = topo
        .place
        .iter()
        .map(|&(h, r, z)| (h as usize, r as usize, z as usize))
        .collect();
    let (hosts, racks, zones) = topo.counts;
    let mut total = 0u64;
    let mut live_any = 0u64;
    // Bytes of shards with a live replica on each node / host / rack / zone; a shard
    // counts once per place however many of its replicas are there.
    let mut on_node = vec![0u64; topo.len()];
    let mut on_host = vec![0u64; hosts];
    let mut on_rack = vec![0u64; racks];
    let mut on_zone = vec![0u64; zones];
    let mut here: Vec<usize> = Vec::with_capacity(8);
    for s in shards {
        total += s.bytes;
        here.clear();
        for r in &s.replicas {
            if let Some(i) = topo.index(r) {
                if live[i] && !here.contains(&i) {
                    here.push(i);
                }
            }
        }
        if here.is_empty() {
            continue;
        }
        live_any += s.bytes;
        for (k, &i) in here.iter().enumerate() {
            on_node[i] += s.bytes;
            let (h, r, z) = place[i];
            let earlier = &here[..k];
            if !earlier.iter().any(|&j| place[j].0 == h) {
                on_host[h] += s.bytes;
            }
            if !earlier.iter().any(|&j| place[j].1 == r) {
                on_rack[r] += s.bytes;
            }
            if !earlier.iter().any(|&j| place[j].2 == z) {
                on_zone[z] += s.bytes;
            }
        }
    }
    let mut out: Vec<NodeLocality> = candidates
        .iter()
        .map(|&i| {
            let (h, r, z) = place[i];
            // A node's own replicas count only while it is live; a down node holds
            // nothing anyone can use.
            let resident = if live[i] { on_node[i] } else { 0 };
            let host = on_host[h].max(resident);
            let rack = on_rack[r].max(host);
            let zone = on_zone[z].max(rack);
            let anywhere = live_any.max(zone);
            let l = NodeLocality {
                index: i,
                // Named below, for the rows answered only.
                node: String::new(),
                resident_bytes: resident,
                resident_fraction: if total == 0 {
                    1.0
                } else {
                    resident as f64 / total as f64
                },
                same_host_bytes: host - resident,
                same_rack_bytes: rack - host,
                same_zone_bytes: zone - rack,
                other_zone_bytes: anywhere - zone,
                origin_bytes: total - anywhere,
                transfer_cost: 0.0,
                rank: 0,
            };
            let cost = (l.same_host_bytes as f64 * w.same_host
                + l.same_rack_bytes as f64 * w.same_rack
                + l.same_zone_bytes as f64 * w.same_zone
                + l.other_zone_bytes as f64 * w.other_zone
                + l.origin_bytes as f64 * w.object_store)
                / GIB;
            NodeLocality {
                transfer_cost: cost,
                ..l
            }
        })
        .collect();
    // A total order (ids are unique), so the best `limit` are picked, then sorted, with
    // the same result as sorting all.
    let order = |a: &NodeLocality, b: &NodeLocality| {
        a.transfer_cost
            .total_cmp(&b.transfer_cost)
            .then(b.resident_bytes.cmp(&a.resident_bytes))
            .then(topo.order[a.index].cmp(&topo.order[b.index]))
    };
    if limit < out.len() {
        out.select_nth_unstable_by(limit, order);
        out.truncate(limit);
    }
    out.sort_unstable_by(order);
    for (i, l) in out.iter_mut().enumerate() {
        l.rank = i as u32 + 1;
        l.node = topo.ids[l.index].clone();
    }
    out
}

/// Whether a node's labels satisfy a selector (`k=v` pairs, all must match).
pub fn matches(labels: &HashMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(id: &str, host: &str, rack: &str, zone: &str) -> NodeTopo {
        NodeTopo {
            id: id.into(),
            host: host.into(),
            rack: rack.into(),
            zone: zone.into(),
            live: true,
        }
    }

    fn shard(bytes: u64, replicas: &[&str]) -> ShardBytes {
        ShardBytes {
            bytes,
            replicas: replicas.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn grades_by_distance_and_ranks_cheapest_first() {
        let nodes = vec![
            node("a", "ha", "r1", "z1"),
            node("b", "hb", "r1", "z1"),
            node("c", "hc", "r2", "z1"),
            node("d", "hd", "r3", "z2"),
        ];
        let g = 1u64 << 30;
        let shards = vec![shard(g, &["a"]), shard(2 * g, &["a", "c"]), shard(g, &[])];
        let out = compute(&shards, &nodes, &[0, 1, 2, 3], &CostWeights::default());
        let by: HashMap<_, _> = out.iter().map(|l| (l.node.as_str(), l)).collect();
        assert_eq!(by["a"].resident_bytes, 3 * g);
        assert_eq!(by["a"].origin_bytes, g);
        assert_eq!(by["b"].resident_bytes, 0);
        assert_eq!(by["b"].same_rack_bytes, 3 * g, "a is in b's rack");
        assert_eq!(by["c"].resident_bytes, 2 * g);
        assert_eq!(by["c"].same_zone_bytes, g);
        assert_eq!(by["d"].other_zone_bytes, 3 * g);
        assert_eq!(out[0].node, "a");
        assert_eq!(out.last().unwrap().node, "d");
        assert!((by["a"].resident_fraction - 0.75).abs() < 1e-9);
        assert!((by["b"].transfer_cost - (3.0 * 1.0 + 20.0)).abs() < 1e-9);
    }

    #[test]
    fn a_down_node_is_neither_source_nor_resident() {
        let mut nodes = vec![node("a", "ha", "r1", "z1"), node("b", "hb", "r1", "z1")];
        nodes[0].live = false;
        let out = compute(&[shard(100, &["a"])], &nodes, &[0, 1], &CostWeights::default());
        for l in out {
            assert_eq!(l.resident_bytes, 0);
            assert_eq!(l.origin_bytes, 100);
        }
    }

    /// The cheapest source of each shard for each node, the slow way.
    fn brute(shards: &[ShardBytes], nodes: &[NodeTopo], i: usize) -> [u64; 6] {
        let me = &nodes[i];
        let mut out = [0u64; 6];
        for s in shards {
            let best = s
                .replicas
                .iter()
                .filter_map(|r| nodes.iter().find(|n| &n.id == r && n.live))
                .map(|n| {
                    if me.live && n.id == me.id {
                        0
                    } else if n.host == me.host {
                        1
                    } else if n.rack == me.rack && n.zone == me.zone {
                        2
                    } else if n.zone == me.zone {
                        3
                    } else {
                        4
                    }
                })
                .min()
                .unwrap_or(5);
            out[best] += s.bytes;
        }
        out
    }

    proptest! {
        #[test]
        fn aggregated_sums_equal_the_per_shard_answer(
            topo in prop::collection::vec((0u8..6, any::<bool>()), 1..12),
            shards in prop::collection::vec((1u64..1_000_000, prop::collection::vec(0usize..12, 0..4)), 0..40),
        ) {
            let nodes: Vec<NodeTopo> = topo
                .iter()
                .enumerate()
                .map(|(i, (h, live))| NodeTopo {
                    id: format!("n{i}"),
                    host: format!("h{h}"),
                    // A host sits in one rack, a rack in one zone, as in a real cluster.
                    rack: format!("r{}", h % 3),
                    zone: format!("z{}", (h % 3) % 2),
                    live: *live,
                })
                .collect();
            let shards: Vec<ShardBytes> = shards
                .into_iter()
                .map(|(b, reps)| {
                    let r = reps.into_iter().filter(|i| *i < nodes.len()).map(|i| format!("n{i}")).collect();
                    ShardBytes { bytes: b, replicas: r }
                })
                .collect();
            let all: Vec<usize> = (0..nodes.len()).collect();
            let out = compute(&shards, &nodes, &all, &CostWeights::default());
            for l in &out {
                let i = nodes.iter().position(|n| n.id == l.node).unwrap();
                let want = brute(&shards, &nodes, i);
                prop_assert_eq!(
                    [l.resident_bytes, l.same_host_bytes, l.same_rack_bytes, l.same_zone_bytes, l.other_zone_bytes, l.origin_bytes],
                    want,
                    "node {}", l.node
                );
            }
            for w in out.windows(2) {
                prop_assert!(w[0].transfer_cost <= w[1].transfer_cost);
            }
            // The best k, picked without sorting all, are the full ranking's first k.
            let topology = Topology::new(nodes.iter().map(|n| (n.id.as_str(), n.host.as_str(), n.rack.as_str(), n.zone.as_str())));
            let live: Vec<bool> = nodes.iter().map(|n| n.live).collect();
            for k in [0, 1, 3, all.len()] {
                let best = compute_on(&shards, &topology, &live, &all, &CostWeights::default(), k);
                prop_assert_eq!(&best[..], &out[..k.min(out.len())]);
            }
        }
    }
}
