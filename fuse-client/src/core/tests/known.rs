//! Paths learned from the local node a shard at a time: siblings opened without asking
//! again, and a sibling that changed asked again.

use super::*;

/// A node holding one file per blob in a directory, verified as they are now; counts the
/// `EnsureLocal` calls it answers.
struct DirLocal {
    dir: PathBuf,
    ensured: AtomicUsize,
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

#[test]
fn the_first_open_in_a_shard_learns_its_siblings_paths_and_a_changed_sibling_is_asked_again() {
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
                    // Two shards: f0..f3, then f4 and f5.
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
    });
    let settings = Settings {
        kernel_opens: true,
        passthrough: false,
        passthrough_min_size: 0,
        readahead_chunks: 4,
        open_timeout: Duration::from_secs(2),
        local_patience: Duration::from_secs(2),
        reopen_ttl: Duration::from_secs(60),
        generation: 1,
        readdirplus: Default::default(),
    };
    let core = Arc::new(Core::new(
        ns.clone(),
        rt.handle().clone(),
        Some(node.clone() as Arc<dyn LocalNode>),
        Arc::new(remote),
        metrics,
        settings,
    ));
    let ino = |i: usize| ns.lookup(crate::namespace::ROOT, &format!("f{i}")).unwrap();
    let blob = |i: usize| BlobHash::of(&files[i]);
    let open = |i: usize| {
        core.local_file(ino(i), blob(i), files[i].len() as u64)
            .map(|(f, _)| f)
    };
    assert!(open(1).is_some());
    assert_eq!(
        node.ensured.load(Ordering::SeqCst),
        1,
        "the first open asks the node"
    );
    // The shard's other files are learned in the background, in one call.
    let deadline = Instant::now() + Duration::from_secs(5);
    while core.known.lock().unwrap().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the siblings' paths were never learned"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // f3 is rewritten after the node listed it: its identity no longer matches.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(dir.path().join(blob(3).to_hex()), &files[3]).unwrap();
    for i in [0, 2] {
        let f = open(i).unwrap();
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &f.file, &mut got).unwrap();
        assert_eq!(got, files[i], "f{i}");
    }
    assert_eq!(
        node.ensured.load(Ordering::SeqCst),
        1,
        "siblings opened without asking"
    );
    assert!(open(3).is_some());
    assert_eq!(
        node.ensured.load(Ordering::SeqCst),
        2,
        "a changed file is asked about again"
    );
    // Another shard is not known from this one.
    assert!(open(4).is_some());
    assert_eq!(node.ensured.load(Ordering::SeqCst), 3);
    drop(core);
    rt.shutdown_background();
}
