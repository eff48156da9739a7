#![no_main]
//! The `snapshot_signature` fuzz target. Its body is ../bodies/snapshot_signature.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/snapshot_signature.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
