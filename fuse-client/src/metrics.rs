//! The mount's metrics, served in Prometheus text when `--metrics-addr` is given and
//! summarised in the mount's status file for `locus status`.
//!
//! | name | type | unit | meaning |
//! |---|---|---|---|
//! | locus_mount_opens_total | counter | opens | file opens by how they are served (passthrough, local, remote, empty) |
//! | locus_mount_reads_total | counter | calls | read calls that reached the mount (passthrough reads never do) |
//! | locus_mount_read_bytes_total | counter | bytes | bytes by source: local (pread of the node's file), remote (fetched from replicas), origin (from a backup or the version's import source, verified), cache (bytes returned from chunks already in memory or already on their way) |
//! | locus_mount_read_errors_total | counter | calls | reads answered with EIO |
//! | locus_mount_source_failures_total | counter | attempts | remote reads that failed and moved on to another replica |
//! | locus_mount_corrupt_chunks_total | counter | chunks | chunks (or ranges of them) whose bytes did not match their hash (never returned) |
//! | locus_mount_range_reads_total | counter | fetches | remote fetches of a random reader's verification groups with their proof, instead of whole chunks |
//! | locus_mount_readahead_skipped_total | counter | times | read-ahead not started because the shared read-ahead budget was in use |
//! | locus_mount_listed_entries_total | counter | entries | entries of READDIRPLUS answers by what they carry (`attributes`: the kernel makes an inode for each; `names`: name and type only) |
//! | locus_mount_lookups_total | counter | calls | LOOKUPs answered (a stat or open of a path the kernel had no entry for) |
//! | locus_mount_ring_reads_total | counter | calls | reads of the node's files submitted on the io_uring queue the request came in on (the rest of the local reads go through the page cache or the blocking pool) |
//! | locus_mount_read_aheads_total | counter | reads | small files read ahead at their LOOKUP under FUSE over io_uring, by outcome (`started`; `taken` by their READ; `dropped` untaken: a walk that only stats files, which turns reading ahead off) |
//! | locus_mount_read_seconds | histogram | seconds | latency of read calls served by the mount |
//! | locus_mount_fetch_seconds | histogram | seconds | latency of remote chunk fetches |

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct How {
    pub how: &'static str,
}

