//! `MountLease` and the deletes that consult it: a version that mounts serve is not
//! deleted unless the caller forces it (`crate::mounts`).

use std::time::Instant;

use locus_proto::{pb, DatasetName};
use tonic::Status;

use super::{to_status, MetadataService};
use crate::auth::Principal;
use crate::mounts::{busy_message, Lease, RENEW};

impl MetadataService {
    pub(super) async fn lease(
        &self,
        p: Principal,
        q: pb::MountLeaseRequest,
    ) -> Result<pb::MountLeaseResponse, Status> {
        let r = q
            .r#ref
            .ok_or_else(|| Status::invalid_argument("ref: which version the mount serves is missing"))?;
        let name = DatasetName::try_from(r.dataset)?;
        if r.version == 0 {
            return Err(Status::invalid_argument(
                "ref.version: a mount serves one numbered version",
            ));
        }
        if q.host.is_empty() || q.mountpoint.is_empty() {
            return Err(Status::invalid_argument(
                "host and mountpoint name the lease; both are needed",
            ));
        }
        let target = format!("{name}@{}", r.version);
        let place = format!("{}:{}", q.host, q.mountpoint);
        if q.ended {
            if self.mounts.end(name.as_str(), r.version, &q.host, &q.mountpoint) {
                self.audit.mount(&p, "mount.end", &target, place);
            }
        } else {
            let lease = Lease {
                host: q.host,
                mountpoint: q.mountpoint,
                who: p.name.clone(),
            };
            if self.mounts.renew(name.as_str(), r.version, lease, Instant::now()) {
                self.audit.mount(&p, "mount.start", &target, place);
            }
        }
        Ok(pb::MountLeaseResponse {
            renew_ms: RENEW.as_millis() as u64,
        })
    }

    /// How many live mounts serve what a delete of `name` (one version, or all) would
    /// remove, and the refusal when there are some and the caller did not force it.
    fn unmounted(
        &self,
        name: &DatasetName,
        version: Option<u64>,
        target: &str,
        force: bool,
    ) -> (usize, Result<(), crate::CatalogError>) {
        let live = self.mounts.live(name.as_str(), version, Instant::now());
        let r = if live.is_empty() || force {
            Ok(())
        } else {
            Err(crate::CatalogError::Precondition(busy_message(
                target,
                &live,
                name.as_str(),
            )))
        };
        (live.len(), r)
    }

    pub(super) async fn remove_version(
        &self,
        p: Principal,
        q: pb::DeleteVersionRequest,
    ) -> Result<(), Status> {
        let name = DatasetName::try_from(q.dataset)?;
        if q.version == 0 {
            return Err(Status::invalid_argument(
                "version: name the version to delete explicitly; 0 (latest) is not accepted",
            ));
        }
        let target = format!("{name}@{}", q.version);
        let (mounts, free) = self.unmounted(&name, Some(q.version), &target, q.force);
        let r = match free {
            Ok(()) => self.run(move |c| c.delete_version(&name, q.version)).await,
            Err(e) => Err(e),
        };
        self.audit(&p, "version.delete", &target, &r, |_| match mounts {
            0 => "deleted".into(),
            n => format!("deleted, forced past {n} mounts"),
        });
        r.map_err(to_status)?;
        tracing::info!(%target, who = %p.name, "version deleted");
        Ok(())
    }

    pub(super) async fn remove_dataset(
        &self,
        p: Principal,
        q: pb::DeleteDatasetRequest,
    ) -> Result<u64, Status> {
        let name = DatasetName::try_from(q.name)?;
        let target = name.to_string();
        let (_, free) = self.unmounted(&name, None, &target, q.force);
        let r = match free {
            Ok(()) => self.run(move |c| c.delete_dataset(&name)).await,
            Err(e) => Err(e),
        };
        self.audit(&p, "dataset.delete", &target, &r, |n| {
            format!("{n} versions deleted")
        });
        let versions_deleted = r.map_err(to_status)?;
        tracing::info!(dataset = %target, who = %p.name, versions_deleted, "dataset deleted");
        Ok(versions_deleted)
    }
}
