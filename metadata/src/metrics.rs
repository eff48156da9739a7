//! The metadata service's metrics catalogue, served at `/metrics` in Prometheus text.
//!
//! | name | type | unit | meaning |
//! |---|---|---|---|
//! | locus_metadata_rpc_requests_total | counter | calls | gRPC calls by method and status code |
//! | locus_metadata_rpc_duration_seconds | histogram | seconds | gRPC call latency by method |
//! | locus_metadata_auth_failures_total | counter | calls | refused calls by reason |
//! | locus_metadata_versions_committed_total | counter | versions | versions committed |
//! | locus_metadata_entries_received_total | counter | entries | manifest entries uploaded |
//! | locus_metadata_sessions_reaped_total | counter | sessions | idle import sessions discarded |
//! | locus_metadata_nodes | gauge | nodes | registered nodes by state (up, down) |
//! | locus_metadata_open_sessions | gauge | sessions | import sessions not yet committed |
//! | locus_metadata_store_bytes | gauge | bytes | size of the RocksDB directory |
//! | locus_metadata_repairs_total | counter | shards | shard repairs by result (ok, failed) |
//! | locus_metadata_repair_bytes_total | counter | bytes | bytes of shards re-replicated |
//! | locus_metadata_shards_without_replica | gauge | shards | shards with no live replica |

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

type HistogramFamily = Family<MethodLabel, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    rpc_requests: Family<RpcLabels, Counter>,
    rpc_seconds: HistogramFamily,
    auth_failures: Family<ReasonLabel, Counter>,
    pub versions_committed: Counter,
    pub entries_received: Counter,
    pub sessions_reaped: Counter,
    pub nodes: Family<StateLabel, Gauge>,
    pub open_sessions: Gauge,
    pub store_bytes: Gauge,
    pub repairs: Family<ReasonLabel, Counter>,
    pub repair_bytes: Counter,
    pub shards_lost: Gauge,
    pub last_backup: Gauge,
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~3 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("locus_metadata");
        let rpc_requests = Family::<RpcLabels, Counter>::default();
        let rpc_seconds: HistogramFamily = Family::new_with_constructor(latency_histogram);
        let auth_failures = Family::<ReasonLabel, Counter>::default();
        let versions_committed = Counter::default();
        let entries_received = Counter::default();
        let sessions_reaped = Counter::default();
        let nodes = Family::<StateLabel, Gauge>::default();
        let open_sessions = Gauge::default();
        let store_bytes = Gauge::default();
        let repairs = Family::<ReasonLabel, Counter>::default();
        let repair_bytes = Counter::default();
        let shards_lost = Gauge::default();
        let last_backup = Gauge::default();
        registry.register(
            "rpc_requests",
            "gRPC calls by method and status code",
            rpc_requests.clone(),
        );
        registry.register(
            "rpc_duration_seconds",
            "gRPC call latency by method",
            rpc_seconds.clone(),
        );
        registry.register("auth_failures", "Refused calls by reason", auth_failures.clone());
        registry.register(
            "versions_committed",
            "Versions committed",
            versions_committed.clone(),
        );
        registry.register(
            "entries_received",
            "Manifest entries uploaded",
            entries_received.clone(),
        );
        registry.register(
            "sessions_reaped",
            "Idle import sessions discarded",
            sessions_reaped.clone(),
        );
        registry.register("nodes", "Registered nodes by state", nodes.clone());
        registry.register(
            "open_sessions",
            "Import sessions not yet committed",
            open_sessions.clone(),
        );
        registry.register(
            "last_backup_timestamp_seconds",
            "When the last backup was committed (Unix time; 0 = never): alert when it grows old",
            last_backup.clone(),
        );
        registry.register(
            "store_bytes",
            "Size of the metadata store on disk",
            store_bytes.clone(),
        );
        Self {
            registry,
            rpc_requests,
            rpc_seconds,
            auth_failures,
            versions_committed,
            entries_received,
            sessions_reaped,
            nodes,
            open_sessions,
            store_bytes,
            repairs,
            repair_bytes,
            shards_lost,
            last_backup,
        }
    }
}

impl Metrics {
    pub fn rpc_done(&self, method: &str, code: tonic::Code, took: Duration) {
        self.rpc_requests
            .get_or_create(&RpcLabels {
                method: method.to_string(),
                code: format!("{code:?}"),
            })
            .inc();
        self.rpc_seconds
            .get_or_create(&MethodLabel {
                method: method.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn auth_failure(&self, reason: &str) {
        self.auth_failures
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
