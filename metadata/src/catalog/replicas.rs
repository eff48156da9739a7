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
        self.delete_shard_blobs(b, v.uid)?;
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
        let key = keys::shard(v.uid, shard);
        let mut s: ShardRecord = match self.store.get(Table::Shards, &key)? {
            Some(b) => decode(Table::Shards, &b)?,
            None => {
                return Err(CatalogError::NotFound(format!(
                    "{}@{n} has no shard {shard}",
                    r.name
                )))
            }
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
                b.delete(Table::NodeShards, keys::node_shard(node.as_str(), v.uid, shard));
                *delta.entry(node.as_str()).or_default() -= i128::from(s.bytes);
            }
        }
        for node in add {
            if !s.replicas.iter().any(|x| x == node.as_str()) {
                s.replicas.push(node.to_string());
                b.put(
                    Table::NodeShards,
                    keys::node_shard(node.as_str(), v.uid, shard),
                    Vec::new(),
                );
                *delta.entry(node.as_str()).or_default() += i128::from(s.bytes);
            }
        }
        if s.replicas.is_empty() && delta.values().any(|d| *d < 0) {
            return Err(CatalogError::Precondition(format!(
                "{}@{n} shard {shard}: that would remove its last replica; add another first",
                r.name
            )));
        }
        for (node, d) in delta {
            if d == 0 {
                continue;
            }
            let rk = keys::resident(v.uid, node);
            let cur = self
                .store
                .get(Table::Resident, &rk)?
                .and_then(|x| keys::u64_value(&x))
                .unwrap_or(0);
            let new = (i128::from(cur) + d).max(0) as u64;
            if new == 0 {
                b.delete(Table::Resident, rk);
            } else {
                b.put(Table::Resident, rk, new.to_be_bytes().to_vec());
            }
        }
        b.put(Table::Shards, key, s.encode_to_vec());
        self.store.write(b, true)?;
        self.replicas_changed();
        Ok(s.replicas)
    }
}
