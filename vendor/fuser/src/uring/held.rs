//! What a server taking over a connection finds in the ring entries a dead one left: each
//! entry's header page keeps a copy of the request being answered (`Queue::keep`), since
//! an answer overwrites the kernel's copy, and the next server answers that request again
//! (`Queue::held`).

use super::HEADER_LEN;
use super::IN_HEADER_LEN;
use super::OP_IN_LEN;
use super::PAGE;
use super::Queue;

/// In each header page, past the kernel's header: the note of the request being answered
/// (its id once the copy below is whole, the copy's length, flags), then the copy.
const NOTE: usize = 512;
const NOTE_DATA: usize = NOTE + 16;
/// Requests longer than this (writes, which a read-only mount never gets) are not kept.
const NOTE_CAP: usize = 3328;
const NOT_KEPT: u32 = u32::MAX;
// The note lies between the kernel's header and the request rebuilt at the page's end.
const _: () = assert!(NOTE >= HEADER_LEN && NOTE_DATA + NOTE_CAP <= PAGE - IN_HEADER_LEN - OP_IN_LEN);
/// Note flag: a read of a file into the entry's payload is in flight (`RingReply::read`).
const READING: u32 = 1;
/// Note flag: the answer to the request is whole in the entry, and was or is about to be
/// submitted (`Queue::fetch_next`).
const REPLIED: u32 = 2;

/// What a server taking over finds in an entry a previous one registered.
pub(super) enum Held {
    /// No request ever came to it.
    Unused,
    /// The request last handed to it, whose answer was not yet whole in the entry, and
    /// whether a read of a file into its payload was in flight.
    Request {
        unique: u64,
        bytes: Vec<u8>,
        reading: bool,
    },
    /// The request last handed to it, whose answer is whole in the entry: it is sent
    /// again as it is (COMMIT_AND_FETCH; ENOENT if the kernel had taken it).
    Replied(u64),
    /// A request that cannot be rebuilt: it is answered EIO.
    Unreadable(u64),
}

impl Queue {
    fn note(&self, slot: usize) -> *mut u8 {
        // SAFETY: within the entry's header page.
        unsafe { self.header(slot).add(NOTE) }
    }

    /// Keeps a copy of the request in `slot` before anything answers it: a reply
    /// overwrites the kernel's copy (its header, its payload), and a server taking over
    /// must be able to read the request again. The id is written last, once the copy is
    /// whole.
    pub(super) fn keep(&self, slot: usize, unique: u64, request: &[u8]) {
        let note = self.note(slot);
        // SAFETY: the note lies in the entry's header page past the kernel's header and
        // before the rebuilt request; the entry is this thread's until answered.
        unsafe {
            let kept = if request.len() <= NOTE_CAP {
                std::ptr::copy_nonoverlapping(request.as_ptr(), note.add(NOTE_DATA - NOTE), request.len());
                request.len() as u32
            } else {
                NOT_KEPT
            };
            std::ptr::write(note.add(8).cast::<u32>(), kept);
            std::ptr::write(note.add(12).cast::<u32>(), 0);
            std::sync::atomic::AtomicU64::from_ptr(note.cast::<u64>())
                .store(unique, std::sync::atomic::Ordering::Release);
        }
    }

    /// Marks the answer to the request in `slot` whole in the entry (its header and
    /// payload), just before its COMMIT_AND_FETCH is pushed.
    pub(super) fn replied(&self, slot: usize) {
        // SAFETY: the note's flags; nothing else writes them until the entry's next
        // request is kept.
        unsafe { std::ptr::write_volatile(self.note(slot).add(12).cast::<u32>(), REPLIED) };
    }

    pub(super) fn set_reading(&self, slot: usize, on: bool) {
        // SAFETY: the note's flags; the entry belongs to the request being answered.
        unsafe { std::ptr::write_volatile(self.note(slot).add(12).cast::<u32>(), u32::from(on) * READING) };
    }

    /// What a previous server left in `slot` (see `Held`). The request is the kept copy
    /// when the note names the request the kernel last handed the entry (an answer may
    /// have been written over the kernel's copy since); otherwise the note is older, no
    /// answer was begun, and the kernel's copy is whole.
    pub(super) fn held(&self, slot: usize, scratch: &mut Vec<u8>) -> Held {
        let header = self.header(slot);
        // SAFETY: the header page is mapped; the kernel wrote it when it handed the
        // entry its last request, and the server that had it is gone.
        let unique = unsafe { std::ptr::read_unaligned(header.add(8).cast::<u64>()) };
        if unique == 0 {
            return Held::Unused;
        }
        let note = self.note(slot);
        // SAFETY: as above, the note is in the same page.
        let (marker, kept, flags) = unsafe {
            (
                std::sync::atomic::AtomicU64::from_ptr(note.cast::<u64>())
                    .load(std::sync::atomic::Ordering::Acquire),
                std::ptr::read(note.add(8).cast::<u32>()),
                std::ptr::read(note.add(12).cast::<u32>()),
            )
        };
        if marker == unique && flags & REPLIED != 0 {
            // Answered in the entry, and no request came to it since. The kernel may have
            // taken the answer (then the entry was waiting for its next request) or not
            // (the server died before submitting it): the same answer is sent again, and
            // the request is never run twice (an OPEN run twice left a handle and a
            // backing id nobody releases).
            return Held::Replied(unique);
        }
        let bytes = if marker == unique {
            if kept == NOT_KEPT || kept as usize > NOTE_CAP {
                return Held::Unreadable(unique);
            }
            // SAFETY: `kept` bytes of the note, within the page.
            unsafe { std::slice::from_raw_parts(note.add(NOTE_DATA - NOTE), kept as usize) }.to_vec()
        } else {
            match self.request(slot, scratch) {
                // SAFETY: rebuilt by `request` in the entry's memory or in `scratch`.
                Ok((ptr, len, _, _)) => unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec(),
                Err(_) => return Held::Unreadable(unique),
            }
        };
        let own = bytes
            .get(8..16)
            .map(|b| u64::from_ne_bytes(b.try_into().unwrap()));
        if bytes.len() < IN_HEADER_LEN || own != Some(unique) {
            return Held::Unreadable(unique);
        }
        Held::Request {
            unique,
            bytes,
            reading: marker == unique && flags & READING != 0,
        }
    }
}
