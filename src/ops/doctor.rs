//! `locus doctor`'s checks, each a verdict (pass, warn, fail), a line of what it found
//! and, when not passing, what to do. Host checks need nothing running: the FUSE device,
//! fusermount3, passthrough, FUSE over io_uring, the open-file limit, the cache node's
//! socket, data dirs, certificates. Cluster checks ask the metadata service: reachable,
//! the clock against it, nodes down, the age of the last committed backup. The command
//! (`src/cmd/doctor.rs`) picks which to run and prints them.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use locus_proto::client::MetadataClient;
use locus_proto::human::format_size;
use locus_proto::pb;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
}

#[derive(Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub verdict: Verdict,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

pub(crate) fn check(
    name: impl Into<String>,
    verdict: Verdict,
    detail: impl Into<String>,
    fix: Option<&str>,
) -> Check {
    Check {
        name: name.into(),
        verdict,
        detail: detail.into(),
        fix: fix.map(str::to_string),
    }
}

/// The host checks that need no argument: FUSE device, fusermount3, passthrough, FUSE
/// over io_uring, the open-file limit.
pub fn host() -> Vec<Check> {
    vec![
        fuse_device(),
        fusermount(),
        passthrough(),
        fuse_io_uring(),
        open_files(),
    ]
}

fn fuse_device() -> Check {
    use std::os::unix::fs::FileTypeExt;
    const NAME: &str = "fuse device";
    let fix = Some("load the module (modprobe fuse); in a container, pass --device /dev/fuse");
    let md = match std::fs::metadata("/dev/fuse") {
        Ok(m) => m,
        Err(e) => return check(NAME, Verdict::Fail, format!("/dev/fuse: {e}"), fix),
    };
    use std::os::unix::fs::MetadataExt;
    let rdev = md.rdev();
    if !md.file_type().is_char_device()
        || nix::sys::stat::major(rdev) != 10
        || nix::sys::stat::minor(rdev) != 229
    {
        return check(
            NAME,
            Verdict::Fail,
            "/dev/fuse is not the FUSE device (char 10:229)",
            fix,
        );
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        Ok(_) => check(NAME, Verdict::Pass, "/dev/fuse opens read-write", None),
        Err(e) => check(
            NAME,
            Verdict::Fail,
            format!("cannot open /dev/fuse: {e}"),
            Some("give this user access to /dev/fuse (mode 0666 is the default)"),
        ),
    }
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

fn fusermount() -> Check {
    const NAME: &str = "fusermount3";
    match on_path("fusermount3") {
        Some(p) => check(NAME, Verdict::Pass, p.display().to_string(), None),
        None if euid() == 0 => check(
            NAME,
            Verdict::Warn,
            "not on PATH (root mounts without it; other users cannot)",
            Some("install fuse3"),
        ),
        None => check(
            NAME,
            Verdict::Fail,
            "not on PATH: this user cannot mount",
            Some("install fuse3"),
        ),
    }
}

/// The kernel's (major, minor) release.
fn kernel() -> Option<(u32, u32)> {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut it = r.trim().split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Whether this process holds CAP_SYS_ADMIN (effective).
fn cap_sys_admin() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 21) != 0)
}

fn passthrough() -> Check {
    const NAME: &str = "fuse passthrough";
    let k = kernel();
    let detail = |why: &str| match k {
        Some((a, b)) => format!("kernel {a}.{b}: {why}"),
        None => why.to_string(),
    };
    if k.is_none_or(|v| v < (6, 9)) {
        return check(
            NAME,
            Verdict::Warn,
            detail("no FUSE passthrough before 6.9; local files are read through the mount"),
            Some("a kernel of 6.9 or later reads local blobs at disk speed"),
        );
    }
    if !cap_sys_admin() {
        return check(
            NAME,
            Verdict::Warn,
            detail("passthrough needs CAP_SYS_ADMIN in the mount process, which this one lacks"),
            Some("run mounts as root or with CAP_SYS_ADMIN"),
        );
    }
    check(NAME, Verdict::Pass, detail("available"), None)
}

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether mounts can take their requests through FUSE over io_uring
/// (`--fuse-transport io-uring`), and how to switch it on.
fn fuse_io_uring() -> Check {
    io_uring_check(
        std::fs::read_to_string(ENABLE_URING).ok().as_deref(),
        std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
            .ok()
            .as_deref(),
    )
}

