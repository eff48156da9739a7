//! Which committed snapshots a retention policy keeps. Pure, so it is tested alone.
//!
//! Like the usual backup tools: `keep_last` newest snapshots; for `keep_daily` the newest
//! snapshot of each of the last N days that have one; for `keep_weekly` the newest of each
//! of the last M ISO weeks (Monday to Sunday, UTC) that have one. The newest snapshot is
//! always kept, whatever the policy.

use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    pub keep_last: u32,
    pub keep_daily: u32,
    pub keep_weekly: u32,
}

impl Policy {
    pub fn is_empty(&self) -> bool {
        self.keep_last == 0 && self.keep_daily == 0 && self.keep_weekly == 0
    }
}

const DAY_MS: i64 = 86_400_000;

/// `snapshots`: (id, created_ms) of committed snapshots, any order. Returns the ids kept.
pub fn keep(snapshots: &[(String, i64)], p: Policy) -> BTreeSet<String> {
    let mut s: Vec<&(String, i64)> = snapshots.iter().collect();
    // Newest first; ids break ties (they sort by time too).
    s.sort_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
    let mut kept = BTreeSet::new();
    if let Some(newest) = s.first() {
        kept.insert(newest.0.clone());
    }
    for x in s.iter().take(p.keep_last as usize) {
        kept.insert(x.0.clone());
    }
    let mut by_bucket = |n: u32, bucket: &dyn Fn(i64) -> i64| {
        let mut seen = BTreeSet::new();
        for x in &s {
            if seen.len() >= n as usize {
                break;
            }
            if seen.insert(bucket(x.1)) {
                kept.insert(x.0.clone());
            }
        }
    };
    by_bucket(p.keep_daily, &|ms| ms.div_euclid(DAY_MS));
    // 1970-01-01 was a Thursday: day + 3 counts from the Monday before it.
    by_bucket(p.keep_weekly, &|ms| (ms.div_euclid(DAY_MS) + 3).div_euclid(7));
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snaps(hours: &[i64]) -> Vec<(String, i64)> {
        // 2026-11-30 is a Monday; hour offsets from its midnight.
        let base = 20_787 * DAY_MS;
        hours
            .iter()
            .map(|h| (format!("s{h:+04}"), base + h * 3_600_000))
            .collect()
    }

    fn ids(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn newest_is_always_kept() {
        let s = snaps(&[1, 2, 3]);
        assert_eq!(keep(&s, Policy::default()), ids(&["s+003"]));
        assert!(keep(&[], Policy::default()).is_empty());
    }

    #[test]
    fn last_daily_weekly() {
        // Two a day for four days (Mon..Thu), and one eight days earlier.
        let s = snaps(&[-192, 1, 13, 25, 37, 49, 61, 73, 85]);
        let p = Policy {
            keep_last: 2,
            ..Default::default()
        };
        assert_eq!(keep(&s, p), ids(&["s+085", "s+073"]));
        let p = Policy {
            keep_daily: 3,
            ..Default::default()
        };
        // Newest of each of the last three days.
        assert_eq!(keep(&s, p), ids(&["s+085", "s+061", "s+037"]));
        let p = Policy {
            keep_weekly: 2,
            ..Default::default()
        };
        // Newest of this week, and of the latest earlier week that has one (-192 h: Sunday 22nd).
        assert_eq!(keep(&s, p), ids(&["s+085", "s-192"]));
        let p = Policy {
            keep_last: 1,
            keep_daily: 7,
            keep_weekly: 4,
        };
        assert_eq!(keep(&s, p), ids(&["s+085", "s+061", "s+037", "s+013", "s-192"]));
    }
}
