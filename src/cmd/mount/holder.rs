//! Mounts that survive their process: the holder of a mount's FUSE connection.
//!
//! `locus mount` runs as two processes. The **holder** (the process `locus mount` starts,
//! or runs in the foreground) does no filesystem work: it starts the **server** (itself
//! again, with `--serve`), keeps a copy of the server's `/dev/fuse` descriptor, and when
//! the server dies — a crash, an OOM kill, `kill -9` — starts another on the same live
//! connection. Readers see a pause, never "Transport endpoint is not connected":
//!
//! - requests the kernel had not handed out yet wait in its queue;
//! - requests the dead server had read but not answered sit on the connection's
//!   processing list; the new server asks the kernel to queue them again
//!   (`FUSE_NOTIFY_RESEND`, Linux 6.9+); under FUSE over io_uring, where the kernel
//!   resends nothing, they sit in the dead server's ring entries, whose memory (a memfd)
//!   the holder keeps: the new server maps it at the same address and answers them;
//! - the kernel sends INIT once per connection, so the holder keeps what the first server
//!   negotiated and the next one restores it (`Session::from_initialized_fd`, vendored);
//! - inode numbers come from the manifest, the same in every server; a file handle from
//!   the dead server is unknown to the next, which then reads by inode;
//! - passthrough backing ids belong to the connection: the server reports each one
//!   registered or closed before the kernel sees it, and counts the files open on each
//!   in memory the holder keeps (a memfd); the next server reuses the ids files still
//!   use (the kernel refuses a second backing file for an inode whose file is open) and
//!   closes the rest (`locus_fuse::fs::takeover`);
//! - a file handle from the dead server is never one the next issues (handles count from
//!   the server's pid).
//!
//! The server talks to the holder over a Unix datagram socket pair (`LOCUS_MOUNT_CHANNEL`,
//! inherited): the descriptor and the negotiated state (with the descriptor attached),
//! the ring entries' memory, the open counts' memory, the ready line, and backing ids.
//! The holder hands a restarted server the descriptor (`LOCUS_MOUNT_FUSE_FD`), the ring
//! memory (`LOCUS_MOUNT_RING_FD`), the open counts (`LOCUS_MOUNT_OPENS_FD`) and a state
//! file (`LOCUS_MOUNT_SESSION`). The server's side of this contract is
//! `locus_fuse::handoff`; the socket protocol is `server_side`.
//!
//! Signals to the holder: TERM/INT unmount and stop (forwarded to the server, which
//! unmounts); HUP restarts the server from the executable now at the path the holder was
//! started from — an upgrade in place, under the readers' feet. Under FUSE over io_uring
//! the server is first told to freeze its queues (SIGUSR2), and killed once every free
//! ring entry holds a request (`hold_ring_queues`): a request reaching a free entry of a
//! dying server would fail.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::Signal;
use nix::sys::socket::{self, ControlMessageOwned, MsgFlags};

use super::runtime::status_path;

const CHANNEL_ENV: &str = "LOCUS_MOUNT_CHANNEL";
const FUSE_FD_ENV: &str = "LOCUS_MOUNT_FUSE_FD";
const SESSION_ENV: &str = "LOCUS_MOUNT_SESSION";
const RING_FD_ENV: &str = "LOCUS_MOUNT_RING_FD";
const OPENS_FD_ENV: &str = "LOCUS_MOUNT_OPENS_FD";
/// How long a planned restart waits for the server's io_uring queues to freeze.
const FREEZE_WAIT: Duration = Duration::from_secs(5);

use locus_fuse::fs::Backing;
pub use locus_fuse::handoff::{RingMemory, SessionState};

/// The ring entries' memory the holder keeps for the next server, and their layout.
type KeptRing = Option<(OwnedFd, RingMemory)>;
/// The open counts' memory the holder keeps for the next server, and how many inodes.
type KeptCounts = Option<(OwnedFd, u64)>;

