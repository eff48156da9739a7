//! Paths learned from the local node a shard at a time: siblings opened without asking
//! again, and a sibling that changed asked again.

use super::*;

/// A node holding one file per blob in a directory, verified as they are now; counts the
/// `EnsureLocal` calls it answers.
struct DirLocal {
    dir: PathBuf,
    ensured: AtomicUsize,
    listed: AtomicUsize,
}

impl DirLocal {
    fn file(&self, blob: &BlobHash) -> PathBuf {
        self.dir.join(blob.to_hex())
    }
}

impl LocalNode for DirLocal {
    fn ensure_local(&self, blob: BlobHash, _size: u64, _limit: Duration) -> Result<NodeBlob, LocalError> {
        self.ensured.fetch_add(1, Ordering::SeqCst);
        Ok(NodeBlob::whole(self.file(&blob)))
    }

    fn local_paths(
        &self,
        blobs: &[BlobHash],
        _limit: Duration,
    ) -> Result<Vec<Option<KnownPath>>, LocalError> {
        use std::os::unix::fs::MetadataExt;
        self.listed.fetch_add(1, Ordering::SeqCst);
        Ok(blobs
            .iter()
            .map(|b| {
                let path = self.file(b);
                let m = std::fs::metadata(&path).ok()?;
                Some(KnownPath {
                    path,
                    ino: m.ino(),
                    ctime_s: m.ctime(),
                    ctime_ns: m.ctime_nsec(),
                    size: m.len(),
                    offset: 0,
                    packed: false,
                })
            })
            .collect())
    }
}

/// Six files in two shards (f0..f3, then f4 and f5), each blob a file of its own in a
/// directory the node lists, behind a core that keeps verified files for `reopen_ttl`.
struct Shards {
    dir: tempfile::TempDir,
    files: Vec<Vec<u8>>,
    ns: Arc<Namespace>,
    rt: tokio::runtime::Runtime,
    node: Arc<DirLocal>,
    core: Arc<Core>,
}

impl Shards {
    fn new(reopen_ttl: Duration) -> Shards {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i + 1; 1000 + usize::from(i)]).collect();
        let entries: Vec<Entry> = files
            .iter()
            .enumerate()
            .map(|(i, data)| {
                let blob = BlobHash::of(data);
                std::fs::write(dir.path().join(blob.to_hex()), data).unwrap();
                Entry {
                    path: RelPath::try_from(format!("f{i}")).unwrap(),
                    kind: EntryKind::File {
                        size: data.len() as u64,
                        blob,
                        chunks: vec![blob],
                        shard: u32::from(i >= 4),
                    },
                    mode: 0o644,
                    mtime_ns: 1,
                }
            })
            .collect();
        let ns = Arc::new(Namespace::build(entries, CHUNK).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let metrics = Arc::new(Metrics::default());
        let remote = Remote::new(
            Arc::new(FakeReplicas {
                data: Vec::new(),
                behave: Mutex::new(HashMap::new()),
                log: Mutex::new(Vec::new()),
                range_log: Mutex::new(Vec::new()),
                tree: Default::default(),
            }),
            Place::default(),
            Topology::default(),
            1 << 20,
            metrics.clone(),
        );
        let node = Arc::new(DirLocal {
            dir: dir.path().to_path_buf(),
            ensured: AtomicUsize::new(0),
            listed: AtomicUsize::new(0),
        });
        let settings = kernel_opens_settings(Duration::from_secs(2), reopen_ttl);
        let core = Arc::new(Core::new(
            ns.clone(),
            rt.handle().clone(),
            Some(node.clone() as Arc<dyn LocalNode>),
            Arc::new(remote),
            metrics,
            settings,
        ));
        Shards {
            dir,
            files,
            ns,
            rt,
            node,
            core,
        }
    }

    fn blob(&self, i: usize) -> BlobHash {
        BlobHash::of(&self.files[i])
    }

    /// The node's file for `f{i}`, as a read or an open gets it.
    fn open(&self, i: usize) -> Option<Arc<NodeFile>> {
        let ino = self.ns.lookup(crate::namespace::ROOT, &format!("f{i}")).unwrap();
        self.core
            .local_file(ino, self.blob(i), self.files[i].len() as u64)
            .map(|(f, _)| f)
    }

    fn ensured(&self) -> usize {
        self.node.ensured.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` learned paths wait to be used.
    fn wait_learned(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.core.known.lock().unwrap().len() < n {
            assert!(
                Instant::now() < deadline,
                "the siblings' paths were never learned"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(self) {
        drop(self.core);
        self.rt.shutdown_background();
    }
}

#[test]
fn the_first_open_in_a_shard_learns_its_siblings_paths_and_a_changed_sibling_is_asked_again() {
    let t = Shards::new(Duration::from_secs(60));
    assert!(t.open(1).is_some());
    assert_eq!(t.ensured(), 1, "the first open asks the node");
    // The shard's other files are learned in the background, in one call.
    t.wait_learned(3);
    // f3 is rewritten after the node listed it: its identity no longer matches.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(t.dir.path().join(t.blob(3).to_hex()), &t.files[3]).unwrap();
    for i in [0, 2] {
        let f = t.open(i).unwrap();
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &f.file, &mut got).unwrap();
        assert_eq!(got, t.files[i], "f{i}");
    }
    assert_eq!(t.ensured(), 1, "siblings opened without asking");
    assert!(t.open(3).is_some());
    assert_eq!(t.ensured(), 2, "a changed file is asked about again");
    // Another shard is not known from this one.
    assert!(t.open(4).is_some());
    assert_eq!(t.ensured(), 3);
    t.stop();
}

/// A training job's next epoch comes after the reopen window: the files it re-reads are
/// asked of the node again, a shard in one call as the first time, not one by one (which
/// halved a cold pass over small files that came more than 30 s after the last).
#[test]
fn after_the_reopen_window_a_shards_files_are_learned_again_in_one_call() {
    let ttl = Duration::from_millis(300);
    let t = Shards::new(ttl);
    assert!(t.open(1).is_some());
    t.wait_learned(3);
    for i in [0, 2, 3] {
        assert!(t.open(i).is_some());
    }
    assert_eq!((t.ensured(), t.node.listed.load(Ordering::SeqCst)), (1, 1));
    // Within the window the files are reused without asking anything.
    for i in 0..4 {
        assert!(t.open(i).is_some());
    }
    assert_eq!((t.ensured(), t.node.listed.load(Ordering::SeqCst)), (1, 1));

    std::thread::sleep(ttl + Duration::from_millis(50));
    // The first file past the window asks for itself and has its siblings listed again.
    assert!(t.open(0).is_some());
    assert_eq!(t.ensured(), 2);
    t.wait_learned(3);
    for i in 1..4 {
        assert!(t.open(i).is_some(), "f{i}");
    }
    assert_eq!(
        (t.ensured(), t.node.listed.load(Ordering::SeqCst)),
        (2, 2),
        "the rest of the shard opened from one more listing"
    );
    t.stop();
}
