//! What schedulers ask: locality of a version on candidate nodes, shard-to-rank assignment, warm-up plans.

use super::*;

impl Catalog {
    /// What locality weighs: each asked-about shard's bytes and replicas, for one or more
    /// versions. `shards` keeps only those shard ids (one version only); `prefixes` keeps
    /// only files under those paths, counting each shard by the bytes of its matching
    /// files (this reads the version's entries; whole-version questions read only shard
    /// records). Returns the resolved versions and the shards.
    pub fn locality_shards(
        &self,
        refs: &[DatasetRef],
        shards: Option<&HashSet<u32>>,
        prefixes: &[String],
    ) -> Result<LocalityShards> {
        if shards.is_some() && refs.len() != 1 {
            return Err(InvalidInput::new("shards", "a shard list needs exactly one dataset version").into());
        }
        let mut resolved = Vec::new();
        let mut out = Vec::new();
        for r in refs {
            let (n, v) = self.resolve(r)?;
            let mut pinned = r.clone();
            pinned.version = VersionSel::Number(n);
            resolved.push((r.name.as_str().to_string(), n));
            let all = self.cached_shards(v.uid)?;
            if shards.is_none() && prefixes.is_empty() {
                out.push(ShardSet::All(all));
                continue;
            }
            let recs: BTreeMap<u32, &crate::locality::ShardBytes> = all
                .iter()
                .filter(|(id, _)| shards.is_none_or(|s| s.contains(id)))
                .map(|(id, s)| (*id, s))
                .collect();
            if let Some(want) = shards {
                if let Some(missing) = want.iter().find(|id| !recs.contains_key(id)) {
                    return Err(CatalogError::NotFound(format!(
                        "{}@{n} has no shard {missing}",
                        r.name.as_str()
                    )));
                }
            }
            if prefixes.is_empty() {
                out.push(ShardSet::Some(recs.into_values().cloned().collect()));
                continue;
            }
            let mut bytes: BTreeMap<u32, u64> = BTreeMap::new();
            let mut token = Vec::new();
            loop {
                let (_, page, next) = self.list_entries(&pinned, None, &token, 10_000, false)?;
                for e in page {
                    let under = prefixes.iter().any(|p| {
                        let p = p.trim_end_matches('/');
                        e.path == p
                            || (e.path.starts_with(p) && e.path.as_bytes().get(p.len()) == Some(&b'/'))
                    });
                    if under && e.kind == pb::EntryKind::File as i32 && recs.contains_key(&e.shard) {
                        *bytes.entry(e.shard).or_default() += e.size;
                    }
                }
                if next.is_empty() {
                    break;
                }
                token = next;
            }
            out.push(ShardSet::Some(
                bytes
                    .into_iter()
                    .map(|(id, b)| crate::locality::ShardBytes {
                        bytes: b,
                        replicas: recs[&id].replicas.clone(),
                    })
                    .collect(),
            ));
        }
        Ok((resolved, out))
    }

