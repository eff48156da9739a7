//! A backup's catalogue export as restore and backup read it (anyone who can write the
//! bucket controls these bytes; a signature is checked only once they are read): planned
//! and searched for a version, refused or used, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use locus_metadata::snapshot;

fuzz_target!(|data: &[u8]| {
    let _ = snapshot::plan(data);
    let _ = snapshot::version_from_export(data, "ds", None);
    let _ = snapshot::version_from_export(data, "ds", Some(1));
});
