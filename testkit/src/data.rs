//! Datasets on disk: deterministic bytes, a mixed tree, and `locus dataset import` of a directory.

use std::path::Path;

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
