//! What one server of a mount leaves the next on the same live FUSE connection.
//!
//! A mount's connection outlives its server: the process that holds it (`locus mount`'s
//! holder) starts another server when one dies or is upgraded, and that one takes the
//! connection over without the kernel noticing. This module is the server's side of that
//! contract, independent of how the holder talks: what a server reports as it starts
//! (`Holder`), what a taking-over server is given (`Takeover`, `SessionState`), and what
//! it does to the kernel's queues once it serves (`resend_lost_requests`,
//! `wake_ring_queues`). The holder process itself, its socket protocol and its signals
//! stay with the command.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use crate::fs::Negotiated;

/// What the process holding a mount's connection is told by the server as it starts.
/// Reports are best effort where the method returns nothing: a holder that is gone
/// cannot start a next server anyway.
pub trait Holder: Send + Sync {
    /// A copy of the connection and what was negotiated on it (a fresh mount only).
    fn session(&self, fuse: BorrowedFd<'_>, s: &SessionState) -> std::io::Result<()>;
    /// The memory the io_uring queues' entries are in, for the next server.
    fn rings(&self, memory: BorrowedFd<'_>, layout: RingMemory) -> std::io::Result<()>;
    /// The memory the counts of files open with passthrough are in (`fs::OpenCounts`),
    /// for `len` inodes, for the next server.
    fn open_counts(&self, memory: BorrowedFd<'_>, len: usize) -> std::io::Result<()>;
    /// A passthrough backing id registered or closed for an inode.
    fn backing(&self, ino: u64, what: crate::fs::Backing);
}

/// A live connection a server takes over from its predecessor.
pub struct Takeover {
    pub fuse: OwnedFd,
    pub state: SessionState,
    /// The ring entries' memory (see `SessionState::ring_memory`).
    pub ring: Option<OwnedFd>,
    /// The counts of files open with passthrough (see `SessionState::open_counts`).
    pub open_counts: Option<OwnedFd>,
}

/// What a server taking over a live connection must know about it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SessionState {
    /// The version mounted: a restarted server loads this one, whatever "latest" is now.
    pub version: u64,
    pub proto_major: u32,
    pub proto_minor: u32,
    pub negotiated: Negotiated,
    /// Backing ids registered on the connection and not closed, by inode.
    #[serde(default)]
    pub backing: BTreeMap<u64, u32>,
    /// How many inodes the counts of files open with passthrough cover (a memfd the
    /// holder keeps, `fs::OpenCounts`): the next server closes the backing ids no file
    /// uses. `None` from a holder that does not keep them; the ids are then kept.
    #[serde(default)]
    pub open_counts: Option<u64>,
    /// The mount's device ("major:minor" in the mount table): another mount at the same
    /// path has another, so an ending mount unmounts only its own.
    #[serde(default)]
    pub device: Option<String>,
    /// The FUSE-over-io_uring payload size when the connection's requests come through
    /// ring queues: the next server registers its own queues (see `wake_ring_queues`).
    #[serde(default)]
    pub io_uring_payload: Option<usize>,
    /// Where the ring queues' entries are (a memfd the holder keeps): the next server
    /// maps it at the same address and answers the requests a dead server held in its
    /// entries.
    #[serde(default)]
    pub ring_memory: Option<RingMemory>,
}

/// `fuser::RingLayout`, as a session file keeps it (the vendored fuser has no serde).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingMemory {
    pub addr: u64,
    pub len: u64,
    pub queues: u32,
    pub depth: u16,
    pub payload_cap: u64,
}

impl From<fuser::RingLayout> for RingMemory {
    fn from(l: fuser::RingLayout) -> Self {
        RingMemory {
            addr: l.addr,
            len: l.len,
            queues: l.queues,
            depth: l.depth,
            payload_cap: l.payload_cap,
        }
    }
}

impl From<RingMemory> for fuser::RingLayout {
    fn from(m: RingMemory) -> Self {
        fuser::RingLayout {
            addr: m.addr,
            len: m.len,
            queues: m.queues,
            depth: m.depth,
            payload_cap: m.payload_cap,
        }
    }
}

/// Asks the kernel to queue again every request a server read and never answered
/// (FUSE_NOTIFY_RESEND, Linux 6.9+): a header with the notify code, no body.
pub fn resend_lost_requests(fuse: BorrowedFd<'_>) -> std::io::Result<()> {
    use std::io::Write as _;
    const FUSE_NOTIFY_RESEND: i32 = 7;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&16u32.to_ne_bytes());
    h[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    // One write is one message to /dev/fuse; 16 bytes are never written in part.
    std::fs::File::from(fuse.try_clone_to_owned()?).write_all(&h)
}

/// Sends one request from each CPU to a mount whose requests come through ring queues,
/// after a new server registered its queues. Requests that arrived while no server had
/// entries wait in their CPU's queue, and the kernel hands a waiting request to an entry
/// only when one is answered (COMMIT_AND_FETCH), never when one is registered: without a
/// request to answer, a queue whose readers all wait would never move. A STATFS always
/// reaches the server; each answer fetches the next waiting request.
pub fn wake_ring_queues(mp: &Path) {
    statfs_from_each_cpu(mp, 1, "ring-wake");
}

/// `per_cpu` STATFS calls of the mount at `mp` from threads pinned to each CPU (each
/// reaches that CPU's ring queue), detached: a hung mount must not hang the caller.
pub fn statfs_from_each_cpu(mp: &Path, per_cpu: u16, name: &str) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for cpu in 0..cpus {
        for _ in 0..per_cpu {
            let mp = mp.to_path_buf();
            let _ = std::thread::Builder::new()
                .name(format!("{name}-{cpu}"))
                .spawn(move || {
                    if pin_to(cpu) {
                        let _ = statfs(&mp);
                    }
                });
        }
    }
}

/// One STATFS of the mount at `mp` from this thread's CPU (which queue it reaches).
pub fn statfs(mp: &Path) -> std::io::Result<()> {
    nix::sys::statfs::statfs(mp)?;
    Ok(())
}

/// Pins the calling thread to `cpu`: a ring request goes to the queue of the CPU that
/// makes it. False when it cannot be.
pub fn pin_to(cpu: usize) -> bool {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).is_ok() && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_memory_round_trips_through_fusers_layout() {
        let l = RingMemory {
            addr: 0x1000_0000_0000,
            len: 3 << 20,
            queues: 2,
            depth: 16,
            payload_cap: 1 << 20,
        };
        let back: fuser::RingLayout = l.into();
        assert_eq!(RingMemory::from(back), l);
    }

    #[test]
    fn a_session_file_from_before_rings_still_reads() {
        let old: SessionState = serde_json::from_str(
            r#"{"version":3,"proto_major":7,"proto_minor":41,"negotiated":{"passthrough":true,"kernel_opens":false}}"#,
        )
        .unwrap();
        assert_eq!(old.version, 3);
        assert!(old.ring_memory.is_none() && old.io_uring_payload.is_none() && old.backing.is_empty());
        assert!(
            old.open_counts.is_none(),
            "a holder that did not count: ids are kept"
        );
    }
}
