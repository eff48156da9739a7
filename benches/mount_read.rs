//! Read throughput through `locus mount` against the same files read from a local
//! directory, and against rclone and s3fs mounting an S3-compatible server that holds
//! the same files — all measured in one run, one table.
//!
//!     cargo bench --bench mount_read
//!     LOCUS_BENCH_LARGE_MIB=256 LOCUS_BENCH_SMALL_FILES=2000 cargo bench --bench mount_read
//!     LOCUS_BENCH_MOUNT_ARGS="--threads 8" cargo bench --bench mount_read
//!     LOCUS_BENCH_ONLY=small LOCUS_BENCH_SYSTEMS="locus (local node)" cargo bench --bench mount_read
//!
//!     LOCUS_BENCH_NEXT_EPOCH=6 LOCUS_BENCH_MOUNT_ARGS="--reopen-cache 5s" cargo bench --bench mount_read
//!
//! `LOCUS_BENCH_NEXT_EPOCH=S` adds, for each Locus row, a job's next epoch: S seconds
//! after the warm samples (past the mount's reopen window, which the mount arguments
//! shorten), the local directory and then the same mount read cold again, with the
//! mount's CPU over that read (printed under the table).
//!
//! `LOCUS_BENCH_ONLY` (comma-separated: large, mixed, small) and `LOCUS_BENCH_SYSTEMS`
//! (names separated by `;`, as names hold commas; matched as prefixes; the local
//! directory is always read) run part of the table; `LOCUS_BENCH_PERF=DIR` records a
//! system-wide profile of each cold read into `DIR`.
//!
//! Workloads, each its own dataset (as training data comes): large files read
//! sequentially one after another (1 MiB reads); a version of mixed sizes (4 KiB to
//! 64 MiB, doubling; `LOCUS_BENCH_MIXED_FILES`, default 45, ~384 MiB) read whole by 8
//! threads; and 128 KiB files read whole by 8 threads. "cold" drops the kernel page
//! cache (root only) and remounts (so rclone's VFS cache and Locus's remote chunk cache
//! start empty). The host below a VM caches what the guest dropped, so a cold figure is
//! only comparable with a read of the same files in the same cache state: each Locus
//! cold read is framed by cold reads of the node's own blob files for that dataset (the
//! bytes Locus reads), one just before the mount and one after the system's warm
//! samples, and "× blobs" is against the one after, which has had one more read to warm
//! the host's cache than Locus had (the ratio errs against Locus). "warm" then repeats the read at
//! once: three samples, each as many whole passes as fit in a second (a warm pass over
//! the small files takes only tens of milliseconds, too short to time alone), and
//! reports the median sample. Each warm sample follows a sample of the local directory,
//! and the warm ratio ("× raw N") is against the median of those paired samples, so load
//! from elsewhere on the host moves both.
//!
//! The Locus cluster is one metadata service and one cache node on this host. The
//! local-node rows use the node's Unix socket: with the default `--opens auto` (the
//! large-file version is passed through, the small-file one opened by the kernel), then
//! each `--opens` forced, to show what the choice is worth; the remote row reads from the
//! node over TCP. The "io_uring" rows repeat the default and `--opens mount` rows with
//! `--fuse-transport io-uring` (the bench switches the kernel's `enable_uring` on for the
//! run and puts it back; the rows are dropped, with a note, where it cannot). Under the table, each Locus row says how many of its opens were
//! passed through to the kernel (FUSE passthrough) per workload, from the mount's own
//! counters, and the transport the mount says it ran: whether passthrough or io_uring
//! engaged is recorded, not assumed. The peers read from SeaweedFS when `weed` is installed
//! (bench/setup-peers.sh), else from the harness's moto; rclone (`--vfs-cache-mode full
//! --read-only`) and s3fs come from Debian and are skipped with a note when absent.

use locus_testkit as support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

/// The fuse module's `enable_uring` parameter switched on, and put back as it was when
/// dropped (`None` inside: it could not be switched on).
struct EnableUring(Option<String>);

