//! Whole-system throughput of the data path, with its physical references measured in the
//! same run:
//!
//! - import (`locus dataset import`, hashing + placement + upload + commit) of 1 GiB of
//!   large files into a local cluster, against min(b3sum of the same files, raw write of
//!   the same bytes with fsync to the same disk);
//! - peer-to-peer transfer (a node's FetchBlobs from another node, verified and fsynced),
//!   against single-stream loopback TCP (iperf3).
//!
//! Run: `cargo bench --bench cluster_throughput` (1 GiB), or with `LOCUS_BENCH_MIB=2048`.
//!
//! Needs `b3sum` (cargo install b3sum) and `iperf3` (Debian) for the references; a missing
//! reference is reported as such, not guessed.

use locus_testkit as support;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use locus_proto::{nodepb, pb};
use support::*;

fn write_files(dir: &Path, seed: &str, files: usize, each: usize) -> Vec<std::path::PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    (0..files)
        .map(|i| {
            let p = dir.join(format!("part-{i:03}.bin"));
            let mut buf = vec![0u8; each];
            blake3::Hasher::new()
                .update(format!("{seed}{i}").as_bytes())
                .finalize_xof()
                .fill(&mut buf);
            std::fs::write(&p, &buf).unwrap();
            p
        })
        .collect()
}

fn raw_write_rate(dir: &Path, bytes: usize) -> f64 {
    let p = dir.join("raw-write.bin");
    let buf = vec![0x5au8; 4 << 20];
    let t = Instant::now();
    let mut f = std::fs::File::create(&p).unwrap();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        f.write_all(&buf[..n]).unwrap();
        left -= n;
    }
    f.sync_all().unwrap();
    let r = bytes as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&p);
    r
}

fn b3sum_rate(files: &[std::path::PathBuf], bytes: usize) -> Option<f64> {
    let t = Instant::now();
    let out = Command::new("b3sum").args(files).output().ok()?;
    out.status
        .success()
        .then(|| bytes as f64 / t.elapsed().as_secs_f64())
}

fn iperf3_rate() -> Option<f64> {
    let port = "5299";
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", port])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", port, "-t", "3", "-J"])
        .output()
        .ok();
    let _ = server.kill();
    let _ = server.wait();
    let j: serde_json::Value = serde_json::from_slice(&out?.stdout).ok()?;
    j["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| b / 8.0)
}

