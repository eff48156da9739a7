//! A version's sealed namespace (`locus_proto::sealed`), from both ends:
//! - odd first byte: the rest is read as sealed bytes, as a mount maps them — opening and
//!   walking every inode (attributes, listings, lookups, links, chunk hashes, paths) may
//!   refuse or answer "absent", never panic or read out of bounds;
//! - even first byte: the rest is decoded as a page of entries (validated like API input:
//!   names, `..`, absolute paths, NUL, sizes, hashes); what passes is sealed (the writer
//!   refuses conflicts such as a file under a file or duplicates) and the result must open
//!   and find every entry it was given.
use locus_proto::sealed::{seal, Index, ROOT};
use locus_proto::{pb, Entry};
use prost::Message;

fn walk(ix: &Index<&[u8]>) {
    let n = ix.len() as u64;
    for ino in 0..=n.min(4096) + 1 {
        let _ = (
            ix.attr(ino),
            ix.readlink(ino),
            ix.path(ino),
            ix.nlink(ino),
            ix.parent(ino),
        );
        if let Some((_, c)) = ix.blob(ino) {
            let _ = c.to_vec();
        }
        if let Some((first, count)) = ix.children(ino) {
            for child in first..first.saturating_add(count.min(64)) {
                if let Some(name) = ix.name(child) {
                    let _ = ix.lookup(ino, name);
                }
            }
        }
        let _ = ix.lookup(ino, "a");
    }
}

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        if let Ok(ix) = Index::open(rest) {
            walk(&ix);
        }
        return;
    }
    // A chunk size from those the store writes (64 KiB .. 1 GiB).
    let chunk_size = 1u32 << (16 + u32::from(mode / 2) % 15);
    let Ok(page) = pb::ListEntriesResponse::decode(rest) else {
        return;
    };
    let entries: Vec<Entry> = page
        .entries
        .into_iter()
        .filter_map(|e| Entry::try_from(e).ok())
        .collect();
    let paths: Vec<String> = entries.iter().map(|e| e.path.as_str().to_string()).collect();
    if let Ok((bytes, _)) = seal(entries, chunk_size, "ds", "c") {
        let ix = Index::open(&bytes[..]).expect("what the writer wrote opens");
        for p in &paths {
            let mut ino = ROOT;
            for part in p.split('/') {
                ino = ix.lookup(ino, part).expect("every sealed entry is found");
            }
            assert_eq!(ix.path(ino).as_deref(), Some(p.as_str()));
        }
        walk(&ix);
    }
}
