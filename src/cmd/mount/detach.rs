//! A mount from outside: the checks a mount point and a node socket pass before anything
//! starts, the detached child a plain `locus mount` starts and waits for, and `locus
//! umount`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::runtime::{private_runtime_dir, status_path};
use super::{MountArgs, UmountArgs};

/// Refuses what would fail later with a worse message.
pub(super) fn check_mountpoint(p: &Path) -> anyhow::Result<()> {
    let md = std::fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => anyhow::anyhow!("mountpoint {} does not exist", p.display()),
        std::io::ErrorKind::NotConnected => anyhow::anyhow!(
            "{} is a dead mount (its process is gone); run `locus umount {}` first",
            p.display(),
            p.display()
        ),
        _ => anyhow::anyhow!("mountpoint {}: {e}", p.display()),
    })?;
    if !md.is_dir() {
        bail!("mountpoint {} is not a directory", p.display());
    }
    if locus_fuse::is_mount_point(p) {
        bail!(
            "{} is busy: something is already mounted there (`locus umount {}` if it is ours)",
            p.display(),
            p.display()
        );
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("FUSE is not available: /dev/fuse is missing (load the fuse module, or in a container pass --device /dev/fuse)");
    }
    Ok(())
}

/// A mountpoint with files in it would have them hidden for as long as the mount lasts.
pub(super) fn check_empty(p: &Path, nonempty: bool) -> anyhow::Result<()> {
    let has = std::fs::read_dir(p)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if has && !nonempty {
        bail!(
            "mountpoint {} is not empty: the mount would hide its files until unmounted. Use an \
             empty directory, or pass --nonempty to mount over them anyway",
            p.display()
        );
    }
    Ok(())
}

/// The local node's socket, asked for by name: it must be there and answer, or every read
/// would silently go to remote replicas while the mount claimed to be local.
pub(super) fn check_node_socket(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let md = std::fs::metadata(p).map_err(|e| {
        anyhow::anyhow!(
            "--node-socket {}: {e} (is the cache node running, with --local-socket {}?)",
            p.display(),
            p.display()
        )
    })?;
    if !md.file_type().is_socket() {
        bail!("--node-socket {} is not a socket", p.display());
    }
    match std::os::unix::net::UnixStream::connect(p) {
        Ok(_) => Ok(()),
        // A user the node does not admit to its local socket reads through the open
        // socket beside it (blobs as descriptors, under this mount's grants).
        Err(e)
            if e.kind() == std::io::ErrorKind::PermissionDenied
                && locus_proto::open_socket::path_of(p).exists() =>
        {
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!(
            "--node-socket {}: nobody answers there ({e}); is the cache node running? \
             (without --node-socket the mount reads from remote replicas only)",
            p.display()
        )),
    }
}

