//! Opening a backup target (or any object-store URL) and naming the objects in it.
//!
//! `file:///abs/dir` and `s3://bucket[/prefix]` are built in. S3 credentials, region and
//! endpoint come from the usual AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP=true` for plain HTTP); they are never
//! printed. `gs://` and `az://` are refused with a clear message until their object_store
//! backends are compiled in.

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

/// A few quick retries, then a clear failure: a backup that cannot reach its target
/// should say so within a minute (and resume on the next run), not hang for the library
/// default of ten retries over three minutes per request.
fn retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 4,
        retry_timeout: std::time::Duration::from_secs(60),
        ..Default::default()
    }
}

/// `LOCUS_OBJECT_STORE_TIMEOUT` (e.g. `10s`): how long one request may take before it
/// is given up and retried (object_store's default is 30 s). A server that stops
/// answering fails a backup after about five of these.
fn request_timeout() -> Result<Option<String>> {
    let Ok(v) = std::env::var("LOCUS_OBJECT_STORE_TIMEOUT") else {
        return Ok(None);
    };
    let d = locus_proto::human::parse_duration(&v)
        .map_err(|e| BackupError::Target(format!("LOCUS_OBJECT_STORE_TIMEOUT: {e}")))?;
    Ok(Some(format!("{}ms", d.as_millis().max(1))))
}

impl Target {
    /// Opens `url`. A `file://` target directory is created when missing.
    pub fn open(url: &str) -> Result<Target> {
        let url = url.trim_end_matches('/').to_string();
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(BackupError::Target(format!(
                    "{url}: a file:// URL needs an absolute path (file:///dir)"
                )));
            }
            std::fs::create_dir_all(path)
                .map_err(|e| BackupError::Target(format!("cannot create {path}: {e}")))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(path)
                .map_err(|e| BackupError::Target(format!("{url}: {e}")))?;
            let local_root = Some(std::path::PathBuf::from(path));
            return Ok(Target {
                url,
                store: Arc::new(store),
                prefix: String::new(),
                local_root,
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(BackupError::Target(format!("{url}: no bucket name")));
            }
            let mut b = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry());
            if let Some(t) = request_timeout()? {
                use object_store::aws::AmazonS3ConfigKey;
                use object_store::ClientConfigKey;
                b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), t);
            }
            let store = b
                .build()
                .map_err(|e| BackupError::Target(format!("cannot set up access to {url}: {e}")))?;
            return Ok(Target {
                url: url.clone(),
                store: Arc::new(store),
                prefix: prefix.trim_matches('/').to_string(),
                local_root: None,
            });
        }
        if url.starts_with("gs://") || url.starts_with("az://") {
            return Err(BackupError::Target(format!(
                "{url}: this build writes to file:// and s3:// (and S3-compatible servers); \
                 gs:// and az:// are not built in yet"
            )));
        }
        Err(BackupError::Target(format!(
            "{url}: not an object-store URL (file:///dir or s3://bucket/prefix)"
        )))
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
                use std::os::fd::AsRawFd;
                let dir = std::fs::File::open(&root)?;
                // SAFETY: syncfs only reads the descriptor, which `dir` keeps open for
                // the call.
                #[allow(unsafe_code)]
                let rc = unsafe { libc::syncfs(dir.as_raw_fd()) };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
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
        assert!(Target::open("gs://b/x")
            .unwrap_err()
            .to_string()
            .contains("not built in"));
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