/// A message from the server.
enum Msg {
    Session(OwnedFd, SessionState),
    Rings(OwnedFd, RingMemory),
    /// The memory of the counts of files open with passthrough, for `len` inodes.
    OpenCounts(OwnedFd, u64),
    /// The server has stopped its io_uring queues: requests now stay where they land.
    Freezing,
    /// The frozen server's ring entries are all held: it may be killed.
    Held,
    Ready(String),
    Backing(u64, locus_fuse::fs::Backing),
}

// The server's side.
mod server_side;
pub use server_side::{takeover_from_env, Channel};

/// Before a planned restart of an io_uring mount's server: `depth` STATFS calls from a
/// thread pinned to each CPU, into the frozen server (`fuser::RingControl`). Each takes a
/// free ring entry of its CPU's queue, or waits in the kernel's queue once none is left,
/// so that no request can meet a free entry of the server while it dies. They return
/// when the next server answers them.
pub fn hold_ring_queues(mp: &Path, depth: u16) {
    locus_fuse::handoff::statfs_from_each_cpu(mp, depth, "ring-hold");
}

/// Detaches the mount at `mp` if it is still the one on connection `fuse` (mounted as
/// `device`). Once a mount ended from outside (`fusermount3 -u`, `umount`), the same path
/// may already hold a new mount, which a plain unmount by path would tear down under its
/// readers: so nothing is done unless the connection is alive (its device number cannot
/// have been reused) and the mount table shows that device at the path.
pub fn unmount_if_ours(mp: &Path, fuse: BorrowedFd<'_>, device: Option<&str>) {
    if !connection_alive(fuse) {
        return;
    }
    let ours = match device {
        Some(d) => locus_fuse::is_locus_mount_on(mp, d),
        // A state from before devices were recorded: the live connection is the best
        // evidence there is.
        None => locus_fuse::is_locus_mount(mp),
    };
    if ours {
        lazy_unmount(mp);
    }
}

/// Whether the kernel still serves this FUSE connection: an unmounted (or aborted) one
/// reports an error on poll.
pub fn connection_alive(fuse: BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(fuse, PollFlags::POLLOUT)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(_) => !fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLNVAL)),
        Err(_) => false,
    }
}

/// Detaches the mount at `mp` (lazily: open files keep working until closed).
fn lazy_unmount(mp: &Path) {
    let ok = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg("-z")
        .arg(mp)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(mp)
            .stderr(Stdio::null())
            .status();
    }
}

/// An inherited variable naming a descriptor, read at most once per process: a second
/// reader would own the same descriptor twice. The variable is left in the environment
/// (removing it while the runtime's threads run is a data race on `environ`); nothing this
/// process starts reads it, and the descriptors are close-on-exec.
fn take_env(name: &'static str) -> Option<String> {
    static TAKEN: Mutex<Vec<&str>> = Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if taken.contains(&name) {
        return None;
    }
    let v = std::env::var(name).ok()?;
    taken.push(name);
    Some(v)
}

