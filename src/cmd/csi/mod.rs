//! `locus csi`: the Kubernetes CSI driver. A pod gets a dataset version as a read-only
//! volume: inline (`csi: {driver: csi.locus.io, volumeAttributes: {dataset:
//! imagenet@3}}`), through a static PersistentVolume with the same attributes, or through
//! a PersistentVolumeClaim of a Locus StorageClass, which the controller provisions.
//!
//! One binary, two roles (`--mode`): the node plugin on every host ([`node`]) mounts
//! versions into pods; the controller ([`controller`]), one per cluster beside the
//! external-provisioner sidecar, turns a claim into a volume that names one version.
//! Neither ever creates, changes or deletes data: a volume is a view of a version.

mod controller;
mod node;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, ValueEnum};
use locus_proto::csi;
use tonic::{Request, Response, Status};

use crate::config::Resolved;

pub use locus::ops::csi::DRIVER;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// The node plugin (a DaemonSet on every host): mounts volumes into pods.
    Node,
    /// The controller (a Deployment with the external-provisioner): provisions volumes
    /// from StorageClass parameters. Needs no node socket and mounts nothing.
    Controller,
    /// Both on one socket (a single-host cluster, or a conformance run).
    All,
}

#[derive(Args, Debug)]
pub struct CsiArgs {
    /// Where to serve CSI (kubelet, the registrar or the provisioner connect here).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// Which CSI services to serve.
    #[arg(long, value_enum, default_value = "node")]
    pub mode: Mode,
    /// This Kubernetes node's name (its cache node's id). Node mode only.
    #[arg(long, env = "NODE_NAME")]
    pub node_id: Option<String>,
    /// This host's cache node socket; the shared mounts read through it. Node mode only.
    #[arg(long, env = "LOCUS_NODE_SOCKET", default_value = "/run/locus/node.sock")]
    pub node_socket: PathBuf,
    /// Where the shared mounts and the record of published volumes live. Node mode only.
    #[arg(long, default_value = "/var/lib/locus-csi")]
    pub state_dir: PathBuf,
    /// Kubelet's root: every target path must be under it. Node mode only.
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub kubelet_dir: PathBuf,
    /// Every volume must come with the pod's own Locus token (a Secret with key `token`,
    /// named by the volume's nodePublishSecretRef, or the StorageClass's
    /// csi.storage.k8s.io/node-publish-secret-name): its dataset is checked against that
    /// token's scope before it is mounted. Without this flag a volume without a secret is
    /// checked against the driver's own token only, so any pod author may mount any
    /// dataset the driver can read. Node mode only.
    #[arg(long, env = "LOCUS_CSI_REQUIRE_POD_TOKEN")]
    pub require_pod_token: bool,
}

pub async fn run(a: CsiArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let path = a.endpoint.strip_prefix("unix://").ok_or_else(|| {
        anyhow::anyhow!("--endpoint must be unix:///PATH (CSI serves only on a Unix socket)")
    })?;
    let serves_node = matches!(a.mode, Mode::Node | Mode::All);
    let serves_controller = matches!(a.mode, Mode::Controller | Mode::All);
    let node = if serves_node {
        Some(Arc::new(node::Plugin::open(&a, cfg)?))
    } else {
        None
    };
    let identity = Identity {
        controller: serves_controller,
    };
    // A socket left by an earlier run is replaced; anything else at the path is not ours.
    {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => anyhow::bail!("--endpoint {path} exists and is not a socket; refusing to replace it"),
            Err(_) => {}
        }
    }
    if let Some(dir) = Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let listener =
        tokio::net::UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot listen on {path}: {e}"))?;
    tracing::info!(endpoint = %a.endpoint, mode = ?a.mode, "CSI driver ready");
    let router = tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(identity))
        .add_optional_service(node.map(csi::node_server::NodeServer::from_arc))
        .add_optional_service(
            serves_controller
                .then(|| csi::controller_server::ControllerServer::new(controller::Controller::new(cfg))),
        );
    router
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            crate::cmd::shutdown_signal(),
        )
        .await?;
    Ok(())
}

type Res<T> = Result<Response<T>, Status>;

struct Identity {
    controller: bool,
}

#[tonic::async_trait]
impl csi::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Res<csi::GetPluginInfoResponse> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Res<csi::GetPluginCapabilitiesResponse> {
        use csi::plugin_capability::{service::Type, Service, Type as Cap};
        // Volumes are reachable from every node (any host reads any version), so no
        // topology constraint is advertised.
        let capabilities = self
            .controller
            .then(|| csi::PluginCapability {
                r#type: Some(Cap::Service(Service {
                    r#type: Type::ControllerService as i32,
                })),
            })
            .into_iter()
            .collect();
        Ok(Response::new(csi::GetPluginCapabilitiesResponse { capabilities }))
    }

    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Res<csi::ProbeResponse> {
        Ok(Response::new(csi::ProbeResponse {
            ready: Some(csi::BoolValue { value: true }),
        }))
    }
}

/// `dataset@version` of what `r` names now (NOT_FOUND when there is no such version,
/// UNAVAILABLE when the metadata service cannot be reached).
/// `resolve` as the pod's own token (a volume's `token` secret), when it has one: a
/// dataset outside that token's scope is refused as the service refuses it (NOT_FOUND,
/// as for a dataset that does not exist).
async fn resolve_as(
    cfg: &Resolved,
    pod_token: Option<&str>,
    r: &locus_proto::DatasetRef,
) -> Result<String, Status> {
    match pod_token {
        None => resolve(cfg, r).await,
        Some(t) => {
            let mut as_pod = cfg.clone();
            as_pod.token = Some(t.to_string());
            resolve(&as_pod, r).await.map_err(|e| {
                Status::new(
                    e.code(),
                    format!(
                        "with the pod's token (its volume's node-publish secret): {}",
                        e.message()
                    ),
                )
            })
        }
    }
}

async fn resolve(cfg: &Resolved, r: &locus_proto::DatasetRef) -> Result<String, Status> {
    let mut c = cfg
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("the metadata service: {e:#}")))?;
    let v = c
        .get_version(locus_proto::pb::GetVersionRequest {
            r#ref: Some(locus_proto::pb::VersionRef::from(r)),
        })
        .await?
        .into_inner();
    Ok(format!("{}@{}", v.dataset, v.version))
}
