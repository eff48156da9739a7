//! The CSI driver's policy and system calls, apart from its gRPC services (`locus csi`
//! in the binary): which StorageClass parameters and capabilities a Locus volume takes,
//! what a volume id says, where a pod's target may be, the bind mount a pod gets, and
//! the per-key locks that keep one version's slow mount from holding up another's.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use locus_proto::csi;
use locus_proto::DatasetRef;
use tonic::Status;

/// The name pods, StorageClasses and the CSIDriver object use.
pub const DRIVER: &str = "csi.locus.io";

/// The StorageClass parameters the provisioner passes through on its own (its
/// `csi.storage.k8s.io/` keys are removed before the call; these are kept).
pub fn is_provisioner_key(k: &str) -> bool {
    k.starts_with("csi.storage.k8s.io/")
}

/// What a StorageClass names: `dataset` (`name` or `name@N`) and `version`.
pub fn dataset_of(params: &HashMap<String, String>) -> Result<DatasetRef, Status> {
    if let Some(k) = params
        .keys()
        .find(|k| !matches!(k.as_str(), "dataset" | "version") && !is_provisioner_key(k))
    {
        return Err(Status::invalid_argument(format!(
            "unknown StorageClass parameter {k:?}: Locus takes `dataset` and optionally `version`"
        )));
    }
    let dataset = params.get("dataset").ok_or_else(|| {
        Status::invalid_argument("StorageClass parameter `dataset` is required (e.g. dataset: imagenet)")
    })?;
    let spec = match params.get("version") {
        Some(_) if dataset.contains('@') => {
            return Err(Status::invalid_argument(format!(
                "`dataset` {dataset:?} names a version and `version` names another; give one"
            )))
        }
        Some(v) => format!("{dataset}@{v}"),
        None => dataset.clone(),
    };
    spec.parse()
        .map_err(|e| Status::invalid_argument(format!("StorageClass parameters name {spec:?}: {e}")))
}

/// Why `c` cannot be served, if it cannot: a Locus volume is a read-only file tree.
pub fn refusal(c: &csi::VolumeCapability) -> Option<String> {
    use csi::volume_capability::access_mode::Mode;
    use csi::volume_capability::AccessType;
    match c.access_type {
        Some(AccessType::Mount(_)) => {}
        Some(AccessType::Block(_)) => {
            return Some("a Locus volume is a read-only file tree, not a block device".into())
        }
        None => return Some("a volume capability needs an access type (mount)".into()),
    }
    let mode = c
        .access_mode
        .as_ref()
        .and_then(|m| Mode::try_from(m.mode).ok())
        .unwrap_or(Mode::Unknown);
    match mode {
        Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly => None,
        m => Some(format!(
            "access mode {} is not offered: a Locus volume is a read-only view of a dataset \
             version; claim it ReadOnlyMany (MULTI_NODE_READER_ONLY)",
            m.as_str_name()
        )),
    }
}

/// `name@N:H` for the claim's volume name.
pub fn volume_id(version: &str, name: &str) -> String {
    let h = blake3::hash(name.as_bytes());
    format!("{version}:{}", &h.to_hex()[..16])
}

/// The version a volume id names, if it is one of ours.
pub fn version_of(volume_id: &str) -> Option<DatasetRef> {
    let (version, hash) = volume_id.rsplit_once(':')?;
    if hash.len() != 16 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let r: DatasetRef = version.parse().ok()?;
    matches!(r.version, locus_proto::VersionSel::Number(_)).then_some(r)
}

/// One async lock per key (a target path, a version), made on first use and dropped
/// when nobody holds or waits for it.
#[derive(Default)]
pub struct KeyedLocks(Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>);

impl KeyedLocks {
    pub async fn lock(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, w| w.strong_count() > 0);
            match map.get(key).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(key.to_string(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }
}

/// A pod's target path as given, if it is absolute, clean and under `kubelet_dir` (its
/// existing part resolved, so a symlink cannot lead out of it). Touches the file system.
pub fn resolve_target(kubelet_dir: &Path, given: &str) -> Result<PathBuf, Status> {
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
    if !real.starts_with(kubelet_dir) || real == kubelet_dir {
        return Err(Status::invalid_argument(format!(
            "target_path {given} is outside the kubelet directory {}",
            kubelet_dir.display()
        )));
    }
    Ok(real)
}

/// Bind-mounts `src` on `dst`, then makes that bind read-only, nosuid and nodev.
pub fn bind_read_only(src: &Path, dst: &Path) -> std::io::Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    // A remount of a bind sets the flags given and clears the rest: without NOSUID and
    // NODEV here the pod's view would honour setuid bits and device files the shared
    // mount refuses (a setuid-root binary in a dataset would make whoever runs it in the
    // pod root).
    let flags =
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if let Err(e) = mount(None::<&str>, dst, None::<&str>, flags, None::<&str>) {
        let _ = umount2(dst, MntFlags::MNT_DETACH);
        return Err(e.into());
    }
    Ok(())
}

