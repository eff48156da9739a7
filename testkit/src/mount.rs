//! `locus mount` as an operator runs it, and what a test reads of it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

use super::*;

// ---------------------------------------------------------------------------------------
// Mounts

/// A `locus mount` started through the real CLI (daemonizing, as an operator runs it).
/// Dropping it unmounts (lazily, so a hung mount cannot hang the test) and kills the
/// mount process.
pub struct Mount {
    pub path: PathBuf,
    pub runtime_dir: PathBuf,
    pub log: PathBuf,
}

impl Metadata {
    /// `locus mount TARGET <run dir>/NAME [--node-socket SOCK] EXTRA…`; panics unless it
    /// reports ready.
    pub fn mount(&self, name: &str, target: &str, node: Option<&Node>, extra: &[&str]) -> Mount {
        let o = self.try_mount(name, target, node, extra);
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    /// Like `mount`, returning the CLI's output whatever it was.
    pub fn try_mount(
        &self,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
    ) -> (Mount, Output) {
        self.try_mount_on(None, name, target, node, extra)
    }

    /// `mount` run on test-bed host `on`: the mount process lives in its network
    /// namespace (so it reaches nodes over that host's link); the mountpoint is visible
    /// everywhere.
    pub fn mount_on(
        &self,
        on: &Host,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
    ) -> Mount {
        let o = self.try_mount_on(Some(on), name, target, node, extra);
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    /// `mount` with more environment for the mount process (`LOCUS_BULK=off`, say),
    /// without touching this process's own.
    pub fn mount_with_env(
        &self,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Mount {
        let o = self.spawn_mount(
            name,
            target,
            node,
            extra,
            How {
                env,
                ..How::default()
            },
        );
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    /// `mount` with the mount process (and the server it starts) limited to `nofile`
    /// open descriptors, soft and hard, as a host's limits would have it (`prlimit`).
    pub fn mount_with_nofile(
        &self,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
        nofile: u64,
    ) -> Mount {
        let how = How {
            nofile: Some(nofile),
            ..How::default()
        };
        let o = self.spawn_mount(name, target, node, extra, how);
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    /// `mount_on` with more environment for the mount process.
    pub fn mount_on_with_env(
        &self,
        on: &Host,
        name: &str,
        target: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Mount {
        let how = How {
            on: Some(on),
            env,
            ..How::default()
        };
        let o = self.spawn_mount(name, target, None, extra, how);
        assert!(o.1.status.success(), "mount failed: {}", stderr(&o.1));
        o.0
    }

    fn try_mount_on(
        &self,
        on: Option<&Host>,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
    ) -> (Mount, Output) {
        self.spawn_mount(name, target, node, extra, How { on, ..How::default() })
    }

    fn spawn_mount(
        &self,
        name: &str,
        target: &str,
        node: Option<&Node>,
        extra: &[&str],
        How { on, env, nofile }: How<'_>,
    ) -> (Mount, Output) {
        let path = self.dir.parent().unwrap().join(name);
        std::fs::create_dir_all(&path).unwrap();
        let runtime_dir = self.dir.parent().unwrap().join("runtime");
        let log = self.dir.parent().unwrap().join(format!("{name}.log"));
        let mut args = vec![
            "mount",
            target,
            path.to_str().unwrap(),
            "--log-file",
            log.to_str().unwrap(),
        ];
        if let Some(n) = node {
            args.push("--node-socket");
            args.push(n.socket.to_str().unwrap());
        }
        args.extend_from_slice(extra);
        // With a limit, `prlimit` sets it and runs `locus`.
        let program: &std::ffi::OsStr = match nofile {
            Some(_) => "prlimit".as_ref(),
            None => locus().as_os_str(),
        };
        let mut cmd = match on {
            Some(h) => h.command(program),
            None => Command::new(program),
        };
        if let Some(n) = nofile {
            cmd.arg(format!("--nofile={n}:{n}")).arg("--").arg(locus());
        }
        cmd.args(&args)
            .env("LOCUS_METADATA", self.url())
            .env("LOCUS_RUNTIME_DIR", &runtime_dir)
            .env("RUST_LOG", "info")
            .env_remove("LOCUS_CONFIG");
        if self.opts.tls {
            cmd.env("LOCUS_CA_CERT", self.dir.join("ca.pem"));
        }
        if self.opts.mtls {
            cmd.env("LOCUS_CLIENT_CERT", self.dir.join("admin.pem"))
                .env("LOCUS_CLIENT_KEY", self.dir.join("admin.key"));
        }
        // A test that gives its own token file gets no token from the environment too.
        match self.token("reader").or_else(|| self.token("admin")) {
            Some(t) if !extra.contains(&"--token-file") => cmd.env("LOCUS_TOKEN", t),
            _ => cmd.env_remove("LOCUS_TOKEN"),
        };
        cmd.envs(env.iter().copied());
        let out = cmd.output().expect("run locus mount");
        (
            Mount {
                path,
                runtime_dir,
                log,
            },
            out,
        )
    }
}

/// Where and how `locus mount` runs: on a test-bed host (else here), with more
/// environment, under a descriptor limit.
#[derive(Default)]
struct How<'a> {
    on: Option<&'a Host>,
    env: &'a [(&'a str, &'a str)],
    nofile: Option<u64>,
}

impl Mount {
    /// The mount's status file (what `locus status` shows): the one in the runtime dir
    /// that names this mountpoint.
    pub fn status(&self) -> serde_json::Value {
        let dir = self.runtime_dir.join("mounts");
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.path().extension().is_some_and(|x| x == "json") {
                let Ok(v) =
                    serde_json::from_slice::<serde_json::Value>(&std::fs::read(e.path()).unwrap_or_default())
                else {
                    continue;
                };
                if v["mountpoint"].as_str() == Some(self.path.to_str().unwrap()) {
                    return v;
                }
            }
        }
        panic!("no status file for {} in {}", self.path.display(), dir.display())
    }

    /// Waits (the status file is rewritten every two seconds) until `ok` holds for the
    /// mount's status, and returns it.
    pub async fn status_when(
        &self,
        what: &str,
        ok: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        wait_until(what, Duration::from_secs(10), || {
            let s = self.status();
            let good = ok(&s);
            async move { good.then_some(s) }
        })
        .await
    }

    /// The process that keeps the mount (its holder).
    pub fn pid(&self) -> u32 {
        self.status()["pid"].as_u64().unwrap() as u32
    }

    /// The process serving the kernel's requests now (restartable under the mount).
    pub fn server_pid(&self) -> u32 {
        self.status()["server_pid"].as_u64().unwrap() as u32
    }

    pub fn umount(&self) -> Output {
        Command::new(locus())
            .args(["umount", self.path.to_str().unwrap()])
            .env("LOCUS_RUNTIME_DIR", &self.runtime_dir)
            .output()
            .expect("run locus umount")
    }

    pub fn is_mounted(&self) -> bool {
        let want = self.path.display().to_string();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if !self.is_mounted() {
            return;
        }
        let pid = std::fs::read_dir(self.runtime_dir.join("mounts"))
            .ok()
            .and_then(|_| std::panic::catch_unwind(|| self.pid()).ok());
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(&self.path)
            .status();
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- mount log {} ---\n{}",
                self.log.display(),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Drops a file's pages from the page cache, so the next read asks the filesystem again.
pub fn drop_page_cache(path: &Path) {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    if let Ok(f) = std::fs::File::open(path) {
        let _ = posix_fadvise(&f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
    }
}

/// A process that makes mounts (the CSI driver), killed when the test ends however it
/// ends, and every mount under `root` lazily unmounted after it.
pub struct MountingProcess {
    pub child: Child,
    pub root: PathBuf,
}

impl Drop for MountingProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for m in mounts_under(&self.root).into_iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
    }
}

/// Reads `p` with O_DIRECT: through a mount, each read is one synchronous request the
/// server must answer, whatever the page cache holds, and whose error reaches the reader
/// (a failed read-ahead would be retried by the kernel and hide it).
pub fn read_direct(p: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(p)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out)?;
    Ok(out)
}

/// Mount points under `root`, outermost first.
pub fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(root))
        .collect()
}

/// `locus csi --mode MODE` for node `n`, as kubelet runs the node plugin: socket
/// `csi/csi.sock`, state in `csi-state`, kubelet's dir `kubelet` (all under the
/// harness), a reader's token; its log in `csi.log`.
pub fn spawn_csi_driver(h: &Harness, m: &Metadata, n: &Node, mode: &str) -> Child {
    spawn_csi_driver_with(h, m, n, mode, &[])
}

/// A NodePublishVolume as kubelet sends it for a read-only Locus volume at `target`:
/// `volumeAttributes.dataset` when given, and the node-publish secret's `token` when given.
pub fn csi_publish_request(
    volume: &str,
    target: &Path,
    dataset: Option<&str>,
    token: Option<&str>,
) -> locus_proto::csi::NodePublishVolumeRequest {
    use locus_proto::csi;
    csi::NodePublishVolumeRequest {
        volume_id: volume.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(csi::VolumeCapability {
            access_type: Some(csi::volume_capability::AccessType::Mount(Default::default())),
            access_mode: Some(csi::volume_capability::AccessMode {
                mode: csi::volume_capability::access_mode::Mode::MultiNodeReaderOnly as i32,
            }),
        }),
        readonly: true,
        volume_context: dataset
            .map(|d| [("dataset".to_string(), d.to_string())].into())
            .unwrap_or_default(),
        secrets: token
            .map(|t| [("token".to_string(), t.to_string())].into())
            .unwrap_or_default(),
        ..Default::default()
    }
}

/// `spawn_csi_driver` with more flags.
pub fn spawn_csi_driver_with(h: &Harness, m: &Metadata, n: &Node, mode: &str, extra: &[&str]) -> Child {
    let kubelet = h.path("kubelet");
    std::fs::create_dir_all(kubelet.join("pods")).unwrap();
    Command::new(locus())
        .args(["csi", "--mode", mode])
        .args(extra)
        .arg("--endpoint")
        .arg(format!("unix://{}", h.path("csi/csi.sock").display()))
        .args(["--node-id", "n1", "--node-socket"])
        .arg(&n.socket)
        .arg("--state-dir")
        .arg(h.path("csi-state"))
        .arg("--kubelet-dir")
        .arg(&kubelet)
        .env("LOCUS_METADATA", m.url())
        .env("LOCUS_TOKEN", m.token("reader").unwrap())
        .env("LOCUS_RUNTIME_DIR", h.path("runtime"))
        .env_remove("LOCUS_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(h.path("csi.log"))
                .unwrap(),
        )
        .spawn()
        .unwrap()
}

/// Waits until a Unix socket exists at `sock` (a daemon is listening).
pub async fn wait_for_socket(sock: &Path) {
    wait_until(
        &format!("the socket {}", sock.display()),
        Duration::from_secs(10),
        || async { sock.exists().then_some(()) },
    )
    .await
}

/// The fuse module's `enable_uring` parameter, set for the life of the value and put back
/// as it was when dropped.
pub struct EnableUring(Option<String>);

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

impl EnableUring {
    pub fn set(on: bool) -> EnableUring {
        let was = std::fs::read_to_string(ENABLE_URING).unwrap_or_else(|e| {
            panic!("{ENABLE_URING}: {e} (this test needs a kernel with FUSE over io_uring, Linux 6.14+, and root)")
        });
        std::fs::write(ENABLE_URING, if on { "Y" } else { "N" })
            .unwrap_or_else(|e| panic!("{ENABLE_URING}: {e} (this test needs root)"));
        EnableUring(Some(was.trim().to_string()))
    }
}

impl Drop for EnableUring {
    fn drop(&mut self) {
        if let Some(was) = self.0.take() {
            let _ = std::fs::write(ENABLE_URING, was);
        }
    }
}
