//! Sending one blob to a node for an import: a local file or bytes in hand (an object the
//! client read) over the bulk path (WRITE); an object still in its store — or anything
//! for a node that does not take bulk writes — as a WriteBlob stream.

use std::sync::atomic::Ordering;

use locus_proto::client::NodeClient;
use locus_proto::grant::Op;
use locus_proto::nodepb;

use super::{BlobSource, GrpcCluster, NodeError, Upload};

impl GrpcCluster {
    /// Sends a local file or bytes in hand to the node over the bulk path
    /// (`bulk::Pool::write`: a file goes to the socket by `sendfile`, the node receives
    /// into its write blocks). None when the node is to be sent it over gRPC instead (an
    /// older build, TLS with no CA, `LOCUS_BULK=off`, an object still in its store).
    pub(super) async fn send_bulk(&self, node: &str, blob: &Upload) -> Result<Option<()>, NodeError> {
        use locus_proto::bulk::{Body, BulkError, WriteRequest};
        let file = match &blob.source {
            BlobSource::Local(path) => Some(
                tokio::fs::File::open(path)
                    .await
                    .map_err(|e| NodeError::Source(format!("cannot open {}: {e}", path.display())))?
                    .into_std()
                    .await,
            ),
            BlobSource::Memory(_) => None,
            BlobSource::Remote(_) => return Ok(None),
        };
        let body = match (&file, &blob.source) {
            (Some(f), _) => Body::File(f),
            (None, BlobSource::Memory(b)) => Body::Bytes(b),
            (None, _) => unreachable!("a file or bytes"),
        };
        let what = match &blob.source {
            BlobSource::Local(path) => path.display().to_string(),
            _ => format!("blob {}", blob.hash),
        };
        let addr = self.address(node).await?;
        let w = WriteRequest {
            hash: blob.hash,
            size: blob.size,
            chunk_size: blob.chunk_size,
            pin: true,
        };
        let done = blob.done.clone();
        let sent = move |n: u64| {
            done.fetch_add(n, Ordering::Relaxed);
        };
        let idle = locus_proto::net::peer_idle();
        match self
            .nodes
            .bulk_write(node, &addr, Op::Import, w, body, idle, &sent)
            .await
        {
            Ok(stored) => {
                if !stored {
                    // Here already: nothing went out, but the blob counts as done.
                    blob.done.fetch_add(blob.size, Ordering::Relaxed);
                }
                Ok(Some(()))
            }
            Err(BulkError::Unsupported(_)) => Ok(None),
            Err(BulkError::Grant(m)) => Err(NodeError::Grant(format!("node {node}: {m}"))),
            Err(BulkError::Full(m)) => Err(NodeError::Full(format!("node {node}: {m}"))),
            Err(BulkError::Unreachable(m)) => {
                self.nodes.failed(&addr);
                Err(NodeError::Unreachable(format!("node {node}: {m}")))
            }
            Err(BulkError::Refused(m) | BulkError::Missing(m) | BulkError::DataLoss(m)) => Err(
                NodeError::Rejected(format!("node {node} kept nothing of {what}: {m}")),
            ),
        }
    }
}

/// Streams one file or object to a node as a pinned blob; the node verifies it against `h`.
pub(super) async fn send_blob(node: &str, mut client: NodeClient, blob: Upload) -> Result<(), NodeError> {
    use futures_util::StreamExt;
    use nodepb::write_blob_message::Msg;
    use tokio::io::AsyncReadExt;
    let Upload {
        hash: h,
        size,
        chunk_size,
        source,
        store: remote,
        done,
    } = blob;
    let source = &source;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(nodepb::WriteBlobMessage {
        msg: Some(Msg::Header(nodepb::WriteBlobHeader {
            hash: h.0.to_vec(),
            size,
            chunk_size,
            pin: true,
        })),
    })
    .await
    .ok();
    let data = |b: bytes::Bytes| nodepb::WriteBlobMessage {
        msg: Some(Msg::Data(b)),
    };
    // Bytes of this blob handed to the node's stream.
    let moved = locus_proto::net::Progress::default();
    let moved2 = moved.clone();
    let done = {
        let total = done;
        move |n: u64| {
            total.fetch_add(n, Ordering::Relaxed);
            moved2.fetch_add(n, Ordering::Relaxed);
        }
    };
    // The reader ends early without error when the node ends the call (it had the blob,
    // or failed; the call's own result says which).
    let reader: tokio::task::JoinHandle<Result<(), String>> = match source {
        BlobSource::Local(path) => {
            let mut file = tokio::fs::File::open(path)
                .await
                .map_err(|e| NodeError::Source(format!("cannot open {}: {e}", path.display())))?;
            tokio::spawn(async move {
                loop {
                    // A fresh buffer per message, frozen and handed over without a copy.
                    let mut buf = bytes::BytesMut::with_capacity(2 << 20);
                    let n = file.read_buf(&mut buf).await.map_err(|e| e.to_string())?;
                    if n == 0 || tx.send(data(buf.freeze())).await.is_err() {
                        return Ok(());
                    }
                    done(n as u64);
                }
            })
        }
        BlobSource::Memory(bytes) => {
            let bytes = bytes.clone();
            tokio::spawn(async move {
                // Slices of the one buffer, no copies.
                let mut at = 0;
                while at < bytes.len() {
                    let to = (at + (2 << 20)).min(bytes.len());
                    if tx.send(data(bytes.slice(at..to))).await.is_err() {
                        return Ok(());
                    }
                    done((to - at) as u64);
                    at = to;
                }
                Ok(())
            })
        }
        BlobSource::Remote(path) => {
            let store = remote.ok_or(NodeError::Source("an object-store blob without its store".into()))?;
            let path = path.clone();
            tokio::spawn(async move {
                let s = crate::ops::remote::open_object(&store, &path)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut s = std::pin::pin!(s);
                while let Some(piece) = s.next().await {
                    let piece = piece.map_err(|e| format!("reading {path} failed: {e}"))?;
                    let n = piece.len() as u64;
                    if tx.send(data(piece)).await.is_err() {
                        break;
                    }
                    done(n);
                }
                Ok(())
            })
        }
    };
    // The node takes the bytes as fast as it stores them; one that takes none for the
    // peer timeout (hung, partitioned) fails this blob instead of the import waiting.
    let idle = locus_proto::net::peer_idle();
    let call = client.write_blob(tokio_stream::wrappers::ReceiverStream::new(rx));
    let resp = match locus_proto::net::until_idle(call, &moved, idle).await {
        Ok(r) => r,
        Err(()) => {
            reader.abort();
            return Err(NodeError::Unreachable(format!(
                "no bytes reached node {node} for {}s: it or the source is stalled (LOCUS_PEER_TIMEOUT)",
                idle.as_secs_f64()
            )));
        }
    };
    reader
        .await
        .map_err(|e| NodeError::Source(format!("reading the source failed: {e}")))?
        .map_err(NodeError::Source)?;
    resp.map(|_| ()).map_err(|s| NodeError::from_status(node, &s))
}
