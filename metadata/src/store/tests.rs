//! The store contract, the batch's serialised form, sorted runs and derived rows.

use super::*;
use crate::keys;

/// The batch as older builds defined it, whose serialised form is in Raft logs and
/// messages between members of different builds.
mod old {
    use super::Table;

    mod bytes {
        pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(v)
        }
        pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
            Ok(<&[u8]>::deserialize(d)?.to_vec())
        }
        use serde::Deserialize;
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    pub enum Op {
        Put(
            Table,
            #[serde(with = "bytes")] Vec<u8>,
            #[serde(with = "bytes")] Vec<u8>,
        ),
        Delete(Table, #[serde(with = "bytes")] Vec<u8>),
        DeleteRange(
            Table,
            #[serde(with = "bytes")] Vec<u8>,
            #[serde(with = "bytes")] Vec<u8>,
        ),
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    pub struct Batch {
        pub ops: Vec<Op>,
    }
}

#[test]
fn a_batch_serialises_as_older_builds_wrote_it_and_reads_their_bytes_back() {
    let mut b = Batch::default();
    b.put(Table::Entries, b"k1", vec![7u8; 300]);
    b.delete(Table::Raft, b"applied");
    b.delete_range(Table::BlobShards, b"", [0xffu8; 3]);
    b.put(Table::Meta, b"", b"");
    let old = old::Batch {
        ops: vec![
            old::Op::Put(Table::Entries, b"k1".to_vec(), vec![7u8; 300]),
            old::Op::Delete(Table::Raft, b"applied".to_vec()),
            old::Op::DeleteRange(Table::BlobShards, vec![], vec![0xff; 3]),
            old::Op::Put(Table::Meta, vec![], vec![]),
        ],
    };
    let bytes = bincode::serialize(&old).unwrap();
    assert_eq!(bincode::serialize(&b).unwrap(), bytes, "the same bytes as before");
    let back: Batch = bincode::deserialize(&bytes).unwrap();
    assert_eq!(back, b);
    assert_eq!(back.len(), 4);
    // From a reader too (no borrowing from the input).
    let read: Batch = bincode::deserialize_from(&bytes[..]).unwrap();
    assert_eq!(read, b);
    assert_eq!(
        bincode::deserialize::<old::Batch>(&bincode::serialize(&b).unwrap()).unwrap(),
        old
    );
    let ops: Vec<Op> = b.ops().collect();
    assert_eq!(ops[0], Op::Put(Table::Entries, b"k1", &[7u8; 300]));
    assert_eq!(ops[2], Op::DeleteRange(Table::BlobShards, b"", &[0xff; 3]));
    // A change of a kind no build writes is refused, not misread.
    let mut bad = bytes.clone();
    bad[8] = 9;
    assert!(bincode::deserialize::<Batch>(&bad).is_err());
}

/// A derived change names its rows in 16 bytes, reads back as it was written, and is
/// refused by a build that does not know the kind (a group is upgraded whole).
#[test]
fn a_derived_change_round_trips_and_an_older_build_refuses_it() {
    let mut b = Batch::default();
    b.derive(Table::BlobShards, derive_blob_shards(5, 1, 3));
    b.put(Table::Sessions, b"s", b"v");
    let bytes = bincode::serialize(&b).unwrap();
    assert_eq!(bincode::deserialize::<Batch>(&bytes).unwrap(), b);
    let ops: Vec<Op> = b.ops().collect();
    assert_eq!(
        ops[0],
        Op::Derive(Table::BlobShards, &derive_blob_shards(5, 1, 3))
    );
    let err = bincode::deserialize::<old::Batch>(&bytes).unwrap_err();
    assert!(err.to_string().contains("variant index"), "{err}");
}

/// The blob → shard rows of page 1 of uid 5 (`[1, 2)`): each (blob, shard) of those page
/// rows once, in key order, size and chunk size as the page row says; pages 0 and 2,
/// a shard with no page in the range, another uid and a per-blob row (a namespace's) not
/// at all. `per_page` blobs per page and shard, one repeated in every page.
fn derive_contract(s: &dyn KvStore, per_page: usize) {
    let blob = |i: usize| *blake3::hash(&i.to_le_bytes()).as_bytes();
    let mut b = Batch::default();
    let mut want = std::collections::BTreeMap::new();
    for uid in [5u64, 6] {
        for page in 0..3u32 {
            // Shard 2 has only page 0 (outside the range); shard 7 follows a gap.
            for shard in [0u32, 1, 2, 7].into_iter().filter(|s| *s != 2 || page == 0) {
                // Every page names blob 0 and its own blobs.
                let mut blobs: Vec<([u8; 32], u64)> = std::iter::once(0)
                    .chain((0..per_page).map(|i| 1 + i + per_page * page as usize))
                    .map(|i| (blob(i), i as u64))
                    .collect();
                blobs.sort();
                if uid == 5 && page == 1 {
                    for (h, size) in &blobs {
                        want.insert(
                            keys::blob_shard(h, uid, shard),
                            keys::blob_shard_value(*size, 4096),
                        );
                    }
                }
                b.put(
                    Table::ShardBlobs,
                    keys::shard_blob_page(uid, shard, page),
                    keys::shard_blob_page_value(4096, &blobs),
                );
            }
        }
    }
    b.put(
        Table::ShardBlobs,
        keys::shard_blob(5, 0, &blob(999_999)),
        keys::blob_shard_value(1, 4096),
    );
    s.write(b, true).unwrap();
    let mut b = Batch::default();
    b.derive(Table::BlobShards, derive_blob_shards(5, 1, 2));
    b.put(Table::Sessions, b"progress", b"recorded");
    s.write(b, false).unwrap();
    let got: Vec<(Vec<u8>, Vec<u8>)> = s
        .scan(Table::BlobShards, b"", None)
        .map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
        .collect();
    assert_eq!(
        got.len(),
        3 * (1 + per_page),
        "page 1's blobs, of shards 0, 1 and 7"
    );
    assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    assert_eq!(s.get(Table::Sessions, b"progress").unwrap().unwrap(), b"recorded");

    // A derived change that names another table, or names it wrong, is refused.
    for (t, what) in [
        (Table::Entries, derive_blob_shards(5, 0, 1)),
        (Table::BlobShards, vec![0; 3]),
    ] {
        let mut b = Batch::default();
        b.derive(t, what);
        assert!(s.write(b, false).is_err(), "{t:?}");
    }
}

/// After `derive_contract`: the rest of both uids' rows derived, and the namespace's own
/// index row put, as the catalogue writes them; then uid 5 forgotten with its page rows
/// deleted in the same batch (`forget` writes it). Every row of uid 5 goes, the
/// namespace's included; every row of uid 6 stays. Returns how many rows went.
fn forget_contract(s: &dyn KvStore, forget: impl Fn(Batch)) -> usize {
    let blob = |i: usize| *blake3::hash(&i.to_le_bytes()).as_bytes();
    let mut b = Batch::default();
    b.derive(Table::BlobShards, derive_blob_shards(5, 0, 1));
    b.derive(Table::BlobShards, derive_blob_shards(5, 2, 3));
    b.derive(Table::BlobShards, derive_blob_shards(6, 0, 3));
    b.put(
        Table::BlobShards,
        keys::blob_shard(&blob(999_999), 5, 0),
        keys::blob_shard_value(1, 4096),
    );
    s.write(b, false).unwrap();
    let of = |uid: u64| {
        s.scan(Table::BlobShards, b"", None)
            .filter(|kv| kv.as_ref().unwrap().0[32..40] == uid.to_be_bytes())
            .count()
    };
    let (five, six) = (of(5), of(6));
    assert!(five > 0 && six > 0);
    let mut b = Batch::default();
    b.derive(Table::BlobShards, forget_blob_shards(5));
    let (from, to) = keys::uid_range(5);
    b.delete_range(Table::ShardBlobs, from.clone(), to.clone());
    assert!(b.len() == 2, "the change names the rows, it does not list them");
    forget(b);
    assert_eq!(of(5), 0, "every index row of uid 5, the namespace's too");
    assert_eq!(of(6), six, "uid 6 keeps its rows");
    assert_eq!(s.scan(Table::ShardBlobs, &from, Some(&to)).count(), 0);
    // A forget names one uid in 8 bytes; another table is refused.
    let mut b = Batch::default();
    b.derive(Table::Entries, forget_blob_shards(6));
    assert!(s.write(b, false).is_err());
    five
}

#[test]
fn derived_rows_in_memory() {
    let s = MemStore::default();
    derive_contract(&s, 5);
    forget_contract(&s, |b| s.write(b, true).unwrap());
}

#[test]
fn derived_rows_in_rocksdb_go_in_as_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open(dir.path()).unwrap();
    derive_contract(&s, rocks::INGEST_AT_LEAST);
    assert_eq!(s.memtable_rows(Table::BlobShards), 0);
    // A member's apply, replayed from its log should it stop half-way: the deletes go in
    // as a file too. (The namespace row's put is the memtable's one row, unless RocksDB
    // flushed it because the file overlaps it.)
    forget_contract(&s, |b| s.write_unlogged(b).unwrap());
    assert!(s.memtable_rows(Table::BlobShards) <= 1);
    // A single service's write is atomic: the deletes go with the rest of their batch.
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open(dir.path()).unwrap();
    derive_contract(&s, rocks::INGEST_AT_LEAST);
    let gone = forget_contract(&s, |b| s.write(b, true).unwrap());
    assert!(gone >= rocks::INGEST_AT_LEAST);
    assert_eq!(s.memtable_rows(Table::BlobShards), 1 + gone as u64);
    // Too few to be worth a file: through the memtable, the same rows.
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open(dir.path()).unwrap();
    derive_contract(&s, 3);
    assert_eq!(s.memtable_rows(Table::BlobShards), 3 * (1 + 3));
    forget_contract(&s, |b| s.write_unlogged(b).unwrap());
}

