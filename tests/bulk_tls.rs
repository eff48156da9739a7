//! The bulk path to nodes that serve TLS, end to end: real `locus node serve` processes
//! with certificates of one CA made by `locus tls`, mutual TLS on. Blob bytes go over the
//! bulk path inside TLS (never in clear, never without the caller's certificate), an
//! import, a mount with no local node and a peer copy take it, and the bytes are exactly
//! the blob's.

use locus_testkit as support;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use locus_proto::bulk::{self, BulkError, Pool};
use locus_proto::tls::rustls;
use locus_proto::{nodepb, BlobHash};
use support::*;

const IDLE: Duration = Duration::from_secs(10);

fn mtls() -> MetadataOpts {
    MetadataOpts {
        tokens: tokens(),
        mtls: true,
        ..Default::default()
    }
}

fn tls_node(i: usize) -> NodeOpts {
    let mut o = NodeOpts::host(i);
    o.tls = true;
    o
}

/// A counter in a TLS node's /metrics (its HTTP port serves TLS with the same CA).
fn tls_counter(m: &Metadata, n: &Node, name: &str) -> u64 {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(m.dir.join("ca.pem"))
        .arg(format!("https://127.0.0.1:{}/metrics", n.http.port()))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} is not in the node's metrics: {}", stderr(&out)))
}

