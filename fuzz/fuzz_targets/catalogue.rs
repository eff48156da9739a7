#![no_main]
//! The `catalogue` fuzz target. Its body is ../bodies/catalogue.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/catalogue.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