/// Unmounts `p`; lazily when something still holds it open (a reader of a pod that is
/// going away), so kubelet's cleanup is never blocked by it.
pub fn unmount(p: &Path) -> std::io::Result<()> {
    use nix::mount::{umount2, MntFlags};
    umount2(p, MntFlags::empty())
        .or_else(|_| umount2(p, MntFlags::MNT_DETACH))
        .map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn params(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn storage_class_parameters_name_one_version_or_are_refused_with_the_reason() {
        let r = dataset_of(&params(&[("dataset", "imagenet")])).unwrap();
        assert_eq!(r.to_string(), "imagenet@latest");
        let r = dataset_of(&params(&[("dataset", "imagenet"), ("version", "3")])).unwrap();
        assert_eq!(r.to_string(), "imagenet@3");
        let r = dataset_of(&params(&[
            ("dataset", "imagenet@4"),
            ("csi.storage.k8s.io/fstype", ""),
        ]))
        .unwrap();
        assert_eq!(r.to_string(), "imagenet@4");
        for (p, why) in [
            (params(&[]), "is required"),
            (
                params(&[("dataset", "imagenet"), ("verison", "3")]),
                "unknown StorageClass parameter \"verison\"",
            ),
            (params(&[("dataset", "imagenet@2"), ("version", "3")]), "give one"),
            (params(&[("dataset", "../etc")]), "../etc"),
            (
                params(&[("dataset", "imagenet"), ("version", "0")]),
                "numbered from 1",
            ),
        ] {
            let e = dataset_of(&p).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{p:?}");
            assert!(e.message().contains(why), "{p:?}: {}", e.message());
        }
    }

    #[test]
    fn a_volume_id_names_its_version_is_stable_per_claim_and_fits_the_spec() {
        let longest = format!("{}@{}", "a".repeat(63), u64::MAX);
        let id = volume_id(&longest, &"n".repeat(128));
        assert!(id.len() <= 128, "{} bytes", id.len());
        assert_eq!(version_of(&id).unwrap().to_string(), longest);
        assert_eq!(volume_id("imagenet@3", "pvc-1"), volume_id("imagenet@3", "pvc-1"));
        assert_ne!(volume_id("imagenet@3", "pvc-1"), volume_id("imagenet@3", "pvc-2"));
        for other in [
            "imagenet@3",
            "imagenet@latest:0123456789abcdef",
            "x:y",
            "",
            "imagenet@3:0123",
        ] {
            assert!(version_of(other).is_none(), "{other}");
        }
    }

    #[test]
    fn only_read_only_file_tree_capabilities_are_served() {
        use csi::volume_capability::{access_mode::Mode, AccessMode, AccessType};
        let cap = |t: Option<AccessType>, m: Mode| csi::VolumeCapability {
            access_type: t,
            access_mode: Some(AccessMode { mode: m as i32 }),
        };
        let mount = || Some(AccessType::Mount(Default::default()));
        assert!(refusal(&cap(mount(), Mode::MultiNodeReaderOnly)).is_none());
        assert!(refusal(&cap(mount(), Mode::SingleNodeReaderOnly)).is_none());
        for m in [Mode::SingleNodeWriter, Mode::MultiNodeMultiWriter, Mode::Unknown] {
            let why = refusal(&cap(mount(), m)).unwrap();
            assert!(
                why.contains(m.as_str_name()) && why.contains("ReadOnlyMany"),
                "{why}"
            );
        }
        let block = refusal(&cap(
            Some(AccessType::Block(Default::default())),
            Mode::MultiNodeReaderOnly,
        ));
        assert!(block.unwrap().contains("block device"));
    }

    #[tokio::test]
    async fn a_held_key_blocks_only_itself_and_is_forgotten_once_free() {
        let locks = KeyedLocks::default();
        let a = locks.lock("imagenet@1").await;
        // Another key is not held up by it.
        let b = tokio::time::timeout(Duration::from_secs(1), locks.lock("laion@1")).await;
        assert!(b.is_ok(), "a lock on another key waited");
        // The same key waits until the holder lets go.
        let again = tokio::time::timeout(Duration::from_millis(100), locks.lock("imagenet@1")).await;
        assert!(again.is_err(), "the same key was locked twice at once");
        drop(a);
        let again = tokio::time::timeout(Duration::from_secs(1), locks.lock("imagenet@1")).await;
        assert!(again.is_ok());
        drop((b, again));
        let _ = locks.lock("other").await;
        let map = locks.0.lock().unwrap();
        assert!(
            map.len() <= 1,
            "free keys are not kept: {:?}",
            map.keys().collect::<Vec<_>>()
        );
    }
}
