//! The Locus FUSE client: mounts one dataset version as a read-only file tree.
//!
//! - `namespace`: the version's sealed namespace, used in place (mapped);
//! - `load`: what a mount reads before it answers the kernel, the namespace included;
//! - `reader`: verified chunks from remote replicas, with failover and read-ahead;
//! - `core`: what every file-system operation means (which source, passthrough or not,
//!   what a listing carries), with typed errors, no kernel and unit tests for each;
//! - `fs`: the fuser adapter: a request in, the core's answer out as a reply (one errno
//!   mapping), plus what only the kernel's side has (handles, backing ids, INIT);
//! - `metrics`: what the mount reports;
//! - `start`: a mount from its options to serving the kernel, in one call;
//! - `handoff`: what one server of a mount leaves the next on the same live connection.
//!
//! `load` reads everything a mount needs once (the namespace from nodes, not from the
//! metadata service); `start` builds the rest on it and meets the kernel. The `locus
//! mount` command adds the process around them (daemonizing, the holder, signals, the
//! status file, the lease).
//!
//! It depends on `locus-proto` (wire and formats) and `locus-backup` (a version's origin
//! as the last source), never on the metadata service or the node.

pub mod core;
pub mod fs;
pub mod handoff;
pub mod load;
pub mod metrics;
pub mod namespace;
pub mod pieces;
pub mod reader;
pub mod start;

use std::path::Path;

pub use fs::{LocusFs, Readdirplus, Settings};
pub use load::{Opened, Sources};
pub use namespace::Namespace;
pub use reader::{Place, Remote, Topology};

/// The filesystem type the kernel shows for our mounts (`fuse.locus`).
pub const SUBTYPE: &str = "locus";
/// Every Locus mount's source name starts with this (`locus:imagenet@3`).
pub const SOURCE_PREFIX: &str = "locus:";

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The metadata service's answer, with its code (NOT_FOUND: no such dataset or
    /// version; UNAVAILABLE: not reachable; PERMISSION_DENIED: the token).
    #[error("{}", .0.message())]
    Status(tonic::Status),
    #[error("the version is invalid: {0}")]
    Invalid(String),
    /// Committed before versions carried a sealed namespace.
    #[error("{0}")]
    Unsealed(String),
    /// No source gave bytes that hash to the version's namespace.
    #[error("no source could give this mount the version's namespace: {0}")]
    Namespace(String),
}

impl From<tonic::Status> for LoadError {
    fn from(s: tonic::Status) -> Self {
        LoadError::Status(s)
    }
}

/// Entries per FUSE-over-io_uring queue (one queue per CPU): requests a CPU's callers
/// can have with the mount at once before the kernel queues the next (a reader's
/// blocking work runs off the queue thread, holding its entry meanwhile).
pub const RING_DEPTH: u16 = 16;

/// The fuser configuration of a Locus mount; `io_uring`: ask the kernel for FUSE over
/// io_uring (it is used when the kernel offers it and this process can make rings).
pub fn session_config(source: &str, allow_other: bool, threads: usize, io_uring: bool) -> fuser::Config {
    use fuser::MountOption as O;
    let mut c = fuser::Config::default();
    c.mount_options = vec![
        O::FSName(source.to_string()),
        O::Subtype(SUBTYPE.to_string()),
        O::RO,
        O::NoDev,
        O::NoSuid,
        O::NoAtime,
        // The kernel checks permission bits against the manifest's modes.
        O::DefaultPermissions,
    ];
    if allow_other {
        c.acl = fuser::SessionACL::All;
    }
    c.n_threads = Some(threads.max(1));
    // One descriptor read by every thread: a cloned one would be closed with a dying
    // server, failing the requests it held, while the shared one stays open in the
    // holder and its lost requests can be resent (see `locus mount`'s holder).
    c.clone_fd = false;
    c.io_uring = io_uring.then_some(RING_DEPTH);
    c
}

/// Whether `path` is the root of a Locus mount, from /proc/self/mountinfo.
pub fn is_locus_mount(path: &Path) -> bool {
    mounts().iter().any(|m| m.as_path() == path)
}

/// The device ("major:minor", as mountinfo writes it) of the Locus mount on top at `path`:
/// what tells one mount at a path from the next one made there. It comes from the mount
/// table, so no request reaches the file system (a hung server cannot hang the caller).
pub fn mount_device(path: &Path) -> Option<String> {
    mount_table()
        .into_iter()
        .rev()
        .find(|m| m.mount_point.as_path() == path && m.is_locus())
        .map(|m| m.device)
}

/// Whether a Locus mount on `device` is mounted at `path`. A device number is reused once
/// its mount is gone, so a caller that must know the mount is its own also checks that its
/// connection is alive (which keeps the number taken).
pub fn is_locus_mount_on(path: &Path, device: &str) -> bool {
    mount_table()
        .iter()
        .any(|m| m.mount_point.as_path() == path && m.is_locus() && m.device == device)
}

/// One line of /proc/self/mountinfo, the fields used here.
struct MountLine {
    device: String,
    mount_point: std::path::PathBuf,
    fstype: String,
    source: String,
}

impl MountLine {
    /// Mounted by root the type is plain "fuse" (the subtype only shows through
    /// fusermount), so the source name marks ours.
    fn is_locus(&self) -> bool {
        (self.fstype == "fuse" || self.fstype == format!("fuse.{SUBTYPE}"))
            && self.source.starts_with(SOURCE_PREFIX)
    }
}

/// Every mount on this host, in mount order, from /proc/self/mountinfo
/// ("id parent major:minor root mount_point options ... - fstype source super_options").
fn mount_table() -> Vec<MountLine> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split(' ');
            let (fstype, source) = (r.next()?, r.next()?);
            let mut f = left.split(' ');
            let device = f.nth(2)?;
            let mp = f.nth(1)?;
            Some(MountLine {
                device: device.to_string(),
                mount_point: std::path::PathBuf::from(unescape_mountinfo(mp)),
                fstype: fstype.to_string(),
                source: unescape_mountinfo(source),
            })
        })
        .collect()
}

/// Whether anything at all is mounted at `path`.
pub fn is_mount_point(path: &Path) -> bool {
    mount_table().iter().any(|m| m.mount_point.as_path() == path)
}

/// Mount points of every Locus mount on this host.
pub fn mounts() -> Vec<std::path::PathBuf> {
    mount_table()
        .into_iter()
        .filter(MountLine::is_locus)
        .map(|m| m.mount_point)
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn mountinfo_escapes() {
        assert_eq!(super::unescape_mountinfo(r"/mnt/a\040b"), "/mnt/a b");
        assert_eq!(super::unescape_mountinfo(r"/plain"), "/plain");
        assert_eq!(super::unescape_mountinfo(r"/x\134y"), r"/x\y");
    }
}
