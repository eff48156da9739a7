//! `locus demo`: a throwaway local cluster on the embedded defaults (local dirs, a
//! `file://` origin), driven through the same API and commands as a real one.
//!
//! It starts a real `locus metadata serve` process, generates a small sample dataset,
//! commits it as a version through an import session, and lists it.

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

#[allow(unsafe_code)]
fn terminate(child: &Child) {
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped) and a valid
    // signal number has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
}

pub async fn run(a: DemoArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let tmp;
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

    let mut daemon = start_metadata(&dir)?;
    let url = wait_for_addr(&dir.join("metadata.addr"), &mut daemon, &dir.join("metadata.log")).await?;
    println!(
        "==> metadata service at {url} (log: {})",
        dir.join("metadata.log").display()
    );
    let mut demo_cfg = cfg.clone();
    demo_cfg.metadata_url = url.clone();
    demo_cfg.token = None;
    demo_cfg.ca_cert = None;
    let mut c = demo_cfg.connect().await?;

    let chunk = locus_proto::DEFAULT_CHUNK_SIZE;
    let root = sample.clone();
    let scanned = tokio::task::spawn_blocking(move || crate::scan::scan_dir(&root, chunk, 1 << 30)).await??;
    println!(
        "==> hashed {} files ({}) into {} shard(s)",
        scanned.files,
        crate::output::size(scanned.bytes),
        scanned.shards.len()
    );
    let begin = c
        .begin_version(pb::BeginVersionRequest {
            dataset: "sample".into(),
            chunk_size: chunk,
            origin: format!("file://{}", sample.display()),
            replication: 1,
        })
        .await
        .or_status()?;
    locus_proto::client::put_entries_paged(&mut c, begin.session_id, scanned.entries)
        .await
        .map_err(crate::output::status_error)?;
    locus_proto::client::put_shards_paged(&mut c, begin.session_id, scanned.shards)
        .await
        .map_err(crate::output::status_error)?;
    let v = c
        .commit_version(pb::CommitVersionRequest {
            session_id: begin.session_id,
        })
        .await
        .or_status()?
        .version
        .context("the service committed without returning the version")?;
    println!(
        "==> committed sample@{}: {} files, {}, {} shard(s)\n",
        v.version,
        v.files,
        crate::output::size(v.bytes),
        v.shards
    );

    println!("$ locus dataset list");
    super::dataset::run(super::dataset::DatasetCmd::List, &demo_cfg).await?;
    println!("\n$ locus dataset ls sample@{} --recursive", v.version);
    super::dataset::run(
        super::dataset::DatasetCmd::Ls {
            dataset: format!("sample@{}", v.version),
            directory: String::new(),
            recursive: true,
        },
        &demo_cfg,
    )
    .await?;
    println!("\n$ locus status");
    super::status::run(&demo_cfg).await?;

    if a.keep_running {
        println!("\nThe cluster keeps running; in another shell try:\n  export LOCUS_METADATA={url}\n  locus dataset show sample@latest\nCtrl-C stops it.");
        super::shutdown_signal().await;
    }
    drop(c);
    drop(daemon);
    println!("\n==> demo finished; metadata service stopped");
    Ok(())
}

fn start_metadata(dir: &Path) -> anyhow::Result<Daemon> {
    let exe = std::env::current_exe().context("cannot find the locus executable")?;
    let log = std::fs::File::create(dir.join("metadata.log"))?;
    let _ = std::fs::remove_file(dir.join("metadata.addr"));
    let child = Command::new(exe)
        .args([
            "metadata",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.join("metadata"))
        .arg("--addr-file")
        .arg(dir.join("metadata.addr"))
        .env_remove("LOCUS_METADATA_TOKENS_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("cannot start the metadata service")?;
    Ok(Daemon(child))
}

async fn wait_for_addr(path: &Path, daemon: &mut Daemon, log: &Path) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Some(a) = s.lines().find_map(|l| l.strip_prefix("grpc=")) {
                return Ok(format!("http://{a}"));
            }
        }
        if let Ok(Some(status)) = daemon.0.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            bail!("the metadata service exited ({status}) before it was ready:\n{text}");
        }
        if Instant::now() > deadline {
            bail!(
                "the metadata service did not start within 30 s; see {}",
                log.display()
            );
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
