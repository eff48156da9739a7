//! What a mount server needs to take over a live FUSE connection from a predecessor
//! that died (see `locus mount`'s holder): the state INIT negotiated, and the passthrough
//! backing ids it registered, reported as they come and go so the holder can pass them on.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::LocusFs;

/// See `Mount::backing_observer`: (inode, backing id or `None` when closed).
pub type BackingObserver = Arc<dyn Fn(u64, Option<u32>) + Send + Sync>;

/// What init negotiated with the kernel, which a process taking over a live connection
/// must restore (the kernel sends INIT once per connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Negotiated {
    pub passthrough: bool,
    pub kernel_opens: bool,
}

impl LocusFs {
    /// Reports backing ids to `f` (see `Mount::backing_observer`). Call before mounting.
    pub fn with_backing_observer(mut self, f: BackingObserver) -> Self {
        Arc::get_mut(&mut self.mount)
            .expect("set before the filesystem is shared")
            .backing_observer = Some(f);
        self
    }

    /// Takes over a connection another process of this mount initialized: what it
    /// negotiated, and the backing ids it registered (kept for the life of this process,
    /// since files opened with them may stay open; a few dozen ids at most).
    pub fn restore(&self, n: Negotiated, inherited: HashMap<u64, u32>) {
        self.mount
            .core
            .negotiated
            .passthrough
            .store(n.passthrough, Ordering::Relaxed);
        self.mount
            .core
            .negotiated
            .kernel_opens
            .store(n.kernel_opens, Ordering::Relaxed);
        *self.mount.inherited.lock().unwrap() = inherited;
    }
}
