//! The node's outgoing streams: a local blob streamed to a reader or a peer (verified
//! chunk by chunk, read on blocking threads one piece at a time), and one blob uploaded
//! to a backup target from that same verified read.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::nodepb;
use locus_proto::BlobHash;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::{to_status, STREAM_PIECE};
use crate::store::BlobStore;

pub(super) type BlobStream = Pin<Box<dyn Stream<Item = Result<nodepb::BlobData, Status>> + Send>>;

/// Streams `[offset, offset+len)` of a local blob, verified chunk by chunk. Each piece is
/// read on a blocking thread and handed over on the async side; a reader that takes
/// nothing for `idle` loses the stream.
pub fn stream_blob(store: Arc<BlobStore>, h: BlobHash, offset: u64, len: u64, idle: Duration) -> BlobStream {
    let (tx, rx) = mpsc::channel::<Result<nodepb::BlobData, Status>>(1);
    tokio::spawn(async move {
        let st = store.clone();
        let opened = tokio::task::spawn_blocking(move || st.open_reader(&h, offset, len)).await;
        let mut reader = match opened {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let _ = tx.send(Err(to_status(e))).await;
                return;
            }
            Err(e) => {
                let _ = tx
                    .send(Err(Status::internal(format!("read task failed: {e}"))))
                    .await;
                return;
            }
        };
        loop {
            let next = tokio::task::spawn_blocking(move || {
                let piece = reader.next_piece();
                (reader, piece)
            })
            .await;
            let piece = match next {
                Ok((r, piece)) => {
                    reader = r;
                    piece
                }
                Err(e) => {
                    let _ = tx
                        .send(Err(Status::internal(format!("read task failed: {e}"))))
                        .await;
                    return;
                }
            };
            let buf = match piece {
                Ok(Some(buf)) => bytes::Bytes::from(buf),
                Ok(None) => return,
                Err(e) => {
                    let _ = tx.send(Err(to_status(e))).await;
                    return;
                }
            };
            // One verified buffer, sliced into messages without copying; the next is read
            // only once the reader has taken all of this one.
            let mut at = 0;
            while at < buf.len() {
                let to = (at + STREAM_PIECE).min(buf.len());
                let msg = Ok(nodepb::BlobData {
                    data: buf.slice(at..to),
                });
                match tokio::time::timeout(idle, tx.send(msg)).await {
                    Ok(Ok(())) => at = to,
                    Ok(Err(_)) => return, // the reader went away
                    Err(_) => {
                        tracing::debug!(blob = %h, "a reader took nothing for {idle:?}; closing its stream");
                        return;
                    }
                }
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Longest an UploadBlobs stream stays silent while blobs are being uploaded.
pub(super) const UPLOAD_ALIVE: Duration = Duration::from_secs(5);

/// How long a backup upload may stop taking bytes before the node gives up on it.
const UPLOAD_IDLE: Duration = Duration::from_secs(120);

/// Uploads one local blob to a backup target: Ok(false) when the target already had it.
/// The bytes come from the store's verified read (a corrupt local copy fails with
/// DATA_LOSS before anything is sent) and are hashed again on the way out.
pub(super) async fn upload_one(
    store: &Arc<BlobStore>,
    target: &locus_backup::Target,
    h: BlobHash,
    size: u64,
    skip_existing: bool,
) -> Result<bool, Status> {
    // The data stream fails only on this node's copy (corrupt, gone), and a hash mismatch
    // of what was sent is this copy's fault too: DATA_LOSS, and another replica is asked.
    // Anything else is the target's.
    let unavailable = |e: locus_backup::BackupError| match e {
        locus_backup::BackupError::Corrupt(m) | locus_backup::BackupError::Invalid(m) => Status::data_loss(m),
        e => Status::unavailable(e.to_string()),
    };
    if skip_existing
        && locus_backup::blob::exists(target, &h, size)
            .await
            .map_err(unavailable)?
    {
        return Ok(false);
    }
    let data = stream_blob(store.clone(), h, 0, 0, UPLOAD_IDLE)
        .map(|r| r.map(|d| d.data).map_err(|s| s.message().to_string()));
    locus_backup::blob::upload(target, &h, size, data)
        .await
        .map_err(unavailable)?;
    Ok(true)
}
