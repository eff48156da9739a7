//! Scrub: re-verifies every stored blob at a bounded rate, forever, in hash order from a
//! cursor the store keeps, so a pass resumes where it stopped after a restart. A blob
//! that fails is quarantined by the store, which wakes pin sync to queue it for refill.
//! It never holds the store's lock while it reads: batches of names come from the index,
//! each blob is hashed on a blocking thread.

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::store::BlobStore;

/// Blobs read from the index at a time.
const BATCH: usize = 256;

/// Runs until `stop`; `rate` bytes per second, 0 disables.
pub async fn run(
    store: Arc<BlobStore>,
    rate: u64,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    if rate == 0 {
        return;
    }
    let mut cursor = store.scrub_cursor();
    if let Some(h) = cursor {
        tracing::info!(after = %h, "scrub resumes where it stopped");
    }
    loop {
        let st = store.clone();
        let batch = match tokio::task::spawn_blocking(move || st.scrub_batch(cursor, BATCH)).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                tracing::warn!("scrub cannot read the index: {e}");
                Vec::new()
            }
            Err(e) => {
                tracing::warn!("scrub task failed: {e}");
                Vec::new()
            }
        };
        if batch.is_empty() {
            if cursor.is_some() {
                // A pass ended; the next starts from the first blob.
                metrics.scrub_passes.inc();
                cursor = None;
                store.set_scrub_cursor(None);
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        for (h, size) in batch {
            let st = store.clone();
            match tokio::task::spawn_blocking(move || st.verify(&h)).await {
                Ok(Ok(true)) => {}
                // The store has already announced the quarantine; pin sync refetches.
                Ok(Ok(false)) => tracing::error!(blob = %h, "scrub found a corrupt blob"),
                Ok(Err(e)) => tracing::warn!(blob = %h, "scrub could not verify: {e}"),
                Err(e) => tracing::warn!("scrub task failed: {e}"),
            }
            metrics.scrub_bytes.inc_by(size);
            cursor = Some(h);
            store.set_scrub_cursor(cursor);
            let pause = Duration::from_secs_f64(size.max(4096) as f64 / rate as f64);
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}