fn gbs(r: f64) -> String {
    format!("{:.2} GB/s", r / 1e9)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("cluster_throughput: bench");
        return;
    }
    let mib = env_u64("LOCUS_BENCH_MIB", 1024) as usize;
    let files = 8;
    let each = mib / files * (1 << 20);
    let bytes = each * files;
    let h = Harness::new("bench-cluster");

    let src1 = h.path("src-r1");
    let paths = write_files(&src1, "r1", files, each);
    let src2 = h.path("src-r2");
    write_files(&src2, "r2", files, each);
    let raw = raw_write_rate(&h.root, bytes);
    let b3 = b3sum_rate(&paths, bytes);

    let m = h
        .start_metadata(
            "meta",
            MetadataOpts {
                liveness_timeout: Some("30s"),
                ..Default::default()
            },
        )
        .await;
    let mut nodes = Vec::new();
    for i in 1..=3 {
        let mut o = NodeOpts::host(i);
        o.capacity = "64GiB";
        o.pin_sync = "1h";
        nodes.push(h.start_node(&format!("n{i}"), &m, o).await);
    }
    let import = |dir: &Path, name: &str, r: &str| {
        let t = Instant::now();
        let out = m.cli(&[
            "dataset",
            "import",
            name,
            dir.to_str().unwrap(),
            "--replicas",
            r,
            "--json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        (t.elapsed(), j)
    };
    let (t1, j1) = import(&src1, "bench-r1", "1");
    let (t2, _) = import(&src2, "bench-r2", "2");
    let imp1 = bytes as f64 / t1.as_secs_f64();
    let imp2 = bytes as f64 / t2.as_secs_f64();

    // Peer transfer: copy every blob of bench-r1 that n1 holds onto n3 (whatever n3
    // already has is skipped, so first drop nothing and count only fetched bytes).
    let mut c = m.client(None).await;
    let shards = c
        .list_shards(pb::ListShardsRequest {
            r#ref: Some(pb::VersionRef {
                dataset: "bench-r1".into(),
                version: 1,
            }),
            start: 0,
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .shards;
    let (_, entries) = locus_proto::client::list_all_entries(
        &mut c,
        pb::VersionRef {
            dataset: "bench-r1".into(),
            version: 1,
        },
        None,
        true,
    )
    .await
    .unwrap();
    let (from, to) = (&nodes[0], &nodes[2]);
    let on_from: std::collections::HashSet<u32> = shards
        .iter()
        .filter(|s| s.replicas.contains(&from.id))
        .map(|s| s.id)
        .collect();
    let blobs: Vec<nodepb::BlobRef> = entries
        .iter()
        .filter(|e| e.kind == pb::EntryKind::File as i32 && on_from.contains(&e.shard))
        .filter(|e| {
            !to.blob_files().contains_key(
                &blake3::Hash::from_bytes(e.blob.clone().try_into().unwrap())
                    .to_hex()
                    .to_string(),
            )
        })
        .map(|e| nodepb::BlobRef {
            hash: e.blob.clone(),
            size: e.size,
            ..Default::default()
        })
        .collect();
    let peer_bytes: u64 = blobs.iter().map(|b| b.size).sum();
    let mut tc = to.client().await;
    let t = Instant::now();
    let r = tc
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: from.grpc.to_string(),
            blobs,
            pin: false,
            chunk_size: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let peer = r.bytes as f64 / t.elapsed().as_secs_f64();
    assert_eq!(r.bytes, peer_bytes);

    // The transport alone: stream the same blobs from n1 (verified per chunk) and drop
    // them, no disk write on the receiving side.
    let mut fc = from.client().await;
    let t = Instant::now();
    let mut streamed = 0u64;
    for e in entries
        .iter()
        .filter(|e| e.kind == pb::EntryKind::File as i32 && on_from.contains(&e.shard))
    {
        let mut s = fc
            .read_blob(nodepb::ReadBlobRequest {
                hash: e.blob.clone(),
                offset: 0,
                length: 0,
            })
            .await
            .unwrap()
            .into_inner();
        while let Some(m) = tokio_stream::StreamExt::next(&mut s).await {
            streamed += m.unwrap().data.len() as u64;
        }
    }
    let stream_rate = streamed as f64 / t.elapsed().as_secs_f64();
    let tcp = iperf3_rate();

    let reference = match b3 {
        Some(b) => b.min(raw),
        None => raw,
    };
    println!();
    println!(
        "cluster_throughput: {} files of {} MiB ({} MiB), 3 nodes on one host, release build",
        files,
        each >> 20,
        bytes >> 20
    );
    println!("| measure | throughput | reference | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| import R=1 (hash {:.2}s, upload {:.2}s) | {} | min(b3sum {}, raw write {}) = {} | {:.2}× |",
        j1["hash_seconds"].as_f64().unwrap_or(0.0),
        j1["upload_seconds"].as_f64().unwrap_or(0.0),
        gbs(imp1),
        b3.map_or("not installed".into(), gbs),
        gbs(raw),
        gbs(reference),
        imp1 / reference
    );
    println!(
        "| import R=2 (twice the bytes written) | {} | same | {:.2}× |",
        gbs(imp2),
        imp2 / reference
    );
    match tcp {
        Some(t) => {
            println!(
                "| peer transfer ({} MiB, verified + fsynced) | {} | iperf3 one stream {} | {:.2}× (of raw write: {:.2}×) |",
                peer_bytes >> 20,
                gbs(peer),
                gbs(t),
                peer / t,
                peer / raw
            );
            println!(
                "| blob stream, no disk write ({} MiB, verified) | {} | iperf3 one stream {} | {:.2}× |",
                streamed >> 20,
                gbs(stream_rate),
                gbs(t),
                stream_rate / t
            );
        }
        None => println!(
            "| peer transfer ({} MiB) | {} | iperf3 not installed | - |",
            peer_bytes >> 20,
            gbs(peer)
        ),
    }
}
