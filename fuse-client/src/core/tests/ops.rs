//! Every operation the adapter asks the core, with no kernel: what it answers for each
//! kind of entry, and the policy behind opens, backing files and listings.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use super::*;
use crate::core::listing::READDIRPLUS_ENTRIES;
use crate::core::ops::{LocalOpen, OpenPlan};
use crate::namespace::{Kind, ROOT};

fn dir(p: &str) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::Dir,
        mode: 0o755,
        mtime_ns: 1,
    }
}

fn link(p: &str, target: &str) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::Symlink {
            target: target.into(),
        },
        mode: 0o777,
        mtime_ns: 1,
    }
}

fn file(p: &str, data: &[u8]) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::File {
            size: data.len() as u64,
            blob: BlobHash::of(data),
            chunks: if data.is_empty() {
                vec![]
            } else {
                vec![BlobHash::of(data)]
            },
            shard: 0,
        },
        mode: 0o644,
        mtime_ns: 1,
    }
}

/// "f" (3 chunks) beside a directory of `n` files, a symlink and an empty file.
fn tree(n: usize, local: Option<LocalBehave>, tune: impl FnOnce(&mut Settings)) -> Fixture {
    let mut more = vec![dir("d"), link("l", "f"), file("empty", b"")];
    more.extend((0..n).map(|i| file(&format!("d/{i:03}"), format!("file {i}").as_bytes())));
    fixture_with(CHUNK, 3, (Behave::Good, Behave::Good), local, more, tune)
}

fn ino(f: &Fixture, parent: u64, name: &str) -> u64 {
    f.core.lookup(parent, OsStr::new(name)).unwrap().ino
}

#[test]
fn lookup_getattr_and_readlink_answer_from_the_namespace_each_failure_for_its_reason() {
    let f = tree(3, None, |_| {});
    let a = f.core.lookup(ROOT, OsStr::new("f")).unwrap();
    assert_eq!((a.ino, a.kind, a.size), (f.ino, Kind::File, f.data.len() as u64));
    assert!(matches!(
        f.core.lookup(ROOT, OsStr::new("nope")),
        Err(FsError::NotFound)
    ));
    // A name that is not UTF-8 names nothing a version can hold.
    assert!(matches!(
        f.core.lookup(ROOT, OsStr::from_bytes(b"\xff")),
        Err(FsError::NotFound)
    ));
    assert!(matches!(
        f.core.lookup(f.ino, OsStr::new("x")),
        Err(FsError::NotFound)
    ));
    let d = ino(&f, ROOT, "d");
    assert_eq!(f.core.lookup(d, OsStr::new("001")).unwrap().size, 6);

    assert_eq!(f.core.getattr(d).unwrap().kind, Kind::Dir);
    assert!(matches!(f.core.getattr(99_999), Err(FsError::NotFound)));

    let l = ino(&f, ROOT, "l");
    assert_eq!(f.core.readlink(l).unwrap(), "f");
    assert!(matches!(f.core.readlink(f.ino), Err(FsError::NotSymlink)));
    assert!(matches!(f.core.readlink(99_999), Err(FsError::NotFound)));
}

