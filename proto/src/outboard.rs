//! Verified ranges of a blob: BLAKE3's own tree, kept beside the blob as an *outboard*,
//! so that any range of a blob can be checked against the blob's hash (its name) without
//! reading the rest of it.
//!
//! A blob's BLAKE3 hash is the root of a binary tree over its 1 KiB chunks. Below a
//! group of [`GROUP`] bytes (16 chunks) the tree is recomputed from the bytes; above it,
//! every parent node is stored as the pair of its children's chaining values (64 bytes),
//! in pre-order: an outboard of about 1/256 of the blob. To verify bytes
//! `[start, end)` a reader needs them rounded out to whole groups, and the pairs on the
//! paths from the root down to those groups ([`proof`]); [`verify`] recomputes each
//! group's chaining value and each pair's parent up to the root, which must be the blob's
//! name. Nothing but the root is trusted. The shape of the tree is BLAKE3's (the left
//! subtree holds the largest power-of-two number of chunks less than the whole), so the
//! root is exactly `blake3::hash(blob)`.
//!
//! Built on blake3's `hazmat` API; every shape is tested against `blake3::hash`. A
//! node's store builds a blob's outboard as the blob arrives ([`Builder`], in the pass
//! that hashes it) and keeps it beside the blob; nodes compute the others a range is
//! asked of ([`outboard_from`], a piece at a time) and send the proof with each range;
//! docs/architecture.md, "Verified ranges".

use blake3::hazmat::{
    left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};

use crate::BlobHash;

mod build;
pub use build::{Builder, Sink};

/// Bytes per verification group: the unit a range is rounded to.
pub const GROUP: u64 = 16 * 1024;
/// Bytes of one stored parent node (its two children's chaining values).
pub const PAIR: usize = 64;

/// The outboard of `data`, and its root (the blob's hash).
pub fn outboard(data: &[u8]) -> (BlobHash, Vec<u8>) {
    let mut out = Vec::with_capacity(outboard_len(data.len() as u64));
    let root = if data.len() as u64 <= GROUP {
        *blake3::hash(data).as_bytes()
    } else {
        let (l, _) = split(data.len() as u64);
        let at = reserve(&mut out);
        let lcv = subtree(&data[..l as usize], 0, &mut out);
        let rcv = subtree(&data[l as usize..], l, &mut out);
        fill_pair(&mut out, at, &lcv, &rcv);
        *merge_subtrees_root(&lcv, &rcv, Mode::Hash).as_bytes()
    };
    (BlobHash(root), out)
}

/// Bytes [`outboard_from`] holds in memory at once: subtrees up to this size are read
/// whole and hashed from memory.
pub const STREAM_PIECE: u64 = 1 << 20;

