//! Placement of new shards, where blobs are (for nodes and mounts), what each node must hold, and the
//! repair plan for shards under their replication factor.

use super::*;

impl Catalog {
    /// Live, non-draining nodes as placement candidates.
    pub(super) fn candidates(&self) -> Result<Vec<(placement::Candidate, String)>> {
        Ok(self
            .list_nodes()?
            .into_iter()
            // A node not heard from since this service started may be gone for good: it
            // keeps its replicas through the grace, but takes no new one.
            .filter(|n| n.state == pb::NodeState::Up as i32 && !n.draining && !n.unheard)
            .map(|n| {
                let c = placement::Candidate {
                    host: n.labels.get("host").cloned().unwrap_or_else(|| n.id.clone()),
                    rack: n.labels.get("rack").cloned().unwrap_or_default(),
                    free: n.free_bytes,
                    id: n.id,
                };
                (c, n.address)
            })
            .collect())
    }

    /// Chooses `replication` nodes for each shard. Shards that cannot be placed are
    /// returned with the reason, and debit nothing.
    pub fn place_shards(
        &self,
        shards: &[(u32, u64, Vec<String>)],
        replication: u32,
    ) -> Result<PlacementResult> {
        if replication == 0 || replication > 16 {
            return Err(InvalidInput::new("replication", "must be 1 to 16").into());
        }
        let mut seen = HashSet::new();
        if let Some((id, _, _)) = shards.iter().find(|(id, _, _)| !seen.insert(*id)) {
            return Err(InvalidInput::new("shards", format!("shard {id} is listed twice")).into());
        }
        let mut nodes: Vec<_> = self.candidates()?.into_iter().map(|(c, _)| c).collect();
        let reqs: Vec<_> = shards
            .iter()
            .map(|(id, bytes, prefer)| placement::Request {
                shard: *id,
                bytes: *bytes,
                replicas: replication as usize,
                existing: Vec::new(),
                prefer: prefer.clone(),
            })
            .collect();
        let mut placed = Vec::new();
        let mut unplaced = Vec::new();
        // Nodes waiting to be heard from after this service started are not chosen; a
        // placement that fails for want of them says so.
        let unheard = self.list_nodes()?.iter().filter(|n| n.unheard).count();
        for (shard, o) in placement::place(&reqs, &mut nodes) {
            match o {
                placement::Outcome::Placed(n) => placed.push((shard, n)),
                placement::Outcome::Unplaced(why) if unheard > 0 => unplaced.push((
                    shard,
                    format!(
                        "{why}; {unheard} node(s) not heard from since the metadata service started \
                         are not chosen yet: retry in a few seconds"
                    ),
                )),
                placement::Outcome::Unplaced(why) => unplaced.push((shard, why)),
            }
        }
        Ok((placed, unplaced))
    }

    pub(super) fn live_addresses(&self) -> Result<HashMap<String, String>> {
        Ok(self
            .list_nodes()?
            .into_iter()
            .filter(|n| n.state == pb::NodeState::Up as i32)
            .map(|n| (n.id, n.address))
            .collect())
    }

