#![no_main]
//! The `namespace` fuzz target. Its body is ../bodies/namespace.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/namespace.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
