//! The cache node's metrics catalogue, served at `/metrics` in Prometheus text.
//!
//! | name | type | unit | meaning |
//! |---|---|---|---|
//! | locus_node_read_bytes_total | counter | bytes | blob bytes served (ReadBlob and the bulk path) |
//! | locus_node_bulk_sent_bytes_total | counter | bytes | of those, bytes sent over the bulk path |
//! | locus_node_bulk_received_bytes_total | counter | bytes | blob bytes received over the bulk path (imports) |
//! | locus_node_bulk_connections | gauge | connections | bulk-path connections open now (a thread each) |
//! | locus_node_opened_blobs_total | counter | blobs | blobs handed out as open descriptors on the open socket |
//! | locus_node_ensure_local_total | counter | calls | blobs a client had this node make present and verified, one per call (`EnsureLocal`: a same-host mount asks it for a file it has no path for) |
//! | locus_node_local_paths_total | counter | calls | lists of verified paths given (`LocalPaths`: a mount asks once per shard and reopen window) |
//! | locus_node_written_bytes_total | counter | bytes | blob bytes stored, verified (WriteBlob, fetches) |
//! | locus_node_blobs_written_total | counter | blobs | blobs stored by how they came (client, peer, backup, origin) |
//! | locus_node_write_refusals_total | counter | calls | writes refused by reason (full, mismatch) |
//! | locus_node_corrupt_total | counter | blobs | blobs that failed verification and were quarantined |
//! | locus_node_capacity_bytes | gauge | bytes | configured capacity |
//! | locus_node_used_bytes | gauge | bytes | bytes of stored blobs |
//! | locus_node_pinned_bytes | gauge | bytes | bytes of blobs this node replicates (never evicted) |
//! | locus_node_blobs | gauge | blobs | stored blobs |
//! | locus_node_team_cached_bytes | gauge | bytes | unpinned bytes cached for each team's readers (`team`) |
//! | locus_node_team_cache_share_bytes | gauge | bytes | each team's share of the cache room now (`team`) |
//! | locus_node_refill_queue_blobs | gauge | blobs | pinned blobs missing here, still to copy |
//! | locus_node_refill_queue_bytes | gauge | bytes | bytes of those blobs |
//! | locus_node_refill_rate_bytes_per_second | gauge | bytes/s | mean copy rate of the current refill |
//! | locus_node_refill_eta_seconds | gauge | s | time to go at that rate (0 when idle or unknown) |
//! | locus_node_refill_failing_blobs | gauge | blobs | blobs waiting for a retry after a failed copy |
//! | locus_node_refill_bytes_total | counter | bytes | bytes the refill copied |
//! | locus_node_scrub_bytes_total | counter | bytes | bytes the scrub re-verified |
//! | locus_node_scrub_passes_total | counter | passes | complete scrub passes over every blob |
//! | locus_node_pin_syncs_total | counter | syncs | pin syncs done (the blobs this node must hold, read from the metadata service) |
//! | locus_node_open_import_pinned_blobs | gauge | blobs | blobs the last pin sync kept pinned for imports still open (no version names them yet) |
//! | locus_node_data_dir_free_bytes | gauge | bytes | free space on each data dir's file system, for anyone (`dir`) |
//! | locus_node_data_dir_size_bytes | gauge | bytes | size of each data dir's file system (`dir`) |
//! | locus_node_tls_cert_expiry_timestamp_seconds | gauge | Unix s | when the serving certificate expires (only with TLS) |

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TeamLabel {
    pub team: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirLabel {
    pub dir: String,
}

pub struct Metrics {
    registry: Registry,
    pub read_bytes: Counter,
    pub bulk_bytes: Counter,
    pub bulk_received: Counter,
    pub bulk_connections: Gauge,
    pub opened_blobs: Counter,
    pub ensure_local: Counter,
    pub local_paths: Counter,
    pub outboards_kept_used: Counter,
    pub outboards_computed: Counter,
    pub written_bytes: Counter,
    pub blobs_written: Family<KindLabel, Counter>,
    pub write_refusals: Family<KindLabel, Counter>,
    pub corrupt: Counter,
    pub backup_bytes: Counter,
    pub capacity: Gauge,
    pub used: Gauge,
    pub pinned: Gauge,
    pub blobs: Gauge,
    pub refill_queue_blobs: Gauge,
    pub refill_queue_bytes: Gauge,
    pub refill_rate: Gauge,
    pub refill_eta: Gauge,
    pub refill_failing: Gauge,
    pub refill_bytes: Counter,
    pub scrub_bytes: Counter,
    pub scrub_passes: Counter,
    pub pin_syncs: Counter,
    pub open_import_pinned: Gauge,
    pub dir_free: Family<DirLabel, Gauge>,
    pub dir_size: Family<DirLabel, Gauge>,
    pub team_cached: Family<TeamLabel, Gauge>,
    pub team_share: Family<TeamLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(None)
    }
}

