//! The Locus FUSE client: mounts one dataset version as a read-only file tree.
//!
//! - `namespace`: the version's manifest as a compact, immutable inode table;
//! - `reader`: verified chunks from remote replicas, with failover and read-ahead;
//! - `fs`: the FUSE filesystem (passthrough to the local node's files when possible);
//! - `metrics`: what the mount reports.
//!
//! `load` reads everything a mount needs from the metadata service once; `session`
//! mounts it. The `locus mount` command adds the process around them (daemonizing,
//! signals, the status file).
//!
//! It depends only on `locus-proto` and never reaches into another Locus crate.

pub mod core;
pub mod fs;
pub mod metrics;
pub mod namespace;
pub mod pieces;
pub mod reader;

use std::path::Path;
use std::time::{Duration, Instant};

use locus_proto::client::MetadataClient;
use locus_proto::manifest::Entry;
use locus_proto::pb;

pub use fs::{LocusFs, Settings};
pub use namespace::Namespace;
pub use reader::{Place, Remote, Topology};

/// The filesystem type the kernel shows for our mounts (`fuse.locus`).
pub const SUBTYPE: &str = "locus";
/// Every Locus mount's source name starts with this (`locus:imagenet@3`).
pub const SOURCE_PREFIX: &str = "locus:";

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Status(String),
    #[error("the manifest is invalid: {0}")]
    Invalid(String),
}

impl From<tonic::Status> for LoadError {
    fn from(s: tonic::Status) -> Self {
        LoadError::Status(s.message().to_string())
    }
}

/// What a mount needs, read once.
pub struct Loaded {
    pub version: pb::Version,
    pub namespace: Namespace,
    pub topology: Topology,
    pub took: Duration,
}

/// Reads a version's manifest (page by page, converting as it goes so the protobuf
/// form of a million entries is never held at once), its shards and the nodes.
/// `version` 0 means the latest.
pub async fn load(
    client: &mut MetadataClient,
    dataset: &str,
    version: u64,
    place: &Place,
) -> Result<Loaded, LoadError> {
    let started = Instant::now();
    let mut r = pb::VersionRef {
        dataset: dataset.to_string(),
        version,
    };
    let v = client
        .get_version(pb::GetVersionRequest {
            r#ref: Some(r.clone()),
        })
        .await?
        .into_inner();
    r.version = v.version;
    let total = v.files + v.dirs + v.symlinks;
    let mut builder = namespace::Builder::new(v.chunk_size, total as usize);
    let bad = |e: String| LoadError::Invalid(e);
    let mut token = Vec::new();
    loop {
        let resp = client
            .list_entries(pb::ListEntriesRequest {
                r#ref: Some(r.clone()),
                directory: None,
                page_token: token,
                limit: 10_000,
                without_chunks: false,
            })
            .await?
            .into_inner();
        for e in resp.entries {
            let e = Entry::try_from(e).map_err(|e| bad(e.to_string()))?;
            builder.add(e).map_err(|e| bad(e.to_string()))?;
        }
        if resp.next_page_token.is_empty() {
            break;
        }
        token = resp.next_page_token;
    }
    let namespace = builder.finish().map_err(|e| bad(e.to_string()))?;
    let topology = Topology::load(client, &r, place).await?;
    Ok(Loaded {
        version: v,
        namespace,
        topology,
        took: started.elapsed(),
    })
}

/// The fuser configuration of a Locus mount.
pub fn session_config(source: &str, allow_other: bool, threads: usize) -> fuser::Config {
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
    c
}

/// Whether `path` is the root of a Locus mount, from /proc/self/mountinfo.
pub fn is_locus_mount(path: &Path) -> bool {
    mounts().iter().any(|m| m.as_path() == path)
}

/// Every mount on this host as (mount point, fs type, source), from
/// /proc/self/mountinfo ("... mount_point options ... - fstype source super_options").
fn mount_table() -> Vec<(std::path::PathBuf, String, String)> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split(' ');
            let (fstype, source) = (r.next()?, r.next()?);
            let mp = left.split(' ').nth(4)?;
            Some((
                std::path::PathBuf::from(unescape_mountinfo(mp)),
                fstype.to_string(),
                unescape_mountinfo(source),
            ))
        })
        .collect()
}

/// Whether anything at all is mounted at `path`.
pub fn is_mount_point(path: &Path) -> bool {
    mount_table().iter().any(|(mp, _, _)| mp.as_path() == path)
}

/// Mount points of every Locus mount on this host. Mounted by root the type is plain
/// "fuse" (the subtype only shows through fusermount), so the source name marks ours.
pub fn mounts() -> Vec<std::path::PathBuf> {
    mount_table()
        .into_iter()
        .filter(|(_, fstype, source)| {
            (fstype == "fuse" || *fstype == format!("fuse.{SUBTYPE}")) && source.starts_with(SOURCE_PREFIX)
        })
        .map(|(mp, _, _)| mp)
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
