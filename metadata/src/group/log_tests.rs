//! The segment log: openraft's storage suite, and what a restart finds after appends,
//! truncations, purges, a torn append, damage and a log left by older builds.

use std::fs::OpenOptions;
use std::path::Path;

use openraft::{CommittedLeaderId, EntryPayload};

use super::*;
use crate::group::segments::{RECENT_BYTES, RECENT_ENTRIES};
use crate::store::{Batch, RocksStore, Table};

struct Builder;

impl
    openraft::testing::StoreBuilder<
        TypeConfig,
        LogStore,
        super::super::state::StateMachine,
        tempfile::TempDir,
    > for Builder
{
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, super::super::state::StateMachine), SErr> {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
        // Small segments, so that the suite's appends, truncations and purges cross them.
        let log = LogStore::open_rolling_at(&dir.path().join("raft-log"), store.clone(), 200).unwrap();
        let sm = super::super::state::StateMachine::open(
            store,
            &dir.path().join("raft-snapshots"),
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        )
        .unwrap();
        Ok((dir, log, sm))
    }
}

/// openraft's storage suite, every case but `transfer_snapshot`: that one swaps the file
/// handle openraft gave the receiving state machine for the sender's, which a state
/// machine that installs from its receiving file by path (as this one does, and as
/// openraft's own transfer does) never sees.
#[tokio::test(flavor = "multi_thread")]
async fn the_segment_log_passes_openraft_storage_suite() {
    use openraft::testing::{StoreBuilder, Suite};
    type S = Suite<TypeConfig, LogStore, super::super::state::StateMachine, Builder, tempfile::TempDir>;
    macro_rules! run {
        ($($case:ident)*) => {$(
            let (_dir, log, sm) = Builder.build().await.unwrap();
            S::$case(log, sm).await.unwrap_or_else(|e| panic!("{}: {e}", stringify!($case)));
        )*};
    }
    run!(last_membership_in_log_initial
        last_membership_in_log
        last_membership_in_log_multi_step
        get_membership_initial
        get_membership_from_log_and_empty_sm
        get_membership_from_empty_log_and_sm
        get_membership_from_log_le_sm_last_applied
        get_membership_from_log_gt_sm_last_applied_1
        get_membership_from_log_gt_sm_last_applied_2
        get_initial_state_without_init
        get_initial_state_membership_from_log_and_sm
        get_initial_state_with_state
        get_initial_state_last_log_gt_sm
        get_initial_state_last_log_lt_sm
        get_initial_state_log_ids
        get_initial_state_re_apply_committed
        save_vote
        get_log_entries
        limited_get_log_entries
        try_get_log_entry
        initial_logs
        get_log_state
        get_log_id
        last_id_in_log
        last_applied_state
        purge_logs_upto_0
        purge_logs_upto_5
        purge_logs_upto_20
        delete_logs_since_11
        delete_logs_since_0
        append_to_log
        snapshot_meta
        apply_single
        apply_multiple);
}

fn entry(index: u64, term: u64, bytes: usize) -> Entry<TypeConfig> {
    let mut b = Batch::default();
    b.put(Table::Meta, format!("k{index}"), vec![index as u8; bytes]);
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
        payload: EntryPayload::Normal(b),
    }
}

fn append(log: &LogStore, from: u64, to: u64, term: u64) {
    let records = (from..to)
        .map(|i| {
            let e = entry(i, term, 100);
            Appended {
                id: e.log_id,
                record: record_of(&e).unwrap(),
                entry: Some(e),
            }
        })
        .collect();
    log.segs().append(records).unwrap();
}

