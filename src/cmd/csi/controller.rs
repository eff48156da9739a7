//! The controller: provisions a volume for a PersistentVolumeClaim of a Locus
//! StorageClass (through the external-provisioner sidecar). A volume is a read-only view
//! of one dataset version, so provisioning allocates nothing: it checks the claim, resolves
//! the version the StorageClass names (`latest` once, here, so a pod restarted next month
//! sees the same bytes) and records it in the volume's id and context. Deleting a volume
//! frees nothing and never touches the dataset.
//!
//! StorageClass parameters: `dataset` (a name, or `name@N`) and optionally `version` (a
//! number or `latest`, the default). The volume id is `name@N:H`, H a hash of the claim's
//! volume name: a retried CreateVolume for one claim gets the same id, two claims of one
//! version get two volumes, and the id alone says what to mount and fits the spec's 128
//! bytes (a dataset name is at most 63). The controller keeps no state, so it cannot
//! tell a retry from a second request with another capacity; it reports capacity 0
//! ("unknown"), which the spec allows and Kubernetes fills from the claim.

use locus::ops::csi as ops_csi;
use locus_proto::csi;
use tonic::{Request, Response, Status};

use super::Res;
use crate::config::Resolved;

pub(super) struct Controller {
    cfg: Resolved,
}

impl Controller {
    pub(super) fn new(cfg: &Resolved) -> Controller {
        Controller { cfg: cfg.clone() }
    }
}

#[tonic::async_trait]
impl csi::controller_server::Controller for Controller {
    async fn create_volume(&self, req: Request<csi::CreateVolumeRequest>) -> Res<csi::CreateVolumeResponse> {
        let q = req.into_inner();
        if q.name.is_empty() {
            return Err(Status::invalid_argument("name is required"));
        }
        if q.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        if let Some(why) = q.volume_capabilities.iter().find_map(ops_csi::refusal) {
            return Err(Status::invalid_argument(why));
        }
        if q.volume_content_source.is_some() {
            return Err(Status::invalid_argument(
                "a Locus volume cannot be made from a snapshot or another volume; name a dataset version",
            ));
        }
        if !q.mutable_parameters.is_empty() {
            return Err(Status::invalid_argument(
                "Locus volumes take no mutable parameters",
            ));
        }
        if let Some(c) = &q.capacity_range {
            if c.required_bytes < 0
                || c.limit_bytes < 0
                || (c.limit_bytes > 0 && c.limit_bytes < c.required_bytes)
            {
                return Err(Status::invalid_argument(format!(
                    "capacity range {}..{} is not a range",
                    c.required_bytes, c.limit_bytes
                )));
            }
        }
        let r = ops_csi::dataset_of(&q.parameters)?;
        let version = super::resolve(&self.cfg, &r)
            .await
            .map_err(|s| Status::new(s.code(), format!("StorageClass dataset {r}: {}", s.message())))?;
        let id = ops_csi::volume_id(&version, &q.name);
        tracing::info!(name = %q.name, volume = %id, "volume provisioned");
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                capacity_bytes: 0,
                volume_id: id,
                volume_context: [("dataset".to_string(), version)].into(),
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(&self, req: Request<csi::DeleteVolumeRequest>) -> Res<csi::DeleteVolumeResponse> {
        let q = req.into_inner();
        if q.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        // Nothing was allocated, and the dataset is not the volume's to delete: every id,
        // known or not, is deleted by doing nothing (the call must be idempotent).
        tracing::info!(volume = %q.volume_id, "volume deleted (its dataset is untouched)");
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Res<csi::ValidateVolumeCapabilitiesResponse> {
        let q = req.into_inner();
        if q.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if q.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        let not_found = || Status::not_found(format!("no volume {:?}", q.volume_id));
        let r = ops_csi::version_of(&q.volume_id).ok_or_else(not_found)?;
        match super::resolve(&self.cfg, &r).await {
            Ok(_) => {}
            Err(s) if s.code() == tonic::Code::NotFound => return Err(not_found()),
            Err(s) => return Err(s),
        }
        if let Some(why) = q.volume_capabilities.iter().find_map(ops_csi::refusal) {
            return Ok(Response::new(csi::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why,
            }));
        }
        Ok(Response::new(csi::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                volume_context: q.volume_context,
                volume_capabilities: q.volume_capabilities,
                parameters: q.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Res<csi::ControllerGetCapabilitiesResponse> {
        use csi::controller_service_capability::{rpc::Type, Rpc, Type as Cap};
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: vec![csi::ControllerServiceCapability {
                r#type: Some(Cap::Rpc(Rpc {
                    r#type: Type::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }
}
