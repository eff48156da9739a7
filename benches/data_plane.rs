//! CPU per MiB of moving blob bytes between processes: what a remote byte costs both ends,
//! judged against a plain TCP copy plus one BLAKE3 pass measured in the same run.
//!
//! One metadata service and one cache node n0 holding `LOCUS_BENCH_MIB` MiB (default
//! 1024) in 4 files; everything on loopback (on a shared 2-core machine throughput
//! measures CPU, so CPU time per MiB of every process involved is the figure). Each
//! round, with the page cache dropped before each part:
//! - reference: the blob files sent over one loopback TCP connection with `sendfile`,
//!   received 4 MiB at a time into a reused buffer (two threads of this process, each
//!   end the CPU of its own thread), the least of three cold tries; and one BLAKE3 pass
//!   over the same bytes on one thread;
//! - remote read, bulk path and gRPC (`LOCUS_BULK=off`): a fresh mount with no local
//!   node reads every file once in 1 MiB reads; CPU of n0 and of the mount process;
//! - peer copy: a fresh node copies every blob from n0 (FetchBlobs: verified, written and
//!   fsynced); CPU of both nodes.
//!
//! First, once: random 64 KiB and 4 KiB reads through a mount with no local node, bytes
//! the node served per byte read and the median latency, at 4 MiB and 64 KiB chunks.
//! Then, per round (part `import`): `locus dataset import` of a fresh local directory of
//! the same size (new bytes each round, so nothing is already on the node), files read
//! cold; CPU of the CLI (from the rusage of its children) and of n0, against the
//! reference measured over the same files in the same round.
//!
//! Run:
//!
//!     cargo bench --bench data_plane
//!     LOCUS_BENCH_MIB=1024 LOCUS_BENCH_ROUNDS=3 cargo bench --bench data_plane
//!     LOCUS_BENCH_PARTS=copy cargo bench --bench data_plane     # any of read,copy,random,outboard
//!     LOCUS_BENCH_MOUNT_ARGS="--cache-size 256MiB" cargo bench --bench data_plane
//!
//! Needs root to drop the page cache (without it the figures are warm, and say so), and
//! to stop a virtual machine's free page reporting for the run (`SteadyMemory`; its
//! first step touches `LOCUS_BENCH_PRETOUCH_MIB`, default 6 GiB, once).

use locus_testkit as support;

use std::path::PathBuf;

use locus_proto::nodepb;
use support::*;

fn ms_per_mib(cpu: f64, bytes: u64) -> f64 {
    cpu * 1000.0 / (bytes as f64 / (1 << 20) as f64)
}

/// Blob bytes node `n` has served so far (its read_bytes counter).
async fn served(n: &Node) -> u64 {
    counter(n, "locus_node_read_bytes_total").await
}

/// Of those, bytes sent over the bulk path.
async fn bulk_sent(n: &Node) -> u64 {
    counter(n, "locus_node_bulk_sent_bytes_total").await
}