/// What is read back is what was appended, whether it comes from the entries kept in
/// memory since their append or from the segment files; a truncation and a purge drop
/// what they drop from both.
#[tokio::test(flavor = "multi_thread")]
async fn entries_read_back_the_same_from_memory_and_from_their_segments() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log");
    let state = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
    let n = RECENT_ENTRIES as u64 + 100;
    let mut log = LogStore::open_rolling_at(&path, state.clone(), 1 << 16).unwrap();
    append(&log, 1, n + 1, 1);
    {
        let s = log.segs();
        assert_eq!(s.recent.len(), RECENT_ENTRIES, "bounded");
        assert_eq!(
            s.recent.front().unwrap().0.log_id.index,
            n + 1 - RECENT_ENTRIES as u64
        );
    }
    let want = |i: u64, term: u64| entry(i, term, 100);
    let got = log.try_get_log_entries(1..n + 1).await.unwrap();
    assert_eq!(got.len() as u64, n);
    for (i, e) in (1..).zip(&got) {
        assert_eq!(*e, want(i, 1), "entry {i}");
    }
    // Conflicting entries from n - 10 on go; new ones of term 2 take their place.
    log.truncate(LogId::new(CommittedLeaderId::new(1, 1), n - 10))
        .await
        .unwrap();
    append(&log, n - 10, n - 5, 2);
    log.purge(LogId::new(CommittedLeaderId::new(1, 1), n - 20))
        .await
        .unwrap();
    let got = log.try_get_log_entries(0..u64::MAX).await.unwrap();
    let expect: Vec<_> = (n - 19..n - 10)
        .map(|i| want(i, 1))
        .chain((n - 10..n - 5).map(|i| want(i, 2)))
        .collect();
    assert_eq!(got, expect);
    assert_eq!(log.segs().recent.front().unwrap().0.log_id.index, n - 19);
    // From the files alone, after a reopen: the same.
    drop(log);
    let mut log = LogStore::open_rolling_at(&path, state, 1 << 16).unwrap();
    assert!(log.segs().recent.is_empty());
    assert_eq!(log.try_get_log_entries(0..u64::MAX).await.unwrap(), expect);
}

/// However large its entries (manifest pages are ~4 MiB), the log keeps no more than
/// `RECENT_BYTES` of them in memory: the newest that fit. The older ones read back from
/// their segments, the same.
#[tokio::test(flavor = "multi_thread")]
async fn entries_kept_in_memory_stay_within_their_byte_bound() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
    let mut log = LogStore::open_rolling_at(&dir.path().join("raft-log"), state, 64 << 20).unwrap();
    let big = 4 << 20;
    let n = (RECENT_BYTES / big + 8) as u64;
    let mut record_len = 0;
    for i in 1..=n {
        let e = entry(i, 1, big);
        let record = record_of(&e).unwrap();
        record_len = record.len();
        log.segs()
            .append(vec![Appended {
                id: e.log_id,
                record,
                entry: Some(e),
            }])
            .unwrap();
    }
    {
        let s = log.segs();
        let held: usize = s.recent.iter().map(|(_, b)| b).sum();
        assert!(held <= RECENT_BYTES, "{held} bytes held, bound {RECENT_BYTES}");
        assert!(
            held + record_len > RECENT_BYTES,
            "as many as fit are kept: {held} bytes held"
        );
        assert_eq!(s.recent.back().unwrap().0.log_id.index, n, "the newest");
        assert!(s.recent.len() < n as usize);
    }
    let got = log.try_get_log_entries(1..n + 1).await.unwrap();
    assert_eq!(got.len() as u64, n);
    for (i, e) in (1..).zip(&got) {
        assert!(*e == entry(i, 1, big), "entry {i}");
    }
}

fn segment_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

