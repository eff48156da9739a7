//! The mount's lease with the metadata service: "this host serves DATASET@N at this
//! mount point" (`locus_metadata::mounts`). Said at start, renewed while the mount lives,
//! withdrawn when it ends, so `dataset rm` can refuse to pull a version from under its
//! readers and the audit log knows who mounted what, where and until when.
//!
//! A lease is advice, never a condition of serving: a service that does not answer
//! costs a warning, and the mount goes on.

use std::time::{Duration, Instant};

use locus_proto::client::MetadataClient;
use locus_proto::pb;

/// The most a lease call may hold up the mount's loop.
const ANSWER: Duration = Duration::from_secs(5);

pub struct Lease {
    client: MetadataClient,
    req: pb::MountLeaseRequest,
    renew: Duration,
    last: Option<Instant>,
    warned: bool,
}

impl Lease {
    pub fn new(
        client: MetadataClient,
        dataset: &str,
        version: u64,
        host: &str,
        mountpoint: &std::path::Path,
    ) -> Self {
        Self {
            client,
            req: pb::MountLeaseRequest {
                r#ref: Some(pb::VersionRef {
                    dataset: dataset.to_string(),
                    version,
                }),
                host: host.to_string(),
                mountpoint: mountpoint.display().to_string(),
                ended: false,
            },
            // Until the service's first answer says otherwise.
            renew: locus_metadata::mounts::RENEW,
            last: None,
            warned: false,
        }
    }

    /// Takes or renews the lease when it is due.
    pub async fn tick(&mut self) {
        if self.last.is_some_and(|t| t.elapsed() < self.renew) {
            return;
        }
        self.last = Some(Instant::now());
        match self.call(false).await {
            Ok(a) => {
                if a.renew_ms > 0 {
                    self.renew = Duration::from_millis(a.renew_ms);
                }
                if self.warned {
                    tracing::info!("the metadata service has the mount's lease again");
                    self.warned = false;
                }
            }
            Err(e) if !self.warned => {
                self.warned = true;
                tracing::warn!(
                    "cannot renew the mount's lease (the mount goes on; `dataset rm` will not see it): {e}"
                );
            }
            Err(_) => {}
        }
    }

    /// Withdraws the lease: the mount has ended.
    pub async fn end(mut self) {
        if let Err(e) = self.call(true).await {
            tracing::warn!("cannot withdraw the mount's lease (it lapses by itself): {e}");
        }
    }

    async fn call(&mut self, ended: bool) -> Result<pb::MountLeaseResponse, String> {
        let req = pb::MountLeaseRequest {
            ended,
            ..self.req.clone()
        };
        match tokio::time::timeout(ANSWER, self.client.mount_lease(req)).await {
            Ok(Ok(a)) => Ok(a.into_inner()),
            Ok(Err(s)) => Err(s.message().to_string()),
            Err(_) => Err(format!("no answer in {}s", ANSWER.as_secs())),
        }
    }
}
