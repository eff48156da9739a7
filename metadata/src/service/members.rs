//! `ChangeMembers`: adding, promoting and removing members of a replicated metadata group
//! (`crate::group`), for the admin; a single service refuses it.

use locus_proto::pb;
use locus_proto::pb::metadata_server::Metadata;
use tonic::{Request, Response, Status};

use super::{principal, MetadataService};

impl MetadataService {
    /// `ChangeMembers`: a membership change of the replicated group, audited.
    pub(super) async fn members(
        &self,
        req: Request<pb::ChangeMembersRequest>,
    ) -> Result<Response<pb::ClusterInfo>, Status> {
        let p = principal(&req)?;
        let Some(group) = self.group.clone() else {
            return Err(Status::failed_precondition(
                "this metadata service is not a replicated group: start its members with --id and \
                 --cluster to make one",
            ));
        };
        let r = req.into_inner();
        let target = format!("{} {}", r.op, r.names.join(","));
        let result = group.change_members(r).await;
        self.audit.record(
            &p,
            "change-members",
            &target,
            result
                .as_ref()
                .map(|_| "committed".to_string())
                .map_err(|s| s.message().to_string()),
        );
        result?;
        let mut info = Request::new(pb::GetClusterInfoRequest {});
        info.extensions_mut().insert(p);
        self.get_cluster_info(info).await
    }
}