/// The outboard and root of a blob of `len` bytes whose bytes `fill` gives front to back
/// (each call fills the whole buffer it is handed with the next bytes): a blob of any
/// size with at most [`STREAM_PIECE`] of it in memory. The same result as [`outboard`].
pub fn outboard_from<E>(
    len: u64,
    mut fill: impl FnMut(&mut [u8]) -> Result<(), E>,
) -> Result<(BlobHash, Vec<u8>), E> {
    let mut b = Builder::new(len, Vec::with_capacity(outboard_len(len)));
    let mut buf = vec![0u8; len.min(STREAM_PIECE) as usize];
    let mut left = len;
    while left > 0 {
        let n = left.min(STREAM_PIECE) as usize;
        fill(&mut buf[..n])?;
        b.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(b.finish().expect("exactly `len` bytes were pushed"))
}

/// Bytes of the outboard of a blob of `len` bytes: one pair per parent above the groups.
pub fn outboard_len(len: u64) -> usize {
    (len.div_ceil(GROUP).max(1) as usize - 1) * PAIR
}

/// Where a subtree of `len` bytes (more than one group) splits: (left, right) lengths.
fn split(len: u64) -> (u64, u64) {
    let l = left_subtree_len(len);
    (l, len - l)
}

fn reserve(out: &mut Vec<u8>) -> usize {
    out.extend_from_slice(&[0u8; PAIR]);
    out.len() - PAIR
}

fn fill_pair(out: &mut [u8], at: usize, l: &ChainingValue, r: &ChainingValue) {
    out[at..at + 32].copy_from_slice(l);
    out[at + 32..at + PAIR].copy_from_slice(r);
}

/// The chaining value of a non-root subtree starting at `offset`, its pairs appended.
fn subtree(data: &[u8], offset: u64, out: &mut Vec<u8>) -> ChainingValue {
    if data.len() as u64 <= GROUP {
        return group_cv(data, offset);
    }
    let (l, _) = split(data.len() as u64);
    let at = reserve(out);
    let lcv = subtree(&data[..l as usize], offset, out);
    let rcv = subtree(&data[l as usize..], offset + l, out);
    fill_pair(out, at, &lcv, &rcv);
    merge_subtrees_non_root(&lcv, &rcv, Mode::Hash)
}

fn group_cv(data: &[u8], offset: u64) -> ChainingValue {
    blake3::Hasher::new()
        .set_input_offset(offset)
        .update(data)
        .finalize_non_root()
}

/// `[start, end)` rounded out to whole groups, within a blob of `len` bytes.
pub fn rounded(start: u64, end: u64, len: u64) -> (u64, u64) {
    let s = start / GROUP * GROUP;
    let e = end.div_ceil(GROUP).saturating_mul(GROUP).min(len);
    (s.min(len), e)
}

/// The pairs a reader of `[start, end)` needs (in pre-order, as [`verify`] takes them),
/// cut from a blob's whole `outboard`. `len` is the blob's size. None when the outboard
/// is not the size a blob of `len` bytes has (a truncated or foreign file).
pub fn proof(outboard: &[u8], len: u64, start: u64, end: u64) -> Option<Vec<u8>> {
    if outboard.len() != outboard_len(len) {
        return None;
    }
    proof_with(len, start, end, |at| {
        let mut p = [0u8; PAIR];
        p.copy_from_slice(&outboard[at..at + PAIR]);
        Ok::<_, std::convert::Infallible>(p)
    })
    .ok()
}

/// [`proof`], reading each pair it needs with `pair(byte offset in the outboard)`: for an
/// outboard kept in a file, of which a range needs a few pages.
pub fn proof_with<E>(
    len: u64,
    start: u64,
    end: u64,
    mut pair: impl FnMut(usize) -> Result<[u8; PAIR], E>,
) -> Result<Vec<u8>, E> {
    let mut out = Vec::new();
    if len > GROUP {
        let mut at = 0;
        walk_proof(&mut pair, &mut at, 0, len, start, end, &mut out)?;
    }
    Ok(out)
}

fn walk_proof<E>(
    pair: &mut impl FnMut(usize) -> Result<[u8; PAIR], E>,
    at: &mut usize,
    offset: u64,
    len: u64,
    start: u64,
    end: u64,
    out: &mut Vec<u8>,
) -> Result<(), E> {
    if len <= GROUP {
        return Ok(());
    }
    let here = *at;
    *at += PAIR;
    let (l, r) = split(len);
    let wanted = |o: u64, n: u64| o < end && start < o + n;
    let (lw, rw) = (wanted(offset, l), wanted(offset + l, r));
    if lw || rw {
        out.extend_from_slice(&pair(here)?);
    }
    // Skipped subtrees are skipped in the outboard too (pre-order: a subtree's pairs are
    // contiguous).
    if lw {
        walk_proof(pair, at, offset, l, start, end, out)?;
    } else {
        *at += outboard_len(l);
    }
    if rw {
        walk_proof(pair, at, offset + l, r, start, end, out)?;
    } else {
        *at += outboard_len(r);
    }
    Ok(())
}

/// Why a range did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("the range {start}..{end} is not whole groups of the blob ({len} bytes)")]
    Shape { start: u64, end: u64, len: u64 },
    #[error("the proof is {got} bytes, {want} were needed")]
    ProofLength { got: usize, want: usize },
    #[error("the bytes at {offset} do not hash to the blob's tree")]
    Mismatch { offset: u64 },
}

