//! Who may call what on the metadata service: the policy table the shared auth layer
//! (`locus_proto::auth`) enforces on every call, and the metrics it reports to.
//!
//! A method missing from the table is refused.

use std::sync::Arc;
use std::time::Duration;

pub use locus_proto::auth::{allows, Access, Action, AuthLayer, Principal, Role, TokenFileError, TokenSet};

use crate::metrics::Metrics;

const SERVICE_PREFIX: &str = "/locus.metadata.v1.Metadata/";

/// The policy: every method of the Metadata service and the access it needs.
pub fn required_access(method: &str) -> Option<Access> {
    Some(match method {
        "GetClusterInfo" => Access::Any,
        // The handler checks the role the operation needs.
        "IssueGrant" => Access::Read,
        "RegisterNode" | "Heartbeat" | "BlobsInVersions" => Access::Node,
        "ListNodes" | "ListDatasets" | "GetDataset" | "GetVersion" | "ListEntries" | "ListShards"
        | "LocateBlobs" | "Locality" | "Assign" | "ListBackups" | "MountLease" => Access::Read,
        "DeleteVersion" | "DeleteDataset" | "BeginVersion" | "PutEntries" | "PutShards" | "CommitVersion"
        | "AbortVersion" | "SealVersion" | "PlaceShards" | "DrainNode" | "RemoveNode" | "Warm" | "ExportCatalog" | "RecordBackup"
        // Only the service's own repair changes replicas in normal operation; a node token
        // must not be able to rewrite where other nodes' data is.
        | "UpdateReplicas" | "ChangeMembers" | "GrantKeys" => Access::Admin,
        "ListNodeBlobs" => Access::NodeOrAdmin,
        _ => return None,
    })
}

/// The metadata service's policy, reporting to its metrics and audit log.
pub struct MetadataPolicy(pub Arc<Metrics>, pub Arc<crate::audit::AuditLog>);

impl locus_proto::auth::Policy for MetadataPolicy {
    fn prefix(&self) -> &'static str {
        SERVICE_PREFIX
    }
    fn access(&self, method: &str) -> Option<Access> {
        required_access(method)
    }
    fn refused(&self, r: &locus_proto::auth::Refused<'_>) {
        self.0.auth_failure(r.reason);
        self.1.refused(r);
    }
    fn done(&self, method: &str, code: tonic::Code, took: Duration) {
        self.0.rpc_done(method, code, took);
    }
}

/// The auth layer for the metadata service.
pub fn layer(
    tokens: Option<Arc<TokenSet>>,
    metrics: Arc<Metrics>,
    audit: Arc<crate::audit::AuditLog>,
) -> AuthLayer {
    AuthLayer::new(tokens, Arc::new(MetadataPolicy(metrics, audit)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use locus_proto::auth::{check, rpcs_of};

    const PROTO: &str = include_str!("../../proto/proto/locus/metadata/v1/metadata.proto");

    /// A call added to the proto without a policy line is refused to everyone; this
    /// catches it before a user does, and pins who may call the group's raft port.
    #[test]
    fn every_rpc_in_the_proto_files_has_an_access_rule() {
        let api = rpcs_of(PROTO, "Metadata");
        assert!(api.len() > 25, "{api:?}");
        for m in &api {
            assert!(required_access(m).is_some(), "Metadata/{m} has no access rule");
        }
        use locus_proto::auth::Policy;
        let raft = rpcs_of(PROTO, "Raft");
        assert!(raft.len() >= 5, "{raft:?}");
        for m in &raft {
            assert!(
                crate::group::RaftPolicy.access(m).is_some(),
                "Raft/{m} has no access rule"
            );
        }
    }

    /// A member token opens the raft port and nothing of the API; no other role opens
    /// the raft port.
    #[test]
    fn member_tokens_are_for_the_raft_port_only() {
        use locus_proto::auth::{allows, Policy};
        for m in rpcs_of(PROTO, "Metadata") {
            let a = required_access(&m).unwrap();
            assert!(!allows(Role::Member, a), "a member token opens Metadata/{m}");
        }
        for m in ["Append", "Vote", "InstallSnapshot", "Liveness"] {
            let a = crate::group::RaftPolicy.access(m).unwrap();
            assert!(allows(Role::Member, a), "{m}");
            for r in [Role::Admin, Role::Node, Role::Reader, Role::Grant] {
                assert!(!allows(r, a), "role {r:?} opens Raft/{m}");
            }
        }
    }

    fn set() -> TokenSet {
        TokenSet::from_pairs([
            ("ops".into(), "admin-secret-0123456789".into(), Role::Admin),
            ("gpu1".into(), "node-secret-0123456789".into(), Role::Node),
            ("job".into(), "reader-secret-0123456789".into(), Role::Reader),
        ])
    }

    fn call(method: &str, token: Option<&str>) -> Result<Principal, tonic::Code> {
        let auth = token.map(|t| format!("Bearer {t}"));
        check(
            Some(&set()),
            method,
            required_access(method),
            auth.as_deref().map(str::as_bytes),
            None,
        )
        .map_err(|(s, _)| s.code())
    }

    #[test]
    fn roles() {
        let admin = Some("admin-secret-0123456789");
        let node = Some("node-secret-0123456789");
        let reader = Some("reader-secret-0123456789");
        assert_eq!(call("CommitVersion", admin).unwrap().name, "ops");
        assert_eq!(
            call("CommitVersion", node).unwrap_err(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            call("CommitVersion", reader).unwrap_err(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            call("Heartbeat", admin).unwrap_err(),
            tonic::Code::PermissionDenied
        );
        assert!(call("Heartbeat", node).is_ok());
        assert!(call("ListEntries", reader).is_ok());
        assert_eq!(
            call("UpdateReplicas", node).unwrap_err(),
            tonic::Code::PermissionDenied
        );
        assert!(call("UpdateReplicas", admin).is_ok());
        assert!(call("ListNodeBlobs", node).is_ok());
        assert_eq!(
            call("UpdateReplicas", reader).unwrap_err(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            call("ListEntries", None).unwrap_err(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            call("ListEntries", Some("nope")).unwrap_err(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            call("NoSuchCall", admin).unwrap_err(),
            tonic::Code::PermissionDenied
        );
    }
}