#[test]
fn an_open_is_refused_for_writers_and_directories_and_planned_by_what_the_mount_has() {
    let f = tree(1, None, |_| {});
    assert!(matches!(f.core.open(f.ino, true), Err(FsError::ReadOnly)));
    assert!(matches!(
        f.core.open(ino(&f, ROOT, "d"), false),
        Err(FsError::IsDir)
    ));
    assert!(matches!(f.core.open(99_999, false), Err(FsError::NotFound)));
    // No local node: remote replicas.
    assert!(matches!(
        f.core.open(f.ino, false),
        Ok(OpenPlan::Remote { ino, size }) if ino == f.ino && size == f.data.len() as u64
    ));

    let f = tree(1, Some(LocalBehave::File(PathBuf::new())), |_| {});
    // An empty file needs no node.
    let empty = ino(&f, ROOT, "empty");
    assert!(matches!(
        f.core.open(empty, false),
        Ok(OpenPlan::Remote { size: 0, .. })
    ));
    // A file the node has not given yet: ask it (off the session thread), then its file.
    let Ok(OpenPlan::AskNode { ino, size, blob }) = f.core.open(f.ino, false) else {
        panic!("the node is to be asked");
    };
    assert_eq!(blob, BlobHash::of(&f.data));
    let Some(node) = &f.local else { unreachable!() };
    assert_eq!(
        node.calls.load(Ordering::SeqCst),
        0,
        "nothing asked on the session thread"
    );
    assert!(matches!(
        f.core.open_fetched(ino, size, blob),
        OpenPlan::Local { .. }
    ));
    assert_eq!(node.calls.load(Ordering::SeqCst), 1);
    // Reopened within the reopen window: the node's file again, without asking it.
    assert!(matches!(f.core.open(f.ino, false), Ok(OpenPlan::Local { .. })));
    assert_eq!(node.calls.load(Ordering::SeqCst), 1);
    // A node that does not answer within its patience: remote replicas for this open.
    let hung = tree(1, Some(LocalBehave::Hang), |_| {});
    let Ok(OpenPlan::AskNode {
        ino: i,
        size: n,
        blob: b,
    }) = hung.core.open(hung.ino, false)
    else {
        panic!("the node is to be asked");
    };
    assert!(matches!(hung.core.open_fetched(i, n, b), OpenPlan::Remote { .. }));
    // Once INIT said the kernel opens files by itself, every open says so.
    f.core.negotiated.kernel_opens.store(true, Ordering::Relaxed);
    assert!(matches!(f.core.open(f.ino, false), Ok(OpenPlan::KernelOpens)));
    assert!(matches!(f.core.open(f.ino, true), Err(FsError::ReadOnly)));
}

#[test]
fn backing_files_are_for_large_whole_files_while_the_kernel_takes_them_and_kept_only_while_recent() {
    let f = tree(1, Some(LocalBehave::File(PathBuf::new())), |s| {
        s.passthrough_min_size = 1000;
    });
    let Ok(OpenPlan::AskNode { ino, size, blob }) = f.core.open(f.ino, false) else {
        panic!("the node is to be asked");
    };
    let OpenPlan::Local { file, .. } = f.core.open_fetched(ino, size, blob) else {
        panic!("the node's file");
    };
    // Not negotiated (or not offered): pread.
    assert_eq!(f.core.local_open(size, &file), LocalOpen::Pread);
    f.core.negotiated.passthrough.store(true, Ordering::Relaxed);
    assert_eq!(f.core.local_open(size, &file), LocalOpen::Passthrough);
    assert_eq!(
        f.core.local_open(999, &file),
        LocalOpen::Pread,
        "below the threshold"
    );
    let packed = NodeFile::of(file.file().try_clone().unwrap(), 4096, true);
    assert_eq!(
        f.core.local_open(size, &packed),
        LocalOpen::Pread,
        "a pack is never a backing file"
    );
    f.core.passthrough_refused(&"EPERM");
    assert_eq!(
        f.core.local_open(size, &file),
        LocalOpen::Pread,
        "refused once: pread from now on"
    );
    // Verified within the reopen window: a closed file keeps its backing id.
    assert!(f.core.keeps_backing(f.ino));
    assert!(!f.core.keeps_backing(ino + 1), "a file not opened recently");

    // No reopen window: every open asks the node, and no backing id outlives its opens.
    let f = tree(1, Some(LocalBehave::File(PathBuf::new())), |s| {
        s.reopen_ttl = Duration::ZERO;
    });
    let Ok(OpenPlan::AskNode { ino, size, blob }) = f.core.open(f.ino, false) else {
        panic!("the node is to be asked");
    };
    assert!(matches!(
        f.core.open_fetched(ino, size, blob),
        OpenPlan::Local { .. }
    ));
    assert!(!f.core.keeps_backing(f.ino));
    assert!(matches!(f.core.open(f.ino, false), Ok(OpenPlan::AskNode { .. })));
}

