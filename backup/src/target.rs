//! A backup target (any object-store URL `crate::url` opens) and the names of the objects
//! in it.

use std::sync::Arc;

use locus_proto::manifest::BlobHash;
use object_store::path::Path as ObjPath;
use object_store::ObjectStore;

use crate::{BackupError, Result};

#[derive(Clone)]
pub struct Target {
    /// The URL as the operator gave it (no credentials are ever part of it).
    pub url: String,
    pub store: Arc<dyn ObjectStore>,
    /// Key prefix inside the store, without leading or trailing '/'.
    pub prefix: String,
    /// The directory of a file:// target.
    pub local_root: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("url", &self.url).finish()
    }
}

impl Target {
    /// Opens `url` (see [`crate::url`]). A `file://` target directory is created when
    /// missing.
    pub fn open(url: &str) -> Result<Target> {
        let url = url.trim_end_matches('/').to_string();
        let o = crate::url::open(&url, true)?;
        Ok(Target {
            url,
            store: o.store,
            prefix: o.prefix,
            local_root: o.local_root,
        })
    }

    /// Makes everything written to a `file://` target so far durable: the local
    /// filesystem writes objects without fsync, so a crash could lose blobs of a
    /// snapshot already marked committed. One `syncfs` of the target's filesystem, at
    /// the points where a run vouches for what it wrote (a node's uploads done, before
    /// and after COMMITTED), instead of an fsync per object. Nothing to do for object
    /// stores, whose PUT answers only once the object is stored.
    pub async fn sync_local(&self) -> Result<()> {
        let Some(root) = self.local_root.clone() else {
            return Ok(());
        };
        let failed =
            |e: std::io::Error| BackupError::Target(format!("cannot flush {} to disk: {e}", root.display()));
        let r = {
            let root = root.clone();
            tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                let dir = std::fs::File::open(&root)?;
                Ok(nix::unistd::syncfs(&dir)?)
            })
            .await
        };
        r.map_err(|e| failed(std::io::Error::other(e)))?.map_err(failed)
    }

    /// The key `rel` under the target's prefix.
    pub fn key(&self, rel: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{}/{rel}", self.prefix))
        }
    }

    pub fn blob_key(&self, h: &BlobHash) -> ObjPath {
        let hex = h.to_hex();
        self.key(&format!("blobs/{}/{hex}", &hex[..2]))
    }

    pub fn snapshot_key(&self, id: &str, name: &str) -> ObjPath {
        self.key(&format!("snapshots/{id}/{name}"))
    }

    /// Parses a key under `blobs/` back into its hash.
    pub fn blob_of_key(&self, key: &ObjPath) -> Option<BlobHash> {
        let name = key.as_ref().rsplit('/').next()?;
        BlobHash::from_hex(name).ok()
    }

    pub fn describe(&self, key: &ObjPath) -> String {
        let rel = key
            .as_ref()
            .strip_prefix(self.prefix.as_str())
            .unwrap_or(key.as_ref())
            .trim_start_matches('/');
        format!("{}/{rel}", self.url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        for u in ["gs://b/x", "s3://b/x"] {
            assert_eq!(Target::open(u).unwrap().prefix, "x", "{u}");
        }
        if std::env::var_os("AZURE_STORAGE_ACCOUNT_NAME").is_none() {
            let e = Target::open("az://c/x").unwrap_err().to_string();
            assert!(
                e.contains("az://c/x") && e.contains("Account must be specified"),
                "{e}"
            );
        }
        assert!(Target::open("ftp://b/x")
            .unwrap_err()
            .to_string()
            .contains("not an object-store URL"));
        assert!(Target::open("file://relative").is_err());
        assert!(Target::open("s3://").is_err());
        assert!(Target::open("/plain/path").is_err());
        let d = tempfile::tempdir().unwrap();
        let t = Target::open(&format!("file://{}/sub/", d.path().display())).unwrap();
        assert!(d.path().join("sub").is_dir());
        let h = BlobHash::of(b"x");
        let k = t.blob_key(&h);
        assert!(k.as_ref().starts_with(&format!("blobs/{}/", &h.to_hex()[..2])));
        assert_eq!(t.blob_of_key(&k), Some(h));
    }
}
