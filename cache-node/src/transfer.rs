//! Copying blobs into this node's store: from a peer's ReadBlob stream, from a backup
//! target, from the version's origin, or "from anywhere" (live replicas first, then
//! backups, then the origin when the caller named it), with an idle timeout on
//! every wait and an optional byte-rate limit shared by the copies that take it.
//!
//! Bytes reach the store through a [`Sink`]: it writes each received piece on a blocking
//! thread while the next one is being received, so the network and the disk overlap, and
//! it never holds a blocking thread while it waits for the network — a slow or silent
//! sender costs its idle timeout and nothing else. Nothing here makes a blob visible: the
//! store's writer verifies every chunk and the whole blob against its name first.

use std::sync::Arc;
use std::time::Duration;

use locus_proto::nodepb;
use locus_proto::BlobHash;
use tokio_stream::StreamExt;
use tonic::Status;

use crate::service::to_status;
use crate::store::{BlobStore, BlobWriter, Keep, StoreError, TeamId, WriteBlock};
use crate::{Peers, Sources};

/// A byte-rate budget shared by several copies (token bucket; a copy may run into debt by
/// one piece, then waits it off). `rate == 0` means unlimited.
#[derive(Debug)]
pub struct RateLimit {
    rate: u64,
    /// (when the budget was last topped up, bytes available — negative while in debt).
    state: std::sync::Mutex<(tokio::time::Instant, f64)>,
}

