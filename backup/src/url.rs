//! Object-store URLs, opened one way everywhere: backup targets, import sources, a
//! version's origin read by the mount or by a node. One place decides which schemes exist
//! and how each finds its credentials, so a URL that works for `locus backup` works for
//! `locus dataset import` and for the mount.
//!
//! - `file:///abs/dir`
//! - `s3://bucket[/prefix]`: the AWS environment (`AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL` for S3-compatible servers,
//!   `AWS_ALLOW_HTTP=true` for plain HTTP);
//! - `gs://bucket[/prefix]`: Google's (`GOOGLE_SERVICE_ACCOUNT` naming a service-account
//!   JSON file, `GOOGLE_SERVICE_ACCOUNT_KEY` holding one, or
//!   `GOOGLE_APPLICATION_CREDENTIALS`); a key file with `"gcs_base_url"` and
//!   `"disable_oauth": true` points at an emulator such as fake-gcs-server
//!   (`GOOGLE_ALLOW_HTTP=true` if it speaks plain HTTP);
//! - `az://container[/prefix]`: Azure's (`AZURE_STORAGE_ACCOUNT_NAME`,
//!   `AZURE_STORAGE_ACCOUNT_KEY` or a SAS/bearer variable; `AZURE_STORAGE_USE_EMULATOR=true`
//!   with `AZURITE_BLOB_STORAGE_URL` for Azurite).
//!
//! Credentials never appear in a URL and are never printed. Every store gets the same
//! bounded retries and the optional per-request timeout `LOCUS_OBJECT_STORE_TIMEOUT`.
//!
//! Credentials are the ones an operator configured, never ones found: a process whose
//! environment names none for a store is refused at once, without a connection, instead
//! of falling back to the cloud's instance-metadata service (169.254.169.254), which
//! would hand a cache node or a mount the machine's own role — a confused deputy reading
//! with rights nobody gave Locus. `LOCUS_INSTANCE_CREDENTIALS=true` allows that fallback
//! where the machine's role is meant for it.

use std::path::PathBuf;
use std::sync::Arc;

use object_store::ObjectStore;

use crate::{BackupError, Result};

/// An opened URL.
pub struct Opened {
    pub store: Arc<dyn ObjectStore>,
    /// Key prefix inside the store, without leading or trailing '/'.
    pub prefix: String,
    /// The directory of a `file://` URL.
    pub local_root: Option<PathBuf>,
}

/// A few quick retries, then a clear failure: work that cannot reach its store should say
/// so within a minute, not hang for the library default of ten retries over three
/// minutes per request.
fn retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 4,
        retry_timeout: std::time::Duration::from_secs(60),
        ..Default::default()
    }
}

/// `LOCUS_OBJECT_STORE_TIMEOUT` (e.g. `10s`): how long one request may take before it
/// is given up and retried (object_store's default is 30 s). A server that stops
/// answering fails the work after about five of these.
fn request_timeout() -> Result<Option<std::time::Duration>> {
    let Ok(v) = std::env::var("LOCUS_OBJECT_STORE_TIMEOUT") else {
        return Ok(None);
    };
    let d = locus_proto::human::parse_duration(&v)
        .map_err(|e| BackupError::Target(format!("LOCUS_OBJECT_STORE_TIMEOUT: {e}")))?;
    Ok(Some(d.max(std::time::Duration::from_millis(1))))
}

/// `bucket/prefix` → (bucket, prefix without surrounding '/'). A URL carrying
/// credentials (`user:secret@bucket`, a `?`-signed query such as an Azure SAS) is refused
/// without repeating it: it would be stored as a version's origin or a backup's address
/// and shown to every reader; credentials come from the environment.
fn split<'a>(url: &str, rest: &'a str) -> Result<(&'a str, String)> {
    let scheme = &url[..url.find("://").map_or(0, |i| i + 3)];
    if rest.contains('?')
        || rest
            .split('/')
            .next()
            .is_some_and(|b| b.contains('@') || b.contains(':'))
    {
        return Err(BackupError::Target(format!(
            "a {scheme} URL with credentials in it (user:secret@ or a ?query) is refused: it would \
             be stored and shown to readers; give credentials through the environment \
             (AWS_*, GOOGLE_*, AZURE_STORAGE_*) instead"
        )));
    }
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(BackupError::Target(format!("{url}: no bucket or container name")));
    }
    Ok((bucket, prefix.trim_matches('/').to_string()))
}

