//! Refill: the worker pool that brings back the blobs this node must hold but lacks — after
//! a disk swap or a wipe, a quarantine, a crash mid-write, or a repair it missed.
//!
//! Pin sync hands it the complete list of pinned-but-missing blobs; `Refill` keeps them as
//! a queue ordered by when each is next due, and `parallel` workers copy them (live
//! replicas first, then backups) under an optional byte-rate budget. A copy that fails is
//! retried with exponential backoff (1 s doubling to 5 min); a blob that stops being
//! wanted leaves the queue at the next pin sync. Progress (blobs and bytes to go, bytes
//! done, rate, failures) is readable at any time for heartbeats, metrics and `node list`.
//!
//! What makes the queue survive a restart is where it comes from: the metadata service's
//! record of which shards this node replicates (ListNodeBlobs) is durable, so the first
//! pin sync after a start rebuilds the queue exactly; only the backoff state is lost,
//! and a restart is a fine moment to try every source again.
//!
//! It never runs inside the heartbeat loop, and it never blocks a thread while it waits on
//! the network (see `transfer`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use locus_proto::BlobHash;
use tokio::time::Instant;

use crate::store::BlobStore;
use crate::transfer::{self, CopyOptions, RateLimit, Source};
use crate::{Peers, Sources};

/// First retry delay; it doubles with each failure up to `MAX_BACKOFF`.
const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

#[derive(Debug, Clone)]
pub struct RefillConfig {
    pub me: String,
    /// Copies at once.
    pub parallel: usize,
    /// Bytes per second for all refill copies together; 0 = unlimited.
    pub rate: u64,
    pub idle: Duration,
}

/// One blob to bring back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub hash: BlobHash,
    pub size: u64,
    pub chunk_size: u32,
}

#[derive(Debug)]
struct Item {
    want: Wanted,
    attempts: u32,
    due: Instant,
    in_flight: bool,
}

#[derive(Debug, Default)]
struct Queue {
    items: HashMap<BlobHash, Item>,
    /// (due, hash) of every item not in flight: the next due is the first.
    order: BTreeSet<(Instant, BlobHash)>,
    /// Bytes of every item, in flight or not.
    bytes: u64,
    /// Items whose last copy failed (kept as a count: progress is read on every
    /// heartbeat, and the queue may hold millions of blobs).
    failing: u64,
    /// Since the queue last went from empty to non-empty.
    episode: Option<Episode>,
    /// Totals since the node started.
    copied_blobs: u64,
    copied_bytes: u64,
    failures: u64,
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    started: Instant,
    bytes_done: u64,
}

/// What the refill is doing, for heartbeats, metrics and `node list`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    /// Blobs still to copy (including those being copied).
    pub blobs: u64,
    pub bytes: u64,
    /// Bytes copied since this refill began (the queue was last empty).
    pub done_bytes: u64,
    /// Mean bytes per second since this refill began.
    pub rate: u64,
    /// Blobs waiting to be retried after a failed copy.
    pub failing: u64,
    pub copied_blobs: u64,
    pub copied_bytes: u64,
    pub failures: u64,
}

impl Progress {
    /// Seconds to go at the current rate; None while there is no rate yet.
    pub fn eta_secs(&self) -> Option<u64> {
        (self.rate > 0).then(|| self.bytes.div_ceil(self.rate))
    }
}

pub struct Refill {
    cfg: RefillConfig,
    queue: Mutex<Queue>,
    wake: tokio::sync::Notify,
    limit: RateLimit,
    /// Where queued blobs are, asked of the metadata service in batches ahead of the
    /// workers (one request per `LOCATE_BATCH` blobs, not one per blob). An entry is
    /// used once: a retry locates its blob afresh.
    located: Mutex<HashMap<BlobHash, Sources>>,
    /// One batch lookup at a time, so workers do not ask for the same blobs twice.
    locating: tokio::sync::Mutex<()>,
}

/// Blobs located per LocateBlobs request.
const LOCATE_BATCH: usize = 1000;

impl Refill {
    pub fn new(cfg: RefillConfig) -> Arc<Self> {
        Arc::new(Self {
            limit: RateLimit::new(cfg.rate),
            cfg,
            queue: Mutex::new(Queue::default()),
            wake: tokio::sync::Notify::new(),
            located: Mutex::new(HashMap::new()),
            locating: tokio::sync::Mutex::new(()),
        })
    }

