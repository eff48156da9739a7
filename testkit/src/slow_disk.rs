//! A disk made slow for chosen processes only: a block-I/O cgroup that lets them read a
//! few times a second from the disk under a path, so a test can hold a read in flight
//! (a mount's read ahead, a node's verify) for as long as it needs without a fault
//! injected in the code under test. cgroup v2's `io.max` where the `io` controller is
//! on, else cgroup v1's `blkio.throttle.read_iops_device`. Needs root; a machine without
//! either fails the test that asks, with the reason.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub struct SlowDisk {
    dir: PathBuf,
    /// Where processes go back to when the throttle is dropped.
    root: PathBuf,
}

impl SlowDisk {
    /// At most `iops` reads a second from the disk that holds `under`, for the processes
    /// later given to `add`.
    pub fn new(under: &Path, iops: u32) -> SlowDisk {
        let dev = whole_disk(under);
        let name = format!("locus-test-slow-{}-{}", std::process::id(), unique());
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let (root, file, rule) =
            if std::fs::read_to_string(v2).is_ok_and(|c| c.split_whitespace().any(|c| c == "io")) {
                (
                    PathBuf::from("/sys/fs/cgroup"),
                    "io.max",
                    format!("{dev} riops={iops}"),
                )
            } else if Path::new("/sys/fs/cgroup/blkio/cgroup.procs").exists() {
                (
                    PathBuf::from("/sys/fs/cgroup/blkio"),
                    "blkio.throttle.read_iops_device",
                    format!("{dev} {iops}"),
                )
            } else {
                panic!("no block-I/O cgroup here (cgroup v2 `io` or v1 `blkio`): a slow disk cannot be made");
            };
        if file == "io.max" {
            // A child's io.max exists only once the root hands the controller down.
            let _ = std::fs::write(root.join("cgroup.subtree_control"), "+io");
        }
        let dir = root.join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e} (needs root)", dir.display()));
        let slow = SlowDisk { dir, root };
        std::fs::write(slow.dir.join(file), &rule)
            .unwrap_or_else(|e| panic!("{}: {rule}: {e}", slow.dir.join(file).display()));
        slow
    }

    /// Process `pid` (all its threads) reads slowly from now on.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", self.dir.display()));
    }
}

impl Drop for SlowDisk {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
            }
        }
        // A cgroup whose last process just left may still be busy for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("warning: {} was left behind", self.dir.display());
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// `MAJOR:MINOR` of the whole disk holding `path` (throttles apply to disks, not to
/// their partitions).
fn whole_disk(path: &Path) -> String {
    let dev = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .dev();
    let (major, minor) = (libc_major(dev), libc_minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    assert!(
        sys.exists(),
        "{} is on device {major}:{minor}, which is no block device (tmpfs, overlay?): it cannot be made slow",
        path.display()
    );
    if sys.join("partition").exists() {
        let disk = std::fs::canonicalize(&sys).unwrap();
        let parent = disk.parent().unwrap().join("dev");
        return std::fs::read_to_string(&parent)
            .unwrap_or_else(|e| panic!("{}: {e}", parent.display()))
            .trim()
            .to_string();
    }
    format!("{major}:{minor}")
}

// The glibc encoding of dev_t (gnu_dev_major / gnu_dev_minor).
fn libc_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)
}

fn libc_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)
}
