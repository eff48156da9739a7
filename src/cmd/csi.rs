//! `locus csi`: the Kubernetes CSI node plugin. A pod gets a dataset version as a
//! read-only volume, inline (`csi: {driver: csi.locus.io, volumeAttributes: {dataset:
//! imagenet@3}}`) or through a static PersistentVolume with the same attributes.
//!
//! Pods on one host reading one version share one mount, hence one page cache: the
//! plugin keeps a single `locus mount` per version under `--state-dir/mounts/` (through
//! this host's cache node) and bind-mounts it into each pod's target path, counting the
//! targets; the last unpublish unmounts it. The shared mounts are separate processes, so
//! a restart of the plugin leaves every pod's volume in place, and the record of which
//! target uses which version is a file (`volumes.json`, rewritten atomically) that a
//! restarted plugin reads back.
//!
//! Only the Identity and Node services are served: volumes are neither created nor
//! attached (the CSIDriver object says `attachRequired: false`), and no staging is done.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use locus_proto::csi;
use locus_proto::pb;
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::config::Resolved;

/// The name pods and the CSIDriver object use.
pub const DRIVER: &str = "csi.locus.io";

#[derive(Args, Debug)]
pub struct CsiArgs {
    /// Where to serve CSI (kubelet and the registrar connect here).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// This Kubernetes node's name (its cache node's id).
    #[arg(long, env = "NODE_NAME")]
    pub node_id: Option<String>,
    /// This host's cache node socket; the shared mounts read through it.
    #[arg(long, env = "LOCUS_NODE_SOCKET", default_value = "/run/locus/node.sock")]
    pub node_socket: PathBuf,
    /// Where the shared mounts and the record of published volumes live.
    #[arg(long, default_value = "/var/lib/locus-csi")]
    pub state_dir: PathBuf,
    /// Kubelet's root: every target path must be under it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub kubelet_dir: PathBuf,
}

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

struct Plugin {
    node_id: String,
    node_socket: PathBuf,
    state_dir: PathBuf,
    kubelet_dir: PathBuf,
    cfg: Resolved,
    /// One publish or unpublish at a time: they share the counts and the file.
    published: tokio::sync::Mutex<Published>,
}

pub async fn run(a: CsiArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let path = a.endpoint.strip_prefix("unix://").ok_or_else(|| {
        anyhow::anyhow!("--endpoint must be unix:///PATH (CSI serves only on a Unix socket)")
    })?;
    let node_id = match a.node_id {
        Some(n) => n,
        None => crate::cmd::node::hostname(),
    };
    std::fs::create_dir_all(a.state_dir.join("mounts"))?;
    // Absolute and resolved: shared mounts are found by their path in the mount table.
    let state_dir = std::fs::canonicalize(&a.state_dir)
        .map_err(|e| anyhow::anyhow!("--state-dir {}: {e}", a.state_dir.display()))?;
    let kubelet_dir = std::fs::canonicalize(&a.kubelet_dir)
        .map_err(|e| anyhow::anyhow!("--kubelet-dir {}: {e}", a.kubelet_dir.display()))?;
    let published = match std::fs::read(state_dir.join("volumes.json")) {
        Ok(b) => serde_json::from_slice(&b)
            .map_err(|e| anyhow::anyhow!("{}: {e}", state_dir.join("volumes.json").display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Published::default(),
        Err(e) => return Err(e.into()),
    };
    let plugin = Arc::new(Plugin {
        node_id,
        node_socket: a.node_socket,
        state_dir,
        kubelet_dir,
        cfg: cfg.clone(),
        published: tokio::sync::Mutex::new(published),
    });
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
    tracing::info!(endpoint = %a.endpoint, node = %plugin.node_id, "CSI node plugin ready");
    tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::from_arc(plugin.clone()))
        .add_service(csi::node_server::NodeServer::from_arc(plugin))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            crate::cmd::shutdown_signal(),
        )
        .await?;
    Ok(())
}

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl csi::identity_server::Identity for Plugin {
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
        // No controller service: nothing is provisioned or attached.
        Ok(Response::new(csi::GetPluginCapabilitiesResponse::default()))
    }

    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Res<csi::ProbeResponse> {
        Ok(Response::new(csi::ProbeResponse {
            ready: Some(csi::BoolValue { value: true }),
        }))
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
        let target = self.target_path(&q.target_path)?;
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
        let mut published = self.published.lock().await;
        let key = target.display().to_string();
        if let Some(t) = published.targets.get(&key) {
            if t.volume_id == q.volume_id && is_mountpoint(&target) {
                return Ok(Response::new(csi::NodePublishVolumeResponse {}));
            }
            if t.volume_id != q.volume_id {
                return Err(Status::already_exists(format!(
                    "{key} already holds volume {}",
                    t.volume_id
                )));
            }
        }
        let version = self.resolve(&r).await?;
        let shared = self.shared_dir(&version);
        if !is_mountpoint(&shared) {
            self.mount_shared(&version, &shared).await?;
        }
        std::fs::create_dir_all(&target)
            .map_err(|e| Status::internal(format!("cannot create {key}: {e}")))?;
        bind_read_only(&shared, &target).map_err(|e| Status::internal(format!("cannot mount {key}: {e}")))?;
        published.targets.insert(
            key.clone(),
            Target {
                volume_id: q.volume_id.clone(),
                version: version.clone(),
            },
        );
        self.save(&published)?;
        tracing::info!(volume = %q.volume_id, target = %key, %version, "published");
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
        let target = self.target_path(&q.target_path)?;
        let key = target.display().to_string();
        let mut published = self.published.lock().await;
        if is_mountpoint(&target) {
            unmount(&target).map_err(|e| Status::internal(format!("cannot unmount {key}: {e}")))?;
        }
        match std::fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Status::internal(format!("cannot remove {key}: {e}"))),
        }
        // Unpublishing what is not published succeeds: the call must be idempotent.
        if let Some(t) = published.targets.remove(&key) {
            self.save(&published)?;
            let still_used = published.targets.values().any(|o| o.version == t.version);
            if !still_used {
                let shared = self.shared_dir(&t.version);
                if is_mountpoint(&shared) {
                    unmount(&shared).map_err(|e| {
                        Status::internal(format!("cannot unmount the shared mount of {}: {e}", t.version))
                    })?;
                }
                let _ = std::fs::remove_dir(&shared);
                tracing::info!(version = %t.version, "last volume of this version unpublished; its mount is gone");
            }
            tracing::info!(volume = %q.volume_id, target = %key, "unpublished");
        }
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }
}

