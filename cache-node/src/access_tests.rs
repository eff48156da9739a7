//! Every call of the node's API has an access rule, and every operation a grant names
//! opens only calls that exist: a call added to node.proto without a rule would be refused
//! to everyone, and a rule naming a call that does not exist would hide a typo.

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