impl Metrics {
    /// `tls_not_after`: when the serving certificate expires (Unix s), with TLS on; its
    /// gauge exists only then.
    pub fn new(tls_not_after: Option<i64>) -> Self {
        let mut r = Registry::with_prefix("locus_node");
        let m = Metrics {
            registry: Registry::default(),
            read_bytes: Counter::default(),
            bulk_bytes: Counter::default(),
            bulk_received: Counter::default(),
            bulk_connections: Gauge::default(),
            opened_blobs: Counter::default(),
            ensure_local: Counter::default(),
            local_paths: Counter::default(),
            outboards_kept_used: Counter::default(),
            outboards_computed: Counter::default(),
            written_bytes: Counter::default(),
            blobs_written: Family::default(),
            write_refusals: Family::default(),
            corrupt: Counter::default(),
            backup_bytes: Counter::default(),
            capacity: Gauge::default(),
            used: Gauge::default(),
            pinned: Gauge::default(),
            blobs: Gauge::default(),
            refill_queue_blobs: Gauge::default(),
            refill_queue_bytes: Gauge::default(),
            refill_rate: Gauge::default(),
            refill_eta: Gauge::default(),
            refill_failing: Gauge::default(),
            refill_bytes: Counter::default(),
            scrub_bytes: Counter::default(),
            scrub_passes: Counter::default(),
            pin_syncs: Counter::default(),
            open_import_pinned: Gauge::default(),
            dir_free: Family::default(),
            dir_size: Family::default(),
            team_cached: Family::default(),
            team_share: Family::default(),
        };
        r.register("read_bytes", "Blob bytes served", m.read_bytes.clone());
        r.register(
            "bulk_sent_bytes",
            "Blob bytes sent over the bulk path",
            m.bulk_bytes.clone(),
        );
        r.register(
            "bulk_received_bytes",
            "Blob bytes received over the bulk path (imports), before verification",
            m.bulk_received.clone(),
        );
        r.register(
            "range_kept_outboard",
            "Ranges proved from an outboard kept on disk beside the blob",
            m.outboards_kept_used.clone(),
        );
        r.register(
            "range_outboards_computed",
            "Outboards computed by reading a blob or chunk whole, for a range asked of it",
            m.outboards_computed.clone(),
        );
        r.register(
            "bulk_connections",
            "Bulk-path connections open now",
            m.bulk_connections.clone(),
        );
        r.register(
            "opened_blobs",
            "Blobs handed out as open descriptors on the open socket",
            m.opened_blobs.clone(),
        );
        r.register(
            "ensure_local",
            "EnsureLocal calls: blobs made present and verified for a client, one per call",
            m.ensure_local.clone(),
        );
        r.register(
            "local_paths",
            "LocalPaths calls: lists of verified paths given to a same-host mount",
            m.local_paths.clone(),
        );
        r.register(
            "written_bytes",
            "Blob bytes stored, verified",
            m.written_bytes.clone(),
        );
        r.register("blobs_written", "Blobs stored by origin", m.blobs_written.clone());
        r.register(
            "write_refusals",
            "Writes refused by reason",
            m.write_refusals.clone(),
        );
        r.register("corrupt", "Blobs that failed verification", m.corrupt.clone());
        r.register(
            "backup_uploaded_bytes",
            "Blob bytes uploaded to backup targets, verified",
            m.backup_bytes.clone(),
        );
        r.register("capacity_bytes", "Configured capacity", m.capacity.clone());
        r.register("used_bytes", "Bytes of stored blobs", m.used.clone());
        r.register("pinned_bytes", "Bytes of replicated blobs", m.pinned.clone());
        r.register("blobs", "Stored blobs", m.blobs.clone());
        r.register(
            "team_cached_bytes",
            "Unpinned bytes cached for each team's readers",
            m.team_cached.clone(),
        );
        r.register(
            "team_cache_share_bytes",
            "Each team's share of the cache room now",
            m.team_share.clone(),
        );
        r.register(
            "refill_queue_blobs",
            "Pinned blobs missing here, still to copy",
            m.refill_queue_blobs.clone(),
        );
        r.register(
            "refill_queue_bytes",
            "Bytes of pinned blobs missing here",
            m.refill_queue_bytes.clone(),
        );
        r.register(
            "refill_rate_bytes_per_second",
            "Mean copy rate of the current refill",
            m.refill_rate.clone(),
        );
        r.register(
            "refill_eta_seconds",
            "Time the refill needs at its current rate",
            m.refill_eta.clone(),
        );
        r.register(
            "refill_failing_blobs",
            "Blobs waiting for a retry after a failed copy",
            m.refill_failing.clone(),
        );
        r.register("refill_bytes", "Bytes the refill copied", m.refill_bytes.clone());
        r.register(
            "scrub_bytes",
            "Bytes the scrub re-verified",
            m.scrub_bytes.clone(),
        );
        r.register("scrub_passes", "Complete scrub passes", m.scrub_passes.clone());
        r.register("pin_syncs", "Pin syncs done", m.pin_syncs.clone());
        r.register(
            "open_import_pinned_blobs",
            "Blobs the last pin sync kept pinned for imports still open",
            m.open_import_pinned.clone(),
        );
        r.register(
            "data_dir_free_bytes",
            "Free space on each data dir's file system",
            m.dir_free.clone(),
        );
        r.register(
            "data_dir_size_bytes",
            "Size of each data dir's file system",
            m.dir_size.clone(),
        );
        if let Some(t) = tls_not_after {
            let g: Gauge = Gauge::default();
            g.set(t);
            r.register(
                "tls_cert_expiry_timestamp_seconds",
                "When the serving certificate expires (Unix time)",
                g,
            );
        }
        // Known label values start at 0, so each series exists before its first event.
        for kind in ["full", "mismatch"] {
            let _ = m.write_refusals.get_or_create(&KindLabel { kind: kind.into() });
        }
        for kind in ["client", "peer", "origin"] {
            let _ = m.blobs_written.get_or_create(&KindLabel { kind: kind.into() });
        }
        Metrics { registry: r, ..m }
    }

