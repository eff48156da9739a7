//! The segment files of a member's Raft log (`DATA_DIR/raft-log/segments`): records
//! appended, read back, cut at a truncation and deleted after a purge, and the entries
//! appended last kept in memory for the reads that follow an append. `group::log` puts
//! openraft's storage traits on top; the record format is described there.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use openraft::{Entry, LogId};

use super::TypeConfig;

/// A segment this large takes no more entries.
pub(super) const SEGMENT_BYTES: u64 = 64 << 20;
/// Length, index, checksum.
pub(super) const HEADER: usize = 4 + 8 + 8;

/// Where one entry's record is.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loc {
    /// The segment (its first index).
    seg: u64,
    /// The record's offset in it.
    off: u64,
    /// The payload's length.
    len: u32,
}

pub(super) struct Segments {
    dir: PathBuf,
    /// The index of `held[0]`.
    pub(super) first: u64,
    /// Every entry not purged, in order.
    pub(super) held: VecDeque<Loc>,
    /// The last entry's id.
    pub(super) last: Option<LogId<u64>>,
    /// Segment files by first index, with their lengths, in order.
    files: std::collections::BTreeMap<u64, u64>,
    /// Open handles (for reading and, the last one, appending).
    open: HashMap<u64, File>,
    /// A segment this long takes no more entries (`SEGMENT_BYTES`; smaller in tests).
    roll: u64,
    /// The last entries appended, as they were handed in (consecutive, ending at the last
    /// entry held): replication to each follower and the member's own apply read an
    /// entry soon after its append, and reading it back from its segment cost a copy, a
    /// checksum and a decode of every page, three times over on a leader.
    pub(super) recent: VecDeque<(Entry<TypeConfig>, usize)>,
    /// The record bytes of `recent` (each entry's beside it).
    recent_bytes: usize,
}

/// `Segments::recent` keeps at most this many record bytes and entries.
pub(super) const RECENT_BYTES: usize = 128 << 20;
pub(super) const RECENT_ENTRIES: usize = 4096;

/// One record ready to append: header and the serialised entry, in one buffer.
pub(super) struct Appended {
    pub(super) id: LogId<u64>,
    pub(super) record: Vec<u8>,
    /// The entry itself, kept in `Segments::recent`; None: not kept (a migration).
    pub(super) entry: Option<Entry<TypeConfig>>,
}

pub(super) fn checksum(index: u64, payload: &[u8]) -> [u8; 8] {
    let mut h = blake3::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(payload);
    let mut out = [0u8; 8];
    out.copy_from_slice(&h.finalize().as_bytes()[..8]);
    out
}

/// One record: header and payload.
pub(super) fn record(index: u64, payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(HEADER + payload.len());
    r.resize(HEADER, 0);
    r.extend_from_slice(payload);
    seal(&mut r, index);
    r
}

/// An entry's record, serialised straight into the buffer that is written (no copy of
/// the payload into a second one).
pub(super) fn record_of(e: &Entry<TypeConfig>) -> Result<Vec<u8>, bincode::Error> {
    let hint = match &e.payload {
        openraft::EntryPayload::Normal(b) => b.encoded_len_hint(),
        _ => 256,
    };
    let mut r = Vec::with_capacity(HEADER + 64 + hint);
    r.resize(HEADER, 0);
    bincode::serialize_into(&mut r, e)?;
    seal(&mut r, e.log_id.index);
    Ok(r)
}

