//! Why a node did not do what an import or a backup asked of it, sorted by whose fault
//! it is (see `NodeError`).

/// Why a node did not take, copy or upload blobs, sorted by whose fault it is, so the
/// import or backup says what to do about it (and the tests can tell the causes apart).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// The import's own input: a source file unreadable, or changed since it was hashed.
    /// No node is at fault.
    #[error("{0}")]
    Source(String),
    /// Not reachable, silent past the peer timeout, or failing inside.
    #[error("{0}")]
    Unreachable(String),
    /// No grant for the node (the metadata service refused this client one), or the node
    /// refused the grant presented.
    #[error("{0}")]
    Grant(String),
    /// The node has no room for it.
    #[error("{0}")]
    Full(String),
    /// The node received bytes that are not the blob's and kept nothing.
    #[error("{0}")]
    Rejected(String),
    /// This cluster's nodes cannot do that at all.
    #[error("{0}")]
    Unsupported(String),
}

impl NodeError {
    /// The same cause with its message rewritten.
    pub fn map(self, f: impl FnOnce(String) -> String) -> Self {
        use NodeError::*;
        match self {
            Source(m) => Source(f(m)),
            Unreachable(m) => Unreachable(f(m)),
            Grant(m) => Grant(f(m)),
            Full(m) => Full(f(m)),
            Rejected(m) => Rejected(f(m)),
            Unsupported(m) => Unsupported(f(m)),
        }
    }

    /// A node's gRPC answer, sorted; the message names the node.
    pub fn from_status(node: &str, s: &tonic::Status) -> Self {
        use tonic::Code;
        let m = format!("node {node}: {}", s.message());
        match s.code() {
            Code::ResourceExhausted => NodeError::Full(m),
            Code::Unauthenticated | Code::PermissionDenied => NodeError::Grant(m),
            Code::InvalidArgument | Code::DataLoss => NodeError::Rejected(m),
            Code::Unimplemented => NodeError::Unsupported(m),
            _ => NodeError::Unreachable(m),
        }
    }

    /// What the operator can do about it, in a sentence.
    pub fn advice(&self) -> &'static str {
        match self {
            NodeError::Source(_) => "the source changed or could not be read while it was imported; rerun once it is stable",
            NodeError::Unreachable(_) => "check that the node is up and reachable (`locus status`); LOCUS_PEER_TIMEOUT sets how long a silent node is waited for",
            NodeError::Grant(_) => "the node or the metadata service refused this client's credentials: importing needs an admin token, and the node must trust the service's grant key",
            NodeError::Full(_) => "a node is out of room: free space on it, add nodes, or import with fewer --replicas",
            NodeError::Rejected(_) => "the node received bytes that are not the file's: the source changed while it was imported, or the network corrupted them",
            NodeError::Unsupported(_) => "this cluster's nodes are too old for this; upgrade them",
        }
    }
}
