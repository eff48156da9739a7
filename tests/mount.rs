//! End-to-end tests of `locus mount`: real FUSE mounts of versions imported into a real
//! cluster (metadata service and cache nodes as processes on loopback), read through the
//! kernel with ordinary file calls.

use locus_testkit as support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use locus_proto::nodepb;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_file_reads_back_identical_with_and_without_a_local_node() {
    let h = Harness::new("mount-identical");
    let (m, nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 600);
    // Files an import sends alone (above 256 KiB); the smaller ones go in batches and the
    // node keeps them packed, many to a file.
    std::fs::create_dir_all(src.join("large")).unwrap();
    for i in 0..20 {
        std::fs::write(
            src.join(format!("large/{i:02}.bin")),
            pseudo_random(700 + i, 300_000),
        )
        .unwrap();
    }
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "2MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Every open asks the mount: files of 128 KiB and more in a file of their own on the
    // node are passed through (the 20 large ones, and the 140 KB+ ones of shards the
    // node copies from a peer); packed ones and smaller ones are read by the mount.
    let local = m.mount(
        "local",
        "mixed@1",
        Some(&nodes[0]),
        &["--opens", "mount", "--passthrough-min-size", "128KiB"],
    );
    // The kernel opens files by itself and asks for pages only.
    let kernel = m.mount("kernel", "mixed@1", Some(&nodes[0]), &["--opens", "kernel"]);
    // No local node: `--opens auto` lets the kernel open files here too.
    let remote = m.mount("remote", "mixed", None, &[]);
    assert_same_tree(&src, &local.path);
    assert_same_tree(&src, &kernel.path);
    assert_same_tree(&src, &remote.path);

    // The transport is the one asked for: CI runs this suite in both, with io_uring
    // switched on in the kernel for the second.
    let want = match std::env::var("LOCUS_FUSE_TRANSPORT").as_deref() {
        Ok("io-uring") => "io_uring",
        _ => "/dev/fuse",
    };
    for mnt in [&local, &kernel, &remote] {
        assert_eq!(
            mnt.status()["transport"].as_str(),
            Some(want),
            "{}",
            mnt.path.display()
        );
    }
    let ls = local
        .status_when(
            "the local mount to hand large files to the kernel and read small ones",
            |s| {
                s["totals"]["opens_passthrough"].as_u64() >= Some(20)
                    && s["totals"]["opens_local"].as_u64() >= Some(450)
            },
        )
        .await;
    assert!(ls["totals"]["opens_passthrough"].as_u64() < Some(100), "{ls}");
    assert_eq!(ls["totals"]["read_errors"], 0, "{ls}");
    assert_eq!(ls["totals"]["opens_remote"], 0, "{ls}");
    assert_eq!(ls["kernel_opens"], false, "{ls}");
    // Opened by the kernel: nothing passed through, every non-empty file fetched from the
    // node once (the first read of each), however often it is opened.
    for _ in 0..3 {
        std::fs::read(kernel.path.join("val/file 0002.bin")).unwrap();
    }
    let ks = kernel
        .status_when("the kernel-opened mount to count its files", |s| {
            s["totals"]["opens_local"].as_u64() >= Some(500)
        })
        .await;
    assert_eq!(ks["kernel_opens"], true, "{ks}");
    assert_eq!(ks["passthrough"], false, "{ks}");
    assert!(ks["totals"]["opens_local"].as_u64() <= Some(560), "{ks}");
    assert_eq!(ks["totals"]["opens_passthrough"], 0, "{ks}");
    assert_eq!(ks["totals"]["opens_remote"], 0, "{ks}");
    assert_eq!(ks["totals"]["read_errors"], 0, "{ks}");
    let rs = remote
        .status_when("the remote mount to count its reads", |s| {
            s["totals"]["opens_remote"].as_u64() > Some(500)
        })
        .await;
    assert_eq!(rs["kernel_opens"], true, "{rs}");
    assert!(rs["totals"]["bytes_remote"].as_u64().unwrap() > 0, "{rs}");
    assert_eq!(rs["totals"]["read_errors"], 0, "{rs}");
    // The local node now holds every blob the mount opened, verified.
    assert!(nodes[0].blob_files().len() > 100);

    // `locus status` shows both mounts.
    let mut cmd = std::process::Command::new(locus());
    let st = cmd
        .arg("status")
        .env("LOCUS_METADATA", m.url())
        .env("LOCUS_RUNTIME_DIR", &local.runtime_dir)
        .output()
        .unwrap();
    let text = stdout(&st);
    assert!(
        text.contains(&format!("mixed@1 at {}", local.path.display())),
        "{text}"
    );
    assert!(text.contains(&format!("at {}", remote.path.display())), "{text}");
    assert!(
        text.contains(&format!(
            "at {} (pid {}, server {} via {want}): opened by the kernel",
            kernel.path.display(),
            kernel.pid(),
            kernel.server_pid()
        )),
        "{text}"
    );

    // Read-only: every kind of change is refused with EROFS and leaves the tree alone,
    // whoever opens the files.
    for mnt in [&local.path, &kernel.path] {
        let some_file = mnt.join("val/file 0002.bin");
        let erofs = |r: std::io::Result<()>| {
            let e = r.expect_err("a change to a read-only mount");
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
        };
        erofs(std::fs::write(mnt.join("new"), b"x"));
        erofs(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&some_file)
                .map(drop),
        );
        erofs(
            std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&some_file)
                .map(drop),
        );
        erofs(std::fs::remove_file(&some_file));
        erofs(std::fs::rename(&some_file, mnt.join("val/moved")));
        erofs(std::fs::create_dir(mnt.join("newdir")));
        erofs(std::os::unix::fs::symlink("x", mnt.join("newlink")));
        assert_same_tree(&src, mnt);
    }

    // `locus umount` unmounts and the mount process exits.
    let pid = remote.pid();
    let u = remote.umount();
    assert!(u.status.success(), "{}", stderr(&u));
    assert!(!remote.is_mounted());
    wait_until("the mount process to exit", Duration::from_secs(10), || async {
        (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    })
    .await;

    // SIGTERM to the mount process unmounts cleanly.
    let pid = local.pid();
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    wait_until("SIGTERM to unmount", Duration::from_secs(10), || async {
        (!local.is_mounted() && !Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_of_100k_entries_lists_correctly() {
    let h = Harness::new("mount-bigdir");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    // Holds the version's sealed namespace (the files' bytes exist nowhere).
    let node = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let mut c = m.client(None).await;
    let (entries, shards) = synthetic_manifest("big", 100_000, 100_000, 100_000, 1 << 20);
    let want: Vec<String> = entries
        .iter()
        .filter(|e| e.path.starts_with("top/d00000/"))
        .map(|e| e.path.rsplit('/').next().unwrap().to_string())
        .collect();
    commit_mountable(&mut c, &node, "big", 1 << 20, entries, shards)
        .await
        .unwrap();
    let mnt = m.mount("big", "big@1", None, &[]);
    let dir = mnt.path.join("top/d00000");
    let mut got: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    got.sort();
    let mut want = want;
    want.sort();
    assert_eq!(got.len(), 100_000);
    assert_eq!(got, want);
    // Attributes of entries far apart in the listing.
    for name in [&want[0], &want[50_000], &want[99_999]] {
        let md = std::fs::metadata(dir.join(name)).unwrap();
        assert!(md.is_file());
        assert_eq!(md.permissions().mode() & 0o7777, 0o644);
    }
    assert_eq!(
        std::fs::metadata(dir.join("no-such-file")).unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_no_error_when_the_node_serving_them_is_killed() {
    let h = Harness::new("mount-kill");
    let (m, mut nodes) = cluster(&h, 3, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 300);
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "1MiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Two mounts read through n1 as their local node (one asked at every open, one whose
    // files the kernel opens), the third from replicas (n1 among them).
    let local = m.mount(
        "local",
        "mixed@1",
        Some(&nodes[0]),
        &["--opens", "mount", "--no-passthrough", "--reopen-cache", "0s"],
    );
    let kernel = m.mount("kernel", "mixed@1", Some(&nodes[0]), &["--opens", "kernel"]);
    // A small chunk cache, so passes after the kill really go to the nodes again.
    let remote = m.mount("remote", "mixed@1", None, &["--cache-size", "256KiB"]);
    let files = Arc::new(files_of(&src));

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let roots = [
        local.path.clone(),
        remote.path.clone(),
        kernel.path.clone(),
        remote.path.clone(),
    ];
    let readers = spawn_verifying_readers(&roots, files.clone(), 8, stop.clone(), reads.clone());
    wait_until("readers to get going", Duration::from_secs(30), || async {
        (reads.load(Ordering::Relaxed) > 200).then_some(())
    })
    .await;
    nodes[0].daemon.kill9();
    let at_kill = reads.load(Ordering::Relaxed);
    // Keep reading well past the kill: each reader goes over many files not yet opened.
    wait_until(
        "readers to continue after the kill",
        Duration::from_secs(60),
        || async { (reads.load(Ordering::Relaxed) > at_kill + 1_200).then_some(()) },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap().unwrap();
    }
    let ls = local
        .status_when("the local mount to fall back to replicas", |s| {
            s["totals"]["opens_remote"].as_u64() > Some(0)
        })
        .await;
    assert_eq!(ls["totals"]["read_errors"], 0, "{ls}");
    let ks = kernel
        .status_when("the kernel-opened mount to fall back to replicas", |s| {
            s["totals"]["opens_remote"].as_u64() > Some(0)
        })
        .await;
    assert_eq!(ks["totals"]["read_errors"], 0, "{ks}");
    let rs = remote
        .status_when("the remote mount to have failed over", |s| {
            s["totals"]["failovers"].as_u64() > Some(0)
        })
        .await;
    assert_eq!(rs["totals"]["read_errors"], 0, "{rs}");
}

/// Reads answered off the ring's threads leave the mount serving once those threads have
/// ended. A mount with no local node answers every read from a blocking-pool thread, which
/// the pool lets go after 10 s idle. Under FUSE over io_uring the kernel completes a ring
/// command on the thread that submitted it: an answer submitted by a pool thread tied the
/// entry's next request to that thread, and once it had ended the request failed its
/// reader with ECANCELED (and the entry was lost to its queue). Through `/dev/fuse` the
/// same reads must pass too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_keep_working_after_the_threads_that_answered_earlier_ones_have_ended() {
    let h = Harness::new("mount-threads-ended");
    let (m, _nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..400u64 {
        std::fs::write(src.join(format!("f{i:03}")), pseudo_random(i, 40_000)).unwrap();
    }
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let remote = m.mount("remote", "ds@1", None, &[]);
    // Eight readers at once, so the answers come from many pool threads and land on
    // many ring entries.
    let read_all = |range: std::ops::Range<u64>| {
        let next = AtomicU64::new(range.start);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= range.end {
                        break;
                    }
                    let name = format!("f{i:03}");
                    let got =
                        std::fs::read(remote.path.join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert!(got == pseudo_random(i, 40_000), "{name} differs");
                });
            }
        });
    };
    read_all(0..200);
    // Past the pool's keep-alive: the threads that answered are gone.
    tokio::time::sleep(Duration::from_secs(13)).await;
    read_all(200..400);
    let st = remote.status();
    assert_eq!(st["totals"]["read_errors"], 0, "{st}");
}

/// A file system handler that panics answers its request EIO and leaves its thread
/// serving: the next request from the same CPU (the same io_uring queue, when the
/// environment asks for that transport) is answered. In-process, a file system of one
/// name that panics; a thread of the session's one (or of the queue's) would otherwise
/// die with the panic and leave that CPU's requests unanswered.
#[test]
fn a_handler_that_panics_answers_eio_and_its_thread_keeps_serving() {
    struct Boom;
    impl fuser::Filesystem for Boom {
        fn lookup(
            &self,
            _: &fuser::Request,
            _: fuser::INodeNo,
            name: &std::ffi::OsStr,
            reply: fuser::ReplyEntry,
        ) {
            if name == "boom" {
                panic!("a lookup that panics, on purpose");
            }
            reply.error(fuser::Errno::ENOENT);
        }
    }
    // Every request from CPU 0: one queue under io_uring.
    // SAFETY: a zeroed cpu_set_t is empty; CPU 0 is set in it.
    #[allow(unsafe_code)]
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("m");
    std::fs::create_dir(&mp).unwrap();
    let mut config = fuser::Config::default();
    // Named as a Locus mount, so that the mount table finds its connection below.
    config.mount_options = vec![
        fuser::MountOption::FSName(format!("{}panic-test@1", locus_fuse::SOURCE_PREFIX)),
        fuser::MountOption::Subtype(locus_fuse::SUBTYPE.into()),
        fuser::MountOption::RO,
    ];
    config.n_threads = Some(1);
    let ring = std::env::var("LOCUS_FUSE_TRANSPORT").is_ok_and(|t| t == "io-uring");
    config.io_uring = ring.then_some(4);
    let mut s = fuser::Session::new(Boom, &mp, &config)
        .unwrap_or_else(|e| panic!("mount at {} (needs /dev/fuse and root): {e}", mp.display()));
    if ring {
        assert!(
            s.start_io_uring().expect("io_uring queues"),
            "requests come through io_uring"
        );
    }
    let session = s.spawn().unwrap();
    // The connection's number, for aborting it should a stat never be answered.
    let conn =
        locus_fuse::mount_device(&mp).and_then(|d| d.split_once(':').map(|(_, minor)| minor.to_string()));
    let answer = |name: &str| {
        let p = mp.join(name);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::fs::metadata(&p).map(|_| ()));
        });
        rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| {
            // Unblock the waiting stat before failing, or this process could not end.
            if let Some(c) = &conn {
                let ctl = Path::new("/sys/fs/fuse/connections");
                if !ctl.join(c).exists() {
                    let _ = std::process::Command::new("mount")
                        .args(["-t", "fusectl", "none"])
                        .arg(ctl)
                        .status();
                }
                let _ = std::fs::write(ctl.join(c).join("abort"), "1");
            }
            let _ = std::process::Command::new("umount").arg("-l").arg(&mp).status();
            panic!("no answer for {name}: the thread that panicked stopped serving")
        })
    };
    for round in 0..3 {
        let e = answer("boom").expect_err("a lookup that panicked cannot succeed");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "round {round}: {e}");
        let e = answer("ok").expect_err("no such file");
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "round {round}: {e}");
    }
    drop(session);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_does_not_hold_up_readers() {
    let h = Harness::new("mount-hung");
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 60);
    // A large file read in many requests: a hung node must cost it one wait, not one
    // per request (32 MiB in 1 MiB requests at 3 s each would be minutes).
    let big = pseudo_random(31, 32 << 20);
    std::fs::write(src.join("zz-big.bin"), &big).unwrap();
    // Small shards: the big file is not in the shard of the first file read, so the mount
    // has not learned its path from the node before the node hangs (it would open the
    // node's verified file directly, and rightly need no replica).
    let out = import(&m, "mixed", &src, &["--replicas", "2", "--shard-size", "64KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // n1 is the local node; remote reads prefer n2 (same "host" label).
    let args = |opens| vec!["--opens", opens, "--labels", "host=h2"];
    let kernel = m.mount("kernel", "mixed@1", Some(&nodes[0]), &args("kernel"));
    let mount = m.mount("mount", "mixed@1", Some(&nodes[0]), &args("mount"));
    let files: Vec<_> = nonempty_files(&src)
        .into_iter()
        .filter(|(p, _)| !p.ends_with("zz-big.bin"))
        .collect();
    // The node answers while it runs.
    let (rel, want) = &files[0];
    let got = std::fs::read(kernel.path.join(rel)).unwrap();
    assert_eq!(blake3::hash(&got).to_hex().as_str(), want);

    // Stopped (alive, silent), it would hold every first read for the whole open timeout
    // (ten minutes); readers get the bytes from n2 after a few seconds instead.
    let pid = nodes[0].daemon.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let big_path = kernel.path.join("zz-big.bin");
    let big_reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut f = std::fs::File::open(&big_path).map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        if got == big {
            Ok(())
        } else {
            Err("zz-big.bin: wrong bytes".to_string())
        }
    });
    let mut readers: Vec<_> = files[1..9]
        .iter()
        .enumerate()
        .map(|(i, (rel, want))| {
            let root = if i % 2 == 0 {
                kernel.path.clone()
            } else {
                mount.path.clone()
            };
            let (p, want) = (root.join(rel), want.clone());
            std::thread::spawn(move || {
                let data = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                if blake3::hash(&data).to_hex().as_str() == want {
                    Ok(())
                } else {
                    Err(format!("{}: wrong bytes", p.display()))
                }
            })
        })
        .collect();
    readers.push(big_reader);
    wait_until(
        "readers to finish while n1 is stopped",
        Duration::from_secs(60),
        || async { readers.iter().all(|r| r.is_finished()).then_some(()) },
    )
    .await;
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    for r in readers {
        r.join().unwrap().unwrap();
    }
    // The big file came from n2; files whose paths the mount had learned from n1 before
    // it hung may have been read from n1's disk. No read failed either way.
    let st = kernel
        .status_when("the mount to count its remote reads", |s| {
            s["totals"]["bytes_remote"].as_u64() >= Some(32 << 20)
        })
        .await;
    assert_eq!(st["totals"]["read_errors"], 0, "{st}");
    let st = mount
        .status_when("the mount to count its reads", |s| {
            s["totals"]["reads"].as_u64() > Some(0)
        })
        .await;
    assert_eq!(st["totals"]["read_errors"], 0, "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_never_returned() {
    corrupted_blobs("mount").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_never_returned_when_the_kernel_opens_files() {
    corrupted_blobs("kernel").await;
}

/// Changes one byte of a node's blob file in place (same size).
fn flip_byte(blob: &Path, at: usize) {
    let mut bytes = std::fs::read(blob).unwrap();
    bytes[at] ^= 0x01;
    std::fs::OpenOptions::new()
        .write(true)
        .open(blob)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
        .unwrap();
}

/// The version's sealed namespace on the mount's local node, damaged on the node's disk:
/// one byte changed where the structure still opens (only its hash tells), then cut short.
/// The node hashes a file that changed since its last check before it answers, so it
/// quarantines the bad copy and fetches the peer's; the mount serves the source's tree
/// exactly each time. On a host without a node, a copy fetched once is kept for the
/// host's next mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_namespace_on_the_local_node_is_refused_and_fetched_from_a_peer() {
    let h = Harness::new("mount-ns-damaged");
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 40);
    let out = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let shown: serde_json::Value =
        serde_json::from_slice(&m.cli(&["dataset", "show", "ds@1", "--json"]).stdout).unwrap();
    let ns = shown["namespace"]["blob"]
        .as_str()
        .expect("a sealed namespace")
        .to_string();
    // Sent alone, so a file of its own (a mount maps it whole).
    let on_n1 = nodes[0].blob_files()[&ns].path.clone();
    let good = std::fs::read(&on_n1).unwrap();
    assert!(
        nodes[1].blob_files().contains_key(&ns),
        "both replicas of shard 0 hold it"
    );

    // A good copy: used from the node, mapped.
    let mnt = m.mount("good", "ds@1", Some(&nodes[0]), &[]);
    assert_same_tree(&src, &mnt.path);
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(
        log.contains("from the local node") && log.contains("mapped"),
        "{log}"
    );
    drop(mnt);

    // The root's mtime (bytes 18..26 of the first record): still a well-formed namespace.
    flip_byte(&on_n1, 20);
    let mnt = m.mount("flipped", "ds@1", Some(&nodes[0]), &[]);
    assert_same_tree(&src, &mnt.path);
    assert_eq!(nodes[0].quarantined(), 1, "n1 set its bad copy aside");
    assert_eq!(std::fs::read(&on_n1).unwrap(), good, "and fetched the peer's");
    drop(mnt);

    // Cut short.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&on_n1)
        .unwrap()
        .set_len(100)
        .unwrap();
    let mnt = m.mount("short", "ds@1", Some(&nodes[0]), &[]);
    assert_same_tree(&src, &mnt.path);
    assert_eq!(std::fs::read(&on_n1).unwrap(), good);
    drop(mnt);

    // No local node: fetched from the nodes once, then this host's copy.
    let mnt = m.mount("remote", "ds@1", None, &[]);
    assert_same_tree(&src, &mnt.path);
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(log.contains("from the cluster's nodes, kept at"), "{log}");
    drop(mnt);
    let mnt = m.mount("again", "ds@1", None, &[]);
    assert_same_tree(&src, &mnt.path);
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(log.contains("from this host's copy"), "{log}");
}

