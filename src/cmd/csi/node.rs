//! The node plugin: pods on one host reading one version share one mount, hence one
//! page cache. The plugin keeps a single `locus mount` per version under
//! `--state-dir/mounts/` (through this host's cache node) and bind-mounts it into each
//! pod's target path, counting the targets; the last unpublish unmounts it. The shared
//! mounts are separate processes, so a restart of the plugin leaves every pod's volume in
//! place, and the record of which target uses which version is a file (`volumes.json`,
//! rewritten atomically) that a restarted plugin reads back.
//!
//! Nothing is attached or staged (the CSIDriver object says `attachRequired: false`).
//! Any access mode is accepted here, writer modes included (kubelet asks for
//! SINGLE_NODE_WRITER for inline volumes): the volume is read-only whatever is asked.
//!
//! Locking: one publish of version A never waits for a mount of version B. A target path
//! and a version each have their own lock (held across the slow steps for that target or
//! that version's shared mount); the record of published targets has a short one, held
//! only to read or change it. Every file-system and mount(2) call runs off the async
//! workers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use locus::ops::csi as ops_csi;
use locus_proto::csi;
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use super::{CsiArgs, Res};
use crate::config::Resolved;

/// What is published: target path → (volume id, the version it shows).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Published {
    targets: BTreeMap<String, Target>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Target {
    volume_id: String,
    /// `dataset@version`, resolved when first published.
    version: String,
}

pub(super) struct Plugin {
    node_id: String,
    node_socket: PathBuf,
    state_dir: PathBuf,
    kubelet_dir: PathBuf,
    cfg: Resolved,
    /// The record; held only while it is read or changed.
    published: Mutex<Published>,
    /// Turns at writing the record out (see [`Plugin::change`]).
    writer: tokio::sync::Mutex<()>,
    targets: ops_csi::KeyedLocks,
    versions: ops_csi::KeyedLocks,
    /// Refuse a volume that does not bring the pod's own token (`--require-pod-token`).
    require_pod_token: bool,
}

/// Runs blocking file-system or mount work off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
}

impl Plugin {
    /// The node plugin of `a`: its directories made and resolved, its record read back.
    pub(super) fn open(a: &CsiArgs, cfg: &Resolved) -> anyhow::Result<Plugin> {
        let node_id = match &a.node_id {
            Some(n) => n.clone(),
            None => crate::cmd::node::hostname(),
        };
        std::fs::create_dir_all(a.state_dir.join("mounts"))?;
        // Absolute and resolved: shared mounts are found by their path in the mount table.
        let state_dir = std::fs::canonicalize(&a.state_dir)
            .map_err(|e| anyhow::anyhow!("--state-dir {}: {e}", a.state_dir.display()))?;
        let kubelet_dir = std::fs::canonicalize(&a.kubelet_dir)
            .map_err(|e| anyhow::anyhow!("--kubelet-dir {}: {e}", a.kubelet_dir.display()))?;
        let record = state_dir.join("volumes.json");
        let published = match std::fs::read(&record) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| anyhow::anyhow!("{}: {e}", record.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Published::default(),
            Err(e) => return Err(e.into()),
        };
        tracing::info!(node = %node_id, "CSI node plugin");
        Ok(Plugin {
            node_id,
            node_socket: a.node_socket.clone(),
            state_dir,
            kubelet_dir,
            cfg: cfg.clone(),
            published: Mutex::new(published),
            writer: tokio::sync::Mutex::new(()),
            targets: ops_csi::KeyedLocks::default(),
            versions: ops_csi::KeyedLocks::default(),
            require_pod_token: a.require_pod_token,
        })
    }
}

