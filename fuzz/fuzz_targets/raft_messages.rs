#![no_main]
//! The `raft_messages` fuzz target. Its body is ../bodies/raft_messages.rs, which the test suite also runs over
//! this target's committed corpus (tests/fuzz_corpus.rs).
#[path = "../bodies/raft_messages.rs"]
mod body;
libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
