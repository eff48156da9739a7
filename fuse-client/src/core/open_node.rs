//! The mount's side of the node's open socket (`locus_proto::open_socket`): blobs as
//! descriptors under this mount's read grants, for a user the node does not trust with
//! its data dir.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use locus_proto::BlobHash;

use super::{LocalError, LocalNode, NodeBlob, NodeFile};

/// The node over its open socket (`locus_proto::open_socket`): each blob as a file
/// descriptor, asked for under a read grant for the mounted version — what a user the
/// node does not trust with its data dir gets instead of paths (a team's job on a shared
/// host). It lists no paths, so every open asks; passthrough works as with paths.
pub struct OpenSocketNode {
    pub path: PathBuf,
    pub chunk_size: u32,
    /// A read grant for the mounted version ("" where the cluster has no tokens); its
    /// source renews it before it ends.
    pub grant: Box<dyn Fn() -> Result<String, String> + Send + Sync>,
    /// Idle connections, reused (a request's answer is read before the next is sent).
    pub idle: Mutex<Vec<std::os::unix::net::UnixStream>>,
}

impl LocalNode for OpenSocketNode {
    fn ensure_local(&self, blob: BlobHash, _size: u64, _limit: Duration) -> Result<NodeBlob, LocalError> {
        Err(LocalError::Refused(format!(
            "blob {blob}: the open socket hands out descriptors, never paths"
        )))
    }

    fn open_local(&self, blob: BlobHash, size: u64, limit: Duration) -> Result<NodeFile, LocalError> {
        let (resp, files) = self.ask(Some((blob, size)), &[], limit)?;
        let file = files
            .into_iter()
            .next()
            .ok_or_else(|| LocalError::Refused("the node answered without a descriptor".into()))?;
        Ok(NodeFile::of(file, resp.offset, resp.packed))
    }

    fn hands_out_files(&self) -> bool {
        true
    }

    fn open_many(&self, blobs: &[BlobHash], limit: Duration) -> Result<Vec<Option<NodeFile>>, LocalError> {
        let mut out = Vec::with_capacity(blobs.len());
        for batch in blobs.chunks(locus_proto::open_socket::MAX_FDS - 1) {
            let (resp, files) = self.ask(None, batch, limit)?;
            if resp.more.len() != batch.len() {
                return Err(LocalError::Refused(format!(
                    "{} answers for {} blobs",
                    resp.more.len(),
                    batch.len()
                )));
            }
            let mut files = files.into_iter();
            for m in resp.more {
                let file = if m.present { files.next() } else { None };
                out.push(file.map(|file| NodeFile::of(file, m.offset, m.packed)));
            }
        }
        Ok(out)
    }
}

impl OpenSocketNode {
    /// One request on an idle connection (or a new one): `first` made local and opened,
    /// `more` opened where the node holds them verified.
    fn ask(
        &self,
        first: Option<(BlobHash, u64)>,
        more: &[BlobHash],
        limit: Duration,
    ) -> Result<(locus_proto::nodepb::OpenBlobResponse, Vec<File>), LocalError> {
        let grant = (self.grant)().map_err(LocalError::Refused)?;
        let req = locus_proto::nodepb::OpenBlobRequest {
            hash: first.map(|f| f.0 .0.to_vec()).unwrap_or_default(),
            size: first.map_or(0, |f| f.1),
            chunk_size: self.chunk_size,
            grant,
            more: more.iter().map(|h| h.0.to_vec()).collect(),
        };
        let conn = match self.idle.lock().unwrap().pop() {
            Some(c) => c,
            None => locus_proto::open_socket::connect(&self.path, limit)
                .map_err(|e| LocalError::Unreachable(format!("{}: {e}", self.path.display())))?,
        };
        let _ = conn.set_read_timeout(Some(limit));
        let (resp, files) = locus_proto::open_socket::ask(&conn, &req)
            .map_err(|e| LocalError::Unreachable(format!("{}: {e}", self.path.display())))?;
        self.idle.lock().unwrap().push(conn);
        if resp.code != 0 {
            let code = tonic::Code::from(resp.code as i32);
            return Err(LocalError::from_status(&tonic::Status::new(code, resp.message)));
        }
        Ok((resp, files))
    }
}