pub struct Metrics {
    registry: Registry,
    opens: Family<How, Counter>,
    reads: Counter,
    read_bytes: Family<How, Counter>,
    read_errors: Counter,
    source_failures: Counter,
    corrupt: Counter,
    readahead_skipped: Counter,
    range_reads: Counter,
    listed: Family<With, Counter>,
    lookups: Counter,
    ring_reads: Counter,
    /// Synced from `fuser::prefetch::counts` when encoded (under `sync`).
    read_aheads: Family<Outcome, Counter>,
    sync: std::sync::Mutex<()>,
    read_seconds: Histogram,
    fetch_seconds: Histogram,
    // Plain totals for the status file (prometheus-client cannot be read back cheaply).
    totals: [AtomicU64; 15],
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct With {
    pub with: &'static str,
}

/// Indexes into `totals`.
const OPEN_PASSTHROUGH: usize = 0;
const OPEN_LOCAL: usize = 1;
const OPEN_REMOTE: usize = 2;
const BYTES_LOCAL: usize = 3;
const BYTES_REMOTE: usize = 4;
const BYTES_CACHE: usize = 5;
const ERRORS: usize = 6;
const READS: usize = 7;
const FAILOVERS: usize = 8;
const BYTES_ORIGIN: usize = 9;
const CORRUPT: usize = 10;
const LISTED_ATTRIBUTES: usize = 11;
const LISTED_NAMES: usize = 12;
const LOOKUPS: usize = 13;
const RING_READS: usize = 14;

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("locus_mount");
        let m = Metrics {
            registry: Registry::default(),
            opens: Family::default(),
            reads: Counter::default(),
            read_bytes: Family::default(),
            read_errors: Counter::default(),
            source_failures: Counter::default(),
            corrupt: Counter::default(),
            readahead_skipped: Counter::default(),
            range_reads: Counter::default(),
            listed: Family::default(),
            lookups: Counter::default(),
            ring_reads: Counter::default(),
            read_aheads: Family::default(),
            sync: Default::default(),
            // 10 µs .. ~5 s
            read_seconds: Histogram::new(exponential_buckets(1e-5, 3.0, 12)),
            fetch_seconds: Histogram::new(exponential_buckets(1e-4, 3.0, 11)),
            totals: Default::default(),
        };
        r.register("opens", "File opens by how they are served", m.opens.clone());
        r.register("reads", "Read calls served by the mount", m.reads.clone());
        r.register("read_bytes", "Bytes returned by source", m.read_bytes.clone());
        r.register("read_errors", "Reads answered with EIO", m.read_errors.clone());
        r.register(
            "source_failures",
            "Remote reads that failed over to another replica",
            m.source_failures.clone(),
        );
        r.register(
            "corrupt_chunks",
            "Chunks that did not match their hash",
            m.corrupt.clone(),
        );
        r.register(
            "readahead_skipped",
            "Read-ahead not started because the shared read-ahead budget was in use",
            m.readahead_skipped.clone(),
        );
        r.register(
            "range_reads",
            "Remote fetches of verified ranges instead of whole chunks",
            m.range_reads.clone(),
        );
        r.register(
            "listed_entries",
            "Entries of directory listings by what they carry",
            m.listed.clone(),
        );
        r.register("lookups", "LOOKUPs answered", m.lookups.clone());
        r.register(
            "ring_reads",
            "Reads of the node's files submitted on the io_uring queue the request came in on",
            m.ring_reads.clone(),
        );
        r.register(
            "read_aheads",
            "Small files read ahead at their LOOKUP, by outcome",
            m.read_aheads.clone(),
        );
        r.register("read_seconds", "Latency of read calls", m.read_seconds.clone());
        r.register(
            "fetch_seconds",
            "Latency of remote chunk fetches",
            m.fetch_seconds.clone(),
        );
        Metrics { registry: r, ..m }
    }
}

/// Totals for `locus status`.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Totals {
    pub opens_passthrough: u64,
    pub opens_local: u64,
    pub opens_remote: u64,
    pub bytes_local: u64,
    pub bytes_remote: u64,
    pub bytes_cache: u64,
    pub read_errors: u64,
    pub reads: u64,
    /// Remote reads that failed and were retried on another replica.
    pub failovers: u64,
    /// Verified bytes read from a backup or the version's origin because no node could
    /// serve them.
    pub bytes_origin: u64,
    /// Chunks a source sent whose bytes did not hash right (never returned to a reader).
    #[serde(default)]
    pub corrupt_chunks: u64,
    /// Entries listed with attributes (the kernel made an inode for each) and as names only.
    #[serde(default)]
    pub listed_with_attributes: u64,
    #[serde(default)]
    pub listed_names_only: u64,
    #[serde(default)]
    pub lookups: u64,
    /// Local reads submitted on the io_uring queue their request came in on.
    #[serde(default)]
    pub ring_reads: u64,
    /// Small files read ahead at their LOOKUP (under FUSE over io_uring): started, taken
    /// by their READ, and dropped untaken (`fuser::prefetch`; the process's, whatever
    /// its mounts).
    #[serde(default)]
    pub read_aheads_started: u64,
    #[serde(default)]
    pub read_aheads_taken: u64,
    #[serde(default)]
    pub read_aheads_dropped: u64,
}

impl Metrics {
    fn add(&self, i: usize, n: u64) {
        self.totals[i].fetch_add(n, Ordering::Relaxed);
    }

    pub fn opened(&self, how: &'static str) {
        self.opens.get_or_create(&How { how }).inc();
        let i = match how {
            "passthrough" => OPEN_PASSTHROUGH,
            "local" => OPEN_LOCAL,
            "remote" => OPEN_REMOTE,
            // Empty files: nothing to read from anywhere.
            _ => return,
        };
        self.add(i, 1);
    }

