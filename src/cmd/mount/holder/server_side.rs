//! The server's side of the hand-over, as this holder speaks it: its channel to the
//! holder (`locus_fuse::handoff::Holder` over a Unix socket), and what a restarted server
//! is given to take over (the connection, its state, the ring entries' memory) through
//! its environment. What the server does with them is `locus_fuse::start`'s.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use anyhow::Context;
use nix::sys::socket::{self, ControlMessage, MsgFlags};

use locus_fuse::handoff::Takeover;

use super::{
    set_cloexec, take_env, RingMemory, SessionState, CHANNEL_ENV, FUSE_FD_ENV, OPENS_FD_ENV, RING_FD_ENV,
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
}

impl locus_fuse::handoff::Holder for Channel {
    /// Hands the holder a copy of the connection and what was negotiated on it.
    fn session(&self, fuse: BorrowedFd<'_>, s: &SessionState) -> std::io::Result<()> {
        let mut m = b"session ".to_vec();
        m.extend(serde_json::to_vec(s).map_err(std::io::Error::other)?);
        self.send(&m, Some(fuse))
    }

    /// Hands the holder the memory the ring queues' entries are in, for the next server.
    fn rings(&self, memory: BorrowedFd<'_>, layout: RingMemory) -> std::io::Result<()> {
        let mut m = b"rings ".to_vec();
        m.extend(serde_json::to_vec(&layout).map_err(std::io::Error::other)?);
        self.send(&m, Some(memory))
    }

    /// Hands the holder the memory the counts of passthrough files open are in.
    fn open_counts(&self, memory: BorrowedFd<'_>, len: usize) -> std::io::Result<()> {
        self.send(format!("opens {len}").as_bytes(), Some(memory))
    }

    /// Reports what happened to a backing id. Failure is logged, not fatal: a holder
    /// that is gone cannot restart us anyway.
    fn backing(&self, ino: u64, what: locus_fuse::fs::Backing) {
        use locus_fuse::fs::Backing;
        let m = match what {
            Backing::Registered(id) => format!("backing {ino} {id}"),
            Backing::Closed => format!("unbacking {ino}"),
        };
        if let Err(e) = self.send(m.as_bytes(), None) {
            tracing::debug!("cannot tell the holder of a backing id: {e}");
        }
    }
}

/// The live connection the holder gave this server to take over, if it gave one.
pub fn takeover_from_env() -> anyhow::Result<Option<Takeover>> {
    let Some(fd) = take_env(FUSE_FD_ENV) else {
        return Ok(None);
    };
    let fd: RawFd = fd.parse().context(FUSE_FD_ENV)?;
    let path = take_env(SESSION_ENV).context(SESSION_ENV)?;
    set_cloexec(fd);
    // SAFETY: as in `take_fd`.
    #[allow(unsafe_code)]
    let fuse = unsafe { OwnedFd::from_raw_fd(fd) };
    let state = serde_json::from_slice(&std::fs::read(&path).with_context(|| path.clone())?)
        .with_context(|| format!("{path}: not a mount session"))?;
    let ring = take_fd(RING_FD_ENV)?;
    let open_counts = take_fd(OPENS_FD_ENV)?;
    Ok(Some(Takeover {
        fuse,
        state,
        ring,
        open_counts,
    }))
}

/// A descriptor the holder passed open and named in the environment variable `name`.
fn take_fd(name: &'static str) -> anyhow::Result<Option<OwnedFd>> {
    let Some(fd) = take_env(name) else {
        return Ok(None);
    };
    let fd: RawFd = fd.parse().context(name)?;
    set_cloexec(fd);
    // SAFETY: passed open by the holder, owned by nobody else in this process.
    #[allow(unsafe_code)]
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}