#[test]
fn opendir_and_listings_give_dot_entries_then_children_in_order_with_positions_to_resume_from() {
    let f = tree(5, None, |s| s.readdirplus = Readdirplus::All);
    let d = ino(&f, ROOT, "d");
    assert!(matches!(f.core.opendir(d), Ok(false)));
    assert!(matches!(f.core.opendir(f.ino), Err(FsError::NotDir)));
    assert!(matches!(f.core.opendir(99_999), Err(FsError::NotFound)));

    let names = |l: crate::core::ops::Listing<'_>| -> Vec<(String, u64)> {
        l.entries.map(|e| (e.name.to_string(), e.offset)).collect()
    };
    let all = names(f.core.list(d, 0, false).unwrap());
    let want: Vec<(String, u64)> = [".", "..", "000", "001", "002", "003", "004"]
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), i as u64 + 1))
        .collect();
    assert_eq!(all, want);
    // Resumed at an entry's offset: what follows it.
    assert_eq!(names(f.core.list(d, 4, false).unwrap()), want[4..].to_vec());
    assert_eq!(names(f.core.list(d, 1, false).unwrap()), want[1..].to_vec());
    let root = f.core.list(ROOT, 0, false).unwrap();
    let up: Vec<_> = root.entries.take(2).map(|e| (e.ino, e.kind)).collect();
    assert_eq!(
        up,
        vec![(ROOT, Kind::Dir), (ROOT, Kind::Dir)],
        "the root is its own parent"
    );
    assert!(matches!(f.core.list(f.ino, 0, false), Err(FsError::NotDir)));
    assert!(matches!(f.core.list(99_999, 0, true), Err(FsError::NotFound)));
    // READDIRPLUS under `All`: every entry with its attributes.
    let plus = f.core.list(d, 0, true).unwrap();
    assert!(plus.attributes);
    let attrs: Vec<_> = plus.entries.map(|e| e.attr.map(|a| a.ino)).collect();
    assert_eq!(attrs.len(), 7);
    assert!(attrs.iter().all(Option::is_some));

    // Once INIT said the kernel opens directories by itself.
    f.core.negotiated.kernel_opens.store(true, Ordering::Relaxed);
    assert!(matches!(f.core.opendir(d), Ok(true)));
}

#[test]
fn readdirplus_policies_auto_caps_each_answer_and_adaptive_learns_from_lookups() {
    let n = READDIRPLUS_ENTRIES + 8;
    let f = tree(n, None, |s| s.readdirplus = Readdirplus::Auto);
    let d = ino(&f, ROOT, "d");
    let l = f.core.list(d, 0, true).unwrap();
    assert!(l.attributes);
    assert_eq!(
        l.entries.count(),
        2 + READDIRPLUS_ENTRIES,
        "a page's worth of children"
    );
    // Plain READDIR is never capped.
    assert_eq!(f.core.list(d, 0, false).unwrap().entries.count(), 2 + n);

    let f = tree(n, None, |s| s.readdirplus = Readdirplus::Adaptive);
    let d = ino(&f, ROOT, "d");
    assert!(
        !f.core.list(d, 0, true).unwrap().attributes,
        "bare until stats follow listings"
    );
    // A stat walk: each file of the directory just listed is looked up.
    for i in 0..n {
        f.core.lookup(d, OsStr::new(&format!("{i:03}"))).unwrap();
    }
    let l = f.core.list(d, 0, true).unwrap();
    assert!(l.attributes, "lookups after a bare listing turn attributes on");
    assert_eq!(l.entries.count(), 2 + n);
}

#[test]
fn statfs_counts_the_versions_bytes_and_entries() {
    let f = tree(4, None, |_| {});
    let s = f.core.statfs();
    // "f", the 4 small files ("file i": 6 bytes each) and nothing for the rest.
    let bytes = f.data.len() as u64 + 4 * 6;
    assert_eq!(s.blocks, bytes.div_ceil(4096));
    // The root, "d", "l", "empty", "f" and the 4 files.
    assert_eq!(s.files, 9);
    assert_eq!((s.block_size, s.name_max), (4096, 255));
}
