//! The sealed namespace format: writer and reader against each other, refused manifests,
//! damaged bytes, and the size per entry.
use super::*;
use crate::manifest::RelPath;

fn dir(p: &str) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::Dir,
        mode: 0o750,
        mtime_ns: 7,
    }
}

fn file(p: &str, size: u64, chunks: usize) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::File {
            size,
            blob: BlobHash::of(p.as_bytes()),
            chunks: (0..chunks)
                .map(|c| BlobHash::of(format!("{p}#{c}").as_bytes()))
                .collect(),
            shard: 3,
        },
        mode: 0o640,
        mtime_ns: 9,
    }
}

fn sample() -> Vec<Entry> {
    vec![
        file("a/z.bin", 5, 1),
        Entry {
            path: RelPath::try_from("a/link").unwrap(),
            kind: EntryKind::Symlink {
                target: "../b.bin".into(),
            },
            mode: 0o777,
            mtime_ns: 1,
        },
        dir("a"),
        file("b.bin", 6_000_000, 2),
        dir("a/sub"),
        file("a/m.bin", 0, 0),
        file("a/sub/deep", 1, 1),
    ]
}

#[test]
fn a_sealed_tree_answers_lookups_listings_and_attrs_in_place() {
    let (bytes, hash) = seal(sample(), 4 << 20, "ds", "c1").unwrap();
    assert_eq!(hash, BlobHash::of(&bytes));
    let ix = Index::open(&bytes[..]).unwrap();
    ix.check_identity("ds", "c1").unwrap();
    assert!(matches!(
        ix.check_identity("other", "c1"),
        Err(OpenError::OtherVersion { .. })
    ));
    assert!(ix.check_identity("ds", "c2").is_err());
    assert_eq!(ix.len(), 8);
    assert_eq!(ix.total_bytes(), 6_000_006);
    let a = ix.lookup(ROOT, "a").unwrap();
    assert_eq!(ix.attr(a).unwrap().kind, Kind::Dir);
    assert_eq!(ix.attr(a).unwrap().mode, 0o750);
    assert_eq!(ix.nlink(a), Some(3), "a and its one subdirectory");
    assert_eq!(ix.nlink(ROOT), Some(3));
    let (first, count) = ix.children(a).unwrap();
    let names: Vec<_> = (first..first + count).map(|i| ix.name(i).unwrap()).collect();
    assert_eq!(names, ["link", "m.bin", "sub", "z.bin"]);
    let b = ix.lookup(ROOT, "b.bin").unwrap();
    let at = ix.attr(b).unwrap();
    assert_eq!(
        (at.kind, at.size, at.mode, at.mtime_ns, at.shard),
        (Kind::File, 6_000_000, 0o640, 9, 3)
    );
    let (blob, chunks) = ix.blob(b).unwrap();
    assert_eq!(blob, BlobHash::of(b"b.bin"));
    assert_eq!(
        chunks.to_vec(),
        vec![BlobHash::of(b"b.bin#0"), BlobHash::of(b"b.bin#1")]
    );
    // One chunk: its hash is the blob's, not stored twice.
    let z = ix.lookup(a, "z.bin").unwrap();
    assert_eq!(ix.blob(z).unwrap().1.to_vec(), vec![BlobHash::of(b"a/z.bin")]);
    let m = ix.lookup(a, "m.bin").unwrap();
    assert!(ix.blob(m).unwrap().1.is_empty());
    let l = ix.lookup(a, "link").unwrap();
    assert_eq!(ix.readlink(l), Some("../b.bin"));
    assert_eq!(ix.parent(l), Some(a));
    let sub = ix.lookup(a, "sub").unwrap();
    let deep = ix.lookup(sub, "deep").unwrap();
    assert_eq!(ix.path(deep).as_deref(), Some("a/sub/deep"));
    assert_eq!(ix.lookup(a, "nope"), None);
    assert_eq!(ix.lookup(b, "x"), None, "files have no children");
    assert_eq!(ix.children(b), None);
    assert_eq!(ix.children(deep), None);
    assert!(ix.attr(0).is_none() && ix.attr(99).is_none());
    // The same entries in any order seal to the same bytes.
    let mut rev = sample();
    rev.reverse();
    assert_eq!(seal(rev, 4 << 20, "ds", "c1").unwrap().1, hash);
}

