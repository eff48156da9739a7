//! What the operator's long commands do, as library code: the binary's `src/cmd/` parses
//! arguments, calls these with plain option structs and prints what they return, so a
//! daemon, a test or another command (restore imports a version read back from a backup)
//! can run the same work.
//!
//! Nothing here prints or exits: progress goes to an [`Observer`], results and typed
//! errors to the caller.

pub mod admission;
pub mod backup;
pub mod cluster;
pub mod csi;
pub mod doctor;
pub mod import;
pub mod kube;
pub mod remote;
pub mod restore;
pub mod scan;
pub mod seal;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Sees long work progress, one phase at a time ("hashing", "uploading").
pub trait Observer: Send + Sync {
    /// A phase starts with `total` bytes to do (0 when not known yet); the returned
    /// counter is advanced as bytes are done.
    fn start(&self, phase: &'static str, total: u64) -> Arc<AtomicU64>;
    /// The phase ended, done or not.
    fn end(&self, phase: &'static str);
    /// Something went wrong that the work went around (a node's bad copy, another
    /// replica asked); the operator should hear of it.
    fn warn(&self, message: &str) {
        tracing::warn!("{message}");
    }
}

/// An observer that shows nothing.
#[derive(Debug, Default)]
pub struct Quiet;

impl Observer for Quiet {
    fn start(&self, _phase: &'static str, _total: u64) -> Arc<AtomicU64> {
        Arc::default()
    }
    fn end(&self, _phase: &'static str) {}
}

/// Reading or hashing a source (a directory, an object-store prefix) failed: the
/// sentence says what and where.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SourceError(pub String);

/// `context: cause` for results and options, like a context chain, into a
/// [`SourceError`].
pub(crate) trait Explain<T> {
    fn explain(self, what: impl FnOnce() -> String) -> Result<T, SourceError>;
}

impl<T, E: std::fmt::Display> Explain<T> for Result<T, E> {
    fn explain(self, what: impl FnOnce() -> String) -> Result<T, SourceError> {
        self.map_err(|e| SourceError(format!("{}: {e}", what())))
    }
}

impl<T> Explain<T> for Option<T> {
    fn explain(self, what: impl FnOnce() -> String) -> Result<T, SourceError> {
        self.ok_or_else(|| SourceError(what()))
    }
}

/// A metadata-service error as an operator reads it: what kind of refusal, then the
/// service's own sentence.
pub fn status_sentence(s: &tonic::Status) -> String {
    use tonic::Code::*;
    let what = match s.code() {
        Unauthenticated => "not authenticated",
        PermissionDenied => "permission denied",
        NotFound => "not found",
        InvalidArgument => "invalid request",
        FailedPrecondition => "refused",
        Unavailable => "metadata service unavailable",
        DeadlineExceeded => "timed out",
        _ => "metadata service error",
    };
    // Under TLS 1.3 a server that demands a client certificate refuses one only after the
    // client thinks the handshake is done: the call then just fails ("operation was
    // canceled"), which says nothing about why.
    let tls = locus_proto::tls::client();
    let no_cert = tls.identity.is_none()
        && tls.ca_pem.is_some()
        && matches!(s.code(), Cancelled | Unknown | Unavailable)
        && ["cancel", "certificate", "transport error"]
            .iter()
            .any(|w| s.message().contains(w));
    if no_cert {
        return format!(
            "{what}: {} (if the server demands a client certificate, give --client-cert and --client-key)",
            s.message()
        );
    }
    format!("{what}: {}", s.message())
}