async fn indices(log: &mut LogStore) -> Vec<u64> {
    log.try_get_log_entries(0..u64::MAX)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.log_id.index)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn entries_survive_a_reopen_after_appends_a_truncation_and_a_purge() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log");
    let state = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
    {
        let mut log = LogStore::open_rolling_at(&path, state.clone(), 300).unwrap();
        append(&log, 1, 21, 1);
        assert!(segment_files(&path).len() > 3, "{:?}", segment_files(&path));
        // The leader changed: entries from 15 on conflict and go; 15.. come again in term 2.
        log.truncate(LogId::new(CommittedLeaderId::new(1, 1), 15))
            .await
            .unwrap();
        assert_eq!(log.get_log_state().await.unwrap().last_log_id.unwrap().index, 14);
        append(&log, 15, 18, 2);
        log.purge(LogId::new(CommittedLeaderId::new(1, 1), 7))
            .await
            .unwrap();
        assert_eq!(indices(&mut log).await, (8..18).collect::<Vec<_>>());
    }
    let files = segment_files(&path);
    let first: u64 = files[0].trim_end_matches(".seg").parse().unwrap();
    assert!(
        first > 1 && first <= 8,
        "segments holding only purged entries are deleted: {files:?}"
    );
    let mut log = LogStore::open_rolling_at(&path, state.clone(), 300).unwrap();
    assert_eq!(indices(&mut log).await, (8..18).collect::<Vec<_>>());
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id.unwrap().index, 7);
    assert_eq!(
        state.last_log_id.unwrap(),
        LogId::new(CommittedLeaderId::new(2, 1), 17)
    );
    let e = log.try_get_log_entries(16..17).await.unwrap();
    assert_eq!(
        e[0].log_id.leader_id.term, 2,
        "the entry appended after the truncation"
    );
    assert!(!log.is_empty().unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_torn_last_record_is_cut_off_and_damage_elsewhere_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log");
    let state = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
    {
        let log = LogStore::open_rolling_at(&path, state.clone(), 300).unwrap();
        append(&log, 1, 11, 1);
    }
    let files = segment_files(&path);
    let last = path.join("segments").join(files.last().unwrap());
    // An append that never returned: half a record at the end of the last segment.
    let torn = record(11, &bincode::serialize(&entry(11, 1, 100)).unwrap());
    let mut f = OpenOptions::new().append(true).open(&last).unwrap();
    std::io::Write::write_all(&mut f, &torn[..torn.len() / 2]).unwrap();
    let before = std::fs::metadata(&last).unwrap().len();
    {
        let mut log = LogStore::open_rolling_at(&path, state.clone(), 300).unwrap();
        assert_eq!(indices(&mut log).await, (1..11).collect::<Vec<_>>());
        assert_eq!(
            std::fs::metadata(&last).unwrap().len(),
            before - (torn.len() / 2) as u64
        );
        // It appends where the cut record was.
        append(&log, 11, 12, 1);
        assert_eq!(indices(&mut log).await, (1..12).collect::<Vec<_>>());
    }
    // A whole header whose length claims far more than the file holds: cut off at open,
    // never read or allocated.
    let last_now = path.join("segments").join(segment_files(&path).last().unwrap());
    let len_now = std::fs::metadata(&last_now).unwrap().len();
    let mut huge = record(12, b"x");
    huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut f = OpenOptions::new().append(true).open(&last_now).unwrap();
    std::io::Write::write_all(&mut f, &huge).unwrap();
    {
        let mut log = LogStore::open_rolling_at(&path, state.clone(), 300).unwrap();
        assert_eq!(indices(&mut log).await, (1..12).collect::<Vec<_>>());
        assert_eq!(std::fs::metadata(&last_now).unwrap().len(), len_now);
    }
    // A flipped byte in a segment that is not the last: refused, naming the file.
    let first = path.join("segments").join(&files[0]);
    let mut bytes = std::fs::read(&first).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff;
    std::fs::write(&first, bytes).unwrap();
    let e = LogStore::open_rolling_at(&path, state.clone(), 300)
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(msg.contains(&files[0]) && msg.contains("checksum"), "{msg}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_log_kept_in_rocksdb_by_older_builds_moves_into_segments() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log");
    let state = Arc::new(RocksStore::open_replicated(&dir.path().join("db")).unwrap());
    {
        // The layout older builds wrote: entries in the `log` column family.
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let db = DB::open_cf_descriptors(
            &opts,
            &path,
            ["log", "meta"].map(|n| ColumnFamilyDescriptor::new(n, Options::default())),
        )
        .unwrap();
        let cf = db.cf_handle("log").unwrap();
        for i in 1..6u64 {
            db.put_cf(cf, i.to_be_bytes(), bincode::serialize(&entry(i, 3, 50)).unwrap())
                .unwrap();
        }
        // Purged up to 2, the deletion not made.
        let purged: LogId<u64> = LogId::new(CommittedLeaderId::new(3, 1), 2);
        db.put_cf(
            db.cf_handle("meta").unwrap(),
            PURGED,
            bincode::serialize(&purged).unwrap(),
        )
        .unwrap();
    }
    let mut log = LogStore::open(&path, state.clone()).unwrap();
    assert_eq!(indices(&mut log).await, vec![3, 4, 5]);
    assert_eq!(log.get_log_state().await.unwrap().last_log_id.unwrap().index, 5);
    // A move that stopped after writing the segments, before deleting the old entries:
    // the next start must not append them twice.
    {
        let cf = log.cf("log");
        for i in 3..6u64 {
            log.meta
                .put_cf(cf, i.to_be_bytes(), bincode::serialize(&entry(i, 3, 50)).unwrap())
                .unwrap();
        }
    }
    drop(log);
    let mut log = LogStore::open(&path, state.clone()).unwrap();
    assert_eq!(
        indices(&mut log).await,
        vec![3, 4, 5],
        "the interrupted move is not repeated"
    );
    let left = log.meta.iterator_cf(log.cf("log"), IteratorMode::Start).count();
    assert_eq!(left, 0, "the old entries are deleted once moved");
    drop(log);
    let mut log = LogStore::open(&path, state.clone()).unwrap();
    assert_eq!(indices(&mut log).await, vec![3, 4, 5]);
}
