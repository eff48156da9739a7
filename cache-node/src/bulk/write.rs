//! WRITE on the bulk path: a client (an import) hands the node a blob to store. The bytes
//! are received straight into the store's aligned direct-I/O blocks, hashed (root and
//! outboard) and written from where they lie, then verified against the blob's name and
//! published, as for WriteBlob over gRPC but with no protobuf or HTTP/2 framing and no
//! copy out of a decoder.
//!
//! The exchange: `op=WRITE hash size chunk_size pin` → `OK n` where n = size ("send
//! them") or 0 ("here already", pinned if asked); then exactly `size` bytes from the
//! client; then the node's verdict, `OK 0` once the blob is stored and synced, or an
//! error (INVALID: the bytes are not the blob's; FULL: no room).

use std::io::Read;

use locus_proto::BlobHash;

use super::{refuse, BulkServer, Conn};
use crate::store::{StoreError, WriteBlock};

impl BulkServer {
    /// Answers one WRITE. An error that leaves the connection in an unknown state (bytes
    /// of the blob still unread) is answered where it can be, and closes it.
    pub(super) fn write(
        &self,
        s: &mut Conn,
        h: BlobHash,
        size: u64,
        chunk_size: u32,
        pin: bool,
    ) -> std::io::Result<()> {
        let writer = match self.store.begin_write(h, size, chunk_size, pin) {
            Ok(Some(w)) => w,
            Ok(None) => return s.answer(0),
            Err(e) => {
                if matches!(e, StoreError::Full { .. }) {
                    self.metrics.refused("full");
                }
                return refuse(s, &h, e);
            }
        };
        s.answer(size)?;
        let mut w = writer;
        let mut block = Box::<WriteBlock>::default();
        let mut left = size;
        while left > 0 {
            block.clear();
            while !block.is_full() && left > 0 {
                let n = s.read(block.spare(usize::try_from(left).unwrap_or(usize::MAX)))?;
                if n == 0 {
                    // The writer goes with its reservation and partial file.
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the client ended blob {h} {left} bytes early"),
                    ));
                }
                block.filled(n);
                left -= n as u64;
            }
            if let Err(e) = w.write_block(&block) {
                // The client is still sending: say why, then end the connection.
                refuse(s, &h, e)?;
                s.close_gently();
                return Err(std::io::Error::other("the blob write failed"));
            }
            self.metrics.bulk_received.inc_by(block.data().len() as u64);
        }
        match w.finish_stored() {
            Ok(_) => {
                self.metrics.wrote("client", size);
                s.answer(0)
            }
            Err(e) => {
                if matches!(e, StoreError::Mismatch { .. }) {
                    self.metrics.refused("mismatch");
                }
                refuse(s, &h, e)
            }
        }
    }
}
