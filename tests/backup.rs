//! Backups end to end: a real cluster (metadata service and three cache nodes) backed up
//! through the real CLI to a `file://` target and to SeaweedFS (a real, persistent
//! S3-compatible server), incremental runs, an S3 server killed mid-backup, verification,
//! retention with garbage collection, and the restore drill: everything wiped, restored,
//! mounted and compared byte for byte with the original files.
//!
//! Longer than our ~700-line guide on purpose: every file under `tests/` is its own binary
//! that links the whole workspace (seconds each on two cores), so end-to-end tests of one
//! component share one file. Helpers belong in `testkit/`, not here.

use locus_testkit as support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use support::*;

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "command failed: {}{}", stdout(o), stderr(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// Field `k` of every element of a JSON array of objects.
fn column<'a>(v: &'a serde_json::Value, k: &str) -> Vec<&'a str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s[k].as_str().unwrap())
        .collect()
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// Every blob object under a `file://` target: hash (file name) → size.
/// The sealed namespace of `target` (NAME@VERSION): its blob's hash and size, as `dataset
/// show --json` gives them (a backup stores it like a file's blob).
fn namespace_of(m: &Metadata, target: &str) -> (String, u64) {
    let v = json(&m.cli(&["dataset", "show", target, "--json"]));
    let ns = &v["namespace"];
    (
        ns["blob"].as_str().expect("a sealed namespace").to_string(),
        u(ns, "bytes"),
    )
}

fn stored_blobs(target: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(dirs) = std::fs::read_dir(target.join("blobs")) else {
        return out;
    };
    for d in dirs {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            let f = f.unwrap();
            out.insert(
                f.file_name().to_string_lossy().into_owned(),
                f.metadata().unwrap().len(),
            );
        }
    }
    out
}

/// The hashes a snapshot's blob list names (format: "LOCUSBL1", 40-byte records, checksum).
fn listed_blobs(target: &Path, snapshot: &str) -> BTreeSet<String> {
    let b = std::fs::read(target.join("snapshots").join(snapshot).join("blobs")).unwrap();
    b[8..b.len() - 32]
        .chunks_exact(40)
        .map(|c| {
            blake3::Hash::from_bytes(c[..32].try_into().unwrap())
                .to_hex()
                .to_string()
        })
        .collect()
}

