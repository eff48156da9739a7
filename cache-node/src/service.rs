//! The node API over gRPC: streaming blob reads and writes, presence checks, peer fetches
//! and, for same-host clients on the Unix socket, "make this blob local". Store errors are
//! mapped to `Status` here and nowhere else. Blob I/O runs on blocking threads, one piece
//! at a time: no blocking thread ever waits on a client or a peer, so a reader that stops
//! reading holds a little memory and its idle timeout, never a thread.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use locus_proto::chunks::ChunkKind;
use locus_proto::nodepb::{self, node_server::Node};
use locus_proto::BlobHash;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::store::{BlobStore, StoreError};

mod local;
mod small;
mod streams;
use crate::transfer::{fetch_from_peer, next_within, open_read, Sink};
use crate::Peers;
pub use streams::stream_blob;
use streams::{upload_one, BlobStream, UPLOAD_ALIVE};

/// Bytes per streamed message.
pub const STREAM_PIECE: usize = 2 << 20;

pub fn to_status(e: StoreError) -> Status {
    match e {
        StoreError::NotFound(_) => Status::not_found(e.to_string()),
        StoreError::NotPresent { .. } => Status::failed_precondition(e.to_string()),
        StoreError::Corrupt { .. } => Status::data_loss(e.to_string()),
        StoreError::Mismatch { .. } => Status::invalid_argument(e.to_string()),
        StoreError::Full { .. } => Status::resource_exhausted(e.to_string()),
        StoreError::DataDir { .. } | StoreError::Io(_) | StoreError::Index(_) => {
            tracing::error!("{e}");
            Status::internal(e.to_string())
        }
    }
}

#[derive(Clone)]
pub struct NodeService {
    pub store: Arc<BlobStore>,
    pub peers: Arc<Peers>,
    pub id: String,
    /// True for the instance serving the Unix socket.
    pub local: bool,
    /// How long a peer may stay silent during a transfer before it is given up on.
    pub peer_idle: Duration,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub refill: Arc<crate::refill::Refill>,
}

impl NodeService {
    /// FetchBlobs without a named source: each blob from wherever it can be had (live
    /// replicas, then backups), four at a time. Fails naming the first blob no source had.
    /// `origin`: the version's origin URL, and each blob's path under it ("" where the
    /// origin is not to be read).
    async fn fetch_from_anywhere(
        &self,
        blobs: Vec<(BlobHash, u64)>,
        pin: bool,
        chunk_size: u32,
        origin: &str,
        paths: Vec<String>,
    ) -> Result<Response<nodepb::FetchBlobsResponse>, Status> {
        let opts = crate::transfer::CopyOptions {
            me: &self.id,
            pin,
            team: crate::store::TeamId::NONE,
            idle: self.peer_idle,
            limit: None,
            origin: None,
        };
        let mut copies = futures_util::StreamExt::buffer_unordered(
            futures_util::stream::iter(blobs.into_iter().zip(paths).map(|((h, size), path)| async move {
                let opts = crate::transfer::CopyOptions {
                    origin: (!origin.is_empty() && !path.is_empty()).then_some((origin, path.as_str())),
                    ..opts
                };
                let r = crate::transfer::copy_from_anywhere(
                    &self.store,
                    &self.peers,
                    h,
                    size,
                    chunk_size,
                    opts,
                    None,
                )
                .await;
                (h, size, r)
            })),
            4,
        );
        let mut resp = nodepb::FetchBlobsResponse::default();
        while let Some((h, size, r)) = futures_util::StreamExt::next(&mut copies).await {
            let from = match r {
                Ok(src) => match src.kind() {
                    Some(kind) => kind,
                    None => {
                        resp.already_present += 1;
                        continue;
                    }
                },
                Err(s) => return Err(Status::new(s.code(), format!("blob {h}: {}", s.message()))),
            };
            resp.fetched += 1;
            resp.bytes += size;
            self.metrics.wrote(from, size);
        }
        Ok(Response::new(resp))
    }

