//! A real PyTorch job on a real Locus cluster: torch.distributed with gloo, two nodes with
//! a mount each and two ranks per node, every rank's DataLoader (two persistent worker
//! processes) sampling with LocusSampler and reading through its node's mount
//! (`python/tests/e2e_torch.py`). What the job read is checked against the source and
//! against the mounts' own counters, not against what the sampler claims: every sample
//! opened exactly once per epoch across the ranks, the bytes the mounts served equal to
//! the source's, most of them from the rank's own node; `set_epoch` changing the order;
//! a job stopped mid-epoch resuming at the same and at another world size with no
//! sample read twice or left out; and files dealt whole to the DataLoader's workers by
//! `shard_files`, as a WebDataset-style loader reads tar shards.
//!
//! Needs torch (`pip install torch`, which scripts/setup-debian.sh does; it runs on CPU).

use locus_testkit as support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use support::*;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/e2e_torch.py")
}

/// Files of distinct contents and sizes in a few directories.
fn samples(root: &Path, n: usize) {
    for i in 0..n {
        let d = root.join(format!("class{}", i % 4));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join(format!("img{i:04}.bin")),
            pseudo_random(i as u64 + 11, 3_000 + i * 211),
        )
        .unwrap();
    }
}

/// SHA-256 of every file under `root`, by relative path (what the job's Python reports).
fn sha256_of_tree(root: &Path) -> BTreeMap<String, String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import hashlib, json, os, sys\n\
             r = sys.argv[1]\n\
             print(json.dumps({os.path.relpath(os.path.join(d, f), r): \
             hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest() \
             for d, _, fs in os.walk(r) for f in fs}))",
        )
        .arg(root)
        .output()
        .expect("python3");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

struct Job<'a> {
    h: &'a Harness,
    m: &'a Metadata,
    /// The source's bytes, all samples.
    total_bytes: u64,
    /// (node id, mount) of the two nodes.
    nodes: [(&'a str, &'a Mount); 2],
}

impl Job<'_> {
    /// Runs `world` ranks (the first half on the first node, the rest on the second) for
    /// `epoch`; returns each rank's report.
    fn run(&self, tag: &str, world: usize, epoch: u64, extra: &[&str]) -> Vec<serde_json::Value> {
        let port = free_low_port().to_string();
        let http = format!("http://{}", self.m.http);
        let mut children = Vec::new();
        for r in 0..world {
            let (node, mnt) = self.nodes[if r < world.div_ceil(2) { 0 } else { 1 }];
            let out = self.h.path(&format!("{tag}-rank{r}.json"));
            let log = std::fs::File::create(self.h.path(&format!("{tag}-rank{r}.log"))).unwrap();
            let child = Command::new("python3")
                .arg(script())
                .arg(&out)
                .arg(epoch.to_string())
                .args(extra)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("LOCUS_NODE", node)
                .env("LOCUS_HTTP", &http)
                .env("MOUNT", &mnt.path)
                .env("DATASET", "ds@1")
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("python3");
            children.push((r, out, child));
        }
        children
            .into_iter()
            .map(|(r, out, mut c)| {
                let st = c.wait().unwrap();
                let log =
                    std::fs::read_to_string(self.h.path(&format!("{tag}-rank{r}.log"))).unwrap_or_default();
                assert!(st.success(), "{tag}: rank {r} failed ({st}):\n{log}");
                serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
            })
            .collect()
    }

    /// Runs one whole epoch from a dropped page cache and checks it against the source
    /// and the mounts' counters: every sample exactly once across the ranks, its bytes the
    /// source's, one open per sample, the source's bytes served, nearly all of them local.
    /// Returns each rank's order.
    async fn full_epoch(
        &self,
        tag: &str,
        epoch: u64,
        extra: &[&str],
        want: &BTreeMap<String, String>,
    ) -> Vec<Vec<u64>> {
        let (n, total_bytes) = (want.len(), self.total_bytes);
        assert!(drop_caches(), "dropping the page cache needs root");
        let (o0, l0, b0) = self.counters().await;
        let reports = self.run(tag, 4, epoch, extra);
        let (o1, l1, b1) = self.counters().await;
        let per_rank = delivered(&reports);
        let parts: Vec<&[u64]> = per_rank.iter().map(Vec::as_slice).collect();
        exactly_once(tag, &parts, n);
        let files: Vec<String> = serde_json::from_value(reports[0]["files"].clone()).unwrap();
        assert_eq!(files.len(), n);
        for r in &reports {
            for s in r["samples"].as_array().unwrap() {
                let f = &files[s["index"].as_u64().unwrap() as usize];
                assert_eq!(
                    s["sha256"].as_str(),
                    want.get(f).map(String::as_str),
                    "{tag}: {f}"
                );
            }
        }
        assert_eq!(o1 - o0, n as u64, "{tag}: opens at the mounts");
        assert_eq!(b1 - b0, total_bytes, "{tag}: bytes the mounts served");
        let local = (l1 - l0) as f64 / total_bytes as f64;
        println!("{tag}: local share of bytes {local:.3}");
        assert!(local >= 0.9, "{tag}: only {local:.3} of the bytes were local");
        per_rank
    }

    /// Both mounts' opens and bytes served so far (their status files' counters).
    async fn counters(&self) -> (u64, u64, u64) {
        let (mut opens, mut local, mut all) = (0, 0, 0);
        for (_, m) in self.nodes {
            // The status file is rewritten every two seconds: wait for a fresh one.
            tokio::time::sleep(std::time::Duration::from_millis(2_200)).await;
            let t = &m.status()["totals"];
            let n = |k: &str| t[k].as_u64().unwrap_or(0);
            opens += n("opens_local") + n("opens_remote");
            local += n("bytes_local");
            all += n("bytes_local") + n("bytes_remote") + n("bytes_cache") + n("bytes_origin");
        }
        (opens, local, all)
    }
}