/// The check from the fuse module's `enable_uring` parameter (absent: the kernel has no
/// FUSE over io_uring) and the `kernel.io_uring_disabled` sysctl. Never a failure:
/// mounts serve through /dev/fuse by default and fall back to it.
fn io_uring_check(enable_uring: Option<&str>, io_uring_disabled: Option<&str>) -> Check {
    const NAME: &str = "fuse over io_uring";
    let Some(param) = enable_uring else {
        return check(
            NAME,
            Verdict::Pass,
            "not in this kernel (Linux 6.14+ built with CONFIG_FUSE_IO_URING); mounts use /dev/fuse",
            None,
        );
    };
    if io_uring_disabled.is_some_and(|v| v.trim() == "2") {
        return check(
            NAME,
            Verdict::Warn,
            "io_uring is switched off for every process (kernel.io_uring_disabled = 2): \
             --fuse-transport io-uring mounts fall back to /dev/fuse",
            Some("sysctl kernel.io_uring_disabled=0"),
        );
    }
    if matches!(param.trim(), "Y" | "y" | "1") {
        check(
            NAME,
            Verdict::Pass,
            "available and enabled: mounts with --fuse-transport io-uring use it",
            None,
        )
    } else {
        check(
            NAME,
            Verdict::Pass,
            "available, not enabled: --fuse-transport io-uring mounts fall back to /dev/fuse",
            Some(
                "echo Y > /sys/module/fuse/parameters/enable_uring (as root; to keep it, \
                 `options fuse enable_uring=1` in /etc/modprobe.d/ or fuse.enable_uring=1 on the kernel command line)",
            ),
        )
    }
}

fn open_files() -> Check {
    const NAME: &str = "open files limit";
    use nix::sys::resource::{getrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return check(NAME, Verdict::Warn, "cannot read RLIMIT_NOFILE", None);
    };
    let fix = Some("raise it (LimitNOFILE=1048576 in the unit, or ulimit -n)");
    let d = format!("{soft} (hard {hard})");
    match soft {
        n if n >= 65_536 => check(NAME, Verdict::Pass, d, None),
        n if n >= 1024 => check(
            NAME,
            Verdict::Warn,
            format!("{d}: a node or mount with many readers may run out"),
            fix,
        ),
        _ => check(NAME, Verdict::Fail, format!("{d}: too low to serve"), fix),
    }
}

/// The cache node's Unix socket: `given`, else the default path if it exists; none there
/// is a warning (mounts here then read from other hosts).
pub async fn node_socket(given: Option<&Path>) -> Option<Check> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    const NAME: &str = "node socket";
    let default = Path::new("/run/locus/node.sock");
    let path = match given {
        Some(p) => p,
        None if default.exists() => default,
        None => {
            return Some(check(
                NAME,
                Verdict::Warn,
                "no node socket at /run/locus/node.sock: mounts here read from other hosts",
                Some("run a cache node on this host, or give --node-socket"),
            ))
        }
    };
    let shown = path.display();
    let md = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => {
            return Some(check(
                NAME,
                Verdict::Fail,
                format!("{shown}: {e}"),
                Some("is the node running with --local-socket here?"),
            ))
        }
    };
    if !md.file_type().is_socket() {
        return Some(check(
            NAME,
            Verdict::Fail,
            format!("{shown} is not a socket"),
            None,
        ));
    }
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o002 != 0 {
        return Some(check(
            NAME,
            Verdict::Fail,
            format!("{shown} has mode {mode:o}: any user on this host can reach the node"),
            Some("restart the node (it creates the socket 0660) and do not chmod it; grant access with --local-socket-group"),
        ));
    }
    let mut c = locus_proto::client::connect_local_node(path);
    let status = tokio::time::timeout(
        Duration::from_secs(5),
        c.get_node_status(locus_proto::nodepb::GetNodeStatusRequest {}),
    )
    .await;
    Some(match status {
        Ok(Ok(s)) => {
            let s = s.into_inner();
            check(
                NAME,
                Verdict::Pass,
                format!(
                    "{shown} (mode {mode:o}): node {}, {} of {} used",
                    s.id,
                    format_size(s.used_bytes),
                    format_size(s.capacity_bytes)
                ),
                None,
            )
        }
        Ok(Err(e)) => check(
            NAME,
            Verdict::Fail,
            format!("{shown}: the node refused: {}", e.message()),
            Some("run as root, the node's user, or a member of its --local-socket-group"),
        ),
        Err(_) => check(
            NAME,
            Verdict::Fail,
            format!("{shown}: no answer within 5 s"),
            None,
        ),
    })
}

