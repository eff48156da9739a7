//! A backup's catalogue export as restore and backup read it (anyone who can write the
//! bucket controls these bytes; a signature is checked only once they are read): planned,
//! searched for a version and restored into an in-memory store — each row checked like
//! API input — or refused; never a panic.
use locus_metadata::{snapshot, store::MemStore};

pub fn run(data: &[u8]) {
    let _ = snapshot::plan(data);
    let _ = snapshot::version_from_export(data, "ds", None);
    let _ = snapshot::version_from_export(data, "ds", Some(1));
    let _ = snapshot::restore(data, &MemStore::default(), "file:///fuzz", "snap", None);
}
