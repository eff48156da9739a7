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
//! | locus_metadata_repairs_total | counter | shards | shard repairs by result (`reason`: ok, failed) |
//! | locus_metadata_repair_bytes_total | counter | bytes | bytes of shards re-replicated |
//! | locus_metadata_shards_without_replica | gauge | shards | shards with no live replica |
//! | locus_metadata_shards_under_replicated | gauge | shards | shards with fewer live replicas than their version asks for (as of the last repair pass) |
//! | locus_metadata_last_backup_timestamp_seconds | gauge | Unix s | when the last backup was committed (0 = never) |
//! | locus_metadata_grant_signing_key_created_timestamp_seconds | gauge | Unix s | when the key that signs grants now was made (rotate old ones) |
//! | locus_metadata_tls_cert_expiry_timestamp_seconds | gauge | Unix s | when the serving certificate expires (only with TLS) |
//! | locus_metadata_group_has_leader | gauge | 0/1 | this member knows a leader (only in a group) |
//! | locus_metadata_group_is_leader | gauge | 0/1 | this member is the leader (only in a group) |
//! | locus_metadata_group_applied_index | gauge | entries | the last log entry this member applied (only in a group): members far apart are behind |

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TeamLabel {
    pub team: String,
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
    pub shards_under_replicated: Gauge,
    pub last_backup: Gauge,
    pub signing_key_created: Gauge,
    /// Teams' pinned bytes and quotas (`crate::quota`), set at each scrape.
    pub team_pinned: Family<TeamLabel, Gauge>,
    pub team_pinned_limit: Family<TeamLabel, Gauge>,
    /// Present only in a group.
    pub group: Option<GroupGauges>,
}

/// A group member's view of its group.
#[derive(Default)]
pub struct GroupGauges {
    pub has_leader: Gauge,
    pub is_leader: Gauge,
    pub applied_index: Gauge,
}

/// What decides which metrics a service exports: group metrics only in a group, the
/// certificate's expiry only with TLS (an absent series cannot fire an alert wrongly).
#[derive(Debug, Default, Clone, Copy)]
pub struct MetricsShape {
    pub group: bool,
    /// Unix seconds when the serving certificate expires.
    pub tls_not_after: Option<i64>,
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~3 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(MetricsShape::default())
    }
}

impl Metrics {
    pub fn new(shape: MetricsShape) -> Self {
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
        let shards_under_replicated = Gauge::default();
        let last_backup = Gauge::default();
        let signing_key_created = Gauge::default();
        let team_pinned = Family::<TeamLabel, Gauge>::default();
        let team_pinned_limit = Family::<TeamLabel, Gauge>::default();
        registry.register(
            "team_pinned_bytes",
            "Replicated bytes a team's datasets' committed versions pin ([[metadata_server.team]])",
            team_pinned.clone(),
        );
        registry.register(
            "team_pinned_limit_bytes",
            "A team's quota on pinned bytes",
            team_pinned_limit.clone(),
        );
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
        registry.register("repairs", "Shard repairs by result", repairs.clone());
        registry.register(
            "repair_bytes",
            "Bytes of shards re-replicated",
            repair_bytes.clone(),
        );
        registry.register(
            "shards_without_replica",
            "Shards with no live replica",
            shards_lost.clone(),
        );
        registry.register(
            "shards_under_replicated",
            "Shards with fewer live replicas than their version asks for (last repair pass)",
            shards_under_replicated.clone(),
        );
        registry.register(
            "grant_signing_key_created_timestamp_seconds",
            "When the key that signs grants now was made (Unix time)",
            signing_key_created.clone(),
        );
        if let Some(t) = shape.tls_not_after {
            let g: Gauge = Gauge::default();
            g.set(t);
            registry.register(
                "tls_cert_expiry_timestamp_seconds",
                "When the serving certificate expires (Unix time)",
                g,
            );
        }
        // Known label values start at 0, so each series exists from the start: a rule's
        // increase() sees the first failed repair, and dashboards show a flat line rather
        // than nothing.
        for reason in ["ok", "failed"] {
            let _ = repairs.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        for reason in ["missing_token", "bad_token", "denied", "unknown_method"] {
            let _ = auth_failures.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        let group = shape.group.then(|| {
            let g = GroupGauges::default();
            registry.register(
                "group_has_leader",
                "1 when this member knows the group's leader",
                g.has_leader.clone(),
            );
            registry.register(
                "group_is_leader",
                "1 when this member is the leader",
                g.is_leader.clone(),
            );
            registry.register(
                "group_applied_index",
                "The last log entry this member applied",
                g.applied_index.clone(),
            );
            g
        });
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
            team_pinned,
            team_pinned_limit,
            repairs,
            repair_bytes,
            shards_lost,
            shards_under_replicated,
            last_backup,
            signing_key_created,
            group,
        }
    }

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
