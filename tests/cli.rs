//! End-to-end tests of the `locus` command line against a real metadata service.

use locus_testkit as support;

use std::process::Command;

use locus_proto::pb;
use support::*;

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "command failed: {}", stderr(o));
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

fn fails_with(o: &std::process::Output, needle: &str) {
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {} stderr: {}",
        stdout(o),
        stderr(o)
    );
    let err = stderr(o);
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(
        !err.contains("Status {") && !err.contains("Error {"),
        "debug dump: {err}"
    );
}

#[tokio::test]
async fn listing_showing_and_deleting_datasets() {
    let h = Harness::new("cli");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    let mut entries = vec![dir_entry("train"), dir_entry("train/cats")];
    let (files, shards) = synthetic_manifest("c", 30, 10, 10, 1 << 22);
    entries.extend(files);
    entries.push(pb::Entry {
        path: "train/link".into(),
        kind: pb::EntryKind::Symlink as i32,
        symlink_target: "../top".into(),
        mode: 0o777,
        ..Default::default()
    });
    let v1 = commit(&mut c, "imagenet", 1 << 22, entries.clone(), shards.clone())
        .await
        .unwrap();
    let v2 = commit(&mut c, "imagenet", 1 << 22, entries.clone(), shards)
        .await
        .unwrap();
    assert_eq!((v1.version, v2.version), (1, 2));

    let list = json(&m.cli(&["dataset", "list", "--json"]));
    assert_eq!(list[0]["name"], "imagenet");
    assert_eq!(list[0]["latest"], 2);
    assert_eq!(list[0]["versions"], 2);
    assert_eq!(list[0]["bytes"], 2 * v1.bytes);
    let human = m.cli(&["dataset", "list"]);
    assert!(
        stdout(&human)
            .lines()
            .any(|l| l.starts_with("imagenet") && l.contains(" 2 ")),
        "{}",
        stdout(&human)
    );

    let show = json(&m.cli(&["dataset", "show", "imagenet", "--json"]));
    assert_eq!(show["version_list"].as_array().unwrap().len(), 2);
    let one = json(&m.cli(&["dataset", "show", "imagenet@latest", "--json"]));
    assert_eq!(one["version"], 2);
    assert_eq!(one["files"], 30);
    assert_eq!(one["dirs"], 2 + 1 + 3);
    assert_eq!(one["symlinks"], 1);
    let text = stdout(&m.cli(&["dataset", "show", "imagenet@1"]));
    assert!(text.contains("imagenet@1") && text.contains("30 ("), "{text}");

    let root = json(&m.cli(&["dataset", "ls", "imagenet@1", "--json"]));
    let names: Vec<_> = root["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["top", "train"]);
    let train = json(&m.cli(&["dataset", "ls", "imagenet@1", "train", "--json"]));
    let link = &train["entries"].as_array().unwrap()[1];
    assert_eq!(
        (link["path"].as_str(), link["target"].as_str()),
        (Some("train/link"), Some("../top"))
    );
    let all = json(&m.cli(&["dataset", "ls", "imagenet@1", "--recursive", "--json"]));
    assert_eq!(all["entries"].as_array().unwrap().len(), entries.len());

    // Errors read as sentences, with exit status 1.
    fails_with(
        &m.cli(&["dataset", "show", "imagenet@9"]),
        "not found: version imagenet@9 does not exist",
    );
    fails_with(
        &m.cli(&["dataset", "show", "nosuch"]),
        "not found: no dataset named nosuch",
    );
    fails_with(
        &m.cli(&["dataset", "show", "Bad@x"]),
        "is not a dataset reference",
    );
    fails_with(&m.cli(&["dataset", "ls", "imagenet@1", "nodir"]), "no directory");
    fails_with(
        &m.cli(&["dataset", "ls", "imagenet@1", "../etc"]),
        "invalid request",
    );
    fails_with(&m.cli(&["dataset", "rm", "imagenet"]), "--all-versions");
    fails_with(&m.cli(&["dataset", "rm", "imagenet@latest"]), "name the version");

    // Deleting.
    let out = m.cli(&["dataset", "rm", "imagenet@1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    fails_with(&m.cli(&["dataset", "show", "imagenet@1"]), "does not exist");
    assert_eq!(
        json(&m.cli(&["dataset", "show", "imagenet@latest", "--json"]))["version"],
        2
    );
    let out = m.cli(&["dataset", "rm", "imagenet", "--all-versions"]);
    assert!(stdout(&out).contains("1 versions"), "{}", stdout(&out));
    assert_eq!(
        json(&m.cli(&["dataset", "list", "--json"])),
        serde_json::json!([])
    );
    // Numbers are not reused after the dataset came back.
    let (e, s) = synthetic_manifest("again", 3, 3, 3, 1 << 22);
    assert_eq!(
        commit(&mut c, "imagenet", 1 << 22, e, s).await.unwrap().version,
        3
    );

    let st = json(&m.cli(&["status", "--json"]));
    assert_eq!(st["datasets"]["count"], 1);
    assert_eq!(st["metadata"]["caller"]["role"], "anonymous");
}

#[tokio::test]
async fn tokens_and_config_precedence() {
    let h = Harness::new("cli-auth");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                ..Default::default()
            },
        )
        .await;
    let reader = tokens().into_iter().find(|t| t.role == "reader").unwrap().secret;
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(locus());
        cmd.args(args)
            .env_remove("LOCUS_METADATA")
            .env_remove("LOCUS_TOKEN")
            .env_remove("LOCUS_TOKEN_FILE")
            .env_remove("LOCUS_CONFIG")
            .env("HOME", h.path("home"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let url = m.url();
    fails_with(
        &run(&["--metadata", &url, "dataset", "list"], &[]),
        "not authenticated",
    );
    fails_with(
        &run(
            &["--metadata", &url, "dataset", "rm", "x@1"],
            &[("LOCUS_TOKEN", &reader)],
        ),
        "permission denied",
    );
    let out = run(
        &["--metadata", &url, "status", "--json"],
        &[("LOCUS_TOKEN", &reader)],
    );
    assert_eq!(json(&out)["metadata"]["caller"]["name"], "trainer");

    // A token on the command line is refused: every user of the host reads argv.
    let out = run(&["--metadata", &url, "--token", &reader, "status"], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("process list") && stderr(&out).contains("LOCUS_TOKEN"),
        "{}",
        stderr(&out)
    );

    // A token from a file (the whole file, one line), as a mounted Secret gives it: a file
    // others may read is refused, saying how to fix it; an empty file is an error, not an
    // anonymous call.
    use std::os::unix::fs::PermissionsExt;
    let tf = h.path("token");
    std::fs::write(&tf, format!("{reader}\n")).unwrap();
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(
        &["--metadata", &url, "--token-file", tf.to_str().unwrap(), "status"],
        &[],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("chmod 600"), "{}", stderr(&out));
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = run(
        &[
            "--metadata",
            &url,
            "--token-file",
            tf.to_str().unwrap(),
            "status",
            "--json",
        ],
        &[],
    );
    assert_eq!(json(&out)["metadata"]["caller"]["name"], "trainer");
    std::fs::write(&tf, "\n").unwrap();
    let out = run(
        &["--metadata", &url, "--token-file", tf.to_str().unwrap(), "status"],
        &[],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("the file is empty"), "{}", stderr(&out));

    // The config file supplies what flags and environment leave out; they win over it.
    // One that holds a token and others may read is refused, not used with a warning.
    let cfg = h.path("locus.toml");
    std::fs::write(&cfg, format!("metadata = \"{url}\"\ntoken = \"{reader}\"\n")).unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg_s = cfg.to_str().unwrap();
    let out = run(&["--config", cfg_s, "status", "--json"], &[]);
    assert!(!out.status.success(), "a world-readable token was used");
    assert!(stderr(&out).contains("chmod 600"), "{}", stderr(&out));
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = run(&["--config", cfg_s, "status", "--json"], &[]);
    assert_eq!(json(&out)["metadata"]["caller"]["role"], "reader");
    let out = run(
        &["--config", cfg_s, "status"],
        &[("LOCUS_METADATA", "http://127.0.0.1:1")],
    );
    fails_with(&out, "cannot reach the metadata service at http://127.0.0.1:1");
    let out = run(
        &["--config", cfg_s, "--metadata", &url, "status", "--json"],
        &[("LOCUS_METADATA", "http://127.0.0.1:1")],
    );
    assert!(out.status.success(), "flag beats environment: {}", stderr(&out));
    let bad = h.path("bad.toml");
    std::fs::write(&bad, "metdata = \"typo\"\n").unwrap();
    let out = run(&["--config", bad.to_str().unwrap(), "status"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("unknown field"), "{}", stderr(&out));
}

#[test]
fn demo_commits_and_lists_a_sample_dataset() {
    let h = Harness::new("demo");
    let out = Command::new(locus())
        .args(["demo", "--dir"])
        .arg(h.path("demo"))
        .env_remove("LOCUS_METADATA")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("imported sample@1: 29 files"), "{text}");
    assert!(text.contains("× 2 replicas"), "{text}");
    assert!(text.contains("images/ünïcødé name.txt"), "{text}");
    for n in ["node1", "node2", "node3"] {
        assert!(
            text.lines().any(|l| l.starts_with(n) && l.contains(" up ")),
            "{n} up: {text}"
        );
    }
    assert!(text.contains("cluster stopped"), "{text}");
    assert!(
        // The 29 files' blobs and the version's sealed namespace.
        text.contains("30 blobs (10.2 MiB); uploaded 30 blobs") && text.contains("0 missing, 0 corrupt"),
        "backup: {text}"
    );
    // The services it started are gone; the metadata store and the blobs are on disk,
    // every shard on two nodes: 2 × the sample's distinct blobs and its namespace.
    assert!(h.path("demo/metadata/db/CURRENT").exists());
    let blobs: usize = ["node1", "node2", "node3"]
        .iter()
        .map(|n| {
            locus_cache_node::store::indexed_blobs(&[h.path(&format!("demo/{n}"))])
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(
        blobs,
        2 * 30,
        "29 distinct file blobs and the namespace, two replicas each"
    );
}

/// `--help` of every command, as a user runs it: each leaf command shows an example,
/// and the walk reaches every command the top level lists (src/help_tests.rs checks the
/// descriptions and headings through clap itself).
#[test]
fn help_explains_every_command() {
    fn subcommands(help: &str) -> Vec<String> {
        let Some((_, rest)) = help.split_once("Commands:\n") else {
            return Vec::new();
        };
        rest.lines()
            .take_while(|l| l.starts_with("  "))
            // A command's line; a wrapped description continues further in.
            .filter(|l| !l[2..].starts_with(' '))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_string)
            .collect()
    }
    let mut todo = vec![Vec::<String>::new()];
    let mut leaves = 0;
    while let Some(path) = todo.pop() {
        let out = Command::new(locus()).args(&path).arg("--help").output().unwrap();
        assert!(out.status.success(), "{path:?}");
        let help = stdout(&out);
        assert!(help.contains("Usage:"), "{path:?}");
        let subs = subcommands(&help);
        if subs.is_empty() {
            leaves += 1;
            let example = help
                .split_once("Examples:")
                .is_some_and(|(_, ex)| ex.lines().any(|l| l.trim_start().starts_with("locus ")));
            assert!(example, "locus {} --help has no example:\n{help}", path.join(" "));
        }
        for s in subs {
            let mut p = path.clone();
            p.push(s);
            todo.push(p);
        }
    }
    assert!(leaves > 30, "only {leaves} commands found");
    let out = Command::new(locus())
        .args(["metadata", "serve", "--help"])
        .output()
        .unwrap();
    assert!(stdout(&out).contains("--tokens-file"));
    let out = Command::new(locus())
        .args(["dataset", "frobnicate"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// A bearer token is never sent in clear across a network: a plaintext URL of a host that
/// is not loopback is refused before any connection is made, unless --insecure says the
/// network is trusted (then the command goes on and fails for its own reason: nothing
/// listens at that TEST-NET address). `locus tls` makes a CA and certificates, and never
/// overwrites a key.
#[test]
fn a_token_is_never_sent_in_clear_off_loopback_unless_insecure_and_tls_helps_make_certificates() {
    let run = |extra: &[&str]| {
        Command::new(locus())
            .args(["--metadata", "http://192.0.2.1:7400", "dataset", "list"])
            .args(extra)
            .env("LOCUS_TOKEN", "a-token-that-must-stay-home")
            .env_remove("LOCUS_CONFIG")
            .env_remove("LOCUS_INSECURE")
            .output()
            .unwrap()
    };
    let t = std::time::Instant::now();
    let o = run(&[]);
    fails_with(&o, "refusing to send a token in clear to http://192.0.2.1:7400");
    assert!(stderr(&o).contains("--insecure"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("a-token-that-must-stay-home"));
    // Refused, not tried: a connection attempt to TEST-NET would take the 5 s timeout.
    assert!(
        t.elapsed() < std::time::Duration::from_secs(4),
        "{:?}",
        t.elapsed()
    );
    let o = run(&["--insecure"]);
    assert!(!o.status.success());
    assert!(!stderr(&o).contains("in clear"), "{}", stderr(&o));

    let h = Harness::new("tls-helper");
    let ca = h.path("ca");
    let tls = |args: &[&str]| Command::new(locus()).arg("tls").args(args).output().unwrap();
    let o = tls(&["ca", "--dir", ca.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cert = |name: &str, host: &str| {
        tls(&[
            "cert",
            "--ca-dir",
            ca.to_str().unwrap(),
            "--name",
            name,
            "--host",
            host,
        ])
    };
    let o = cert("n1", "10.0.0.7,n1.example");
    assert!(o.status.success(), "{}", stderr(&o));
    use std::os::unix::fs::PermissionsExt;
    for key in ["ca.key", "n1.key"] {
        let mode = std::fs::metadata(ca.join(key)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{key}");
    }
    // The certificate chains to the CA and names the hosts asked for.
    // (openssl is installed by scripts/setup-debian.sh.)
    let v = Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(ca.join("ca.pem"))
        .arg(ca.join("n1.pem"))
        .output()
        .expect("openssl");
    assert!(stdout(&v).contains(": OK"), "{}{}", stdout(&v), stderr(&v));
    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(ca.join("n1.pem"))
        .output()
        .unwrap();
    let text = stdout(&text);
    assert!(
        text.contains("IP Address:10.0.0.7") && text.contains("DNS:n1.example"),
        "{text}"
    );
    let before = std::fs::read(ca.join("n1.key")).unwrap();
    let o = cert("n1", "10.0.0.8");
    fails_with(&o, "not overwriting");
    assert_eq!(std::fs::read(ca.join("n1.key")).unwrap(), before);
    let o = cert("../x", "h");
    fails_with(&o, "--name");
}

#[test]
fn a_peer_timeout_that_is_not_a_duration_is_refused_before_anything_runs() {
    for bad in ["soon", "0s"] {
        let out = Command::new(locus())
            .args(["dataset", "list"])
            .env("LOCUS_PEER_TIMEOUT", bad)
            .env("LOCUS_METADATA", "http://127.0.0.1:1")
            .env_remove("LOCUS_CONFIG")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("LOCUS_PEER_TIMEOUT"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

/// The shipped systemd units pass `systemd-analyze verify` (with the binary path pointed
/// at the one under test), and the backup unit, which runs as a dynamic user, gets the
/// root-only config through a credential rather than reading /etc/locus itself.
#[test]
fn the_shipped_systemd_units_verify() {
    let h = Harness::new("systemd-units");
    let dir = h.path("units");
    std::fs::create_dir_all(&dir).unwrap();
    let units = [
        "locus-backup.service",
        "locus-backup.timer",
        "locus-node.service",
        "locus-slurm-features.service",
        "locus-slurm-features.timer",
    ];
    for u in units {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("deploy/systemd")
                .join(u),
        )
        .unwrap()
        .replace("/usr/local/bin/locus", locus().to_str().unwrap());
        std::fs::write(dir.join(u), text).unwrap();
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(units.map(|u| dir.join(u)))
        .output()
        .expect("systemd-analyze (scripts/setup-debian.sh installs systemd)");
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stderr(&out).trim().is_empty(), "warnings: {}", stderr(&out));
    let backup = std::fs::read_to_string(dir.join("locus-backup.service")).unwrap();
    assert!(backup.contains("DynamicUser=yes"));
    assert!(backup.contains("LoadCredential=locus.toml:/etc/locus/locus.toml"));
    assert!(backup.contains("--config ${CREDENTIALS_DIRECTORY}/locus.toml"));
}

/// Piping a listing into a reader that stops early (`| head -1`, quitting `less`) is a
/// normal end: every listing command exits 0 without a panic when its stdout closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listing_piped_into_a_reader_that_stops_early_exits_quietly() {
    let h = Harness::new("cli-pipe");
    let (m, _nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 30);
    assert!(import(&m, "ds", &src, &["--replicas", "1"]).status.success());
    let listings: &[&[&str]] = &[
        &["dataset", "list"],
        &["dataset", "show", "ds"],
        &["dataset", "show", "ds@1"],
        &["dataset", "ls", "ds@1", "--recursive"],
        &["dataset", "ls", "ds@1", "--recursive", "--json"],
        &["node", "list"],
        &["status"],
        &["status", "--json"],
        &["locality", "ds@1"],
        &["assign", "ds@1", "--nodes", "n1", "--json"],
        &["metadata", "grant-keys", "list"],
    ];
    for args in listings {
        let mut child = m
            .cli_command(args, &[])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before the command prints a byte.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
}

#[test]
fn teams_cache_shares_beyond_the_whole_cache_or_not_in_percent_are_refused_at_start() {
    let h = Harness::new("team-shares");
    let start = |teams: &str| {
        let cfg = h.path("locus.toml");
        std::fs::write(&cfg, teams).unwrap();
        Command::new(locus())
            .arg("--config")
            .arg(&cfg)
            .args([
                "metadata",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "off",
                "--data-dir",
            ])
            .arg(h.path("meta"))
            .env_remove("LOCUS_METADATA")
            .output()
            .unwrap()
    };
    let team = |name: &str, cache: &str| {
        format!(
            "[[metadata_server.team]]\nname = \"{name}\"\ndatasets = [\"{name}-*\"]\npinned = \"1GiB\"\n\
             cache = \"{cache}\"\n"
        )
    };
    let out = start(&(team("a", "60%") + &team("b", "60%")));
    assert!(!out.status.success(), "shares of 120% accepted");
    assert!(
        stderr(&out).contains("the teams' cache shares add up to 120%; at most 100%"),
        "{}",
        stderr(&out)
    );
    let out = start(&team("a", "0.6"));
    assert!(!out.status.success(), "a share not in percent accepted");
    assert!(
        stderr(&out).contains("[[metadata_server.team]] a: cache: \"0.6\": a percentage such as \"25%\""),
        "{}",
        stderr(&out)
    );
}
