//! A backup's blob list as read from the bucket (anyone who can write there can plant
//! one, with a valid checksum: BLAKE3 is no secret): decoded or refused, never a panic;
//! what decodes is in order and encodes back to the same bytes. Each input is tried as
//! it is and with its checksum appended, so the fuzzer reaches past the checksum.
use locus_backup::format::BlobList;

pub fn run(data: &[u8]) {
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(blake3::hash(data).as_bytes());
    for b in [data, &sealed[..]] {
        if let Ok(list) = BlobList::decode(b) {
            assert_eq!(list.encode(), b, "decode and encode disagree");
            for (h, _) in &list.0 {
                assert!(list.contains(h), "a listed blob is not found");
            }
            let _ = list.bytes();
        }
    }
}