    fn q(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the queue exactly `missing`: new blobs are due now, known ones keep their
    /// retry state, blobs no longer wanted are dropped (a copy in flight finishes).
    pub fn set_missing(&self, missing: Vec<Wanted>) {
        let now = Instant::now();
        let mut q = self.q();
        let keep: HashSet<BlobHash> = missing.iter().map(|w| w.hash).collect();
        let gone: Vec<BlobHash> = q.items.keys().filter(|h| !keep.contains(*h)).copied().collect();
        for h in gone {
            q.remove(&h);
        }
        self.located
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|h, _| keep.contains(h));
        for w in missing {
            if q.items.contains_key(&w.hash) {
                continue;
            }
            q.bytes += w.size;
            q.order.insert((now, w.hash));
            q.items.insert(
                w.hash,
                Item {
                    want: w,
                    attempts: 0,
                    due: now,
                    in_flight: false,
                },
            );
        }
        match (q.items.is_empty(), q.episode.is_some()) {
            (true, _) => q.episode = None,
            (false, false) => {
                q.episode = Some(Episode {
                    started: now,
                    bytes_done: 0,
                })
            }
            (false, true) => {}
        }
        drop(q);
        self.wake.notify_waiters();
    }

    pub fn progress(&self) -> Progress {
        let q = self.q();
        let (done_bytes, rate) = match q.episode {
            Some(e) => {
                let secs = e.started.elapsed().as_secs_f64();
                (
                    e.bytes_done,
                    if secs > 0.0 {
                        (e.bytes_done as f64 / secs) as u64
                    } else {
                        0
                    },
                )
            }
            None => (0, 0),
        };
        Progress {
            blobs: q.items.len() as u64,
            bytes: q.bytes,
            done_bytes,
            rate,
            failing: q.failing,
            copied_blobs: q.copied_blobs,
            copied_bytes: q.copied_bytes,
            failures: q.failures,
        }
    }

    /// Takes the next due blob, or says how long until one is due.
    fn next(&self) -> Result<Wanted, Option<Duration>> {
        let now = Instant::now();
        let mut q = self.q();
        let Some(&(due, h)) = q.order.first() else {
            return Err(None);
        };
        if due > now {
            return Err(Some(due - now));
        }
        q.order.remove(&(due, h));
        let it = q.items.get_mut(&h).expect("ordered items are queued");
        it.in_flight = true;
        Ok(it.want)
    }

    fn done(&self, w: &Wanted, copied: bool) {
        let mut q = self.q();
        if q.remove(&w.hash) && copied {
            q.copied_blobs += 1;
            q.copied_bytes += w.size;
            if let Some(e) = q.episode.as_mut() {
                e.bytes_done += w.size;
            }
        }
        if q.items.is_empty() {
            q.episode = None;
        }
    }

    fn failed(&self, w: &Wanted) -> Duration {
        let mut q = self.q();
        q.failures += 1;
        // Not in flight: the blob stopped being wanted while this copy ran and was queued
        // again since; that newer item is waiting with its own schedule.
        let Some(it) = q.items.get_mut(&w.hash).filter(|it| it.in_flight) else {
            return Duration::ZERO;
        };
        it.attempts += 1;
        let first_failure = it.attempts == 1;
        let backoff = MIN_BACKOFF
            .saturating_mul(1 << it.attempts.min(16).saturating_sub(1))
            .min(MAX_BACKOFF);
        it.due = Instant::now() + backoff;
        it.in_flight = false;
        let key = (it.due, w.hash);
        q.order.insert(key);
        if first_failure {
            q.failing += 1;
        }
        backoff
    }

