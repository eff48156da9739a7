//! The Locus FUSE client: mounts one dataset version as a read-only file tree.
//!
//! What is here so far is the mount's namespace (`namespace`): the version's manifest as
//! a compact, immutable inode table. The FUSE session and the read path (local node over
//! its Unix socket, remote replicas otherwise) come next; nothing mounts yet.
//!
//! It depends only on `locus-proto` and never reaches into another Locus crate.

pub mod namespace;
