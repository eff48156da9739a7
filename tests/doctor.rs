//! `locus doctor`: a healthy host and cluster pass; each thing it checks, broken in turn,
//! fails that check (and only that one) with a non-zero exit.

use locus_testkit as support;

use std::collections::BTreeSet;
use std::process::Command;

use support::*;

/// Runs `locus doctor ARGS --json` through `cmd`; (exit code, failed check names, JSON).
fn doctor(cmd: &mut Command) -> (i32, BTreeSet<String>, serde_json::Value) {
    let o = cmd.output().expect("run locus doctor");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}): {}{}",
            stdout(&o),
            stderr(&o)
        )
    });
    let failed = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["verdict"] == "fail")
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    (o.status.code().unwrap_or(-1), failed, v)
}

/// (size, free to unprivileged users) in bytes of the filesystem holding `dir`, as `df` sees it.
fn disk_size_and_free(dir: &std::path::Path) -> (u64, u64) {
    let o = Command::new("df")
        .args(["-B1", "--output=size,avail"])
        .arg(dir)
        .output()
        .expect("run df");
    let text = stdout(&o);
    let nums: Vec<u64> = text
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("df printed {text}"))
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (nums[0], nums[1])
}

fn verdict(v: &serde_json::Value, name: &str) -> String {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str().unwrap().starts_with(name))
        .unwrap_or_else(|| panic!("no check {name}: {v}"))["verdict"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_fails_exactly_the_check_of_what_is_broken() {
    let h = Harness::new("doctor");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 10);
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let url = format!("file://{}", h.path("backup").display());
    let o = m.cli(&["backup", "run", "--to", &url]);
    assert!(o.status.success(), "{}", stderr(&o));

    let sock = n.socket.to_str().unwrap().to_string();
    let data = n.data_dir.to_str().unwrap().to_string();
    let args = |extra: &[&str]| {
        let mut a = vec![
            "--json",
            "doctor",
            "--node-socket",
            &sock,
            "--data-dir",
            &data,
            "--backup-max-age",
            "1h",
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let run =
        |a: Vec<String>| doctor(&mut m.cli_command(&a.iter().map(String::as_str).collect::<Vec<_>>(), &[]));

    // Healthy.
    let (code, failed, v) = run(args(&[]));
    assert_eq!((code, failed.len()), (0, 0), "{v}");
    // The data dir sits on this host's disk: it passes unless that disk is itself under
    // 10% free, which doctor rightly warns about (CI machines can be that full).
    let (size, avail) = disk_size_and_free(&n.data_dir);
    let expected = if avail < size / 10 { "warn" } else { "pass" };
    assert_eq!(verdict(&v, "data dir"), expected, "{v}");
    // Optional (mounts default to /dev/fuse): reported, never a failure.
    assert_ne!(verdict(&v, "fuse over io_uring"), "fail", "{v}");
    for name in [
        "fuse device",
        "node socket",
        "metadata service",
        "clock",
        "nodes",
        "last backup",
    ] {
        assert_eq!(verdict(&v, name), "pass", "{name}: {v}");
    }

    // Certificates: one that ends within --cert-warn warns, with its date.
    let pki = h.path("pki");
    let tls = |a: &[&str]| {
        let o = Command::new(locus()).arg("tls").args(a).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    tls(&["ca", "--dir", pki.to_str().unwrap()]);
    tls(&[
        "cert",
        "--ca-dir",
        pki.to_str().unwrap(),
        "--name",
        "soon",
        "--host",
        "127.0.0.1",
        "--days",
        "3",
    ]);
    let cert = pki.join("soon.pem");
    let with_cert = |warn: &str| {
        doctor(
            Command::new(locus())
                .args(["--json", "doctor", "--local", "--cert-warn", warn, "--cert"])
                .arg(&cert),
        )
        .2
    };
    let v = with_cert("14d");
    assert_eq!(verdict(&v, "certificate soon.pem"), "warn", "{v}");
    let v = with_cert("1d");
    assert_eq!(verdict(&v, "certificate soon.pem"), "pass", "{v}");

    // No /dev/fuse (an empty /dev in a private mount namespace).
    let (code, failed, _) = doctor(
        Command::new("unshare")
            .args([
                "-m",
                "sh",
                "-c",
                "mount -t tmpfs none /dev && exec \"$0\" --json doctor --local",
            ])
            .arg(locus()),
    );
    assert_eq!((code, failed), (1, BTreeSet::from(["fuse device".to_string()])));

    // A socket anyone may connect to.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&n.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, failed, v) = run(args(&[]));
    assert_eq!(
        (code, failed),
        (1, BTreeSet::from(["node socket".to_string()])),
        "{v}"
    );
    std::fs::set_permissions(&n.socket, std::fs::Permissions::from_mode(0o660)).unwrap();

    // A full data dir: a small tmpfs, filled.
    let full = h.path("full");
    std::fs::create_dir_all(&full).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&full)
        .status()
        .unwrap();
    assert!(st.success(), "this test mounts a tmpfs (root)");
    let _ = std::fs::write(full.join("fill"), vec![1u8; 3 << 20]);
    let full_arg = full.to_str().unwrap();
    let mut a = args(&[]);
    let i = a.iter().position(|x| x == "--data-dir").unwrap();
    a[i + 1] = full_arg.to_string();
    let (code, failed, v) = run(a);
    let _ = Command::new("umount").arg(&full).status();
    assert_eq!(
        (code, failed),
        (1, BTreeSet::from([format!("data dir {full_arg}")])),
        "{v}"
    );

    // The metadata service unreachable.
    let mut a = vec!["--metadata".to_string(), "http://127.0.0.1:1".to_string()];
    a.extend(args(&[]));
    let (code, failed, v) = run(a);
    assert_eq!(
        (code, failed),
        (1, BTreeSet::from(["metadata service".to_string()])),
        "{v}"
    );

    // The last backup older than allowed.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let mut a = args(&[]);
    let i = a.iter().position(|x| x == "--backup-max-age").unwrap();
    a[i + 1] = "1s".into();
    let (code, failed, v) = run(a);
    assert_eq!(
        (code, failed),
        (1, BTreeSet::from(["last backup".to_string()])),
        "{v}"
    );
}
