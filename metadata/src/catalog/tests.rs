use std::sync::Arc;

use locus_proto::manifest::{BlobHash, Entry, EntryKind, RelPath};

use super::*;
use crate::store::MemStore;
use crate::ManualClock;

pub(super) struct Fixture {
    pub(super) cat: Catalog,
    pub(super) clock: Arc<ManualClock>,
}

pub(super) fn fixture() -> Fixture {
    fixture_on(Arc::new(MemStore::default()))
}

/// A catalogue on `store` (a RocksDB store where how rows are written matters).
pub(super) fn fixture_on(store: Arc<dyn KvStore>) -> Fixture {
    let clock = Arc::new(ManualClock::default());
    clock.advance_ms(1_000_000);
    let cat = Catalog::open(
        store,
        clock.clone(),
        CatalogConfig {
            liveness_timeout: Duration::from_secs(10),
            session_timeout: Duration::from_secs(60),
            repair_interval: Duration::from_secs(1),
            cost: Default::default(),
            teams: Vec::new(),
        },
    )
    .unwrap();
    Fixture { cat, clock }
}

pub(super) fn dir(p: &str) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::Dir,
        mode: 0o755,
        mtime_ns: 1,
    }
}

pub(super) fn file(p: &str, size: u64, shard: u32) -> Entry {
    Entry {
        path: RelPath::try_from(p).unwrap(),
        kind: EntryKind::File {
            size,
            blob: BlobHash::of(p.as_bytes()),
            chunks: (0..chunk_count_4m(size))
                .map(|i| BlobHash::of(&[i as u8]))
                .collect(),
            shard,
        },
        mode: 0o644,
        mtime_ns: 2,
    }
}

fn chunk_count_4m(size: u64) -> u64 {
    size.div_ceil(4 << 20)
}

pub(super) fn name(s: &str) -> DatasetName {
    DatasetName::try_from(s).unwrap()
}

fn node(s: &str) -> NodeId {
    NodeId::try_from(s).unwrap()
}

fn registration(id: &str, instance: &str) -> NodeRegistration {
    NodeRegistration {
        id: node(id),
        address: format!("{id}:7500"),
        labels: HashMap::from([("zone".to_string(), "z1".to_string())]),
        capacity: 1 << 40,
        free: 1 << 39,
        used: 0,
        instance: instance.to_string(),
    }
}

pub(super) fn register(cat: &Catalog, id: &str) {
    cat.register_node(registration(id, &format!("{id}-identity")))
        .unwrap();
}

pub(super) fn shard(id: u32, bytes: u64, files: u64, replicas: &[&str]) -> ShardSpec {
    ShardSpec {
        id,
        bytes,
        files,
        replicas: replicas.iter().map(|r| node(r)).collect(),
    }
}

/// A small valid version: a/, a/x (10 bytes, shard 0), a/y (5 MiB, shard 1), l -> a/x.
fn small_version(cat: &Catalog, ds: &str, replicas: &[&str]) -> pb::Version {
    let (s, _) = cat.begin_version(&name(ds), 0, "", 2, false, "tester").unwrap();
    let link = Entry {
        path: RelPath::try_from("l").unwrap(),
        kind: EntryKind::Symlink { target: "a/x".into() },
        mode: 0o777,
        mtime_ns: 3,
    };
    cat.put_entries(s, 0, vec![dir("a"), file("a/x", 10, 0)]).unwrap();
    cat.put_entries(s, 1, vec![file("a/y", 5 << 20, 1), link])
        .unwrap();
    cat.put_shards(
        s,
        0,
        vec![shard(0, 10, 1, replicas), shard(1, 5 << 20, 1, replicas)],
    )
    .unwrap();
    commit(cat, s, "tester").unwrap()
}

/// A commit as an importer makes it: with the manifest's sealed namespace.
fn commit(cat: &Catalog, s: u64, who: &str) -> Result<pb::Version> {
    let ns = cat.session_namespace(s).ok();
    cat.commit(s, who, ns)
}

fn latest(ds: &str) -> DatasetRef {
    format!("{ds}@latest").parse().unwrap()
}