    /// Where `w` is: from the batch located ahead, else located now together with the
    /// next blobs due. None when the lookup failed (the copy then asks for itself).
    async fn sources_for(&self, peers: &Peers, w: &Wanted) -> Option<Sources> {
        let take = |h: &BlobHash| self.located.lock().unwrap_or_else(|p| p.into_inner()).remove(h);
        if let Some(s) = take(&w.hash) {
            return Some(s);
        }
        let _one = self.locating.lock().await;
        if let Some(s) = take(&w.hash) {
            return Some(s);
        }
        let batch: Vec<BlobHash> = {
            let q = self.q();
            let known = self.located.lock().unwrap_or_else(|p| p.into_inner());
            std::iter::once(w.hash)
                .chain(
                    q.order
                        .iter()
                        .map(|(_, h)| *h)
                        .filter(|h| !known.contains_key(h))
                        .take(LOCATE_BATCH - 1),
                )
                .collect()
        };
        match peers.locate_many(&batch).await {
            Ok(found) => {
                let mut known = self.located.lock().unwrap_or_else(|p| p.into_inner());
                known.extend(found);
                known.remove(&w.hash)
            }
            Err(s) => {
                tracing::warn!("cannot locate blobs to refill: {}", s.message());
                None
            }
        }
    }

    /// Runs `parallel` workers until `stop`.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<BlobStore>,
        peers: Arc<Peers>,
        metrics: Arc<crate::metrics::Metrics>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..self.cfg.parallel.max(1) {
            set.spawn(
                self.clone()
                    .worker(store.clone(), peers.clone(), metrics.clone(), stop.clone()),
            );
        }
        while set.join_next().await.is_some() {}
    }

    async fn worker(
        self: Arc<Self>,
        store: Arc<BlobStore>,
        peers: Arc<Peers>,
        metrics: Arc<crate::metrics::Metrics>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let w = match self.next() {
                Ok(w) => w,
                Err(wait) => {
                    // Registered before looking again would race with set_missing; a
                    // bounded sleep makes a missed wake-up cost at most a second.
                    let wait = wait.unwrap_or(MIN_BACKOFF).min(MIN_BACKOFF);
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                    continue;
                }
            };
            let opts = CopyOptions {
                me: &self.cfg.me,
                pin: true,
                team: crate::store::TeamId::NONE,
                idle: self.cfg.idle,
                limit: Some(&self.limit),
                origin: None,
            };
            let known = self.sources_for(&peers, &w).await;
            let copy =
                transfer::copy_from_anywhere(&store, &peers, w.hash, w.size, w.chunk_size, opts, known);
            let r = tokio::select! {
                r = copy => r,
                _ = stop.wait_for(|s| *s) => return,
            };
            match r {
                Ok(Source::Here) => self.done(&w, false),
                Ok(src) => {
                    metrics.wrote(src.kind().unwrap_or("peer"), w.size);
                    metrics.refill_bytes.inc_by(w.size);
                    tracing::debug!(blob = %w.hash, from = ?src, "refilled a pinned blob");
                    self.done(&w, true);
                }
                Err(s) => {
                    let backoff = self.failed(&w);
                    tracing::warn!(
                        blob = %w.hash,
                        retry_in_s = backoff.as_secs(),
                        "cannot refill a pinned blob: {}",
                        s.message()
                    );
                }
            }
        }
    }
}

impl Queue {
    /// Drops an item; true if it was queued.
    fn remove(&mut self, h: &BlobHash) -> bool {
        let Some(it) = self.items.remove(h) else {
            return false;
        };
        if !it.in_flight {
            self.order.remove(&(it.due, *h));
        }
        if it.attempts > 0 {
            self.failing -= 1;
        }
        self.bytes -= it.want.size;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: u8, size: u64) -> Wanted {
        Wanted {
            hash: BlobHash([n; 32]),
            size,
            chunk_size: 0,
        }
    }

    fn refill() -> Arc<Refill> {
        Refill::new(RefillConfig {
            me: "a".into(),
            parallel: 2,
            rate: 0,
            idle: Duration::from_secs(1),
        })
    }

    #[test]
    fn the_queue_is_exactly_what_pin_sync_says_is_missing() {
        let r = refill();
        r.set_missing(vec![w(1, 10), w(2, 20), w(3, 30)]);
        assert_eq!((r.progress().blobs, r.progress().bytes), (3, 60));
        // One is being copied when blob 2 stops being wanted.
        let _in_flight = r.next().unwrap();
        r.set_missing(vec![w(1, 10), w(3, 30)]);
        let p = r.progress();
        assert_eq!((p.blobs, p.bytes), (2, 40));
        r.done(&w(1, 10), true);
        r.done(&w(3, 30), true);
        let p = r.progress();
        assert_eq!((p.blobs, p.bytes, p.copied_blobs, p.copied_bytes), (0, 0, 2, 40));
    }