/// Whether this process may take credentials from the machine (instance metadata).
fn instance_credentials_allowed() -> bool {
    std::env::var("LOCUS_INSTANCE_CREDENTIALS").is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "yes"))
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// What a store without configured credentials signs with: nothing. Every request fails
/// with `why` before anything is sent, so a process that was given no credentials for a
/// store says so instead of asking the machine for some. The URL itself still opens
/// (parsing, naming a target), so the error comes where the store is used.
#[derive(Debug)]
struct NoCredentials<C> {
    why: String,
    _c: std::marker::PhantomData<fn() -> C>,
}

#[async_trait::async_trait]
impl<C: Send + Sync + std::fmt::Debug + 'static> object_store::CredentialProvider for NoCredentials<C> {
    type Credential = C;
    async fn get_credential(&self) -> object_store::Result<Arc<C>> {
        Err(object_store::Error::Generic {
            store: "credentials",
            source: self.why.clone().into(),
        })
    }
}

/// None when the store may be used as configured; else the provider that refuses every
/// request, saying what would do.
fn refuse_unless<C: Send + Sync + std::fmt::Debug + 'static>(
    url: &str,
    configured: bool,
    how: &str,
) -> Option<Arc<NoCredentials<C>>> {
    if configured || instance_credentials_allowed() {
        return None;
    }
    Some(Arc::new(NoCredentials {
        why: format!(
            "no credentials for {url} in this process's environment: set {how}, or \
             LOCUS_INSTANCE_CREDENTIALS=true to use this machine's own cloud role (nothing was \
             asked of the instance-metadata service)"
        ),
        _c: std::marker::PhantomData,
    }))
}

