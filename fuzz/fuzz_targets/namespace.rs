//! A version's entries as a mount receives them (ListEntries pages, decoded from any
//! bytes): each entry is validated like API input (names, `..`, absolute paths, NUL,
//! sizes, hashes) and what passes builds the mount's inode table; the build refuses
//! conflicts (a file under a file, duplicates) and never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use locus_proto::{pb, Entry};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    // The first byte picks a chunk size from those the store writes (64 KiB .. 1 GiB).
    let chunk_size = 1u32 << (16 + u32::from(data[0]) % 15);
    let Ok(page) = pb::ListEntriesResponse::decode(&data[1..]) else {
        return;
    };
    let entries: Vec<Entry> = page
        .entries
        .into_iter()
        .filter_map(|e| Entry::try_from(e).ok())
        .collect();
    if let Ok(ns) = locus_fuse::namespace::Namespace::build(entries, chunk_size) {
        let _ = ns.len();
    }
});