/// Runs the mount in a detached child and waits for its first word.
pub(super) fn spawn_background(a: &MountArgs, mountpoint: &Path, token: Option<&str>) -> anyhow::Result<()> {
    private_runtime_dir()?;
    let log = match &a.log_file {
        Some(p) => crate::absolute(p.clone()),
        None => status_path(mountpoint).with_extension("log"),
    };
    if let Some(d) = log.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    // The default log is this mount point's alone, and its last mount has ended (the
    // mount point was free): a new mount starts it afresh, so what it shows is this
    // mount's. A --log-file the operator chose may be shared, so it is appended to, each
    // mount's part under a line that names it.
    let mut log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(a.log_file.is_some())
        .write(true)
        .truncate(a.log_file.is_none())
        .open(&log)
        .with_context(|| format!("cannot open log file {}", log.display()))?;
    let start_len = log_file.metadata().map(|m| m.len()).unwrap_or(0);
    if a.log_file.is_some() {
        use std::io::Write;
        let _ = writeln!(
            log_file,
            "--- locus mount {} at {}, {} ---",
            a.target,
            mountpoint.display(),
            locus_proto::human::format_time_ms(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64)
            )
        );
    }
    let exe = std::env::current_exe().context("cannot find the locus executable")?;
    // The token goes to the child in its environment, never in its argv, which every
    // user of the host can read in the process list.
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut given = std::env::args_os().skip(1);
    while let Some(arg) = given.next() {
        let a = arg.to_string_lossy();
        if a == "--token" || a == "--token-file" {
            given.next();
        } else if !(a.starts_with("--token=") || a.starts_with("--token-file=")) {
            args.push(arg);
        }
    }
    args.push("--notify-ready".into());
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(exe);
    if let Some(t) = token {
        cmd.env("LOCUS_TOKEN", t).env_remove("LOCUS_TOKEN_FILE");
    }
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file)
        // Its own process group: the terminal's Ctrl-C is not for it.
        .process_group(0)
        .spawn()
        .context("cannot start the mount process")?;
    let out = child.stdout.take().expect("stdout is piped");
    let mut line = String::new();
    let _ = BufReader::new(out).read_line(&mut line);
    if let Some(msg) = line.strip_prefix("ready ") {
        print!("{msg}");
        println!("  log: {}", log.display());
        return Ok(());
    }
    let status = child.wait().context("waiting for the mount process")?;
    let logged = std::fs::read(&log).unwrap_or_default();
    let tail = String::from_utf8_lossy(&logged[(start_len as usize).min(logged.len())..]).into_owned();
    let reason = tail
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("error: "))
        .map(str::to_string)
        .unwrap_or_else(|| format!("the mount process exited ({status}); see {}", log.display()));
    bail!("{reason}")
}

pub async fn umount(a: UmountArgs) -> anyhow::Result<()> {
    let mp = crate::absolute(a.mountpoint);
    if !locus_fuse::is_locus_mount(&mp) {
        bail!("{} is not a Locus mount", mp.display());
    }
    // fusermount3 works for the user who mounted; plain umount for root.
    let out = Command::new("fusermount3").arg("-u").arg(&mp).output();
    let ok = matches!(&out, Ok(o) if o.status.success());
    if !ok {
        let o2 = Command::new("umount").arg(&mp).output();
        if !matches!(&o2, Ok(o) if o.status.success()) {
            let why = out
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
                .unwrap_or_default();
            bail!(
                "cannot unmount {}: {why} (is a process still using it? `fuser -vm {}` shows which)",
                mp.display(),
                mp.display()
            );
        }
    }
    // The mount process notices and exits; wait briefly so a script can rmdir next.
    let deadline = Instant::now() + Duration::from_secs(10);
    while status_path(&mp).exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("unmounted {}", mp.display());
    Ok(())
}

/// How this mount reaches the node at `sock`: its local socket when the node admits this
/// user there (root, the node's user, its socket group), else the open socket beside it
/// (blobs as descriptors under this mount's grants: a user the node does not trust with
/// its data dir). `LOCUS_NODE_SOCKET_MODE=open` takes the open socket in any case.
pub(super) async fn local_node(
    sock: &std::path::Path,
) -> (
    Option<locus_proto::client::NodeClient>,
    Option<std::path::PathBuf>,
) {
    let open = locus_proto::open_socket::path_of(sock);
    let has_open = open.exists();
    if has_open && std::env::var("LOCUS_NODE_SOCKET_MODE").as_deref() == Ok("open") {
        tracing::info!(socket = %open.display(), "reading local blobs through the node's open socket (LOCUS_NODE_SOCKET_MODE=open)");
        return (None, Some(open));
    }
    let client = locus_proto::client::connect_local_node(sock);
    if !has_open {
        return (Some(client), None);
    }
    // The node drops a connection from a user it does not admit: the first call fails.
    let probe = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        client
            .clone()
            .get_node_status(locus_proto::nodepb::GetNodeStatusRequest::default()),
    )
    .await;
    match probe {
        Ok(Ok(_)) => (Some(client), None),
        Ok(Err(e)) if e.code() != tonic::Code::DeadlineExceeded => {
            tracing::info!(
                socket = %sock.display(),
                "the node's local socket does not admit this user ({}); reading local blobs through its open socket",
                e.message()
            );
            (None, Some(open))
        }
        // Slow, not refusing: keep the socket, whose calls have their own limits.
        _ => (Some(client), None),
    }
}