/// path → what it is: file content hash, symlink target, or "dir".
fn tree(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.file_type().is_symlink() {
                out.insert(rel, format!("-> {}", std::fs::read_link(&p).unwrap().display()));
            } else if m.is_dir() {
                out.insert(rel, "dir".into());
                walk(root, &p, out);
            } else {
                let data = std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
                out.insert(rel, blake3::hash(&data).to_hex().to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn backup(m: &Metadata, url: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["backup", "run", "--to", url, "--json"];
    args.extend_from_slice(extra);
    json(&m.cli(&args))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backups_to_a_directory_are_incremental_verified_and_collected() {
    let h = Harness::new("backup-file");
    let (m, _nodes) = cluster(&h, 3, NodeOpts::host).await;
    let (a, b) = (h.path("src-a"), h.path("src-b"));
    make_tree(&a, 60);
    std::fs::create_dir_all(&b).unwrap();
    for i in 0..10 {
        std::fs::write(
            b.join(format!("part-{i}")),
            pseudo_random(1000 + i, 50_000 + i as usize),
        )
        .unwrap();
    }
    for (name, dir) in [("alpha", &a), ("beta", &b)] {
        let o = import(&m, name, dir, &["--replicas", "2", "--shard-size", "256KiB"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let target = h.path("backup");
    let url = format!("file://{}", target.display());

    // Full backup: every blob once, each object named by its content's hash.
    let r1 = backup(&m, &url, &[]);
    assert_eq!(r1["committed"], true);
    assert_eq!(u(&r1, "datasets"), 2);
    assert!(u(&r1, "blobs") > 50);
    assert_eq!(u(&r1, "blobs_uploaded"), u(&r1, "blobs"));
    assert_eq!(u(&r1, "bytes_uploaded"), u(&r1, "bytes_scanned"));
    let stored = stored_blobs(&target);
    assert_eq!(stored.len() as u64, u(&r1, "blobs"));
    for hash in stored.keys() {
        let p = target.join("blobs").join(&hash[..2]).join(hash);
        assert_eq!(
            &blake3::hash(&std::fs::read(p).unwrap()).to_hex().to_string(),
            hash
        );
    }
    assert_eq!(stored.values().sum::<u64>(), u(&r1, "bytes_scanned"));

    // The cluster knows its backup: `locus status` and the metadata service's metrics.
    let st = json(&m.cli(&["status", "--json"]));
    assert_eq!(st["backups"][0]["url"], url.as_str());
    assert_eq!(st["backups"][0]["snapshot"], r1["snapshot"]);
    let metrics = http_get(m.http, "/metrics").await;
    let last = metrics
        .lines()
        .find(|l| l.starts_with("locus_metadata_last_backup_timestamp_seconds"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(last > 1_700_000_000, "{metrics}");

    // Nothing changed: nothing is sent.
    let r2 = backup(&m, &url, &[]);
    assert_eq!(u(&r2, "bytes_uploaded"), 0, "{r2}");
    assert_eq!(u(&r2, "blobs_skipped"), u(&r2, "blobs"));

    // A new version sharing most files: only its new blobs go up.
    let a2 = h.path("src-a2");
    assert!(std::process::Command::new("cp")
        .arg("-a")
        .arg(&a)
        .arg(&a2)
        .status()
        .unwrap()
        .success());
    std::fs::write(a2.join("val/file 0002.bin"), b"changed content").unwrap();
    std::fs::write(a2.join("brand-new.bin"), pseudo_random(77, 123_456)).unwrap();
    let o = import(&m, "alpha", &a2, &["--replicas", "2", "--shard-size", "256KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r3 = backup(&m, &url, &[]);
    // Its two new files and its sealed namespace.
    let (_, ns) = namespace_of(&m, "alpha@latest");
    assert_eq!(u(&r3, "blobs_uploaded"), 3, "{r3}");
    assert_eq!(u(&r3, "bytes_uploaded"), 15 + 123_456 + ns);
    assert_eq!(u(&r3, "versions"), 3);

    // list: three committed snapshots with their figures.
    let list = json(&m.cli(&["backup", "list", "--to", &url, "--json"]));
    let snaps = list.as_array().unwrap();
    assert_eq!(snaps.len(), 3);
    assert!(snaps.iter().all(|s| s["state"] == "committed"));
    assert_eq!(snaps[2]["id"], r3["snapshot"]);
    assert_eq!(snaps[2]["committed"]["bytes_uploaded"], r3["bytes_uploaded"]);
    // A damaged manifest is shown with its snapshot, not a failed listing.
    let mp = target
        .join("snapshots")
        .join(snaps[0]["id"].as_str().unwrap())
        .join("manifest.json");
    let good = std::fs::read(&mp).unwrap();
    std::fs::write(&mp, b"{ not json").unwrap();
    let o = m.cli(&["backup", "list", "--to", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("committed, DAMAGED"), "{}", stdout(&o));
    std::fs::write(&mp, good).unwrap();
    let table = m.cli(&["backup", "list", "--to", &url]);
    assert!(stdout(&table).contains("alpha(2)"), "{}", stdout(&table));

    // verify: clean, then a damaged and a missing blob are both named.
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]));
    assert_eq!(u(&v, "blobs_checked"), u(&r3, "blobs"));
    assert_eq!(v["catalog_ok"], true);
    let (victim, gone) = {
        let mut big = stored.iter().filter(|(_, s)| **s > 1000);
        (big.next().unwrap().0.clone(), big.next().unwrap().0.clone())
    };
    let vp = target.join("blobs").join(&victim[..2]).join(&victim);
    let gp = target.join("blobs").join(&gone[..2]).join(&gone);
    let (orig_v, orig_g) = (std::fs::read(&vp).unwrap(), std::fs::read(&gp).unwrap());
    let mut bad = orig_v.clone();
    bad[500] ^= 1;
    std::fs::write(&vp, bad).unwrap();
    std::fs::remove_file(&gp).unwrap();
    let o = m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url]);
    assert!(!o.status.success());
    assert!(
        stdout(&o).contains(&format!("corrupt  {victim}")),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains(&format!("missing  {gone}")), "{}", stdout(&o));
    // A sample reads fewer blobs.
    let o = m.cli(&[
        "backup",
        "verify",
        "--allow-unsigned",
        "--to",
        &url,
        "--sample",
        "0.25",
        "--json",
    ]);
    let sampled: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(u(&sampled, "blobs_checked") < u(&r3, "blobs"), "{sampled}");
    // --repair has the nodes send both again; then everything verifies.
    let o = m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--repair"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains(&format!("repaired {victim}")),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains(&format!("repaired {gone}")), "{}", stdout(&o));
    assert_eq!(std::fs::read(&vp).unwrap(), orig_v);
    assert_eq!(std::fs::read(&gp).unwrap(), orig_g);
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]));
    assert!(v["corrupt"].as_array().unwrap().is_empty() && v["missing"].as_array().unwrap().is_empty());

    // Retention: drop beta, back up, keep only the newest snapshot. What remains is
    // exactly what that snapshot lists, plus what an in-progress backup has announced.
    let o = m.cli(&["dataset", "rm", "beta", "--all-versions"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r4 = backup(&m, &url, &[]);
    let newest = r4["snapshot"].as_str().unwrap().to_string();
    let running = "29991231T000000Z-running";
    let running_dir = target.join("snapshots").join(running);
    std::fs::create_dir_all(&running_dir).unwrap();
    // A run that has announced its blob list (one blob only beta had) but not finished.
    let beta_only: String = listed_blobs(&target, r1["snapshot"].as_str().unwrap())
        .difference(&listed_blobs(&target, &newest))
        .next()
        .unwrap()
        .clone();
    let mut list = b"LOCUSBL1".to_vec();
    list.extend_from_slice(blake3::Hash::from_hex(&beta_only).unwrap().as_bytes());
    list.extend_from_slice(&stored[&beta_only].to_be_bytes());
    let sum = blake3::hash(&list);
    list.extend_from_slice(sum.as_bytes());
    std::fs::write(running_dir.join("blobs"), list).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    std::fs::write(
        running_dir.join("manifest.json"),
        format!(
            r#"{{"format":1,"id":"{running}","cluster_id":"c","created_ms":{now_ms},"datasets":[],
               "blobs":1,"blob_bytes":0,"catalog_bytes":0,"catalog_blake3":""}}"#
        ),
    )
    .unwrap();
    let dry = json(&m.cli(&[
        "backup",
        "gc",
        "--to",
        &url,
        "--keep-last",
        "1",
        "--dry-run",
        "--json",
    ]));
    assert_eq!(dry["snapshots_deleted"].as_array().unwrap().len(), 3);
    assert_eq!(
        stored_blobs(&target).len(),
        // The third version's two new files and its sealed namespace.
        stored.len() + 3,
        "a dry run deletes nothing"
    );
    let g = json(&m.cli(&["backup", "gc", "--to", &url, "--keep-last", "1", "--json"]));
    assert_eq!(g["snapshots_kept"], serde_json::json!([newest.clone()]));
    assert_eq!(g["snapshots_in_progress"], serde_json::json!([running]));
    let mut expect = listed_blobs(&target, &newest);
    expect.insert(beta_only.clone());
    let left: BTreeSet<String> = stored_blobs(&target).into_keys().collect();
    assert_eq!(left, expect);
    assert!(u(&g, "blobs_deleted") > 5);
    let list = json(&m.cli(&["backup", "list", "--to", &url, "--json"]));
    let ids = column(&list, "id");
    assert_eq!(ids, vec![newest.as_str(), running]);
    // The kept snapshot is still whole.
    std::fs::remove_dir_all(&running_dir).unwrap();
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]));
    assert_eq!(v["snapshot"], newest.as_str());
    assert!(v["missing"].as_array().unwrap().is_empty());

    // The target and retention from the config file's [backup] section (a nightly timer
    // runs `locus backup run` with no flags): a committed run, then retention.
    let cfg = h.path("locus.toml");
    std::fs::write(&cfg, format!("[backup]\nto = \"{url}\"\nkeep_last = 1\n")).unwrap();
    let r5 = json(&m.cli(&["--config", cfg.to_str().unwrap(), "backup", "run", "--json"]));
    assert_eq!(r5["committed"], true);
    assert_eq!(r5["target"], url.as_str());
    assert_eq!(u(&r5, "bytes_uploaded"), 0);
    assert_eq!(
        r5["gc"]["snapshots_kept"],
        serde_json::json!([r5["snapshot"].clone()])
    );
    assert_eq!(r5["gc"]["snapshots_deleted"], serde_json::json!([newest.clone()]));

    // A garbage collection that overlaps a run may delete a blob the run skipped as already
    // stored (its previous snapshot listed it). Here: a collection is "running" when the
    // run starts and has deleted one such blob. The run re-checks every blob before it
    // commits and sends the missing one again.
    let latest = r5["snapshot"].as_str().unwrap();
    let victim = listed_blobs(&target, latest).into_iter().next().unwrap();
    let vp = target.join("blobs").join(&victim[..2]).join(&victim);
    std::fs::remove_file(&vp).unwrap();
    let gc_running = |started_ms: u128| {
        std::fs::write(
            target.join("gc/STATE"),
            format!(r#"{{"id":"other-{started_ms}","running":true,"started_ms":{started_ms}}}"#),
        )
        .unwrap()
    };
    // A "running" marker a day old is a collection that died: no re-check (the run trusts
    // its previous snapshot's list, so the blob stays missing and verify says so)...
    let day_ago = now_ms - 2 * 86_400_000;
    gc_running(day_ago);
    let stale = backup(&m, &url, &[]);
    assert_eq!(u(&stale, "blobs_uploaded"), 0, "{stale}");
    assert!(!vp.exists());
    // ...while a live one makes the run check every blob and send the missing one again.
    gc_running(day_ago + 2 * 86_400_000);
    let r6 = backup(&m, &url, &[]);
    assert_eq!(r6["committed"], true);
    assert_eq!(u(&r6, "blobs_uploaded"), 1, "{r6}");
    assert!(vp.exists());
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]));
    assert!(v["missing"].as_array().unwrap().is_empty());

    // Bad input: a target that is not a URL, an unknown snapshot, no target at all.
    let o = m.cli(&["backup", "run", "--to", "/not/a/url"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not an object-store URL"), "{}", stderr(&o));
    let o = m.cli(&[
        "backup",
        "verify",
        "--allow-unsigned",
        "--to",
        &url,
        "--snapshot",
        "../etc",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a snapshot id"), "{}", stderr(&o));
    let o = m.cli(&[
        "backup",
        "verify",
        "--allow-unsigned",
        "--to",
        &url,
        "--snapshot",
        "20200101T000000Z-000-abcdef",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no snapshot"), "{}", stderr(&o));
    let o = m.cli(&["backup", "list"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no backup target"), "{}", stderr(&o));
    // A cloud target without credentials fails the run, naming the target.
    let o = m.cli(&["backup", "run", "--to", "gs://bucket/x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("gs://bucket/x"), "{}", stderr(&o));
    assert!(stderr(&o).contains("was not committed"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_drill_brings_every_byte_back_from_the_backup() {
    let h = Harness::new("backup-drill");
    let (mut m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let (a, b) = (h.path("src-a"), h.path("src-b"));
    make_tree(&a, 40);
    std::fs::create_dir_all(b.join("shards")).unwrap();
    for i in 0..6 {
        std::fs::write(
            b.join(format!("shards/{i:03}.tar")),
            pseudo_random(500 + i, 300_000),
        )
        .unwrap();
    }
    for (name, dir) in [("images", &a), ("text", &b)] {
        let o = import(&m, name, dir, &["--replicas", "2", "--shard-size", "256KiB"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let expect = [("images", tree(&a)), ("text", tree(&b))];
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let r = backup(&m, &url, &[]);
    assert_eq!(r["committed"], true);

    drill(
        &mut m,
        &mut nodes,
        &url,
        r["snapshot"].as_str().unwrap(),
        &expect,
        &[&a, &b],
        ("text", 6 * 300_000),
    )
    .await;

    // Someone deletes a dataset (under its mounts, forced): it comes back from the backup
    // into the running cluster, as its next version (numbers are never reused), identical
    // to the original.
    let o = m.cli(&["dataset", "rm", "text", "--all-versions", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "text@1",
        "--json",
    ]);
    let r = json(&o);
    assert_eq!(r["dataset"], "text");
    assert_eq!(r["version"], 2);
    assert_eq!(r["replicas"], 2);
    // Each replica's blobs were written to its node: from the backup, or found cached there.
    assert_eq!(u(&r, "uploaded_bytes") + u(&r, "skipped_bytes"), 2 * 6 * 300_000);
    let mnt = m.mount("mnt-text-2", "text@2", Some(&nodes[1]), &[]);
    assert_eq!(tree(&mnt.path), expect[1].1);
    drop(mnt);
    // Under another name, and refusals: a version the snapshot lacks, both modes at once.
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "images",
        "--as",
        "images-copy",
        "--json",
    ]);
    assert_eq!(json(&o)["version"], 1);
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "text@7",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("does not hold text@7"), "{}", stderr(&o));
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        &url,
        "--dataset",
        "text",
        "--data-dir",
        "/tmp/x",
    ]);
    assert!(!o.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_to_s3_survives_the_server_dying_resumes_and_restores() {
    let h = Harness::new("backup-s3");
    let mut weed = h.start_weed().await;
    // The nodes (which upload) and the CLI inherit the S3 settings.
    for (k, v) in weed.env() {
        std::env::set_var(k, v);
    }
    // A server that stops answering should fail a run in seconds here, not minutes.
    std::env::set_var("LOCUS_OBJECT_STORE_TIMEOUT", "2s");
    let (mut m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let small = h.path("src-small");
    make_tree(&small, 20);
    let o = import(&m, "small", &small, &["--replicas", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let url = "s3://locus/nightly";
    let r1 = backup(&m, url, &[]);
    assert_eq!(r1["committed"], true);
    let first = r1["snapshot"].as_str().unwrap().to_string();

    // A bigger dataset, and the server killed while its blobs go up.
    let big = h.path("src-big");
    std::fs::create_dir_all(&big).unwrap();
    let files = 400;
    for i in 0..files {
        std::fs::write(big.join(format!("f{i:04}")), pseudo_random(9000 + i, 200_000)).unwrap();
    }
    let o = import(&m, "big", &big, &["--replicas", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bucket = weed.bucket();
    let before = count(bucket.clone()).await;
    let mut run = std::process::Command::new(locus());
    run.args(["backup", "run", "--to", url])
        .env("LOCUS_METADATA", m.url())
        .env_remove("LOCUS_TOKEN")
        .env_remove("LOCUS_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = spawn_while_uploading(&mut run, &bucket, before + 40).await;
    weed.kill9();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "the run must fail: {}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("was not committed"), "{err}");
    assert!(err.contains("rerun to resume"), "{err}");
    // Credentials come from the environment and are never echoed, even in errors.
    assert!(!err.contains(S3_SECRET) && !stdout(&out).contains(S3_SECRET));
    for n in &nodes {
        let log = std::fs::read_to_string(&n.daemon.log).unwrap();
        assert!(!log.contains(S3_SECRET), "{} logged the secret", n.id);
    }

    weed.restart().await;
    let stored = count(weed.bucket()).await;
    assert!(
        stored > before && stored < before + files as usize,
        "{before} {stored}"
    );
    // The earlier snapshot is untouched and still verifies; the interrupted one is listed
    // as incomplete and cannot be used.
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", url, "--json"]));
    assert_eq!(v["snapshot"], first.as_str());
    assert!(v["missing"].as_array().unwrap().is_empty() && v["corrupt"].as_array().unwrap().is_empty());
    let list = json(&m.cli(&["backup", "list", "--to", url, "--json"]));
    let states = column(&list, "state");
    assert_eq!(states, vec!["committed", "incomplete"]);

    // The rerun sends only what had not arrived. A PUT the killed server had taken can
    // still show up in its listing a moment after the restart (or a node's last retry can
    // land then), so `stored` is a lower bound on what the rerun finds: everything counted
    // is skipped, and what is skipped is not sent again.
    let r2 = backup(&m, url, &[]);
    assert_eq!(r2["committed"], true);
    let (blobs, uploaded, skipped) = (
        u(&r2, "blobs") as usize,
        u(&r2, "blobs_uploaded") as usize,
        u(&r2, "blobs_skipped") as usize,
    );
    assert_eq!(uploaded + skipped, blobs, "{r2}");
    assert!(
        skipped >= stored,
        "{stored} were stored, the rerun skipped {skipped}: {r2}"
    );
    assert_eq!(count(weed.bucket()).await as u64, u(&r2, "blobs"));
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", url, "--json"]));
    assert_eq!(v["snapshot"], r2["snapshot"]);
    assert_eq!(u(&v, "blobs_checked"), u(&r2, "blobs"));
    assert!(v["missing"].as_array().unwrap().is_empty() && v["corrupt"].as_array().unwrap().is_empty());

    // A server that stops answering (frozen, connections open) fails the run too, with
    // nothing committed; once it answers again the last snapshot still verifies.
    let more = h.path("src-more");
    std::fs::create_dir_all(&more).unwrap();
    for i in 0..400 {
        std::fs::write(more.join(format!("m{i:03}")), pseudo_random(20_000 + i, 200_000)).unwrap();
    }
    let o = import(&m, "more", &more, &["--replicas", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = count(weed.bucket()).await;
    let mut child = spawn_while_uploading(&mut run, &weed.bucket(), before + 10).await;
    weed.sigstop();
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run ended before the server froze"
    );
    let started = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    let took = started.elapsed();
    eprintln!("a frozen S3 server failed the run after {took:?}");
    weed.sigcont();
    assert!(!out.status.success(), "the run must fail: {}", stdout(&out));
    assert!(stderr(&out).contains("was not committed"), "{}", stderr(&out));
    // A hang bound, not a speed claim: with a 2 s store timeout the run ends in seconds,
    // and without one it would wait on the frozen server's open connections for good.
    assert!(
        took < Duration::from_secs(60),
        "hung: a frozen server took {took:?} to fail the run"
    );
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", url, "--json"]));
    assert_eq!(v["snapshot"], r2["snapshot"]);
    assert!(v["missing"].as_array().unwrap().is_empty() && v["corrupt"].as_array().unwrap().is_empty());

    // And the drill, from S3.
    let expect = [("small", tree(&small)), ("big", tree(&big))];
    drill(
        &mut m,
        &mut nodes,
        url,
        r2["snapshot"].as_str().unwrap(),
        &expect,
        &[&small, &big],
        ("big", files * 200_000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_copies_and_dead_nodes_do_not_stop_a_backup() {
    let h = Harness::new("backup-corrupt");
    let (m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let mut want = BTreeMap::new();
    // Files f{i} of 70,000 distinct bytes; `want` collects their hashes and sizes.
    let write = |want: &mut BTreeMap<String, u64>, range: std::ops::Range<u64>| {
        for i in range {
            let data = pseudo_random(300 + i, 70_000);
            want.insert(blake3::hash(&data).to_hex().to_string(), data.len() as u64);
            std::fs::write(src.join(format!("f{i:02}")), data).unwrap();
        }
    };
    write(&mut want, 0..30);
    // Small shards: every node is first replica of some of them.
    let o = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "64KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Each version's sealed namespace is backed up like its files.
    let (h1, n1) = namespace_of(&m, "ds@1");
    want.insert(h1, n1);
    // Every blob on n1 rots in place (same size, one flipped byte).
    let files = nodes[0].blob_files();
    assert!(files.len() >= 5, "n1 holds {} blobs", files.len());
    for b in files.values() {
        b.flip(1000);
    }
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let o = m.cli(&["backup", "run", "--to", &url, "--json"]);
    let r = json(&o);
    assert_eq!(r["committed"], true);
    assert_eq!(u(&r, "blobs_uploaded"), want.len() as u64);
    assert!(stderr(&o).contains("asking another replica"), "{}", stderr(&o));
    // What was stored is the original content, and n1 quarantined the bad copies it read.
    assert_eq!(stored_blobs(&target), want);
    let v = json(&m.cli(&["backup", "verify", "--allow-unsigned", "--to", &url, "--json"]));
    assert!(v["corrupt"].as_array().unwrap().is_empty() && v["missing"].as_array().unwrap().is_empty());
    assert!(nodes[0].quarantined() > 0);

    // A node dies: new blobs it was first replica for are sent by the other replica.
    write(&mut want, 30..50);
    let o = import(&m, "ds", &src, &["--replicas", "2", "--shard-size", "64KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (h2, n2) = namespace_of(&m, "ds@2");
    want.insert(h2, n2);
    nodes[2].daemon.kill9();
    wait_node_down(&m, "n3").await;
    let r = json(&m.cli(&["backup", "run", "--to", &url, "--json"]));
    assert_eq!(r["committed"], true);
    assert_eq!(
        u(&r, "blobs_uploaded"),
        20 + 1,
        "the new files and the namespace: {r}"
    );
    assert_eq!(stored_blobs(&target), want);
    // A second node dies: some blobs now have no live replica at all, but the target holds
    // them already, so the next run still commits.
    nodes[1].daemon.kill9();
    wait_node_down(&m, "n2").await;
    let r = json(&m.cli(&["backup", "run", "--to", &url, "--json"]));
    assert_eq!(r["committed"], true);
    assert_eq!(u(&r, "blobs_uploaded"), 0);
}

/// Blob objects under the S3 test's target.
async fn count(bucket: std::sync::Arc<dyn object_store::ObjectStore>) -> usize {
    use futures_util::StreamExt;
    let p = object_store::path::Path::from("nightly/blobs");
    bucket
        .list(Some(&p))
        .filter(|r| std::future::ready(r.is_ok()))
        .count()
        .await
}

/// Starts a backup run and returns once `n` blob objects are in the bucket: the run is
/// then in the middle of its uploads.
async fn spawn_while_uploading(
    run: &mut std::process::Command,
    bucket: &std::sync::Arc<dyn object_store::ObjectStore>,
    n: usize,
) -> std::process::Child {
    let child = run.spawn().unwrap();
    wait_until(
        &format!("{n} blobs in the bucket"),
        Duration::from_secs(60),
        || {
            let b = bucket.clone();
            async move { (count(b).await >= n).then_some(()) }
        },
    )
    .await;
    child
}

/// The restore drill: the metadata service, every node's disk and the import sources are
/// lost; the newest snapshot at `url` is restored, a client without a node mounts
/// `remote` (dataset, bytes) and reads it all from the backup, then the nodes come back
/// empty, every dataset is mounted through n1 and compared file by file with `expect`,
/// and every node refills its replicas.
async fn drill(
    m: &mut Metadata,
    nodes: &mut [Node],
    url: &str,
    snapshot: &str,
    expect: &[(&str, BTreeMap<String, String>)],
    sources: &[&Path],
    remote: (&str, u64),
) {
    // Disaster: the metadata service, every node's disk and the import sources are gone.
    m.kill9();
    for n in nodes.iter_mut() {
        n.daemon.kill9();
        std::fs::remove_dir_all(&n.data_dir).unwrap();
        std::fs::create_dir_all(&n.data_dir).unwrap();
    }
    for s in sources {
        std::fs::remove_dir_all(s).unwrap();
    }

    // restore refuses a data dir that is in use, and changes nothing there.
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        url,
        "--data-dir",
        m.data_dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not empty"), "{}", stderr(&o));
    std::fs::remove_dir_all(&m.data_dir).unwrap();
    let o = m.cli(&[
        "restore",
        "--allow-unsigned",
        "--from",
        url,
        "--data-dir",
        m.data_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(snapshot), "{}", stdout(&o));

    m.restart().await;
    // With every node still down, a mount on a host without a node reads verified
    // ranges straight from the backup.
    {
        let (name, total) = remote;
        let want = &expect.iter().find(|e| e.0 == name).unwrap().1;
        let mnt = m.mount("mnt-remote", name, None, &[]);
        assert_eq!(&tree(&mnt.path), want);
        mnt.status_when("every byte to come from the backup", |s| {
            s["totals"]["bytes_origin"].as_u64() >= Some(total)
        })
        .await;
    }
    for n in nodes.iter_mut() {
        n.restart().await;
    }
    // Mount every dataset through node n1 (which now holds nothing): every file must come
    // back byte-identical, through the node, from the backup.
    for (name, want) in expect {
        let mnt = m.mount(&format!("mnt-{name}"), name, Some(&nodes[0]), &[]);
        let got = tree(&mnt.path);
        assert_eq!(got.len(), want.len(), "{name}: entries");
        for (path, hash) in want {
            assert_eq!(got.get(path), Some(hash), "{name}/{path}");
        }
        drop(mnt);
    }
    // Every disk was wiped: the first copy of each blob can only have come from the backup.
    let from_backup = nodes.iter().any(|n| n.logged("copied a blob back from a backup"));
    assert!(from_backup, "no node logged a copy from the backup");
    // The nodes refill their replicas from the backup on their own (pin sync).
    let mut c = m.client(None).await;
    let mut refilled = 0;
    for n in nodes.iter() {
        let want: usize = {
            let r = c
                .list_node_blobs(locus_proto::pb::ListNodeBlobsRequest {
                    node: n.id.clone(),
                    page_token: vec![],
                    limit: 0,
                })
                .await
                .unwrap()
                .into_inner();
            r.blobs.iter().filter(|b| b.size > 0).count()
        };
        // Placement may leave a node without replicas of these few shards.
        if want == 0 {
            continue;
        }
        refilled += 1;
        wait_until(&format!("{} to refill", n.id), Duration::from_secs(60), || {
            let have = n.blob_files().len();
            async move { (have >= want).then_some(()) }
        })
        .await;
    }
    assert!(refilled >= 2, "replicas of every shard are on two nodes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_fails_a_backup_run_after_the_peer_timeout_with_a_clear_message() {
    let h = Harness::new("backup-hung");
    // The stopped node still counts as up, so the plan gives it blobs to send.
    let (m, nodes) = patient_cluster(&h, 2).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..20u64 {
        std::fs::write(src.join(format!("f{i:02}")), pseudo_random(500 + i, 70_000)).unwrap();
    }
    let o = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!nodes[1].blob_files().is_empty(), "n2 holds blobs to back up");
    nodes[1].daemon.sigstop();
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let o = m
        .cli_within(
            Duration::from_secs(120),
            &["backup", "run", "--to", &url, "--json"],
            &[("LOCUS_PEER_TIMEOUT", "2s".to_string())],
        )
        .await;
    nodes[1].daemon.sigcont();
    assert!(!o.status.success(), "a run missing n2's blobs cannot succeed");
    let err = stderr(&o);
    assert!(
        ["sent no progress", "cannot reach"]
            .iter()
            .any(|m| err.contains(m)),
        "says why: {err}"
    );
    assert!(err.contains("was not committed"), "{err}");
    // Once n2 answers again, a rerun completes the snapshot.
    let r = json(&m.cli(&["backup", "run", "--to", &url, "--json"]));
    assert_eq!(r["committed"], true);
}

/// A dataset that lives in a cloud bucket (an emulator): imported from it, mounted and
/// compared, backed up to another bucket of the same cloud, then the restore drill from
/// that backup (everything wiped; the service rebuilt; a node-less mount reading from the
/// backup; the nodes refilling from it).
async fn cloud_round_trip(h: &Harness, emu: &Emulator) {
    let s = emu.scheme();
    // The nodes (which upload and refill), the mounts and the CLI inherit the settings.
    for (k, v) in emu.env() {
        std::env::set_var(k, v);
    }
    let (mut m, mut nodes) = cluster(h, 3, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(src.join("train/a")).unwrap();
    std::fs::create_dir_all(src.join("val")).unwrap();
    let mut total = 0;
    for i in 0..12u64 {
        let rel = match i % 3 {
            0 => format!("train/a/{i:02}.bin"),
            1 => format!("train/{i:02}.bin"),
            _ => format!("val/{i:02}.bin"),
        };
        let data = pseudo_random(700 + i, 50_000 + 9_000 * i as usize);
        total += data.len() as u64;
        std::fs::write(src.join(&rel), &data).unwrap();
    }
    // The same files as objects in the bucket, put there with the same client code and
    // credentials the import uses.
    let bucket = locus_backup::url::open(&format!("{s}://data/set"), false).unwrap();
    for (rel, _) in files_of(&src) {
        let key = object_store::path::Path::from(format!("set/{}", rel.display()));
        let bytes = std::fs::read(src.join(&rel)).unwrap();
        object_store::ObjectStoreExt::put(&*bucket.store, &key, bytes.into())
            .await
            .unwrap();
    }
    let url = format!("{s}://data/set");
    let o = m.cli(&[
        "dataset",
        "import",
        "cloud",
        &url,
        "--replicas",
        "2",
        "--shard-size",
        "200KiB",
        "--json",
    ]);
    assert!(o.status.success(), "import from {url}: {}", stderr(&o));
    let expect = tree(&src);
    {
        let mnt = m.mount("mnt-imported", "cloud@1", Some(&nodes[0]), &[]);
        assert_eq!(tree(&mnt.path), expect, "imported from {url}");
    }
    let backup_url = format!("{s}://backups/nightly");
    let r = backup(&m, &backup_url, &[]);
    assert_eq!(r["committed"], true, "{r}");
    let v = json(&m.cli(&[
        "backup",
        "verify",
        "--allow-unsigned",
        "--to",
        &backup_url,
        "--json",
    ]));
    assert_eq!(v["blobs_checked"], v["blobs_total"], "{v}");
    assert!(v["missing"].as_array().unwrap().is_empty() && v["corrupt"].as_array().unwrap().is_empty());
    drill(
        &mut m,
        &mut nodes,
        &backup_url,
        r["snapshot"].as_str().unwrap(),
        &[("cloud", expect)],
        &[&src],
        ("cloud", total),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_imports_backups_and_restores_round_trip_against_azurite() {
    let h = Harness::new("cloud-azure");
    let emu = h.start_azurite(&["data", "backups"]).await;
    cloud_round_trip(&h, &emu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_every_replica_is_gone_is_repaired_from_the_backup() {
    let h = Harness::new("backup-lost-shard");
    let (m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 60);
    // One replica per shard: losing a node loses its shards outright.
    let o = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "128KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = m.client(None).await;
    let on_n1 = shards(&mut c, "ds", 1)
        .await
        .iter()
        .filter(|s| s.replicas == ["n1"])
        .count();
    assert!(on_n1 > 0, "n1 holds some shards alone");
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    assert_eq!(backup(&m, &url, &[])["committed"], true);

    // n1 and its disk are gone for good.
    nodes[0].daemon.kill9();
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    wait_until(
        "every shard to have its one replica back",
        Duration::from_secs(60),
        || {
            let mut c = c.clone();
            async move {
                let s = shards(&mut c, "ds", 1).await;
                s.iter()
                    .all(|s| s.replicas.len() == 1 && s.replicas[0] != "n1")
                    .then_some(())
            }
        },
    )
    .await;
    let from_backup = nodes[1..]
        .iter()
        .any(|n| n.logged("copied a blob back from a backup"));
    assert!(from_backup, "no node logged a copy from the backup");
    let mnt = m.mount("after", "ds@1", Some(&nodes[1]), &[]);
    assert_eq!(tree(&mnt.path), tree(&src));
}

/// Snapshots signed with the operator's key: restore and verify accept them with the
/// public key, and refuse a snapshot whose catalogue was swapped — here for an older
/// snapshot's, with the manifest's catalogue size and hash rewritten to match, which the
/// bucket alone cannot tell — as well as an unsigned one, unless told --allow-unsigned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_unsigned_snapshot_is_refused_by_restore_and_verify() {
    let h = Harness::new("backup-signed");
    let (m, _nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 20);
    assert!(import(&m, "old", &src, &["--replicas", "1"]).status.success());
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let key = h.path("signing.key");
    let k = json(&m.cli(&["backup", "keygen", "--out", key.to_str().unwrap(), "--json"]));
    let public = k["public_key"].as_str().unwrap().to_string();
    let pub_file = format!("{}.pub", key.display());
    let first = backup(&m, &url, &["--signing-key", key.to_str().unwrap()]);
    assert_eq!(first["signed_by"], public.as_str(), "{first}");
    assert!(import(&m, "new", &src, &["--replicas", "1"]).status.success());
    let second = backup(&m, &url, &["--signing-key", key.to_str().unwrap()]);
    let (s1, s2) = (
        first["snapshot"].as_str().unwrap().to_string(),
        second["snapshot"].as_str().unwrap().to_string(),
    );

    let v = json(&m.cli(&[
        "backup",
        "verify",
        "--to",
        &url,
        "--trust-key",
        &pub_file,
        "--json",
    ]));
    assert_eq!(v["signature"]["Trusted"], public.as_str(), "{v}");
    assert_eq!(v["catalog_ok"], true, "{v}");
    // Signed, but by a key nobody said to trust.
    let o = m.cli(&["backup", "verify", "--to", &url]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("which is not a trusted key"),
        "{}",
        stderr(&o)
    );

    // Someone with write access to the bucket puts the first snapshot's catalogue in the
    // second one and makes the manifest agree: the bytes and hash check out.
    let snap = |id: &str| target.join("snapshots").join(id);
    std::fs::copy(snap(&s1).join("catalog"), snap(&s2).join("catalog")).unwrap();
    let m1: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap(&s1).join("manifest.json")).unwrap()).unwrap();
    let mut m2: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap(&s2).join("manifest.json")).unwrap()).unwrap();
    m2["catalog_bytes"] = m1["catalog_bytes"].clone();
    m2["catalog_blake3"] = m1["catalog_blake3"].clone();
    std::fs::write(snap(&s2).join("manifest.json"), serde_json::to_vec(&m2).unwrap()).unwrap();
    let dir = h.path("restored");
    for allow in [false, true] {
        let mut args = vec![
            "restore",
            "--from",
            &url,
            "--snapshot",
            &s2,
            "--trust-key",
            &public,
        ];
        args.extend(["--data-dir", dir.to_str().unwrap()]);
        if allow {
            args.push("--allow-unsigned");
        }
        let o = m.cli(&args);
        assert!(!o.status.success(), "restored a tampered snapshot");
        assert!(
            stderr(&o).contains("changed after it was signed"),
            "{}",
            stderr(&o)
        );
        assert!(!dir.join("db").exists(), "something was written");
    }
    let o = m.cli(&[
        "backup",
        "verify",
        "--to",
        &url,
        "--snapshot",
        &s2,
        "--trust-key",
        &public,
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("changed after it was signed"),
        "{}",
        stderr(&o)
    );

    // An unsigned snapshot: refused where a key is trusted, accepted with a warning when
    // told so.
    let third = backup(&m, &url, &[]);
    assert_eq!(third["signed_by"], serde_json::Value::Null);
    let s3 = third["snapshot"].as_str().unwrap();
    let o = m.cli(&[
        "backup",
        "verify",
        "--to",
        &url,
        "--snapshot",
        s3,
        "--trust-key",
        &public,
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("it is not signed"), "{}", stderr(&o));
    let o = m.cli(&[
        "restore",
        "--from",
        &url,
        "--snapshot",
        s3,
        "--trust-key",
        &public,
        "--allow-unsigned",
        "--data-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is unsigned; restoring it anyway"),
        "{}",
        stderr(&o)
    );
}

/// A node's object-store credentials write only where the cluster's backups go: an
/// upload to a target no backup run recorded is refused before anything is written, and
/// `backup run` records its target before any node uploads, so the same call to that
/// target is then accepted.
#[tokio::test]
async fn nodes_upload_only_to_targets_a_backup_run_recorded() {
    let h = Harness::new("backup-target-recorded");
    let (m, nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.bin"), pseudo_random(3, 300_000)).unwrap();
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let blobs: Vec<locus_proto::nodepb::BlobRef> = nodes[0]
        .blob_files()
        .iter()
        .map(|(hex, b)| locus_proto::nodepb::BlobRef {
            hash: locus_proto::BlobHash::from_hex(hex).unwrap().0.to_vec(),
            size: b.size,
            origin_path: String::new(),
        })
        .collect();
    assert!(!blobs.is_empty());
    let upload = |target: String| {
        let blobs = blobs.clone();
        let node = &nodes[0];
        async move {
            let mut c = node.client().await;
            let mut s = c
                .upload_blobs(locus_proto::nodepb::UploadBlobsRequest {
                    target,
                    blobs,
                    skip_existing: false,
                    parallel: 0,
                })
                .await?
                .into_inner();
            while s.message().await?.is_some() {}
            Ok::<_, tonic::Status>(())
        }
    };

    let elsewhere = h.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let e = upload(format!("file://{}", elsewhere.display()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("not a backup target"), "{e}");
    assert!(!elsewhere.join("blobs").exists(), "nothing was written there");

    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let o = m.cli(&["backup", "run", "--to", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
    upload(url).await.expect("a recorded target takes uploads");
}

/// A signed snapshot is bound to where it is read from: copied under a newer id (so that
/// it would be taken for the newest), it is refused. Its signature is checked before its
/// catalogue is read at all: a catalogue that never ends (a FIFO here) is never opened
/// for an unsigned snapshot. The guards hold for a library caller of `ops::restore`, and
/// a version restored into the running cluster does not make the backup look fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_is_bound_to_its_id_and_nothing_large_is_read_before_its_signature() {
    let h = Harness::new("backup-bound");
    let (m, _nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 10);
    assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    let target = h.path("backup");
    let url = format!("file://{}", target.display());
    let key = h.path("signing.key");
    let k = json(&m.cli(&["backup", "keygen", "--out", key.to_str().unwrap(), "--json"]));
    let public = k["public_key"].as_str().unwrap().to_string();
    let first = backup(&m, &url, &["--signing-key", key.to_str().unwrap()]);
    let s1 = first["snapshot"].as_str().unwrap().to_string();
    let snap = |id: &str| target.join("snapshots").join(id);
    let dir = h.path("restored");
    fn restore<'a>(url: &'a str, public: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["restore", "--from", url, "--trust-key", public];
        args.extend_from_slice(extra);
        args
    }

    // The old signed snapshot, copied under an id that sorts after every other.
    let later = format!("2099{}", &s1[4..]);
    std::fs::create_dir_all(snap(&later)).unwrap();
    for f in ["manifest.json", "SIGNATURE", "catalog", "blobs", "COMMITTED"] {
        std::fs::copy(snap(&s1).join(f), snap(&later).join(f)).unwrap();
    }
    let o = m.cli(&restore(&url, &public, &["--data-dir", dir.to_str().unwrap()]));
    assert!(!o.status.success(), "an old snapshot was restored as the newest");
    assert!(
        stderr(&o).contains("copied or moved under another id"),
        "{}",
        stderr(&o)
    );
    assert!(!dir.exists(), "something was written");
    std::fs::remove_dir_all(snap(&later)).unwrap();

    // A newest snapshot, unsigned, whose catalogue never ends.
    let endless = format!("2100{}", &s1[4..]);
    std::fs::create_dir_all(snap(&endless)).unwrap();
    let mut man: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap(&s1).join("manifest.json")).unwrap()).unwrap();
    man["id"] = endless.clone().into();
    man["catalog_bytes"] = (1u64 << 30).into();
    std::fs::write(
        snap(&endless).join("manifest.json"),
        serde_json::to_vec(&man).unwrap(),
    )
    .unwrap();
    std::fs::copy(snap(&s1).join("COMMITTED"), snap(&endless).join("COMMITTED")).unwrap();
    let st = std::process::Command::new("mkfifo")
        .arg(snap(&endless).join("catalog"))
        .status()
        .unwrap();
    assert!(st.success());
    let o = m
        .cli_within(
            Duration::from_secs(30),
            &restore(&url, &public, &["--data-dir", dir.to_str().unwrap()]),
            &[],
        )
        .await;
    assert!(!o.status.success());
    assert!(stderr(&o).contains("it is not signed"), "{}", stderr(&o));
    std::fs::remove_dir_all(snap(&endless)).unwrap();

    // A library caller gets the same rules: a non-empty data dir is refused, untouched.
    let t = locus_backup::Target::open(&url).unwrap();
    let trust = locus_backup::sign::Trust::from_args(std::slice::from_ref(&public), false).unwrap();
    let fetched = locus::ops::restore::fetch_catalog(&t, None, &trust)
        .await
        .unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keep.txt"), b"mine").unwrap();
    let e = locus::ops::restore::restore_catalog(fetched, &dir, &url)
        .await
        .expect_err("a restore into a non-empty dir")
        .to_string();
    assert!(e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read(dir.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

    // restore --dataset: the backup becomes a source, not a newer backup.
    let last = |m: &Metadata| {
        let s = json(&m.cli(&["status", "--json"]));
        s["backups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["url"] == url.as_str())
            .map(|b| b["recorded_at_ms"].as_i64().unwrap())
            .unwrap()
    };
    let before = last(&m);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let o = m.cli(&restore(
        &url,
        &public,
        &["--dataset", "ds@1", "--as", "again", "--json"],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        last(&m),
        before,
        "restore --dataset made the last backup look newer"
    );
}
