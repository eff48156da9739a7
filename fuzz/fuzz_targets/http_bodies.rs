#![no_main]
//! The `http_bodies` fuzz target. Its body is ../bodies/http_bodies.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/http_bodies.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
