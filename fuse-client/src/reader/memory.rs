//! Memory for the chunks a mount receives from remote replicas: one buffer per chunk,
//! backed by huge pages where the kernel gives them, kept for reuse once the chunk cache
//! lets the chunk go.
//!
//! Why: a mount's chunk cache fills with fresh memory (a 1 GiB cache read once evicts
//! nothing, so no buffer comes back to be reused), and each 4 KiB page of it cost a page
//! fault, a memory-cgroup charge and a zeroing on its first write, inside the socket's
//! receive copy: close to a third of the mount's CPU per remote MiB in a profile of the
//! `data_plane` bench. Asked for with `MADV_HUGEPAGE` (transparent huge pages are
//! commonly set to `madvise`), the kernel faults a chunk in 2 MiB at a time. Without
//! them nothing changes but the one buffer per chunk, which also lets a read that
//! straddles two received pieces be answered with a slice instead of a copy.

use std::collections::HashMap;
use std::sync::Mutex;

/// The huge page size on x86-64 and arm64 (4 KiB base pages).
const HUGE: usize = 2 << 20;
/// Bytes of free buffers kept for reuse at most.
const KEEP_FREE: usize = 64 << 20;

/// One chunk's bytes, `len` of them from `at` in `v`: `class` bytes of room plus, for a
/// huge buffer, the slack that lets `at` start on a huge page.
pub(crate) struct ChunkMemory {
    v: Vec<u8>,
    at: usize,
    len: usize,
    class: Class,
}

/// A buffer's room and whether it is backed by huge pages. Only chunks of whole huge
/// pages get them (every chunk of a file but its last, at the default 4 MiB): a huge
/// page is resident whole, so a 2.1 MiB chunk in huge pages would hold 4 MiB while the
/// cache counts 2.1. Other sizes are rounded up to 1 MiB, or to a power of two below
/// it, so a reused buffer holds little more than it is counted for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Class {
    room: usize,
    huge: bool,
}

impl Class {
    fn of(len: usize) -> Self {
        const MIB: usize = 1 << 20;
        match len {
            0 => Class { room: 1, huge: false },
            n if n % HUGE == 0 => Class { room: n, huge: true },
            n if n >= MIB => Class {
                room: n.next_multiple_of(MIB),
                huge: false,
            },
            n => Class {
                room: n.next_power_of_two(),
                huge: false,
            },
        }
    }
}

#[derive(Default)]
struct Free(HashMap<Class, Vec<Vec<u8>>>, usize);

fn free() -> &'static Mutex<Free> {
    static F: std::sync::OnceLock<Mutex<Free>> = std::sync::OnceLock::new();
    F.get_or_init(Default::default)
}

impl ChunkMemory {
    /// Room for `len` bytes: a kept buffer of the same size class if one waits, else a
    /// fresh one (whose pages are not touched here, so they come in as the receive copy
    /// writes them — as huge pages where possible).
    pub(crate) fn take(len: usize) -> Self {
        let class = Class::of(len);
        let kept = {
            let mut f = free().lock().unwrap();
            let v = f.0.get_mut(&class).and_then(Vec::pop);
            if v.is_some() {
                f.1 -= class.room;
            }
            v
        };
        let v = kept.unwrap_or_else(|| {
            // calloc: fresh mappings are zero already, so nothing is written yet.
            let v = vec![0u8; if class.huge { class.room + HUGE } else { class.room }];
            if class.huge {
                advise_huge(&v);
            }
            v
        });
        let at = if class.huge {
            v.as_ptr().align_offset(HUGE)
        } else {
            0
        };
        ChunkMemory { v, at, len, class }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + self.len]
    }
}

impl AsRef<[u8]> for ChunkMemory {
    fn as_ref(&self) -> &[u8] {
        &self.v[self.at..self.at + self.len]
    }
}

impl Drop for ChunkMemory {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        let mut f = free().lock().unwrap();
        if f.1 + self.class.room <= KEEP_FREE {
            f.1 += self.class.room;
            f.0.entry(self.class).or_default().push(v);
        }
    }
}

/// Asks for huge pages under the whole huge pages inside `v` (advice: a kernel without
/// them, or with them off, just says no).
fn advise_huge(v: &[u8]) {
    let start = v.as_ptr().align_offset(HUGE);
    let whole = (v.len() - start) / HUGE * HUGE;
    if whole == 0 {
        return;
    }
    // SAFETY: the range lies inside `v`'s allocation, which outlives the call;
    // MADV_HUGEPAGE changes how its pages are backed, never their contents.
    #[allow(unsafe_code)]
    let _ = unsafe {
        libc::madvise(
            v.as_ptr().add(start) as *mut libc::c_void,
            whole,
            libc::MADV_HUGEPAGE,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_buffer_starts_on_a_huge_page_and_comes_back_for_reuse_when_its_bytes_go() {
        let mut m = ChunkMemory::take(4 << 20);
        assert_eq!(m.as_mut_slice().len(), 4 << 20);
        assert_eq!(m.as_mut_slice().as_ptr() as usize % HUGE, 0);
        m.as_mut_slice()[..3].copy_from_slice(b"abc");
        let ptr = m.as_ref().as_ptr();
        let b = bytes::Bytes::from_owner(m);
        let half = b.slice(1..3);
        drop(b);
        assert_eq!(&half[..], b"bc");
        // Still referenced: another take gets another buffer.
        let other = ChunkMemory::take(3 << 20);
        assert_ne!(other.as_ref().as_ptr(), ptr);
        drop(half);
        let kept = |p: *const u8| {
            free().lock().unwrap().0[&Class::of(4 << 20)]
                .iter()
                .any(|v| v.as_ptr_range().contains(&p))
        };
        assert!(kept(ptr), "the freed buffer waits for reuse");
        drop(other);
    }

    #[test]
    fn only_chunks_of_whole_huge_pages_get_them_and_others_little_more_room_than_they_hold() {
        let c = |len| {
            let c = Class::of(len);
            (c.room, c.huge)
        };
        assert_eq!(c(4 << 20), (4 << 20, true));
        assert_eq!(c(2 << 20), (2 << 20, true));
        // A file's last chunk: in small pages, within 1 MiB of its size.
        assert_eq!(c((2 << 20) + 100), (3 << 20, false));
        assert_eq!(c(1000), (1024, false));
        assert_eq!(c(0), (1, false));
        let m = ChunkMemory::take((2 << 20) + 100);
        assert_eq!(m.as_ref().len(), (2 << 20) + 100);
        assert_eq!(m.v.len(), 3 << 20, "no slack for a buffer in small pages");
    }
}
