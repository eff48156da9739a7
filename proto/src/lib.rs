//! The wire contract of Locus and the domain types every crate speaks.
//!
//! `pb` is the generated gRPC code. The domain types (`names`, `manifest`, `size`) are what
//! the rest of the code works with: a message from the wire becomes a domain type through a
//! `TryFrom` conversion that validates it once, so code past the boundary never re-checks a
//! name, path or hash. `client` is the typed client every tool uses to reach the metadata
//! service.
//!
//! This crate must never depend on another Locus crate.

pub mod auth;
pub mod bulk;
pub mod chunks;
pub mod client;
pub mod grant;
pub mod hex;
pub mod human;
pub mod keyfile;
pub mod manifest;
pub mod names;
pub mod net;
pub mod open_socket;
pub mod outboard;
pub mod scope;
pub mod sealed;
pub mod tls;

/// Generated protobuf and gRPC code of the metadata service.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("locus.metadata.v1");
}

/// Generated code of the Kubernetes CSI spec (v1), the part `locus csi` serves.
#[allow(clippy::all, missing_docs)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// Generated protobuf and gRPC code of the cache node.
#[allow(clippy::all, missing_docs)]
pub mod nodepb {
    tonic::include_proto!("locus.node.v1");
}

pub use manifest::{BlobHash, Entry, EntryKind, RelPath};
pub use names::{DatasetName, DatasetRef, NodeId, VersionSel};

/// A value that failed validation at the boundary. The message names the field and says
/// what was wrong, for the person who sent it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidInput {
    pub field: String,
    pub reason: String,
}

impl InvalidInput {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same error, reported under a more specific field name (`entries[3].path`).
    pub fn within(self, outer: impl std::fmt::Display) -> Self {
        Self {
            field: format!("{outer}.{}", self.field),
            reason: self.reason,
        }
    }
}

impl From<InvalidInput> for tonic::Status {
    fn from(e: InvalidInput) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// Default chunk size: the unit of partial caching, transfer and verification.
pub const DEFAULT_CHUNK_SIZE: u32 = 4 * 1024 * 1024;
/// Smallest and largest chunk sizes a version may use.
pub const MIN_CHUNK_SIZE: u32 = 64 * 1024;
pub const MAX_CHUNK_SIZE: u32 = 1024 * 1024 * 1024;
/// Largest gRPC message the metadata service accepts. Manifest pages are sized by clients
/// to stay well under it (see `client::ENTRY_PAGE_BYTES`).
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;
