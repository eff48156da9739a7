//! The Locus cache node: the blob store on a GPU host's NVMe, the node API its peers and
//! the import call, and the local socket the FUSE mount asks for blobs.
//!
//! This crate is empty until the cache-node work lands; nothing here is in use yet. It
//! depends only on `locus-proto` and must never reach into another Locus crate.
