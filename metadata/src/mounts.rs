//! Which versions mounts are serving now: leases the mounts renew, kept in the leader's
//! memory.
//!
//! A mount announces itself when it starts, renews every `RENEW` and says when it ends.
//! `dataset rm` asks this table before it deletes, so a version is not pulled from under
//! live readers by accident. Leases are not replicated: they are soft state that rebuilds
//! itself within one renewal after a leader change or a restart, and writing every
//! renewal of a thousand hosts through the group's log would buy nothing a delete needs.
//! A lease not renewed in `LAPSE` is forgotten (its host died or lost the network).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a mount renews its lease.
pub const RENEW: Duration = Duration::from_secs(30);
/// A lease not renewed for this long has lapsed: three renewals missed.
pub const LAPSE: Duration = Duration::from_secs(90);

/// One mount of a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub host: String,
    pub mountpoint: String,
    /// The principal that mounted (token name or certificate).
    pub who: String,
}

/// (host, mount point) → (who, last renewal).
type Leases = BTreeMap<(String, String), (String, Instant)>;
/// (dataset, version) → its leases.
type ByVersion = BTreeMap<(String, u64), Leases>;

#[derive(Default)]
pub struct MountLeases {
    by_version: Mutex<ByVersion>,
}

impl MountLeases {
    /// Records a start or a renewal; true when this lease was not held before (a new mount,
    /// or one this leader had not heard of).
    pub fn renew(&self, dataset: &str, version: u64, lease: Lease, now: Instant) -> bool {
        let mut m = self.by_version.lock().unwrap_or_else(|e| e.into_inner());
        Self::expire(&mut m, now);
        m.entry((dataset.to_string(), version))
            .or_default()
            .insert((lease.host, lease.mountpoint), (lease.who, now))
            .is_none()
    }

    /// Drops a lease; true when it was held.
    pub fn end(&self, dataset: &str, version: u64, host: &str, mountpoint: &str) -> bool {
        let mut m = self.by_version.lock().unwrap_or_else(|e| e.into_inner());
        let key = (dataset.to_string(), version);
        let Some(leases) = m.get_mut(&key) else {
            return false;
        };
        let had = leases
            .remove(&(host.to_string(), mountpoint.to_string()))
            .is_some();
        if leases.is_empty() {
            m.remove(&key);
        }
        had
    }

    /// The live leases of one version, or of every version of `dataset` (`None`), with
    /// their versions, oldest version first.
    pub fn live(&self, dataset: &str, version: Option<u64>, now: Instant) -> Vec<(u64, Lease)> {
        let mut m = self.by_version.lock().unwrap_or_else(|e| e.into_inner());
        Self::expire(&mut m, now);
        let lo = (dataset.to_string(), version.unwrap_or(0));
        let hi = (dataset.to_string(), version.unwrap_or(u64::MAX));
        m.range(lo..=hi)
            .flat_map(|((_, v), leases)| {
                leases.iter().map(|((host, mountpoint), (who, _))| {
                    (
                        *v,
                        Lease {
                            host: host.clone(),
                            mountpoint: mountpoint.clone(),
                            who: who.clone(),
                        },
                    )
                })
            })
            .collect()
    }

    fn expire(m: &mut ByVersion, now: Instant) {
        m.retain(|_, leases| {
            leases.retain(|_, (_, seen)| now.saturating_duration_since(*seen) < LAPSE);
            !leases.is_empty()
        });
    }
}

/// Why a delete is refused while mounts serve what it would delete, naming where (the
/// first few mounts) and what to do.
pub fn busy_message(what: &str, live: &[(u64, Lease)], dataset: &str) -> String {
    let shown: Vec<String> = live
        .iter()
        .take(5)
        .map(|(v, l)| format!("{dataset}@{v} on {} at {}", l.host, l.mountpoint))
        .collect();
    let more = live.len().saturating_sub(shown.len());
    format!(
        "{what} is mounted: {}{}. Unmount first (`locus umount MOUNTPOINT` on each host), or \
         delete anyway with --force: readers of those mounts then fail once the bytes are collected",
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(host: &str, mp: &str) -> Lease {
        Lease {
            host: host.into(),
            mountpoint: mp.into(),
            who: "reader".into(),
        }
    }

    #[test]
    fn a_lease_is_live_until_it_ends_or_lapses_and_is_kept_per_version() {
        let t = MountLeases::default();
        let t0 = Instant::now();
        assert!(t.renew("ds", 1, lease("a", "/m"), t0));
        assert!(
            !t.renew("ds", 1, lease("a", "/m"), t0),
            "a renewal is not a new mount"
        );
        assert!(t.renew("ds", 2, lease("b", "/m"), t0));
        assert!(t.renew("dsx", 1, lease("c", "/m"), t0));
        assert_eq!(t.live("ds", Some(1), t0), vec![(1, lease("a", "/m"))]);
        assert_eq!(t.live("ds", None, t0).len(), 2, "both versions of ds, not dsx");
        assert!(t.live("ds", Some(3), t0).is_empty());

        assert!(t.end("ds", 1, "a", "/m"));
        assert!(!t.end("ds", 1, "a", "/m"), "ended once");
        assert!(t.live("ds", Some(1), t0).is_empty());

        // Renewed just inside the lapse: live; not renewed for LAPSE: gone.
        let later = t0 + LAPSE - Duration::from_secs(1);
        assert_eq!(t.live("ds", Some(2), later).len(), 1);
        assert!(t.live("ds", Some(2), t0 + LAPSE).is_empty());
        assert!(
            t.renew("ds", 2, lease("b", "/m"), t0 + LAPSE),
            "a lapsed lease is new again"
        );
    }

    #[test]
    fn the_busy_message_names_the_mounts_and_both_ways_out() {
        let live: Vec<_> = (0..7).map(|i| (3, lease(&format!("h{i}"), "/mnt/x"))).collect();
        let m = busy_message("ds@3", &live, "ds");
        assert!(m.contains("ds@3 on h0 at /mnt/x"), "{m}");
        assert!(m.contains("and 2 more"), "{m}");
        assert!(m.contains("locus umount") && m.contains("--force"), "{m}");
    }
}
