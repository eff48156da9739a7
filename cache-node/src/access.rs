//! Who may call what on a node: the access table of its TCP API and the policy that
//! checks grants against it.

use std::sync::Arc;

use tonic::Status;

use crate::Peers;

/// Who may call what on the node's TCP API: grants only, each for its operation
/// (`locus_proto::grant::Op::allows`). No token opens a node: node addresses come from
/// registrations, so a token sent to one reaches whoever registered it — a node that
/// collected its peers' tokens could act for every one of them. Importers, backups,
/// mounts, peers and the metadata service's copy orders all present grants. The Unix
/// socket is for same-host clients and is protected by its file permissions instead.
pub fn required_access(method: &str) -> Option<locus_proto::auth::Access> {
    use locus_proto::auth::Access;
    match method {
        "ReadBlob" | "HaveBlobs" | "GetNodeStatus" | "EnsureLocal" | "LocalPaths" | "WriteBlob"
        | "WriteBlobs" | "FetchBlobs" | "FetchChunks" | "UploadBlobs" | "ImportObject" => Some(Access::Grant),
        _ => None,
    }
}

/// The node's policy: the table above for tokens, the grant keys of the cluster (learnt
/// at registration) for grants.
pub(crate) struct NodePolicy(pub(crate) Arc<Peers>);

impl locus_proto::auth::Policy for NodePolicy {
    fn prefix(&self) -> &'static str {
        "/locus.node.v1.Node/"
    }
    fn access(&self, method: &str) -> Option<locus_proto::auth::Access> {
        required_access(method)
    }
    fn grant(
        &self,
        method: &str,
        grant: &[u8],
    ) -> Option<Result<locus_proto::auth::Principal, locus_proto::auth::Refusal>> {
        use locus_proto::auth::{Principal, Role};
        Some(
            match self.0.grants.verify(grant, method, locus_proto::grant::now_ms()) {
                Ok((_, g)) => Ok(Principal {
                    name: format!("grant:{}", g.issued_to),
                    role: Some(Role::Grant),
                    grant: Some(Arc::new(g)),
                    scope: None,
                }),
                Err(e @ locus_proto::grant::GrantError::WrongMethod { .. }) => {
                    Err((Status::permission_denied(e.to_string()), "denied"))
                }
                Err(e) => Err((Status::unauthenticated(e.to_string()), "bad_grant")),
            },
        )
    }
}

// Every call of the node's API has an access rule, and every operation a grant names
// opens only calls that exist: a call added to node.proto without a rule would be refused
// to everyone, and a rule naming a call that does not exist would hide a typo.
#[cfg(test)]
mod tests {
    use locus_proto::auth::rpcs_of;
    use locus_proto::grant::Op;

    const PROTO: &str = include_str!("../../proto/proto/locus/node/v1/node.proto");

    #[test]
    fn every_node_rpc_has_an_access_rule_and_grants_open_only_real_calls() {
        let api = rpcs_of(PROTO, "Node");
        assert!(api.len() >= 11, "{api:?}");
        for m in &api {
            assert!(crate::required_access(m).is_some(), "Node/{m} has no access rule");
        }
        let known = [
            "WriteBlob",
            "WriteBlobs",
            "HaveBlobs",
            "FetchBlobs",
            "ImportObject",
            "GetNodeStatus",
            "UploadBlobs",
            "ReadBlob",
            "FetchChunks",
            "EnsureLocal",
            "LocalPaths",
            "Frobnicate",
        ];
        for op in [Op::Import, Op::Backup, Op::Read] {
            for m in known.iter().filter(|m| op.allows(m)) {
                assert!(
                    api.iter().any(|a| a == m),
                    "{op:?} opens {m}, which node.proto does not have"
                );
            }
        }
        assert!(
            Op::Import.allows("WriteBlobs"),
            "an import grant opens the batch write"
        );
        assert!(!Op::Read.allows("WriteBlobs") && !Op::Backup.allows("WriteBlobs"));
    }
}
