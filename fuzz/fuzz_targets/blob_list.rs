#![no_main]
//! The `blob_list` fuzz target. Its body is ../bodies/blob_list.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/blob_list.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
