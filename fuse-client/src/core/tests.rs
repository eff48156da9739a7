//! The mount's core against injected faults: replicas that fail, send corrupt bytes or
//! hang, a local node that hangs, and sequential readers. No kernel, no network: the
//! sources are fakes behind the same traits the real ones implement.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use locus_proto::manifest::{EntryKind, RelPath};
use locus_proto::{BlobHash, Entry};

use super::*;
use crate::reader::{
    BoxFuture, ChunkRef, Located, Pieces, Place, RangeRequest, Ranged, Remote, Replicas, SourceError,
    Topology,
};

const CHUNK: u32 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behave {
    Good,
    Fail,
    Corrupt,
    /// Silent: the read gives up after its idle timeout, as the real source does.
    Hang,
    /// Answers NOT_FOUND: it does not hold the blob.
    Missing,
    /// No grant could be presented (the metadata service did not issue one).
    NoGrant,
    /// Whole chunks are right; a range comes with one proof node flipped.
    WrongProof,
    /// Whole chunks are right; a range is one byte short.
    Truncated,
    /// Serves no ranges (an older node): whole chunks only.
    NoRanges,
}

/// Replicas serving one blob, each node behaving as told; every request is logged.
struct FakeReplicas {
    data: Vec<u8>,
    behave: Mutex<HashMap<String, Behave>>,
    log: Mutex<Vec<(String, u32)>>,
    /// Ranges asked for: (address, start, end), offsets in the blob.
    range_log: Mutex<Vec<(String, u64, u64)>>,
    /// The blob's outboard, made at the first range asked.
    tree: std::sync::OnceLock<Vec<u8>>,
}

impl FakeReplicas {
    fn requests_for(&self, index: u32) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, i)| *i == index)
            .count()
    }
}

/// `b` split at a third and at two thirds plus one.
fn in_pieces(b: Vec<u8>) -> Pieces {
    let b = Bytes::from(b);
    let (x, y) = (b.len() / 3, (2 * b.len() / 3 + 1).min(b.len()));
    Pieces::from(vec![b.slice(..x), b.slice(x..y), b.slice(y..)])
}

impl Replicas for FakeReplicas {
    fn read<'a>(
        &'a self,
        addr: &'a str,
        c: ChunkRef,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Pieces, SourceError>> {
        Box::pin(async move {
            self.log.lock().unwrap().push((addr.to_string(), c.index));
            let how = *self.behave.lock().unwrap().get(addr).unwrap_or(&Behave::Fail);
            let part = || self.data[c.offset as usize..(c.offset + c.len) as usize].to_vec();
            match how {
                // In uneven pieces, as a node's messages arrive.
                Behave::Good | Behave::WrongProof | Behave::Truncated | Behave::NoRanges => {
                    Ok(in_pieces(part()))
                }
                Behave::Fail => Err(SourceError::Unreachable("connection refused".into())),
                Behave::Missing => Err(SourceError::from_status(&tonic::Status::not_found(
                    "no such blob",
                ))),
                Behave::NoGrant => Err(SourceError::Grant("no read grant: the service is down".into())),
                Behave::Corrupt => {
                    let mut b = part();
                    b[0] ^= 1;
                    Ok(in_pieces(b))
                }
                Behave::Hang => {
                    tokio::time::sleep(idle).await;
                    Err(SourceError::Unreachable(format!("stalled for {idle:?}")))
                }
            }
        })
    }

    fn read_range<'a>(
        &'a self,
        addr: &'a str,
        r: RangeRequest,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Option<Ranged>, SourceError>> {
        Box::pin(async move {
            let how = *self.behave.lock().unwrap().get(addr).unwrap_or(&Behave::Fail);
            if how == Behave::NoRanges {
                return Ok(None);
            }
            let (start, end) = (r.start, r.end);
            self.range_log
                .lock()
                .unwrap()
                .push((addr.to_string(), start, end));
            // Ranges of the whole blob, checked against its own hash.
            assert_eq!((r.chunk_offset, r.chunk_len), (0, self.data.len() as u64));
            let ob = self
                .tree
                .get_or_init(|| locus_proto::outboard::outboard(&self.data).1);
            let mut proof = locus_proto::outboard::proof(ob, r.chunk_len, start, end).unwrap();
            let mut data = self.data[start as usize..end as usize].to_vec();
            match how {
                Behave::Good => {}
                Behave::Corrupt => data[(end - start) as usize / 2] ^= 1,
                Behave::WrongProof => proof[5] ^= 0x10,
                Behave::Truncated => {
                    data.pop();
                }
                Behave::Fail => return Err(SourceError::Unreachable("connection refused".into())),
                Behave::Missing => return Err(SourceError::Missing("no such blob".into())),
                Behave::NoGrant => return Err(SourceError::Grant("no read grant".into())),
                Behave::Hang => {
                    tokio::time::sleep(idle).await;
                    return Err(SourceError::Unreachable(format!("stalled for {idle:?}")));
                }
                Behave::NoRanges => unreachable!(),
            }
            Ok(Some(Ranged {
                proof: proof.into(),
                data: data.into(),
            }))
        })
    }