    #[test]
    fn a_failed_copy_backs_off_exponentially_and_others_go_first() {
        let r = refill();
        r.set_missing(vec![w(1, 10), w(2, 10)]);
        let a = r.next().unwrap();
        assert_eq!(r.failed(&a), Duration::from_secs(1));
        // The failed one is not due; the other is.
        let b = r.next().unwrap();
        assert_ne!(a.hash, b.hash);
        assert!(matches!(r.next(), Err(Some(d)) if d <= Duration::from_secs(1)));
        r.done(&b, true);
        // Two more failures of the same blob: 2 s, then 4 s.
        {
            let mut q = r.q();
            let due = q.items[&a.hash].due;
            q.order.remove(&(due, a.hash));
            q.items.get_mut(&a.hash).unwrap().in_flight = true;
        }
        assert_eq!(r.failed(&a), Duration::from_secs(2));
        assert_eq!(r.progress().failing, 1);
        assert_eq!(r.progress().failures, 2);
        // Copied at last: nothing is failing any more.
        r.done(&a, true);
        assert_eq!((r.progress().failing, r.progress().blobs), (0, 0));
    }

    /// The queue's bookkeeping, checked against its items.
    fn check(r: &Refill) {
        let q = r.q();
        let bytes: u64 = q.items.values().map(|i| i.want.size).sum();
        assert_eq!(q.bytes, bytes, "bytes to go");
        let waiting: Vec<_> = q.items.iter().filter(|(_, i)| !i.in_flight).collect();
        assert_eq!(q.order.len(), waiting.len(), "every waiting item is ordered once");
        for (h, i) in waiting {
            assert!(q.order.contains(&(i.due, *h)), "ordered by its due time");
        }
        let failing = q.items.values().filter(|i| i.attempts > 0).count() as u64;
        assert_eq!(q.failing, failing, "failing count");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(Vec<u8>),
        Take,
        Done(u8, bool),
        Fail(u8),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            proptest::collection::vec(0u8..12, 0..12).prop_map(Op::Set),
            Just(Op::Take),
            (0u8..12, any::<bool>()).prop_map(|(n, c)| Op::Done(n, c)),
            (0u8..12).prop_map(Op::Fail),
        ]
    }

    proptest::proptest! {
        /// Whatever pin sync, the workers and failures do in whatever order, the queue's
        /// counts and order stay exactly those of its items.
        #[test]
        fn the_queue_keeps_its_books_through_any_sequence(ops in proptest::collection::vec(op(), 1..60)) {
            let r = refill();
            let mut taken: Vec<Wanted> = Vec::new();
            for o in ops {
                match o {
                    Op::Set(ns) => r.set_missing(ns.iter().map(|n| w(*n, u64::from(*n) + 1)).collect()),
                    Op::Take => {
                        if let Ok(x) = r.next() {
                            taken.push(x);
                        }
                    }
                    Op::Done(n, copied) => {
                        if let Some(i) = taken.iter().position(|x| x.hash == BlobHash([n; 32])) {
                            r.done(&taken.remove(i), copied);
                        }
                    }
                    Op::Fail(n) => {
                        if let Some(i) = taken.iter().position(|x| x.hash == BlobHash([n; 32])) {
                            let x = taken.remove(i);
                            // Only a copy still wanted comes back to the queue.
                            let wanted = r.q().items.contains_key(&x.hash);
                            r.failed(&x);
                            proptest::prop_assert_eq!(r.q().items.contains_key(&x.hash), wanted);
                        }
                    }
                }
                check(&r);
            }
        }
    }

    #[test]
    fn backoff_stops_growing_at_five_minutes() {
        let r = refill();
        r.set_missing(vec![w(1, 10)]);
        let mut last = Duration::ZERO;
        for _ in 0..30 {
            {
                let mut q = r.q();
                let due = q.items[&BlobHash([1; 32])].due;
                q.order.remove(&(due, BlobHash([1; 32])));
                q.items.get_mut(&BlobHash([1; 32])).unwrap().in_flight = true;
            }
            last = r.failed(&w(1, 10));
        }
        assert_eq!(last, MAX_BACKOFF);
    }
}