#[test]
fn tables_are_numbered_in_the_order_of_all() {
    for (i, t) in Table::ALL.iter().enumerate() {
        assert_eq!(*t as usize, i, "{t:?}");
    }
}

fn contract(s: &dyn KvStore) {
    let mut b = Batch::default();
    for k in [b"a1".as_slice(), b"a2", b"a3", b"b1"] {
        b.put(Table::Entries, k, k);
    }
    b.put(Table::Shards, b"a1", b"other table");
    s.write(b, true).unwrap();
    let keys: Vec<_> = s
        .scan(Table::Entries, b"a", Some(b"b"))
        .map(|r| r.unwrap().0.to_vec())
        .collect();
    assert_eq!(keys, vec![b"a1".to_vec(), b"a2".to_vec(), b"a3".to_vec()]);
    let mut b = Batch::default();
    b.delete_range(Table::Entries, b"a2", b"b");
    b.delete(Table::Entries, b"b1");
    s.write(b, false).unwrap();
    let keys: Vec<_> = s
        .scan(Table::Entries, b"", None)
        .map(|r| r.unwrap().0.to_vec())
        .collect();
    assert_eq!(keys, vec![b"a1".to_vec()]);
    assert_eq!(s.get(Table::Shards, b"a1").unwrap().unwrap(), b"other table");
    assert_eq!(s.get(Table::Shards, b"a2").unwrap(), None);
    let mut rows = Vec::new();
    s.export(&[Table::Shards, Table::Entries], &mut |t, k, v| {
        rows.push((t, k.to_vec(), v.to_vec()));
        Ok(())
    })
    .unwrap();
    assert_eq!(
        rows,
        vec![
            (Table::Shards, b"a1".to_vec(), b"other table".to_vec()),
            (Table::Entries, b"a1".to_vec(), b"a1".to_vec()),
        ]
    );
}