    pub fn read(&self, how: &'static str, bytes: usize, took: Duration) {
        self.reads.inc();
        self.add(READS, 1);
        self.read_seconds.observe(took.as_secs_f64());
        // Remote bytes are counted per chunk as they arrive or hit the cache.
        if how == "local" {
            self.read_bytes.get_or_create(&How { how }).inc_by(bytes as u64);
            self.add(BYTES_LOCAL, bytes as u64);
        }
    }

    pub fn read_error(&self) {
        self.read_errors.inc();
        self.add(ERRORS, 1);
    }

    pub fn remote_read(&self, bytes: usize, took: Duration) {
        self.fetch_seconds.observe(took.as_secs_f64());
        self.read_bytes
            .get_or_create(&How { how: "remote" })
            .inc_by(bytes as u64);
        self.add(BYTES_REMOTE, bytes as u64);
    }

    pub fn origin_read(&self, bytes: usize, took: Duration) {
        self.fetch_seconds.observe(took.as_secs_f64());
        self.read_bytes
            .get_or_create(&How { how: "origin" })
            .inc_by(bytes as u64);
        self.add(BYTES_ORIGIN, bytes as u64);
    }

    pub fn cache_hit(&self, bytes: usize) {
        self.read_bytes
            .get_or_create(&How { how: "cache" })
            .inc_by(bytes as u64);
        self.add(BYTES_CACHE, bytes as u64);
    }

    pub fn source_failure(&self) {
        self.source_failures.inc();
        self.add(FAILOVERS, 1);
    }

    pub fn corrupt(&self) {
        self.corrupt.inc();
        self.add(CORRUPT, 1);
    }

    /// A random reader's read was fetched as a verified range.
    pub fn range_read(&self) {
        self.range_reads.inc();
    }

    pub fn readahead_skipped(&self) {
        self.readahead_skipped.inc();
    }

    /// `n` entries of one READDIRPLUS answer, with attributes or as names only.
    pub fn listed(&self, attributes: bool, n: u64) {
        let (with, i) = if attributes {
            ("attributes", LISTED_ATTRIBUTES)
        } else {
            ("names", LISTED_NAMES)
        };
        self.listed.get_or_create(&With { with }).inc_by(n);
        self.add(i, n);
    }

    /// A local read was submitted on the request's own io_uring queue.
    pub fn ring_read(&self) {
        self.ring_reads.inc();
        self.add(RING_READS, 1);
    }

    pub fn looked_up(&self) {
        self.lookups.inc();
        self.add(LOOKUPS, 1);
    }

    pub fn totals(&self) -> Totals {
        let t = |i: usize| self.totals[i].load(Ordering::Relaxed);
        let (started, taken, dropped) = fuser::prefetch::counts();
        Totals {
            opens_passthrough: t(OPEN_PASSTHROUGH),
            opens_local: t(OPEN_LOCAL),
            opens_remote: t(OPEN_REMOTE),
            bytes_local: t(BYTES_LOCAL),
            bytes_remote: t(BYTES_REMOTE),
            bytes_cache: t(BYTES_CACHE),
            read_errors: t(ERRORS),
            reads: t(READS),
            failovers: t(FAILOVERS),
            bytes_origin: t(BYTES_ORIGIN),
            corrupt_chunks: t(CORRUPT),
            listed_with_attributes: t(LISTED_ATTRIBUTES),
            listed_names_only: t(LISTED_NAMES),
            lookups: t(LOOKUPS),
            ring_reads: t(RING_READS),
            read_aheads_started: started,
            read_aheads_taken: taken,
            read_aheads_dropped: dropped,
        }
    }

    pub fn encode(&self) -> String {
        {
            // The reads ahead are counted by fuser, for the process: brought up to date
            // here, one encoder at a time so that none is added twice.
            let _one = self.sync.lock().unwrap_or_else(|e| e.into_inner());
            let (started, taken, dropped) = fuser::prefetch::counts();
            for (outcome, n) in [("started", started), ("taken", taken), ("dropped", dropped)] {
                let c = self.read_aheads.get_or_create(&Outcome { outcome });
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