    pub fn wrote(&self, kind: &str, bytes: u64) {
        self.written_bytes.inc_by(bytes);
        self.blobs_written
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    /// `blobs` blobs of `bytes` in all written by one group commit.
    pub fn wrote_many(&self, kind: &str, blobs: u64, bytes: u64) {
        self.written_bytes.inc_by(bytes);
        self.blobs_written
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc_by(blobs);
    }

    /// A blob assembled chunk by chunk became complete (its bytes were counted as they came).
    pub fn completed(&self, kind: &str) {
        self.blobs_written
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    pub fn refill(&self, p: &crate::refill::Progress) {
        self.refill_queue_blobs.set(p.blobs as i64);
        self.refill_queue_bytes.set(p.bytes as i64);
        self.refill_rate.set(p.rate as i64);
        self.refill_eta.set(p.eta_secs().unwrap_or(0) as i64);
        self.refill_failing.set(p.failing as i64);
    }

    pub fn refused(&self, kind: &str) {
        self.write_refusals
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc();
    }

    /// The space on each data dir's file system: (dir, free, size) in bytes.
    pub fn dirs(&self, space: &[(String, u64, u64)]) {
        for (d, free, size) in space {
            let l = DirLabel { dir: d.clone() };
            self.dir_free.get_or_create(&l).set(*free as i64);
            self.dir_size.get_or_create(&l).set(*size as i64);
        }
    }

    /// Each team's cached bytes and share (of `room`: capacity less pinned bytes).
    pub fn teams(&self, teams: &[crate::store::TeamUse], room: u64) {
        for t in teams {
            let l = TeamLabel { team: t.name.clone() };
            self.team_cached.get_or_create(&l).set(t.cached as i64);
            let share = (u128::from(room) * u128::from(t.permille) / 1000) as i64;
            self.team_share.get_or_create(&l).set(share);
        }
    }

    pub fn encode(&self, s: &crate::store::Stats) -> String {
        self.capacity.set(s.capacity as i64);
        self.used.set(s.used as i64);
        self.pinned.set(s.pinned as i64);
        self.blobs.set(s.blobs as i64);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// The refill's progress on the wire.
pub fn refill_status(p: &crate::refill::Progress) -> locus_proto::nodepb::RefillStatus {
    locus_proto::nodepb::RefillStatus {
        blobs: p.blobs,
        bytes: p.bytes,
        done_bytes: p.done_bytes,
        rate: p.rate,
        failing: p.failing,
        copied_blobs: p.copied_blobs,
        copied_bytes: p.copied_bytes,
        failures: p.failures,
    }
}
