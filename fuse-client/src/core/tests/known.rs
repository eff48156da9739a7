//! Paths learned from the local node a shard at a time: siblings opened without asking
//! again, and a sibling that changed asked again.

use super::*;

/// A node holding one file per blob in a directory, verified as they are now; counts the
/// `EnsureLocal` calls it answers.
struct DirLocal {
    dir: PathBuf,
    ensured: AtomicUsize,
    listed: AtomicUsize,
    /// Blobs kept in the pack file `pack` instead, at these offsets.
    packed: HashMap<BlobHash, u64>,
    /// Whether it hands out files by windows (the open socket), and the calls doing so.
    hands_out: bool,
    handed: AtomicUsize,
}

impl DirLocal {
    fn file(&self, blob: &BlobHash) -> PathBuf {
        match self.packed.contains_key(blob) {
            true => self.dir.join("pack"),
            false => self.dir.join(blob.to_hex()),
        }
    }

    fn at(&self, blob: &BlobHash) -> NodeBlob {
        NodeBlob {
            path: self.file(blob),
            offset: self.packed.get(blob).copied().unwrap_or(0),
            packed: self.packed.contains_key(blob),
        }
    }
}

impl LocalNode for DirLocal {
    fn ensure_local(&self, blob: BlobHash, _size: u64, _limit: Duration) -> Result<NodeBlob, LocalError> {
        self.ensured.fetch_add(1, Ordering::SeqCst);
        Ok(self.at(&blob))
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
                let at = self.at(b);
                let m = std::fs::metadata(&at.path).ok()?;
                Some(KnownPath {
                    path: at.path,
                    ino: m.ino(),
                    ctime_s: m.ctime(),
                    ctime_ns: m.ctime_nsec(),
                    size: m.len(),
                    offset: at.offset,
                    packed: at.packed,
                })
            })
            .collect())
    }

    fn hands_out_files(&self) -> bool {
        self.hands_out
    }

    fn open_many(&self, blobs: &[BlobHash], _limit: Duration) -> Result<Vec<Option<NodeFile>>, LocalError> {
        self.handed.fetch_add(1, Ordering::SeqCst);
        Ok(blobs.iter().map(|b| NodeFile::open(&self.at(b)).ok()).collect())
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

/// The first shard's files (f0..f3) in one pack, each at an offset off any page boundary
/// with a neighbour on both sides; written to `path`.
fn write_pack(path: &std::path::Path, files: &[Vec<u8>]) -> HashMap<BlobHash, u64> {
    let mut pack = vec![0xAAu8; 100];
    let mut at = HashMap::new();
    for data in &files[..4] {
        at.insert(BlobHash::of(data), pack.len() as u64);
        pack.extend_from_slice(data);
        pack.extend_from_slice(&[0xBB; 37]);
    }
    std::fs::write(path, &pack).unwrap();
    at
}

impl Shards {
    fn new(reopen_ttl: Duration) -> Shards {
        Shards::build(reopen_ttl, false, false, recent_capacity())
    }

    /// `new`, with the first shard's blobs in one pack.
    fn packed(reopen_ttl: Duration) -> Shards {
        Shards::build(reopen_ttl, true, false, recent_capacity())
    }

    /// A node that hands out files by inode windows, behind a core that keeps at most
    /// `room` files open.
    fn handing_out(reopen_ttl: Duration, room: usize) -> Shards {
        Shards::build(reopen_ttl, false, true, room)
    }

    fn build(reopen_ttl: Duration, pack: bool, hands_out: bool, room: usize) -> Shards {
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
        let packed = match pack {
            true => write_pack(&dir.path().join("pack"), &files),
            false => HashMap::new(),
        };
        let node = Arc::new(DirLocal {
            dir: dir.path().to_path_buf(),
            ensured: AtomicUsize::new(0),
            listed: AtomicUsize::new(0),
            packed,
            hands_out,
            handed: AtomicUsize::new(0),
        });
        let settings = kernel_opens_settings(Duration::from_secs(2), reopen_ttl);
        let mut core = Core::new(
            ns.clone(),
            rt.handle().clone(),
            Some(node.clone() as Arc<dyn LocalNode>),
            Arc::new(remote),
            metrics,
            settings,
        );
        core.recent_max = room;
        let core = Arc::new(core);
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

    fn ino(&self, i: usize) -> u64 {
        self.ns.lookup(crate::namespace::ROOT, &format!("f{i}")).unwrap()
    }

    /// `f{i}` whole, as a read that ends the blob gets it: direct, into a page-aligned
    /// buffer with the room the read path gives it.
    fn read_direct(&self, i: usize, f: &NodeFile) -> Vec<u8> {
        let want = self.files[i].len();
        let room = direct_room(f.base, want);
        let mut space = vec![0u8; room + DIRECT_ALIGN];
        let at = space.as_ptr().align_offset(DIRECT_ALIGN);
        let buf = &mut space[at..at + room];
        let n = self.core.pread_local(self.ino(i), f, 0, want, true, buf).unwrap();
        buf[..n].to_vec()
    }

    fn ensured(&self) -> usize {
        self.node.ensured.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` paths were learned within the reopen window.
    fn wait_learned(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let window = self.core.settings.reopen_ttl;
        while self.core.known.lock().unwrap().fresh(window) < n {
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
        std::io::Read::read_to_end(&mut f.file(), &mut got).unwrap();
        assert_eq!(got, t.files[i], "f{i}");
    }
    assert_eq!(t.ensured(), 1, "siblings opened without asking");
    assert!(t.open(3).is_some());
    assert_eq!(t.ensured(), 2, "a changed file is asked about again");
    assert_eq!(
        t.core.known.lock().unwrap().fresh(Duration::from_secs(60)),
        2,
        "the changed file's path is forgotten, its siblings' kept"
    );
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

/// Descriptors this process holds open on `path`.
fn open_on(path: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p == path)
        .count()
}

/// Small files are packed on the nodes: a cold pass over a shard opens its pack once (and
/// once more for direct reads), not twice per file, and each file still reads its own
/// bytes and none of its neighbours'.
#[test]
fn the_files_of_one_pack_share_its_descriptors_and_read_their_own_bytes() {
    let t = Shards::packed(Duration::from_secs(60));
    let pack = t.dir.path().join("pack");
    assert!(t.open(1).is_some());
    t.wait_learned(3);
    let files: Vec<_> = [0, 2, 3].map(|i| t.open(i).unwrap()).into();
    assert_eq!(t.ensured(), 1, "siblings opened from learned paths");
    assert!(
        files.iter().all(|f| f.packed && Arc::ptr_eq(&f.fd, &files[0].fd)),
        "one pack, one descriptor"
    );
    for (f, i) in files.iter().zip([0, 2, 3]) {
        assert_eq!(t.read_direct(i, f), t.files[i], "f{i}");
    }
    // f1's own (from EnsureLocal), and the siblings' shared one with its direct twin.
    let takes_direct = open_direct(files[0].file()).is_some();
    assert_eq!(open_on(&pack), if takes_direct { 3 } else { 2 });
    t.stop();
}

/// A pack replaced at the same path (a new inode) is never read through descriptors of the
/// file it replaced: the identity the node verified must be the open file's.
#[test]
fn a_pack_replaced_at_its_path_is_opened_again_not_read_through_the_old_descriptors() {
    let ttl = Duration::from_millis(300);
    let t = Shards::packed(ttl);
    let pack = t.dir.path().join("pack");
    assert!(t.open(1).is_some());
    t.wait_learned(3);
    let old = t.open(0).unwrap();
    std::thread::sleep(ttl + Duration::from_millis(50));
    // The same blobs, each now at another offset, in a new file renamed over the old.
    let files: Vec<Vec<u8>> = std::iter::once(vec![9u8; 5000])
        .chain(t.files.iter().cloned())
        .collect();
    let tmp = t.dir.path().join("pack.new");
    let at = write_pack(&tmp, &files[1..]);
    assert_eq!(at, t.node.packed, "the offsets the node lists stay as they were");
    std::fs::rename(&tmp, &pack).unwrap();
    // Past the window: the next file asks the node, and the shard is listed again with
    // the new file's identity.
    assert!(t.open(1).is_some());
    t.wait_learned(3);
    let new = t.open(2).unwrap();
    assert!(
        !Arc::ptr_eq(&new.fd, &old.fd),
        "the replaced pack's descriptors were reused"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        new.file().metadata().unwrap().ino(),
        std::fs::metadata(&pack).unwrap().ino()
    );
    assert_eq!(t.read_direct(2, &new), t.files[2]);
    t.stop();
}

/// A version holds more files than a mount keeps open, so a job's second pass within the
/// window finds most of them closed for room: each is opened again from the path the node
/// listed (a pack's from its descriptors), not asked of the node one by one, which hashes
/// it again (a second pass over 7,000 cold files ran at 0.4× the first).
#[test]
fn a_file_closed_for_room_within_the_window_is_opened_again_from_its_listed_path() {
    for t in [
        Shards::new(Duration::from_secs(60)),
        Shards::packed(Duration::from_secs(60)),
    ] {
        assert!(t.open(1).is_some());
        t.wait_learned(3);
        for i in [0, 2, 3] {
            assert!(t.open(i).is_some());
        }
        // What `Core::remember` does when the open files fill the room it has.
        t.core.recent.lock().unwrap().clear();
        for i in [0, 2, 3] {
            let f = t.open(i).unwrap();
            assert_eq!(t.read_direct(i, &f), t.files[i], "f{i} read again");
        }
        assert_eq!(
            (t.ensured(), t.node.listed.load(Ordering::SeqCst)),
            (1, 1),
            "reopened without asking the node"
        );
        t.stop();
    }
}

/// The same for a node that hands out files (the open socket, which lists no paths): the
/// files it handed out are closed for room like any, and the next open asks for its
/// window again instead of each file alone for the rest of the window.
#[test]
fn files_a_node_handed_out_and_closed_for_room_are_asked_for_by_window_again() {
    let t = Shards::handing_out(Duration::from_secs(60), 8);
    assert!(t.open(1).is_some());
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.core.recent_file(t.ino(5)).is_none() {
        assert!(
            Instant::now() < deadline,
            "the window's files were never handed out"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!((t.ensured(), t.node.handed.load(Ordering::SeqCst)), (1, 1));
    // Other files opened meanwhile fill the room; the window's files are closed.
    let other = Arc::new(NodeFile::open(&t.node.at(&t.blob(0))).unwrap());
    for ino in 100..110 {
        t.core.remember(ino, other.clone());
    }
    assert!(t.core.recent_file(t.ino(2)).is_none(), "f2 still open");
    // f0 asks for itself, and its window is handed out again for the rest.
    assert!(t.open(0).is_some());
    assert_eq!(t.ensured(), 2);
    while t.core.recent_file(t.ino(2)).is_none() {
        assert!(Instant::now() < deadline, "the window was not asked for again");
        std::thread::sleep(Duration::from_millis(10));
    }
    for i in 2..6 {
        assert!(t.open(i).is_some(), "f{i}");
    }
    assert_eq!(
        (t.ensured(), t.node.handed.load(Ordering::SeqCst)),
        (2, 2),
        "one more window asked, no file alone"
    );
    t.stop();
}
