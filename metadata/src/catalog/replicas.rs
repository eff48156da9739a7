//! Deleting versions and datasets, and changing a shard's replica set (with its resident counters).

use super::*;

impl Catalog {
    pub(super) fn delete_version_into(
        &self,
        b: &mut Batch,
        name: &str,
        n: u64,
        v: &VersionRecord,
    ) -> Result<()> {
        let (from, to) = keys::uid_range(v.uid);
        for kv in self.store.scan(Table::Shards, &from, Some(&to)) {
            let (k, val) = kv?;
            let s: ShardRecord = decode(Table::Shards, &val)?;
            let id = keys::shard_id(&k).unwrap_or(0);
            for node in &s.replicas {
                b.delete(Table::NodeShards, keys::node_shard(node, v.uid, id));
            }
        }
        self.delete_shard_blobs(b, v.uid);
        b.delete_range(Table::Entries, from.clone(), to.clone());
        b.delete_range(Table::Shards, from.clone(), to.clone());
        b.delete_range(Table::Resident, from, to);
        b.delete(Table::Versions, keys::version(name, n));
        Ok(())
    }

    pub fn delete_version(&self, name: &DatasetName, number: u64) -> Result<()> {
        let _v = lock(&self.versions_lock);
        let r = DatasetRef {
            name: name.clone(),
            version: VersionSel::Number(number),
        };
        let (n, v) = self.resolve(&r)?;
        let mut b = Batch::default();
        self.delete_version_into(&mut b, name.as_str(), n, &v)?;
        let mut ds = self
            .dataset_record(name.as_str())?
            .expect("resolve found the dataset under the same lock");
        ds.latest = self
            .versions_of(name.as_str())?
            .iter()
            .map(|(m, _)| *m)
            .filter(|m| *m != n)
            .max()
            .unwrap_or(0);
        b.put(Table::Datasets, name.as_str().as_bytes(), ds.encode_to_vec());
        self.store.write(b, true)?;
        Ok(())
    }

    pub fn delete_dataset(&self, name: &DatasetName) -> Result<u64> {
        let _v = lock(&self.versions_lock);
        let mut ds = self
            .dataset_record(name.as_str())?
            .filter(|d| !d.deleted)
            .ok_or_else(|| CatalogError::NotFound(format!("no dataset named {name}")))?;
        let versions = self.versions_of(name.as_str())?;
        let mut b = Batch::default();
        for (n, v) in &versions {
            self.delete_version_into(&mut b, name.as_str(), *n, v)?;
        }
        ds.deleted = true;
        ds.latest = 0;
        b.put(Table::Datasets, name.as_str().as_bytes(), ds.encode_to_vec());
        self.store.write(b, true)?;
        Ok(versions.len() as u64)
    }

    /// Adds and removes replica nodes of one shard. Adding a node that already holds the
    /// shard, or removing one that does not, changes nothing (repair may retry). A change
    /// that would leave a shard with no replica is refused.
    pub fn update_replicas(
        &self,
        r: &DatasetRef,
        shard: u32,
        add: &[NodeId],
        remove: &[NodeId],
    ) -> Result<Vec<String>> {
        let _v = lock(&self.versions_lock);
        let (n, v) = self.resolve(r)?;
        self.change_replicas(v.uid, &format!("{}@{n}", r.name), shard, add, remove)
    }

    /// `update_replicas` of the version stored under `uid` (`label` names it in errors);
    /// the caller holds `versions_lock`.
    fn change_replicas(
        &self,
        uid: u64,
        label: &str,
        shard: u32,
        add: &[NodeId],
        remove: &[NodeId],
    ) -> Result<Vec<String>> {
        let key = keys::shard(uid, shard);
        let mut s: ShardRecord = match self.store.get(Table::Shards, &key)? {
            Some(b) => decode(Table::Shards, &b)?,
            None => return Err(CatalogError::NotFound(format!("{label} has no shard {shard}"))),
        };
        for node in add {
            if !self.node_exists(node)? {
                return Err(InvalidInput::new("add", format!("node {node} is not registered")).into());
            }
        }
        let mut b = Batch::default();
        let mut delta: BTreeMap<&str, i128> = BTreeMap::new();
        for node in remove {
            if let Some(pos) = s.replicas.iter().position(|x| x == node.as_str()) {
                s.replicas.remove(pos);
                b.delete(Table::NodeShards, keys::node_shard(node.as_str(), uid, shard));
                *delta.entry(node.as_str()).or_default() -= i128::from(s.bytes);
            }
        }
        for node in add {
            if !s.replicas.iter().any(|x| x == node.as_str()) {
                s.replicas.push(node.to_string());
                b.put(
                    Table::NodeShards,
                    keys::node_shard(node.as_str(), uid, shard),
                    Vec::new(),
                );
                *delta.entry(node.as_str()).or_default() += i128::from(s.bytes);
            }
        }
        if s.replicas.is_empty() && delta.values().any(|d| *d < 0) {
            return Err(CatalogError::Precondition(format!(
                "{label} shard {shard}: that would remove its last replica; add another first"
            )));
        }
        for (node, d) in delta {
            if d == 0 {
                continue;
            }
            let rk = keys::resident(uid, node);
            let cur = self
                .store
                .get(Table::Resident, &rk)?
                .and_then(|x| keys::u64_value(&x))
                .unwrap_or(0);
            let new = (i128::from(cur) + d).max(0) as u64;
            if new == 0 {
                b.delete(Table::Resident, rk);
            } else {
                b.put(Table::Resident, rk, new.to_be_bytes());
            }
        }
        b.put(Table::Shards, key, s.encode_to_vec());
        self.store.write(b, true)?;
        self.replicas_changed();
        Ok(s.replicas)
    }