    /// Chunk `c` (of `cs` bytes) of blob `h` from the peer at `source`: over the bulk
    /// path, or over gRPC to a peer without it. Never more than the chunk: a peer that
    /// offers more is cut off before it can grow the buffer.
    async fn chunk_from(&self, source: &str, h: &BlobHash, c: u64, cs: u64) -> Result<bytes::Bytes, Status> {
        use locus_proto::bulk::BulkError;
        let too_much = || {
            Status::data_loss(format!(
                "{source} sent more than the {cs} bytes of chunk {c} of blob {h}"
            ))
        };
        match self.peers.bulk_read(source, h, c * cs, cs, self.peer_idle).await {
            Ok(r) if r.len() > cs => return Err(too_much()),
            Ok(r) => return r.all().await.map_err(crate::transfer::bulk_status),
            Err(BulkError::Unsupported(_)) => {}
            Err(e) => return Err(crate::transfer::bulk_status(e)),
        }
        let mut peer = self.peers.peer(source, crate::transfer::CONNECT).await?;
        let req = nodepb::ReadBlobRequest {
            hash: h.0.to_vec(),
            offset: c * cs,
            length: cs,
        };
        let mut s = open_read(&mut peer, req, self.peer_idle).await?;
        let mut buf = Vec::with_capacity(cs as usize);
        while let Some(m) = next_within(&mut s, self.peer_idle).await? {
            if (buf.len() + m.data.len()) as u64 > cs {
                return Err(too_much());
            }
            buf.extend_from_slice(&m.data);
        }
        Ok(buf.into())
    }

    /// The Unix socket serves what a same-host mount needs (reads, EnsureLocal,
    /// LocalPaths) and nothing that writes, fetches from an address, or sends to a URL:
    /// whoever can reach the socket gets no more than a reader.
    fn not_local(&self, method: &str) -> Result<(), Status> {
        if self.local {
            return Err(Status::permission_denied(format!(
                "{method} is not served on the node's Unix socket (it serves reads, EnsureLocal \
                 and LocalPaths to same-host mounts)"
            )));
        }
        Ok(())
    }
}

fn hash(b: &[u8]) -> Result<BlobHash, Status> {
    Ok(BlobHash::from_slice("hash", b)?)
}

/// (hash, size) of each requested blob; a malformed hash refuses the whole request.
fn blob_refs(refs: &[nodepb::BlobRef]) -> Result<Vec<(BlobHash, u64)>, Status> {
    refs.iter().map(|b| hash(&b.hash).map(|h| (h, b.size))).collect()
}

#[tonic::async_trait]
impl Node for NodeService {
    type ReadBlobStream = BlobStream;

    async fn read_blob(&self, req: Request<nodepb::ReadBlobRequest>) -> Result<Response<BlobStream>, Status> {
        let grant = granted(&req);
        let q = req.into_inner();
        let h = hash(&q.hash)?;
        if let Some(g) = &grant {
            self.peers.grant_opens(g, &h).await?;
        }
        let Some(size) = self.store.size_of(&h) else {
            return Err(to_status(StoreError::NotFound(h)));
        };
        if let Some(missing) = self.store.missing_chunks(&h) {
            // A partly present blob serves only ranges whose chunks are all here.
            let cs = self.store.chunk_size_of(&h).unwrap_or(1);
            let end = if q.length == 0 {
                size
            } else {
                q.offset.saturating_add(q.length).min(size)
            };
            let gaps: Vec<u64> = missing
                .into_iter()
                .filter(|c| c * cs < end && (c + 1) * cs > q.offset)
                .collect();
            if !gaps.is_empty() {
                return Err(to_status(StoreError::NotPresent {
                    hash: h,
                    missing: gaps,
                }));
            }
        }
        let size = self.store.size_of(&h).unwrap_or(0);
        let end = if q.length == 0 {
            size
        } else {
            q.offset.saturating_add(q.length).min(size)
        };
        self.metrics.read_bytes.inc_by(end.saturating_sub(q.offset));
        Ok(Response::new(stream_blob(
            self.store.clone(),
            h,
            q.offset,
            q.length,
            self.peer_idle,
        )))
    }