    /// Up to `limit` blobs the session's files name that only committed versions of
    /// datasets `sees` rejects hold (none of a dataset it accepts): content a scoped
    /// importer may never have had, named by hash to have it readable as its own.
    pub fn foreign_blobs(
        &self,
        session: u64,
        sees: impl Fn(&str) -> bool,
        limit: usize,
    ) -> Result<Vec<BlobHash>> {
        let mut visible: HashMap<u64, bool> = HashMap::new();
        for kv in self.store.scan(Table::Versions, b"", None) {
            let (k, v) = kv?;
            if let Some((dataset, _)) = keys::split_version(&k) {
                visible.insert(decode::<VersionRecord>(Table::Versions, &v)?.uid, sees(dataset));
            }
        }
        let (from, to) = keys::uid_range(session);
        let mut checked = std::collections::HashSet::new();
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Entries, &from, Some(&to)) {
            let (_, v) = kv?;
            let e: EntryRecord = decode(Table::Entries, &v)?;
            let Ok(h) = BlobHash::from_slice("blob", &e.blob) else {
                continue;
            };
            if e.kind != KIND_FILE || !checked.insert(h) {
                continue;
            }
            let (mut inside, mut outside) = (false, false);
            let end = crate::store::prefix_end(&h.0);
            for kv in self.store.scan(Table::BlobShards, &h.0, end.as_deref()) {
                let (k, _) = kv?;
                if k.len() != 44 {
                    continue;
                }
                match visible.get(&keys::u64_value(&k[32..40]).unwrap_or(0)) {
                    Some(true) => {
                        inside = true;
                        break;
                    }
                    Some(false) => outside = true,
                    None => {}
                }
            }
            if outside && !inside {
                out.push(h);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// For each hash, whether a shard of one of the versions `uids` holds it: what a node
    /// asks before serving a blob under a read grant narrowed to those versions. A deleted
    /// version's rows are gone, so its blobs stop being members with it.
    pub fn blobs_in_versions(&self, uids: &[u64], hashes: &[BlobHash]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let end = crate::store::prefix_end(&h.0);
            let mut member = false;
            for kv in self.store.scan(Table::BlobShards, &h.0, end.as_deref()) {
                let (k, _) = kv?;
                if k.len() == 44 && uids.contains(&keys::u64_value(&k[32..40]).unwrap_or(0)) {
                    member = true;
                    break;
                }
            }
            out.push(member);
        }
        Ok(out)
    }

    /// For each hash, whether a committed version of a dataset `sees` accepts holds it:
    /// what a scoped caller may be told the whereabouts of.
    pub fn blobs_seen(&self, hashes: &[BlobHash], sees: impl Fn(&str) -> bool) -> Result<Vec<bool>> {
        let mut visible: HashMap<u64, bool> = HashMap::new();
        for kv in self.store.scan(Table::Versions, b"", None) {
            let (k, v) = kv?;
            if let Some((dataset, _)) = keys::split_version(&k) {
                visible.insert(decode::<VersionRecord>(Table::Versions, &v)?.uid, sees(dataset));
            }
        }
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let end = crate::store::prefix_end(&h.0);
            let mut seen = false;
            for kv in self.store.scan(Table::BlobShards, &h.0, end.as_deref()) {
                let (k, _) = kv?;
                if k.len() == 44 && visible.get(&keys::u64_value(&k[32..40]).unwrap_or(0)) == Some(&true) {
                    seen = true;
                    break;
                }
            }
            out.push(seen);
        }
        Ok(out)
    }