#[tonic::async_trait]
impl csi::node_server::Node for Plugin {
    async fn node_get_info(&self, _: Request<csi::NodeGetInfoRequest>) -> Res<csi::NodeGetInfoResponse> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            ..Default::default()
        }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Res<csi::NodeGetCapabilitiesResponse> {
        Ok(Response::new(csi::NodeGetCapabilitiesResponse::default()))
    }

    async fn node_publish_volume(
        &self,
        req: Request<csi::NodePublishVolumeRequest>,
    ) -> Res<csi::NodePublishVolumeResponse> {
        let q = req.into_inner();
        if q.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        match q.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()) {
            Some(csi::volume_capability::AccessType::Mount(_)) => {}
            Some(csi::volume_capability::AccessType::Block(_)) => {
                return Err(Status::invalid_argument(
                    "a Locus volume is a read-only file tree, not a block device",
                ))
            }
            None => return Err(Status::invalid_argument("volume_capability is required")),
        }
        let spec = q.volume_context.get("dataset").ok_or_else(|| {
            Status::invalid_argument("volumeAttributes.dataset is required: name a version, e.g. imagenet@3")
        })?;
        let r: locus_proto::DatasetRef = spec
            .parse()
            .map_err(|e| Status::invalid_argument(format!("volumeAttributes.dataset {spec:?}: {e}")))?;
        // The pod's own token, when its volume brings one: the dataset must be one that
        // token may read, whatever the driver's own token may.
        let pod_token = q.secrets.get("token").map(|t| t.trim()).filter(|t| !t.is_empty());
        if pod_token.is_none() && self.require_pod_token {
            return Err(Status::failed_precondition(
                "this driver mounts only volumes that bring the pod's own Locus token: give the \
                 volume a nodePublishSecretRef (or the StorageClass \
                 csi.storage.k8s.io/node-publish-secret-name) naming a Secret with key `token`",
            ));
        }
        let target = self.target_path(&q.target_path).await?;
        let key = target.display().to_string();
        let _target_lock = self.targets.lock(&key).await;
        let recorded = self.record().targets.get(&key).cloned();
        let version = match recorded {
            Some(t) if t.volume_id != q.volume_id => {
                return Err(Status::already_exists(format!(
                    "{key} already holds volume {}",
                    t.volume_id
                )))
            }
            Some(_) if mounted(&target).await => {
                return Ok(Response::new(csi::NodePublishVolumeResponse {}));
            }
            // Published before and gone since (a reboot): the version it was given, still
            // readable with the pod's token.
            Some(t) => {
                if pod_token.is_some() {
                    let given: locus_proto::DatasetRef = t
                        .version
                        .parse()
                        .map_err(|e| Status::internal(format!("recorded version {:?}: {e}", t.version)))?;
                    super::resolve_as(&self.cfg, pod_token, &given).await?;
                }
                t.version
            }
            None => super::resolve_as(&self.cfg, pod_token, &r).await?,
        };
        let _version_lock = self.versions.lock(&version).await;
        let shared = self.shared_dir(&version);
        if !mounted(&shared).await {
            self.mount_shared(&version, &shared).await?;
        }
        let (src, dst) = (shared.clone(), target.clone());
        blocking(move || {
            std::fs::create_dir_all(&dst)
                .map_err(|e| Status::internal(format!("cannot create {}: {e}", dst.display())))?;
            ops_csi::bind_read_only(&src, &dst)
                .map_err(|e| Status::internal(format!("cannot mount {}: {e}", dst.display())))
        })
        .await?;
        let entry = Target {
            volume_id: q.volume_id.clone(),
            version: version.clone(),
        };
        self.change(move |p| {
            p.targets.insert(key, entry);
        })
        .await?;
        tracing::info!(volume = %q.volume_id, target = %target.display(), %version, "published");
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Res<csi::NodeUnpublishVolumeResponse> {
        let q = req.into_inner();
        if q.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let target = self.target_path(&q.target_path).await?;
        let key = target.display().to_string();
        let _target_lock = self.targets.lock(&key).await;
        let dir = target.clone();
        blocking(move || {
            if is_mountpoint(&dir) {
                ops_csi::unmount(&dir)
                    .map_err(|e| Status::internal(format!("cannot unmount {}: {e}", dir.display())))?;
            }
            match std::fs::remove_dir(&dir) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(Status::internal(format!("cannot remove {}: {e}", dir.display()))),
            }
        })
        .await?;
        // Unpublishing what is not published succeeds: the call must be idempotent.
        let k = key.clone();
        let Some(t) = self.change(move |p| p.targets.remove(&k)).await? else {
            return Ok(Response::new(csi::NodeUnpublishVolumeResponse {}));
        };
        // Under the version's lock, a publish of the same version either has recorded its
        // target already (the mount stays) or has not looked at the mount yet (and will
        // make it again if it is gone).
        let _version_lock = self.versions.lock(&t.version).await;
        let still_used = self.record().targets.values().any(|o| o.version == t.version);
        if !still_used {
            let shared = self.shared_dir(&t.version);
            let version = t.version.clone();
            blocking(move || {
                if is_mountpoint(&shared) {
                    ops_csi::unmount(&shared).map_err(|e| {
                        Status::internal(format!("cannot unmount the shared mount of {version}: {e}"))
                    })?;
                }
                let _ = std::fs::remove_dir(&shared);
                Ok(())
            })
            .await?;
            tracing::info!(version = %t.version, "last volume of this version unpublished; its mount is gone");
        }
        tracing::info!(volume = %q.volume_id, target = %key, "unpublished");
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }
}