#[test]
fn commit_makes_a_complete_version() {
    let f = fixture();
    register(&f.cat, "n1");
    register(&f.cat, "n2");
    let v = small_version(&f.cat, "ds", &["n1", "n2"]);
    assert_eq!(
        (v.version, v.files, v.dirs, v.symlinks, v.shards),
        (1, 2, 1, 1, 2)
    );
    assert_eq!(v.bytes, 10 + (5 << 20));

    let (n, all, next) = f.cat.list_entries(&latest("ds"), None, b"", 100, true).unwrap();
    assert_eq!(n, 1);
    assert!(next.is_empty());
    let mut paths: Vec<_> = all.iter().map(|e| e.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, vec!["a", "a/x", "a/y", "l"]);
    let y = all.iter().find(|e| e.path == "a/y").unwrap();
    assert_eq!(y.chunks.len(), 2);
    assert_eq!(Entry::try_from(y.clone()).unwrap(), file("a/y", 5 << 20, 1));

    let (_, in_a, _) = f
        .cat
        .list_entries(&latest("ds"), Some("a"), b"", 100, false)
        .unwrap();
    assert_eq!(
        in_a.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
        vec!["a/x", "a/y"]
    );
    assert!(in_a.iter().all(|e| e.chunks.is_empty()));
    assert!(matches!(
        f.cat.list_entries(&latest("ds"), Some("a/x"), b"", 100, false),
        Err(CatalogError::NotFound(_))
    ));

    let got = f.cat.get_version(&latest("ds")).unwrap();
    let mut res: Vec<_> = got.resident.iter().map(|r| (r.node.as_str(), r.bytes)).collect();
    res.sort();
    assert_eq!(res, vec![("n1", v.bytes), ("n2", v.bytes)]);
}

#[test]
fn paging_visits_every_entry_once() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("p"), 0, "", 1, false, "t").unwrap();
    let mut entries = vec![dir("d")];
    for i in 0..250 {
        entries.push(file(&format!("d/f{i:03}"), 1, 0));
        entries.push(file(&format!("g{i:03}"), 1, 0));
    }
    f.cat.put_entries(s, 0, entries).unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 500, 500, &[])]).unwrap();
    commit(&f.cat, s, "t").unwrap();
    let mut token = Vec::new();
    let mut seen = HashSet::new();
    let mut pages = 0;
    loop {
        let (_, page, next) = f.cat.list_entries(&latest("p"), None, &token, 64, false).unwrap();
        pages += 1;
        for e in page {
            assert!(seen.insert(e.path));
        }
        if next.is_empty() {
            break;
        }
        token = next;
    }
    assert_eq!(seen.len(), 501);
    assert_eq!(pages, 8);
    // A token from another listing is refused.
    let (_, _, tok) = f.cat.list_entries(&latest("p"), None, b"", 10, false).unwrap();
    assert!(matches!(
        f.cat.list_entries(&latest("p"), Some("d"), &tok, 10, false),
        Err(CatalogError::Invalid(_))
    ));
}

#[test]
fn uncommitted_and_aborted_sessions_stay_invisible() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![dir("a")]).unwrap();
    assert!(f.cat.list_datasets().unwrap().is_empty());
    assert!(matches!(
        f.cat.get_version(&latest("ds")),
        Err(CatalogError::NotFound(_))
    ));
    f.cat.abort(s).unwrap();
    assert_eq!(f.cat.open_sessions().unwrap(), 0);
    assert!(matches!(commit(&f.cat, s, "t"), Err(CatalogError::NotFound(_))));
    let (from, to) = keys::uid_range(s);
    assert_eq!(f.cat.store.scan(Table::Entries, &from, Some(&to)).count(), 0);
}

