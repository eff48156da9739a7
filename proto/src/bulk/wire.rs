//! The bulk path's wire format (see the parent module's table): constants, answer
//! codes, and requests as bytes.

use bytes::Bytes;

use crate::BlobHash;

/// The first bytes of every bulk connection, from both ends.
pub const MAGIC: [u8; 8] = *b"LOCUSBK1";
/// The first bytes of a bulk connection to a node that serves TLS, in clear, from the
/// client only; a TLS handshake follows, and then the bulk path as over plaintext
/// (hello with MAGIC and all). The same port tells it from gRPC's own TLS hello.
pub const MAGIC_TLS: [u8; 8] = *b"LOCUSBKT";
/// Bytes of a blob.
pub const OP_READ: u8 = 1;
/// A verified range of a chunk: proof and bytes.
pub const OP_RANGE: u8 = 2;
/// A blob for the node to store (an import): the client sends its bytes.
pub const OP_WRITE: u8 = 3;
/// Bytes of a WRITE request after the op byte: hash, size, chunk size, pin.
pub const WRITE_BODY: usize = 32 + 8 + 4 + 1;
/// Grants for WRITE are checked as grants for this call (an import grant).
pub const WRITE_GRANT_METHOD: &str = "WriteBlob";
/// Bytes of a READ request after the op byte.
pub const REQUEST_BODY: usize = 32 + 8 + 8;
/// Longest RANGE a node answers (a mount asks for at most a kernel read, 1 MiB, rounded
/// out to whole groups).
pub const RANGE_MAX: u64 = 8 << 20;
/// Bytes of a RANGE request after the op byte.
pub const RANGE_BODY: usize = 32 + 4 * 8;
/// Longest grant a hello may carry.
pub const MAX_GRANT: usize = 8 << 10;
/// Grants for the bulk path are checked as grants for this call (a read grant).
pub const GRANT_METHOD: &str = "ReadBlob";

/// Answer codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    Ok = 0,
    /// The node does not hold the blob.
    NotFound = 1,
    /// The node holds part of the blob, not the asked range.
    NotPresent = 2,
    /// The node's copy failed its check (now quarantined).
    DataLoss = 3,
    /// No grant, or one the node does not accept (expired, unknown key).
    Unauthenticated = 4,
    /// A grant that does not allow this.
    PermissionDenied = 5,
    /// A malformed request.
    Invalid = 6,
    Internal = 7,
    /// The node serves as many bulk connections as it will: use gRPC.
    Busy = 8,
    /// The node has no room for the blob (WRITE).
    Full = 9,
}

impl Code {
    pub fn from_u8(b: u8) -> Option<Code> {
        use Code::*;
        Some(match b {
            0 => Ok,
            1 => NotFound,
            2 => NotPresent,
            3 => DataLoss,
            4 => Unauthenticated,
            5 => PermissionDenied,
            6 => Invalid,
            7 => Internal,
            8 => Busy,
            9 => Full,
            _ => return None,
        })
    }
}

/// An error answer: code, then the message (cut to what a u16 length holds).
pub fn encode_error(code: Code, msg: &str) -> Vec<u8> {
    let mut m = msg.as_bytes();
    if m.len() > 1024 {
        m = &m[..1024];
    }
    let mut out = Vec::with_capacity(3 + m.len());
    out.push(code as u8);
    out.extend_from_slice(&(m.len() as u16).to_le_bytes());
    out.extend_from_slice(m);
    out
}

/// A request, as sent.
pub fn encode_read(h: &BlobHash, offset: u64, len: u64) -> [u8; 1 + REQUEST_BODY] {
    let mut out = [0u8; 1 + REQUEST_BODY];
    out[0] = OP_READ;
    out[1..33].copy_from_slice(&h.0);
    out[33..41].copy_from_slice(&offset.to_le_bytes());
    out[41..49].copy_from_slice(&len.to_le_bytes());
    out
}

/// A request body (after the op byte), decoded: (hash, offset, len).
pub fn decode_read(b: &[u8; REQUEST_BODY]) -> (BlobHash, u64, u64) {
    let mut h = [0u8; 32];
    h.copy_from_slice(&b[..32]);
    let offset = u64::from_le_bytes(b[32..40].try_into().unwrap());
    let len = u64::from_le_bytes(b[40..48].try_into().unwrap());
    (BlobHash(h), offset, len)
}

/// A WRITE request, as sent: store blob `h` of `size` bytes (hashed in chunks of
/// `chunk_size`), pinned or not.
pub fn encode_write(h: &BlobHash, size: u64, chunk_size: u32, pin: bool) -> [u8; 1 + WRITE_BODY] {
    let mut out = [0u8; 1 + WRITE_BODY];
    out[0] = OP_WRITE;
    out[1..33].copy_from_slice(&h.0);
    out[33..41].copy_from_slice(&size.to_le_bytes());
    out[41..45].copy_from_slice(&chunk_size.to_le_bytes());
    out[45] = u8::from(pin);
    out
}

/// A WRITE request body, decoded: (hash, size, chunk size, pin).
pub fn decode_write(b: &[u8; WRITE_BODY]) -> (BlobHash, u64, u32, bool) {
    let mut h = [0u8; 32];
    h.copy_from_slice(&b[..32]);
    let size = u64::from_le_bytes(b[32..40].try_into().unwrap());
    let chunk_size = u32::from_le_bytes(b[40..44].try_into().unwrap());
    (BlobHash(h), size, chunk_size, b[44] != 0)
}

