//! The node's persistent identity: a random name created in its first data dir at first
//! start (`identity`), sent with every registration and heartbeat, and the id of the
//! cluster the data dir belongs to, recorded at its first registration.
//!
//! The metadata service gives a node id to one identity at a time: a second process
//! started with the same id (two hosts with the default id, their host name) is refused
//! while the first is up, and a process whose id was taken over after it was declared
//! down is told to stop. A data dir that belongs to another cluster is refused outright:
//! its blobs and pins mean nothing to this one.
//!
//! File format, one `key=value` per line: `instance=<32 hex>`, `cluster=<id>`. Mode 0600:
//! the instance is what a heartbeat proves itself with beside the node's token, so no
//! other user of the host may read it (an older, wider file is narrowed at start).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::NodeError;

#[derive(Debug, Clone)]
pub struct Identity {
    pub instance: String,
    /// The cluster this data dir joined; None until its first registration.
    pub cluster: Option<String>,
    path: PathBuf,
}

impl Identity {
    /// Reads `dir/identity`, creating it (with a fresh instance) when absent.
    pub fn load_or_create(dir: &Path) -> Result<Identity, NodeError> {
        let path = dir.join("identity");
        let bad = |why: String| NodeError::Config(format!("{}: {why}", path.display()));
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                use std::os::unix::fs::PermissionsExt;
                if let Ok(m) = std::fs::metadata(&path) {
                    if m.permissions().mode() & 0o077 != 0 {
                        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                            .map_err(|e| bad(format!("cannot make it private (chmod 600): {e}")))?;
                        tracing::warn!(path = %path.display(), "the node identity was readable by others; made it private");
                    }
                }
                let mut instance = None;
                let mut cluster = None;
                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                    match line.split_once('=') {
                        Some(("instance", v)) if valid(v) => instance = Some(v.to_string()),
                        Some(("cluster", v)) if valid(v) => cluster = Some(v.to_string()),
                        _ => return Err(bad(format!("unexpected line {line:?}"))),
                    }
                }
                let instance = instance.ok_or_else(|| bad("no instance= line".into()))?;
                Ok(Identity {
                    instance,
                    cluster,
                    path,
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut raw = [0u8; 16];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut f| f.read_exact(&mut raw))
                    .map_err(|e| bad(format!("cannot read /dev/urandom: {e}")))?;
                let id = Identity {
                    instance: locus_proto::hex::encode(&raw),
                    cluster: None,
                    path,
                };
                id.save()?;
                Ok(id)
            }
            Err(e) => Err(bad(e.to_string())),
        }
    }

    /// Binds the data dir to `cluster` at its first registration; refuses another one.
    pub fn bind_cluster(&mut self, cluster: &str) -> Result<(), NodeError> {
        match &self.cluster {
            Some(c) if c == cluster => Ok(()),
            Some(c) => Err(NodeError::Identity(format!(
                "the data dir {} belongs to cluster {c}, but the metadata service is cluster \
                 {cluster}: point the node at its own cluster's service, or give it an empty \
                 data dir to join this one",
                self.path.parent().unwrap_or(Path::new("")).display()
            ))),
            None if valid(cluster) => {
                self.cluster = Some(cluster.to_string());
                self.save()
            }
            None => Err(NodeError::Identity(format!(
                "the metadata service reports an unusable cluster id {cluster:?}"
            ))),
        }
    }

    /// Written whole to a temporary file, synced, then renamed over the old one.
    fn save(&self) -> Result<(), NodeError> {
        let mut text = format!("instance={}\n", self.instance);
        if let Some(c) = &self.cluster {
            text.push_str(&format!("cluster={c}\n"));
        }
        let tmp = self.path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| NodeError::Config(format!("cannot write {}: {e}", self.path.display())))
    }
}

fn valid(v: &str) -> bool {
    !v.is_empty() && v.len() <= 64 && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_created_once_kept_and_bound_to_one_cluster() {
        let d = tempfile::tempdir().unwrap();
        let mut a = Identity::load_or_create(d.path()).unwrap();
        assert_eq!(a.instance.len(), 32);
        assert_eq!(a.cluster, None);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let file = d.path().join("identity");
        assert_eq!(mode(&file), 0o600, "only the node's user may read its identity");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        Identity::load_or_create(d.path()).unwrap();
        assert_eq!(mode(&file), 0o600, "a wider old file is narrowed");
        a.bind_cluster("c1").unwrap();
        let mut b = Identity::load_or_create(d.path()).unwrap();
        assert_eq!(b.instance, a.instance, "the same data dir, the same identity");
        assert_eq!(b.cluster.as_deref(), Some("c1"));
        b.bind_cluster("c1").unwrap();
        let e = b.bind_cluster("c2").unwrap_err().to_string();
        assert!(e.contains("belongs to cluster c1") && e.contains("c2"), "{e}");
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            Identity::load_or_create(other.path()).unwrap().instance,
            a.instance
        );
        std::fs::write(d.path().join("identity"), "instance=../../x\n").unwrap();
        assert!(Identity::load_or_create(d.path()).is_err());
    }
}