#[test]
fn idle_sessions_are_reaped() {
    let f = fixture();
    let (old, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(old, 0, vec![dir("a")]).unwrap();
    f.clock.advance_ms(50_000);
    let (fresh, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.clock.advance_ms(20_000);
    assert_eq!(f.cat.reap_sessions().unwrap(), 1);
    assert!(matches!(
        f.cat.put_entries(old, 1, vec![]),
        Err(CatalogError::NotFound(_))
    ));
    f.cat.put_entries(fresh, 0, vec![dir("b")]).unwrap();
    let (from, to) = keys::uid_range(old);
    assert_eq!(f.cat.store.scan(Table::Entries, &from, Some(&to)).count(), 0);
}

#[test]
fn pages_are_idempotent_and_ordered() {
    let f = fixture();
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    assert_eq!(f.cat.put_entries(s, 0, vec![dir("a")]).unwrap(), (1, 1));
    // A retried page is acknowledged without being applied twice.
    assert_eq!(f.cat.put_entries(s, 0, vec![dir("a")]).unwrap(), (1, 1));
    assert!(matches!(
        f.cat.put_entries(s, 5, vec![dir("b")]),
        Err(CatalogError::Precondition(_))
    ));
    // A duplicate path in a later page is refused and changes nothing.
    assert!(matches!(
        f.cat.put_entries(s, 1, vec![dir("b"), dir("a")]),
        Err(CatalogError::Invalid(_))
    ));
    assert!(matches!(
        f.cat.put_entries(s, 1, vec![dir("c"), dir("c")]),
        Err(CatalogError::Invalid(_))
    ));
    assert_eq!(f.cat.put_entries(s, 1, vec![dir("b")]).unwrap(), (2, 2));
    // Wrong chunk count for the session's chunk size.
    let mut bad = file("b/f", 10, 0);
    if let EntryKind::File { chunks, .. } = &mut bad.kind {
        chunks.push(BlobHash::of(b"extra"));
    }
    assert!(matches!(
        f.cat.put_entries(s, 2, vec![bad]),
        Err(CatalogError::Invalid(_))
    ));
}

#[test]
fn commit_checks_the_whole_manifest() {
    let f = fixture();
    // A file whose parent directory is missing.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("nodir/x", 1, 0)]).unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 1, 1, &[])]).unwrap();
    let e = commit(&f.cat, s, "t").unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
    // A parent that is a file.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat
        .put_entries(s, 0, vec![file("x", 1, 0), file("x/y", 1, 0)])
        .unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 2, 2, &[])]).unwrap();
    assert!(matches!(
        commit(&f.cat, s, "t"),
        Err(CatalogError::Precondition(_))
    ));
    // Shard totals that disagree with the files.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("x", 1, 0)]).unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 2, 1, &[])]).unwrap();
    assert!(matches!(
        commit(&f.cat, s, "t"),
        Err(CatalogError::Precondition(_))
    ));
    // Files in a shard never sent.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![file("x", 1, 3)]).unwrap();
    assert!(matches!(
        commit(&f.cat, s, "t"),
        Err(CatalogError::Precondition(_))
    ));
    // None of these became a version.
    assert!(f.cat.list_datasets().unwrap().is_empty());
    // Unregistered replica nodes are refused at upload.
    let (s, _) = f.cat.begin_version(&name("ds"), 0, "", 1, false, "t").unwrap();
    assert!(matches!(
        f.cat.put_shards(s, 0, vec![shard(0, 1, 1, &["ghost"])]),
        Err(CatalogError::Invalid(_))
    ));
}

#[test]
fn numbers_are_consecutive_and_never_reused() {
    let f = fixture();
    for want in 1..=3 {
        assert_eq!(small_version(&f.cat, "ds", &[]).version, want);
    }
    f.cat.delete_version(&name("ds"), 3).unwrap();
    assert_eq!(f.cat.get_dataset(&name("ds")).unwrap().latest, 2);
    assert_eq!(small_version(&f.cat, "ds", &[]).version, 4);
    assert_eq!(f.cat.delete_dataset(&name("ds")).unwrap(), 3);
    assert!(f.cat.list_datasets().unwrap().is_empty());
    assert!(matches!(
        f.cat.get_dataset(&name("ds")),
        Err(CatalogError::NotFound(_))
    ));
    assert_eq!(small_version(&f.cat, "ds", &[]).version, 5);
    assert_eq!(f.cat.list_datasets().unwrap()[0].version_count, 1);
}

#[test]
fn replica_changes_move_resident_counters() {
    let f = fixture();
    for n in ["n1", "n2", "n3"] {
        register(&f.cat, n);
    }
    small_version(&f.cat, "ds", &["n1", "n2"]);
    let r: DatasetRef = "ds@1".parse().unwrap();
    let reps = f
        .cat
        .update_replicas(&r, 1, &[node("n3")], &[node("n1")])
        .unwrap();
    assert_eq!(reps, vec!["n2", "n3"]);
    // Repeating the same change is a no-op.
    f.cat
        .update_replicas(&r, 1, &[node("n3")], &[node("n1")])
        .unwrap();
    let resident: HashMap<_, _> = f
        .cat
        .get_version(&r)
        .unwrap()
        .resident
        .into_iter()
        .map(|x| (x.node, x.bytes))
        .collect();
    assert_eq!(resident["n1"], 10);
    assert_eq!(resident["n2"], 10 + (5 << 20));
    assert_eq!(resident["n3"], 5 << 20);
    assert!(matches!(
        f.cat.update_replicas(&r, 9, &[node("n3")], &[]),
        Err(CatalogError::NotFound(_))
    ));
    f.cat.delete_version(&name("ds"), 1).unwrap();
    assert_eq!(f.cat.store.scan(Table::NodeShards, b"", None).count(), 0);
    assert_eq!(f.cat.store.scan(Table::Resident, b"", None).count(), 0);
}

