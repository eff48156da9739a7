//! `locus demo`: a throwaway local cluster on the embedded defaults (local dirs, a
//! `file://` origin), driven through the same API and commands as a real one.
//!
//! It starts a real `locus metadata serve` process and three `locus node serve` processes
//! (one per simulated rack), generates a small sample dataset, imports it with two
//! replicas through the same code as `locus dataset import`, and shows the result.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use locus_proto::pb;

use crate::config::Resolved;
use crate::output::StatusExt;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Keep the cluster's files here (default: a temporary directory, removed at the end).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Leave the cluster running until Ctrl-C, to try other commands against it.
    #[arg(long)]
    pub keep_running: bool,
}

/// The metadata service child; stopped with SIGTERM when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        terminate(&self.0);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Asks a child we spawned and have not reaped yet to stop.
fn terminate(child: &Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
}

pub async fn run(a: DemoArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let tmp;
    let keep = a.dir.is_some();
    let dir = match a.dir {
        Some(d) => {
            std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
            crate::absolute(d)
        }
        None => {
            tmp = tempfile::Builder::new().prefix("locus-demo-").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let sample = dir.join("sample");
    if !sample.exists() {
        write_sample(&sample)?;
    }
    println!("==> sample dataset in {}", sample.display());

    // Daemons are dropped (SIGTERM, then wait) in reverse order: nodes, then metadata.
    let mut daemons = Vec::new();
    let metadata_args: Vec<String> = vec![
        "metadata".into(),
        "serve".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--http-listen".into(),
        "127.0.0.1:0".into(),
        "--data-dir".into(),
        dir.join("metadata").display().to_string(),
    ];
    let url = format!(
        "http://{}",
        start(&dir, "metadata", &metadata_args, &mut daemons).await?
    );
    println!("==> metadata service at {url}");
    for i in 1..=3 {
        let name = format!("node{i}");
        let args: Vec<String> = vec![
            "--metadata".into(),
            url.clone(),
            "node".into(),
            "serve".into(),
            "--id".into(),
            name.clone(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            dir.join(&name).display().to_string(),
            "--capacity".into(),
            "1GiB".into(),
            "--reserve".into(),
            "0".into(),
            "--labels".into(),
            format!("zone=demo,rack=rack{i},host=host{i}"),
            "--heartbeat-interval".into(),
            "500ms".into(),
            "--local-socket".into(),
            dir.join(format!("{name}.sock")).display().to_string(),
        ];
        let addr = start(&dir, &name, &args, &mut daemons).await?;
        println!(
            "==> cache node {name} at {addr} (rack{i}, data in {})",
            dir.join(&name).display()
        );
    }
    let mut demo_cfg = cfg.clone();
    demo_cfg.metadata_url = url.clone();
    demo_cfg.token = None;
    demo_cfg.ca_cert = None;
    wait_for_nodes(&demo_cfg, 3).await?;

    println!(
        "\n$ locus dataset import sample {} --replicas 2",
        sample.display()
    );
    super::import::run(
        super::import::ImportArgs {
            name: "sample".into(),
            source: sample.display().to_string(),
            replicas: 2,
            shard_size: "4MiB".into(),
            chunk_size: "4MiB".into(),
            parallel: 8,
            read_by: super::import::ReadByArg::Auto,
        },
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus dataset list");
    super::dataset::run(super::dataset::DatasetCmd::List, &demo_cfg).await?;
    println!("\n$ locus dataset show sample@1");
    super::dataset::run(
        super::dataset::DatasetCmd::Show {
            dataset: "sample@1".into(),
        },
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus dataset ls sample@1 images");
    super::dataset::run(
        super::dataset::DatasetCmd::Ls {
            dataset: "sample@1".into(),
            directory: "images".into(),
            recursive: false,
        },
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus locality sample@1");
    super::locality::run(
        super::locality::LocalityArgs {
            targets: vec!["sample@1".into()],
            nodes: Vec::new(),
            selector: None,
            shards: Vec::new(),
            paths: Vec::new(),
            limit: None,
        },
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus assign sample@1 --nodes node1,node2 --ranks-per-node 2");
    super::locality::assign(
        super::locality::AssignArgs {
            target: "sample@1".into(),
            nodes: vec!["node1".into(), "node2".into()],
            ranks_per_node: 2,
            rank_nodes: Vec::new(),
            with_files: false,
        },
        &demo_cfg,
    )
    .await?;
    demo_mount(&dir, &url, &sample)?;
    let backup_url = format!("file://{}", dir.join("backup").display());
    let key = dir.join("backup-signing.key");
    println!("\n$ locus backup keygen --out {}", key.display());
    super::backup::run(super::backup::BackupCmd::Keygen { out: key.clone() }, &demo_cfg).await?;
    println!(
        "\n$ locus backup run --to {backup_url} --signing-key {}",
        key.display()
    );
    let to = || super::backup::TargetArg {
        to: Some(backup_url.clone()),
    };
    super::backup::run(
        super::backup::BackupCmd::Run(super::backup::RunArgs {
            target: to(),
            retention: Default::default(),
            parallel: 4,
            signing_key: Some(key.clone()),
        }),
        &demo_cfg,
    )
    .await?;
    let public = format!("{}.pub", key.display());
    println!("\n$ locus backup verify --to {backup_url} --trust-key {public}");
    super::backup::run(
        super::backup::BackupCmd::Verify(super::backup::VerifyArgs {
            target: to(),
            snapshot: None,
            sample: 1.0,
            parallel: 8,
            repair: false,
            trust: super::backup::TrustArgs {
                trust_keys: vec![public.clone()],
                allow_unsigned: false,
            },
        }),
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus backup list --to {backup_url}");
    super::backup::run(super::backup::BackupCmd::List(to()), &demo_cfg).await?;
    // Heartbeats carry the nodes' new figures within half a second.
    tokio::time::sleep(Duration::from_millis(700)).await;
    println!("\n$ locus node list");
    super::node::run(super::node::NodeCmd::List, &demo_cfg).await?;
    println!("\n$ locus status");
    super::status::run(&demo_cfg).await?;

    if a.keep_running {
        println!(
            "\nThe cluster keeps running; in another shell try:\n  export LOCUS_METADATA={url}\n  \
             locus node list\n  locus dataset show sample@latest\n  \
             locus backup list --to {backup_url}\nCtrl-C stops it."
        );
        super::shutdown_signal().await;
    }
    drop(daemons);
    if keep {
        println!(
            "\n==> demo finished; cluster stopped; its data and logs are in {}",
            dir.display()
        );
    } else {
        println!("\n==> demo finished; cluster stopped and its temporary directory removed");
    }
    Ok(())
}

/// Mounts the sample through node1 (passthrough), checks one file against the source and
/// unmounts; says why and moves on where FUSE is unavailable.
fn demo_mount(dir: &Path, url: &str, sample: &Path) -> anyhow::Result<()> {
    if !Path::new("/dev/fuse").exists() {
        println!("\n(no /dev/fuse here: skipping the mount part of the demo)");
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    let sock = dir.join("node1.sock");
    println!(
        "\n$ locus mount sample@1 {} --node-socket {}",
        mnt.display(),
        sock.display()
    );
    let out = Command::new(&exe)
        .args(["--metadata", url, "mount", "sample@1"])
        .arg(&mnt)
        .arg("--node-socket")
        .arg(&sock)
        .arg("--log-file")
        .arg(dir.join("mount.log"))
        .env("LOCUS_RUNTIME_DIR", dir.join("run"))
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        println!(
            "(the mount failed, so that part is skipped: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return Ok(());
    }
    let rel = "images/train/img-003.jpg";
    let same = std::fs::read(mnt.join(rel)).ok() == std::fs::read(sample.join(rel)).ok();
    println!(
        "$ cmp {} {}  → {}",
        mnt.join(rel).display(),
        sample.join(rel).display(),
        if same { "identical" } else { "DIFFERENT" }
    );
    let entries = std::fs::read_dir(mnt.join("images/train"))
        .map(|d| d.count())
        .unwrap_or(0);
    println!("$ ls {} | wc -l  → {entries}", mnt.join("images/train").display());
    let u = Command::new(&exe)
        .arg("umount")
        .arg(&mnt)
        .env("LOCUS_RUNTIME_DIR", dir.join("run"))
        .output()?;
    print!("{}", String::from_utf8_lossy(&u.stdout));
    if !same {
        bail!("the mounted file differs from its source");
    }
    Ok(())
}

/// Starts `locus ARGS --addr-file …` with its log in `dir/NAME.log` and waits until it
/// reports its address.
async fn start(dir: &Path, name: &str, args: &[String], daemons: &mut Vec<Daemon>) -> anyhow::Result<String> {
    let exe = std::env::current_exe().context("cannot find the locus executable")?;
    let log_path = dir.join(format!("{name}.log"));
    let addr_file = dir.join(format!("{name}.addr"));
    let _ = std::fs::remove_file(&addr_file);
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(exe)
        .args(args)
        .arg("--addr-file")
        .arg(&addr_file)
        .env_remove("LOCUS_METADATA_TOKENS_FILE")
        .env_remove("LOCUS_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    daemons.push(Daemon(child));
    let d = daemons.last_mut().expect("just pushed");
    wait_for_addr(&addr_file, d, &log_path).await
}

async fn wait_for_nodes(cfg: &Resolved, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = cfg.connect().await?;
    loop {
        let nodes = c.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
        if nodes
            .iter()
            .filter(|x| x.state == pb::NodeState::Up as i32)
            .count()
            >= n
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the cache nodes did not register within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_addr(path: &Path, daemon: &mut Daemon, log: &Path) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Some(a) = s.lines().find_map(|l| l.strip_prefix("grpc=")) {
                return Ok(a.to_string());
            }
        }
        if let Ok(Some(status)) = daemon.0.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            bail!("{} exited ({status}) before it was ready:\n{text}", log.display());
        }
        if Instant::now() > deadline {
            bail!("not ready within 30 s; see {}", log.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deterministic sample content: a little of everything a dataset has.
fn write_sample(root: &Path) -> anyhow::Result<()> {
    let bytes = |seed: &str, n: usize| {
        let mut out = vec![0u8; n];
        blake3::Hasher::new()
            .update(seed.as_bytes())
            .finalize_xof()
            .fill(&mut out);
        out
    };
    std::fs::create_dir_all(root.join("images/train"))?;
    std::fs::create_dir_all(root.join("labels"))?;
    std::fs::create_dir_all(root.join("empty dir"))?;
    std::fs::write(
        root.join("README.txt"),
        "A sample dataset generated by `locus demo`.\n",
    )?;
    for i in 0..24 {
        std::fs::write(
            root.join(format!("images/train/img-{i:03}.jpg")),
            bytes(&format!("img{i}"), 8_000 + i * 4_000),
        )?;
    }
    let csv: String = (0..24).map(|i| format!("img-{i:03}.jpg,{}\n", i % 5)).collect();
    std::fs::write(root.join("labels/train.csv"), csv)?;
    std::fs::write(root.join("shard-000.bin"), bytes("big", 9 * 1024 * 1024))?;
    std::fs::write(root.join("labels/empty.txt"), b"")?;
    std::fs::write(root.join("images/ünïcødé name.txt"), "names may hold any UTF-8\n")?;
    std::os::unix::fs::symlink("shard-000.bin", root.join("latest.bin"))?;
    Ok(())
}