    /// For each blob: the live nodes holding it as a replica, their addresses, and its
    /// (size, chunk size) from a committed version's manifest (None: no committed version
    /// holds it).
    #[allow(clippy::type_complexity)]
    pub fn locate_blobs(
        &self,
        hashes: &[BlobHash],
    ) -> Result<Vec<(Vec<String>, Vec<String>, Option<(u64, u32)>)>> {
        let live = self.live_addresses()?;
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let end = crate::store::prefix_end(&h.0);
            let mut nodes: Vec<String> = Vec::new();
            let mut size = None;
            for kv in self.store.scan(Table::BlobShards, &h.0, end.as_deref()) {
                let (k, sized) = kv?;
                if k.len() != 44 {
                    continue;
                }
                let uid = keys::u64_value(&k[32..40]).unwrap_or(0);
                let shard = u32::from_be_bytes(k[40..44].try_into().expect("4 bytes"));
                if let Some(v) = self.store.get(Table::Shards, &keys::shard(uid, shard))? {
                    let rec: ShardRecord = decode(Table::Shards, &v)?;
                    for n in rec.replicas {
                        if live.contains_key(&n) && !nodes.contains(&n) {
                            nodes.push(n);
                        }
                    }
                    if size.is_none() && self.uid_committed(uid)? {
                        // Rows of schema version 1 keep the size in the shard's row.
                        let v = if sized.is_empty() {
                            self.store
                                .get(Table::ShardBlobs, &keys::shard_blob(uid, shard, &h.0))?
                                .unwrap_or_default()
                        } else {
                            sized.to_vec()
                        };
                        if v.len() == 12 {
                            let s = u64::from_be_bytes(v[..8].try_into().expect("8 bytes"));
                            let cs = u32::from_be_bytes(v[8..12].try_into().expect("4 bytes"));
                            size = Some((s, cs));
                        }
                    }
                }
            }
            let addrs = nodes.iter().map(|n| live[n].clone()).collect();
            out.push((nodes, addrs, size));
        }
        Ok(out)
    }

    /// Whether rows under `uid` belong to a committed version (not to an import session
    /// still open: what it uploaded is the importer's word, not a manifest's yet).
    fn uid_committed(&self, uid: u64) -> Result<bool> {
        Ok(self.store.get(Table::Sessions, &keys::uid(uid))?.is_none())
    }

    /// The blobs `node` must hold, a page at a time (whole shards per page). The token is
    /// the last `node_shards` key covered.
    pub fn list_node_blobs(
        &self,
        node: &NodeId,
        token: &[u8],
        limit: usize,
    ) -> Result<(Vec<pb::NodeBlob>, Vec<u8>)> {
        let mut prefix = node.as_str().as_bytes().to_vec();
        prefix.push(0);
        let end = crate::store::prefix_end(&prefix).expect("prefix ends in 0x00");
        let start = if token.is_empty() {
            prefix.clone()
        } else {
            if !token.starts_with(&prefix) {
                return Err(InvalidInput::new("page_token", "does not belong to this node's listing").into());
            }
            let mut t = token.to_vec();
            t.push(0);
            t
        };
        let mut out = Vec::new();
        let mut last = Vec::new();
        let mut more = false;
        for kv in self.store.scan(Table::NodeShards, &start, Some(&end)) {
            let (k, _) = kv?;
            if out.len() >= limit {
                more = true;
                break;
            }
            let tail = &k[prefix.len()..];
            if tail.len() != 12 {
                continue;
            }
            let uid = keys::u64_value(&tail[..8]).unwrap_or(0);
            let shard = u32::from_be_bytes(tail[8..12].try_into().expect("4 bytes"));
            for (hash, size, chunk_size) in self.shard_blobs(uid, shard)? {
                out.push(pb::NodeBlob {
                    hash: hash.0.to_vec(),
                    size,
                    chunk_size,
                });
            }
            last = k.to_vec();
        }
        Ok((out, if more { last } else { Vec::new() }))
    }

    /// The blobs of one shard: (hash, size, chunk size).
    pub fn shard_blobs(&self, uid: u64, shard: u32) -> Result<Vec<(BlobHash, u64, u32)>> {
        let prefix = keys::shard(uid, shard);
        let end = crate::store::prefix_end(&prefix);
        let mut out = Vec::new();
        for kv in self.store.scan(Table::ShardBlobs, &prefix, end.as_deref()) {
            let (k, v) = kv?;
            let (_, blobs) = keys::shard_blobs_row(&k, &v).ok_or_else(|| CatalogError::Corrupt {
                table: "shard_blobs",
                reason: "malformed row".into(),
            })?;
            out.extend(
                blobs
                    .into_iter()
                    .map(|(h, size, chunk)| (BlobHash(h), size, chunk)),
            );
        }
        // Each page's row is in hash order, and a blob two pages name is listed once.
        out.sort_unstable_by_key(|b| b.0 .0);
        out.dedup_by(|a, b| a.0 == b.0);
        Ok(out)
    }

    /// The blobs of a shard of a committed version, by reference.
    pub fn version_shard_blobs(&self, r: &DatasetRef, shard: u32) -> Result<Vec<(BlobHash, u64, u32)>> {
        let (_, v) = self.resolve(r)?;
        self.shard_blobs(v.uid, shard)
    }

    /// Where a shard's blobs can be read outside the cluster: the version's origin URL
    /// (None for versions without one) and, for each blob, the path of a file holding
    /// it. Found by reading the version's entries: O(entries), for the rare copy of a
    /// shard no node holds, never on a read path.
    pub fn shard_origin(
        &self,
        r: &DatasetRef,
        shard: u32,
    ) -> Result<Option<(String, HashMap<BlobHash, String>)>> {
        let (_, v) = self.resolve(r)?;
        if v.origin.is_empty() || v.origin == "cluster" {
            return Ok(None);
        }
        let (from, to) = keys::uid_range(v.uid);
        let mut paths = HashMap::new();
        for kv in self.store.scan(Table::Entries, &from, Some(&to)) {
            let (k, val) = kv?;
            let rec: EntryRecord = decode(Table::Entries, &val)?;
            if rec.kind != KIND_FILE || rec.shard != shard || rec.blob.len() != 32 {
                continue;
            }
            let (dir, name) = super::sessions::split_entry(&k)?;
            let hash = BlobHash(rec.blob[..].try_into().expect("32 bytes"));
            paths.entry(hash).or_insert_with(|| keys::join(dir, name));
        }
        Ok(Some((v.origin, paths)))
    }

    /// Shards with fewer live replicas than their version's replication factor (replicas
    /// on down or draining nodes do not count), each with a source and a new target.
    /// Shards with no live replica at all are reported in the second list; while a backup
    /// is recorded or the version has an origin they are also planned, without a source:
    /// the target copies each blob back from the backup, else from the origin.
    /// Up to `limit` repairs to make now, the shards no live node holds (with what
    /// happens to them), and how many shards have fewer live replicas than their version
    /// asks for (all of them, not only the `limit` planned).
    pub fn repair_plan(&self, limit: usize) -> Result<(Vec<RepairTask>, Vec<String>, u64)> {
        let nodes = self.list_nodes()?;
        let serving: HashMap<&str, &pb::Node> = nodes
            .iter()
            .filter(|n| n.state == pb::NodeState::Up as i32)
            .map(|n| (n.id.as_str(), n))
            .collect();
        let mut cands: Vec<placement::Candidate> = self.candidates()?.into_iter().map(|(c, _)| c).collect();
        let cand_of = |n: &pb::Node| placement::Candidate {
            id: n.id.clone(),
            host: n.labels.get("host").cloned().unwrap_or_else(|| n.id.clone()),
            rack: n.labels.get("rack").cloned().unwrap_or_default(),
            free: 0,
        };
        let mut tasks = Vec::new();
        let mut lost = Vec::new();
        let mut under = 0u64;
        let have_backup = !self.backup_sources()?.is_empty();
        let versions: Vec<(String, u64, VersionRecord)> = self
            .store
            .scan(Table::Versions, b"", None)
            .map(|kv| {
                let (k, v) = kv?;
                let name = String::from_utf8_lossy(&k[..k.len().saturating_sub(9)]).into_owned();
                let n = keys::version_number(&k).unwrap_or(0);
                Ok((name, n, decode::<VersionRecord>(Table::Versions, &v)?))
            })
            .collect::<Result<_>>()?;
        for (name, n, v) in versions {
            let (from, to) = keys::uid_range(v.uid);
            for kv in self.store.scan(Table::Shards, &from, Some(&to)) {
                let (k, val) = kv?;
                let shard = keys::shard_id(&k).unwrap_or(0);
                let rec: ShardRecord = decode(Table::Shards, &val)?;
                if rec.replicas.is_empty() {
                    continue; // an origin-only version: nothing to keep replicated
                }
                let counting: Vec<&pb::Node> = rec
                    .replicas
                    .iter()
                    .filter_map(|r| serving.get(r.as_str()).copied())
                    .filter(|n| !n.draining)
                    .collect();
                let drop: Vec<String> = rec
                    .replicas
                    .iter()
                    .filter(|r| !counting.iter().any(|c| &c.id == *r))
                    .cloned()
                    .collect();
                if counting.len() >= v.replication as usize {
                    continue;
                }
                under += 1;
                if tasks.len() >= limit {
                    // Counted; planned on a later pass.
                    continue;
                }
                // A draining node that is still up can be the source.
                let source = counting
                    .first()
                    .copied()
                    .or_else(|| rec.replicas.iter().find_map(|r| serving.get(r.as_str()).copied()));
                if source.is_none() {
                    let has_origin = !v.origin.is_empty() && v.origin != "cluster";
                    if !have_backup && !has_origin {
                        lost.push(format!(
                            "{name}@{n} shard {shard}: no live replica, no backup and no origin"
                        ));
                        continue;
                    }
                    lost.push(format!(
                        "{name}@{n} shard {shard}: no live replica; copying it back from {}",
                        match (have_backup, has_origin) {
                            (true, true) => "the backup or the origin",
                            (true, false) => "the backup",
                            _ => "the origin",
                        }
                    ));
                }
                let req = placement::Request {
                    shard,
                    bytes: rec.bytes,
                    replicas: counting.len() + 1,
                    existing: rec
                        .replicas
                        .iter()
                        .filter_map(|r| serving.get(r.as_str()).copied())
                        .map(cand_of)
                        .collect(),
                    prefer: Vec::new(),
                };
                // existing includes live draining replicas (so they are not chosen again);
                // ask for one more replica than currently counts.
                let req = placement::Request {
                    replicas: req.existing.len() + 1,
                    ..req
                };
                if let Some((_, placement::Outcome::Placed(t))) =
                    placement::place(&[req], &mut cands).into_iter().next()
                {
                    let target = &t[0];
                    tasks.push(RepairTask {
                        dataset: name.clone(),
                        version: n,
                        shard,
                        bytes: rec.bytes,
                        source: source.map(|s| (s.id.clone(), s.address.clone())),
                        target: (target.clone(), serving[target.as_str()].address.clone()),
                        drop: if counting.len() + 1 >= v.replication as usize {
                            drop
                        } else {
                            Vec::new()
                        },
                    });
                }
            }
        }
        Ok((tasks, lost, under))
    }
}