    /// Forgets a node that is gone for good (`locus node rm`): it is dropped from every
    /// shard it is a replica of, then its registration is deleted. Refused while it is up
    /// (stop it first), and while it holds the last replica of any shard (nothing else
    /// has those bytes: bring it back, or let repair copy them from a backup or origin
    /// first) — in which case nothing is changed. Returns the shards it was dropped from.
    pub fn remove_node(&self, id: &NodeId) -> Result<u64> {
        let _v = lock(&self.versions_lock);
        if !self.node_exists(id)? {
            return Err(CatalogError::NotFound(format!("node {id} is not registered")));
        }
        if let Some(n) = self.list_nodes()?.into_iter().find(|n| n.id == id.as_str()) {
            if n.state == pb::NodeState::Up as i32 {
                return Err(CatalogError::Precondition(format!(
                    "node {id} is up (heard {:.1}s ago): stop it first (`locus node drain {id}` \
                     moves its replicas away while it runs)",
                    n.last_seen_ms_ago as f64 / 1000.0
                )));
            }
        }
        let mut prefix = id.as_str().as_bytes().to_vec();
        prefix.push(0);
        let end = crate::store::prefix_end(&prefix);
        let mut held = Vec::new();
        for kv in self.store.scan(Table::NodeShards, &prefix, end.as_deref()) {
            let (k, _) = kv?;
            let rest = &k[prefix.len()..];
            let (Some(uid), Some(shard)) = (
                rest.get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_be_bytes),
                rest.get(8..12)
                    .and_then(|b| b.try_into().ok())
                    .map(u32::from_be_bytes),
            ) else {
                return Err(CatalogError::Corrupt {
                    table: "node_shards",
                    reason: "malformed key".into(),
                });
            };
            held.push((uid, shard));
        }
        let mut last = Vec::new();
        for (uid, shard) in &held {
            let rec: ShardRecord = match self.store.get(Table::Shards, &keys::shard(*uid, *shard))? {
                Some(b) => decode(Table::Shards, &b)?,
                None => continue,
            };
            if rec.replicas.iter().all(|r| r == id.as_str()) {
                last.push(format!("{} (shard {shard})", self.uid_label(*uid)?));
            }
        }
        if !last.is_empty() {
            let more = if last.len() > 5 {
                format!(" and {} more", last.len() - 5)
            } else {
                String::new()
            };
            last.truncate(5);
            return Err(CatalogError::Precondition(format!(
                "node {id} holds the last replica of {}{more}; nothing was changed. Bring the \
                 node back, or wait for repair to copy those shards from a backup or the origin",
                last.join(", ")
            )));
        }
        for (uid, shard) in &held {
            let label = self.uid_label(*uid)?;
            self.change_replicas(*uid, &label, *shard, &[], std::slice::from_ref(id))?;
        }
        let mut b = Batch::default();
        b.delete(Table::Nodes, id.as_str().as_bytes());
        self.store.write(b, true)?;
        lock(&self.live).remove(id.as_str());
        self.node_gen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(held.len() as u64)
    }

    /// `dataset@N` of the version stored under `uid`, for messages (`uid N` if none).
    fn uid_label(&self, uid: u64) -> Result<String> {
        for kv in self.store.scan(Table::Versions, b"", None) {
            let (k, v) = kv?;
            let rec: VersionRecord = decode(Table::Versions, &v)?;
            if rec.uid == uid {
                if let Some((name, n)) = keys::split_version(&k) {
                    return Ok(format!("{name}@{n}"));
                }
            }
        }
        Ok(format!("uid {uid}"))
    }
}