#[test]
fn mem_store_contract() {
    contract(&MemStore::default());
}

#[test]
fn rocks_store_contract() {
    let dir = tempfile::tempdir().unwrap();
    contract(&RocksStore::open(dir.path()).unwrap());
}

/// A long sorted run into one table bypasses the memtable and reads back like any
/// write: newer than what was there, older than what comes after, the same when
/// written again (a member replaying the entry), and the group's mark beside it kept.
#[test]
fn a_sorted_run_is_ingested_and_reads_like_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open_replicated(dir.path()).unwrap();
    let key = |i: usize| format!("k{i:06}").into_bytes();
    let n = rocks::INGEST_AT_LEAST + 10;
    let mut before = Batch::default();
    before.put(Table::BlobShards, key(7), b"old");
    s.write(before, true).unwrap();
    let mut run = Batch::default();
    for i in 0..n {
        run.put(Table::BlobShards, key(i), format!("v{i}"));
    }
    run.put(Table::Raft, b"applied", b"1");
    s.write_unlogged(run.clone()).unwrap();
    // RocksDB flushed the earlier put (its key is in the run's range) before taking
    // the file; none of the run's rows went into the memtable.
    assert_eq!(s.memtable_rows(Table::BlobShards), 0);
    assert_eq!(s.get(Table::BlobShards, &key(7)).unwrap().unwrap(), b"v7");
    assert_eq!(s.get(Table::Raft, b"applied").unwrap().unwrap(), b"1");
    s.write_unlogged(run).unwrap();
    let mut after = Batch::default();
    after.put(Table::BlobShards, key(9), b"newer");
    s.write(after, true).unwrap();
    let got: Vec<_> = s
        .scan(Table::BlobShards, b"", None)
        .map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
        .collect();
    assert_eq!(got.len(), n);
    for (i, (k, v)) in got.iter().enumerate() {
        assert_eq!(k, &key(i));
        let want = if i == 9 {
            b"newer".to_vec()
        } else {
            format!("v{i}").into_bytes()
        };
        assert_eq!(v, &want, "row {i}");
    }
    assert_eq!(
        std::fs::read_dir(dir.path().join("ingest")).unwrap().count(),
        0,
        "staged files left"
    );

    // Out of order, short, or mixed with another table: the memtable, as before.
    for (i, batch) in [
        (0..n).rev().collect::<Vec<_>>(),
        (0..rocks::INGEST_AT_LEAST - 1).collect(),
    ]
    .into_iter()
    .enumerate()
    {
        let d = tempfile::tempdir().unwrap();
        let s = RocksStore::open(d.path()).unwrap();
        let mut b = Batch::default();
        for j in &batch {
            b.put(Table::BlobShards, key(*j), b"x");
        }
        s.write(b, false).unwrap();
        assert_eq!(s.memtable_rows(Table::BlobShards), batch.len() as u64, "case {i}");
    }
    let d = tempfile::tempdir().unwrap();
    let s = RocksStore::open(d.path()).unwrap();
    let mut b = Batch::default();
    for j in 0..n {
        b.put(Table::BlobShards, key(j), b"x");
    }
    b.put(Table::Entries, b"e", b"x");
    s.write(b, false).unwrap();
    assert_eq!(s.memtable_rows(Table::BlobShards), n as u64);
}