/// A filesystem's type name from its statfs magic.
fn fs_type(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlay",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        _ => "other",
    }
}

/// A node data dir: reachable, on a local disk, with room.
pub fn data_dir(dir: &Path) -> Check {
    let name = format!("data dir {}", dir.display());
    if dir.as_os_str().as_encoded_bytes().contains(&0) {
        return check(name, Verdict::Fail, "the path holds a NUL byte", None);
    }
    let (vfs, fs) = match (nix::sys::statvfs::statvfs(dir), nix::sys::statfs::statfs(dir)) {
        (Ok(vfs), Ok(fs)) => (vfs, fs),
        (Err(e), _) | (_, Err(e)) => {
            return check(
                name,
                Verdict::Fail,
                std::io::Error::from(e).to_string(),
                Some("create it, or fix the path"),
            )
        }
    };
    let total = vfs.blocks() * vfs.fragment_size();
    let free = vfs.blocks_available() * vfs.fragment_size();
    let kind = fs_type(fs.filesystem_type().0);
    let d = format!("{kind}, {} free of {}", format_size(free), format_size(total));
    // A node stops taking blobs at its reserve; below 1% (or 64 MiB) it cannot even
    // write its index.
    if free < (64 << 20).max(total / 100) {
        return check(
            name,
            Verdict::Fail,
            format!("{d}: full"),
            Some("free space, or lower --capacity so the node evicts"),
        );
    }
    if matches!(kind, "tmpfs" | "overlay" | "nfs" | "fuse") {
        return check(
            name,
            Verdict::Warn,
            format!("{d}: not a local disk (blobs belong on local NVMe)"),
            None,
        );
    }
    if free < total / 10 {
        return check(name, Verdict::Warn, format!("{d}: under 10% free"), None);
    }
    check(name, Verdict::Pass, d, None)
}

