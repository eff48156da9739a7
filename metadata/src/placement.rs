//! Replica placement: which nodes hold each shard.
//!
//! Rules, in order: a shard's replicas are on distinct hosts (never two on one host);
//! never on a node without room for the shard; nodes that already hold the shard's bytes
//! first (a re-import moves nothing); then distinct racks while racks without one of its
//! replicas remain; among the nodes left, the one with the most free bytes (so placement
//! is weighted by free capacity and fills nodes evenly). Free bytes are
//! debited as shards are placed, so one call never overcommits a node. Ties break on a
//! hash of (shard, node) so equal nodes share the load without randomness.
//!
//! A pure function: no I/O, no clock, so the rules are property-tested.

use std::collections::HashSet;

/// A node that may receive replicas.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub id: String,
    pub host: String,
    pub rack: String,
    /// Bytes it can still accept.
    pub free: u64,
}

/// A shard to place, with nodes that already hold it (repair) and must not be chosen
/// again; their hosts and racks count as used.
#[derive(Debug, Clone)]
pub struct Request {
    pub shard: u32,
    pub bytes: u64,
    pub replicas: usize,
    pub existing: Vec<Candidate>,
    /// Node ids that already hold the shard's bytes, preferred in this order.
    pub prefer: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// New nodes for the shard (in addition to `existing`).
    Placed(Vec<String>),
    /// Not enough suitable nodes; nothing was debited for this shard.
    Unplaced(String),
}