impl Plugin {
    fn record(&self) -> std::sync::MutexGuard<'_, Published> {
        self.published.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `f` to the record and writes it out (atomically, off the async workers).
    /// Writers take turns, each writing what the record is after its own change, so the
    /// file never goes back to an older state.
    async fn change<R>(&self, f: impl FnOnce(&mut Published) -> R) -> Result<R, Status> {
        let _writer = self.writer.lock().await;
        let (out, bytes) = {
            let mut p = self.record();
            let out = f(&mut p);
            (
                out,
                serde_json::to_vec_pretty(&*p).map_err(|e| Status::internal(e.to_string()))?,
            )
        };
        let path = self.state_dir.join("volumes.json");
        blocking(move || {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes)
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| Status::internal(format!("cannot record published volumes: {e}")))
        })
        .await?;
        Ok(out)
    }

    /// [`csi::resolve_target`] under this host's kubelet directory, off the async workers.
    async fn target_path(&self, given: &str) -> Result<PathBuf, Status> {
        let (given, kubelet_dir) = (given.to_string(), self.kubelet_dir.clone());
        blocking(move || ops_csi::resolve_target(&kubelet_dir, &given)).await
    }

    fn shared_dir(&self, version: &str) -> PathBuf {
        self.state_dir.join("mounts").join(version)
    }

    /// Starts the one `locus mount` of `version`, reading through this host's node.
    async fn mount_shared(&self, version: &str, dir: &Path) -> Result<(), Status> {
        let exe = std::env::current_exe().map_err(|e| Status::internal(e.to_string()))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("mount")
            .arg(version)
            .arg(dir)
            .arg("--allow-other")
            .arg("--node-socket")
            .arg(&self.node_socket)
            .arg("--log-file")
            .arg(self.state_dir.join(format!("mount-{version}.log")))
            .env("LOCUS_METADATA", &self.cfg.metadata_url)
            .env_remove("LOCUS_TOKEN");
        // The token reaches the mount through its environment, never its argv.
        if let Some(t) = &self.cfg.token {
            cmd.env("LOCUS_TOKEN", t);
        }
        let dir = dir.to_path_buf();
        // It returns once the mount is readable.
        let out = blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| Status::internal(format!("{}: {e}", dir.display())))?;
            cmd.output()
                .map_err(|e| Status::internal(format!("cannot start locus mount: {e}")))
        })
        .await?;
        if !out.status.success() {
            return Err(Status::unavailable(format!(
                "mounting {version} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

/// [`is_mountpoint`], off the async workers.
async fn mounted(p: &Path) -> bool {
    let p = p.to_path_buf();
    blocking(move || Ok(is_mountpoint(&p))).await.unwrap_or(false)
}

/// Whether `p` (absolute, resolved) is a mount point in this process's mount table.
fn is_mountpoint(p: &Path) -> bool {
    locus_fuse::is_mount_point(p)
}