fn set_cloexec(fd: RawFd) {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    // SAFETY: fcntl on a descriptor number; a wrong one fails harmlessly.
    #[allow(unsafe_code)]
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    let _ = fcntl(b, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
}

// ---------------------------------------------------------------------------------------
// The holder's side.

/// Runs the holder until the mount ends. `notify_ready`: print "ready ..." on stdout for
/// the parent that started us in the background.
/// `token`: the resolved token, given to the server in its environment, never its argv.
pub async fn run(mountpoint: &Path, notify_ready: bool, token: Option<&str>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // Resolved once: a restarted server runs whatever executable is at this path then.
    let exe = std::env::current_exe().context("cannot find the locus executable")?;
    let mut args: Vec<OsString> = Vec::new();
    let mut given = std::env::args_os().skip(1);
    while let Some(arg) = given.next() {
        let s = arg.to_string_lossy();
        if s == "--token" || s == "--token-file" {
            given.next();
        } else if !(s.starts_with("--token=")
            || s.starts_with("--token-file=")
            || s == "--notify-ready"
            || s == "--foreground")
        {
            args.push(arg);
        }
    }
    args.push("--serve".into());
    // Named by our pid: a mount made at the same path after this one ended outside our
    // knowledge has its own.
    let session_file = status_path(mountpoint).with_extension(format!("{}.session.json", std::process::id()));
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;

    let mut fuse: Option<OwnedFd> = None;
    let mut state: Option<SessionState> = None;
    let mut ring: KeptRing = None;
    let mut counts: KeptCounts = None;
    let mut ready = false;
    let mut stopping = false;
    let mut quick_deaths = 0u32;
    let code = loop {
        let (ours, theirs) = socket::socketpair(
            socket::AddressFamily::Unix,
            socket::SockType::SeqPacket,
            None,
            socket::SockFlag::SOCK_CLOEXEC,
        )
        .context("socketpair")?;
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .env(CHANNEL_ENV, theirs.as_raw_fd().to_string());
        if let Some(t) = token {
            cmd.env("LOCUS_TOKEN", t).env_remove("LOCUS_TOKEN_FILE");
        }
        let mut pass = vec![theirs.as_raw_fd()];
        if let (Some(fd), Some(s)) = (&fuse, &state) {
            let mut s = s.clone();
            s.ring_memory = None;
            if let Some((memory, layout)) = ring.as_ref().filter(|_| s.io_uring_payload.is_some()) {
                s.ring_memory = Some(*layout);
                cmd.env(RING_FD_ENV, memory.as_raw_fd().to_string());
                pass.push(memory.as_raw_fd());
            }
            s.open_counts = None;
            if let Some((memory, len)) = &counts {
                s.open_counts = Some(*len);
                cmd.env(OPENS_FD_ENV, memory.as_raw_fd().to_string());
                pass.push(memory.as_raw_fd());
            }
            write_private(&session_file, &serde_json::to_vec(&s)?)?;
            cmd.env(FUSE_FD_ENV, fd.as_raw_fd().to_string())
                .env(SESSION_ENV, &session_file);
            pass.push(fd.as_raw_fd());
        }
        // SAFETY: between fork and exec only fcntl(2), which is async-signal-safe, runs.
        #[allow(unsafe_code)]
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &pass {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("cannot start the mount server")?;
        drop(theirs);
        let started = Instant::now();
        let mut rx = receive(ours);
        let mut killed_for_restart = false;
        // A planned restart of an io_uring server waits (a while) for its queues to freeze.
        let mut freezing: Option<tokio::time::Instant> = None;
        // This server said it serves (it takes SIGUSR2 only from then on).
        let mut serving = false;
        let status = loop {
            let until = freezing.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                Some(m) = rx.recv() => {
                    if matches!(m, Msg::Held) {
                        if freezing.take().is_some() {
                            signal_child(&child, Signal::SIGKILL);
                        }
                    } else if matches!(m, Msg::Freezing) {
                        // Only now: sent before, they would have been answered, and
                        // their entries left free again.
                        if let (Some(_), Some((_, l))) = (freezing, &ring) {
                            hold_ring_queues(mountpoint, l.depth);
                        }
                    } else {
                        serving |= matches!(m, Msg::Ready(_));
                        apply(m, &mut fuse, &mut state, (&mut ring, &mut counts), &mut ready, notify_ready);
                    }
                }
                // Until it says so, more requests on every CPU: a queue whose free
                // entries outnumber what arrived would otherwise wait out the deadline.
                _ = tokio::time::sleep(Duration::from_millis(50)), if freezing.is_some() => {
                    hold_ring_queues(mountpoint, 1);
                }
                _ = tokio::time::sleep_until(until), if freezing.is_some() => {
                    tracing::warn!("the mount server did not freeze its io_uring queues in time: restarting it anyway");
                    freezing = None;
                    signal_child(&child, Signal::SIGKILL);
                }
                st = child.wait() => break st?,
                _ = term.recv() => { stopping = true; signal_child(&child, Signal::SIGTERM) }
                _ = int.recv() => { stopping = true; signal_child(&child, Signal::SIGTERM) }
                _ = hup.recv() => {
                    if fuse.is_some() && !stopping && freezing.is_none() {
                        tracing::info!("SIGHUP: restarting the mount server from {}", exe.display());
                        killed_for_restart = true;
                        let depth = ring.as_ref().map(|(_, l)| l.depth);
                        let ring_mount = state.as_ref().is_some_and(|s| s.io_uring_payload.is_some());
                        match depth.filter(|_| ring_mount && serving) {
                            // Under io_uring a request that meets a free entry of a dying
                            // server fails: the server freezes first, and every free entry
                            // is filled (see `hold_ring_queues`).
                            Some(_) => {
                                signal_child(&child, Signal::SIGUSR2);
                                freezing = Some(tokio::time::Instant::now() + FREEZE_WAIT);
                            }
                            None => signal_child(&child, Signal::SIGKILL),
                        }
                    }
                }
            }
        };
        // What the server sent just before it ended (a backing id, above all).
        while let Some(m) = rx.recv().await {
            apply(
                m,
                &mut fuse,
                &mut state,
                (&mut ring, &mut counts),
                &mut ready,
                notify_ready,
            );
        }
        if stopping || status.success() {
            break status.code().unwrap_or(0);
        }
        if fuse.is_none() || state.is_none() {
            // It never mounted: its error is in the log already.
            break status.code().unwrap_or(1);
        }
        if !locus_fuse::is_locus_mount(mountpoint) {
            tracing::info!("{} was unmounted while its server was down", mountpoint.display());
            break 0;
        }
        if !killed_for_restart {
            tracing::warn!("the mount server died ({status}); starting another on the same connection");
        }
        if state.as_ref().is_some_and(|s| s.io_uring_payload.is_some()) && ring.is_none() {
            // The kernel resends only what /dev/fuse readers held (FUSE_NOTIFY_RESEND
            // does not reach ring queues, Linux 6.18); without the entries' memory the
            // next server cannot answer what this one held.
            tracing::warn!(
                "requests the server held in its io_uring queues cannot be answered again: their readers wait until unmount"
            );
        }
        // A server that keeps dying at once (a bad binary, no memory) is retried more
        // slowly, up to every 5 s; readers wait meanwhile, they do not fail. A restart
        // asked for (SIGHUP) is no death: its readers wait only for the next server, and
        // upgrades in a row must not back off (measured: 140, 240, 440 ms stalls for three
        // in a row, each one pause longer).
        if killed_for_restart {
            continue;
        }
        quick_deaths = if started.elapsed() < Duration::from_secs(10) {
            quick_deaths + 1
        } else {
            0
        };
        let pause = Duration::from_millis(50 << quick_deaths.min(7)).min(Duration::from_secs(5));
        tokio::time::sleep(pause).await;
    };
    if let Some(fd) = &fuse {
        unmount_if_ours(
            mountpoint,
            fd.as_fd(),
            state.as_ref().and_then(|s| s.device.as_deref()),
        );
    }
    let _ = std::fs::remove_file(&session_file);
    super::runtime::remove_status_of(mountpoint, std::process::id());
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

fn apply(
    m: Msg,
    fuse: &mut Option<OwnedFd>,
    state: &mut Option<SessionState>,
    (ring, counts): (&mut KeptRing, &mut KeptCounts),
    ready: &mut bool,
    notify_ready: bool,
) {
    match m {
        Msg::Session(fd, s) => {
            *fuse = Some(fd);
            *state = Some(s);
        }
        Msg::Rings(fd, layout) => *ring = Some((fd, layout)),
        Msg::OpenCounts(fd, len) => *counts = Some((fd, len)),
        Msg::Ready(msg) if !*ready => {
            *ready = true;
            if notify_ready {
                use std::io::Write;
                print!("ready {msg}");
                let _ = std::io::stdout().flush();
            } else {
                eprint!("{msg}");
            }
        }
        Msg::Ready(_) => tracing::info!("the restarted mount server is serving"),
        Msg::Held | Msg::Freezing => {}
        Msg::Backing(ino, what) => {
            if let Some(s) = state {
                keep_backing(s, ino, what);
            }
        }
    }
}

/// Keeps the session's backing ids up to date, for the next server.
fn keep_backing(s: &mut SessionState, ino: u64, what: Backing) {
    match what {
        Backing::Registered(id) => s.backing.insert(ino, id),
        Backing::Closed => s.backing.remove(&ino),
    };
}

fn signal_child(child: &tokio::process::Child, sig: Signal) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
    }
}