impl RateLimit {
    pub fn new(rate: u64) -> Self {
        Self {
            rate,
            state: std::sync::Mutex::new((tokio::time::Instant::now(), 0.0)),
        }
    }

    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Waits until `n` more bytes fit in the budget.
    pub async fn take(&self, n: u64) {
        if self.rate == 0 {
            return;
        }
        let wait = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = tokio::time::Instant::now();
            let rate = self.rate as f64;
            // A quarter second of burst: enough to keep a copy streaming, small enough
            // that the rate holds over any second.
            let burst = rate / 4.0;
            st.1 = (st.1 + now.duration_since(st.0).as_secs_f64() * rate).min(burst);
            st.0 = now;
            st.1 -= n as f64;
            if st.1 < 0.0 {
                Duration::from_secs_f64(-st.1 / rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Feeds a [`BlobWriter`] without parking a blocking thread between pieces: each piece is
/// written on a blocking thread while the caller receives the next.
pub struct Sink {
    state: SinkState,
}

type WriterAndBlock = (Box<BlobWriter>, Box<WriteBlock>);

enum SinkState {
    Idle(Box<BlobWriter>),
    Busy(tokio::task::JoinHandle<Result<Box<BlobWriter>, StoreError>>),
    /// Writing a block, which comes back with the writer for the next receive.
    BusyBlock(tokio::task::JoinHandle<Result<WriterAndBlock, StoreError>>),
    Failed,
}

impl Sink {
    pub fn new(w: BlobWriter) -> Self {
        Self {
            state: SinkState::Idle(Box::new(w)),
        }
    }

    async fn writer(&mut self) -> Result<Box<BlobWriter>, Status> {
        Ok(self.writer_and_block().await?.0)
    }

    /// The writer once it is idle, and the block it last wrote, if that was a block.
    async fn writer_and_block(&mut self) -> Result<(Box<BlobWriter>, Option<Box<WriteBlock>>), Status> {
        let failed = |e: tokio::task::JoinError| Status::internal(format!("write task failed: {e}"));
        match std::mem::replace(&mut self.state, SinkState::Failed) {
            SinkState::Idle(w) => Ok((w, None)),
            SinkState::Busy(j) => Ok((j.await.map_err(failed)?.map_err(to_status)?, None)),
            SinkState::BusyBlock(j) => {
                let (w, b) = j.await.map_err(failed)?.map_err(to_status)?;
                Ok((w, Some(b)))
            }
            SinkState::Failed => Err(Status::internal("the blob write failed earlier")),
        }
    }

    /// Waits for the previous write, then starts writing block `b` (filled straight
    /// from a socket); gives back the block written before, to be filled again.
    pub async fn write_block(&mut self, b: Box<WriteBlock>) -> Result<Option<Box<WriteBlock>>, Status> {
        let (mut w, free) = self.writer_and_block().await?;
        self.state = SinkState::BusyBlock(tokio::task::spawn_blocking(move || {
            w.write_block(&b)?;
            Ok((w, b))
        }));
        Ok(free)
    }

    /// Waits for the previous piece to be written, then starts writing this one.
    pub async fn write(&mut self, buf: bytes::Bytes) -> Result<(), Status> {
        let mut w = self.writer().await?;
        self.state = SinkState::Busy(tokio::task::spawn_blocking(move || {
            w.write(&buf)?;
            Ok(w)
        }));
        Ok(())
    }

    /// `write` for several pieces, written one after another in one blocking task.
    pub async fn write_all(&mut self, bufs: Vec<bytes::Bytes>) -> Result<(), Status> {
        let mut w = self.writer().await?;
        self.state = SinkState::Busy(tokio::task::spawn_blocking(move || {
            for b in &bufs {
                w.write(b)?;
            }
            Ok(w)
        }));
        Ok(())
    }

    /// Writes what is pending, then verifies and publishes the blob.
    pub async fn finish(self) -> Result<(), Status> {
        self.finish_stored().await.map(|_| ())
    }

    /// `finish`, saying what was stored.
    pub async fn finish_stored(mut self) -> Result<crate::store::Stored, Status> {
        let w = self.writer().await?;
        tokio::task::spawn_blocking(move || w.finish_stored())
            .await
            .map_err(|e| Status::internal(format!("write task failed: {e}")))?
            .map_err(to_status)
    }
}

/// Starts storing blob `h` (None if it is here already), off the async threads.
pub async fn begin_write(
    store: &Arc<BlobStore>,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    keep: Keep,
) -> Result<Option<BlobWriter>, Status> {
    let st = store.clone();
    tokio::task::spawn_blocking(move || st.begin_write(h, size, chunk_size, keep))
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(to_status)
}

/// Copies one blob from a backup target into the local store; the store's writer checks
/// every chunk and the whole blob against its name before it becomes visible.
pub async fn fetch_from_backup(
    store: &Arc<BlobStore>,
    target: &locus_backup::Target,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    keep: Keep,
    idle: Duration,
) -> Result<bool, Status> {
    let Some(writer) = begin_write(store, h, size, chunk_size, keep).await? else {
        return Ok(false);
    };
    let data = locus_backup::blob::read(target, &h)
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut data = std::pin::pin!(data);
    let mut sink = Sink::new(writer);
    loop {
        let piece = tokio::time::timeout(idle, data.next()).await.map_err(|_| {
            Status::unavailable(format!("{} sent nothing for {}s", target.url, idle.as_secs_f64()))
        })?;
        match piece {
            Some(Ok(b)) => sink.write(b).await?,
            Some(Err(e)) => {
                return Err(Status::unavailable(format!(
                    "reading blob {h} from {}: {e}",
                    target.url
                )))
            }
            None => break,
        }
    }
    sink.finish().await?;
    Ok(true)
}

/// Waits for a peer's next message, but not longer than `idle`: a peer that hangs (stopped,
/// wedged disk, network partition without resets) must fail the transfer, not stall it.
pub async fn next_within<T>(stream: &mut tonic::Streaming<T>, idle: Duration) -> Result<Option<T>, Status> {
    match tokio::time::timeout(idle, stream.next()).await {
        Ok(Some(Ok(m))) => Ok(Some(m)),
        Ok(Some(Err(s))) => Err(s),
        Ok(None) => Ok(None),
        Err(_) => Err(Status::unavailable(format!(
            "the peer sent nothing for {}s",
            idle.as_secs_f64()
        ))),
    }
}

/// Opens a ReadBlob stream, giving up after `idle` without an answer.
pub async fn open_read(
    peer: &mut locus_proto::client::NodeClient,
    req: nodepb::ReadBlobRequest,
    idle: Duration,
) -> Result<tonic::Streaming<nodepb::BlobData>, Status> {
    match tokio::time::timeout(idle, peer.read_blob(req)).await {
        Ok(r) => Ok(r?.into_inner()),
        Err(_) => Err(Status::unavailable(format!(
            "the peer did not answer for {}s",
            idle.as_secs_f64()
        ))),
    }
}

/// Copies one blob from the peer at `addr` into the local store, verifying it: over the
/// bulk path (the peer sends from its file, the bytes are received into the buffers the
/// store's writer hashes and writes), or over gRPC to a peer without it. Returns false
/// if it was already here. With `limit`, every piece is paid for before it is written.
#[allow(clippy::too_many_arguments)]
pub async fn fetch_from_peer(
    store: &Arc<BlobStore>,
    peers: &Peers,
    addr: &str,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    keep: Keep,
    idle: Duration,
    limit: Option<&RateLimit>,
) -> Result<bool, Status> {
    use locus_proto::bulk::BulkError;
    let mut reading = match peers.bulk_read(addr, &h, 0, 0, idle).await {
        Ok(r) => r,
        Err(BulkError::Unsupported(_)) => {
            let mut peer = peers.peer(addr, idle.min(CONNECT)).await?;
            return fetch_over_grpc(store, &mut peer, h, size, chunk_size, keep, idle, limit).await;
        }
        Err(e) => return Err(bulk_status(e)),
    };
    if reading.len() != size {
        return Err(Status::data_loss(format!(
            "the peer offers {} bytes of blob {h}, the manifest says {size}",
            reading.len()
        )));
    }
    let Some(writer) = begin_write(store, h, size, chunk_size, keep).await? else {
        return Ok(false);
    };
    // Received straight into the aligned blocks the store writes the device from (no
    // copy between the socket and the disk's buffer; gathering 512 KiB pieces into the
    // writer's own buffer was 12% of a copying node's CPU), two of them: one filled from
    // the socket while the other is hashed and written.
    let mut sink = Sink::new(writer);
    let mut spare = Some(Box::<WriteBlock>::default());
    let mut left = size;
    while left > 0 {
        let mut b = spare.take().unwrap_or_default();
        b.clear();
        while !b.is_full() && left > 0 {
            let n = reading
                .read_into(b.spare(usize::try_from(left).unwrap_or(usize::MAX)))
                .await
                .map_err(bulk_status)?;
            if n == 0 {
                return Err(Status::data_loss(format!(
                    "the peer ended blob {h} {left} bytes early"
                )));
            }
            b.filled(n);
            left -= n as u64;
        }
        if let Some(l) = limit {
            l.take(b.data().len() as u64).await;
        }
        spare = sink.write_block(b).await?;
    }
    sink.finish().await?;
    Ok(true)
}

/// A bulk-path failure as the status a copy reports (UNAUTHENTICATED makes the caller
/// drop the grant it presented).
pub(crate) fn bulk_status(e: locus_proto::bulk::BulkError) -> Status {
    use locus_proto::bulk::BulkError;
    match e {
        BulkError::Missing(m) => Status::not_found(m),
        BulkError::Grant(m) => Status::unauthenticated(m),
        BulkError::DataLoss(m) => Status::data_loss(m),
        BulkError::Full(m) => Status::resource_exhausted(m),
        BulkError::Unsupported(m) | BulkError::Unreachable(m) | BulkError::Refused(m) => {
            Status::unavailable(m)
        }
    }
}

/// `fetch_from_peer` over a peer's ReadBlob stream.
#[allow(clippy::too_many_arguments)]
async fn fetch_over_grpc(
    store: &Arc<BlobStore>,
    peer: &mut locus_proto::client::NodeClient,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    keep: Keep,
    idle: Duration,
    limit: Option<&RateLimit>,
) -> Result<bool, Status> {
    let Some(writer) = begin_write(store, h, size, chunk_size, keep).await? else {
        return Ok(false);
    };
    let mut stream = open_read(
        peer,
        nodepb::ReadBlobRequest {
            hash: h.0.to_vec(),
            offset: 0,
            length: 0,
        },
        idle,
    )
    .await?;
    let mut sink = Sink::new(writer);
    while let Some(d) = next_within(&mut stream, idle).await? {
        if let Some(l) = limit {
            l.take(d.data.len() as u64).await;
        }
        sink.write(d.data).await?;
    }
    sink.finish().await?;
    Ok(true)
}

/// Where a copy came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// It was here already.
    Here,
    Peer(String),
    Backup(String),
    /// The version's origin (URL).
    Origin(String),
}

impl Source {
    /// The `blobs_written_total` label of a copy from here.
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            Source::Here => None,
            Source::Peer(_) => Some("peer"),
            Source::Backup(_) => Some("backup"),
            Source::Origin(_) => Some("origin"),
        }
    }
}

/// How a "from anywhere" copy behaves.
#[derive(Debug, Clone, Copy)]
pub struct CopyOptions<'a> {
    /// This node's id: never a source.
    pub me: &'a str,
    pub pin: bool,
    /// Whom an unpinned copy is cached for (whose cache share it counts in and whose
    /// blobs it may evict: `store::teams`).
    pub team: TeamId,
    pub idle: Duration,
    pub limit: Option<&'a RateLimit>,
    /// The version's origin URL and the blob's path under it: the last source, when no
    /// live replica or backup could send the blob.
    pub origin: Option<(&'a str, &'a str)>,
}

