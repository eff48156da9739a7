//! Nodes: registration, heartbeats (liveness and the figures nodes report), drain, listing.

use super::*;

impl Catalog {
    /// Records a node's registration. A node id belongs to one process identity at a
    /// time: another identity is refused (`Taken`) while the holder is up, and takes the
    /// id over once it is down (a data dir replaced, a node reinstalled). Returns the
    /// identity it replaced, if any.
    pub fn register_node(&self, reg: NodeRegistration) -> Result<Option<String>> {
        let now = self.clock.now_ms();
        let key = reg.id.as_str().as_bytes();
        let mut replaced = None;
        let (registered_at_ms, draining) = match self.store.get(Table::Nodes, key)? {
            Some(v) => {
                let old = decode::<NodeRecord>(Table::Nodes, &v)?;
                if !old.instance.is_empty() && old.instance != reg.instance {
                    let timeout = self.config.liveness_timeout.as_millis() as i64;
                    let seen = lock(&self.live)
                        .get(reg.id.as_str())
                        .map_or(self.started_ms, |l| l.last_seen_ms);
                    let ago = (now - seen).max(0);
                    if ago <= timeout {
                        return Err(CatalogError::Taken(format!(
                            "node id {id} is held by another running process (at {addr}, last heard {ago} ms \
                             ago): two nodes were started with the same id — the default is the host \
                             name, so give each node its own --id — or this node's data dir was \
                             replaced while the old process still runs. Stop the other process, or \
                             wait until it is declared down ({timeout} ms after it was last heard), \
                             and this node takes the id over",
                            id = reg.id,
                            addr = old.address,
                        )));
                    }
                    replaced = Some(old.instance.clone());
                }
                (old.registered_at_ms, old.draining)
            }
            None => (now, false),
        };
        let rec = NodeRecord {
            address: reg.address,
            labels: reg.labels,
            capacity_bytes: reg.capacity,
            free_bytes: reg.free.min(reg.capacity),
            used_bytes: reg.used,
            registered_at_ms,
            draining,
            instance: reg.instance.clone(),
        };
        let mut b = Batch::default();
        b.put(Table::Nodes, key, rec.encode_to_vec());
        self.store.write(b, true)?;
        // After the write: a reader that loaded before it holds the old generation.
        self.node_gen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut live = lock(&self.live);
        let l = live.entry(reg.id.to_string()).or_default();
        l.last_seen_ms = now;
        l.heard = true;
        l.stats.free = reg.free.min(reg.capacity);
        l.stats.used = reg.used;
        Ok(replaced)
    }