/// A RANGE request: bytes `[start, end)` of the chunk `[chunk_offset, chunk_offset +
/// chunk_len)` of blob `hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeRequest {
    pub hash: BlobHash,
    pub chunk_offset: u64,
    pub chunk_len: u64,
    pub start: u64,
    pub end: u64,
}

impl RangeRequest {
    pub fn encode(&self) -> [u8; 1 + RANGE_BODY] {
        let mut out = [0u8; 1 + RANGE_BODY];
        out[0] = OP_RANGE;
        out[1..33].copy_from_slice(&self.hash.0);
        for (i, v) in [self.chunk_offset, self.chunk_len, self.start, self.end]
            .into_iter()
            .enumerate()
        {
            out[33 + 8 * i..41 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// A request body (after the op byte), decoded.
    pub fn decode(b: &[u8; RANGE_BODY]) -> Self {
        let mut h = [0u8; 32];
        h.copy_from_slice(&b[..32]);
        let at = |i: usize| u64::from_le_bytes(b[32 + 8 * i..40 + 8 * i].try_into().unwrap());
        RangeRequest {
            hash: BlobHash(h),
            chunk_offset: at(0),
            chunk_len: at(1),
            start: at(2),
            end: at(3),
        }
    }

    /// Why a node cannot answer it as asked, if it cannot (the blob is `size` bytes).
    pub fn invalid(&self, size: u64) -> Option<String> {
        // A bound on the bytes a node reads and checks in one buffer for one request.
        if self.end.saturating_sub(self.start) > RANGE_MAX {
            return Some(format!(
                "a range of {} bytes is longer than {RANGE_MAX}; read longer spans with READ",
                self.end - self.start
            ));
        }
        let c_end = self.chunk_offset.checked_add(self.chunk_len);
        if self.chunk_len == 0 || c_end.is_none_or(|e| e > size) {
            return Some(format!(
                "chunk {}+{} is not within the blob ({size} bytes)",
                self.chunk_offset, self.chunk_len
            ));
        }
        if self.start >= self.end
            || (self.start, self.end) != crate::outboard::rounded(self.start, self.end, self.chunk_len)
        {
            return Some(format!(
                "{}..{} is not a range of whole groups of a {}-byte chunk",
                self.start, self.end, self.chunk_len
            ));
        }
        None
    }

    /// Why a node does not compute this chunk's outboard to answer it, if it does not: the
    /// outboard it would read the chunk for and keep in memory (1/256 of the chunk) is
    /// bounded. A whole blob whose outboard the node keeps on disk has no such bound.
    pub fn too_dear_to_compute(&self) -> Option<String> {
        (self.chunk_len > u64::from(crate::MAX_CHUNK_SIZE)).then(|| {
            format!(
                "no outboard is kept for this blob, and one for {} bytes is not computed on request (at most {})",
                self.chunk_len,
                crate::MAX_CHUNK_SIZE
            )
        })
    }

    /// The bytes a RANGE answer carries: the length prefix, the proof, the data.
    pub fn answer_max(&self) -> u64 {
        let proof = crate::outboard::proof_len(self.chunk_len, self.start, self.end);
        4 + proof as u64 + (self.end - self.start)
    }
}

/// A verified-later range: the proof and the bytes as the node sent them (the caller
/// checks them with `outboard::verify`).
#[derive(Debug, Clone)]
pub struct Ranged {
    pub proof: Bytes,
    pub data: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outboard::{self, GROUP};

    fn req(chunk_len: u64, start: u64, end: u64) -> RangeRequest {
        RangeRequest {
            hash: BlobHash([1; 32]),
            chunk_offset: 0,
            chunk_len,
            start,
            end,
        }
    }

    #[test]
    fn an_answer_carries_exactly_the_proof_of_its_range_however_large_the_blob() {
        let data: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 241) as u8).collect();
        let (_, ob) = outboard::outboard(&data);
        let len = data.len() as u64;
        for (s, e) in [(0, GROUP), (7 * GROUP, 70 * GROUP), (len - GROUP, len)] {
            let p = outboard::proof(&ob, len, s, e).unwrap();
            assert_eq!(req(len, s, e).answer_max(), 4 + p.len() as u64 + (e - s));
        }
        // A whole blob of 64 GiB: a 16 KiB range's answer is a few pairs over its bytes,
        // not the blob's 256 MiB outboard.
        assert!(req(64 << 30, 0, GROUP).answer_max() < GROUP + 64 * 64);
    }

    #[test]
    fn only_an_outboard_past_the_largest_chunk_size_is_too_dear_to_compute() {
        let most = u64::from(crate::MAX_CHUNK_SIZE);
        assert!(req(most, 0, GROUP).too_dear_to_compute().is_none());
        let why = req(most + 1, 0, GROUP).too_dear_to_compute().unwrap();
        assert!(why.contains("not computed on request"), "{why}");
        // Not a shape error: the request itself is well formed.
        assert!(req(most + 1, 0, GROUP).invalid(most + 1).is_none());
    }
}