impl EnableUring {
    const PATH: &'static str = "/sys/module/fuse/parameters/enable_uring";

    fn on() -> EnableUring {
        let was = std::fs::read_to_string(Self::PATH).ok();
        EnableUring(was.filter(|_| std::fs::write(Self::PATH, "Y").is_ok()))
    }
}

impl Drop for EnableUring {
    fn drop(&mut self) {
        if let Some(was) = &self.0 {
            let _ = std::fs::write(Self::PATH, was.trim());
        }
    }
}

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

/// Reads every file in `files` under `root`: `threads` readers taking files in turn.
/// Returns (bytes, seconds).
fn read_all(root: &Path, files: &[PathBuf], threads: usize) -> (u64, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let files = Arc::new(files.to_vec());
    let t = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (next, files, root) = (next.clone(), files.clone(), root.to_path_buf());
            std::thread::spawn(move || {
                use std::io::Read;
                let mut buf = vec![0u8; 1 << 20];
                let mut total = 0u64;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(f) = files.get(i) else { break };
                    let p = root.join(f);
                    let mut file = std::fs::File::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    loop {
                        let n = file
                            .read(&mut buf)
                            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                        if n == 0 {
                            break;
                        }
                        total += n as u64;
                    }
                }
                total
            })
        })
        .collect();
    let bytes = handles.into_iter().map(|h| h.join().unwrap()).sum();
    (bytes, t.elapsed().as_secs_f64())
}

/// Reads the node's copies of blobs (a file each, or ranges of packs) from `threads`
/// threads; (bytes, seconds).
fn read_blobs(blobs: &[OnDisk], threads: usize) -> (u64, f64) {
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    let bytes = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut total = 0u64;
                    while let Some(b) = blobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                        total += b.read().len() as u64;
                    }
                    total
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    (bytes, t.elapsed().as_secs_f64())
}

/// One warm sample: whole passes over `files` until at least a second has gone by.
/// Returns (passes, bytes, seconds).
fn warm_sample(root: &Path, files: &[PathBuf], threads: usize) -> (usize, u64, f64) {
    let (mut passes, mut bytes, mut secs) = (0, 0, 0.0);
    while secs < 1.0 {
        let (b, s) = read_all(root, files, threads);
        passes += 1;
        bytes += b;
        secs += s;
    }
    (passes, bytes, secs)
}

/// GB/s for the large and the mixed files (workloads 0 and 1), files/s for the small ones.
fn rate((passes, bytes, secs): (usize, u64, f64), workload: usize, files: usize) -> f64 {
    if workload < 2 {
        bytes as f64 / secs / 1e9
    } else {
        (passes * files) as f64 / secs
    }
}

/// A peer's FUSE mount of the bucket; unmounted on drop.
struct PeerMount {
    path: PathBuf,
    child: Option<std::process::Child>,
}

impl Drop for PeerMount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(&self.path)
            .status();
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn wait_mounted(p: &Path) -> bool {
    let want = p.display().to_string();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if info.lines().any(|l| l.split(' ').nth(4) == Some(want.as_str())) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn rclone_mount(h: &Harness, s3: &Peers, n: usize) -> Option<PeerMount> {
    let path = h.path(&format!("rclone{n}"));
    std::fs::create_dir_all(&path).unwrap();
    let cache = h.path(&format!("rclone-cache{n}"));
    let child = Command::new("rclone")
        .args(["mount", "s3:locus", path.to_str().unwrap()])
        .args([
            "--vfs-cache-mode",
            "full",
            "--read-only",
            "--cache-dir",
            cache.to_str().unwrap(),
        ])
        .env_remove("AWS_CA_BUNDLE")
        .envs(s3.rclone_env())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(h.path(&format!("rclone{n}.log"))).unwrap())
        .spawn()
        .ok()?;
    let m = PeerMount {
        path: path.clone(),
        child: Some(child),
    };
    wait_mounted(&path).then_some(m)
}