#[test]
fn liveness_follows_heartbeats() {
    let f = fixture();
    register(&f.cat, "n1");
    register(&f.cat, "n2");
    f.clock.advance_ms(8_000);
    f.cat
        .heartbeat(
            &node("n1"),
            "n1-identity",
            NodeStats {
                free: 5,
                used: 6,
                ..Default::default()
            },
        )
        .unwrap();
    f.clock.advance_ms(8_000);
    let nodes = f.cat.list_nodes().unwrap();
    let state = |id: &str| nodes.iter().find(|n| n.id == id).unwrap().state;
    assert_eq!(state("n1"), pb::NodeState::Up as i32);
    assert_eq!(state("n2"), pb::NodeState::Down as i32);
    assert_eq!(nodes.iter().find(|n| n.id == "n1").unwrap().free_bytes, 5);
    assert!(matches!(
        f.cat.heartbeat(&node("ghost"), "", NodeStats::default()),
        Err(CatalogError::NotFound(_))
    ));
}

#[test]
fn a_node_id_belongs_to_one_identity_while_it_is_up_and_passes_on_once_it_is_down() {
    let f = fixture();
    assert_eq!(f.cat.register_node(registration("n1", "first")).unwrap(), None);
    // The same process again (a restart with its data dir): fine.
    assert_eq!(f.cat.register_node(registration("n1", "first")).unwrap(), None);
    // Another process claiming n1 while it is up: refused, saying what to do.
    f.clock.advance_ms(9_000);
    match f.cat.register_node(registration("n1", "second")) {
        Err(CatalogError::Taken(why)) => {
            assert!(why.contains("give each node its own --id"), "{why}");
            assert!(why.contains("declared down"), "{why}");
        }
        other => panic!("expected Taken, got {other:?}"),
    }
    let addr = |cat: &Catalog| cat.list_nodes().unwrap()[0].address.clone();
    assert_eq!(addr(&f.cat), "n1:7500");
    // Once n1 is down (its disk replaced, say), the new identity takes the id over, and
    // the old process, should it come back, is told to stop.
    f.clock.advance_ms(2_000);
    assert_eq!(
        f.cat.register_node(registration("n1", "second")).unwrap(),
        Some("first".to_string())
    );
    assert!(matches!(
        f.cat.heartbeat(&node("n1"), "first", NodeStats::default()),
        Err(CatalogError::Precondition(_))
    ));
    f.cat
        .heartbeat(&node("n1"), "second", NodeStats::default())
        .unwrap();
    // A clean stop gives the id up at once (only its holder can): the same node on a new
    // disk registers without waiting for it to be declared down.
    f.cat.release_node(&node("n1"), "first").unwrap();
    assert!(matches!(
        f.cat.register_node(registration("n1", "third")),
        Err(CatalogError::Taken(_))
    ));
    f.cat.release_node(&node("n1"), "second").unwrap();
    assert_eq!(f.cat.register_node(registration("n1", "third")).unwrap(), None);
}

#[test]
fn begin_validates_its_arguments() {
    let f = fixture();
    for (chunk, origin) in [
        (1000, ""),
        (1 << 12, ""),
        (0, "ftp://x"),
        (0, "s3://"),
        (0, "cluster2"),
    ] {
        assert!(
            matches!(
                f.cat.begin_version(&name("ds"), chunk, origin, 1, false, "t"),
                Err(CatalogError::Invalid(_))
            ),
            "{chunk} {origin}"
        );
    }
    assert!(f
        .cat
        .begin_version(&name("ds"), 1 << 16, "s3://bucket/prefix", 3, false, "t")
        .is_ok());
}

