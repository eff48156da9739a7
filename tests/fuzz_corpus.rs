//! Every fuzz target's committed corpus, replayed through the code the fuzzer runs
//! (fuzz/bodies/, shared with fuzz/fuzz_targets/): an input that once broke a parser, or
//! reached a new corner of it, must never panic again. This is the regression half of
//! fuzzing, on every test run and on the ordinary build; `scripts/fuzz.sh` (nightly,
//! libFuzzer) is the other half, which looks for new inputs.

use std::path::Path;

#[path = "../fuzz/bodies/blob_list.rs"]
mod blob_list;
#[path = "../fuzz/bodies/catalogue.rs"]
mod catalogue;
#[path = "../fuzz/bodies/grant.rs"]
mod grant;
#[path = "../fuzz/bodies/http_bodies.rs"]
mod http_bodies;
#[path = "../fuzz/bodies/human.rs"]
mod human;
#[path = "../fuzz/bodies/index_record.rs"]
mod index_record;
#[path = "../fuzz/bodies/namespace.rs"]
mod namespace;
#[path = "../fuzz/bodies/raft_messages.rs"]
mod raft_messages;
#[path = "../fuzz/bodies/snapshot_signature.rs"]
mod snapshot_signature;

/// Runs `run` over every input of `target`'s corpus, naming each input that panics.
fn replay(target: &str, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "{} holds no inputs", dir.display());
    let mut failed = Vec::new();
    for p in &inputs {
        let data = std::fs::read(p).unwrap();
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            failed.push(p.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: {} of {} inputs panic:\n{}",
        failed.len(),
        inputs.len(),
        failed.join("\n")
    );
}

#[test]
fn blob_list_corpus_replays_without_a_panic() {
    replay("blob_list", blob_list::run);
}

#[test]
fn catalogue_corpus_replays_without_a_panic() {
    replay("catalogue", catalogue::run);
}

#[test]
fn grant_corpus_replays_without_a_panic() {
    replay("grant", grant::run);
}

#[test]
fn http_bodies_corpus_replays_without_a_panic() {
    replay("http_bodies", http_bodies::run);
}

#[test]
fn human_corpus_replays_without_a_panic() {
    replay("human", human::run);
}

#[test]
fn index_record_corpus_replays_without_a_panic() {
    replay("index_record", index_record::run);
}

#[test]
fn namespace_corpus_replays_without_a_panic() {
    replay("namespace", namespace::run);
}

#[test]
fn raft_messages_corpus_replays_without_a_panic() {
    replay("raft_messages", raft_messages::run);
}

#[test]
fn snapshot_signature_corpus_replays_without_a_panic() {
    replay("snapshot_signature", snapshot_signature::run);
}
