//! Teams' shares of the cache on a real store: whose blobs a write may evict.

use super::super::tests::{check_books, open};
use super::*;
use crate::store::StoreError;
use std::sync::Arc;

const BLOB: usize = 10_000;

/// Stores a blob of `BLOB` bytes of `fill` cached for `keep`.
fn put(s: &Arc<BlobStore>, fill: u16, keep: Keep) -> Result<BlobHash, StoreError> {
    let data: Vec<u8> = (0..BLOB)
        .map(|i| (i as u16 ^ fill.wrapping_mul(7919)) as u8)
        .collect();
    let data = [&fill.to_le_bytes()[..], &data[2..]].concat();
    let h = BlobHash::of(&data);
    if let Some(mut w) = s.begin_write(h, data.len() as u64, 1 << 16, keep)? {
        w.write(&data)?;
        w.finish()?;
    }
    Ok(h)
}

fn cached(team: TeamId) -> Keep {
    Keep { pin: false, team }
}

#[test]
fn a_teams_reads_evict_its_own_blobs_never_another_teams_within_its_share() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 10 * BLOB as u64);
    let (a, b) = (s.team("team-a", 500), s.team("team-b", 500));
    assert_ne!(a, b);
    assert_eq!(s.team("team-a", 500), a, "a team keeps its id");
    let bs: Vec<BlobHash> = (0..4).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
    // Team A reads far more than the node holds: its own older blobs make room.
    let as_: Vec<BlobHash> = (0..30).map(|i| put(&s, i, cached(a)).unwrap()).collect();
    for h in &bs {
        assert!(
            s.contains(h),
            "team B's blob within its share was evicted by team A's reads"
        );
    }
    assert!(s.contains(as_.last().unwrap()));
    assert!(!s.contains(&as_[0]), "team A's oldest blob made room");
    let used = s.team_use();
    let of = |n: &str| used.iter().find(|u| u.name == n).unwrap().cached;
    assert_eq!(of("team-b"), 4 * BLOB as u64);
    assert_eq!(of("team-a"), 6 * BLOB as u64, "team A filled the rest, not more");
    check_books(&s);
}

#[test]
fn a_team_over_its_share_loses_only_the_excess_to_another_team() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 10 * BLOB as u64);
    let (a, b) = (s.team("team-a", 500), s.team("team-b", 300));
    let bs: Vec<BlobHash> = (0..8).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
    // B's oldest go first down to its share (30% of the 10 blobs' room: 3 blobs), then
    // the untagged blobs (an unscoped reader's), then A's own.
    let x = put(&s, 2000, Keep::default()).unwrap();
    put(&s, 2001, Keep::default()).unwrap();
    for i in 0..10 {
        put(&s, i, cached(a)).unwrap();
    }
    assert!(!s.contains(&x), "untagged blobs are anyone's to evict");
    let kept: Vec<bool> = bs.iter().map(|h| s.contains(h)).collect();
    assert_eq!(
        kept,
        [false, false, false, false, false, true, true, true],
        "team B kept its most recent blobs, about its share"
    );
    check_books(&s);
}

#[test]
fn a_write_is_refused_when_only_other_teams_shares_hold_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 10 * BLOB as u64);
    let (a, b) = (s.team("team-a", 0), s.team("team-b", 1000));
    let bs: Vec<BlobHash> = (0..10).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
    let err = put(&s, 1, cached(a)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Full { .. }), "{msg}");
    assert!(
        msg.contains("team team-b holds"),
        "the refusal says whose share holds the room: {msg}"
    );
    assert!(bs.iter().all(|h| s.contains(h)));
    // The team's own reads still make room for themselves.
    put(&s, 1010, cached(b)).unwrap();
    assert!(!s.contains(&bs[0]));
    check_books(&s);
}

#[test]
fn replicas_shrink_every_share_and_are_never_refused_room_for_them() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 10 * BLOB as u64);
    let b = s.team("team-b", 1000);
    let bs: Vec<BlobHash> = (0..10).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
    // A pinned write (an import's replica) takes room from the cache whatever its team:
    // the quota, not the share, bounds what replicas may take.
    for i in 0..4 {
        put(&s, i, true.into()).unwrap();
    }
    assert_eq!(bs.iter().filter(|h| s.contains(h)).count(), 6);
    assert!(
        s.contains(&bs[9]) && !s.contains(&bs[3]),
        "least recently used first"
    );
    check_books(&s);
}

#[test]
fn a_replica_takes_untagged_blobs_before_any_share_shrinks() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path(), 10 * BLOB as u64);
    let b = s.team("team-b", 500);
    // Team B's blobs are the oldest, within its half; then five untagged ones.
    let bs: Vec<BlobHash> = (0..5).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
    let xs: Vec<BlobHash> = (0..5)
        .map(|i| put(&s, 2000 + i, Keep::default()).unwrap())
        .collect();
    // A replica: least recently used, and B's share of the room the replica leaves (4.5
    // blobs), would take B's oldest; an untagged blob goes instead.
    put(&s, 1, true.into()).unwrap();
    assert!(
        bs.iter().all(|h| s.contains(h)),
        "a share shrank while untagged blobs were there"
    );
    assert_eq!(xs.iter().filter(|h| s.contains(h)).count(), 4);
    // The next one finds B beyond its share of the smaller room (5 of 4.5 blobs' worth):
    // the shares shrink with the room replicas take.
    put(&s, 2, true.into()).unwrap();
    assert!(!s.contains(&bs[0]));
    check_books(&s);
}

#[test]
fn tags_and_shares_survive_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let (bs, a) = {
        let s = open(d.path(), 10 * BLOB as u64);
        let (a, b) = (s.team("team-a", 400), s.team("team-b", 600));
        let bs: Vec<BlobHash> = (0..5).map(|i| put(&s, 1000 + i, cached(b)).unwrap()).collect();
        (bs, a)
    };
    let s = open(d.path(), 10 * BLOB as u64);
    let used = s.team_use();
    assert_eq!(
        used.iter()
            .map(|u| (u.name.as_str(), u.permille, u.cached))
            .collect::<Vec<_>>(),
        [("team-a", 400, 0), ("team-b", 600, 5 * BLOB as u64)]
    );
    check_books(&s);
    // Protected before any grant names the teams again.
    for i in 0..20 {
        put(&s, i, cached(a)).unwrap();
    }
    assert!(
        bs.iter().all(|h| s.contains(h)),
        "team B's cache survived a restart and A's reads"
    );
    check_books(&s);
}
