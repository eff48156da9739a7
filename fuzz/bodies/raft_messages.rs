//! The bodies of the metadata group's Raft messages as a member decodes them from its
//! raft port (bincode, bounded): any bytes decode or are refused, without a panic and
//! without allocating what a length prefix merely claims.

pub fn run(data: &[u8]) {
    if let Some((kind, body)) = data.split_first() {
        let _ = locus_metadata::group::decode_for_fuzzing(*kind, body);
    }
}