/// Checks `data`, which must be bytes `[start, end)` of a blob of `len` bytes named
/// `root`, a range of whole groups (see [`rounded`]), against `proof` (from [`proof`] for
/// the same range). Ok only if every byte and every pair is the blob's, and the data is
/// the whole range (a transfer cut short at a group boundary is not a shorter range).
pub fn verify(
    root: &BlobHash,
    len: u64,
    start: u64,
    end: u64,
    data: &[u8],
    proof: &[u8],
) -> Result<(), RangeError> {
    if (start, end) != rounded(start, end, len)
        || end > len
        || (start >= end && len > 0)
        || data.len() as u64 != end - start
    {
        return Err(RangeError::Shape { start, end, len });
    }
    if len <= GROUP {
        if !proof.is_empty() {
            return Err(RangeError::ProofLength {
                got: proof.len(),
                want: 0,
            });
        }
        return match blake3::hash(data).as_bytes() == &root.0 {
            true => Ok(()),
            false => Err(RangeError::Mismatch { offset: 0 }),
        };
    }
    let mut at = 0;
    let want = proof_len(len, start, end);
    if proof.len() != want {
        return Err(RangeError::ProofLength {
            got: proof.len(),
            want,
        });
    }
    let v = Verifier {
        proof,
        data,
        start,
        end,
    };
    v.node(&mut at, 0, len, Expect::Root(&root.0))
}

/// Bytes of the proof for `[start, end)` of a blob of `len` bytes.
pub fn proof_len(len: u64, start: u64, end: u64) -> usize {
    fn walk(offset: u64, len: u64, start: u64, end: u64) -> usize {
        if len <= GROUP {
            return 0;
        }
        let (l, r) = split(len);
        let wanted = |o: u64, n: u64| o < end && start < o + n;
        let mut n = 0;
        if wanted(offset, l) || wanted(offset + l, r) {
            n += PAIR;
        }
        if wanted(offset, l) {
            n += walk(offset, l, start, end);
        }
        if wanted(offset + l, r) {
            n += walk(offset + l, r, start, end);
        }
        n
    }
    walk(0, len, start, end)
}

enum Expect<'a> {
    Root(&'a [u8; 32]),
    Node(ChainingValue),
}

struct Verifier<'a> {
    proof: &'a [u8],
    data: &'a [u8],
    start: u64,
    end: u64,
}

