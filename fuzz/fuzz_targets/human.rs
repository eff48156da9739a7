#![no_main]
//! The `human` fuzz target. Its body is ../bodies/human.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/human.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