/// A token alone must not keep a node alive (whoever holds it heartbeats without the
/// identity that registered), and a node cannot draw replicas with room it does not have.
#[test]
fn heartbeats_need_the_registered_identity_and_free_bytes_are_bounded_by_capacity() {
    let f = fixture();
    register(&f.cat, "n1");
    f.clock.advance_ms(8_000);
    match f.cat.heartbeat(&node("n1"), "", NodeStats::default()) {
        Err(CatalogError::Invalid(e)) => assert!(e.reason.contains("must carry it"), "{e:?}"),
        other => panic!("a heartbeat without the identity was not refused: {other:?}"),
    }
    f.clock.advance_ms(8_000);
    let n1 = |cat: &Catalog| {
        cat.list_nodes()
            .unwrap()
            .into_iter()
            .find(|n| n.id == "n1")
            .unwrap()
    };
    assert_eq!(
        n1(&f.cat).state,
        pb::NodeState::Down as i32,
        "the refused heartbeat kept it up"
    );
    let capacity = n1(&f.cat).capacity_bytes;
    f.cat
        .heartbeat(
            &node("n1"),
            "n1-identity",
            NodeStats {
                free: u64::MAX,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(n1(&f.cat).state, pb::NodeState::Up as i32);
    assert_eq!(n1(&f.cat).free_bytes, capacity);
}

/// The service's own pause (stopped, frozen) is not the nodes' silence: after a gap in
/// its ticks longer than the liveness timeout, no node is declared down until each had a
/// fresh timeout to be heard; without ticks (no pause seen) liveness is judged as usual.
#[test]
fn a_pause_of_the_service_itself_gives_every_node_a_fresh_liveness_timeout() {
    let f = fixture();
    register(&f.cat, "n1");
    register(&f.cat, "n2");
    f.cat.tick();
    // Ticking along, then silent for twice the liveness timeout (10 s here).
    for _ in 0..5 {
        f.clock.advance_ms(200);
        f.cat.tick();
        f.cat
            .heartbeat(&node("n1"), "n1-identity", NodeStats::default())
            .unwrap();
        f.cat
            .heartbeat(&node("n2"), "n2-identity", NodeStats::default())
            .unwrap();
    }
    f.clock.advance_ms(20_000);
    let state = |cat: &Catalog, id: &str| {
        cat.list_nodes()
            .unwrap()
            .into_iter()
            .find(|n| n.id == id)
            .unwrap()
            .state
    };
    // The first look after the pause sees it: both up.
    assert_eq!(state(&f.cat, "n1"), pb::NodeState::Up as i32);
    assert_eq!(state(&f.cat, "n2"), pb::NodeState::Up as i32);
    // n1 goes on heartbeating, n2 stays silent: one timeout later n2 is down, n1 not.
    for _ in 0..60 {
        f.clock.advance_ms(200);
        f.cat.tick();
        f.cat
            .heartbeat(&node("n1"), "n1-identity", NodeStats::default())
            .unwrap();
    }
    assert_eq!(state(&f.cat, "n1"), pb::NodeState::Up as i32);
    assert_eq!(state(&f.cat, "n2"), pb::NodeState::Down as i32);
}

/// A commit carries the sealed namespace the importer stored: it must be the one the
/// manifest seals to, it becomes a blob of the first shard (so its replicas hold it), and
/// a version without files keeps a small one in the catalogue.
#[test]
fn a_commit_binds_the_version_to_the_sealed_namespace_of_its_manifest() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("ns"), 0, "", 1, false, "t").unwrap();
    f.cat
        .put_entries(s, 0, vec![dir("a"), file("a/x", 10, 0)])
        .unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 10, 1, &["n1"])]).unwrap();
    let (h, n) = f.cat.session_namespace(s).unwrap();
    match f.cat.commit(s, "t", Some((BlobHash::of(b"another tree"), n))) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("is not this manifest's"), "{m}"),
        other => panic!("a wrong namespace was taken: {other:?}"),
    }
    match f.cat.commit(s, "t", None) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("predates"), "{m}"),
        other => panic!("a commit without a namespace was taken: {other:?}"),
    }
    let v = f.cat.commit(s, "t", Some((h, n))).unwrap();
    assert_eq!((v.namespace_blob.as_slice(), v.namespace_size), (&h.0[..], n));
    let got = f.cat.get_version(&latest("ns")).unwrap();
    assert_eq!(got.namespace_blob, h.0.to_vec());
    assert!(got.namespace_inline.is_empty());
    // Located like any blob of shard 0, with its size from the catalogue.
    let loc = f.cat.locate_blobs(&[h]).unwrap();
    assert_eq!(loc[0].2, Some((n, 4 << 20)));

    // Directories only: no shard, so the catalogue keeps the namespace itself.
    let (s, _) = f.cat.begin_version(&name("dirs"), 0, "", 1, false, "t").unwrap();
    f.cat.put_entries(s, 0, vec![dir("a"), dir("a/b")]).unwrap();
    let v = f.cat.commit(s, "t", None).unwrap();
    let got = f.cat.get_version(&latest("dirs")).unwrap();
    assert_eq!(got.namespace_blob, v.namespace_blob);
    assert_eq!(BlobHash::of(&got.namespace_inline).0.to_vec(), got.namespace_blob);
    let ix = locus_proto::sealed::Index::open(&got.namespace_inline[..]).unwrap();
    let a = ix.lookup(locus_proto::sealed::ROOT, "a").unwrap();
    assert!(ix.lookup(a, "b").is_some());
}