impl CopyOptions<'_> {
    fn keep(&self) -> Keep {
        Keep {
            pin: self.pin,
            team: self.team,
        }
    }
}

/// Copies `h` from the first live replica that can send it, else from a backup (from
/// `known` sources if the caller located the blob already). The error
/// is the last source's, so the caller can tell "nobody has it" (NOT_FOUND) from "the
/// sources failed" (UNAVAILABLE and friends).
pub async fn copy_from_anywhere(
    store: &Arc<BlobStore>,
    peers: &Peers,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    o: CopyOptions<'_>,
    known: Option<Sources>,
) -> Result<Source, Status> {
    if store.contains(&h) {
        if o.pin {
            let st = store.clone();
            tokio::task::spawn_blocking(move || st.set_pinned(&h, true))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(to_status)?;
        }
        return Ok(Source::Here);
    }
    let sources = match known {
        Some(s) => s,
        None => peers.locate(&h).await?,
    };
    let mut last = Status::not_found(format!("no live node or backup holds blob {h}"));
    for (id, addr) in sources.nodes {
        if id == o.me {
            continue;
        }
        match fetch_from_peer(
            store,
            peers,
            &addr,
            h,
            size,
            chunk_size,
            o.keep(),
            o.idle,
            o.limit,
        )
        .await
        {
            Ok(true) => return Ok(Source::Peer(id)),
            Ok(false) => return Ok(Source::Here),
            Err(s) => {
                if s.code() == tonic::Code::Unauthenticated {
                    peers.peer_refused(&addr).await;
                }
                tracing::warn!(blob = %h, peer = %id, "copy failed, trying another source: {}", s.message());
                last = Status::new(s.code(), format!("{id}: {}", s.message()));
            }
        }
    }
    // No live replica could send it: a backup is the source of last resort (after a
    // restore, every blob comes back this way).
    for url in &sources.backups {
        let target = match peers.target(url) {
            Ok(t) => t,
            Err(s) => {
                last = s;
                continue;
            }
        };
        match fetch_from_backup(store, &target, h, size, chunk_size, o.keep(), o.idle).await {
            Ok(true) => {
                tracing::info!(blob = %h, backup = %url, "copied a blob back from a backup");
                return Ok(Source::Backup(url.clone()));
            }
            Ok(false) => return Ok(Source::Here),
            Err(s) => {
                tracing::warn!(blob = %h, backup = %url, "backup read failed: {}", s.message());
                last = s;
            }
        }
    }
    if let Some((url, path)) = o.origin {
        match fetch_from_origin(store, peers, url, path, h, size, chunk_size, o.keep(), o.idle).await {
            Ok(true) => {
                tracing::info!(blob = %h, origin = %url, path, "copied a blob from the version's origin");
                return Ok(Source::Origin(url.to_string()));
            }
            Ok(false) => return Ok(Source::Here),
            Err(s) => {
                tracing::warn!(blob = %h, origin = %url, path, "origin read failed: {}", s.message());
                last = Status::new(s.code(), format!("origin {url}: {}", s.message()));
            }
        }
    }
    Err(last)
}

