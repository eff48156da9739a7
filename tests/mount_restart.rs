//! Mounts that survive their process: the server of a mount is killed (`kill -9`) or
//! restarted in place (SIGHUP to the holder) under readers, who see a pause and no error.

use locus_testkit as support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::*;

fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Reads `p` in 64 KiB pieces, pausing between them, so its handle and some of its reads
/// are in the air whenever the server dies.
fn read_slowly(p: &Path, pause: Duration) -> std::io::Result<Vec<u8>> {
    let mut f = std::fs::File::open(p)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf[..n]);
        std::thread::sleep(pause);
    }
}

/// Waits until the mount has a live server other than `old`, and returns it.
/// Whole reads of `files` under `root`, each on a thread of its own and with O_DIRECT (so
/// each is a request the server must answer), checked against their hashes.
fn direct_reads(
    root: &Path,
    files: impl IntoIterator<Item = (PathBuf, String)>,
) -> Vec<std::thread::JoinHandle<Result<(), String>>> {
    files
        .into_iter()
        .map(|(rel, want)| {
            let p = root.join(rel);
            drop_page_cache(&p);
            std::thread::spawn(move || -> Result<(), String> {
                let data = read_direct(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                if blake3::hash(&data).to_hex().as_str() == want {
                    Ok(())
                } else {
                    Err(format!("{}: wrong bytes", p.display()))
                }
            })
        })
        .collect()
}

/// How many of `reads` still wait after 1.5 s.
async fn still_waiting(reads: &[std::thread::JoinHandle<Result<(), String>>]) -> usize {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    reads.iter().filter(|r| !r.is_finished()).count()
}

async fn new_server(m: &Mount, old: u32) -> u32 {
    wait_until("a new mount server", Duration::from_secs(20), || {
        let now = std::panic::catch_unwind(|| m.server_pid()).unwrap_or(old);
        async move { (now != old && alive(now)).then_some(now) }
    })
    .await
}

/// For `wait_until`: done once more than `n` reads were counted.
fn reads_past(reads: &Arc<AtomicU64>, n: u64) -> impl Fn() -> std::future::Ready<Option<()>> {
    let reads = reads.clone();
    move || std::future::ready((reads.load(Ordering::Relaxed) > n).then_some(()))
}

/// Stops readers that read until `stop` is set, waits for each to end (a request lost
/// with a dead server would leave its reader blocked for good) and returns what each
/// returned, panicking on the first that failed.
async fn finish_readers<T>(
    stop: &AtomicBool,
    readers: Vec<std::thread::JoinHandle<Result<T, String>>>,
) -> Vec<T> {
    stop.store(true, Ordering::Relaxed);
    wait_until("every reader to finish", Duration::from_secs(60), || async {
        readers.iter().all(|r| r.is_finished()).then_some(())
    })
    .await;
    readers
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.join()
                .unwrap()
                .unwrap_or_else(|e| panic!("reader {i} failed: {e}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_no_error_when_the_mount_server_is_killed_or_upgraded() {
    let h = Harness::new("mount-restart");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let _n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    let src = h.path("src");
    make_tree(&src, 200);
    std::fs::write(src.join("big-a.bin"), pseudo_random(7, 24 << 20)).unwrap();
    std::fs::write(src.join("big-b.bin"), pseudo_random(8, 24 << 20)).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Every way a mount reads: the kernel opening files itself, the mount passing local
    // files through to the kernel, and remote replicas with no local node.
    // Over /dev/fuse whatever the environment asks: under io_uring the kernel cannot
    // hand a dead server's requests to the next (see the test below).
    let dev = ["--fuse-transport", "dev-fuse"];
    let mounts = [
        // "latest" when mounted: a restarted server must still serve version 1.
        m.mount("kernel", "ds", Some(&n1), &["--opens", "kernel", dev[0], dev[1]]),
        m.mount(
            "passthrough",
            "ds@1",
            Some(&n1),
            &["--opens", "mount", "--passthrough-min-size", "0", dev[0], dev[1]],
        ),
        m.mount(
            "remote",
            "ds@1",
            None,
            &["--cache-size", "256KiB", dev[0], dev[1]],
        ),
    ];
    let roots: Vec<PathBuf> = mounts.iter().map(|m| m.path.clone()).collect();
    let files = Arc::new(nonempty_files(&src));
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    for r in 0..8usize {
        let root = roots[r % 3].clone();
        let (files, stop, reads) = (files.clone(), stop.clone(), reads.clone());
        readers.push(std::thread::spawn(move || -> Result<u64, String> {
            let mut i = r * 37;
            let mut done = 0;
            while !stop.load(Ordering::Relaxed) {
                // Two readers stay on the big files, slowly: their handles outlive servers.
                let (rel, want) = if r < 2 {
                    files
                        .iter()
                        .find(|(p, _)| p.ends_with(["big-a.bin", "big-b.bin"][i % 2]))
                        .unwrap()
                } else {
                    &files[i % files.len()]
                };
                let p = root.join(rel);
                drop_page_cache(&p);
                let pause = Duration::from_millis(if r < 2 { 2 } else { 0 });
                let data = read_slowly(&p, pause).map_err(|e| format!("{}: {e}", p.display()))?;
                if blake3::hash(&data).to_hex().as_str() != want {
                    return Err(format!("{}: wrong bytes", p.display()));
                }
                reads.fetch_add(1, Ordering::Relaxed);
                done += 1;
                i += 1;
            }
            Ok(done)
        }));
    }
    wait_until(
        "readers to get going",
        Duration::from_secs(30),
        reads_past(&reads, 100),
    )
    .await;

    // A version 2 in which every file differs, committed before the servers restart.
    let src2 = h.path("src2");
    make_tree(&src2, 200);
    for (i, (rel, _)) in nonempty_files(&src2).into_iter().enumerate() {
        let len = std::fs::metadata(src2.join(&rel)).unwrap().len() as usize;
        std::fs::write(src2.join(&rel), pseudo_random(10_000 + i as u64, len)).unwrap();
    }
    let out = import(&m, "ds", &src2, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A passthrough file held open across the restarts: its backing id must be the one
    // the next server uses for that file (the kernel refuses a second one while it is open).
    let want_a = files
        .iter()
        .find(|(p, _)| p.ends_with("big-a.bin"))
        .unwrap()
        .1
        .clone();
    let mut held = std::fs::File::open(mounts[1].path.join("big-a.bin")).unwrap();
    let mut held_bytes = vec![0u8; 1 << 20];
    held.read_exact(&mut held_bytes).unwrap();

    // kill -9 of every server, one mount after another, while all readers run.
    let holders: Vec<u32> = mounts.iter().map(|m| m.pid()).collect();
    for mnt in &mounts {
        let old = mnt.server_pid();
        assert_ne!(old, mnt.pid(), "the server is not its own holder");
        signal(old, "-KILL");
        let now = new_server(mnt, old).await;
        assert!(!alive(old));
        let at = reads.load(Ordering::Relaxed);
        wait_until(
            "readers to go on after the kill",
            Duration::from_secs(60),
            reads_past(&reads, at + 60),
        )
        .await;
        assert_ne!(now, old);
    }
    let again =
        std::fs::read(mounts[1].path.join("big-a.bin")).expect("reopen a file held open across the restart");
    assert_eq!(blake3::hash(&again).to_hex().as_str(), want_a);
    held.read_to_end(&mut held_bytes).unwrap();
    assert_eq!(blake3::hash(&held_bytes).to_hex().as_str(), want_a);

    // An upgrade in place: SIGHUP makes the holder start the server again from the
    // executable at its path.
    let pt = &mounts[1];
    let old = pt.server_pid();
    signal(pt.pid(), "-HUP");
    new_server(pt, old).await;
    let at = reads.load(Ordering::Relaxed);
    wait_until(
        "readers to go on after the upgrade",
        Duration::from_secs(60),
        reads_past(&reads, at + 60),
    )
    .await;

    for (i, n) in finish_readers(&stop, readers).await.into_iter().enumerate() {
        assert!(n > 0, "reader {i} read nothing");
    }
    // The holders never changed, and every mount still reads the version exactly.
    for (mnt, holder) in mounts.iter().zip(&holders) {
        assert_eq!(mnt.pid(), *holder);
        assert!(mnt.is_mounted());
        assert_same_tree(&src, &mnt.path);
        let log = std::fs::read_to_string(&mnt.log).unwrap();
        assert!(log.contains("took over the live mount"), "{log}");
        let st = mnt.status();
        assert_eq!(st["totals"]["read_errors"], 0, "{st}");
    }
    // The passthrough mount kept passing files through after taking over.
    assert_eq!(pt.status()["passthrough"], true);

    // Requests the server has read and not answered when it dies: with both nodes
    // stopped, reads through the remote mount wait inside the server; it is killed; the
    // next server gets those requests again from the kernel and answers them once the
    // nodes are back.
    let remote = &mounts[2];
    n1.daemon.sigstop();
    _n2.daemon.sigstop();
    let stuck = direct_reads(
        &remote.path,
        files
            .iter()
            .filter(|(p, _)| std::fs::metadata(src.join(p)).unwrap().len() > 100_000)
            .take(4)
            .cloned(),
    );
    let waiting = still_waiting(&stuck).await;
    assert!(waiting >= 2, "only {waiting} reads waited on the stopped nodes");
    let old = remote.server_pid();
    signal(old, "-KILL");
    new_server(remote, old).await;
    n1.daemon.sigcont();
    _n2.daemon.sigcont();
    wait_until(
        "the reads in flight at the kill to finish",
        Duration::from_secs(60),
        || async { stuck.iter().all(|r| r.is_finished()).then_some(()) },
    )
    .await;
    for r in stuck {
        r.join().unwrap().unwrap();
    }

    // SIGTERM to the holder still unmounts, and both processes end.
    let (holder, server) = (mounts[0].pid(), mounts[0].server_pid());
    signal(holder, "-TERM");
    wait_until("SIGTERM to unmount", Duration::from_secs(10), || async {
        (!mounts[0].is_mounted() && !alive(holder) && !alive(server)).then_some(())
    })
    .await;
    // `locus umount` of a mount whose server was replaced (it holds no unmount handle of
    // its own): unmounted, and both processes end.
    let (holder, server) = (mounts[2].pid(), mounts[2].server_pid());
    let u = mounts[2].umount();
    assert!(u.status.success(), "{}", stderr(&u));
    wait_until(
        "umount to end both processes",
        Duration::from_secs(10),
        || async { (!mounts[2].is_mounted() && !alive(holder) && !alive(server)).then_some(()) },
    )
    .await;
}

/// `fusermount3 -u`, `umount` and `umount -l` (what scripts, systemd and other tools run)
/// end a mount without `locus umount`'s wait for its processes; a new mount at the same
/// path made at once must outlive the exit of the old mount's holder and server, which
/// must touch nothing that is not theirs: not the new mount, not its status file. Ten
/// rounds, under a reader that keeps reading the path throughout: once the new mount is
/// up every read succeeds, and no read ever returns wrong bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remount_after_fusermount_u_umount_or_umount_l_is_not_torn_down_by_the_mount_that_ended() {
    let h = Harness::new("mount-remount");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 20);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let files: Vec<_> = nonempty_files(&src).into_iter().take(5).collect();

    // The reader: each read opens, reads whole and closes one file, and is logged with
    // when it started and ended and whether it had the right bytes.
    type Log = Vec<(std::time::Instant, std::time::Instant, Result<bool, String>)>;
    let log: Arc<std::sync::Mutex<Log>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mnt = h.path("mnt");
    let reader = {
        let (log, stop, files, mnt) = (log.clone(), stop.clone(), files.clone(), mnt.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for (rel, want) in &files {
                    let t = std::time::Instant::now();
                    let r = std::fs::read(mnt.join(rel))
                        .map(|b| blake3::hash(&b).to_hex().as_str() == want)
                        .map_err(|e| format!("{}: {e}", rel.display()));
                    log.lock().unwrap().push((t, std::time::Instant::now(), r));
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        })
    };

    for round in 0..10 {
        let how: &[&str] = match round % 3 {
            0 => &["fusermount3", "-u"],
            1 => &["umount"],
            _ => &["umount", "-l"],
        };
        let old = m.mount("mnt", "ds", Some(&n1), &[]);
        assert_eq!(old.path, mnt);
        let (old_holder, old_server) = (old.pid(), old.server_pid());
        // A plain unmount is refused (EBUSY) while the reader has a file open: again.
        let mut tries = 0;
        while !std::process::Command::new(how[0])
            .args(&how[1..])
            .arg(&old.path)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
            .success()
        {
            tries += 1;
            assert!(tries < 200, "round {round}: {how:?} kept failing");
            std::thread::sleep(Duration::from_millis(10));
        }
        // At once, before the old processes have noticed.
        let new = m.mount("mnt", "ds", Some(&n1), &[]);
        let new_holder = new.pid();
        assert_ne!(
            new_holder, old_holder,
            "round {round} ({how:?}): the status file names the new mount"
        );
        wait_until(
            "the old mount's processes to exit",
            Duration::from_secs(20),
            || async { (!alive(old_holder) && !alive(old_server)).then_some(()) },
        )
        .await;
        // Give a late tear-down time to happen, reading all along, then look.
        let up = std::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let looked = std::time::Instant::now();
        assert!(
            new.is_mounted(),
            "round {round} ({how:?}): the new mount was torn down by the old one"
        );
        assert_eq!(
            new.pid(),
            new_holder,
            "round {round} ({how:?}): the new mount's status file is its own"
        );
        {
            let log = log.lock().unwrap();
            let since: Vec<_> = log
                .iter()
                .filter(|(t, end, _)| *t >= up && *end <= looked)
                .collect();
            assert!(
                since.len() >= 5,
                "round {round}: the reader read {} files in 2 s",
                since.len()
            );
            for (_, _, r) in since {
                assert_eq!(r, &Ok(true), "round {round} ({how:?}): a read of the new mount");
            }
        }
        let o = new.umount();
        assert!(o.status.success(), "{}", stderr(&o));
        // Its Drop would unmount whatever is at the path now.
        std::mem::forget(old);
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let log = log.lock().unwrap();
    assert!(
        !log.iter().any(|(_, _, r)| r == &Ok(false)),
        "a read returned wrong bytes"
    );
}

/// `--fuse-transport io-uring`: on a kernel that does not offer it (the parameter off)
/// the mount serves through /dev/fuse and says so once; where it is on, requests come
/// through the rings, and a server killed under them is replaced: reads made while no
/// server runs (parked in the kernel's queues) are answered by the next server, byte for
/// byte, and so are reads the dead server held in its ring entries when it was killed
/// (the next server maps the entries' memory and answers them), and an upgrade in place
/// (SIGHUP) under readers that never stop fails none of their reads, nor does a freeze
/// that no restart follows (the server thaws). Reads that reach a
/// ring while its server crashes fail with ECANCELED, which no server can prevent
/// (docs/architecture.md). It switches the kernel parameter, so CI's io_uring pass
/// leaves it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_uring_falls_back_where_off_and_a_killed_server_is_replaced_where_on() {
    let h = Harness::new("mount-uring");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 120);
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let files = Arc::new(nonempty_files(&src));
    let ring = ["--fuse-transport", "io-uring", "--opens", "kernel"];

    {
        let _off = EnableUring::set(false);
        let mnt = m.mount("off", "ds", Some(&n1), &ring);
        assert_eq!(mnt.status()["transport"].as_str(), Some("/dev/fuse"));
        let (rel, want) = &files[0];
        let got = std::fs::read(mnt.path.join(rel)).unwrap();
        assert_eq!(blake3::hash(&got).to_hex().as_str(), want);
        let log = std::fs::read_to_string(&mnt.log).unwrap();
        assert_eq!(
            log.matches("FUSE over io_uring is not available here").count(),
            1,
            "said once: {log}"
        );
        let o = mnt.umount();
        assert!(o.status.success(), "{}", stderr(&o));
    }

    let _on = EnableUring::set(true);
    let mnt = m.mount("on", "ds", Some(&n1), &ring);
    assert_eq!(mnt.status()["transport"].as_str(), Some("io_uring"));
    for (rel, want) in files.iter() {
        let got = std::fs::read(mnt.path.join(rel)).unwrap();
        assert_eq!(blake3::hash(&got).to_hex().as_str(), want, "{}", rel.display());
    }
    for round in 0..3 {
        let old = mnt.server_pid();
        signal(old, "-9");
        // Readers start once the server is gone and before the next one runs: their
        // requests wait in the queue of the CPU they run on until the next server has
        // registered its entries. (A request the kernel hands a ring while its server is
        // dying fails with ECANCELED: docs/architecture.md.)
        wait_until(
            "the killed server to be gone",
            Duration::from_secs(10),
            || async { (!alive(old)).then_some(()) },
        )
        .await;
        let readers: Vec<_> = (0..4usize)
            .map(|r| {
                let (files, root) = (files.clone(), mnt.path.clone());
                std::thread::spawn(move || -> Result<usize, String> {
                    let mut n = 0;
                    for (rel, want) in files.iter().skip(r).step_by(4) {
                        let got =
                            read_direct(&root.join(rel)).map_err(|e| format!("{}: {e}", rel.display()))?;
                        if blake3::hash(&got).to_hex().as_str() != want {
                            return Err(format!("{}: wrong bytes", rel.display()));
                        }
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        new_server(&mnt, old).await;
        wait_until("every reader to finish", Duration::from_secs(60), || async {
            readers.iter().all(|r| r.is_finished()).then_some(())
        })
        .await;
        let read: usize = readers
            .into_iter()
            .map(|r| r.join().unwrap().unwrap_or_else(|e| panic!("round {round}: {e}")))
            .sum();
        assert_eq!(read, files.len(), "round {round}");
        let status = mnt.status();
        assert_eq!(status["transport"].as_str(), Some("io_uring"), "round {round}");
        // Each kill came to an idle server: every request its entries last had was
        // answered in the entry, so the next server sent those answers again and ran
        // none of the requests again (an OPEN run twice leaves a handle and a backing id
        // nobody releases; a RELEASE run twice would lower an open count twice).
        assert_eq!(
            (status["takeover_rerun"].as_u64(), status["server_pid"].as_u64()),
            (Some(0), Some(u64::from(mnt.server_pid()))),
            "round {round}: a request was run again: {status}"
        );
        assert!(
            status["takeover_resent"].as_u64() > Some(0),
            "round {round}: no answer of the killed server's was sent again: {status}"
        );
    }

    // A planned restart (SIGHUP to the holder: an upgrade in place) under readers that
    // never stop: the server freezes its queues, every free entry is filled before it is
    // killed, and the next answers what they hold, so no read fails, not even with the
    // ECANCELED a plain kill gives readers here.
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..4usize)
        .map(|r| {
            let (files, root, stop, reads) = (files.clone(), mnt.path.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut i = r * 7;
                while !stop.load(Ordering::Relaxed) {
                    let (rel, want) = &files[i % files.len()];
                    let got = read_direct(&root.join(rel)).map_err(|e| format!("{}: {e}", rel.display()))?;
                    if blake3::hash(&got).to_hex().as_str() != want {
                        return Err(format!("{}: wrong bytes", rel.display()));
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            })
        })
        .collect();
    wait_until(
        "readers to get going",
        Duration::from_secs(30),
        reads_past(&reads, 50),
    )
    .await;
    for round in 0..3 {
        let old = mnt.server_pid();
        signal(mnt.pid(), "-HUP");
        new_server(&mnt, old).await;
        let at = reads.load(Ordering::Relaxed);
        wait_until(
            &format!("readers to go on after restart {round}"),
            Duration::from_secs(60),
            reads_past(&reads, at + 50),
        )
        .await;
    }
    // A freeze nobody follows with a kill (the holder gone, or SIGUSR2 by hand): reads
    // stop while the server is frozen, and it thaws after 15 s and serves what reached
    // it meanwhile. Counted from once the server says it froze (and reads it was
    // already answering are done), as reads go on until the signal is taken.
    let freezes = || {
        std::fs::read_to_string(&mnt.log)
            .unwrap()
            .matches("freezing the io_uring queues for a restart")
            .count()
    };
    let before = freezes();
    signal(mnt.server_pid(), "-USR2");
    wait_until("the server to freeze", Duration::from_secs(10), || async {
        (freezes() > before).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let at = reads.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        reads.load(Ordering::Relaxed),
        at,
        "no read is answered while frozen"
    );
    wait_until(
        "readers to go on after a freeze nobody ended",
        Duration::from_secs(60),
        reads_past(&reads, at + 50),
    )
    .await;
    finish_readers(&stop, readers).await;
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(log.contains("frozen with every entry held"), "{log}");
    assert!(
        log.contains("nobody restarted this server: serving again"),
        "{log}"
    );
    assert!(
        !log.contains("did not freeze its io_uring queues in time"),
        "{log}"
    );
    let o = mnt.umount();
    assert!(o.status.success(), "{}", stderr(&o));

    // Reads the server holds when it is killed: through a mount with no local node, with
    // the only node stopped, each read waits inside the server in its ring entry. The
    // next server finds them in the entries' memory and answers them once the node is
    // back; nothing else reads meanwhile, so no request meets the dying rings.
    let remote = m.mount("held", "ds", None, &["--fuse-transport", "io-uring"]);
    assert_eq!(remote.status()["transport"].as_str(), Some("io_uring"));
    let big: Vec<_> = files
        .iter()
        .filter(|(p, _)| std::fs::metadata(src.join(p)).unwrap().len() > 50_000)
        .take(4)
        .cloned()
        .collect();
    assert_eq!(big.len(), 4, "the tree has files of more than 50 kB");
    n1.daemon.sigstop();
    let stuck = direct_reads(&remote.path, big);
    let waiting = still_waiting(&stuck).await;
    assert!(waiting >= 2, "only {waiting} reads waited on the stopped node");
    let old = remote.server_pid();
    signal(old, "-KILL");
    new_server(&remote, old).await;
    n1.daemon.sigcont();
    wait_until(
        "the reads the killed server held to be answered by the next",
        Duration::from_secs(60),
        || async { stuck.iter().all(|r| r.is_finished()).then_some(()) },
    )
    .await;
    for r in stuck {
        r.join().unwrap().unwrap();
    }
    let log = std::fs::read_to_string(&remote.log).unwrap();
    assert!(log.contains("requests a previous server held"), "{log}");
    let o = remote.umount();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Closes of a file by the last holder of it (IN_CLOSE_NOWRITE), watched with inotify.
struct CloseWatch {
    inotify: nix::sys::inotify::Inotify,
    names: Vec<(nix::sys::inotify::WatchDescriptor, String)>,
}

impl CloseWatch {
    fn new() -> CloseWatch {
        use nix::sys::inotify::{InitFlags, Inotify};
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify");
        CloseWatch {
            inotify,
            names: Vec::new(),
        }
    }

    fn watch(&mut self, path: &Path, name: &str) {
        let wd = self
            .inotify
            .add_watch(path, nix::sys::inotify::AddWatchFlags::IN_CLOSE_NOWRITE)
            .unwrap_or_else(|e| panic!("watch {}: {e}", path.display()));
        self.names.push((wd, name.to_string()));
    }

    /// Names of the watched files closed since the last call, waiting up to `wait` for
    /// the first.
    fn closed(&self, wait: Duration) -> Vec<String> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN)];
        let ms = PollTimeout::try_from(wait.as_millis() as i32).unwrap_or(PollTimeout::MAX);
        let _ = poll(&mut fds, ms);
        let mut out = Vec::new();
        while let Ok(events) = self.inotify.read_events() {
            for e in events {
                if let Some((_, name)) = self.names.iter().find(|(w, _)| *w == e.wd) {
                    out.push(name.clone());
                }
            }
        }
        out
    }
}

/// A cluster of one node holding `files` (name, seed, bytes; pseudo-random), imported
/// with one replica, and a mount of it on that node where every open asks the mount and
/// files of 1 MiB and more are passed through (`extra`: more mount arguments). Fields
/// drop in order, the harness last.
struct Passthrough {
    mnt: Mount,
    n1: Node,
    _m: Metadata,
    src: PathBuf,
    _h: Harness,
}

async fn passthrough_mount(name: &str, files: &[(&str, u64, usize)], extra: &[&str]) -> Passthrough {
    let h = Harness::new(name);
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    make_tree(&src, 20);
    for (file, seed, len) in files {
        std::fs::write(src.join(file), pseudo_random(*seed, *len)).unwrap();
    }
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut args = vec!["--opens", "mount", "--passthrough-min-size", "1MiB"];
    args.extend(extra);
    let mnt = m.mount("pt", "ds", Some(&n1), &args);
    Passthrough {
        mnt,
        n1,
        _m: m,
        src,
        _h: h,
    }
}

/// A server that takes a mount over closes the passthrough backing ids its predecessor
/// registered as soon as no file uses them: at takeover for a file that was opened and
/// closed (its id kept for reopens), and at the last release of a file held open across
/// the takeover, whose id the new server reused meanwhile (the kernel refuses a second
/// backing file for an inode in use). Before, every inherited id stayed registered for
/// the new server's life, pinning the node's blob files in the kernel. Seen from the
/// node's blob files: the kernel's last reference to each, dropped when its id is
/// closed, is their final close (inotify).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_over_mount_closes_the_backing_ids_no_file_uses_any_more() {
    let Passthrough { mnt, n1, src, .. } = &passthrough_mount(
        "mount-backing",
        &[("held.bin", 7, 4 << 20), ("closed.bin", 8, 4 << 20)],
        &[],
    )
    .await;
    let hash = |name: &str| {
        blake3::hash(&std::fs::read(src.join(name)).unwrap())
            .to_hex()
            .to_string()
    };
    let (held_hash, closed_hash) = (hash("held.bin"), hash("closed.bin"));
    let mut held = std::fs::File::open(mnt.path.join("held.bin")).unwrap();
    let mut first = vec![0u8; 1 << 20];
    held.read_exact(&mut first).unwrap();
    let closed = std::fs::read(mnt.path.join("closed.bin")).unwrap();
    assert_eq!(blake3::hash(&closed).to_hex().as_str(), closed_hash);
    assert_eq!(mnt.status()["passthrough"], true, "the files were passed through");

    let blobs = n1.blob_files();
    let mut w = CloseWatch::new();
    w.watch(&blobs[&held_hash].path, "held");
    w.watch(&blobs[&closed_hash].path, "closed");
    let old = mnt.server_pid();
    signal(old, "-KILL");
    new_server(mnt, old).await;
    let mut seen = w.closed(Duration::from_secs(10));
    // Anything else closing it late would show here too.
    seen.extend(w.closed(Duration::from_millis(500)));
    assert_eq!(
        seen,
        ["closed"],
        "the id of the file no longer open is closed at takeover, the held one's is not"
    );

    // The held file reads on through its inherited id. Once it is closed, the last file
    // the old server opened with that id is gone, and so is the id: what the holder
    // passes to the next server after another kill lists no backing id at all.
    let mut rest = Vec::new();
    held.read_to_end(&mut rest).unwrap();
    first.extend(rest);
    assert_eq!(blake3::hash(&first).to_hex().as_str(), held_hash);
    drop(held);
    let session = mnt
        .runtime_dir
        .join("mounts")
        .read_dir()
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.to_string_lossy()
                .ends_with(&format!(".{}.session.json", mnt.pid()))
        })
        .expect("the holder's session file");
    let mut state = serde_json::Value::Null;
    // The RELEASE reaches the server after close(2) returns: give it a moment, and the
    // next server another, should the kill come first (it is resent to that one).
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let old = mnt.server_pid();
        signal(old, "-KILL");
        new_server(mnt, old).await;
        state = serde_json::from_slice(&std::fs::read(&session).unwrap()).unwrap();
        if state["backing"].as_object().is_some_and(|b| b.is_empty()) {
            break;
        }
    }
    assert_eq!(
        state["backing"],
        serde_json::json!({}),
        "no backing id left: {state}"
    );
    assert!(
        state["open_counts"].as_u64().is_some(),
        "the counts are kept: {state}"
    );
    let again = std::fs::read(mnt.path.join("held.bin")).unwrap();
    assert_eq!(blake3::hash(&again).to_hex().as_str(), held_hash);
    let log = std::fs::read_to_string(&mnt.log).unwrap();
    assert!(log.contains("took over the live mount"), "{log}");
    let o = mnt.umount();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A handle the killed server issued and the kernel releases after the takeover leaves
/// the new server's own handles alone. Every server numbered its handles from 1, so the
/// new server's first passthrough handle (file Y) had the number of the old server's
/// still-open one (file X): X's RELEASE took Y's handle and its backing count with it,
/// closing Y's backing id while Y was open, and the next open of Y failed with EIO (the
/// kernel allows one backing file per inode in use, and refused the new one). With
/// `--reopen-cache 0s` no id is kept for reopens, so the count alone decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_handle_of_a_killed_server_leaves_the_new_servers_handles_alone() {
    let Passthrough { mnt, src, .. } = &passthrough_mount(
        "mount-fh",
        &[("x.bin", 21, 2 << 20), ("y.bin", 22, 2 << 20)],
        &["--reopen-cache", "0s"],
    )
    .await;
    let want_y = blake3::hash(&std::fs::read(src.join("y.bin")).unwrap());
    let x = std::fs::File::open(mnt.path.join("x.bin")).unwrap();
    let old = mnt.server_pid();
    signal(old, "-KILL");
    new_server(mnt, old).await;
    let mut y = std::fs::File::open(mnt.path.join("y.bin")).unwrap();
    assert_eq!(mnt.status()["passthrough"], true, "y is passed through");
    drop(x);
    // The RELEASE of x is answered asynchronously; give it time to land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again =
        std::fs::read(mnt.path.join("y.bin")).unwrap_or_else(|e| panic!("y opened again while open: {e}"));
    assert_eq!(blake3::hash(&again), want_y);
    let mut first = Vec::new();
    y.read_to_end(&mut first).unwrap();
    assert_eq!(blake3::hash(&first), want_y);
    drop(y);
    let o = mnt.umount();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Every file under `dir` out of the page cache.
fn drop_page_caches_under(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if e.file_type().unwrap().is_dir() {
            drop_page_caches_under(&p);
        } else {
            drop_page_cache(&p);
        }
    }
}

/// A READ waiting on the read ahead its file's LOOKUP started, when its server is
/// killed: the disk is made slow for the mount server alone (a block-I/O cgroup), so the
/// reads ahead are still in flight when the READs come and take them; the next server
/// finds the READs in their entries, runs them again and answers them, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_waiting_on_a_read_ahead_when_the_server_is_killed_is_answered_by_the_next() {
    let _on = EnableUring::set(true);
    let h = Harness::new("mount-ahead-kill");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    // Enough files for the node to keep them in a pack (the read ahead's kind of file).
    let files: Vec<(String, Vec<u8>)> = (0..24u64)
        .map(|i| (format!("f{i:02}.bin"), pseudo_random(7_100 + i, 40_000)))
        .collect();
    std::fs::create_dir_all(&src).unwrap();
    for (name, data) in &files {
        std::fs::write(src.join(name), data).unwrap();
    }
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", free_low_port()).parse().unwrap();
    let mnt = m.mount(
        "m",
        "ds@1",
        Some(&n1),
        &[
            "--fuse-transport",
            "io-uring",
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    assert_eq!(mnt.status()["transport"].as_str(), Some("io_uring"));
    let taken = || async move {
        let scraped = http_get(metrics, "/metrics").await;
        let name = "locus_mount_read_aheads_total{outcome=\"taken\"} ";
        let line = scraped.lines().find(|l| l.starts_with(name));
        line.and_then(|l| l[name.len()..].trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name}in:\n{scraped}"))
    };

    // The first open asks the node, which hands out the paths of the files around it:
    // the LOOKUPs of those read them ahead.
    let (first, want) = &files[0];
    assert!(
        std::fs::read(mnt.path.join(first)).unwrap() == *want,
        "{first}: wrong bytes"
    );
    // Only the node's files leave the page cache: a page the server faults in comes from
    // the slowed disk too (dropping every cache left the server crawling on its own
    // code's page faults), so its binary is read into the cache first.
    let old = mnt.server_pid();
    std::fs::read(format!("/proc/{old}/exe")).unwrap();
    drop_page_caches_under(&n1.data_dir);
    let slow = SlowDisk::new(&n1.data_dir, 1);
    slow.add(old);
    let readers: Vec<_> = files[1..7]
        .iter()
        .cloned()
        .map(|(name, want)| {
            let p = mnt.path.join(&name);
            std::thread::spawn(move || -> Result<(), String> {
                let got = std::fs::read(&p).map_err(|e| format!("{name}: {e}"))?;
                (got == want).then_some(()).ok_or(format!("{name}: wrong bytes"))
            })
        })
        .collect();
    // One read a second: the first read ahead may land at once, the others wait their
    // turn with their READs attached.
    wait_until(
        "READs to wait on reads ahead",
        Duration::from_secs(20),
        || async { (taken().await >= 3).then_some(()) },
    )
    .await;
    let waiting = readers.iter().filter(|r| !r.is_finished()).count();
    assert!(waiting >= 2, "only {waiting} readers still wait on a read ahead");
    signal(old, "-KILL");
    new_server(&mnt, old).await;
    wait_until(
        "the READs the killed server held to be answered by the next",
        Duration::from_secs(60),
        || async { readers.iter().all(|r| r.is_finished()).then_some(()) },
    )
    .await;
    for r in readers {
        r.join().unwrap().unwrap();
    }
    let status = mnt.status();
    eprintln!("after the takeover: {status}");
    assert!(
        status["takeover_rerun"].as_u64() >= Some(2),
        "the READs were not run again by the next server: {status}"
    );
    drop(slow);
    let o = mnt.umount();
    assert!(o.status.success(), "{}", stderr(&o));
}
