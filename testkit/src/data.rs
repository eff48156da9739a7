//! Datasets on disk: deterministic bytes, a mixed tree, and `locus dataset import` of a directory.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::*;

// ---------------------------------------------------------------------------------------
// Datasets on disk

/// `n` deterministic pseudo-random bytes (BLAKE3's output stream for `seed`).
pub fn pseudo_random(seed: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    blake3::Hasher::new()
        .update(&seed.to_le_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

/// A mixed tree: `files` files from empty to over two 64 KiB chunks, nested directories,
/// symlinks, empty directories, duplicate contents, unicode and spaces in names.
pub fn make_tree(root: &Path, files: usize) {
    let bytes = |seed: usize, n: usize| pseudo_random(seed as u64, n);
    for i in 0..files {
        let dir = match i % 4 {
            0 => format!("train/class {:02}", i % 13),
            1 => format!("train/ünï/{:02}/deep", i % 7),
            2 => "val".to_string(),
            _ => String::new(),
        };
        let d = root.join(&dir);
        std::fs::create_dir_all(&d).unwrap();
        let size = match i % 10 {
            0 => 0,
            1..=6 => (i * 37) % 4096,
            7 | 8 => 10_000 + (i * 101) % 50_000,
            _ => 140_000 + (i * 13) % 60_000,
        };
        // Every 50th file repeats an earlier one's content: one blob, many files.
        let content = if i % 50 == 49 {
            bytes(i - 20, size)
        } else {
            bytes(i, size)
        };
        std::fs::write(d.join(format!("file {i:04}.bin")), content).unwrap();
    }
    std::fs::create_dir_all(root.join("empty/nested")).unwrap();
    for i in 0..5 {
        std::os::unix::fs::symlink(
            format!("../val/file {:04}.bin", i * 4 + 2),
            root.join(format!("val-link-{i}")),
        )
        .unwrap();
    }
    std::os::unix::fs::symlink("/etc/hostname", root.join("absolute-link")).unwrap();
}

/// `locus dataset import NAME DIR` with 64 KiB chunks and JSON output.
pub fn import(m: &Metadata, name: &str, dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "dataset",
        "import",
        name,
        dir.to_str().unwrap(),
        "--chunk-size",
        "64KiB",
        "--json",
    ];
    args.extend_from_slice(extra);
    m.cli(&args)
}

/// What a tree looks like through `stat`, `readlink`, `readdir` and `read`: path →
/// (kind, size, permission bits, mtime in ns, link target or content hash).
pub fn describe(root: &Path) -> BTreeMap<String, (char, u64, u32, i128, String)> {
    walk(root, true)
}

/// `describe` without reading files (the hash is left empty).
pub fn walk(root: &Path, content: bool) -> BTreeMap<String, (char, u64, u32, i128, String)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(root.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            let r = rel.join(&name);
            let p = root.join(&r);
            let m = std::fs::symlink_metadata(&p).unwrap();
            let mtime = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
            let perm = m.permissions().mode() & 0o7777;
            let key = r.to_string_lossy().into_owned();
            if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap().to_string_lossy().into_owned();
                out.insert(key, ('l', m.len(), perm, mtime, t));
            } else if m.is_dir() {
                out.insert(key, ('d', 0, perm, mtime, String::new()));
                stack.push(r);
            } else {
                let h = if content {
                    blake3::hash(&std::fs::read(&p).unwrap()).to_hex().to_string()
                } else {
                    String::new()
                };
                out.insert(key, ('f', m.len(), perm, mtime, h));
            }
        }
    }
    out
}

/// Asserts that two trees look the same through every call `describe` makes.
pub fn assert_same_tree(src: &Path, mounted: &Path) {
    let want = describe(src);
    let got = describe(mounted);
    assert_eq!(want.len(), got.len(), "number of entries");
    for (path, w) in &want {
        let g = got
            .get(path)
            .unwrap_or_else(|| panic!("{path} is missing from the mount"));
        assert_eq!(w, g, "{path}");
    }
}

/// `files_of`, without empty files (reading those never reaches a source).
pub fn nonempty_files(root: &Path) -> Vec<(PathBuf, String)> {
    files_of(root)
        .into_iter()
        .filter(|(p, _)| std::fs::metadata(root.join(p)).unwrap().len() > 0)
        .collect()
}

/// Every regular file under `root`: (relative path, BLAKE3 of its content).
pub fn files_of(root: &Path) -> Vec<(PathBuf, String)> {
    describe(root)
        .into_iter()
        .filter(|(_, v)| v.0 == 'f')
        .map(|(k, v)| (PathBuf::from(k), v.4))
        .collect()
}

/// Readers that go round `files` (relative path, BLAKE3) under `roots` (reader `r` reads
/// under `roots[r % roots.len()]`), each read cold (its pages dropped first) and checked,
/// counting good reads in `reads` until `stop`. A reader stops at its first error or wrong
/// byte and returns it.
pub fn spawn_verifying_readers(
    roots: &[PathBuf],
    files: std::sync::Arc<Vec<(PathBuf, String)>>,
    readers: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    reads: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Vec<std::thread::JoinHandle<Result<(), String>>> {
    use std::sync::atomic::Ordering;
    (0..readers)
        .map(|r| {
            let root = roots[r % roots.len()].clone();
            let (files, stop, reads) = (files.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut i = r * 37;
                while !stop.load(Ordering::Relaxed) {
                    let (rel, want) = &files[i % files.len()];
                    let p = root.join(rel);
                    // Forget cached pages so every pass really reads through the mount.
                    drop_page_cache(&p);
                    let data = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                    if blake3::hash(&data).to_hex().as_str() != want {
                        return Err(format!("{}: wrong bytes", p.display()));
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            })
        })
        .collect()
}