/// Pieces gathered before one write: an object store's body arrives in pieces of a few
/// KiB, and each write is a trip to a blocking thread.
const GATHER: usize = 4 << 20;

/// Reads the file at `path` under the origin `url` whole, hashing it as it streams in,
/// and stores it under the hash of its bytes (an import the node reads itself). Nothing
/// is stored unless exactly `size` bytes arrive.
#[allow(clippy::too_many_arguments)]
pub async fn import_from_origin(
    store: &Arc<BlobStore>,
    peers: &Peers,
    url: &str,
    path: &str,
    size: u64,
    chunks: (u32, locus_proto::chunks::ChunkKind),
    keep: Keep,
    idle: Duration,
) -> Result<crate::store::Stored, Status> {
    let rel = locus_proto::RelPath::try_from(path.to_string())
        .map_err(|e| Status::invalid_argument(format!("path: {e}")))?;
    let origin = peers.origin_for(url, rel.as_str())?;
    let st = store.clone();
    let writer = tokio::task::spawn_blocking(move || st.begin_unnamed_write(size, chunks, keep))
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(to_status)?;
    let mut body = tokio::time::timeout(idle, origin.stream(rel.as_str()))
        .await
        .map_err(|_| Status::unavailable(format!("{url}/{rel}: no answer for {}s", idle.as_secs_f64())))?
        .map_err(Status::unavailable)?;
    let mut sink = Sink::new(writer);
    let mut batch: Vec<bytes::Bytes> = Vec::new();
    let mut batched = 0usize;
    loop {
        let piece = tokio::time::timeout(idle, futures_util::StreamExt::next(&mut body))
            .await
            .map_err(|_| Status::unavailable(format!("{url}/{rel}: nothing for {}s", idle.as_secs_f64())))?;
        let end = match piece {
            Some(Ok(b)) => {
                batched += b.len();
                batch.push(b);
                false
            }
            Some(Err(e)) => return Err(Status::unavailable(e)),
            None => true,
        };
        if batched >= GATHER || (end && !batch.is_empty()) {
            sink.write_all(std::mem::take(&mut batch)).await?;
            batched = 0;
        }
        if end {
            break;
        }
    }
    sink.finish_stored().await
}