fn tie(shard: u32, id: &str) -> u64 {
    let h = blake3::hash(format!("{shard}/{id}").as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// Places every request against `nodes`, debiting their free bytes. Larger shards are
/// placed first, which packs better when space is tight.
pub fn place(requests: &[Request], nodes: &mut [Candidate]) -> Vec<(u32, Outcome)> {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|a, b| requests[*b].bytes.cmp(&requests[*a].bytes).then(a.cmp(b)));
    let mut out = Vec::with_capacity(requests.len());
    for i in order {
        let r = &requests[i];
        let need = r.replicas.saturating_sub(r.existing.len());
        let mut hosts: HashSet<String> = r.existing.iter().map(|c| c.host.clone()).collect();
        let mut racks: HashSet<String> = r.existing.iter().map(|c| c.rack.clone()).collect();
        let taken: HashSet<&str> = r.existing.iter().map(|c| c.id.as_str()).collect();
        let mut chosen: Vec<usize> = Vec::new();
        for _ in 0..need {
            let eligible = |j: &usize| {
                let n = &nodes[*j];
                n.free >= r.bytes
                    && !taken.contains(n.id.as_str())
                    && !chosen.contains(j)
                    && !hosts.contains(&n.host)
            };
            let pool: Vec<usize> = (0..nodes.len()).filter(eligible).collect();
            if let Some(j) = r
                .prefer
                .iter()
                .find_map(|id| pool.iter().copied().find(|j| &nodes[*j].id == id))
            {
                hosts.insert(nodes[j].host.clone());
                racks.insert(nodes[j].rack.clone());
                chosen.push(j);
                continue;
            }
            let new_rack: Vec<usize> = pool
                .iter()
                .copied()
                .filter(|j| !racks.contains(&nodes[*j].rack))
                .collect();
            let from = if new_rack.is_empty() { &pool } else { &new_rack };
            let best = from
                .iter()
                .copied()
                .max_by_key(|j| (nodes[*j].free, tie(r.shard, &nodes[*j].id)));
            match best {
                Some(j) => {
                    hosts.insert(nodes[j].host.clone());
                    racks.insert(nodes[j].rack.clone());
                    chosen.push(j);
                }
                None => break,
            }
        }
        if chosen.len() < need {
            let fit = nodes.iter().filter(|n| n.free >= r.bytes).count();
            out.push((
                r.shard,
                Outcome::Unplaced(format!(
                    "needs {need} more replica(s) of {} bytes on distinct hosts; only {} host(s) qualify \
                     ({fit} node(s) with enough free space){}",
                    r.bytes,
                    chosen.len(),
                    if fit > chosen.len() {
                        // More nodes fit than hosts: several share a host label.
                        "; replicas go to distinct hosts (the `host` label, else the node id): give \
                         nodes on different machines their own host=NAME in --labels, or ask for \
                         fewer --replicas"
                    } else {
                        ""
                    }
                )),
            ));
            continue;
        }
        for j in &chosen {
            nodes[*j].free -= r.bytes;
        }
        out.push((
            r.shard,
            Outcome::Placed(chosen.iter().map(|j| nodes[*j].id.clone()).collect()),
        ));
    }
    out.sort_by_key(|(s, _)| *s);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(id: &str, host: &str, rack: &str, free: u64) -> Candidate {
        Candidate {
            id: id.into(),
            host: host.into(),
            rack: rack.into(),
            free,
        }
    }

    fn req(shard: u32, bytes: u64, replicas: usize) -> Request {
        Request {
            shard,
            bytes,
            replicas,
            existing: vec![],
            prefer: vec![],
        }
    }

    #[test]
    fn prefers_nodes_that_hold_the_bytes() {
        let mut nodes = vec![
            node("a", "ha", "r1", 100),
            node("b", "hb", "r2", 90),
            node("c", "hc", "r3", 10),
            node("d", "hc", "r3", 50),
        ];
        let mut r = req(0, 5, 2);
        r.prefer = vec!["c".into(), "d".into()];
        let out = place(&[r], &mut nodes);
        // c first; d shares c's host, so the second replica comes from the normal rules.
        assert_eq!(out[0].1, Outcome::Placed(vec!["c".into(), "a".into()]));
    }

    #[test]
    fn prefers_new_racks_then_free_space() {
        let mut nodes = vec![
            node("a", "ha", "r1", 100),
            node("b", "hb", "r1", 90),
            node("c", "hc", "r2", 10),
        ];
        let out = place(&[req(0, 5, 2)], &mut nodes);
        assert_eq!(out[0].1, Outcome::Placed(vec!["a".into(), "c".into()]));
        assert_eq!((nodes[0].free, nodes[2].free), (95, 5));
    }

    #[test]
    fn reports_what_does_not_fit() {
        let mut nodes = vec![node("a", "h1", "r1", 100), node("b", "h1", "r1", 100)];
        let out = place(&[req(7, 10, 2)], &mut nodes);
        assert!(matches!(&out[0].1, Outcome::Unplaced(m) if m.contains("distinct hosts")));
        assert_eq!(nodes[0].free, 100, "nothing debited for an unplaced shard");
    }

    #[test]
    fn repair_avoids_existing_hosts() {
        let mut nodes = vec![
            node("a", "ha", "r1", 100),
            node("b", "hb", "r2", 100),
            node("c", "hc", "r3", 50),
        ];
        let r = Request {
            shard: 1,
            bytes: 10,
            replicas: 2,
            existing: vec![node("b", "hb", "r2", 0)],
            prefer: vec![],
        };
        let out = place(&[r], &mut nodes);
        assert_eq!(out[0].1, Outcome::Placed(vec!["a".into()]));
    }

    proptest! {
        #[test]
        fn never_two_replicas_on_one_host_and_never_over_capacity(
            caps in prop::collection::vec((0u8..6, 0u8..3, 0u64..1000), 1..12),
            shards in prop::collection::vec(1u64..400, 1..40),
            r in 1usize..4,
        ) {
            let mut nodes: Vec<Candidate> = caps
                .iter()
                .enumerate()
                .map(|(i, (h, rack, free))| node(&format!("n{i}"), &format!("h{h}"), &format!("r{rack}"), *free))
                .collect();
            let before = nodes.clone();
            let reqs: Vec<Request> = shards.iter().enumerate().map(|(i, b)| req(i as u32, *b, r)).collect();
            let out = place(&reqs, &mut nodes);
            prop_assert_eq!(out.len(), reqs.len());
            let mut used = vec![0u64; nodes.len()];
            for (shard, o) in &out {
                if let Outcome::Placed(ids) = o {
                    prop_assert_eq!(ids.len(), r);
                    let hosts: HashSet<_> = ids
                        .iter()
                        .map(|id| before.iter().find(|n| &n.id == id).unwrap().host.clone())
                        .collect();
                    prop_assert_eq!(hosts.len(), ids.len(), "two replicas on one host");
                    for id in ids {
                        let j = before.iter().position(|n| &n.id == id).unwrap();
                        used[j] += reqs[*shard as usize].bytes;
                    }
                }
            }
            for (j, n) in before.iter().enumerate() {
                prop_assert!(used[j] <= n.free, "node {} over capacity", n.id);
                prop_assert_eq!(nodes[j].free, n.free - used[j]);
            }
        }
    }
}