/// A page-like batch (a long run of entries beside a few other rows): a member's apply,
/// which its log replays after a crash, ingests the run ahead of the rest; a single
/// service does so only where the writer allows it (`ingest_first`), and only for a run.
#[test]
fn a_run_beside_other_rows_is_ingested_where_a_crash_between_is_harmless() {
    let key = |i: usize| format!("e{i:06}").into_bytes();
    let n = rocks::INGEST_AT_LEAST + 3;
    let page = |order: &mut dyn Iterator<Item = usize>, first: bool| {
        let mut b = Batch::default();
        for i in order {
            b.put(Table::Entries, key(i), format!("v{i}"));
        }
        b.put(Table::ShardBlobs, b"s1", b"blobs");
        b.put(Table::Sessions, b"u1", b"progress");
        if first {
            b.ingest_first(Table::Entries);
        }
        b
    };
    let check = |s: &RocksStore, case: &str| {
        for i in [0, 1, n / 2, n - 1] {
            assert_eq!(
                s.get(Table::Entries, &key(i)).unwrap().unwrap(),
                format!("v{i}").as_bytes(),
                "{case}"
            );
        }
        assert_eq!(
            s.get(Table::ShardBlobs, b"s1").unwrap().unwrap(),
            b"blobs",
            "{case}"
        );
        assert_eq!(
            s.get(Table::Sessions, b"u1").unwrap().unwrap(),
            b"progress",
            "{case}"
        );
        assert_eq!(s.scan(Table::Entries, b"", None).count(), n, "{case}");
    };

    let d = tempfile::tempdir().unwrap();
    let member = RocksStore::open_replicated(d.path()).unwrap();
    let mut b = page(&mut (0..n), false);
    b.put(Table::Raft, b"applied", b"1");
    member.write_unlogged(b.clone()).unwrap();
    assert_eq!(
        member.memtable_rows(Table::Entries),
        0,
        "a member ingests the run"
    );
    assert_eq!(member.memtable_rows(Table::ShardBlobs), 1);
    // Replayed after a crash: the same rows again.
    member.write_unlogged(b).unwrap();
    check(&member, "member");

    let d = tempfile::tempdir().unwrap();
    let single = RocksStore::open(d.path()).unwrap();
    single.write(page(&mut (0..n), false), false).unwrap();
    assert_eq!(
        single.memtable_rows(Table::Entries),
        n as u64,
        "not allowed: the memtable"
    );
    check(&single, "single, not allowed");

    let d = tempfile::tempdir().unwrap();
    let single = RocksStore::open(d.path()).unwrap();
    single.write(page(&mut (0..n), true), false).unwrap();
    assert_eq!(single.memtable_rows(Table::Entries), 0, "allowed: ingested");
    assert_eq!(single.memtable_rows(Table::Sessions), 1);
    check(&single, "single, allowed");

    let d = tempfile::tempdir().unwrap();
    let single = RocksStore::open(d.path()).unwrap();
    single.write(page(&mut (0..n).rev(), true), false).unwrap();
    assert_eq!(
        single.memtable_rows(Table::Entries),
        n as u64,
        "allowed but not a run"
    );
    check(&single, "single, not a run");
}

#[test]
fn rocks_export_is_one_instant() {
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put(Table::Entries, b"e1", b"old");
    b.put(Table::Shards, b"s1", b"old");
    s.write(b, true).unwrap();
    let mut rows = Vec::new();
    let mut wrote = false;
    s.export(&[Table::Entries, Table::Shards], &mut |t, k, v| {
        if !wrote {
            // Writes landing while the export runs belong to the next one.
            let mut b = Batch::default();
            b.put(Table::Shards, b"s2", b"new");
            b.put(Table::Shards, b"s1", b"changed");
            s.write(b, true).unwrap();
            wrote = true;
        }
        rows.push((t, k.to_vec(), v.to_vec()));
        Ok(())
    })
    .unwrap();
    assert_eq!(
        rows,
        vec![
            (Table::Entries, b"e1".to_vec(), b"old".to_vec()),
            (Table::Shards, b"s1".to_vec(), b"old".to_vec()),
        ]
    );
    assert_eq!(s.get(Table::Shards, b"s1").unwrap().unwrap(), b"changed");
}

#[test]
fn prefix_ends() {
    assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
    assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
    assert_eq!(prefix_end(&[0xff, 0xff]), None);
}
