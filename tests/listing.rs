//! What the mount's directory listings tell the kernel, under the default
//! `--readdirplus adaptive`, as the mount's own counters record it: a walk of names alone
//! gets names only (the kernel makes no inode per entry); a walk that stats every file it
//! lists gets the attributes in the listings once its first stats show that, instead of a
//! LOOKUP round trip per file.

use locus_testkit as support;

use std::path::Path;

use support::*;

const DIRS: usize = 20;
const PER_DIR: usize = 1_000;

/// Lists every directory under `top`, then (with `stat`) stats each entry it listed,
/// directory after directory, as `find -printf %s` does; the entries seen.
fn walk(top: &Path, stat: bool) -> usize {
    let mut seen = 0;
    for d in std::fs::read_dir(top).unwrap() {
        let d = d.unwrap();
        assert!(d.file_type().unwrap().is_dir());
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                // The type comes with the name (d_type): no stat.
                assert!(e.file_type().unwrap().is_file());
                e.path()
            })
            .collect();
        if stat {
            for p in &names {
                assert!(std::fs::metadata(p).unwrap().is_file());
            }
        }
        seen += names.len();
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_carry_attributes_only_once_a_walk_is_seen_to_stat_what_it_lists() {
    let h = Harness::new("listing");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let node = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let mut c = m.client(None).await;
    let (entries, shards) = synthetic_manifest("walk", DIRS * PER_DIR, PER_DIR, DIRS * PER_DIR, 1 << 20);
    commit_mountable(&mut c, &node, "walk", 1 << 20, entries, shards)
        .await
        .unwrap();
    let files = (DIRS * PER_DIR) as u64;
    let totals = |s: &serde_json::Value, k: &str| s["totals"][k].as_u64().unwrap_or(0);

    // Names alone: every entry as a name, none with attributes; the only lookups are of
    // the directories the walk goes into.
    let names = m.mount("names", "walk@1", None, &[]);
    assert_eq!(walk(&names.path.join("top"), false), DIRS * PER_DIR);
    let s = names
        .status_when("the names-only walk counted", |s| {
            totals(s, "listed_names_only") >= files
        })
        .await;
    assert_eq!(totals(&s, "listed_with_attributes"), 0, "{}", s["totals"]);
    assert!(totals(&s, "lookups") <= (DIRS + 2) as u64, "{}", s["totals"]);

    // A stat of everything listed, on a fresh mount (the kernel knows no entry of it):
    // the first directory's files are looked up one by one, after which listings carry
    // the attributes and the rest need no lookup.
    let stats = m.mount("stats", "walk@1", None, &[]);
    assert_eq!(walk(&stats.path.join("top"), true), DIRS * PER_DIR);
    let s = stats
        .status_when("the stat walk counted", |s| {
            totals(s, "listed_names_only") + totals(s, "listed_with_attributes") >= files
        })
        .await;
    let (with, lookups) = (totals(&s, "listed_with_attributes"), totals(&s, "lookups"));
    assert!(
        with >= files - 2 * PER_DIR as u64,
        "most entries came with attributes: {}",
        s["totals"]
    );
    assert!(
        lookups <= 2 * PER_DIR as u64 + DIRS as u64,
        "no lookup per file after the first directories: {}",
        s["totals"]
    );

    // The same stat walk with every listing bare (`auto` gives attributes to the first
    // entries of each answer only): a lookup per file, which is what the adaptive
    // listing saves.
    let auto = m.mount("auto", "walk@1", None, &["--readdirplus", "auto"]);
    assert_eq!(walk(&auto.path.join("top"), true), DIRS * PER_DIR);
    let s = auto
        .status_when("the auto walk counted", |s| totals(s, "lookups") >= files / 2)
        .await;
    assert!(totals(&s, "lookups") > 4 * lookups, "{}", s["totals"]);
}