impl Plugin {
    /// A target path as given, if it is absolute, clean and under kubelet's root (its
    /// existing part resolved, so a symlink cannot lead out of it).
    fn target_path(&self, given: &str) -> Result<PathBuf, Status> {
        let p = Path::new(given);
        if given.is_empty() || given.contains('\0') || !p.is_absolute() {
            return Err(Status::invalid_argument("target_path must be an absolute path"));
        }
        if p.components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(Status::invalid_argument("target_path must not contain . or .."));
        }
        // Resolve the deepest existing ancestor; the rest is created by us, as plain dirs.
        let mut existing = p.to_path_buf();
        let mut rest = Vec::new();
        while !existing.exists() {
            let Some(name) = existing.file_name() else { break };
            rest.push(name.to_os_string());
            existing.pop();
        }
        let mut real = std::fs::canonicalize(&existing)
            .map_err(|e| Status::invalid_argument(format!("target_path {given}: {e}")))?;
        for name in rest.iter().rev() {
            real.push(name);
        }
        if !real.starts_with(&self.kubelet_dir) || real == self.kubelet_dir {
            return Err(Status::invalid_argument(format!(
                "target_path {given} is outside the kubelet directory {}",
                self.kubelet_dir.display()
            )));
        }
        Ok(real)
    }

    fn shared_dir(&self, version: &str) -> PathBuf {
        self.state_dir.join("mounts").join(version)
    }

    /// `dataset@version` of what `r` names now, or NOT_FOUND.
    async fn resolve(&self, r: &locus_proto::DatasetRef) -> Result<String, Status> {
        let mut c = self
            .cfg
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("the metadata service: {e:#}")))?;
        let v = c
            .get_version(pb::GetVersionRequest {
                r#ref: Some(pb::VersionRef::from(r)),
            })
            .await?
            .into_inner();
        Ok(format!("{}@{}", v.dataset, v.version))
    }

    /// Starts the one `locus mount` of `version`, reading through this host's node.
    async fn mount_shared(&self, version: &str, dir: &Path) -> Result<(), Status> {
        std::fs::create_dir_all(dir).map_err(|e| Status::internal(format!("{}: {e}", dir.display())))?;
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
        // It returns once the mount is readable; off the async workers meanwhile.
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| Status::internal(format!("cannot start locus mount: {e}")))?;
        if !out.status.success() {
            return Err(Status::unavailable(format!(
                "mounting {version} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    fn save(&self, p: &Published) -> Result<(), Status> {
        let path = self.state_dir.join("volumes.json");
        let tmp = path.with_extension("tmp");
        let bytes = serde_json::to_vec_pretty(p).map_err(|e| Status::internal(e.to_string()))?;
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| Status::internal(format!("cannot record published volumes: {e}")))
    }
}

/// Whether `p` (absolute, resolved) is a mount point in this process's mount table.
fn is_mountpoint(p: &Path) -> bool {
    locus_fuse::is_mount_point(p)
}

fn cstr(p: &Path) -> std::io::Result<std::ffi::CString> {
    std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::other("a path with a NUL byte"))
}

/// Bind-mounts `src` on `dst`, then makes that bind read-only, nosuid and nodev.
#[allow(unsafe_code)]
fn bind_read_only(src: &Path, dst: &Path) -> std::io::Result<()> {
    let (s, d) = (cstr(src)?, cstr(dst)?);
    // SAFETY: mount(2) with NUL-terminated paths that live across the calls.
    unsafe {
        if libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        // A remount of a bind sets the flags given and clears the rest: without NOSUID
        // and NODEV here the pod's view would honour setuid bits and device files the
        // shared mount refuses (a setuid-root binary in a dataset would make whoever
        // runs it in the pod root).
        let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
        if libc::mount(
            std::ptr::null(),
            d.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        ) != 0
        {
            let e = std::io::Error::last_os_error();
            libc::umount2(d.as_ptr(), libc::MNT_DETACH);
            return Err(e);
        }
    }
    Ok(())
}

/// Unmounts `p`; lazily when something still holds it open (a reader of a pod that is
/// going away), so kubelet's cleanup is never blocked by it.
#[allow(unsafe_code)]
fn unmount(p: &Path) -> std::io::Result<()> {
    let c = cstr(p)?;
    // SAFETY: umount2(2) with a NUL-terminated path.
    unsafe {
        if libc::umount2(c.as_ptr(), 0) == 0 {
            return Ok(());
        }
        if libc::umount2(c.as_ptr(), libc::MNT_DETACH) == 0 {
            return Ok(());
        }
    }
    Err(std::io::Error::last_os_error())
}