/// Opens `url`. With `create`, a missing `file://` directory is created; without, it
/// must exist.
pub fn open(url: &str, create: bool) -> Result<Opened> {
    // "s3://" must stay itself (a URL without a bucket), only a path's trailing '/' goes.
    let url = match url.find("://") {
        Some(i) => &url[..(i + 3 + url[i + 3..].trim_end_matches('/').len())],
        None => url,
    };
    let built = |r: object_store::Result<Arc<dyn ObjectStore>>| {
        r.map_err(|e| BackupError::Target(format!("cannot set up access to {url}: {e}")))
    };
    // As a config key, not whole client options: those would replace what the builder
    // read from the environment (AWS_ALLOW_HTTP, say).
    let timeout = request_timeout()?.map(|t| format!("{}ms", t.as_millis()));
    use object_store::ClientConfigKey::Timeout;
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(BackupError::Target(format!(
                "{url}: a file:// URL needs an absolute path (file:///dir)"
            )));
        }
        if create {
            std::fs::create_dir_all(path)
                .map_err(|e| BackupError::Target(format!("cannot create {path}: {e}")))?;
        }
        let store = object_store::local::LocalFileSystem::new_with_prefix(path)
            .map_err(|e| BackupError::Target(format!("{url}: {e}")))?;
        return Ok(Opened {
            store: Arc::new(store),
            prefix: String::new(),
            local_root: Some(PathBuf::from(path)),
        });
    }
    let (store, prefix): (Arc<dyn ObjectStore>, String) = if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = split(url, rest)?;
        let mut b = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry());
        {
            use object_store::aws::AmazonS3ConfigKey as K;
            let has = |k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
            let configured = has(K::AccessKeyId)
                || (has(K::WebIdentityTokenFile) || env_set("AWS_WEB_IDENTITY_TOKEN_FILE"))
                || has(K::ContainerCredentialsRelativeUri)
                || has(K::ContainerCredentialsFullUri)
                || env_set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
                || env_set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
                || b.get_config_value(&K::SkipSignature).is_some_and(|v| v == "true");
            if let Some(none) = refuse_unless::<object_store::aws::AwsCredential>(
                url,
                configured,
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_WEB_IDENTITY_TOKEN_FILE with \
                 AWS_ROLE_ARN, or AWS_SKIP_SIGNATURE=true for a public bucket)",
            ) {
                b = b.with_credentials(none);
            }
        }
        if let Some(t) = &timeout {
            b = b.with_config(object_store::aws::AmazonS3ConfigKey::Client(Timeout), t);
        }
        (built(b.build().map(|s| Arc::new(s) as _))?, prefix)
    } else if let Some(rest) = url.strip_prefix("gs://") {
        let (bucket, prefix) = split(url, rest)?;
        let mut b = object_store::gcp::GoogleCloudStorageBuilder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry());
        {
            use object_store::gcp::GoogleConfigKey as K;
            let has = |k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
            // The gcloud default credentials file is the operator's configuration too.
            let adc = std::env::var_os("HOME").is_some_and(|h| {
                PathBuf::from(h)
                    .join(".config/gcloud/application_default_credentials.json")
                    .is_file()
            });
            let configured = has(K::ServiceAccount)
                || has(K::ServiceAccountKey)
                || has(K::ApplicationCredentials)
                || has(K::BearerToken)
                || env_set("GOOGLE_APPLICATION_CREDENTIALS")
                || adc
                || b.get_config_value(&K::SkipSignature).is_some_and(|v| v == "true");
            if let Some(none) = refuse_unless::<object_store::gcp::GcpCredential>(
                url,
                configured,
                "GOOGLE_SERVICE_ACCOUNT (a key file) or GOOGLE_APPLICATION_CREDENTIALS",
            ) {
                b = b.with_credentials(none);
            }
        }
        if let Some(t) = &timeout {
            b = b.with_config(object_store::gcp::GoogleConfigKey::Client(Timeout), t);
        }
        (built(b.build().map(|s| Arc::new(s) as _))?, prefix)
    } else if let Some(rest) = url.strip_prefix("az://") {
        let (container, prefix) = split(url, rest)?;
        let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
            .with_container_name(container)
            .with_retry(retry());
        {
            use object_store::azure::AzureConfigKey as K;
            let has = |k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
            let yes = |k: K| b.get_config_value(&k).is_some_and(|v| v == "true");
            let configured = has(K::AccessKey)
                || has(K::SasKey)
                || has(K::Token)
                || (has(K::ClientId) && (has(K::ClientSecret) || has(K::FederatedTokenFile)))
                || yes(K::UseEmulator)
                || yes(K::UseAzureCli)
                || yes(K::SkipSignature);
            if let Some(none) = refuse_unless::<object_store::azure::AzureCredential>(
                url,
                configured,
                "AZURE_STORAGE_ACCOUNT_KEY (or a SAS, a bearer token, or a client id with its \
                 secret or federated token file)",
            ) {
                b = b.with_credentials(none);
            }
        }
        if let Some(t) = &timeout {
            b = b.with_config(object_store::azure::AzureConfigKey::Client(Timeout), t);
        }
        (built(b.build().map(|s| Arc::new(s) as _))?, prefix)
    } else {
        return Err(BackupError::Target(format!(
            "{url}: not an object-store URL (file:///dir, s3://bucket/prefix, gs://bucket/prefix \
             or az://container/prefix)"
        )));
    };
    Ok(Opened {
        store,
        prefix,
        local_root: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_are_told_apart_and_bad_urls_refused_with_the_reason() {
        let e = |u: &str| open(u, false).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e("ftp://x/y").contains("not an object-store URL"));
        assert!(e("file://relative").contains("absolute path"));
        for u in ["s3://", "gs:///x", "az://"] {
            assert!(e(u).contains("no bucket or container name"), "{u}: {}", e(u));
        }
        let d = tempfile::tempdir().unwrap();
        let o = open(&format!("file://{}/sub/", d.path().display()), true).unwrap();
        assert_eq!(o.local_root.unwrap(), d.path().join("sub"));
        assert!(d.path().join("sub").is_dir(), "created");
        for u in [
            "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/prefix",
            "az://container/prefix?sv=2024&sig=c2VjcmV0",
            "gs://user@bucket/x",
        ] {
            let why = e(u);
            assert!(why.contains("with credentials in it"), "{u}: {why}");
            assert!(
                !why.contains("wJalr") && !why.contains("c2VjcmV0"),
                "the secret is repeated: {why}"
            );
        }
    }
}