/// The sample indices the reports delivered, each rank's in order.
fn delivered(reports: &[serde_json::Value]) -> Vec<Vec<u64>> {
    reports
        .iter()
        .map(|r| {
            r["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["index"].as_u64().unwrap())
                .collect()
        })
        .collect()
}

/// Every index in 0..n exactly once across `parts`.
fn exactly_once(what: &str, parts: &[&[u64]], n: usize) {
    let mut seen = BTreeMap::new();
    for p in parts {
        for i in *p {
            *seen.entry(*i).or_insert(0u32) += 1;
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).map(|(i, _)| *i).collect();
    assert!(twice.is_empty(), "{what}: samples read more than once: {twice:?}");
    let missing: Vec<_> = (0..n as u64).filter(|i| !seen.contains_key(i)).collect();
    assert!(missing.is_empty(), "{what}: samples never read: {missing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pytorch_job_reads_every_sample_once_per_epoch_locally_and_resumes_at_another_world_size() {
    let torch = Command::new("python3")
        .args([
            "-c",
            "import torch, torch.distributed as d; assert d.is_gloo_available()",
        ])
        .output()
        .expect("python3");
    assert!(
        torch.status.success(),
        "this test needs PyTorch (pip install torch; scripts/setup-debian.sh installs it): {}",
        String::from_utf8_lossy(&torch.stderr)
    );
    let h = Harness::new("pytorch");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let src = h.path("src");
    let n = 96;
    samples(&src, n);
    // One replica, small shards: each shard on one node, so where a rank reads matters.
    let out = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let want = sha256_of_tree(&src);
    let total_bytes: u64 = (0..n).map(|i| 3_000 + i as u64 * 211).sum();
    // The mount opens every file itself and passes nothing through, so its counters see
    // every open and every byte.
    let opts = ["--opens", "mount", "--passthrough-min-size", "1TiB"];
    let mnt1 = m.mount("mnt1", "ds@1", Some(&n1), &opts);
    let mnt2 = m.mount("mnt2", "ds@1", Some(&n2), &opts);
    let job = Job {
        h: &h,
        m: &m,
        total_bytes,
        nodes: [("n1", &mnt1), ("n2", &mnt2)],
    };

    // Two full epochs, the page cache dropped before each so every byte reaches a mount.
    let mut orders = Vec::new();
    for epoch in 0..2u64 {
        orders.push(job.full_epoch(&format!("epoch {epoch}"), epoch, &[], &want).await);
    }
    assert_ne!(orders[0], orders[1], "set_epoch changes the order");

    // Stopped after 3 batches, resumed at the same world size, then at another.
    for (epoch, resume_world) in [(2u64, 4usize), (3, 2)] {
        assert!(drop_caches());
        let partial = job.run(&format!("partial{epoch}"), 4, epoch, &["--stop-after", "3"]);
        let state = h.path(&format!("state{epoch}.json"));
        std::fs::write(&state, serde_json::to_vec(&partial[0]["state"]).unwrap()).unwrap();
        let (o0, _, _) = job.counters().await;
        let rest = job.run(
            &format!("resume{epoch}"),
            resume_world,
            epoch,
            &["--resume", state.to_str().unwrap()],
        );
        let (o1, _, _) = job.counters().await;
        let before = delivered(&partial);
        let after = delivered(&rest);
        let consumed: usize = before.iter().map(Vec::len).sum();
        assert_eq!(consumed, 4 * 3 * 4, "4 ranks × 3 batches × 4 samples");
        let parts: Vec<&[u64]> = before.iter().chain(after.iter()).map(Vec::as_slice).collect();
        exactly_once(
            &format!("epoch {epoch} resumed at world {resume_world}"),
            &parts,
            n,
        );
        assert_eq!(
            o1 - o0,
            (n - consumed) as u64,
            "epoch {epoch}: the resumed job opened only what was left"
        );
        let nodes: BTreeSet<&str> = rest.iter().map(|r| r["node"].as_str().unwrap()).collect();
        assert_eq!(nodes.len(), 2, "both nodes take part");
    }

    // Files read whole as a tar-shard loader reads them: each rank's two workers take
    // `shard_files`' share; every file once across ranks and workers, opened once.
    job.full_epoch("shard files", 4, &["--shard-files"], &want).await;
}