/// Reads the server's messages on a thread of their own until it closes its end.
fn receive(sock: OwnedFd) -> tokio::sync::mpsc::UnboundedReceiver<Msg> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut cmsg = nix::cmsg_space!([RawFd; 1]);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let r = socket::recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            );
            let (n, fd) = match r {
                Ok(r) if r.bytes == 0 => return,
                Ok(r) => {
                    let fd = r.cmsgs().ok().into_iter().flatten().find_map(|c| match c {
                        ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
                        _ => None,
                    });
                    (r.bytes, fd)
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return,
            };
            // SAFETY: the kernel just installed this descriptor in our table for us.
            #[allow(unsafe_code)]
            let fd = fd.map(|f| unsafe { OwnedFd::from_raw_fd(f) });
            if let Some(m) = parse(&buf[..n], fd) {
                if tx.send(m).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

fn parse(m: &[u8], fd: Option<OwnedFd>) -> Option<Msg> {
    let text = std::str::from_utf8(m).ok()?;
    let (kind, rest) = text.split_once(' ').unwrap_or((text, ""));
    match kind {
        "session" => Some(Msg::Session(fd?, serde_json::from_str(rest).ok()?)),
        "rings" => Some(Msg::Rings(fd?, serde_json::from_str(rest).ok()?)),
        "opens" => Some(Msg::OpenCounts(fd?, rest.parse().ok()?)),
        "ready" => Some(Msg::Ready(rest.to_string())),
        "held" => Some(Msg::Held),
        "freezing" => Some(Msg::Freezing),
        "backing" => {
            let (ino, id) = rest.split_once(' ')?;
            Some(Msg::Backing(
                ino.parse().ok()?,
                Backing::Registered(id.parse().ok()?),
            ))
        }
        "unbacking" => Some(Msg::Backing(rest.parse().ok()?, Backing::Closed)),
        _ => {
            tracing::warn!("unknown message from the mount server: {text:?}");
            None
        }
    }
}

/// Writes `data` readable by us alone (the runtime dir is private too).
fn write_private(path: &PathBuf, data: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(data)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_parse_and_junk_is_dropped() {
        assert!(matches!(parse(b"ready mounted x\n", None), Some(Msg::Ready(m)) if m == "mounted x\n"));
        assert!(matches!(
            parse(b"backing 12 3", None),
            Some(Msg::Backing(12, Backing::Registered(3)))
        ));
        assert!(matches!(
            parse(b"unbacking 12", None),
            Some(Msg::Backing(12, Backing::Closed))
        ));
        // A session without its descriptor is no session.
        assert!(parse(br#"session {"version":1,"proto_major":7,"proto_minor":41,"negotiated":{"passthrough":true,"kernel_opens":false}}"#, None).is_none());
        assert!(parse(b"backing x 3", None).is_none());
        // Ring memory comes with its descriptor and a whole layout, or not at all.
        let layout =
            br#"rings {"addr":17592186044416,"len":16842752,"queues":2,"depth":8,"payload_cap":1048576}"#;
        assert!(parse(layout, None).is_none());
        let memfd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        match parse(layout, Some(memfd)) {
            Some(Msg::Rings(_, l)) => {
                assert_eq!(
                    (l.addr, l.queues, l.depth, l.payload_cap),
                    (1 << 44, 2, 8, 1 << 20)
                );
            }
            _ => panic!("a rings message with its memory is understood"),
        }
        let memfd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        assert!(parse(br#"rings {"addr":1}"#, Some(memfd)).is_none());
        // Open counts come with their memory and a length, or not at all.
        assert!(parse(b"opens 100", None).is_none());
        let memfd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        assert!(matches!(
            parse(b"opens 100", Some(memfd)),
            Some(Msg::OpenCounts(_, 100))
        ));
        let memfd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        assert!(parse(b"opens x", Some(memfd)).is_none());
        assert!(parse(b"\xff\xfe", None).is_none());
        assert!(parse(b"nonsense 1", None).is_none());
    }
}
