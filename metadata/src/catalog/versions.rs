//! Datasets and versions as readers see them: listings, one version, its manifest and shards.

use super::*;

impl Catalog {
    pub(super) fn dataset_record(&self, name: &str) -> Result<Option<DatasetRecord>> {
        self.store
            .get(Table::Datasets, name.as_bytes())?
            .map(|v| decode(Table::Datasets, &v))
            .transpose()
    }

    pub(super) fn versions_of(&self, name: &str) -> Result<Vec<(u64, VersionRecord)>> {
        let prefix = keys::version_prefix(name);
        let end = crate::store::prefix_end(&prefix);
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Versions, &prefix, end.as_deref()) {
            let (k, v) = kv?;
            let n = keys::version_number(&k).ok_or_else(|| CatalogError::Corrupt {
                table: "versions",
                reason: "short key".into(),
            })?;
            out.push((n, decode(Table::Versions, &v)?));
        }
        Ok(out)
    }

    /// Resolves a reference to a committed version.
    pub(super) fn resolve(&self, r: &DatasetRef) -> Result<(u64, VersionRecord)> {
        let name = r.name.as_str();
        let ds = self
            .dataset_record(name)?
            .filter(|d| !d.deleted)
            .ok_or_else(|| CatalogError::NotFound(format!("no dataset named {name}")))?;
        let n = match r.version {
            VersionSel::Number(n) => n,
            VersionSel::Latest if ds.latest == 0 => {
                return Err(CatalogError::NotFound(format!(
                    "dataset {name} has no committed version"
                )))
            }
            VersionSel::Latest => ds.latest,
        };
        let v = self
            .store
            .get(Table::Versions, &keys::version(name, n))?
            .ok_or_else(|| CatalogError::NotFound(format!("version {name}@{n} does not exist")))?;
        Ok((n, decode(Table::Versions, &v)?))
    }

    pub(super) fn version_pb(name: &str, n: u64, v: &VersionRecord) -> pb::Version {
        pb::Version {
            dataset: name.to_string(),
            version: n,
            created_at_ms: v.created_at_ms,
            origin: v.origin.clone(),
            replication: v.replication,
            chunk_size: v.chunk_size,
            files: v.files,
            dirs: v.dirs,
            symlinks: v.symlinks,
            bytes: v.bytes,
            shards: v.shards,
            committed_by: v.committed_by.clone(),
            resident: Vec::new(),
            namespace_blob: v.namespace_blob.clone(),
            namespace_size: v.namespace_size,
            namespace_inline: Vec::new(),
            namespace_chunks: Vec::new(),
            tree_chunks: v.tree_chunks,
        }
    }

    /// The bytes the committed versions of datasets `covers` accepts pin on nodes: each
    /// shard's bytes times the replicas it has (as imported, plus warm-up copies): a
    /// team's quota usage (`crate::quota`).
    pub fn pinned_by(&self, covers: impl Fn(&str) -> bool) -> Result<u64> {
        let mut uids = Vec::new();
        for kv in self.store.scan(Table::Versions, b"", None) {
            let (k, v) = kv?;
            let Some((dataset, _)) = keys::split_version(&k) else {
                continue;
            };
            if covers(dataset) {
                uids.push(decode::<VersionRecord>(Table::Versions, &v)?.uid);
            }
        }
        let mut total = 0u64;
        for uid in uids {
            let (from, to) = keys::uid_range(uid);
            for kv in self.store.scan(Table::Shards, &from, Some(&to)) {
                let (_, v) = kv?;
                let s: ShardRecord = decode(Table::Shards, &v)?;
                total = total.saturating_add(s.bytes.saturating_mul(s.replicas.len() as u64));
            }
        }
        Ok(total)
    }

    pub fn list_datasets(&self) -> Result<Vec<pb::Dataset>> {
        let mut out = Vec::new();
        let names: Vec<(String, DatasetRecord)> = self
            .store
            .scan(Table::Datasets, b"", None)
            .map(|kv| {
                let (k, v) = kv?;
                Ok((
                    String::from_utf8_lossy(&k).into_owned(),
                    decode::<DatasetRecord>(Table::Datasets, &v)?,
                ))
            })
            .collect::<Result<_>>()?;
        for (name, rec) in names {
            if rec.deleted {
                continue;
            }
            let versions = self.versions_of(&name)?;
            out.push(pb::Dataset {
                name,
                created_at_ms: rec.created_at_ms,
                latest: rec.latest,
                version_count: versions.len() as u64,
                bytes: versions.iter().map(|(_, v)| v.bytes).sum(),
                versions: Vec::new(),
            });
        }
        Ok(out)
    }

    pub fn get_dataset(&self, name: &DatasetName) -> Result<pb::Dataset> {
        let rec = self
            .dataset_record(name.as_str())?
            .filter(|d| !d.deleted)
            .ok_or_else(|| CatalogError::NotFound(format!("no dataset named {name}")))?;
        let versions = self.versions_of(name.as_str())?;
        Ok(pb::Dataset {
            name: name.to_string(),
            created_at_ms: rec.created_at_ms,
            latest: rec.latest,
            version_count: versions.len() as u64,
            bytes: versions.iter().map(|(_, v)| v.bytes).sum(),
            versions: versions
                .iter()
                .map(|(n, v)| Self::version_pb(name.as_str(), *n, v))
                .collect(),
        })
    }

    /// A version's internal uid and its sealed namespace's hash (empty when unsealed):
    /// what a read grant narrowed to it names.
    pub fn version_grant_ids(&self, r: &DatasetRef) -> Result<(u64, Vec<u8>)> {
        let (_, v) = self.resolve(r)?;
        Ok((v.uid, v.namespace_blob))
    }

    pub fn get_version(&self, r: &DatasetRef) -> Result<pb::Version> {
        let (n, v) = self.resolve(r)?;
        let mut out = Self::version_pb(r.name.as_str(), n, &v);
        out.namespace_inline = v.namespace_inline.clone();
        out.namespace_chunks = v.namespace_chunks.clone();
        let (from, to) = keys::uid_range(v.uid);
        for kv in self.store.scan(Table::Resident, &from, Some(&to)) {
            let (k, val) = kv?;
            out.resident.push(pb::NodeResident {
                node: String::from_utf8_lossy(&k[8..]).into_owned(),
                bytes: keys::u64_value(&val).unwrap_or(0),
            });
        }
        Ok(out)
    }

    /// One page of a version's entries. `directory` restricts the listing to one
    /// directory's direct children. The page token is the last key returned.
    pub fn list_entries(
        &self,
        r: &DatasetRef,
        directory: Option<&str>,
        page_token: &[u8],
        limit: usize,
        with_chunks: bool,
    ) -> Result<(u64, Vec<pb::Entry>, Vec<u8>)> {
        let (n, v) = self.resolve(r)?;
        let (prefix, end) = match directory {
            Some(dir) => {
                locus_proto::RelPath::check_dir(dir).map_err(|e| e.within("directory"))?;
                if !dir.is_empty() {
                    let is_dir = self
                        .store
                        .get(Table::Entries, &keys::entry(v.uid, dir))?
                        .map(|b| decode::<EntryRecord>(Table::Entries, &b))
                        .transpose()?
                        .is_some_and(|e| e.kind == KIND_DIR);
                    if !is_dir {
                        return Err(CatalogError::NotFound(format!("{r}: no directory {dir:?}")));
                    }
                }
                let p = keys::dir_prefix(v.uid, dir);
                let e = crate::store::prefix_end(&p).expect("prefix ends in 0x00");
                (p, e)
            }
            None => keys::uid_range(v.uid),
        };
        let start = if page_token.is_empty() {
            prefix.clone()
        } else {
            if !page_token.starts_with(&prefix) || page_token >= end.as_slice() {
                return Err(InvalidInput::new(
                    "page_token",
                    "does not belong to this listing; start again with an empty token",
                )
                .into());
            }
            let mut s = page_token.to_vec();
            s.push(0);
            s
        };
        let mut out = Vec::new();
        let mut last = Vec::new();
        let mut more = false;
        for kv in self.store.scan(Table::Entries, &start, Some(&end)) {
            let (k, val) = kv?;
            if out.len() == limit {
                more = true;
                break;
            }
            let (dir, name) = super::sessions::split_entry(&k)?;
            let rec: EntryRecord = decode(Table::Entries, &val)?;
            out.push(entry_pb(keys::join(dir, name), rec, with_chunks));
            last = k.to_vec();
        }
        Ok((n, out, if more { last } else { Vec::new() }))
    }

    pub fn list_shards(
        &self,
        r: &DatasetRef,
        start: u32,
        limit: usize,
    ) -> Result<(u64, Vec<pb::Shard>, bool)> {
        let (n, v) = self.resolve(r)?;
        let (_, end) = keys::uid_range(v.uid);
        let mut out = Vec::new();
        let mut more = false;
        for kv in self
            .store
            .scan(Table::Shards, &keys::shard(v.uid, start), Some(&end))
        {
            let (k, val) = kv?;
            if out.len() == limit {
                more = true;
                break;
            }
            let rec: ShardRecord = decode(Table::Shards, &val)?;
            out.push(pb::Shard {
                id: keys::shard_id(&k).unwrap_or(0),
                bytes: rec.bytes,
                files: rec.files,
                replicas: rec.replicas,
            });
        }
        Ok((n, out, more))
    }
}
