//! A cache node's index values as it reads them at start (a damaged disk or an older
//! build's records): decoded and checked, or dropped; never a panic.

pub fn run(data: &[u8]) {
    if let Ok((chunks, missing)) = locus_cache_node::store::check_index_record(data) {
        assert!(missing as u64 <= chunks);
    }
}
