//! The Locus FUSE client: mounts one dataset version as a read-only file tree.
//!
//! This crate is empty until the mount work lands; nothing here is in use yet. It depends
//! only on `locus-proto` and must never reach into another Locus crate.