/// `opens`: the local mount's `--opens`.
async fn corrupted_blobs(opens: &str) {
    let h = Harness::new(&format!("mount-corrupt-{opens}"));
    let (m, nodes) = cluster(&h, 2, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 40);
    // Two files larger than an import sends in batches: each blob a file of its own,
    // which the mount may hand to the kernel (the small files' blobs are kept packed).
    for i in 0..2 {
        std::fs::write(
            src.join(format!("large-{i}.bin")),
            pseudo_random(900 + i, 300_000),
        )
        .unwrap();
    }
    let out = import(&m, "mixed", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let files = files_of(&src);
    // Every blob is on both nodes. Corrupt two files' blobs on n1, in place.
    let big: Vec<_> = files
        .iter()
        .filter(|(p, _)| std::fs::metadata(src.join(p)).unwrap().len() > 256 << 10)
        .collect();
    assert_eq!(big.len(), 2);
    let on_n1 = nodes[0].blob_files();
    for (rel, _) in &big {
        let hash = blake3::hash(&std::fs::read(src.join(rel)).unwrap())
            .to_hex()
            .to_string();
        assert!(!on_n1[&hash].packed);
        on_n1[&hash].flip(70_000);
    }
    // Through n1 as local node: the node re-verifies the changed file, quarantines it and
    // fetches a good copy from n2. Asked at every open, the mount passes the 300 KB files
    // through to the kernel and reads smaller ones itself.
    let local = m.mount(
        "local",
        "mixed@1",
        Some(&nodes[0]),
        &["--opens", opens, "--passthrough-min-size", "128KiB"],
    );
    let (rel, want) = big[0];
    let got = std::fs::read(local.path.join(rel)).unwrap();
    assert_eq!(blake3::hash(&got).to_hex().as_str(), want);
    assert_eq!(nodes[0].quarantined(), 1);

    // Small files' blobs damaged on n1 after the node verified them (the mount keeps the
    // verified file open for reuse): cut short, or one byte flipped in place (same size,
    // so only the file's mtime tells). The damage never reaches the reader. Asked at
    // every open, the mount fails that open's reads (the handle holds the damaged file);
    // without handles, the kernel retries the failed page at once and the retry already
    // has the node re-check and refetch the blob. Either way the next read is right.
    // These blobs are in a pack: cut short, it ends inside the blob (and what follows it
    // in the pack is gone too, so the blob cut is the last of the two in the pack).
    let cut_short = |blob: &OnDisk| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&blob.path)
            .and_then(|f| f.set_len(blob.offset + blob.size / 2))
            .unwrap();
    };
    let flip_a_byte = |blob: &OnDisk| blob.flip(5_000);
    let damages: [&dyn Fn(&OnDisk); 2] = [&cut_short, &flip_a_byte];
    let mut small: Vec<_> = files
        .iter()
        .filter(|(p, _)| (10_000..100_000).contains(&std::fs::metadata(src.join(p)).unwrap().len()))
        .collect();
    small.sort_by_key(|(_, want)| std::cmp::Reverse(on_n1[want].offset));
    assert!(on_n1[&small[0].1].packed && on_n1[&small[1].1].packed);
    for (i, ((rel, want), damage)) in small.into_iter().zip(damages).enumerate() {
        let read = || std::fs::read(local.path.join(rel));
        assert_eq!(blake3::hash(&read().unwrap()).to_hex().as_str(), want);
        drop_page_cache(&local.path.join(rel));
        damage(&on_n1[want]);
        // The damaged pack out of the page cache too: the mount reads a cold blob's end
        // direct (over io_uring, on the request's own ring), and that path must refuse
        // the damage as well.
        std::fs::File::open(&on_n1[want].path)
            .and_then(|f| f.sync_all())
            .unwrap();
        drop_page_cache(&on_n1[want].path);
        if opens == "mount" {
            let err = read().unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        }
        assert_eq!(blake3::hash(&read().unwrap()).to_hex().as_str(), want);
        assert_eq!(nodes[0].quarantined(), 2 + i);
    }
    // Over FUSE io_uring the reads of the damaged, uncached packs were read on the
    // request's own ring (`Mount::read_by_ring`), one per file at least. Through
    // /dev/fuse, never.
    let ring_reads = |s: &serde_json::Value| s["totals"]["ring_reads"].as_u64().unwrap_or(0);
    if std::env::var("LOCUS_FUSE_TRANSPORT").as_deref() == Ok("io-uring") {
        local
            .status_when("the ring reads to be counted", |s| ring_reads(s) >= 2)
            .await;
    } else {
        assert_eq!(ring_reads(&local.status()), 0);
    }

    // From replicas, n1 first (the mount says it runs on n1's host): n1's copy of the
    // second blob fails the check, n1 quarantines it, and n2 serves the chunk.
    let remote = m.mount("remote", "mixed@1", None, &["--labels", "host=h1"]);
    let (rel, want) = big[1];
    for _ in 0..3 {
        let got = std::fs::read(remote.path.join(rel)).unwrap();
        assert_eq!(blake3::hash(&got).to_hex().as_str(), want);
        drop_page_cache(&remote.path.join(rel));
    }
    assert_eq!(
        nodes[0].quarantined(),
        4,
        "n1 was asked first and caught its bad copy"
    );
    remote
        .status_when("the failover to be counted", |s| {
            s["totals"]["failovers"].as_u64() > Some(0)
        })
        .await;
    assert_same_tree(&src, &remote.path);
}

