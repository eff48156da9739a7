//! The system-call edge of the read path (`core::io`): direct reads of a blob's end from
//! any offset, and asking the page cache what it holds.

use super::*;

#[test]
fn a_read_that_ends_a_blob_is_read_direct_with_the_same_bytes_from_any_offset() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob");
    let data: Vec<u8> = (0..3 * 4096 + 1234u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let file = File::open(&path).unwrap();
    // Whether this filesystem takes O_DIRECT at all (tmpfs does not): then the direct
    // descriptor must open, else the read path keeps to the ordinary one.
    let takes_direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .is_ok();
    let Some(file) = open_direct(&file) else {
        assert!(
            !takes_direct,
            "O_DIRECT works here, so the direct descriptor must open"
        );
        return;
    };
    assert!(takes_direct, "a direct descriptor where O_DIRECT does not work");
    let mut space = vec![0u8; data.len() + 3 * DIRECT_ALIGN];
    let at = space.as_ptr().align_offset(DIRECT_ALIGN);
    // A blob that ends the file, from a page boundary or from anywhere (the last blob of
    // a pack); and one inside the file (a pack's blob with neighbours on both sides),
    // whose read must give its bytes and none of the neighbours'.
    let ranges = [
        (0, data.len()),
        (4096, data.len() - 4096),
        (12288, data.len() - 12288),
        (100, data.len() - 100),
        (4097, data.len() - 4097),
        (5000, 3000),
        (4095, 2),
        (1, 4096),
    ];
    for (off, want) in ranges {
        // The reply's buffer: page-aligned, with the room the read path gives it.
        let buf = &mut space[at..at + direct_room(off as u64, want)];
        buf.fill(0xEE);
        let n = pread_direct(&file, off as u64, want, buf)
            .unwrap_or_else(|| panic!("the read at {off} must be direct"))
            .unwrap();
        assert_eq!(n, want, "at {off}");
        assert_eq!(&buf[..n], &data[off..off + want], "at {off}");
    }
    // The room is the pages the range touches, no more: a 1 MiB read from a page
    // boundary fits an io_uring entry's 1 MiB payload.
    assert_eq!(direct_room(0, 1 << 20), 1 << 20);
    assert_eq!(direct_room(8192 + 100, 3996), 4096);
    assert_eq!(direct_room(100, 3997), 8192);
    // A buffer off a page boundary, or one too small for the pages the range touches, is
    // left to the ordinary read.
    assert!(pread_direct(&file, 0, data.len(), &mut space[at + 1..]).is_none());
    assert!(pread_direct(&file, 0, data.len(), &mut space[at..at + data.len()]).is_none());
    assert!(pread_direct(&file, 100, 4096, &mut space[at..at + 4096]).is_none());
    // A file that shrank after its check reads short, for the caller to refuse.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5000)
        .unwrap();
    for off in [4096, 4100] {
        let want = data.len() - off;
        let buf = &mut space[at..at + direct_room(off as u64, want)];
        let n = pread_direct(&file, off as u64, want, buf).unwrap().unwrap();
        assert_eq!(&buf[..n], &data[off..5000], "at {off}");
    }
}

/// `cached` tells pages in the page cache from pages that are not, without reading
/// them: a range written a moment ago is cached; a range never written nor read is not,
/// and asking does not make it so (a read with RWF_NOWAIT would have started reading it).
#[test]
fn the_page_cache_is_asked_what_it_holds_without_reading_anything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[7u8; 3 * 4096], 0).unwrap();
    f.set_len(4 << 20).unwrap();
    let Some(first) = cached(&f, 100, 8000) else {
        // Before Linux 6.5 nothing can say, and then it must keep saying nothing: the
        // read path takes None for "read as before" (RWF_NOWAIT first), never for cold.
        eprintln!("this kernel has no cachestat: only the fallback is checked");
        assert_eq!(cached(&f, 2 << 20, 128 << 10), None);
        assert_eq!(cached(&f, 0, 4096), None);
        return;
    };
    assert!(first, "pages written a moment ago are in the page cache");
    assert_eq!(cached(&f, 2 << 20, 128 << 10), Some(false));
    assert_eq!(
        cached(&f, 2 << 20, 128 << 10),
        Some(false),
        "asking read nothing in"
    );
    // A range that is partly cached is not cached.
    assert_eq!(cached(&f, 8192, 8192), Some(false));
    assert_eq!(cached(&f, 0, 0), None, "an empty range has no answer");
}