    fn forget<'a>(&'a self, _addr: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    fn locate<'a>(
        &'a self,
        _blob: BlobHash,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<Located, SourceError>> {
        // Repair moved nothing: the same replicas.
        Box::pin(async { Ok(Located::default()) })
    }

    fn topology<'a>(&'a self, _place: &'a Place) -> BoxFuture<'a, Result<Topology, SourceError>> {
        Box::pin(async { Err(SourceError::Unreachable("not used here".to_string())) })
    }
}

#[derive(Debug, Clone)]
enum LocalBehave {
    File(PathBuf),
    Hang,
}

struct FakeLocal {
    behave: LocalBehave,
    calls: AtomicUsize,
}

impl LocalNode for FakeLocal {
    fn ensure_local(&self, _blob: BlobHash, _size: u64, limit: Duration) -> Result<NodeBlob, LocalError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match &self.behave {
            LocalBehave::File(p) => Ok(NodeBlob::whole(p.clone())),
            LocalBehave::Hang => {
                std::thread::sleep(limit);
                Err(LocalError::Unreachable(format!("no answer within {limit:?}")))
            }
        }
    }
}

struct Fixture {
    core: Arc<Core>,
    replicas: Arc<FakeReplicas>,
    local: Option<Arc<FakeLocal>>,
    data: Vec<u8>,
    ino: u64,
    rt: Option<tokio::runtime::Runtime>,
    _dir: tempfile::TempDir,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // A hung fake node's fetch may still be sleeping; do not wait for it.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// One file of `chunks` chunks on shard 0, replicated on n1 (cheapest) and n2.
/// The settings of the tests' cores: the kernel opens files, nothing is passed through,
/// four chunks of read-ahead; the node's patience and the reopen window as given.
fn kernel_opens_settings(local_patience: Duration, reopen_ttl: Duration) -> Settings {
    Settings {
        kernel_opens: true,
        passthrough: false,
        passthrough_min_size: 0,
        readahead_chunks: 4,
        open_timeout: Duration::from_secs(2),
        local_patience,
        reopen_ttl,
        generation: 1,
        readdirplus: Default::default(),
    }
}

fn fixture(chunks: usize, n1: Behave, n2: Behave, local: Option<LocalBehave>) -> Fixture {
    fixture_sized(CHUNK, chunks, n1, n2, local)
}

/// `fixture` with chunks of `chunk` bytes.
fn fixture_sized(chunk: u32, chunks: usize, n1: Behave, n2: Behave, local: Option<LocalBehave>) -> Fixture {
    fixture_with(chunk, chunks, (n1, n2), local, Vec::new(), |_| {})
}

/// `fixture_sized` with more entries beside "f", and the settings changed by `tune`.
fn fixture_with(
    chunk: u32,
    chunks: usize,
    (n1, n2): (Behave, Behave),
    local: Option<LocalBehave>,
    more: Vec<Entry>,
    tune: impl FnOnce(&mut Settings),
) -> Fixture {
    let data: Vec<u8> = (0..chunks * chunk as usize - 100)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let hashes: Vec<BlobHash> = data.chunks(chunk as usize).map(BlobHash::of).collect();
    let entry = Entry {
        path: RelPath::try_from("f").unwrap(),
        kind: EntryKind::File {
            size: data.len() as u64,
            blob: BlobHash::of(&data),
            chunks: hashes,
            shard: 0,
        },
        mode: 0o644,
        mtime_ns: 1,
    };
    let mut entries = more;
    entries.push(entry);
    let ns = Arc::new(Namespace::build(entries, chunk).unwrap());
    let ino = ns.lookup(crate::namespace::ROOT, "f").unwrap();
    let replicas = Arc::new(FakeReplicas {
        data: data.clone(),
        behave: Mutex::new(HashMap::from([("a1".to_string(), n1), ("a2".to_string(), n2)])),
        log: Mutex::new(Vec::new()),
        range_log: Mutex::new(Vec::new()),
        tree: Default::default(),
    });
    let topo = Topology::from_parts(
        HashMap::from([(0, vec!["n1".to_string(), "n2".to_string()])]),
        vec![("n1".into(), "a1".into(), 0), ("n2".into(), "a2".into(), 1)],
    );
    let metrics = Arc::new(Metrics::default());
    let mut remote = Remote::new(
        replicas.clone(),
        Place::default(),
        topo,
        64 << 20,
        metrics.clone(),
    );
    remote.timeout = Duration::from_millis(200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = local.map(|b| {
        let b = match b {
            LocalBehave::File(_) => {
                let p = dir.path().join("blob");
                std::fs::write(&p, &data).unwrap();
                LocalBehave::File(p)
            }
            other => other,
        };
        Arc::new(FakeLocal {
            behave: b,
            calls: AtomicUsize::new(0),
        })
    });
    let settings = kernel_opens_settings(Duration::from_millis(300), Duration::from_secs(60));
    let mut settings = settings;
    tune(&mut settings);
    let core = Arc::new(Core::new(
        ns,
        rt.handle().clone(),
        local.clone().map(|l| l as Arc<dyn LocalNode>),
        Arc::new(remote),
        metrics,
        settings,
    ));
    Fixture {
        core,
        replicas,
        local,
        data,
        ino,
        rt: Some(rt),
        _dir: dir,
    }
}

/// The whole file through `read_by_inode`, `step` bytes at a time, as the kernel asks.
fn read_all(f: &Fixture, step: u32) -> Result<Vec<u8>, FsError> {
    let mut out = Vec::new();
    loop {
        let (b, _) = f.core.read_by_inode_bytes(f.ino, out.len() as u64, step)?;
        if b.is_empty() {
            return Ok(out);
        }
        out.extend_from_slice(&b);
    }
}

/// A chunk every page of which the kernel took into its page cache leaves the chunk
/// cache (the kernel answers those reads itself): read again, it is fetched again. What
/// the kernel does not keep (O_DIRECT), or only part of a chunk, stays cached.
#[test]
fn a_chunk_handed_whole_to_the_page_cache_leaves_the_chunk_cache() {
    const BIG: u32 = 4 * 4096;
    let fetches = |f: &Fixture| {
        let log = f.replicas.log.lock().unwrap();
        (0..3u32)
            .map(|i| log.iter().filter(|(_, c)| *c == i).count())
            .collect::<Vec<_>>()
    };
    let read = |f: &Fixture, keeps: bool| {
        let mut out = Vec::new();
        loop {
            let (b, _) = f
                .core
                .read_by_inode_copied(f.ino, out.len() as u64, BIG, keeps)
                .unwrap();
            if b.is_empty() {
                break;
            }
            out.extend_from_slice(&b);
        }
        assert!(out == f.data, "the bytes read are the file's");
    };
    let f = fixture_sized(BIG, 3, Behave::Good, Behave::Good, None);
    read(&f, true);
    assert_eq!(fetches(&f), [1, 1, 1]);
    read(&f, true);
    assert_eq!(fetches(&f), [2, 2, 2], "each chunk was let go once handed over");

    let f = fixture_sized(BIG, 3, Behave::Good, Behave::Good, None);
    read(&f, false);
    read(&f, false);
    assert_eq!(fetches(&f), [1, 1, 1], "O_DIRECT reads leave the chunks cached");

    let f = fixture_sized(BIG, 3, Behave::Good, Behave::Good, None);
    let half = BIG / 2;
    f.core.read_by_inode_copied(f.ino, 0, half, true).unwrap();
    f.core.read_by_inode_copied(f.ino, 0, half, true).unwrap();
    assert_eq!(fetches(&f)[0], 1, "half of chunk 0 handed: it stays");
    f.core
        .read_by_inode_copied(f.ino, u64::from(half), half, true)
        .unwrap();
    f.core.read_by_inode_copied(f.ino, 0, BIG, true).unwrap();
    assert_eq!(fetches(&f)[0], 2, "the other half too: it went, and came back");
}

#[test]
fn a_failing_replica_fails_over_to_the_next() {
    let f = fixture(3, Behave::Fail, Behave::Good, None);
    assert!(read_all(&f, CHUNK).unwrap() == f.data);
    let log = f.replicas.log.lock().unwrap().clone();
    assert_eq!(
        log[0],
        ("a1".to_string(), 0),
        "the cheapest replica is asked first"
    );
    assert!(log.iter().any(|(a, _)| a == "a2"), "then the next: {log:?}");
}

/// Who was asked first for chunk `index`.
fn first_asked(f: &Fixture, index: u32) -> String {
    let log = f.replicas.log.lock().unwrap();
    log.iter()
        .find(|(_, i)| *i == index)
        .map(|(a, _)| a.clone())
        .unwrap_or_default()
}

#[test]
fn only_a_node_at_fault_is_passed_over_not_one_that_lacks_the_blob_or_a_grant() {
    // Out of order, so no read-ahead asks for the second chunk early.
    let read = |f: &Fixture, index: u32| {
        let (b, _) = f
            .core
            .read_by_inode_bytes(f.ino, u64::from(index) * u64::from(CHUNK), CHUNK)
            .unwrap();
        let at = index as usize * CHUNK as usize;
        assert!(b[..] == f.data[at..at + b.len()]);
    };
    for healthy in [Behave::Missing, Behave::NoGrant] {
        let f = fixture(4, healthy, Behave::Good, None);
        read(&f, 2);
        read(&f, 0);
        assert_eq!(first_asked(&f, 2), "a1");
        assert_eq!(
            first_asked(&f, 0),
            "a1",
            "{healthy:?}: the cheapest node is still asked first"
        );
    }
    let f = fixture(4, Behave::Fail, Behave::Good, None);
    read(&f, 2);
    read(&f, 0);
    assert_eq!(first_asked(&f, 2), "a1");
    assert_eq!(
        first_asked(&f, 0),
        "a2",
        "a node that failed is passed over for a while"
    );
}

#[test]
fn node_answers_are_sorted_by_whose_fault_they_are() {
    use tonic::{Code, Status};
    let e = |c: Code| SourceError::from_status(&Status::new(c, "x"));
    assert!(matches!(e(Code::NotFound), SourceError::Missing(_)));
    assert!(matches!(e(Code::Unauthenticated), SourceError::Grant(_)));
    assert!(matches!(e(Code::PermissionDenied), SourceError::Grant(_)));
    for c in [
        Code::Unavailable,
        Code::Cancelled,
        Code::Internal,
        Code::DeadlineExceeded,
    ] {
        assert!(e(c).blames_node(), "{c:?}");
    }
    assert!(!e(Code::NotFound).blames_node() && !e(Code::Unauthenticated).blames_node());
    assert!(SourceError::Wrong("bad bytes".into()).blames_node());
}

#[test]
fn a_corrupt_chunk_is_never_returned_and_another_replica_serves_it() {
    let f = fixture(3, Behave::Corrupt, Behave::Good, None);
    assert!(read_all(&f, CHUNK).unwrap() == f.data, "only verified bytes");
    let m = f.core.metrics.encode();
    assert!(m.contains("locus_mount_corrupt_chunks_total 1"), "{m}");
}

#[test]
fn when_every_source_fails_the_read_is_an_io_error_not_zeros() {
    let f = fixture(2, Behave::Fail, Behave::Corrupt, None);
    match f.core.read_by_inode_bytes(f.ino, 0, CHUNK) {
        Err(FsError::Unavailable(why)) => {
            assert!(why.to_string().contains("no source could serve it"), "{why}")
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

#[test]
fn a_hung_replica_costs_its_idle_timeout_then_the_next_serves() {
    let f = fixture(1, Behave::Hang, Behave::Good, None);
    assert!(read_all(&f, CHUNK).unwrap() == f.data);
    assert_eq!(f.replicas.log.lock().unwrap()[0].0, "a1");
}

#[test]
fn a_hung_local_node_costs_a_file_one_wait_not_one_per_read() {
    let f = fixture(8, Behave::Good, Behave::Good, Some(LocalBehave::Hang));
    let patience = f.core.settings.local_patience;
    let t = Instant::now();
    // Eight reads of one chunk each; before, each waited the whole patience again.
    let got = read_all(&f, CHUNK).unwrap();
    let took = t.elapsed();
    assert!(got == f.data, "the replicas served the file");
    assert_eq!(
        f.local.as_ref().unwrap().calls.load(Ordering::SeqCst),
        1,
        "one fetch per inode"
    );
    assert!(
        took < patience * 4,
        "8 reads took {took:?} with a patience of {patience:?}: each read waited again"
    );
}

#[test]
fn a_verified_local_file_is_read_locally_and_a_changed_one_is_refused() {
    let f = fixture(
        3,
        Behave::Fail,
        Behave::Fail,
        Some(LocalBehave::File(PathBuf::new())),
    );
    let (b, how) = f.core.read_by_inode_bytes(f.ino, 0, 1 << 20).unwrap();
    assert_eq!(how, "local");
    assert!(b == f.data);
    assert!(f.replicas.log.lock().unwrap().is_empty(), "no replica was asked");
    // Someone writes into the node's file after it was verified: the next read of it
    // fails instead of returning the new bytes.
    let LocalBehave::File(p) = &f.local.as_ref().unwrap().behave else {
        unreachable!()
    };
    std::thread::sleep(Duration::from_millis(20));
    let mut changed = f.data.clone();
    changed[10] ^= 0xff;
    std::fs::write(p, &changed).unwrap();
    assert!(matches!(
        f.core.read_by_inode_bytes(f.ino, 0, 100),
        Err(FsError::LocalChanged("changed after it was verified"))
    ));
}

#[test]
fn sequential_reads_fetch_the_next_chunks_ahead() {
    let f = fixture(8, Behave::Good, Behave::Good, None);
    for i in 0..3u64 {
        f.core
            .read_by_inode_bytes(f.ino, i * u64::from(CHUNK), CHUNK)
            .unwrap();
    }
    // A forward reader's window grows: after chunks 0, 1 and 2, chunks 3 and 4 are
    // asked for before anyone reads them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.replicas.requests_for(3) == 0 || f.replicas.requests_for(4) == 0 {
        assert!(
            Instant::now() < deadline,
            "no read-ahead: {:?}",
            f.replicas.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Reading them is served from what was fetched ahead: no second request.
    f.core
        .read_by_inode_bytes(f.ino, 3 * u64::from(CHUNK), CHUNK)
        .unwrap();
    assert_eq!(f.replicas.requests_for(3), 1);
    // A reader that jumps about gets no read-ahead past what it asked for.
    let g = fixture(8, Behave::Good, Behave::Good, None);
    g.core
        .read_by_inode_bytes(g.ino, 6 * u64::from(CHUNK), 10)
        .unwrap();
    g.core.read_by_inode_bytes(g.ino, u64::from(CHUNK), 10).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        g.replicas.requests_for(7),
        0,
        "{:?}",
        g.replicas.log.lock().unwrap()
    );
}

mod ranges;

mod io;
mod known;
mod ops;

/// The node's answers sorted by what they mean for the mount: its own trouble (not
/// answering) apart from one blob's (no source has it, every copy corrupt) and from a
/// refusal; the message keeps the code for the log.
#[test]
fn a_local_nodes_errors_say_whether_the_node_or_the_blob_is_at_fault() {
    use tonic::Status;
    let cases = [
        (
            Status::not_found("no live node or backup holds blob x"),
            "missing",
        ),
        (Status::data_loss("chunk 3 hash mismatch"), "corrupt"),
        (Status::unavailable("connection refused"), "unreachable"),
        (Status::deadline_exceeded("slow"), "unreachable"),
        (Status::failed_precondition("packed"), "refused"),
        (Status::resource_exhausted("full"), "refused"),
        (Status::permission_denied("not on the socket"), "refused"),
    ];
    for (s, want) in cases {
        let e = LocalError::from_status(&s);
        let got = match &e {
            LocalError::Missing(_) => "missing",
            LocalError::Corrupt(_) => "corrupt",
            LocalError::Unreachable(_) => "unreachable",
            LocalError::Refused(_) => "refused",
        };
        assert_eq!(got, want, "{s:?}");
        assert!(e.to_string().contains(s.message()), "{e}");
        assert!(e.to_string().contains(&format!("{:?}", s.code())), "{e}");
    }
}

/// A failed load keeps the service's code, so the CLI can tell "no such version" from
/// "the service is down".
#[test]
fn a_load_error_keeps_the_services_code() {
    let e = crate::LoadError::from(tonic::Status::not_found("dataset ds has no version 9"));
    match &e {
        crate::LoadError::Status(s) => assert_eq!(s.code(), tonic::Code::NotFound),
        other => panic!("{other:?}"),
    }
    assert_eq!(e.to_string(), "dataset ds has no version 9");
}