impl Verifier<'_> {
    fn node(&self, at: &mut usize, offset: u64, len: u64, want: Expect<'_>) -> Result<(), RangeError> {
        if len <= GROUP {
            let from = (offset - self.start) as usize;
            let bytes = &self.data[from..from + len as usize];
            let Expect::Node(cv) = want else {
                unreachable!("a blob of one group is checked whole")
            };
            return match group_cv(bytes, offset) == cv {
                true => Ok(()),
                false => Err(RangeError::Mismatch { offset }),
            };
        }
        let pair = &self.proof[*at..*at + PAIR];
        *at += PAIR;
        let l: ChainingValue = pair[..32].try_into().unwrap();
        let r: ChainingValue = pair[32..].try_into().unwrap();
        let ok = match want {
            Expect::Root(root) => merge_subtrees_root(&l, &r, Mode::Hash).as_bytes() == root,
            Expect::Node(cv) => merge_subtrees_non_root(&l, &r, Mode::Hash) == cv,
        };
        if !ok {
            return Err(RangeError::Mismatch { offset });
        }
        let (ll, rl) = split(len);
        let wanted = |o: u64, n: u64| o < self.end && self.start < o + n;
        if wanted(offset, ll) {
            self.node(at, offset, ll, Expect::Node(l))?;
        }
        if wanted(offset + ll, rl) {
            self.node(at, offset + ll, rl, Expect::Node(r))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        let mut x = 0x9e3779b97f4a7c15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Sizes around every boundary that changes the tree's shape.
    const SIZES: &[usize] = &[
        0,
        1,
        1024,
        16 * 1024 - 1,
        16 * 1024,
        16 * 1024 + 1,
        32 * 1024,
        48 * 1024 + 7,
        64 * 1024,
        100_000,
        1 << 20,
        (1 << 20) + 1,
        3 * (1 << 20) + 12_345,
    ];

    #[test]
    fn the_root_is_the_blobs_blake3_hash_and_the_outboard_its_announced_size() {
        for &n in SIZES {
            let d = data(n);
            let (root, ob) = outboard(&d);
            assert_eq!(root.0, *blake3::hash(&d).as_bytes(), "size {n}");
            assert_eq!(ob.len(), outboard_len(n as u64), "size {n}");
        }
        // About 1/256 of the data.
        assert_eq!(outboard_len(1 << 30), ((1 << 30) / GROUP as usize - 1) * PAIR);
    }

    #[test]
    fn every_range_verifies_with_its_proof_and_only_its_own_bytes() {
        for &n in SIZES {
            let d = data(n);
            let len = n as u64;
            let (root, ob) = outboard(&d);
            for (a, b) in [
                (0, 1),
                (0, len),
                (len / 3, len / 2 + 1),
                (len.saturating_sub(1), len),
            ] {
                if a >= b || b > len {
                    continue;
                }
                let (s, e) = rounded(a, b, len);
                let p = proof(&ob, len, s, e).unwrap();
                let bytes = &d[s as usize..e as usize];
                assert_eq!(
                    verify(&root, len, s, e, bytes, &p),
                    Ok(()),
                    "size {n} range {a}..{b}"
                );
                // Far smaller than the outboard for a small range of a large blob.
                if e - s <= GROUP && len >= 1 << 20 {
                    assert!(p.len() <= 64 * 8, "size {n}: proof of {} bytes", p.len());
                }
                // One flipped bit in the bytes.
                let mut bad = bytes.to_vec();
                let i = bad.len() / 2;
                bad[i] ^= 1;
                assert!(
                    matches!(
                        verify(&root, len, s, e, &bad, &p),
                        Err(RangeError::Mismatch { .. })
                    ),
                    "size {n} range {a}..{b}: a flipped bit passed"
                );
                // One flipped bit in the proof.
                if !p.is_empty() {
                    let mut badp = p.clone();
                    badp[p.len() / 2] ^= 1;
                    assert!(
                        matches!(
                            verify(&root, len, s, e, bytes, &badp),
                            Err(RangeError::Mismatch { .. })
                        ),
                        "size {n} range {a}..{b}: a wrong proof node passed"
                    );
                    assert!(matches!(
                        verify(&root, len, s, e, bytes, &p[..p.len() - 1]),
                        Err(RangeError::ProofLength { .. })
                    ));
                }
                // A truncated range is not whole groups (or not the blob's end).
                if bytes.len() > 1 {
                    assert!(
                        verify(&root, len, s, e, &bytes[..bytes.len() - 1], &p).is_err(),
                        "size {n} range {a}..{b} ({s}..{e}): a truncated range passed"
                    );
                }
            }
        }
    }

    #[test]
    fn an_outboard_read_a_piece_at_a_time_is_the_one_built_from_memory() {
        for n in [
            0usize,
            5000,
            1 << 20,
            (1 << 20) + 1,
            3 * (1 << 20) + 12_345,
            9 << 20,
        ] {
            let d = data(n);
            let mut at = 0;
            let mut largest = 0;
            let streamed = outboard_from::<()>(n as u64, |buf| {
                buf.copy_from_slice(&d[at..at + buf.len()]);
                at += buf.len();
                largest = largest.max(buf.len());
                Ok(())
            })
            .unwrap();
            assert_eq!(at, n, "size {n}: every byte read once");
            assert!(
                largest as u64 <= STREAM_PIECE,
                "size {n}: {largest} bytes at once"
            );
            assert_eq!(streamed, outboard(&d), "size {n}");
        }
        // A failed read ends it with that error.
        assert_eq!(outboard_from(4 << 20, |_| Err("disk")), Err("disk"));
    }

    #[test]
    fn an_outboard_of_the_wrong_size_gives_no_proof() {
        let d = data(100_000);
        let (_, ob) = outboard(&d);
        assert!(proof(&ob, 100_000, 0, GROUP).is_some());
        assert!(proof(&ob[..ob.len() - 1], 100_000, 0, GROUP).is_none());
        assert!(proof(&ob, 1 << 20, 0, GROUP).is_none());
    }

    #[test]
    fn a_range_of_another_blob_or_another_place_does_not_verify() {
        let (a, b) = (data(1 << 20), {
            let mut v = data(1 << 20);
            v[700_000] ^= 0x80;
            v
        });
        let len = a.len() as u64;
        let (ra, oa) = outboard(&a);
        let (_, ob) = outboard(&b);
        let (s, e) = rounded(688_128, 688_128 + GROUP, len);
        // b's bytes and b's proof for a range where b differs: not a's.
        let p = proof(&ob, len, s, e).unwrap();
        assert!(verify(&ra, len, s, e, &b[s as usize..e as usize], &p).is_err());
        // a's own group, claimed to sit one group later.
        let p2 = proof(&oa, len, s + GROUP, e + GROUP).unwrap();
        assert!(verify(&ra, len, s + GROUP, e + GROUP, &a[s as usize..e as usize], &p2).is_err());
    }
}
