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
use std::sync::mpsc::{Receiver, SyncSender};

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
        // Two blocks: one filled from the socket here while a second thread hashes and
        // writes the other from where it lies (as a peer copy does), so receiving and
        // storing overlap instead of taking turns.
        let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Box<WriteBlock>>(1);
        let (free_tx, free_rx) = std::sync::mpsc::sync_channel::<Box<WriteBlock>>(2);
        for _ in 0..2 {
            let _ = free_tx.send(Box::default());
        }
        let metrics = &self.metrics;
        let (received, stored) = std::thread::scope(|scope| {
            let storing = scope.spawn(move || {
                let mut w = writer;
                for b in full_rx {
                    w.write_block(&b)?;
                    metrics.bulk_received.inc_by(b.data().len() as u64);
                    // The receiver may have stopped (the client went away): nothing to do.
                    let _ = free_tx.send(b);
                }
                Ok::<_, StoreError>(w)
            });
            let received = receive(s, &h, size, &free_rx, &full_tx);
            drop(full_tx);
            (
                received,
                storing.join().expect("the storing thread does not panic"),
            )
        });
        let w = match (received, stored) {
            (_, Err(e)) => {
                // The client may still be sending: say why, then end the connection.
                refuse(s, &h, e)?;
                s.close_gently();
                return Err(std::io::Error::other("the blob write failed"));
            }
            // The writer goes with its reservation and partial file.
            (Err(e), Ok(_)) => return Err(e),
            (Ok(()), Ok(w)) => w,
        };
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

/// Fills blocks from the client until `size` bytes arrived, handing each full one to the
/// storing thread. Ok also when that thread stopped taking blocks (it failed: its error
/// is the one reported).
fn receive(
    s: &mut Conn,
    h: &BlobHash,
    size: u64,
    free: &Receiver<Box<WriteBlock>>,
    full: &SyncSender<Box<WriteBlock>>,
) -> std::io::Result<()> {
    let mut left = size;
    while left > 0 {
        let Ok(mut block) = free.recv() else {
            return Ok(());
        };
        block.clear();
        while !block.is_full() && left > 0 {
            let n = s.read(block.spare(usize::try_from(left).unwrap_or(usize::MAX)))?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the client ended blob {h} {left} bytes early"),
                ));
            }
            block.filled(n);
            left -= n as u64;
        }
        if full.send(block).is_err() {
            return Ok(());
        }
    }
    Ok(())
}
