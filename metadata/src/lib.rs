//! The Locus metadata service: the one stateful coordinator of a cluster.
//!
//! It records nodes and their liveness, datasets and their immutable versions (manifests,
//! shards, replicas, per-node resident bytes) in RocksDB, and serves them over gRPC with
//! bearer-token roles, an audit log and Prometheus metrics.
//!
//! Layers, outermost first: `server` (listeners, TLS, HTTP, shutdown) → `auth` (who may
//! call what) → `service` (gRPC handlers: wire ↔ domain, errors → `Status`) → `catalog`
//! (the rules) → `store` (ordered key-value tables). Only `store` knows about RocksDB.

pub mod assign;
pub mod audit;
pub mod auth;
pub mod catalog;
pub mod grant_keys;
pub mod group;
pub mod http_api;
pub mod k8s;
pub mod keys;
pub mod locality;
pub mod metrics;
pub mod mounts;
pub mod overview;
pub mod placement;
pub mod quota;
pub mod records;
pub mod repair;
pub mod rows;
pub mod server;
pub mod service;
pub mod snapshot;
pub mod store;

pub use catalog::{Catalog, CatalogConfig, CatalogError, NodeStats, RepairTask};
pub use server::{serve, ServerConfig, ServerError};

/// Wall-clock time in milliseconds since the Unix epoch, from a source tests can control.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> i64;
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told to; for tests.
#[derive(Debug, Default)]
pub struct ManualClock(pub std::sync::atomic::AtomicI64);

impl ManualClock {
    pub fn advance_ms(&self, ms: i64) {
        self.0.fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}