    async fn write_blob(
        &self,
        req: Request<Streaming<nodepb::WriteBlobMessage>>,
    ) -> Result<Response<nodepb::WriteBlobResponse>, Status> {
        use nodepb::write_blob_message::Msg;
        self.not_local("WriteBlob")?;
        let mut stream = req.into_inner();
        let header = match next_within(&mut stream, self.peer_idle).await? {
            Some(nodepb::WriteBlobMessage {
                msg: Some(Msg::Header(h)),
            }) => h,
            _ => return Err(Status::invalid_argument("the first message must be the header")),
        };
        let h = hash(&header.hash)?;
        let st = self.store.clone();
        let size = header.size;
        let writer = tokio::task::spawn_blocking(move || {
            st.begin_write(h, header.size, header.chunk_size, header.pin)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(|e| {
            self.metrics.refused("full");
            to_status(e)
        })?;
        let Some(writer) = writer else {
            return Ok(Response::new(nodepb::WriteBlobResponse { stored: false }));
        };
        // A writer that goes silent loses its write (and its reservation) after the idle
        // timeout instead of holding them forever.
        let mut sink = Sink::new(writer);
        while let Some(msg) = next_within(&mut stream, self.peer_idle).await? {
            match msg {
                nodepb::WriteBlobMessage {
                    msg: Some(Msg::Data(d)),
                } => sink.write(d).await?,
                _ => return Err(Status::invalid_argument("only data may follow the header")),
            }
        }
        sink.finish().await.inspect_err(|s| {
            if s.code() == tonic::Code::InvalidArgument {
                self.metrics.refused("mismatch");
            }
        })?;
        self.metrics.wrote("client", size);
        Ok(Response::new(nodepb::WriteBlobResponse { stored: true }))
    }

    async fn write_blobs(
        &self,
        req: Request<nodepb::WriteBlobsRequest>,
    ) -> Result<Response<nodepb::WriteBlobsResponse>, Status> {
        self.write_small(req.into_inner()).await.map(Response::new)
    }

    async fn have_blobs(
        &self,
        req: Request<nodepb::HaveBlobsRequest>,
    ) -> Result<Response<nodepb::HaveBlobsResponse>, Status> {
        let grant = granted(&req);
        let q = req.into_inner();
        if q.hashes.len() > 100_000 {
            return Err(Status::invalid_argument("hashes: at most 100,000 per call"));
        }
        let hashes = q.hashes.iter().map(|h| hash(h)).collect::<Result<Vec<_>, _>>()?;
        let mut present: Vec<bool> = hashes.iter().map(|h| self.store.contains(h)).collect();
        // A grant narrowed to versions learns nothing of blobs outside them.
        if let Some(g) = grant.as_deref().filter(|g| g.scoped) {
            let here = marked(&hashes, &present);
            let mut opens = self.peers.grant_filter(g, &here).await?.into_iter();
            for p in present.iter_mut().filter(|p| **p) {
                *p = opens.next().unwrap_or(false);
            }
        }
        if q.pin {
            // An import skips what the node holds: the blobs it skips must be pinned as
            // the ones it sends are, or a blob cached unpinned (a deleted version's) could
            // be evicted between this answer and the commit that lists it.
            if let Some(g) = grant.as_deref().filter(|g| g.operation != "import") {
                return Err(Status::permission_denied(format!(
                    "HaveBlobs with pin takes an import grant; this one (issued to {}) is for {:?}",
                    g.issued_to, g.operation
                )));
            }
            let here = marked(&hashes, &present);
            let store = self.store.clone();
            let gone = tokio::task::spawn_blocking(move || -> Result<HashSet<BlobHash>, StoreError> {
                let mut gone = HashSet::new();
                for h in here {
                    if !store.set_pinned(&h, true)? {
                        gone.insert(h);
                    }
                }
                Ok(gone)
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(to_status)?;
            // Evicted between the look and the pin: reported absent, so it is sent.
            for (h, p) in hashes.iter().zip(present.iter_mut()) {
                if *p && gone.contains(h) {
                    *p = false;
                }
            }
        }
        Ok(Response::new(nodepb::HaveBlobsResponse { present }))
    }

    async fn fetch_blobs(
        &self,
        req: Request<nodepb::FetchBlobsRequest>,
    ) -> Result<Response<nodepb::FetchBlobsResponse>, Status> {
        self.not_local("FetchBlobs")?;
        let q = req.into_inner();
        let blobs = blob_refs(&q.blobs)?;
        if q.source.is_empty() {
            if !q.origin.is_empty() {
                self.peers
                    .check_origin(&q.origin, &q.origin_dataset, q.origin_version)
                    .await?;
            }
            let paths = q.blobs.iter().map(|b| b.origin_path.clone()).collect();
            return self
                .fetch_from_anywhere(blobs, q.pin, q.chunk_size, &q.origin, paths)
                .await;
        }
        self.peers.check_source(&q.source).await?;
        let mut resp = nodepb::FetchBlobsResponse::default();
        // A few transfers at once keep the link busy without unbounded memory.
        let mut set = tokio::task::JoinSet::new();
        let mut iter = blobs.into_iter();
        loop {
            while set.len() < 4 {
                let Some((h, size)) = iter.next() else { break };
                let (store, peers, source) = (self.store.clone(), self.peers.clone(), q.source.clone());
                let (cs, pin, idle) = (q.chunk_size, q.pin, self.peer_idle);
                set.spawn(async move {
                    (
                        size,
                        fetch_from_peer(&store, &peers, &source, h, size, cs, pin.into(), idle, None).await,
                    )
                });
            }
            let Some(r) = set.join_next().await else { break };
            match r.map_err(|e| Status::internal(e.to_string()))? {
                (size, Ok(true)) => {
                    resp.fetched += 1;
                    resp.bytes += size;
                    self.metrics.wrote("peer", size);
                }
                (_, Ok(false)) => resp.already_present += 1,
                (_, Err(s)) => {
                    set.abort_all();
                    return Err(Status::new(
                        s.code(),
                        format!("from {}: {}", q.source, s.message()),
                    ));
                }
            }
        }
        Ok(Response::new(resp))
    }

    async fn fetch_chunks(
        &self,
        req: Request<nodepb::FetchChunksRequest>,
    ) -> Result<Response<nodepb::FetchChunksResponse>, Status> {
        self.not_local("FetchChunks")?;
        let q = req.into_inner();
        self.peers.check_source(&q.source).await?;
        let h = hash(&q.hash)?;
        let chunks = q
            .chunk_hashes
            .iter()
            .enumerate()
            .map(|(i, c)| BlobHash::from_slice(&format!("chunk_hashes[{i}]"), c))
            .collect::<Result<Vec<_>, _>>()?;
        // The sparse file holds the blob's whole size from the start: a size only the
        // manifest may decide, never the caller.
        match self.peers.locate(&h).await?.size {
            Some((size, cs)) if size == q.size && (cs == q.chunk_size || q.chunk_size == 0) => {}
            Some((size, cs)) => {
                return Err(Status::invalid_argument(format!(
                    "size {} / chunk size {}: the manifest says {size} / {cs} for blob {h}",
                    q.size, q.chunk_size
                )))
            }
            None => {
                return Err(Status::not_found(format!(
                    "blob {h} is in no committed version of this cluster"
                )))
            }
        }
        let kind = ChunkKind::from_tree(q.tree_chunks);
        if kind.is_tree() && !locus_proto::chunks::tree_chunks_match(&h, &chunks) {
            return Err(Status::invalid_argument(format!(
                "chunk_hashes: not the tree chunk hashes of blob {h}"
            )));
        }
        let st = self.store.clone();
        let (size, cs, pin) = (q.size, q.chunk_size, q.pin);
        tokio::task::spawn_blocking(move || st.begin_partial(h, size, cs, (kind, &chunks), pin))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(to_status)?;
        let Some(missing) = self.store.missing_chunks(&h) else {
            return Ok(Response::new(nodepb::FetchChunksResponse {
                fetched: 0,
                complete: true,
                missing: vec![],
            }));
        };
        let want: Vec<u64> = if q.chunks.is_empty() {
            missing
        } else {
            q.chunks
                .iter()
                .map(|c| u64::from(*c))
                .filter(|c| missing.contains(c))
                .collect()
        };
        let cs = self.store.chunk_size_of(&h).unwrap_or(1);
        let mut fetched = 0;
        for c in want {
            let from = |s: Status| Status::new(s.code(), format!("from {}: {}", q.source, s.message()));
            let buf = self.chunk_from(&q.source, &h, c, cs).await.map_err(from)?;
            let st = self.store.clone();
            let len = buf.len() as u64;
            tokio::task::spawn_blocking(move || st.write_chunk(&h, c, &buf))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(to_status)?;
            fetched += 1;
            self.metrics.written_bytes.inc_by(len);
        }
        let missing = self.store.missing_chunks(&h);
        if missing.is_none() {
            self.metrics.completed("peer");
        }
        Ok(Response::new(nodepb::FetchChunksResponse {
            fetched,
            complete: missing.is_none(),
            missing: missing
                .unwrap_or_default()
                .into_iter()
                .map(|c| c as u32)
                .collect(),
        }))
    }

    async fn local_paths(
        &self,
        req: Request<nodepb::LocalPathsRequest>,
    ) -> Result<Response<nodepb::LocalPathsResponse>, Status> {
        self.metrics.local_paths.inc();
        self.paths_here(req.into_inner()).await.map(Response::new)
    }

    async fn ensure_local(
        &self,
        req: Request<nodepb::EnsureLocalRequest>,
    ) -> Result<Response<nodepb::EnsureLocalResponse>, Status> {
        self.metrics.ensure_local.inc();
        // The local socket's clients are trusted with every blob and name no team: what
        // they have cached counts as untagged.
        self.make_local(req.into_inner(), crate::store::TeamId::NONE)
            .await
            .map(Response::new)
    }

    type UploadBlobsStream = Pin<Box<dyn Stream<Item = Result<nodepb::UploadProgress, Status>> + Send>>;

    async fn import_object(
        &self,
        req: Request<nodepb::ImportObjectRequest>,
    ) -> Result<Response<nodepb::ImportObjectResponse>, Status> {
        // The node's own credentials would read whatever a local caller names.
        self.not_local("ImportObject")?;
        let grant = granted(&req);
        let q = req.into_inner();
        check_grant_target(grant.as_deref(), "origin", &q.origin)?;
        if q.origin.is_empty() {
            return Err(Status::invalid_argument("origin: name the version's origin URL"));
        }
        let stored = crate::transfer::import_from_origin(
            &self.store,
            &self.peers,
            &q.origin,
            &q.path,
            q.size,
            (q.chunk_size, ChunkKind::from_tree(q.tree_chunks)),
            q.pin.into(),
            self.peer_idle,
        )
        .await?;
        if !stored.already_present {
            self.metrics.wrote("origin", q.size);
        }
        Ok(Response::new(nodepb::ImportObjectResponse {
            hash: stored.hash.0.to_vec(),
            chunk_hashes: stored.chunks.iter().map(|c| c.0.to_vec()).collect(),
            already_present: stored.already_present,
            tree_chunks: q.tree_chunks,
        }))
    }

    async fn upload_blobs(
        &self,
        req: Request<nodepb::UploadBlobsRequest>,
    ) -> Result<Response<Self::UploadBlobsStream>, Status> {
        self.not_local("UploadBlobs")?;
        let grant = granted(&req);
        let q = req.into_inner();
        check_grant_target(grant.as_deref(), "target", &q.target)?;
        let blobs = blob_refs(&q.blobs)?;
        self.peers.check_backup_target(&q.target).await?;
        let target = self.peers.target(&q.target)?;
        let parallel = if q.parallel == 0 { 4 } else { q.parallel.min(64) } as usize;
        let (tx, rx) = mpsc::channel(16);
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let mut p = nodepb::UploadProgress::default();
            let mut set = tokio::task::JoinSet::new();
            let mut todo = blobs.into_iter();
            let mut last_sent = std::time::Instant::now();
            loop {
                while set.len() < parallel {
                    let Some((h, size)) = todo.next() else { break };
                    let (store, target, skip) = (store.clone(), target.clone(), q.skip_existing);
                    set.spawn(async move { (h, size, upload_one(&store, &target, h, size, skip).await) });
                }
                // While long uploads run, the caller still hears from us every few
                // seconds: silence means this node hangs, not that a blob is large.
                let r = tokio::select! {
                    r = set.join_next() => r,
                    _ = tokio::time::sleep(UPLOAD_ALIVE) => {
                        if tx.send(Ok(p.clone())).await.is_err() {
                            return;
                        }
                        continue;
                    }
                };
                let Some(r) = r else { break };
                let (h, size, r) = match r {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx
                            .send(Err(Status::internal(format!("upload task failed: {e}"))))
                            .await;
                        return;
                    }
                };
                p.blobs_done += 1;
                match r {
                    Ok(true) => {
                        p.blobs_uploaded += 1;
                        p.bytes_uploaded += size;
                        metrics.backup_bytes.inc_by(size);
                    }
                    Ok(false) => {
                        p.blobs_skipped += 1;
                        p.bytes_skipped += size;
                    }
                    // This copy is bad or gone (a corrupt one is quarantined by the read):
                    // another replica can send it; carry on with the rest.
                    Err(s) if matches!(s.code(), tonic::Code::DataLoss | tonic::Code::NotFound) => {
                        tracing::warn!(blob = %h, "cannot upload this node's copy: {}", s.message());
                        p.failed.push(nodepb::FailedBlob {
                            hash: h.0.to_vec(),
                            reason: s.message().to_string(),
                        });
                    }
                    Err(s) => {
                        // The target failed: let the uploads in flight finish (complete
                        // objects or nothing), then report it.
                        while set.join_next().await.is_some() {}
                        let _ = tx
                            .send(Err(Status::new(s.code(), format!("blob {h}: {}", s.message()))))
                            .await;
                        return;
                    }
                }
                if last_sent.elapsed() >= Duration::from_millis(200) {
                    last_sent = std::time::Instant::now();
                    if tx.send(Ok(p.clone())).await.is_err() {
                        return; // the caller went away; nothing new starts
                    }
                }
            }
            // "Finished" vouches that the blobs are stored: on a file:// target that
            // means on disk, not just written.
            if let Err(e) = target.sync_local().await {
                let _ = tx.send(Err(Status::unavailable(e.to_string()))).await;
                return;
            }
            p.finished = true;
            let _ = tx.send(Ok(p)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_node_status(
        &self,
        _req: Request<nodepb::GetNodeStatusRequest>,
    ) -> Result<Response<nodepb::NodeStatus>, Status> {
        let s = self.store.stats();
        Ok(Response::new(nodepb::NodeStatus {
            id: self.id.clone(),
            capacity_bytes: s.capacity,
            used_bytes: s.used,
            pinned_bytes: s.pinned,
            cached_bytes: s.cached,
            blobs: s.blobs,
            quarantined: s.quarantined,
            refill: Some(crate::metrics::refill_status(&self.refill.progress())),
        }))
    }
}

/// The hashes whose mark is set.
fn marked(hashes: &[BlobHash], marks: &[bool]) -> Vec<BlobHash> {
    hashes
        .iter()
        .zip(marks)
        .filter(|(_, m)| **m)
        .map(|(h, _)| *h)
        .collect()
}

/// The grant a call came with, if it came with one.
fn granted<T>(req: &Request<T>) -> Option<Arc<locus_proto::grant::GrantBody>> {
    req.extensions()
        .get::<locus_proto::auth::Principal>()
        .and_then(|p| p.grant.clone())
}

/// A call under a grant acts only on the URL the grant names: an import grant for one
/// origin reads no other, a backup grant for one target writes to no other.
fn check_grant_target(
    grant: Option<&locus_proto::grant::GrantBody>,
    field: &str,
    url: &str,
) -> Result<(), Status> {
    let Some(g) = grant else { return Ok(()) };
    if g.target != url {
        return Err(Status::permission_denied(format!(
            "{field}: the grant (issued to {}) is for {:?}, not this URL",
            g.issued_to, g.target
        )));
    }
    // Debug: an import reads its origin with one call per file.
    tracing::debug!(
        issued_to = %g.issued_to,
        operation = %g.operation,
        url,
        "granted call"
    );
    Ok(())
}