/// A node whose bytes are damaged on the wire (its replies pass a proxy that flips one
/// byte in every 256 KiB; its disk is fine, so it has nothing to quarantine): a remote
/// mount refuses the bad chunks and reads them from the other replica, and a node copying
/// from it keeps nothing wrong and gets the blob from the other replica instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_sends_wrong_bytes_is_passed_over_and_nothing_wrong_is_kept() {
    let h = Harness::new("mount-liar");
    let proxy = LyingProxy::start().await;
    let advertise = proxy.addr.to_string();
    let (m, nodes) = cluster(&h, 2, |i| {
        let mut o = NodeOpts::host(i);
        if i == 1 {
            o.extra = vec!["--advertise".into(), advertise.clone()];
        }
        o
    })
    .await;
    proxy.forward_to(nodes[0].grpc);
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let big = pseudo_random(41, 24 << 20);
    std::fs::write(src.join("big.bin"), &big).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    proxy.corrupt(true);

    // The mount says it runs on n1's host, so n1 (the liar) is asked first.
    let remote = m.mount("remote", "ds@1", None, &["--labels", "host=h1"]);
    let got = std::fs::read(remote.path.join("big.bin")).unwrap();
    assert!(got == big, "the mount returned wrong bytes");
    assert!(
        proxy.flipped() > 0,
        "the proxy damaged nothing: the test tested nothing"
    );
    let st = remote
        .status_when("the refused chunks to be counted", |s| {
            s["totals"]["corrupt_chunks"].as_u64() > Some(0) && s["totals"]["failovers"].as_u64() > Some(0)
        })
        .await;
    assert_eq!(st["totals"]["read_errors"], 0, "{st}");
    assert_eq!(nodes[0].quarantined(), 0, "n1's own copy is good");

    // A third node copying from the liar by name refuses what it got and keeps nothing;
    // asked to copy from anywhere, it ends with the right blob.
    let n3 = h.start_node("n3", &m, NodeOpts::host(3)).await;
    let blob = blake3::hash(&big).as_bytes().to_vec();
    let want = vec![nodepb::BlobRef {
        hash: blob.clone(),
        size: big.len() as u64,
        ..Default::default()
    }];
    let mut c = n3.client().await;
    let e = c
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: proxy.addr.to_string(),
            blobs: want.clone(),
            pin: false,
            chunk_size: locus_proto::DEFAULT_CHUNK_SIZE,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("hash"), "{e:?}");
    assert!(n3.blob_files().is_empty(), "n3 kept a blob it could not verify");
    let r = c
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: String::new(),
            blobs: want,
            pin: false,
            chunk_size: locus_proto::DEFAULT_CHUNK_SIZE,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.fetched, 1, "{r:?}");
    let files = n3.blob_files();
    let stored = files[&blake3::hash(&big).to_hex().to_string()].read();
    assert!(stored == big, "n3 stored wrong bytes");
}