/// Fills in the header of a record whose payload follows it.
fn seal(r: &mut [u8], index: u64) {
    let (h, payload) = r.split_at_mut(HEADER);
    h[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[4..12].copy_from_slice(&index.to_le_bytes());
    h[12..20].copy_from_slice(&checksum(index, payload));
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Segments {
    fn path(&self, seg: u64) -> PathBuf {
        self.dir.join(format!("{seg:020}.seg"))
    }

    fn file(&mut self, seg: u64) -> std::io::Result<&File> {
        if !self.open.contains_key(&seg) {
            let f = OpenOptions::new().read(true).write(true).open(self.path(seg))?;
            self.open.insert(seg, f);
        }
        Ok(&self.open[&seg])
    }

    /// Reads every segment under `dir`, keeping entries after `purged`.
    pub(super) fn load(dir: &Path, purged: Option<u64>, roll: u64) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut names: Vec<u64> = Vec::new();
        for d in std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))? {
            let d = d.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
            let name = d.file_name().to_string_lossy().into_owned();
            match name.strip_suffix(".seg").and_then(|n| n.parse().ok()) {
                Some(i) => names.push(i),
                None => return Err(format!("{} is not a log segment", d.path().display())),
            }
        }
        names.sort_unstable();
        let mut s = Segments {
            dir: dir.to_path_buf(),
            first: purged.map_or(0, |p| p + 1),
            held: VecDeque::new(),
            last: None,
            files: Default::default(),
            open: HashMap::new(),
            roll,
            recent: VecDeque::new(),
            recent_bytes: 0,
        };
        let mut next: Option<u64> = None;
        let mut last_payload = Vec::new();
        for (k, &seg) in names.iter().enumerate() {
            let path = s.path(seg);
            let is_last = k + 1 == names.len();
            let file = File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            let size = file
                .metadata()
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?
                .len();
            let mut f = std::io::BufReader::with_capacity(1 << 20, file);
            let mut off = 0u64;
            let mut payload = Vec::new();
            loop {
                let mut h = [0u8; HEADER];
                match read_full(&mut f, &mut h) {
                    Ok(0) => break,
                    Ok(n) if n == HEADER => {}
                    Ok(_) if is_last => {
                        cut(&path, off)?;
                        break;
                    }
                    Ok(_) => return Err(damaged(&path, off, "a record cut short")),
                    Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
                }
                let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
                let index = u64::from_le_bytes(h[4..12].try_into().expect("8 bytes"));
                // A torn or damaged header may claim any length: never read (or allocate)
                // past the file's end.
                if off + (HEADER as u64) + u64::from(len) > size {
                    if is_last {
                        cut(&path, off)?;
                        break;
                    }
                    return Err(damaged(&path, off, "a record longer than the rest of its file"));
                }
                payload.resize(len as usize, 0);
                let n = read_full(&mut f, &mut payload)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let whole = n == payload.len() && checksum(index, &payload) == h[12..20];
                if !whole {
                    if is_last {
                        // An append that never returned: it was never acknowledged.
                        cut(&path, off)?;
                        break;
                    }
                    return Err(damaged(&path, off, "a record whose checksum does not match"));
                }
                // A segment starts at the entry it is named by, and follows on from the last.
                let expected = if off == 0 { seg } else { next.unwrap_or(seg) };
                if index != expected || (off == 0 && next.is_some_and(|n| n != seg)) {
                    return Err(damaged(
                        &path,
                        off,
                        &format!("entry {index} where entry {expected} belongs"),
                    ));
                }
                next = Some(index + 1);
                if purged.is_none_or(|p| index > p) {
                    if s.held.is_empty() {
                        s.first = index;
                    }
                    s.held.push_back(Loc { seg, off, len });
                    std::mem::swap(&mut last_payload, &mut payload);
                }
                off += (HEADER + len as usize) as u64;
            }
            if off == 0 {
                // Created by an append that wrote nothing, or emptied by a cut.
                std::fs::remove_file(&path).map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
            } else {
                s.files.insert(seg, off);
            }
        }
        if !s.held.is_empty() {
            let e: Entry<TypeConfig> = bincode::deserialize(&last_payload)
                .map_err(|e| format!("the last entry in {} cannot be decoded: {e}", dir.display()))?;
            s.last = Some(e.log_id);
        }
        // Segments holding only purged entries (a purge that stopped before deleting them).
        if let Some(p) = purged {
            s.drop_purged(p)
                .map_err(|e| format!("cannot delete purged segments: {e}"))?;
        }
        Ok(s)
    }

    /// Appends records, rolling to a new segment past `SEGMENT_BYTES`; durable on return.
    pub(super) fn append(&mut self, entries: Vec<Appended>) -> std::io::Result<()> {
        let mut touched = Vec::new();
        for Appended { id, record: r, entry } in entries {
            let index = id.index;
            let tail = self.files.iter().next_back().map(|(s, l)| (*s, *l));
            let seg = match tail {
                Some((seg, len)) if len < self.roll => seg,
                _ => {
                    let path = self.path(index);
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create_new(true)
                        .open(&path)?;
                    sync_dir(&self.dir)?;
                    self.open.insert(index, f);
                    self.files.insert(index, 0);
                    index
                }
            };
            let off = self.files[&seg];
            self.file(seg)?.write_all_at(&r, off)?;
            if !touched.contains(&seg) {
                touched.push(seg);
            }
            *self.files.get_mut(&seg).expect("present") += r.len() as u64;
            if self.held.is_empty() {
                self.first = index;
            }
            self.held.push_back(Loc {
                seg,
                off,
                len: (r.len() - HEADER) as u32,
            });
            self.last = Some(id);
            self.keep_recent(index, r.len(), entry);
        }
        for seg in touched {
            self.file(seg)?.sync_data()?;
        }
        Ok(())
    }

    /// Keeps an entry just appended in `recent`, dropping the oldest past the bounds.
    fn keep_recent(&mut self, index: u64, bytes: usize, entry: Option<Entry<TypeConfig>>) {
        let follows = self
            .recent
            .back()
            .is_none_or(|(e, _)| e.log_id.index + 1 == index);
        let Some(e) = entry.filter(|_| follows) else {
            self.recent.clear();
            self.recent_bytes = 0;
            return;
        };
        self.recent.push_back((e, bytes));
        self.recent_bytes += bytes;
        while self.recent.len() > 1
            && (self.recent_bytes > RECENT_BYTES || self.recent.len() > RECENT_ENTRIES)
        {
            let (_, b) = self.recent.pop_front().expect("more than one");
            self.recent_bytes -= b;
        }
    }

    /// Entry `index` if `recent` has it.
    fn recent_entry(&self, index: u64) -> Option<&Entry<TypeConfig>> {
        let first = self.recent.front()?.0.log_id.index;
        let i = usize::try_from(index.checked_sub(first)?).ok()?;
        self.recent.get(i).map(|(e, _)| e)
    }

    /// Forgets what `recent` holds from `index` on (a truncation).
    fn forget_recent_from(&mut self, index: u64) {
        while self.recent.back().is_some_and(|(e, _)| e.log_id.index >= index) {
            let (_, b) = self.recent.pop_back().expect("checked");
            self.recent_bytes -= b;
        }
    }

    /// Forgets what `recent` holds up to `index` (a purge).
    fn forget_recent_to(&mut self, index: u64) {
        while self.recent.front().is_some_and(|(e, _)| e.log_id.index <= index) {
            let (_, b) = self.recent.pop_front().expect("checked");
            self.recent_bytes -= b;
        }
    }

    /// Removes every entry from `index` on.
    pub(super) fn truncate(&mut self, index: u64) -> std::io::Result<()> {
        self.forget_recent_from(index);
        if index < self.first {
            return Ok(());
        }
        let keep = (index - self.first) as usize;
        if keep >= self.held.len() {
            return Ok(());
        }
        let cut_at = self.held[keep];
        // Later segments first, highest first: a crash part way leaves a log that ends
        // earlier than it did, never one with a gap.
        let later: Vec<u64> = self
            .files
            .range(cut_at.seg + 1..)
            .map(|(s, _)| *s)
            .rev()
            .collect();
        for seg in later {
            self.open.remove(&seg);
            std::fs::remove_file(self.path(seg))?;
            self.files.remove(&seg);
        }
        if cut_at.off == 0 {
            self.open.remove(&cut_at.seg);
            std::fs::remove_file(self.path(cut_at.seg))?;
            self.files.remove(&cut_at.seg);
        } else {
            let f = self.file(cut_at.seg)?;
            f.set_len(cut_at.off)?;
            f.sync_all()?;
            self.files.insert(cut_at.seg, cut_at.off);
        }
        sync_dir(&self.dir)?;
        self.held.truncate(keep);
        self.last = None;
        Ok(())
    }

    /// Forgets entries up to `index` and deletes the segments that hold nothing else.
    pub(super) fn drop_purged(&mut self, index: u64) -> std::io::Result<()> {
        self.forget_recent_to(index);
        while self.first <= index && self.held.pop_front().is_some() {
            self.first += 1;
        }
        if self.held.is_empty() {
            self.first = self.first.max(index + 1);
            self.last = None;
        }
        // A segment goes when the next one starts at or before the first entry kept (or,
        // the last one, when nothing is kept).
        let segs: Vec<u64> = self.files.keys().copied().collect();
        let mut removed = false;
        for (k, seg) in segs.iter().enumerate() {
            let next = segs.get(k + 1).copied();
            let only_purged = match next {
                Some(n) => n <= index + 1,
                None => self.held.is_empty(),
            };
            if !only_purged {
                break;
            }
            self.open.remove(seg);
            std::fs::remove_file(self.path(*seg))?;
            self.files.remove(seg);
            removed = true;
        }
        if removed {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }

    pub(super) fn read(&mut self, from: u64, to: u64) -> Result<Vec<Entry<TypeConfig>>, String> {
        let from = from.max(self.first);
        let to = to.min(self.first + self.held.len() as u64);
        let mut out = Vec::with_capacity(to.saturating_sub(from) as usize);
        let mut buf = Vec::new();
        for i in from..to {
            if let Some(e) = self.recent_entry(i) {
                out.push(e.clone());
                continue;
            }
            let loc = self.held[(i - self.first) as usize];
            buf.resize(HEADER + loc.len as usize, 0);
            let path = self.path(loc.seg);
            self.file(loc.seg)
                .and_then(|f| f.read_exact_at(&mut buf, loc.off))
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            if buf[12..20] != checksum(i, &buf[HEADER..]) {
                return Err(damaged(&path, loc.off, "a record whose checksum does not match"));
            }
            out.push(bincode::deserialize(&buf[HEADER..]).map_err(|e| e.to_string())?);
        }
        Ok(out)
    }
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(f: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

fn cut(path: &Path, at: u64) -> Result<(), String> {
    tracing::warn!(segment = %path.display(), offset = at, "the Raft log ends in an append that never completed; cutting it off");
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    f.set_len(at)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("cannot cut {} at {at}: {e}", path.display()))
}

fn damaged(path: &Path, off: u64, what: &str) -> String {
    format!(
        "the Raft log segment {} is damaged at offset {off} ({what}); move this member's data \
         directory away and start it again: it rejoins the group and receives a snapshot",
        path.display()
    )
}