/// A client config that trusts the cluster CA and presents no certificate.
fn no_certificate(m: &Metadata) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(m.dir.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(locus_proto::tls::provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_node_serves_blob_bytes_over_the_bulk_path_inside_tls_and_only_to_a_client_with_a_certificate()
{
    let h = Harness::new("bulk-tls");
    let (m, nodes) = cluster_with(&h, mtls(), 1, tls_node).await;
    let n = &nodes[0];
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pseudo_random(41, 3 << 20);
    std::fs::write(src.join("big.bin"), &data).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let hash = BlobHash(*blake3::hash(&data).as_bytes());

    // This test process trusts the cluster CA and presents the admin's certificate
    // (the harness set it): it speaks the bulk path to the https:// node.
    let addr = n.address();
    assert!(addr.starts_with("https://"), "{addr}");
    let pool = Pool::new();
    assert!(pool.speaks(&addr));
    let grant = m.grant("read", "*").await;
    let before = tls_counter(&m, n, "locus_node_bulk_sent_bytes_total");
    for (off, len) in [(0u64, 100u64), (65_000, 2 << 20), (1 << 20, 0)] {
        let r = pool
            .open(&addr, Some(&grant), &hash, off, len, IDLE)
            .await
            .unwrap();
        let end = if len == 0 { data.len() as u64 } else { off + len };
        let got = r.all().await.unwrap();
        assert_eq!(&got[..], &data[off as usize..end as usize], "range {off}+{len}");
    }
    // A verified range too (a random reader's request), checked against the blob's hash.
    let size = data.len() as u64;
    let rr = bulk::RangeRequest {
        hash,
        chunk_offset: 0,
        chunk_len: size,
        start: 1 << 20,
        end: (1 << 20) + (64 << 10),
    };
    let got = pool.range(&addr, Some(&grant), &rr, IDLE).await.unwrap();
    locus_proto::outboard::verify(&hash, size, rr.start, rr.end, &got.data, &got.proof)
        .expect("the range checks against the blob's hash");
    assert_eq!(&got.data[..], &data[1 << 20..(1 << 20) + (64 << 10)]);
    let sent = tls_counter(&m, n, "locus_node_bulk_sent_bytes_total") - before;
    assert!(
        sent >= 100 + (2 << 20) + (2 << 20) + (64 << 10),
        "the node counted {sent} bytes on the bulk path"
    );
    // Without a grant, inside TLS: refused as over plaintext.
    match pool.open(&addr, None, &hash, 0, 0, IDLE).await {
        Err(BulkError::Grant(_)) => {}
        other => panic!("no grant over TLS: {other:?}"),
    }

    // Mutual TLS: a client that trusts the CA but presents no certificate never gets a
    // bulk hello back, whatever grant it carries.
    let tcp = tokio::net::TcpStream::connect(n.grpc).await.unwrap();
    let mut tcp = tcp;
    tokio::io::AsyncWriteExt::write_all(&mut tcp, &bulk::MAGIC_TLS)
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let refused = match tokio_rustls::TlsConnector::from(no_certificate(&m))
        .connect(name, tcp)
        .await
    {
        // TLS 1.3: the client's side of the handshake ends before the server has
        // checked its certificate; the refusal comes as the first read.
        Ok(mut t) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut hello = bulk::MAGIC.to_vec();
            hello.extend_from_slice(&(grant.len() as u16).to_le_bytes());
            hello.extend_from_slice(grant.as_bytes());
            let _ = t.write_all(&hello).await;
            let _ = t.flush().await;
            let mut back = [0u8; 9];
            match tokio::time::timeout(IDLE, t.read_exact(&mut back)).await {
                Ok(Ok(_)) => panic!("a client with no certificate was answered {back:?}"),
                Ok(Err(e)) => e.to_string(),
                Err(_) => panic!("the node neither answered nor refused"),
            }
        }
        Err(e) => e.to_string(),
    };
    assert!(
        refused.to_lowercase().contains("certificate"),
        "refused for the wrong reason: {refused}"
    );

    // A bulk hello in clear to a TLS node is not served: it goes to gRPC, whose TLS
    // refuses it, and no MAGIC comes back.
    let mut s = std::net::TcpStream::connect(n.grpc).unwrap();
    s.set_read_timeout(Some(IDLE)).unwrap();
    // (The node may hang up before it has all of it.)
    let _ = s.write_all(&bulk::MAGIC);
    let _ = s.write_all(&(grant.len() as u16).to_le_bytes());
    let _ = s.write_all(grant.as_bytes());
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    assert!(
        !back.starts_with(&bulk::MAGIC),
        "a TLS node answered a bulk hello in clear"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_a_mount_and_a_peer_copy_take_the_bulk_path_to_and_between_tls_nodes() {
    let h = Harness::new("bulk-tls-mount");
    let (m, nodes) = cluster_with(&h, mtls(), 2, tls_node).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pseudo_random(43, 9 << 20);
    std::fs::write(src.join("big.bin"), &data).unwrap();
    let out = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let hash = BlobHash(*blake3::hash(&data).as_bytes());
    let holder = nodes
        .iter()
        .position(|n| n.blob_files().contains_key(&hash.to_hex()))
        .expect("a node holds the blob");
    let (src_node, other) = (&nodes[holder], &nodes[1 - holder]);
    // The import (this test's CLI trusts the CA and presents a certificate) wrote the
    // file to its node over the bulk path, inside TLS.
    let received = tls_counter(&m, src_node, "locus_node_bulk_received_bytes_total");
    assert!(
        received >= data.len() as u64,
        "the import sent {received} bytes over the bulk path, the file is {}",
        data.len()
    );

    // A mount with no local node reads the file from its holder, over the bulk path.
    let before = tls_counter(&m, src_node, "locus_node_bulk_sent_bytes_total");
    let mnt = m.mount("tls", "ds@1", None, &[]);
    assert_eq!(std::fs::read(mnt.path.join("big.bin")).unwrap(), data);
    drop(mnt);
    let sent = tls_counter(&m, src_node, "locus_node_bulk_sent_bytes_total") - before;
    assert!(
        sent >= data.len() as u64,
        "the mount's reads sent {sent} bytes over the bulk path, the file is {}",
        data.len()
    );

    // A peer copy (what repair, warm and refill do) between TLS nodes: verified, kept.
    let before = tls_counter(&m, src_node, "locus_node_bulk_sent_bytes_total");
    // What the service hands a node's caller for copies: an import grant for it.
    let g = m.grant("import", &other.id).await;
    let r = other
        .client_with(Some(&g))
        .await
        .fetch_blobs(nodepb::FetchBlobsRequest {
            source: src_node.address(),
            blobs: vec![nodepb::BlobRef {
                hash: hash.0.to_vec(),
                size: data.len() as u64,
                origin_path: String::new(),
            }],
            pin: true,
            ..Default::default()
        })
        .await
        .expect("FetchBlobs")
        .into_inner();
    assert_eq!(r.bytes, data.len() as u64);
    let sent = tls_counter(&m, src_node, "locus_node_bulk_sent_bytes_total") - before;
    assert!(
        sent >= data.len() as u64,
        "the peer copy moved {sent} bytes over the bulk path"
    );
    let copied = other.blob_files();
    let b = copied.get(&hash.to_hex()).expect("the copy is kept");
    assert_eq!(std::fs::read(&b.path).unwrap(), data);
}