fn s3fs_mount(h: &Harness, s3: &Peers, n: usize) -> Option<PeerMount> {
    let path = h.path(&format!("s3fs{n}"));
    std::fs::create_dir_all(&path).unwrap();
    let pw = h.path("s3fs.passwd");
    std::fs::write(&pw, format!("{S3_KEY}:{S3_SECRET}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
    let st = Command::new("s3fs")
        .args(["locus", path.to_str().unwrap()])
        .args(["-o", &format!("url={}", s3.endpoint)])
        .args(["-o", "use_path_request_style", "-o", "ro", "-o", "kernel_cache"])
        .args(["-o", &format!("passwd_file={}", pw.display())])
        .env_remove("AWS_CA_BUNDLE")
        .status()
        .ok()?;
    if !st.success() {
        return None;
    }
    wait_mounted(&path).then_some(PeerMount { path, child: None })
}

/// The S3 server the peers read from: SeaweedFS (a real, persistent server that checks
/// SigV4 credentials) when `weed` is installed, else the test harness's moto. Either way
/// the bucket is `locus`.
struct Peers {
    endpoint: String,
    server: &'static str,
    _weed: Option<Weed>,
    _moto: Option<S3Server>,
}

impl Peers {
    async fn start(h: &Harness) -> Peers {
        if !have("weed") {
            let moto = h.start_s3().await;
            return Peers {
                endpoint: moto.endpoint.clone(),
                server: "moto (in-memory; SeaweedFS not installed)",
                _weed: None,
                _moto: Some(moto),
            };
        }
        let weed = h.start_weed().await;
        Peers {
            endpoint: weed.endpoint.clone(),
            server: "SeaweedFS 4.48 (weed server, one process, data on this disk)",
            _weed: Some(weed),
            _moto: None,
        }
    }

    fn rclone_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RCLONE_CONFIG_S3_TYPE", "s3".into()),
            ("RCLONE_CONFIG_S3_PROVIDER", "Other".into()),
            ("RCLONE_CONFIG_S3_ENDPOINT", self.endpoint.clone()),
            ("RCLONE_CONFIG_S3_ACCESS_KEY_ID", S3_KEY.into()),
            ("RCLONE_CONFIG_S3_SECRET_ACCESS_KEY", S3_SECRET.into()),
        ]
    }

    async fn bucket(&self) -> Arc<dyn object_store::ObjectStore> {
        if let Some(m) = &self._moto {
            return m.bucket("locus").await;
        }
        s3_store(&self.endpoint, "locus")
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("mount_read: bench");
        return;
    }
    // Memory freed by one part must not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
    let only_s = std::env::var("LOCUS_BENCH_ONLY").unwrap_or_else(|_| "large,mixed,small".into());
    let only: Vec<&str> = only_s.split(',').map(str::trim).collect();
    if let Some(bad) = only.iter().find(|w| !["large", "mixed", "small"].contains(w)) {
        panic!("LOCUS_BENCH_ONLY: unknown workload {bad:?} (large, mixed, small)");
    }
    let large_mib = env_usize("LOCUS_BENCH_LARGE_MIB", 256);
    let large_n = env_usize("LOCUS_BENCH_LARGE_FILES", 4);
    let small_n = env_usize("LOCUS_BENCH_SMALL_FILES", 2000);
    let mixed_n = env_usize("LOCUS_BENCH_MIXED_FILES", 45);
    let next_epoch = env_usize("LOCUS_BENCH_NEXT_EPOCH", 0);
    let h = Harness::new("bench-mount");
    let src = h.path("src");
    let mut large = Vec::new();
    let mut small = Vec::new();
    // Two datasets, as training data comes: one of large files, one of small ones.
    std::fs::create_dir_all(src.join("large")).unwrap();
    for i in 0..large_n {
        let rel = PathBuf::from(format!("l{i}.bin"));
        std::fs::write(
            src.join("large").join(&rel),
            pseudo_random(i as u64, large_mib << 20),
        )
        .unwrap();
        large.push(rel);
    }
    // Mixed sizes: 4 KiB, 8 KiB, … 64 MiB, round and round.
    let mut mixed = Vec::new();
    let mut mixed_bytes = 0u64;
    for i in 0..mixed_n {
        let rel = PathBuf::from(format!("m{:02}/x{i:04}.bin", i % 5));
        let path = src.join("mixed").join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let size = 4096usize << (i % 15);
        std::fs::write(path, pseudo_random(2_000_000 + i as u64, size)).unwrap();
        mixed_bytes += size as u64;
        mixed.push(rel);
    }
    for i in 0..small_n {
        let rel = PathBuf::from(format!("d{:02}/s{i:05}.bin", i % 50));
        let path = src.join("small").join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, pseudo_random(1_000_000 + i as u64, 128 << 10)).unwrap();
        small.push(rel);
    }

    // Locus: one metadata service and one node on this host.
    let (m, nodes) = cluster(&h, 1, |i| NodeOpts {
        capacity: "16GiB",
        ..NodeOpts::host(i)
    })
    .await;
    for dataset in ["large", "mixed", "small"] {
        let out = import(&m, dataset, &src.join(dataset), &["--replicas", "1"]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    // The same files in S3 for the peers.
    let s3 = Peers::start(&h).await;
    let bucket = s3.bucket().await;
    let keys = (large.iter().map(|r| Path::new("large").join(r)))
        .chain(mixed.iter().map(|r| Path::new("mixed").join(r)))
        .chain(small.iter().map(|r| Path::new("small").join(r)));
    for rel in keys {
        let data = std::fs::read(src.join(&rel)).unwrap();
        let key = object_store::path::Path::from(rel.to_str().unwrap());
        object_store::ObjectStoreExt::put(&bucket, &key, data.into())
            .await
            .unwrap();
    }

    // Extra `locus mount` flags, e.g. LOCUS_BENCH_MOUNT_ARGS="--threads 8".
    let mount_args_s = std::env::var("LOCUS_BENCH_MOUNT_ARGS").unwrap_or_default();
    let mount_args: Vec<&str> = mount_args_s.split_whitespace().collect();
    let with = |extra: &[&'static str]| -> Vec<&str> {
        mount_args.iter().copied().chain(extra.iter().copied()).collect()
    };
    let (default_args, mount_opens, kernel_opens) = (
        with(&[]),
        with(&["--opens", "mount"]),
        with(&["--opens", "kernel"]),
    );
    // FUSE over io_uring, row beside row with /dev/fuse: switched on in the kernel for
    // this run where it can be (root, Linux 6.14+), put back as it was at the end.
    let uring = EnableUring::on();
    let (ring_args, ring_mount_opens) = (
        with(&["--fuse-transport", "io-uring"]),
        with(&["--fuse-transport", "io-uring", "--opens", "mount"]),
    );
    let can_drop = drop_caches();
    // Per workload, the node's blob file of each of its files, in the same order.
    let blob_files = nodes[0].blob_files();
    let blobs_of = |dir: &str, files: &[PathBuf]| -> Vec<OnDisk> {
        files
            .iter()
            .map(|f| {
                let h = blake3::hash(&std::fs::read(src.join(dir).join(f)).unwrap());
                blob_files[&h.to_hex().to_string()].clone()
            })
            .collect()
    };
    let blob_lists = [
        blobs_of("large", &large),
        blobs_of("mixed", &mixed),
        blobs_of("small", &small),
    ];
    // (dataset and directory, files in it, readers)
    let workloads: [(&str, &[PathBuf], usize); 3] =
        [("large", &large, 1), ("mixed", &mixed, 8), ("small", &small, 8)];
    // A system mounts the workload's dataset (numbered to keep mount points apart) and
    // returns where its files are, with whatever keeps the mount alive.
    type Mounter<'a> = Box<dyn Fn(usize, &str) -> Option<(PathBuf, Box<dyn std::any::Any>)> + 'a>;
    let mut counter = 0usize;
    let mut systems: Vec<(&str, Mounter)> = vec![(
        "local directory",
        Box::new(|_, dir| Some((src.join(dir), Box::new(()) as Box<dyn std::any::Any>))),
    )];
    // The open socket: what a host user outside the node's socket group reads through
    // (blobs as descriptors under its grants; see docs/architecture.md, "Teams").
    let open_socket: &[(&str, &str)] = &[("LOCUS_NODE_SOCKET_MODE", "open")];
    let mut locus_rows = vec![
        ("locus (local node)", true, &default_args, &[][..]),
        ("locus (local node, io_uring)", true, &ring_args, &[][..]),
        ("locus (local node, --opens mount)", true, &mount_opens, &[][..]),
        (
            "locus (local node, --opens mount, io_uring)",
            true,
            &ring_mount_opens,
            &[][..],
        ),
        ("locus (local node, --opens kernel)", true, &kernel_opens, &[][..]),
        (
            "locus (local node, open socket)",
            true,
            &default_args,
            open_socket,
        ),
        ("locus (remote reads)", false, &default_args, &[][..]),
    ];
    if uring.0.is_none() {
        locus_rows.retain(|(name, _, _, _)| !name.contains("io_uring"));
    }
    for (name, node, args, env) in locus_rows {
        let (m, node) = (&m, node.then(|| &nodes[0]));
        systems.push((
            name,
            Box::new(move |n, dataset| {
                let mnt = m.mount_with_env(&format!("locus{n}"), dataset, node, args, env);
                Some((mnt.path.clone(), Box::new(mnt) as Box<dyn std::any::Any>))
            }),
        ));
    }
    let systems_s = std::env::var("LOCUS_BENCH_SYSTEMS").unwrap_or_default();
    let chosen = |name: &str| {
        name == "local directory"
            || systems_s.is_empty()
            || systems_s.split(';').any(|p| name.starts_with(p.trim()))
    };
    let mut notes = Vec::new();
    if have("rclone") {
        systems.push((
            "rclone mount (vfs-cache full)",
            Box::new(|n, dir| {
                rclone_mount(&h, &s3, n).map(|p| (p.path.join(dir), Box::new(p) as Box<dyn std::any::Any>))
            }),
        ));
    } else {
        notes.push("rclone is not installed (apt-get install rclone): its rows are missing");
    }
    if have("s3fs") {
        systems.push((
            "s3fs",
            Box::new(|n, dir| {
                s3fs_mount(&h, &s3, n).map(|p| (p.path.join(dir), Box::new(p) as Box<dyn std::any::Any>))
            }),
        ));
    } else {
        notes.push("s3fs is not installed (apt-get install s3fs): its rows are missing");
    }

    let mut rows: Vec<(String, [String; 6])> = Vec::new();
    let mut raw: [f64; 6] = [0.0; 6];
    let mut passthrough = Vec::new();
    let mut epochs = Vec::new();
    systems.retain(|(name, _)| chosen(name));
    assert!(
        systems_s.is_empty() || systems.len() > 1,
        "LOCUS_BENCH_SYSTEMS={systems_s:?} names no system (prefixes of the row names, separated by ';')"
    );
    for (si, (name, mount)) in systems.iter().enumerate() {
        let mut cells: [String; 6] = Default::default();
        let mut engaged = Vec::new();
        for (wi, (dir, files, threads)) in workloads.iter().enumerate() {
            let raw_root = src.join(dir);
            counter += 1;
            let blobs_cold = |files: &[PathBuf]| {
                drop_caches();
                let (b, t) = read_blobs(&blob_lists[wi], *threads);
                rate((1, b, t), wi, files.len())
            };
            if !only.contains(dir) {
                cells[wi * 2] = "-".into();
                cells[wi * 2 + 1] = "-".into();
                continue;
            }
            let blobs_before = (can_drop && name.starts_with("locus")).then(|| blobs_cold(files));
            // The local directory read cold just before this system's cold read: the host's
            // cache drifts over a run, so the one cold sample of the first row is not the
            // state later rows read in.
            let raw_before = (can_drop && si > 0).then(|| {
                drop_caches();
                let (b, t) = read_all(&raw_root, files, *threads);
                rate((1, b, t), wi, files.len())
            });
            if can_drop {
                drop_caches();
            }
            let Some((root, guard)) = mount(counter, dir) else {
                cells[wi * 2] = "mount failed".into();
                continue;
            };
            // The mount's CPU time over its cold read (the server process does all its
            // work): what each file cost it, independent of how busy the host was.
            let server = guard
                .downcast_ref::<Mount>()
                .and_then(|m| m.status()["server_pid"].as_u64());
            let cpu_before = server.map(|p| cpu_seconds(p as u32));
            let perf = profile(&format!("cold-{counter}-{dir}"));
            let (cold_bytes, cold_secs) = read_all(&root, files, *threads);
            stop_profile(perf);
            let cold_cpu = match (cpu_before, server.map(|p| cpu_seconds(p as u32))) {
                // Per file for the small files, per MiB for the others.
                (Some(a), Some(b)) => {
                    let us = (b - a) * 1e6;
                    if wi == 2 {
                        format!(", mount CPU {:.0} µs/file", us / files.len() as f64)
                    } else {
                        format!(
                            ", mount CPU {:.0} µs/MiB",
                            us / (cold_bytes as f64 / (1 << 20) as f64)
                        )
                    }
                }
                _ => String::new(),
            };
            let cold = (1, cold_bytes, cold_secs);
            // Warm: the median of three samples (page-cache state makes single ones noisy).
            // Each is taken right after a sample of the local directory, and the warm
            // ratio is against the median of those: other load on this host then moves
            // both figures rather than the ratio.
            let mut samples = Vec::new();
            let mut paired_raw = Vec::new();
            if si > 0 {
                read_all(&raw_root, files, *threads); // the local files back into the page cache
            }
            for _ in 0..3 {
                if si > 0 {
                    paired_raw.push(rate(warm_sample(&raw_root, files, *threads), wi, files.len()));
                }
                samples.push(warm_sample(&root, files, *threads));
            }
            samples.sort_by(|a, b| rate(*a, wi, files.len()).total_cmp(&rate(*b, wi, files.len())));
            let warm = samples[1];
            paired_raw.sort_by(f64::total_cmp);
            if let (true, Some(pid)) = (next_epoch > 0 && can_drop, server) {
                // The next epoch: the files the mount opened are past its reopen window.
                std::thread::sleep(Duration::from_secs(next_epoch as u64));
                drop_caches();
                let (b, t) = read_all(&raw_root, files, *threads);
                let raw_next = rate((1, b, t), wi, files.len());
                drop_caches();
                let before = cpu_seconds(pid as u32);
                let (b, t) = read_all(&root, files, *threads);
                let us = (cpu_seconds(pid as u32) - before) * 1e6;
                let next = rate((1, b, t), wi, files.len());
                let (unit, cpu) = match wi {
                    2 => ("files/s", format!("{:.0} µs/file", us / files.len() as f64)),
                    _ => (
                        "GB/s",
                        format!("{:.0} µs/MiB", us / (b as f64 / (1 << 20) as f64)),
                    ),
                };
                epochs.push(format!(
                    "{name}, {dir}: {next:.2} {unit} ({:.2}× raw {raw_next:.2}), mount CPU {cpu}",
                    next / raw_next
                ));
            }
            if let Some(mnt) = guard.downcast_ref::<Mount>() {
                // The status file is rewritten every two seconds.
                std::thread::sleep(Duration::from_millis(2100));
                let st = mnt.status();
                let t = &st["totals"];
                let opens =
                    ["opens_passthrough", "opens_local", "opens_remote"].map(|k| t[k].as_u64().unwrap_or(0));
                let how = if st["kernel_opens"] == true {
                    format!("{dir}: the kernel opened every file")
                } else if st["passthrough"] != true {
                    format!("{dir}: passthrough unavailable")
                } else {
                    format!("{dir} {} of {}", opens[0], opens.iter().sum::<u64>())
                };
                // The transport the mount says it ran, not the one asked for (io_uring
                // falls back to /dev/fuse where the kernel says no).
                engaged.push(format!("{how} (via {})", st["transport"].as_str().unwrap_or("?")));
            }
            drop(guard);
            let blobs = blobs_before.map(|before| (before, blobs_cold(files)));
            for (k, sample) in [cold, warm].into_iter().enumerate() {
                let value = rate(sample, wi, files.len());
                if si == 0 {
                    raw[wi * 2 + k] = value;
                }
                let unit = if wi < 2 { "GB/s" } else { "files/s" };
                let show = |v: f64| {
                    if wi < 2 {
                        format!("{v:.2}")
                    } else {
                        format!("{v:.0}")
                    }
                };
                let shown = show(value);
                let raw_cold = raw_before.unwrap_or(raw[wi * 2]);
                cells[wi * 2 + k] = match (paired_raw.get(1), blobs) {
                    (Some(&r), _) if k == 1 => format!("{shown} {unit} ({:.2}× raw {})", value / r, show(r)),
                    (_, Some((before, after))) => format!(
                        "{shown} {unit} ({:.2}× raw {}; {:.2}× blobs {}, {} before{cold_cpu})",
                        value / raw_cold,
                        show(raw_cold),
                        value / after,
                        show(after),
                        show(before)
                    ),
                    _ if k == 0 => {
                        format!("{shown} {unit} ({:.2}× raw {})", value / raw_cold, show(raw_cold))
                    }
                    _ => format!("{shown} {unit} ({:.2}× raw)", value / raw[wi * 2 + k]),
                };
            }
        }
        if !engaged.is_empty() {
            passthrough.push(format!("{name}: {}", engaged.join(", ")));
        }
        rows.push((name.to_string(), cells));
    }
    notes.push("cold \"× raw N\": against the local directory read cold just before that system's cold read (N); \"mount CPU\": the mount server's user+system CPU time over its cold read, per file (128 KiB) or per MiB read (the others)");
    notes.push("cold \"× blobs N, M before\": against the node's blob files of that dataset read cold after the system's warm samples (N) and just before its mount (M)");
    notes.push("warm \"× raw N\": against the local directory sampled in turn with that system (N: the median of those samples)");
    if !can_drop {
        notes.push("not root: page caches could not be dropped, so \"cold\" is not cold");
    }
    if uring.0.is_none() {
        notes.push("FUSE over io_uring could not be switched on (/sys/module/fuse/parameters/enable_uring): its rows are missing");
    }

    println!();
    println!(
        "mount_read: {large_n} × {large_mib} MiB files read sequentially (1 thread); {mixed_n} files of \
         4 KiB to 64 MiB ({} MiB), 8 readers; {small_n} × 128 KiB files, 8 readers",
        mixed_bytes >> 20
    );
    println!("| system | large cold | large warm | mixed cold | mixed warm | 128 KiB cold | 128 KiB warm |");
    println!("|---|---|---|---|---|---|---|");
    for (name, c) in &rows {
        println!("| {name} | {} |", c.join(" | "));
    }
    println!("opens passed through to the kernel (of all opens the mount answered), cold and warm passes together, and the transport each mount ran:");
    for p in passthrough {
        println!("  {p}");
    }
    if !epochs.is_empty() {
        println!("the next epoch, read cold {next_epoch} s after the warm samples through the same mount:");
        for e in epochs {
            println!("  {e}");
        }
    }
    println!("peers read from: {}", s3.server);
    for n in notes {
        println!("note: {n}");
    }
}
