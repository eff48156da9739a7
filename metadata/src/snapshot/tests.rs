use super::*;
use crate::store::MemStore;

fn sample() -> MemStore {
    let s = MemStore::default();
    let mut b = Batch::default();
    b.put(Table::Meta, keys::META_CLUSTER_ID, b"c1");
    let rec = VersionRecord {
        uid: 7,
        bytes: 300,
        chunk_size: 4 << 20,
        ..Default::default()
    };
    b.put(Table::Versions, keys::version("ds", 1), rec.encode_to_vec());
    let shard = ShardRecord {
        bytes: 300,
        files: 2,
        replicas: vec!["n2".into(), "n1".into()],
    };
    b.put(Table::Shards, keys::shard(7, 0), shard.encode_to_vec());
    for (h, size) in [(BlobHash::of(b"a"), 100u64), (BlobHash::of(b"b"), 200)] {
        let mut k = keys::shard(7, 0);
        k.extend_from_slice(&h.0);
        let mut v = size.to_be_bytes().to_vec();
        v.extend_from_slice(&(4u32 << 20).to_be_bytes());
        b.put(Table::ShardBlobs, k, v);
    }
    // An open session (uid 9) and its rows stay out of the export.
    b.put(Table::Sessions, keys::uid(9), b"s");
    b.put(Table::Entries, keys::entry(9, "x"), b"e");
    let file = crate::records::EntryRecord {
        kind: crate::records::KIND_FILE,
        size: 100,
        blob: BlobHash::of(b"a").0.to_vec(),
        chunks: BlobHash::of(b"a").0.to_vec(),
        ..Default::default()
    };
    b.put(Table::Entries, keys::entry(7, "a"), file.encode_to_vec());
    s.write(b, true).unwrap();
    s
}