/// A PEM file's certificates: the first to expire fails once expired and warns within
/// `warn_within`.
pub fn certificate(path: &Path, warn_within: Duration) -> Check {
    let name = format!(
        "certificate {}",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let shown = path.display();
    let pem = match std::fs::read(path) {
        Ok(p) => p,
        Err(e) => return check(name, Verdict::Fail, format!("{shown}: {e}"), None),
    };
    let ends = match locus_proto::tls::certificates_not_after(&pem) {
        Ok(e) => e,
        Err(e) => return check(name, Verdict::Fail, format!("{shown}: {e}"), None),
    };
    let first = *ends.iter().min().expect("at least one certificate");
    let now = (locus_proto::grant::now_ms() / 1000) as i64;
    let when = locus_proto::human::format_time_ms(first * 1000);
    let fix = Some("issue a new one (locus tls cert) and restart what serves it");
    if first <= now {
        check(name, Verdict::Fail, format!("{shown}: expired {when}"), fix)
    } else if first - now < warn_within.as_secs() as i64 {
        check(
            name,
            Verdict::Warn,
            format!("{shown}: expires {when}, in {} days", (first - now) / 86_400),
            fix,
        )
    } else {
        check(name, Verdict::Pass, format!("{shown}: valid until {when}"), None)
    }
}

/// The cluster as the metadata service at `url` (reached through `connect`) sees it; a
/// backup older than `backup_max_age` fails.
pub async fn cluster(
    url: &str,
    connect: impl Future<Output = anyhow::Result<MetadataClient>>,
    backup_max_age: Duration,
) -> Vec<Check> {
    const NAME: &str = "metadata service";
    let fix = Some("check --metadata / LOCUS_METADATA, the network, and that the service runs");
    let asked = locus_proto::grant::now_ms();
    let info = tokio::time::timeout(Duration::from_secs(5), async {
        let mut c = connect.await?;
        let info = c
            .get_cluster_info(pb::GetClusterInfoRequest {})
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        Ok::<_, anyhow::Error>((c, info))
    })
    .await;
    let answered = locus_proto::grant::now_ms();
    let (mut c, info) = match info {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return vec![check(NAME, Verdict::Fail, format!("{}: {e:#}", url), fix)],
        Err(_) => {
            return vec![check(
                NAME,
                Verdict::Fail,
                format!("{}: no answer within 5 s", url),
                fix,
            )]
        }
    };
    let mut out = vec![check(
        NAME,
        Verdict::Pass,
        format!(
            "{} (cluster {}, v{}, as {} ({}))",
            url, info.cluster_id, info.server_version, info.caller_name, info.caller_role
        ),
        None,
    )];
    // The service's clock against the middle of the round trip.
    if info.now_unix_ms > 0 {
        let skew_ms = info.now_unix_ms as i64 - ((asked + answered) / 2) as i64;
        let d = format!("{:+.3} s against the metadata service", skew_ms as f64 / 1000.0);
        let fix = Some("run NTP (chrony or systemd-timesyncd) on every host");
        out.push(match skew_ms.unsigned_abs() {
            // Grants hold 10 minutes and tolerate a node 5 minutes behind.
            n if n > 60_000 => check("clock", Verdict::Fail, d, fix),
            n if n > 1_000 => check("clock", Verdict::Warn, d, fix),
            _ => check("clock", Verdict::Pass, d, None),
        });
    }
    match c.list_nodes(pb::ListNodesRequest {}).await {
        Ok(r) => {
            let nodes = r.into_inner().nodes;
            let down: Vec<_> = nodes
                .iter()
                .filter(|n| n.state != pb::NodeState::Up as i32)
                .map(|n| n.id.as_str())
                .collect();
            let d = format!("{} registered, {} down", nodes.len(), down.len());
            out.push(if down.is_empty() {
                check("nodes", Verdict::Pass, d, None)
            } else {
                check(
                    "nodes",
                    Verdict::Warn,
                    format!("{d}: {}", down.join(", ")),
                    Some("repair moves their replicas; `locus node list` shows when each was last heard"),
                )
            });
        }
        Err(s) => out.push(check("nodes", Verdict::Fail, s.message().to_string(), None)),
    }
    match c.list_backups(pb::ListBackupsRequest {}).await {
        Ok(r) => {
            let last = r
                .into_inner()
                .backups
                .into_iter()
                .filter(|b| !b.snapshot.is_empty() && !b.restored)
                .max_by_key(|b| b.recorded_at_ms);
            let fix = Some("run `locus backup run` (the locus-backup timer does it nightly)");
            out.push(match last {
                None => check("last backup", Verdict::Warn, "none committed", fix),
                Some(b) => {
                    let age = Duration::from_millis((answered as i64 - b.recorded_at_ms).max(0) as u64);
                    let d = format!("{} at {} ({} ago)", b.snapshot, b.url, ago(age));
                    if age > backup_max_age {
                        check("last backup", Verdict::Fail, format!("{d}: stale"), fix)
                    } else {
                        check("last backup", Verdict::Pass, d, None)
                    }
                }
            });
        }
        Err(s) => out.push(check("last backup", Verdict::Fail, s.message().to_string(), None)),
    }
    out
}

/// "2d 3h", "5h 12m", "40s": an age at a glance.
fn ago(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_is_checked_for_existence_and_room_and_a_bad_path_fails() {
        let d = tempfile::tempdir().unwrap();
        let ok = data_dir(d.path());
        assert_ne!(ok.verdict, Verdict::Fail, "{ok:?}");
        assert!(ok.detail.contains(" free of "), "{}", ok.detail);
        let missing = data_dir(&d.path().join("absent"));
        assert_eq!(missing.verdict, Verdict::Fail);
        assert!(missing.fix.as_deref().is_some_and(|f| f.contains("create it")));
        use std::os::unix::ffi::OsStrExt;
        let nul = data_dir(Path::new(std::ffi::OsStr::from_bytes(b"/tmp/a\0b")));
        assert_eq!(nul.verdict, Verdict::Fail);
        assert!(nul.detail.contains("NUL"), "{}", nul.detail);
    }

    #[test]
    fn a_certificate_fails_once_expired_and_warns_within_the_window() {
        let d = tempfile::tempdir().unwrap();
        let pem = |name: &str, not_after: (i32, u8, u8)| {
            let mut p = rcgen::CertificateParams::new(vec!["doctor.test".to_string()]).unwrap();
            p.not_before = rcgen::date_time_ymd(2019, 1, 1);
            p.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
            let key = rcgen::KeyPair::generate().unwrap();
            let path = d.path().join(name);
            std::fs::write(&path, p.self_signed(&key).unwrap().pem()).unwrap();
            path
        };
        let day = Duration::from_secs(86_400);
        let expired = certificate(&pem("old.pem", (2020, 1, 1)), 14 * day);
        assert_eq!(expired.verdict, Verdict::Fail);
        assert!(
            expired.detail.contains("expired 2020-01-01"),
            "{}",
            expired.detail
        );
        assert!(expired.fix.is_some());
        let good = pem("good.pem", (2999, 1, 1));
        let valid = certificate(&good, 14 * day);
        assert_eq!(valid.verdict, Verdict::Pass, "{valid:?}");
        assert!(
            valid.detail.contains("valid until 2999-01-01"),
            "{}",
            valid.detail
        );
        // Within the window: warns, saying how many days are left.
        let soon = certificate(&good, 400_000 * day);
        assert_eq!(soon.verdict, Verdict::Warn, "{soon:?}");
        assert!(soon.detail.contains("days"), "{}", soon.detail);
        std::fs::write(d.path().join("junk.pem"), "not a certificate").unwrap();
        assert_eq!(
            certificate(&d.path().join("junk.pem"), day).verdict,
            Verdict::Fail
        );
        assert_eq!(
            certificate(&d.path().join("none.pem"), day).verdict,
            Verdict::Fail
        );
    }

    #[tokio::test]
    async fn a_node_socket_that_is_not_one_or_that_anyone_may_use_fails() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("plain");
        std::fs::write(&file, b"").unwrap();
        let c = node_socket(Some(&file)).await.unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.contains("is not a socket"), "{}", c.detail);
        let c = node_socket(Some(&d.path().join("absent"))).await.unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        let sock = d.path().join("node.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
        let c = node_socket(Some(&sock)).await.unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.contains("any user on this host"), "{}", c.detail);
    }

    #[test]
    fn ages_read_at_a_glance() {
        let s = Duration::from_secs;
        assert_eq!(ago(s(40)), "40s");
        assert_eq!(ago(s(5 * 60 + 3)), "5m 3s");
        assert_eq!(ago(s(5 * 3600 + 12 * 60)), "5h 12m");
        assert_eq!(ago(s(2 * 86_400 + 3 * 3600)), "2d 3h");
    }

    #[test]
    fn io_uring_check_says_whether_it_is_there_on_and_allowed() {
        let absent = io_uring_check(None, Some("0"));
        assert_eq!(absent.verdict, Verdict::Pass);
        assert!(absent.detail.contains("not in this kernel"), "{}", absent.detail);
        let off = io_uring_check(Some("N\n"), Some("0\n"));
        assert_eq!(off.verdict, Verdict::Pass);
        assert!(off.detail.contains("not enabled"), "{}", off.detail);
        assert!(
            off.fix.as_deref().is_some_and(|f| f.contains("enable_uring")),
            "{:?}",
            off.fix
        );
        let on = io_uring_check(Some("Y\n"), Some("0\n"));
        assert_eq!((on.verdict, on.fix.is_none()), (Verdict::Pass, true));
        assert!(on.detail.contains("enabled"), "{}", on.detail);
        let forbidden = io_uring_check(Some("Y\n"), Some("2\n"));
        assert_eq!(forbidden.verdict, Verdict::Warn);
        assert!(
            forbidden.detail.contains("io_uring_disabled"),
            "{}",
            forbidden.detail
        );
    }
}