    /// A node stopping cleanly gives its id up: the next registration, whatever its
    /// identity, is accepted. Only the holder can (another identity changes nothing).
    pub fn release_node(&self, id: &NodeId, instance: &str) -> Result<()> {
        let key = id.as_str().as_bytes();
        let Some(v) = self.store.get(Table::Nodes, key)? else {
            return Ok(());
        };
        let mut rec = decode::<NodeRecord>(Table::Nodes, &v)?;
        if rec.instance.is_empty() || rec.instance != instance {
            return Ok(());
        }
        rec.instance.clear();
        let mut b = Batch::default();
        b.put(Table::Nodes, key, rec.encode_to_vec());
        self.store.write(b, true)?;
        self.node_gen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// `instance`: the heartbeating process's identity. It must be the one that registered:
    /// a heartbeat without it is refused for a node registered with one (only nodes that
    /// predate identities registered without), so a token alone cannot keep a dead node
    /// "up" and hold off its repair. Reported free bytes never exceed the registered
    /// capacity: a node cannot draw every shard's replicas by claiming endless room.
    pub fn heartbeat(&self, id: &NodeId, instance: &str, st: NodeStats) -> Result<()> {
        let mut st = st;
        let Some(v) = self.store.get(Table::Nodes, id.as_str().as_bytes())? else {
            return Err(CatalogError::NotFound(format!(
                "node {id} is not registered; register before sending heartbeats"
            )));
        };
        let rec = decode::<NodeRecord>(Table::Nodes, &v)?;
        if !rec.instance.is_empty() && instance.is_empty() {
            return Err(CatalogError::Invalid(locus_proto::InvalidInput::new(
                "instance",
                format!("node {id} registered with an identity; its heartbeats must carry it"),
            )));
        }
        if !rec.instance.is_empty() && rec.instance != instance {
            return Err(CatalogError::Precondition(format!(
                "node id {id} was taken over by another process (now at {}) after this one was \
                 declared down; this process must stop",
                rec.address
            )));
        }
        st.free = st.free.min(rec.capacity_bytes);
        lock(&self.live).insert(
            id.to_string(),
            Live {
                last_seen_ms: self.clock.now_ms(),
                stats: st,
                heard: true,
            },
        );
        Ok(())
    }

    /// Marks a node draining (or not). Returns how many shards it still holds.
    pub fn drain_node(&self, id: &NodeId, drain: bool) -> Result<u64> {
        let key = id.as_str().as_bytes();
        let mut rec: NodeRecord = match self.store.get(Table::Nodes, key)? {
            Some(v) => decode(Table::Nodes, &v)?,
            None => return Err(CatalogError::NotFound(format!("node {id} is not registered"))),
        };
        rec.draining = drain;
        let mut b = Batch::default();
        b.put(Table::Nodes, key, rec.encode_to_vec());
        self.store.write(b, true)?;
        // After the write: a reader that loaded before it holds the old generation.
        self.node_gen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.node_shard_count(id.as_str())
    }

    pub(super) fn node_shard_count(&self, id: &str) -> Result<u64> {
        let mut prefix = id.as_bytes().to_vec();
        prefix.push(0);
        let end = crate::store::prefix_end(&prefix);
        let mut n = 0;
        for kv in self.store.scan(Table::NodeShards, &prefix, end.as_deref()) {
            kv?;
            n += 1;
        }
        Ok(n)
    }

    pub(super) fn node_records(&self) -> Result<NodeRecords> {
        Ok(self.node_view()?.records.clone())
    }

    pub(super) fn node_view(&self) -> Result<Arc<NodeView>> {
        let gen = self.node_gen.load(std::sync::atomic::Ordering::SeqCst) + self.store.outside_writes();
        if let Some((g, v)) = lock(&self.node_cache).as_ref() {
            if *g == gen {
                return Ok(v.clone());
            }
        }
        let mut out = Vec::new();
        for kv in self.store.scan(Table::Nodes, b"", None) {
            let (k, v) = kv?;
            let id = String::from_utf8(k.to_vec()).map_err(|_| CatalogError::Corrupt {
                table: "nodes",
                reason: "node id is not UTF-8".into(),
            })?;
            out.push((id, decode(Table::Nodes, &v)?));
        }
        let view = Arc::new(NodeView {
            records: Arc::new(out),
            topo: Default::default(),
        });
        *lock(&self.node_cache) = Some((gen, view.clone()));
        Ok(view)
    }

    /// What was last heard from each of `records`' nodes, in their order, copied under one
    /// short lock (not the whole map: at 10,000 nodes a copy of it cost milliseconds).
    /// A node not heard from since this process started counts as seen at its start.
    fn live_of(&self, records: &[(String, NodeRecord)]) -> Vec<Live> {
        let live = lock(&self.live);
        records
            .iter()
            .map(|(id, rec)| {
                live.get(id).copied().unwrap_or(Live {
                    heard: false,
                    last_seen_ms: self.started_ms,
                    stats: NodeStats {
                        free: rec.free_bytes,
                        used: rec.used_bytes,
                        ..Default::default()
                    },
                })
            })
            .collect()
    }

    /// Whether each of `view`'s nodes is up now (heard from within the liveness timeout).
    pub(super) fn up_of(&self, view: &NodeView) -> Vec<bool> {
        let now = self.clock.now_ms();
        let timeout = self.config.liveness_timeout.as_millis() as i64;
        self.live_of(view.records())
            .iter()
            .map(|l| now - l.last_seen_ms <= timeout)
            .collect()
    }

    pub(super) fn node_exists(&self, id: &NodeId) -> Result<bool> {
        Ok(self.store.get(Table::Nodes, id.as_str().as_bytes())?.is_some())
    }

    pub fn list_nodes(&self) -> Result<Vec<pb::Node>> {
        self.notice_pause(false);
        let now = self.clock.now_ms();
        let timeout = self.config.liveness_timeout.as_millis() as i64;
        let records = self.node_records()?;
        let live = self.live_of(&records);
        Ok(records
            .iter()
            .zip(live)
            .map(|((id, rec), l)| {
                let st = l.stats;
                let ago = (now - l.last_seen_ms).max(0);
                let state = if ago <= timeout {
                    pb::NodeState::Up
                } else {
                    pb::NodeState::Down
                };
                pb::Node {
                    id: id.clone(),
                    address: rec.address.clone(),
                    labels: rec.labels.clone(),
                    capacity_bytes: rec.capacity_bytes,
                    free_bytes: st.free,
                    used_bytes: st.used,
                    state: state as i32,
                    last_seen_ms_ago: ago as u64,
                    registered_at_ms: rec.registered_at_ms,
                    pinned_bytes: st.pinned,
                    cached_bytes: st.cached,
                    blobs: st.blobs,
                    draining: rec.draining,
                    quarantined: st.quarantined,
                    refill_blobs: st.refill_blobs,
                    refill_bytes: st.refill_bytes,
                    refill_rate: st.refill_rate,
                    refill_failing: st.refill_failing,
                    unheard: !l.heard && state == pb::NodeState::Up,
                }
            })
            .collect())
    }
}