/// Checks a part took the path its row names: every byte over the bulk path, or none.
fn took_path(name: &str, bulk: bool, bulk_bytes: u64, total: u64) {
    match bulk {
        true => assert!(
            bulk_bytes >= total,
            "{name}: {bulk_bytes} of {total} bytes over the bulk path"
        ),
        false => assert_eq!(bulk_bytes, 0, "{name}: bytes went over the bulk path"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    // Before anything is measured, and for the whole run: memory freed by one part must
    // not be charged to the next (`SteadyMemory`).
    let _memory = SteadyMemory::hold();
    let mib = env_u64("LOCUS_BENCH_MIB", 1024);
    let rounds = env_u64("LOCUS_BENCH_ROUNDS", 3);
    // E.g. "--cache-size 256MiB": with the default 1 GiB chunk cache a 1 GiB read fills
    // fresh memory throughout (a page fault per 4 KiB); a smaller cache is recycled, as
    // in a long job's steady state.
    let mount_args_s = std::env::var("LOCUS_BENCH_MOUNT_ARGS").unwrap_or_default();
    let mount_args: Vec<&str> = mount_args_s.split_whitespace().collect();
    let files = 4usize;
    let each = ((mib as usize) << 20) / files;

    let h = Harness::new("bench-data-plane");
    let src = h.path("src");
    write_random_files(&src, "part-", files, each, 4100);
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let n0 = h
        .start_node("n0", &m, NodeOpts::host(0).with_capacity("64GiB"))
        .await;
    let out = m.cli(&[
        "dataset",
        "import",
        "ds",
        src.to_str().unwrap(),
        "--replicas",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The data files' blobs (the version's namespace is a blob too).
    let mut blobs = n0.blob_files();
    blobs.retain(|_, b| b.size == each as u64);
    let blob_paths: Vec<PathBuf> = blobs.values().map(|b| b.path.clone()).collect();
    let total: u64 = blobs.values().map(|b| b.size).sum();
    assert_eq!(total, (each * files) as u64);
    let cold = drop_caches();
    println!(
        "\ndata_plane: {} MiB in {files} files, one node, loopback; mount flags {mount_args:?}; page cache {}\n",
        total >> 20,
        if cold {
            "dropped before each part"
        } else {
            "NOT dropped (not root): warm figures"
        }
    );
    println!("| round | part | CPU ms/MiB: sender | receiver | both | × reference |");
    println!("|---|---|---|---|---|---|");

    let mut rows: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    let parts =
        std::env::var("LOCUS_BENCH_PARTS").unwrap_or_else(|_| "read,copy,random,outboard,import".into());
    // Before the rounds: the copy part's nodes stay registered for a while after they
    // stop, and an import would place blobs on them.
    if parts.contains("random") {
        random_reads(&m, &n0, &src, files, each as u64).await;
    }
    if parts.contains("import") {
        for round in 1..=rounds {
            let (reference, bulk, grpc) = import_cpu(&h, &m, &n0, round, files, each).await;
            rows.entry("reference (import rounds)")
                .or_default()
                .push(reference);
            rows.entry("import, bulk path")
                .or_default()
                .push(bulk / reference);
            rows.entry("import, WriteBlob")
                .or_default()
                .push(grpc / reference);
        }
    }
    for round in 1..=rounds {
        let (got, tcp, tcp_receiver) = cold_tcp_copy_cpu(&blob_paths, 3);
        assert_eq!(got, total);
        let b3 = blake3_cpu(&blob_paths);
        let reference = ms_per_mib(tcp + b3, total);
        println!(
            "| {round} | reference: TCP copy (sendfile → recv) {:.3} + BLAKE3 {:.3} | {:.3} | {:.3} + {:.3} | {reference:.3} | 1.00× |",
            ms_per_mib(tcp, total),
            ms_per_mib(b3, total),
            ms_per_mib(tcp - tcp_receiver, total),
            ms_per_mib(tcp_receiver, total),
            ms_per_mib(b3, total),
        );
        rows.entry("reference").or_default().push(reference);

        for (name, bulk) in [("remote read, bulk path", true), ("remote read, gRPC", false)] {
            if !parts.contains("read") {
                break;
            }
            drop_caches();
            let mnt = m.mount_with_env(
                &format!("r{round}-{bulk}"),
                "ds@1",
                None,
                &mount_args,
                &switch(bulk),
            );
            let paths: Vec<PathBuf> = (0..files)
                .map(|i| mnt.path.join(format!("part-{i:03}.bin")))
                .collect();
            let (np, mp) = (n0.daemon.pid(), mnt.server_pid());
            let sent_before = served(&n0).await;
            let bulk_before = bulk_sent(&n0).await;
            let perf = profile(&format!("data-plane-{round}-{bulk}"));
            let (n_before, m_before) = (cpu_seconds(np), cpu_seconds(mp));
            let (b, t) = read_sequentially(&paths);
            assert_eq!(b, total);
            let (n_cpu, m_cpu) = (cpu_seconds(np) - n_before, cpu_seconds(mp) - m_before);
            stop_profile(perf);
            let moved = served(&n0).await - sent_before;
            took_path(name, bulk, bulk_sent(&n0).await - bulk_before, total);
            drop(mnt);
            let both = ms_per_mib(n_cpu + m_cpu, total);
            if std::env::var_os("LOCUS_BENCH_PERF").is_some() {
                println!("(node pid {np}, mount pid {mp})");
            }
            println!(
                "| {round} | {name} ({:.0} MiB/s, {:.2}× the bytes read moved) | {:.3} | {:.3} | {both:.3} | {:.2}× |",
                mbs(b, t),
                moved as f64 / total as f64,
                ms_per_mib(n_cpu, total),
                ms_per_mib(m_cpu, total),
                both / reference
            );
            rows.entry(name).or_default().push(both / reference);
        }

        for (name, bulk) in [("peer copy, bulk path", true), ("peer copy, gRPC", false)] {
            if !parts.contains("copy") {
                break;
            }
            let mut opts = NodeOpts::host(1).with_capacity("64GiB");
            opts.env = switch(bulk)
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let n1 = h
                .start_node(&format!("c{round}{}", if bulk { "b" } else { "g" }), &m, opts)
                .await;
            drop_caches();
            let (p0, p1) = (n0.daemon.pid(), n1.daemon.pid());
            let perf = profile(&format!("data-plane-copy-{round}-{bulk}"));
            if std::env::var_os("LOCUS_BENCH_PERF").is_some() {
                println!("(source pid {p0}, copying node pid {p1})");
            }
            let (b0, b1) = (cpu_seconds(p0), cpu_seconds(p1));
            let bulk_before = bulk_sent(&n0).await;
            let t = std::time::Instant::now();
            let r = n1
                .client()
                .await
                .fetch_blobs(nodepb::FetchBlobsRequest {
                    source: n0.address(),
                    blobs: blobs
                        .iter()
                        .map(|(hex, b)| nodepb::BlobRef {
                            hash: locus_proto::BlobHash::from_hex(hex).unwrap().0.to_vec(),
                            size: b.size,
                            origin_path: String::new(),
                        })
                        .collect(),
                    pin: true,
                    ..Default::default()
                })
                .await
                .expect("FetchBlobs")
                .into_inner();
            let took = t.elapsed();
            assert_eq!(r.bytes, total);
            let (c0, c1) = (cpu_seconds(p0) - b0, cpu_seconds(p1) - b1);
            stop_profile(perf);
            took_path(name, bulk, bulk_sent(&n0).await - bulk_before, total);
            drop(n1);
            let both = ms_per_mib(c0 + c1, total);
            println!(
                "| {round} | {name} ({:.0} MiB/s) | {:.3} | {:.3} | {both:.3} | {:.2}× |",
                mbs(total, took),
                ms_per_mib(c0, total),
                ms_per_mib(c1, total),
                both / reference
            );
            rows.entry(name).or_default().push(both / reference);
        }
    }
    if parts.contains("outboard") {
        let (ob, per_mib) = outboard_cpu(&blob_paths);
        let plain = blake3_cpu(&blob_paths);
        println!(
            "\none pass computing root and outboard (16 KiB groups): {:.3} ms/MiB, {per_mib:.0} outboard bytes per MiB; plain BLAKE3 in the same run: {:.3} ms/MiB",
            ms_per_mib(ob, total),
            ms_per_mib(plain, total)
        );
    }
    println!("\nmedians over {rounds} rounds:");
    for (k, v) in rows {
        if k.starts_with("reference") {
            println!("- {k}: {:.3} ms/MiB", median(v));
        } else {
            println!("- {k}: {:.2}× the reference", median(v));
        }
    }
    drop(n0);
    drop(m);
}

/// Random reads from a mount with no local node: `LOCUS_BENCH_RANDOM` (default 200)
/// reads of 64 KiB and as many of 4 KiB at random offsets, the reader's read-ahead off
/// (`POSIX_FADV_RANDOM`), page cache dropped first; bytes the node sent (data, proofs,
/// framing) per byte read,
/// and the median latency. Once with the dataset as imported (4 MiB chunks), once
/// imported again with 64 KiB chunks: the chunk is the unit a mount fetches and verifies.
async fn random_reads(m: &Metadata, n0: &Node, src: &std::path::Path, files: usize, each: u64) {
    use std::os::unix::fs::FileExt;
    let count = env_u64("LOCUS_BENCH_RANDOM", 200) as usize;
    let out = m.cli(&[
        "dataset",
        "import",
        "ds64k",
        src.to_str().unwrap(),
        "--replicas",
        "1",
        "--chunk-size",
        "64KiB",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    println!("\n| dataset | read size | reads | bytes moved / bytes read | median latency |");
    println!("|---|---|---|---|---|");
    for (ds, chunk) in [("ds@1", "4 MiB chunks"), ("ds64k@1", "64 KiB chunks")] {
        for size in [64usize << 10, 4 << 10] {
            drop_caches();
            let mnt = m.mount(&format!("random-{}-{size}", &ds[..ds.len() - 2]), ds, None, &[]);
            let opened: Vec<std::fs::File> = (0..files)
                .map(|i| std::fs::File::open(mnt.path.join(format!("part-{i:03}.bin"))).unwrap())
                .collect();
            for f in &opened {
                let _ = nix::fcntl::posix_fadvise(f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_RANDOM);
            }
            let before = bulk_sent(n0).await;
            let served_before = served(n0).await;
            let mut buf = vec![0u8; size];
            let mut lat = Vec::with_capacity(count);
            let mut x = 0x2545f4914f6cdd1du64;
            for _ in 0..count {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let f = &opened[(x % files as u64) as usize];
                let at = (x >> 8) % (each - size as u64);
                let t = std::time::Instant::now();
                f.read_exact_at(&mut buf, at).unwrap();
                lat.push(t.elapsed().as_secs_f64() * 1e3);
            }
            // Everything the node sent over the bulk path: ranges' proofs and framing too.
            let moved = bulk_sent(n0).await - before;
            assert!(
                served(n0).await - served_before <= moved,
                "some reads went over gRPC: not what this measures"
            );
            drop(opened);
            drop(mnt);
            println!(
                "| {chunk} | {} KiB | {count} | {:.1}× | {:.2} ms |",
                size >> 10,
                moved as f64 / (count * size) as f64,
                median(lat)
            );
        }
    }
}

/// One round of the import part: fresh files (so the node holds none of them), the
/// reference over them, then `locus dataset import` of them with the page cache dropped,
/// over the bulk path; then the same over WriteBlob streams (`LOCUS_BULK=off`) with
/// other fresh files of the same sizes. Returns the reference's CPU ms/MiB and each
/// import's (CLI + node).
async fn import_cpu(
    h: &Harness,
    m: &Metadata,
    n0: &Node,
    round: u64,
    files: usize,
    each: usize,
) -> (f64, f64, f64) {
    let total = (files * each) as u64;
    let fresh = |k: u64| {
        let dir = h.path(&format!("import-{round}-{k}"));
        write_random_files(&dir, "part-", files, each, 9000 + 100 * round + 10 * k);
        dir
    };
    let dir = fresh(0);
    let paths: Vec<PathBuf> = (0..files).map(|i| dir.join(format!("part-{i:03}.bin"))).collect();
    let (got, tcp, tcp_receiver) = cold_tcp_copy_cpu(&paths, 3);
    assert_eq!(got, total);
    let b3 = blake3_cpu(&paths);
    let reference = ms_per_mib(tcp + b3, total);
    println!(
        "| {round} | reference over the import's files: TCP copy {:.3} + BLAKE3 {:.3} | {:.3} | {:.3} + {:.3} | {reference:.3} | 1.00× |",
        ms_per_mib(tcp, total),
        ms_per_mib(b3, total),
        ms_per_mib(tcp - tcp_receiver, total),
        ms_per_mib(tcp_receiver, total),
        ms_per_mib(b3, total),
    );
    let mut figures = Vec::new();
    for (k, bulk) in [(0, true), (1, false)] {
        let dir = if k == 0 { dir.clone() } else { fresh(k) };
        drop_caches();
        let (np, mp) = (n0.daemon.pid(), m.pid());
        let (n_before, m_before, c_before) = (cpu_seconds(np), cpu_seconds(mp), children_cpu_seconds());
        let received = counter(n0, "locus_node_bulk_received_bytes_total").await;
        let t = std::time::Instant::now();
        let env: Vec<(&str, String)> = switch(bulk)
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect();
        let out = m.cli_env(
            &[
                "dataset",
                "import",
                &format!("imported-{round}-{k}"),
                dir.to_str().unwrap(),
                "--replicas",
                "1",
            ],
            &env,
        );
        let took = t.elapsed();
        assert!(out.status.success(), "{}", stderr(&out));
        let (n_cpu, m_cpu, c_cpu) = (
            cpu_seconds(np) - n_before,
            cpu_seconds(mp) - m_before,
            children_cpu_seconds() - c_before,
        );
        let received = counter(n0, "locus_node_bulk_received_bytes_total").await - received;
        took_path("import", bulk, received, total);
        let both = ms_per_mib(c_cpu + n_cpu, total);
        println!(
            "| {round} | import from a local directory, {} ({:.0} MiB/s; metadata service {:.3}) | CLI {:.3} | node {:.3} | {both:.3} | {:.2}× |",
            if bulk { "bulk path" } else { "WriteBlob" },
            mbs(total, took),
            ms_per_mib(m_cpu, total),
            ms_per_mib(c_cpu, total),
            ms_per_mib(n_cpu, total),
            both / reference
        );
        figures.push(both);
        let _ = std::fs::remove_dir_all(&dir);
    }
    (reference, figures[0], figures[1])
}

/// The environment that makes a client process use the bulk path or not (it reads
/// `LOCUS_BULK` at start).
fn switch(bulk: bool) -> Vec<(&'static str, &'static str)> {
    match bulk {
        true => vec![],
        false => vec![(locus_proto::bulk::ENV_SWITCH, "off")],
    }
}
