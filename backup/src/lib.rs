//! Backups of a Locus cluster in object storage, in the layout every role shares:
//! the CLI writes snapshots, lists, verifies, collects garbage and restores; cache nodes
//! upload the blobs they are first replica for and read blobs back when a cluster is
//! refilled; the mount reads ranges of blobs no node holds. `origin` opens a version's
//! origin (where it was imported from), the last source of the mount and the nodes.
//!
//! Layout under the target URL (format version 1, see docs/architecture.md "Backups"):
//!
//! ```text
//! blobs/<h[0..2]>/<hash>          one object per blob, named by its BLAKE3 hash
//! snapshots/<id>/manifest.json    what the snapshot holds (written before any blob)
//! snapshots/<id>/blobs            every blob the snapshot needs (hash, size), sorted
//! snapshots/<id>/catalog          the metadata export (locus-metadata's catalog format)
//! snapshots/<id>/SIGNATURE        the operator's Ed25519 signature of the manifest (`sign`)
//! snapshots/<id>/COMMITTED        the run's report; written last, makes the snapshot valid
//! gc/STATE                        the last garbage collection (id, running/done)
//! ```

pub mod blob;
pub mod format;
pub mod gc;
pub mod origin;
pub mod retention;
pub mod sign;
pub mod target;
pub mod url;

pub use format::{BlobList, Committed, GcState, SnapshotInfo, SnapshotManifest, SnapshotState};
pub use target::Target;

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{0}")]
    Target(String),
    #[error("{what}: {source}")]
    Store {
        what: String,
        #[source]
        source: object_store::Error,
    },
    #[error("{0}")]
    Corrupt(String),
    #[error("{0}")]
    Invalid(String),
}

impl BackupError {
    pub fn store(what: impl Into<String>, source: object_store::Error) -> Self {
        BackupError::Store {
            what: what.into(),
            source,
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            BackupError::Store {
                source: object_store::Error::NotFound { .. },
                ..
            }
        )
    }
}

pub type Result<T, E = BackupError> = std::result::Result<T, E>;