#[test]
fn export_restore_and_plan() {
    let s = sample();
    let mut out = Vec::new();
    let st = export(&s, &mut out).unwrap();
    assert_eq!(st.bytes, out.len() as u64);
    assert_eq!(st.rows, 6);

    let p = plan(&out[..]).unwrap();
    assert_eq!(p.cluster_id, "c1");
    assert_eq!(p.datasets["ds"], (vec![1], 300));
    assert_eq!(p.blobs.len(), 2);
    assert!(p.blobs.iter().all(|b| b.replicas == ["n2", "n1"]));

    let fresh = MemStore::default();
    let r = restore(&out[..], &fresh, "file:///b", "snap1", None).unwrap();
    assert_eq!(r.rows, 6);
    assert_eq!(
        fresh.get(Table::Entries, &keys::entry(7, "a")).unwrap(),
        s.get(Table::Entries, &keys::entry(7, "a")).unwrap()
    );
    assert!(fresh.get(Table::Entries, &keys::entry(9, "x")).unwrap().is_none());
    assert!(fresh.get(Table::Sessions, &keys::uid(9)).unwrap().is_none());
    let rec =
        crate::records::BackupRecord::decode(&fresh.get(Table::Backups, b"file:///b").unwrap().unwrap()[..])
            .expect("the restore source is recorded as a backup record");
    assert_eq!((rec.snapshot.as_str(), rec.restored), ("snap1", true));
    // A catalogue is restored only as the cluster its manifest names.
    restore(&out[..], &MemStore::default(), "file:///b", "snap1", Some("c1")).unwrap();
    let e = restore(&out[..], &MemStore::default(), "file:///b", "snap1", Some("c2"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cluster c1's but its manifest names cluster c2"),
        "{e}"
    );
}

/// A row that would not pass the API (a path with `..`, a short hash, a bad node id)
/// is refused by restore, and so is a session row, which exports never carry.
#[test]
fn restored_rows_are_checked_like_api_input() {
    let bad_rows: Vec<(Table, Vec<u8>, Vec<u8>)> = vec![
        (Table::Entries, keys::entry(7, "../etc/passwd"), {
            let f = crate::records::EntryRecord {
                kind: crate::records::KIND_FILE,
                size: 1,
                blob: vec![0; 32],
                ..Default::default()
            };
            f.encode_to_vec()
        }),
        (Table::Entries, keys::entry(7, "short-hash"), {
            let f = crate::records::EntryRecord {
                kind: crate::records::KIND_FILE,
                size: 1,
                blob: vec![0; 31],
                ..Default::default()
            };
            f.encode_to_vec()
        }),
        (Table::Shards, keys::shard(7, 1), {
            let s = ShardRecord {
                replicas: vec!["bad id!".into()],
                ..Default::default()
            };
            s.encode_to_vec()
        }),
        (Table::Versions, keys::version("ok", 1), {
            let v = VersionRecord {
                chunk_size: 0,
                ..Default::default()
            };
            v.encode_to_vec()
        }),
    ];
    for (i, (t, k, v)) in bad_rows.into_iter().enumerate() {
        // In the store an export is made from, as a buggy build would have written it.
        let s = sample();
        let mut b = Batch::default();
        b.put(t, k, v);
        s.write(b, true).unwrap();
        let mut planted = Vec::new();
        export(&s, &mut planted).unwrap();
        let fresh = MemStore::default();
        let e = restore(&planted[..], &fresh, "file:///b", "snap1", None).unwrap_err();
        assert!(matches!(e, SnapshotError::Corrupt(_)), "row {i}: {e}");
    }
    assert!(crate::rows::check_row(Table::Sessions, &keys::uid(9), b"s").is_err());
    // The untouched export still restores.
    let mut out = Vec::new();
    export(&sample(), &mut out).unwrap();
    restore(&out[..], &MemStore::default(), "file:///b", "snap1", None).unwrap();
}

#[test]
fn one_version_comes_back_out() {
    let s = sample();
    let mut out = Vec::new();
    export(&s, &mut out).unwrap();
    let v = version_from_export(&out[..], "ds", None).unwrap();
    assert_eq!(v.number, 1);
    assert_eq!(v.entries.len(), 1);
    assert_eq!(v.entries[0].path, "a");
    assert_eq!(v.entries[0].size, 100);
    assert_eq!(v.shards.len(), 1);
    assert!(v.shards[0].replicas.is_empty());
    assert_eq!(v.shard_blobs[0].len(), 2);
    assert!(version_from_export(&out[..], "ds", Some(2)).is_err());
    let e = version_from_export(&out[..], "other", None).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");
}

#[test]
fn damage_is_detected() {
    let mut out = Vec::new();
    export(&sample(), &mut out).unwrap();
    for cut in [0, 10, 30, out.len() - 1] {
        assert!(plan(&out[..cut]).is_err(), "cut at {cut}");
    }
    let mut flipped = out.clone();
    flipped[40] ^= 0x20;
    assert!(plan(&flipped[..]).is_err());
    let mut longer = out.clone();
    longer.push(0);
    assert!(plan(&longer[..]).is_err());
    let mut other_schema = out.clone();
    other_schema[21] = 99;
    let e = plan(&other_schema[..]).unwrap_err();
    assert!(e.to_string().contains("schema"), "{e}");
}

/// Schema 2's row per page beside schema 1's row per blob (a blob in both, one in the page
/// row only): each blob is planned and exported once, in hash order; an export whose
/// header says schema 1 (made by an older build) is read as it is.
#[test]
fn an_export_of_either_schema_reads_rows_of_either_form() {
    let s = sample();
    let (b_hash, c_hash) = (BlobHash::of(b"b"), BlobHash::of(b"c"));
    let mut page = [(b_hash.0, 200u64), (c_hash.0, 50)];
    page.sort();
    let mut b = Batch::default();
    b.put(
        Table::ShardBlobs,
        keys::shard_blob_page(7, 0, 3),
        keys::shard_blob_page_value(4 << 20, &page),
    );
    s.write(b, true).unwrap();
    let mut out = Vec::new();
    export(&s, &mut out).unwrap();
    let p = plan(&out[..]).unwrap();
    let mut planned: Vec<_> = p.blobs.iter().map(|b| (b.hash, b.size)).collect();
    planned.sort_by_key(|x| x.0 .0);
    let mut want = vec![(BlobHash::of(b"a"), 100), (b_hash, 200), (c_hash, 50)];
    want.sort_by_key(|x| x.0 .0);
    assert_eq!(planned, want);
    let v = version_from_export(&out[..], "ds", None).unwrap();
    assert_eq!(v.shard_blobs[0], want);
    restore(&out[..], &MemStore::default(), "file:///b", "snap1", None).unwrap();

    // The same export as a schema-1 build labels it (the checksum made again).
    let mut old = out.clone();
    old[18..22].copy_from_slice(&1u32.to_be_bytes());
    let end = old.len() - 32;
    let sum = *blake3::hash(&old[..end]).as_bytes();
    old[end..].copy_from_slice(&sum);
    assert_eq!(plan(&old[..]).unwrap().blobs.len(), 3);
}
