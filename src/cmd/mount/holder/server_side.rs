//! The server's side of the hand-over: its channel to the holder, what a restarted
//! server takes over (the connection, its state, the ring entries' memory), and what it
//! does to the kernel's queues once it serves.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use anyhow::Context;
use nix::sys::socket::{self, ControlMessage, MsgFlags};

use super::{
    pin_to, set_cloexec, take_env, RingMemory, SessionState, CHANNEL_ENV, FUSE_FD_ENV, RING_FD_ENV,
    SESSION_ENV,
};

/// The server's end of the channel to its holder (`None`: not started by a holder).
pub struct Channel(OwnedFd);

impl Channel {
    pub fn from_env() -> Option<Channel> {
        let fd: RawFd = take_env(CHANNEL_ENV)?.parse().ok()?;
        set_cloexec(fd);
        // SAFETY: the holder passed this descriptor to us open and names it in the
        // environment; nothing else in this process owns it.
        #[allow(unsafe_code)]
        Some(Channel(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn send(&self, data: &[u8], fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
        let iov = [IoSlice::new(data)];
        let fds = fd.map(|f| [f.as_raw_fd()]);
        let cmsg: Vec<ControlMessage> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
        socket::sendmsg::<()>(self.0.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)?;
        Ok(())
    }

    /// Hands the holder a copy of the connection and what was negotiated on it.
    pub fn session(&self, fuse: BorrowedFd<'_>, s: &SessionState) -> std::io::Result<()> {
        let mut m = b"session ".to_vec();
        m.extend(serde_json::to_vec(s).map_err(std::io::Error::other)?);
        self.send(&m, Some(fuse))
    }

    /// Hands the holder the memory the ring queues' entries are in, for the next server.
    pub fn rings(&self, memory: BorrowedFd<'_>, layout: RingMemory) -> std::io::Result<()> {
        let mut m = b"rings ".to_vec();
        m.extend(serde_json::to_vec(&layout).map_err(std::io::Error::other)?);
        self.send(&m, Some(memory))
    }

    /// Says the io_uring queues are frozen: requests that come now stay where they land.
    pub fn freezing(&self) {
        if let Err(e) = self.send(b"freezing", None) {
            tracing::warn!("cannot tell the holder the queues are freezing: {e}");
        }
    }

    /// Says every ring entry is held after a freeze (see `hold_ring_queues`).
    pub fn held(&self) {
        if let Err(e) = self.send(b"held", None) {
            tracing::warn!("cannot tell the holder the queues are frozen: {e}");
        }
    }

    pub fn ready(&self, msg: &str) -> std::io::Result<()> {
        self.send(format!("ready {msg}").as_bytes(), None)
    }

    /// Reports a backing id registered (`Some`) or closed (`None`). Failure is logged,
    /// not fatal: a holder that is gone cannot restart us anyway.
    pub fn backing(&self, ino: u64, id: Option<u32>) {
        let m = match id {
            Some(id) => format!("backing {ino} {id}"),
            None => format!("unbacking {ino}"),
        };
        if let Err(e) = self.send(m.as_bytes(), None) {
            tracing::debug!("cannot tell the holder of a backing id: {e}");
        }
    }
}

/// A live connection a restarted server takes over.
pub struct Reattach {
    pub fuse: OwnedFd,
    pub state: SessionState,
    /// The ring entries' memory (see `SessionState::ring_memory`).
    pub ring: Option<OwnedFd>,
}

impl Reattach {
    pub fn from_env() -> anyhow::Result<Option<Reattach>> {
        let Some(fd) = take_env(FUSE_FD_ENV) else {
            return Ok(None);
        };
        let fd: RawFd = fd.parse().context("LOCUS_MOUNT_FUSE_FD")?;
        let path = take_env(SESSION_ENV).context("LOCUS_MOUNT_SESSION")?;
        set_cloexec(fd);
        // SAFETY: as for the channel: passed open by the holder, owned by nobody else.
        #[allow(unsafe_code)]
        let fuse = unsafe { OwnedFd::from_raw_fd(fd) };
        let state = serde_json::from_slice(&std::fs::read(&path).with_context(|| path.clone())?)
            .with_context(|| format!("{path}: not a mount session"))?;
        let ring = match take_env(RING_FD_ENV) {
            Some(fd) => {
                let fd: RawFd = fd.parse().context("LOCUS_MOUNT_RING_FD")?;
                set_cloexec(fd);
                // SAFETY: as above.
                #[allow(unsafe_code)]
                Some(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            None => None,
        };
        Ok(Some(Reattach { fuse, state, ring }))
    }
}

/// Asks the kernel to queue again every request a server read and never answered
/// (FUSE_NOTIFY_RESEND, Linux 6.9+): a header with the notify code, no body.
pub fn resend_lost_requests(fuse: BorrowedFd<'_>) -> std::io::Result<()> {
    const FUSE_NOTIFY_RESEND: i32 = 7;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&16u32.to_ne_bytes());
    h[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    nix::unistd::write(fuse, &h)?;
    Ok(())
}

/// Sends one request from each CPU to a mount whose requests come through ring queues,
/// after a new server registered its queues. Requests that arrived while no server had
/// entries wait in their CPU's queue, and the kernel hands a waiting request to an entry
/// only when one is answered (COMMIT_AND_FETCH), never when one is registered: without a
/// request to answer, a queue whose readers all wait would never move. A STATFS always
/// reaches the server; each answer fetches the next waiting request.
pub fn wake_ring_queues(mp: &Path) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for cpu in 0..cpus {
        let mp = mp.to_path_buf();
        // Detached: a hung mount must not hang the server's start.
        let _ = std::thread::Builder::new()
            .name(format!("ring-wake-{cpu}"))
            .spawn(move || {
                if pin_to(cpu) {
                    let _ = nix::sys::statfs::statfs(&mp);
                }
            });
    }
}