    pub(super) fn replicas_changed(&self) {
        self.replica_gen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// A version's shards (id, bytes, replicas), from the cache when still valid.
    pub(super) fn cached_shards(&self, uid: u64) -> Result<VersionShards> {
        let gen = self.replica_gen.load(std::sync::atomic::Ordering::SeqCst) + self.store.outside_writes();
        if let Some((g, v)) = lock(&self.shard_cache).get(&uid) {
            if *g == gen {
                return Ok(v.clone());
            }
        }
        let (_, end) = keys::uid_range(uid);
        let mut rows = Vec::new();
        for kv in self.store.scan(Table::Shards, &keys::shard(uid, 0), Some(&end)) {
            let (k, val) = kv?;
            let rec: ShardRecord = decode(Table::Shards, &val)?;
            rows.push((
                keys::shard_id(&k).unwrap_or(0),
                crate::locality::ShardBytes {
                    bytes: rec.bytes,
                    replicas: rec.replicas,
                },
            ));
        }
        let rows = Arc::new(rows);
        let mut cache = lock(&self.shard_cache);
        // Versions come and go; keep the cache to the versions asked about lately.
        if cache.len() >= 256 {
            cache.clear();
        }
        cache.insert(uid, (gen, rows.clone()));
        Ok(rows)
    }

    /// The Locality call: candidates ranked by the cost of the data they lack, the best
    /// `limit` of them answered, with their labels if asked.
    pub fn locality(
        &self,
        refs: &[DatasetRef],
        shards: Option<&HashSet<u32>>,
        prefixes: &[String],
        candidates: &[String],
        selector: &HashMap<String, String>,
        (limit, with_labels): (usize, bool),
    ) -> Result<pb::LocalityResponse> {
        if refs.is_empty() {
            return Err(InvalidInput::new("refs", "name at least one dataset version").into());
        }
        let (resolved, shard_bytes) = self.locality_shards(refs, shards, prefixes)?;
        self.notice_pause(false);
        let view = self.node_view()?;
        let nodes = view.records();
        let topo = view.topology();
        let up = self.up_of(&view);
        let picked: Vec<usize> = if candidates.is_empty() {
            (0..nodes.len())
                .filter(|&i| up[i] && !nodes[i].1.draining)
                .filter(|&i| crate::locality::matches(&nodes[i].1.labels, selector))
                .collect()
        } else {
            let mut seen = HashSet::new();
            let mut v = Vec::new();
            for c in candidates {
                let i = topo
                    .index(c)
                    .ok_or_else(|| CatalogError::NotFound(format!("no node named {c}")))?;
                if crate::locality::matches(&nodes[i].1.labels, selector) && seen.insert(i) {
                    v.push(i);
                }
            }
            v
        };
        let ranked = crate::locality::compute_on(
            shard_bytes.iter().flat_map(|s| s.iter()),
            topo,
            &up,
            &picked,
            &self.config.cost,
            limit,
        );
        Ok(pb::LocalityResponse {
            refs: resolved
                .into_iter()
                .map(|(dataset, version)| pb::VersionRef { dataset, version })
                .collect(),
            total_bytes: shard_bytes.iter().flat_map(|s| s.iter()).map(|s| s.bytes).sum(),
            nodes: ranked
                .into_iter()
                .map(|l| {
                    let i = l.index;
                    pb::NodeLocality {
                        labels: if with_labels {
                            nodes[i].1.labels.clone()
                        } else {
                            HashMap::new()
                        },
                        live: up[i],
                        node: l.node,
                        resident_bytes: l.resident_bytes,
                        resident_fraction: l.resident_fraction,
                        transfer_cost: l.transfer_cost,
                        rank: l.rank,
                        same_host_bytes: l.same_host_bytes,
                        same_rack_bytes: l.same_rack_bytes,
                        same_zone_bytes: l.same_zone_bytes,
                        other_zone_bytes: l.other_zone_bytes,
                        origin_bytes: l.origin_bytes,
                    }
                })
                .collect(),
        })
    }

    /// The Assign call. Replicas on nodes that are down do not count as local.
    pub fn assign(
        &self,
        r: &DatasetRef,
        rank_nodes: &[String],
        with_files: bool,
    ) -> Result<pb::AssignResponse> {
        if rank_nodes.is_empty() || rank_nodes.len() > 100_000 {
            return Err(
                InvalidInput::new("rank_nodes", "name the node of each rank (1 to 100,000 ranks)").into(),
            );
        }
        if let Some(bad) = rank_nodes.iter().find(|n| NodeId::try_from(n.as_str()).is_err()) {
            return Err(InvalidInput::new("rank_nodes", format!("{bad:?} is not a node id")).into());
        }
        let (n, _) = self.resolve(r)?;
        // A version too large to list in one answer is refused by `files_by_shard`
        // before anything is listed.
        let live: HashSet<String> = self
            .list_nodes()?
            .into_iter()
            .filter(|n| n.state == pb::NodeState::Up as i32)
            .map(|n| n.id)
            .collect();
        let (_, shards, _) = self.list_shards(r, 0, usize::MAX)?;
        let input: Vec<crate::assign::ShardIn> = shards
            .iter()
            .map(|s| crate::assign::ShardIn {
                id: s.id,
                bytes: s.bytes,
                replicas: s.replicas.iter().filter(|x| live.contains(*x)).cloned().collect(),
            })
            .collect();
        let plans = crate::assign::assign(&input, rank_nodes);
        let files = if with_files {
            self.files_by_shard(r, n)?
        } else {
            HashMap::new()
        };
        let total: u64 = input.iter().map(|s| s.bytes).sum();
        let local: u64 = plans.iter().map(|p| p.local_bytes).sum();
        Ok(pb::AssignResponse {
            r#ref: Some(pb::VersionRef {
                dataset: r.name.as_str().to_string(),
                version: n,
            }),
            total_bytes: total,
            local_fraction: if total == 0 {
                1.0
            } else {
                local as f64 / total as f64
            },
            ranks: plans
                .into_iter()
                .map(|p| pb::RankAssignment {
                    local_fraction: p.local_fraction(),
                    files: p
                        .shards
                        .iter()
                        .flat_map(|s| files.get(s).into_iter().flatten().map(|(p, _)| p.clone()))
                        .collect(),
                    rank: p.rank,
                    node: p.node,
                    shards: p.shards,
                    bytes: p.bytes,
                    local_bytes: p.local_bytes,
                })
                .collect(),
        })
    }

    /// Version `n` of `r`'s dataset: each shard's files (path, size), in manifest order;
    /// refused for a version of more than `MAX_ASSIGN_FILES` files (one answer's worth).
    pub fn files_by_shard(&self, r: &DatasetRef, n: u64) -> Result<HashMap<u32, Vec<(String, u64)>>> {
        let mut pinned = r.clone();
        pinned.version = VersionSel::Number(n);
        let (_, v) = self.resolve(&pinned)?;
        if v.files > MAX_ASSIGN_FILES {
            return Err(InvalidInput::new(
                "files",
                format!(
                    "{}@{n} has {} files, more than one answer lists ({MAX_ASSIGN_FILES}); ask \
                     for shards and list their files separately",
                    r.name.as_str(),
                    v.files
                ),
            )
            .into());
        }
        let mut files: HashMap<u32, Vec<(String, u64)>> = HashMap::new();
        let mut token = Vec::new();
        loop {
            let (_, page, next) = self.list_entries(&pinned, None, &token, 10_000, false)?;
            for e in page.into_iter().filter(|e| e.kind == pb::EntryKind::File as i32) {
                files.entry(e.shard).or_default().push((e.path, e.size));
            }
            if next.is_empty() {
                break;
            }
            token = next;
        }
        Ok(files)
    }

    /// What warming `nodes` with a version takes: a copy task per (shard, node) the node
    /// does not hold yet, each from the cheapest live replica (same rack, then zone, then
    /// any); the bytes already there; and the copies of shards no live node holds, which
    /// only a backup or the version's origin can make.
    pub fn warm_plan(&self, r: &DatasetRef, targets: &[String]) -> Result<WarmPlan> {
        if targets.is_empty() || targets.len() > 10_000 {
            return Err(InvalidInput::new("nodes", "name 1 to 10,000 nodes to warm").into());
        }
        let (n, v) = self.resolve(r)?;
        let nodes = self.list_nodes()?;
        let by_id: HashMap<&str, &pb::Node> = nodes.iter().map(|x| (x.id.as_str(), x)).collect();
        let up = |id: &str| by_id.get(id).is_some_and(|x| x.state == pb::NodeState::Up as i32);
        for t in targets {
            match by_id.get(t.as_str()) {
                None => return Err(CatalogError::NotFound(format!("no node named {t}"))),
                Some(_) if !up(t) => return Err(CatalogError::Precondition(format!("node {t} is down"))),
                Some(x) if x.draining => {
                    return Err(CatalogError::Precondition(format!("node {t} is draining")))
                }
                _ => {}
            }
        }
        let label = |id: &str, k: &str| {
            by_id
                .get(id)
                .and_then(|x| x.labels.get(k))
                .cloned()
                .unwrap_or_default()
        };
        let mut plan = WarmPlan {
            version: n,
            outside_source: (!v.origin.is_empty() && v.origin != "cluster")
                || !self.backup_sources()?.is_empty(),
            ..Default::default()
        };
        for (id, s) in self.cached_shards(v.uid)?.iter() {
            let live: Vec<&String> = s.replicas.iter().filter(|x| up(x)).collect();
            for t in targets {
                if s.replicas.contains(t) {
                    plan.bytes_already += s.bytes;
                    continue;
                }
                let Some(source) = live.iter().min_by_key(|src| {
                    let same = |k: &str| label(src, k) == label(t, k) && !label(t, k).is_empty();
                    (
                        !(same("rack") && same("zone")),
                        !same("zone"),
                        src.as_str().to_string(),
                    )
                }) else {
                    plan.origin.push(RepairTask {
                        dataset: r.name.as_str().to_string(),
                        version: n,
                        shard: *id,
                        bytes: s.bytes,
                        source: None,
                        target: (t.clone(), by_id[t.as_str()].address.clone()),
                        drop: Vec::new(),
                    });
                    continue;
                };
                plan.tasks.push(RepairTask {
                    dataset: r.name.as_str().to_string(),
                    version: n,
                    shard: *id,
                    bytes: s.bytes,
                    source: Some(((*source).clone(), by_id[source.as_str()].address.clone())),
                    target: (t.clone(), by_id[t.as_str()].address.clone()),
                    drop: Vec::new(),
                });
            }
        }
        Ok(plan)
    }
}