/// A version committed before sealed namespaces (its record has none) gets one through
/// `seal_version`, only the one its entries seal to; sealing again is a no-op, and a
/// sealed version never takes another.
#[test]
fn an_unsealed_version_takes_only_the_namespace_its_entries_seal_to() {
    let f = fixture();
    register(&f.cat, "n1");
    let (s, _) = f.cat.begin_version(&name("old"), 0, "", 1, false, "t").unwrap();
    f.cat
        .put_entries(s, 0, vec![dir("a"), file("a/x", 10, 0)])
        .unwrap();
    f.cat.put_shards(s, 0, vec![shard(0, 10, 1, &["n1"])]).unwrap();
    let (h, n) = f.cat.session_namespace(s).unwrap();
    f.cat.commit(s, "t", Some((h, n))).unwrap();
    // Rewind the record to what an older Locus wrote, and drop the namespace's blob rows.
    let (number, mut rec) = f.cat.resolve(&latest("old")).unwrap();
    rec.namespace_blob.clear();
    rec.namespace_size = 0;
    rec.namespace_chunks.clear();
    let mut b = Batch::default();
    b.put(Table::Versions, keys::version("old", number), rec.encode_to_vec());
    b.delete(Table::ShardBlobs, keys::shard_blob(rec.uid, 0, &h.0));
    b.delete(Table::BlobShards, keys::blob_shard(&h.0, rec.uid, 0));
    f.cat.store.write(b, true).unwrap();
    assert!(f
        .cat
        .get_version(&latest("old"))
        .unwrap()
        .namespace_blob
        .is_empty());
    assert_eq!(f.cat.locate_blobs(&[h]).unwrap()[0].2, None);

    let r = latest("old");
    match f.cat.seal_version(&r, (BlobHash::of(b"some other tree"), n)) {
        Err(CatalogError::Precondition(m)) => assert!(m.contains("is not this manifest's"), "{m}"),
        other => panic!("a wrong namespace was taken: {other:?}"),
    }
    let v = f.cat.seal_version(&r, (h, n)).unwrap();
    assert_eq!((v.namespace_blob.as_slice(), v.namespace_size), (&h.0[..], n));
    assert_eq!(
        f.cat.locate_blobs(&[h]).unwrap()[0].2,
        Some((n, 4 << 20)),
        "a blob of shard 0 again"
    );
    assert_eq!(
        f.cat.seal_version(&r, (h, n)).unwrap().namespace_blob,
        h.0.to_vec()
    );
    assert!(matches!(
        f.cat.seal_version(&r, (BlobHash::of(b"x"), 5)),
        Err(CatalogError::Precondition(_))
    ));
}

#[test]
fn a_scoped_session_naming_blobs_only_outside_its_scope_is_found_out() {
    let f = fixture();
    register(&f.cat, "n1");
    register(&f.cat, "n2");
    // Team B's version holds a/x's and a/y's blobs.
    small_version(&f.cat, "b-x", &["n1", "n2"]);
    let team_a = |d: &str| d.starts_with("a-");
    let (s, _) = f
        .cat
        .begin_version(&name("a-new"), 0, "", 1, false, "team-a")
        .unwrap();
    f.cat
        .put_entries(s, 0, vec![dir("a"), file("a/x", 10, 0), file("mine", 3, 0)])
        .unwrap();
    assert_eq!(
        f.cat.foreign_blobs(s, team_a, 10).unwrap(),
        vec![BlobHash::of(b"a/x")],
        "a/x is only B's; `mine` is in no version"
    );
    // Once a version of team A's own holds the same blob, naming it takes nothing.
    small_version(&f.cat, "a-own", &["n1", "n2"]);
    assert!(f.cat.foreign_blobs(s, team_a, 10).unwrap().is_empty());
    // Unscoped: every dataset is visible.
    assert!(f.cat.foreign_blobs(s, |_| true, 10).unwrap().is_empty());
}