/// What the kernel keeps in its page cache the mount lets go of: a file read twice with
/// the page cache dropped between is fetched from the node twice. What it does not keep
/// (O_DIRECT reads) the mount keeps: read again, nothing is fetched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_the_kernel_keeps_leave_the_mount_and_direct_reads_stay_cached() {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    assert!(drop_caches(), "dropping the page cache needs root");
    let h = Harness::new("mount-handed");
    let (m, _nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pseudo_random(43, 12 << 20);
    let len = data.len() as u64;
    std::fs::write(src.join("f.bin"), &data).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // No node on the mount's side: every byte comes over the network.
    let mnt = m.mount("remote", "ds@1", None, &[]);
    let path = mnt.path.join("f.bin");
    let total = |s: &serde_json::Value, k: &str| s["totals"][k].as_u64().unwrap_or(0);

    assert!(std::fs::read(&path).unwrap() == data);
    assert!(drop_caches());
    assert!(std::fs::read(&path).unwrap() == data);
    mnt.status_when("the second read fetched every byte again", |s| {
        total(s, "bytes_remote") >= 2 * len
    })
    .await;

    let direct = || {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let mut v = vec![0u8; (1 << 20) + 4096];
        let at = v.as_ptr().align_offset(4096);
        let mut got = Vec::new();
        loop {
            let n = f.read(&mut v[at..at + (1 << 20)]).unwrap();
            if n == 0 {
                return got;
            }
            got.extend_from_slice(&v[at..at + n]);
        }
    };
    assert!(direct() == data, "O_DIRECT reads the file's bytes");
    mnt.status_when("the direct read fetched it", |s| {
        total(s, "bytes_remote") >= 3 * len
    })
    .await;
    // The status file is rewritten every 2 s: let it settle on the first direct read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = mnt.status();
    assert!(direct() == data);
    let after = mnt
        .status_when("the second direct read served from the mount's cache", |s| {
            total(s, "bytes_cache") >= total(&before, "bytes_cache") + len
        })
        .await;
    assert_eq!(
        total(&after, "bytes_remote"),
        total(&before, "bytes_remote"),
        "nothing was fetched again: {after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_no_source_can_serve_fails_with_eio_and_bad_mounts_are_refused() {
    let h = Harness::new("mount-errors");
    let (m, mut nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 30);
    let out = import(&m, "mixed", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Refusals, each a clear message and a non-zero exit.
    let (_, o) = m.try_mount("nope", "no-such-dataset", None, &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no-such-dataset"), "{}", stderr(&o));
    let (_, o) = m.try_mount("nope2", "mixed@7", None, &[]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("mixed@7") || stderr(&o).contains("version 7"),
        "{}",
        stderr(&o)
    );
    let o = m.cli(&["mount", "mixed", h.path("missing-dir").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
    let o = m.cli(&["mount", "../etc", h.path("x").to_str().unwrap()]);
    assert!(!o.status.success());

    let mnt = m.mount("mnt", "mixed", None, &[]);
    let o = m.cli(&["mount", "mixed", mnt.path.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("busy"), "{}", stderr(&o));
    let o = m.cli(&["umount", h.path("src").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a Locus mount"), "{}", stderr(&o));

    // The only replica dies: the version's origin (the import source) serves, verified.
    let files = nonempty_files(&src);
    let got = std::fs::read(mnt.path.join(&files[0].0)).unwrap();
    assert_eq!(blake3::hash(&got).to_hex().as_str(), files[0].1);
    nodes[0].daemon.kill9();
    let got = std::fs::read(mnt.path.join(&files[1].0)).unwrap();
    assert_eq!(
        blake3::hash(&got).to_hex().as_str(),
        files[1].1,
        "read from the origin"
    );
    mnt.status_when("origin bytes to be counted", |s| {
        s["totals"]["bytes_origin"].as_u64() > Some(0)
    })
    .await;
    let listing = walk(&src, false);
    // A source file changed since the import: EIO, never the new bytes.
    let changed = src.join(&files[2].0);
    let mut bytes = std::fs::read(&changed).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&changed, &bytes).unwrap();
    let e = std::fs::read(mnt.path.join(&files[2].0)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // No node and no origin: EIO, never zeros or short data.
    std::fs::rename(&src, h.path("src-gone")).unwrap();
    let e = std::fs::read(mnt.path.join(&files[3].0)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // Metadata still answers: the namespace is in memory.
    assert_eq!(walk(&mnt.path, false), listing);
    mnt.status_when("the failed read to be counted", |s| {
        s["totals"]["read_errors"].as_u64() > Some(0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_metadata_service_costs_a_reader_one_timeout_then_the_origin_serves() {
    let h = Harness::new("mount-hung-meta");
    let (m, mut nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    make_tree(&src, 30);
    let out = import(&m, "mixed", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mnt = m.mount("mnt", "mixed", None, &[]);
    let files = nonempty_files(&src);
    let got = std::fs::read(mnt.path.join(&files[0].0)).unwrap();
    assert_eq!(blake3::hash(&got).to_hex().as_str(), files[0].1);

    // The only replica dies and the metadata service hangs: a read asks where the blob
    // went now, gives up on the silent service after the mount's source timeout, and
    // reads the version's origin instead of waiting forever.
    nodes[0].daemon.kill9();
    m.daemon.sigstop();
    let (p, want) = (mnt.path.join(&files[1].0), files[1].1.clone());
    let reader = std::thread::spawn(move || std::fs::read(&p).map_err(|e| e.to_string()));
    // Without a bound of its own, the call would end only when HTTP/2 keep-alive gave
    // up on the connection (30 s + 20 s).
    wait_until(
        "the read to finish while the metadata service hangs",
        Duration::from_secs(40),
        || async { reader.is_finished().then_some(()) },
    )
    .await;
    m.daemon.sigcont();
    let got = reader.join().unwrap().unwrap();
    assert_eq!(blake3::hash(&got).to_hex().as_str(), want, "read from the origin");
}

/// Peak and current resident memory of a process, in bytes (VmHWM, VmRSS).
fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (kib("VmHWM:"), kib("VmRSS:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_remote_readers_keep_the_mount_within_its_memory_budget() {
    let h = Harness::new("mount-64-readers");
    let (m, _nodes) = cluster(&h, 1, NodeOpts::host).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..64u64 {
        std::fs::write(src.join(format!("f{i:02}.bin")), pseudo_random(i, 8 << 20)).unwrap();
    }
    let out = m.cli(&[
        "dataset",
        "import",
        "many",
        src.to_str().unwrap(),
        "--replicas",
        "1",
        "--chunk-size",
        "1MiB",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // 16 MiB of chunk cache; 8 MiB of read-ahead per reader, 32 MiB over all of them.
    let mnt = m.mount(
        "many",
        "many@1",
        None,
        &["--cache-size", "16MiB", "--readahead", "8MiB"],
    );
    let pid = mnt.pid();
    let (_, before) = memory_of(pid);
    let readers: Vec<_> = (0..64u64)
        .map(|i| {
            let p = mnt.path.join(format!("f{i:02}.bin"));
            std::thread::spawn(move || {
                let mut f = std::fs::File::open(&p).unwrap();
                let mut buf = vec![0u8; 1 << 20];
                let mut h = blake3::Hasher::new();
                loop {
                    let n = std::io::Read::read(&mut f, &mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                }
                (i, h.finalize())
            })
        })
        .collect();
    for r in readers {
        let (i, got) = tokio::task::spawn_blocking(move || r.join().unwrap())
            .await
            .unwrap();
        assert_eq!(got, blake3::hash(&pseudo_random(i, 8 << 20)), "file {i}");
    }
    let (peak, _) = memory_of(pid);
    // Each reader alone would keep its 8 MiB window in flight: 512 MiB for 64 of them.
    // The budget instead: 16 MiB of chunk cache, 32 MiB of read-ahead (4 × 8 MiB), 32 MiB
    // of fetches readers wait on, the node connection's 64 MiB HTTP/2 window, and 128 MiB
    // for the runtime and the allocator's free lists.
    let budget = (16 + 32 + 32 + 64 + 128) << 20;
    let grew = peak.saturating_sub(before);
    assert!(
        grew < budget,
        "the mount grew by {} MiB reading with 64 readers (budget {} MiB)",
        grew >> 20,
        budget >> 20
    );
    eprintln!("64 readers: the mount grew by {} MiB", grew >> 20);
}

/// The mount's runtime dir (status files, logs) has a predictable name: one planted by
/// someone else — a symlink, a directory of another user's, one others may write in — is
/// refused, nothing is written through it; and a token given on the command line does
/// not reach the background mount's argv, which any user can read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_runtime_dir_is_refused_and_the_token_stays_out_of_the_process_list() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new("mount-hygiene");
    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                tokens: tokens(),
                ..Default::default()
            },
        )
        .await;
    let node = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 10);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let reader = m.token("reader").unwrap();

    let victim = h.path("victim");
    std::fs::create_dir_all(&victim).unwrap();
    let planted = h.path("planted");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let foreign = h.path("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    let open = h.path("open");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mp = h.path("mp");
    std::fs::create_dir_all(&mp).unwrap();
    for (dir, why) in [
        (&planted, "it is a symlink"),
        (&foreign, "belongs to uid 65534"),
        (&open, "others may write in it"),
    ] {
        let out = std::process::Command::new(locus())
            .args(["mount", "ds@1"])
            .arg(&mp)
            .env("LOCUS_METADATA", m.url())
            .env("LOCUS_TOKEN", &reader)
            .env("LOCUS_RUNTIME_DIR", dir)
            .output()
            .unwrap();
        assert!(!out.status.success(), "mounted with {}", dir.display());
        assert!(stderr(&out).contains(why), "{}", stderr(&out));
    }
    assert_eq!(
        std::fs::read_dir(&victim).unwrap().count(),
        0,
        "written through the symlink"
    );

    // A token on the command line is refused before anything starts (argv is
    // world-readable); from a private file the background mount works, and its argv
    // lacks the token.
    let (_, out) = m.try_mount("withflag", "ds@1", Some(&node), &["--token", &reader]);
    assert!(!out.status.success(), "a token in argv was accepted");
    assert!(stderr(&out).contains("process list"), "{}", stderr(&out));
    let tf = h.path("reader-token");
    std::fs::write(&tf, &reader).unwrap();
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mnt = m.mount(
        "withfile",
        "ds@1",
        Some(&node),
        &["--token-file", tf.to_str().unwrap()],
    );
    assert_same_tree(&src, &mnt.path);
    let pid = mnt.status()["pid"].as_u64().unwrap();
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        !String::from_utf8_lossy(&argv).contains(&reader),
        "the token is in the mount's argv"
    );
    let runtime = std::fs::metadata(&mnt.runtime_dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(runtime, 0o700, "{runtime:o}");
}

/// A version committed before versions carried a sealed namespace (by an older Locus, or
/// restored from a catalogue it wrote) cannot be mounted until `locus dataset seal` gives
/// it one; after that it mounts and reads back exactly, and sealing again changes nothing.
/// The old version is made by stripping a fresh one's namespace from the service's
/// RocksDB while the service is stopped, as the old format had it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_from_before_sealed_namespaces_mounts_once_sealed() {
    use locus_metadata::store::{Batch, KvStore, RocksStore, Table};
    use prost::Message;

    let h = Harness::new("seal-old");
    let mut m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 60);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The old format: no namespace fields, no namespace row among the first shard's blobs.
    m.terminate().await;
    {
        let db = RocksStore::open(&m.data_dir.join("db")).unwrap();
        let key = locus_metadata::keys::version("ds", 1);
        let mut v = locus_metadata::records::VersionRecord::decode(
            &db.get(Table::Versions, &key)
                .unwrap()
                .expect("ds@1 is in the catalogue")[..],
        )
        .unwrap();
        assert!(!v.namespace_blob.is_empty(), "a fresh import is sealed");
        let ns: [u8; 32] = v.namespace_blob[..].try_into().unwrap();
        let mut b = Batch::default();
        let (from, to) = locus_metadata::keys::uid_range(v.uid);
        let mut dropped = 0;
        for kv in db.scan(Table::ShardBlobs, &from, Some(&to)) {
            let (k, _) = kv.unwrap();
            if k.ends_with(&ns) {
                let shard = locus_metadata::keys::shard_id(&k).unwrap();
                b.delete(Table::ShardBlobs, &k);
                b.delete(
                    Table::BlobShards,
                    locus_metadata::keys::blob_shard(&ns, v.uid, shard),
                );
                dropped += 1;
            }
        }
        assert_eq!(dropped, 1, "the namespace is one blob of the first shard");
        v.namespace_blob.clear();
        v.namespace_size = 0;
        v.namespace_inline.clear();
        v.namespace_chunks.clear();
        b.put(Table::Versions, key, v.encode_to_vec());
        db.write(b, true).unwrap();
    }
    m.restart().await;

    // Refused with the way out, and `dataset show` says the same.
    let (_unsealed, o) = m.try_mount("mnt", "ds@1", Some(&n1), &[]);
    assert!(!o.status.success(), "an unsealed version must not mount");
    assert!(stderr(&o).contains("locus dataset seal ds@1"), "{}", stderr(&o));
    let show = m.cli(&["dataset", "show", "ds@1"]);
    assert!(
        stdout(&show).contains("locus dataset seal ds@1"),
        "{}",
        stdout(&show)
    );

    let o = m.cli(&["dataset", "seal", "ds@1", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["sealed_now"], true, "{j}");
    assert_eq!(j["namespace"]["blob"].as_str().map(str::len), Some(64), "{j}");
    let o = m.cli(&["dataset", "seal", "ds@1", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let again: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(again["sealed_now"], false, "sealing twice does nothing");
    assert_eq!(again["namespace"], j["namespace"]);

    let mnt = m.mount("mnt2", "ds@1", Some(&n1), &[]);
    assert_eq!(walk(&mnt.path, false), walk(&src, false), "the same tree");
    for (rel, want) in nonempty_files(&src) {
        let got = std::fs::read(mnt.path.join(&rel)).unwrap();
        assert_eq!(blake3::hash(&got).to_hex().as_str(), want, "{}", rel.display());
    }
}

/// A mount started in-process by the one library call (`locus_fuse::start::start`) from
/// its options: it serves every file of the version, and reads its replica locations
/// again as often as `replica_refresh` says. Both mounts here have no local node and
/// learn the version's replicas (all on n1) at start; n1 is then drained onto n2 and
/// killed, and the version's origin deleted. Both read every file back from n2, but the
/// mount refreshing every second goes there first, with no failed read, while the one
/// told to refresh hourly still tries the dead n1 first and has to ask where the blobs
/// are now. Bad starts are refused for their reason: an unknown dataset as a load error
/// (NOT_FOUND), a missing mountpoint as a mount error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_started_by_one_call_serves_every_file_and_refreshes_replicas_as_its_options_say() {
    use locus_fuse::start::{start, MountOptions, StartError};
    let h = Harness::new("mount-start");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 120);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let want = nonempty_files(&src);
    let place = || locus_fuse::Place {
        host: "elsewhere".into(),
        ..Default::default()
    };
    let io_uring = std::env::var("LOCUS_FUSE_TRANSPORT").is_ok_and(|t| t == "io-uring");
    let mount = |name: &str, refresh: Duration| {
        let mp = h.path(name);
        std::fs::create_dir_all(&mp).unwrap();
        let mut o = MountOptions::new("ds", mp, place());
        o.token = m.token("admin");
        o.replica_refresh = refresh;
        o.io_uring = io_uring;
        o
    };
    let mut client = m.client(m.token("admin").map(|_| "admin")).await;
    let fresh = start(&mut client, mount("fresh", Duration::from_secs(1)), None, None)
        .await
        .unwrap_or_else(|e| panic!("mount (needs /dev/fuse and root): {e}"));
    let stale = start(&mut client, mount("stale", Duration::from_secs(3600)), None, None)
        .await
        .unwrap();
    assert_eq!(fresh.transport(), if io_uring { "io_uring" } else { "/dev/fuse" });
    assert_eq!(fresh.version.version, 1);
    let (fresh_mp, stale_mp) = (h.path("fresh"), h.path("stale"));

    let out = m.cli(&["node", "drain", "n1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_moved_off_to(&m, "ds", "n1", 1).await;
    n1.daemon.kill9();
    std::fs::remove_dir_all(&src).unwrap();
    // A few refreshes of the fresh mount (one a second), with room for a busy machine.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let bad = tokio::task::spawn_blocking(move || {
        let mut bad = Vec::new();
        for mp in [&fresh_mp, &stale_mp] {
            for (rel, hash) in &want {
                match std::fs::read(mp.join(rel)) {
                    Ok(b) if blake3::hash(&b).to_hex().as_str() == hash.as_str() => {}
                    Ok(_) => bad.push(format!("{}: wrong bytes", mp.join(rel).display())),
                    Err(e) => bad.push(format!("{}: {e}", mp.join(rel).display())),
                }
            }
        }
        bad
    })
    .await
    .unwrap();
    assert!(bad.is_empty(), "not read back identical: {bad:?}");
    let (f, st) = (fresh.metrics.totals(), stale.metrics.totals());
    assert!(f.bytes_remote > 0 && st.bytes_remote > 0);
    assert_eq!(
        (f.bytes_origin, st.bytes_origin),
        (0, 0),
        "the origin was deleted"
    );
    assert_eq!(f.failovers, 0, "the refreshed mount went to n2 first");
    assert!(st.failovers > 0, "the stale mount tried the dead n1 first");
    for s in [fresh, stale] {
        let session = s.session;
        tokio::task::spawn_blocking(move || session.umount_and_join())
            .await
            .unwrap()
            .unwrap();
    }

    let mut o = mount("none", Duration::from_secs(30));
    o.dataset = "no-such-dataset".into();
    match start(&mut client, o, None, None).await {
        Err(StartError::Load(locus_fuse::LoadError::Status(s))) => {
            assert_eq!(s.code(), tonic::Code::NotFound, "{s:?}")
        }
        Err(e) => panic!("an unknown dataset is a load error: {e}"),
        Ok(_) => panic!("an unknown dataset mounted"),
    }
    let mut o = mount("gone", Duration::from_secs(30));
    o.mountpoint = h.path("not-there");
    match start(&mut client, o, None, None).await {
        Err(e @ StartError::Mount { .. }) => assert!(e.to_string().contains("not-there"), "{e}"),
        Err(e) => panic!("a missing mountpoint is a mount error: {e}"),
        Ok(_) => panic!("mounted on a directory that does not exist"),
    }
}

/// A version holds more files than a mount keeps open (a quarter of its descriptor
/// limit): a job's second pass within the reopen window finds most of its files closed
/// for room. It opens them again from the paths the node listed with their shard (only
/// the file whose open had the shard listed, never listed itself, may be asked for
/// alone); before, each went to the node alone (`EnsureLocal`,
/// which hashes the blob again), and such a pass over 7,000 cold small files ran at
/// 0.35–0.44× raw against 0.6–0.8× for the first (bench/RESULTS.md session 25).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pass_over_more_files_than_the_mount_keeps_open_reopens_them_from_the_paths_the_node_listed()
{
    let h = Harness::new("mount-room");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..200u64)
        .map(|i| (format!("f{i:03}.bin"), pseudo_random(7_000 + i, 20_000)))
        .collect();
    for (name, data) in &files {
        std::fs::write(src.join(name), data).unwrap();
    }
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A limit of 128 descriptors: the mount keeps 32 files open.
    let mnt = m.mount_with_nofile("m", "ds@1", Some(&n1), &[], 128);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", mnt.server_pid())).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(" 128 ")),
        "{limits}"
    );

    // Every read is a request the mount answers from the node's file (O_DIRECT: the page
    // cache holds nothing for it).
    let pass = || {
        for (name, data) in &files {
            let got = read_direct(&mnt.path.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(got == *data, "{name}: wrong bytes");
        }
    };
    pass();
    let asked = (
        counter(&n1, "locus_node_ensure_local_total").await,
        counter(&n1, "locus_node_local_paths_total").await,
    );
    assert!(asked.1 >= 1, "the first pass listed no shard: {asked:?}");
    pass();
    let again = (
        counter(&n1, "locus_node_ensure_local_total").await - asked.0,
        counter(&n1, "locus_node_local_paths_total").await - asked.1,
    );
    // The file whose open had the shard listed was never listed itself: it may be
    // asked for again, alone.
    assert!(
        again.0 <= 1 && again.1 == 0,
        "the second pass asked the node {} times for single files and listed {} shards again",
        again.0,
        again.1
    );
}

/// Under FUSE over io_uring, a small file the node holds is read from the disk from its
/// LOOKUP on, and its READ takes those bytes (the reader's wait for the disk starts
/// earlier); a walk that only looks files up stops reading ahead after a few dozen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_files_are_read_ahead_from_their_lookup_and_a_walk_that_only_stats_stops_it() {
    let _on = EnableUring::set(true);
    let h = Harness::new("mount-ahead");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    let files: Vec<(String, Vec<u8>)> = (0..300u64)
        .map(|i| {
            let dir = if i < 100 { "read" } else { "stat" };
            (format!("{dir}/f{i:03}.bin"), pseudo_random(9_000 + i, 20_000))
        })
        .collect();
    for (name, data) in &files {
        let p = src.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let metrics = format!("127.0.0.1:{}", free_low_port());
    let mnt = m.mount(
        "m",
        "ds@1",
        Some(&n1),
        &["--fuse-transport", "io-uring", "--metrics-listen", &metrics],
    );
    assert_eq!(mnt.status()["transport"].as_str(), Some("io_uring"));
    let total = |s: &serde_json::Value, k: &str| s["totals"][k].as_u64().unwrap_or(0);

    // The node's packs out of the page cache: each file's bytes come from the disk.
    assert!(drop_caches(), "dropping the page cache needs root");
    for (name, data) in &files[..100] {
        let got = std::fs::read(mnt.path.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == *data, "{name}: wrong bytes");
    }
    let s = mnt
        .status_when("most reads took bytes read ahead", |s| {
            total(s, "read_aheads_taken") >= 80
        })
        .await;
    let before = total(&s, "read_aheads_started");
    // The same counts for Prometheus.
    let scraped = http_get(metrics.parse().unwrap(), "/metrics").await;
    let metric = |outcome: &str| -> u64 {
        let name = format!("locus_mount_read_aheads_total{{outcome=\"{outcome}\"}} ");
        let line = scraped.lines().find(|l| l.starts_with(&name));
        line.and_then(|l| l[name.len()..].trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name}in:\n{scraped}"))
    };
    assert!(metric("taken") >= 80, "{scraped}");
    assert!(metric("started") >= metric("taken"), "{scraped}");

    // Only lookups: what is read ahead goes untaken, and the gate closes.
    for (name, _) in &files[100..] {
        std::fs::metadata(mnt.path.join(name)).unwrap();
    }
    let s = mnt
        .status_when("the walk's totals", |s| total(s, "lookups") >= 300)
        .await;
    let during = total(&s, "read_aheads_started") - before;
    assert!(
        during <= 60,
        "{during} of 200 files looked up only were read ahead: {s}"
    );
}