/// Bytes asked of an origin per request, and requests kept in flight per blob: enough to
/// keep an object store streaming, bounded at 32 MiB of memory per blob.
const ORIGIN_PIECE: u64 = 8 << 20;
const ORIGIN_IN_FLIGHT: usize = 4;

/// Copies one blob from the file at `path` under the version's origin `url`, read in
/// ranges (a few in flight, written in order); the store's writer checks every chunk and
/// the whole blob against its name, so a file changed since the import is refused.
#[allow(clippy::too_many_arguments)]
pub async fn fetch_from_origin(
    store: &Arc<BlobStore>,
    peers: &Peers,
    url: &str,
    path: &str,
    h: BlobHash,
    size: u64,
    chunk_size: u32,
    keep: Keep,
    idle: Duration,
) -> Result<bool, Status> {
    let rel = locus_proto::RelPath::try_from(path.to_string())
        .map_err(|e| Status::invalid_argument(format!("origin_path: {e}")))?;
    let origin = peers.origin_for(url, rel.as_str())?;
    let Some(writer) = begin_write(store, h, size, chunk_size, keep).await? else {
        return Ok(false);
    };
    let reads = (0..size.div_ceil(ORIGIN_PIECE)).map(|i| {
        let (origin, rel) = (origin.clone(), rel.clone());
        let off = i * ORIGIN_PIECE;
        let len = ORIGIN_PIECE.min(size - off);
        async move {
            match tokio::time::timeout(idle, origin.read(rel.as_str(), off, len)).await {
                Err(_) => Err(Status::unavailable(format!(
                    "{rel}: no answer for {}s",
                    idle.as_secs_f64()
                ))),
                Ok(Err(e)) => Err(Status::unavailable(e)),
                Ok(Ok(b)) if b.len() as u64 != len => Err(Status::data_loss(format!(
                    "{rel}: {} bytes at {off}, {len} expected (changed since the import?)",
                    b.len()
                ))),
                Ok(Ok(b)) => Ok(b),
            }
        }
    });
    let mut pieces = futures_util::StreamExt::buffered(futures_util::stream::iter(reads), ORIGIN_IN_FLIGHT);
    let mut sink = Sink::new(writer);
    while let Some(piece) = futures_util::StreamExt::next(&mut pieces).await {
        sink.write(piece?).await?;
    }
    sink.finish().await?;
    Ok(true)
}

/// Longest wait for a peer's connection to open (copies, chunk fetches).
pub(crate) const CONNECT: Duration = Duration::from_secs(3);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_rate_limit_never_lets_more_through_than_its_rate() {
        // 2.5 MB at 10 MB/s from an empty budget cannot take less than 0.25 s.
        let l = RateLimit::new(10_000_000);
        let t0 = tokio::time::Instant::now();
        for _ in 0..10 {
            l.take(250_000).await;
        }
        let took = t0.elapsed().as_secs_f64();
        assert!(took >= 0.24, "2.5 MB passed in {took}s at 10 MB/s");
    }

    #[tokio::test]
    async fn an_unlimited_rate_never_waits() {
        let l = RateLimit::new(0);
        let t0 = std::time::Instant::now();
        l.take(u64::MAX / 2).await;
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