/// What the writer says of its output (hash, size, each chunk's hash) is what the
/// bytes hash to, whatever the chunk size against the record boundaries.
#[test]
fn the_writer_names_its_bytes_and_each_chunk_of_them() {
    for chunk in [7u32, 64, 100, 1 << 22] {
        let mut entries = sample();
        entries.sort_unstable_by(|a, b| canonical_cmp(a.path.as_str(), b.path.as_str()));
        let mut out = Vec::new();
        let mut w = Writer::new(&mut out, chunk).unwrap();
        for e in &entries {
            w.push(e).unwrap();
        }
        let sealed = w.finish("ds", "c1").unwrap();
        assert_eq!(sealed.hash, BlobHash::of(&out));
        assert_eq!(sealed.size, out.len() as u64);
        assert_eq!(sealed.chunks, chunk_hashes(&out, chunk), "chunk size {chunk}");
        assert_eq!(sealed.chunks.len() as u64, sealed.size.div_ceil(u64::from(chunk)));
        assert_eq!(sealed.chunk_bytes().len(), 32 * sealed.chunks.len());
    }
}

#[test]
fn inconsistent_or_unordered_manifests_are_refused_naming_the_entry() {
    assert_eq!(
        seal(vec![file("x/y", 1, 1)], 1 << 22, "d", "c").err(),
        Some(SealError::Orphan("x/y".into()))
    );
    assert_eq!(
        seal(vec![file("f", 1, 1), file("f/g", 1, 1)], 1 << 22, "d", "c").err(),
        Some(SealError::Orphan("f/g".into()))
    );
    assert_eq!(
        seal(vec![dir("d"), dir("d")], 1 << 22, "d", "c").err(),
        Some(SealError::Duplicate("d".into()))
    );
    let mut out = Vec::new();
    let mut w = Writer::new(&mut out, 1 << 22).unwrap();
    w.push(&file("b", 1, 1)).unwrap();
    assert_eq!(w.push(&file("a", 1, 1)), Err(SealError::Unsorted("a".into())));
}

#[test]
fn damaged_bytes_are_refused_or_read_as_absent_never_a_panic() {
    let (bytes, _) = seal(sample(), 4 << 20, "ds", "c1").unwrap();
    assert_eq!(Index::open(&bytes[..10]).err(), Some(OpenError::NotSealed));
    assert_eq!(
        Index::open(&bytes[..bytes.len() - 1]).err(),
        Some(OpenError::NotSealed)
    );
    // Flip every byte in turn: opening and walking never panics.
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0xA5;
        if let Ok(ix) = Index::open(&b[..]) {
            for ino in 0..12 {
                let _ = (ix.attr(ino), ix.children(ino), ix.readlink(ino), ix.path(ino));
                if let Some((_, c)) = ix.blob(ino) {
                    let _ = c.to_vec();
                }
                let _ = ix.lookup(ino, "a");
            }
        }
    }
}

#[test]
fn a_million_entries_cost_about_a_hundred_bytes_each() {
    let mut entries = Vec::with_capacity(1_001_000);
    for d in 0..1000 {
        entries.push(dir(&format!("d{d:04}")));
        for f in 0..1000 {
            entries.push(file(&format!("d{d:04}/file-{f:05}.jpg"), 100_000, 1));
        }
    }
    let (bytes, _) = seal(entries, 4 << 20, "ds", "c").unwrap();
    let per = bytes.len() / 1_001_000;
    assert!(per <= 100, "{per} bytes per entry");
    let ix = Index::open(&bytes[..]).unwrap();
    let d = ix.lookup(ROOT, "d0500").unwrap();
    assert!(ix.lookup(d, "file-00999.jpg").is_some());
    assert_eq!(ix.children(d).unwrap().1, 1000);
}

/// A namespace says which kind of chunk hashes its files record, by its format: plain
/// ones keep format 1 (what earlier builds wrote and read), tree ones are format 2, and a
/// format this build does not know is refused by number.
#[test]
fn the_format_names_the_kind_of_chunk_hashes_and_an_unknown_one_is_refused() {
    use crate::chunks::ChunkKind;
    for (kind, format) in [(ChunkKind::Plain, FORMAT), (ChunkKind::Tree, FORMAT_TREE)] {
        let (bytes, _) = seal_with(sample(), (4 << 20, kind), "ds", "c1").unwrap();
        let t = bytes.len() - 96;
        assert_eq!(
            u32::from_le_bytes(bytes[t + 8..t + 12].try_into().unwrap()),
            format
        );
        let ix = Index::open(&bytes[..]).unwrap();
        assert_eq!(ix.chunk_kind(), kind);
        let mut later = bytes.clone();
        later[t + 8..t + 12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(Index::open(&later[..]).err(), Some(OpenError::Format(3)));
    }
    // The same entries sealed plain are the namespace earlier builds made.
    assert_eq!(
        seal(sample(), 4 << 20, "ds", "c1").unwrap(),
        seal_with(sample(), (4 << 20, ChunkKind::Plain), "ds", "c1").unwrap()
    );
}
