//! Where a mount keeps its status file and log: a per-user runtime directory whose
//! name is predictable, so it is made private (0700) and checked before anything is
//! written there.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// Where mounts keep their status files and logs: LOCUS_RUNTIME_DIR, else
/// $XDG_RUNTIME_DIR/locus, else /tmp/locus-<uid>. Only read here; see
/// [`private_runtime_dir`] before writing into it.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LOCUS_RUNTIME_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("locus");
    }
    std::env::temp_dir().join(format!("locus-{}", euid()))
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The runtime dir and its `mounts/`, made (mode 0700) or checked before anything is
/// written there: a name under /tmp is predictable, so another user could have made it
/// first, or put a symlink there, to read our logs or have us write where they choose.
/// Each must be a real directory (not a symlink), ours, and writable by no one else.
pub fn private_runtime_dir() -> anyhow::Result<PathBuf> {
    let root = runtime_dir();
    for d in [root.clone(), root.join("mounts")] {
        private_dir(&d)?;
    }
    Ok(root)
}

/// Where this user's mounts keep namespaces fetched from peers (hosts without a local
/// node), each named by its hash; created private.
pub fn namespace_dir() -> anyhow::Result<PathBuf> {
    let d = private_runtime_dir()?.join("namespaces");
    private_dir(&d)?;
    Ok(d)
}

fn private_dir(d: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(d) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => bail!("cannot create the runtime dir {}: {e}", d.display()),
    }
    let m = std::fs::symlink_metadata(d).with_context(|| format!("cannot inspect {}", d.display()))?;
    let why = if m.file_type().is_symlink() {
        Some("it is a symlink".to_string())
    } else if !m.is_dir() {
        Some("it is not a directory".to_string())
    } else if m.uid() != euid() {
        Some(format!(
            "it belongs to uid {}, not to you (uid {})",
            m.uid(),
            euid()
        ))
    } else if m.mode() & 0o022 != 0 {
        Some(format!("others may write in it (mode {:o})", m.mode() & 0o777))
    } else {
        None
    };
    match why {
        Some(why) => bail!(
            "refusing to use {} as the mount's runtime dir: {why}. Remove it, or set \
             LOCUS_RUNTIME_DIR to a directory of your own",
            d.display()
        ),
        None => Ok(()),
    }
}

/// A file name for a mount's status and log: the mountpoint made readable, plus a short
/// hash of the exact path, since flattening alone maps /a/b and /a_b to the same name.
pub(super) fn state_name(mountpoint: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let tag = &blake3::hash(mountpoint.as_os_str().as_bytes()).to_hex()[..8];
    format!("{}-{tag}", readable_name(mountpoint))
}

fn readable_name(mountpoint: &Path) -> String {
    let s = mountpoint.display().to_string();
    let clean: String = s
        .trim_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean.is_empty() {
        "root".into()
    } else {
        clean
    }
}

pub(super) fn status_path(mountpoint: &Path) -> PathBuf {
    runtime_dir()
        .join("mounts")
        .join(format!("{}.json", state_name(mountpoint)))
}

/// Removes the mount point's status file if it is the one of the mount whose holder is
/// `holder_pid`: after `fusermount3 -u`, a new mount at the same path may have written its
/// own before this one's processes noticed they were done.
pub(super) fn remove_status_of(mountpoint: &Path, holder_pid: u32) {
    let path = status_path(mountpoint);
    if path.exists() && !status_names_another(&path, holder_pid) {
        let _ = std::fs::remove_file(&path);
    }
}

/// Whether the status file at `path` is another mount's than the one whose holder is
/// `holder_pid`. A file that is absent or does not parse names no other mount.
pub(super) fn status_names_another(path: &Path, holder_pid: u32) -> bool {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["pid"].as_u64())
        .is_some_and(|p| p != u64::from(holder_pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_mountpoints_get_distinct_state_files() {
        assert_ne!(state_name(Path::new("/a/b")), state_name(Path::new("/a_b")));
        assert_eq!(state_name(Path::new("/x/y")), state_name(Path::new("/x/y")));
        let n = state_name(Path::new("/mnt/data set"));
        assert!(
            n.starts_with("mnt_data_set-") && n.len() == "mnt_data_set-".len() + 8,
            "{n}"
        );
        assert!(state_name(Path::new("/")).starts_with("root-"));
    }
}
