//! What benches measure their results against: cold reads of plain files, and the raw TCP
//! rate between two test-bed hosts (a stream from this very binary, re-run inside each
//! host's namespace, so the reference costs no more per byte than it must).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::*;

/// Writes dirty pages back and drops the page cache; false without root.
pub fn drop_caches() -> bool {
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Where a virtual machine's kernel reports freed memory to its host, which then takes
/// the pages back (virtio-balloon free page reporting): the guest's next touch of each
/// such page costs a host fault and a zeroed page. Measured on the bench machines: 6 s of
/// system time to touch 20 GiB once (6 ms per MiB), charged to whatever touched it
/// first. Every `drop_caches` and every exiting process frees memory that the next part
/// of a bench then pays for, in whichever process happens to touch it (a receive copy,
/// a page-cache read), so CPU-per-MiB figures moved 2–3× with the order of the parts.
const PAGE_REPORTING_ORDER: &str = "/sys/module/page_reporting/parameters/page_reporting_order";

/// Keeps freed memory in this machine while it lives (see [`PAGE_REPORTING_ORDER`]):
/// stops free page reporting (an order above the largest block is never reported), then
/// touches `LOCUS_BENCH_PRETOUCH_MIB` (default 6144) of memory once, so the pages the
/// bench will use are backed before it measures. Restores the setting when dropped. A
/// machine without free page reporting, or without root, gets a message and nothing else.
pub struct SteadyMemory(Option<String>);

impl SteadyMemory {
    pub fn hold() -> Self {
        let Ok(was) = std::fs::read_to_string(PAGE_REPORTING_ORDER) else {
            println!("(no free page reporting here: freed memory stays in this machine)");
            return SteadyMemory(None);
        };
        if std::fs::write(PAGE_REPORTING_ORDER, "11").is_err() {
            println!(
                "(cannot stop free page reporting, not root: CPU figures will move with what earlier parts freed)"
            );
            return SteadyMemory(None);
        }
        let mib = env_u64("LOCUS_BENCH_PRETOUCH_MIB", 6144) as usize;
        let t = Instant::now();
        let mut v: Vec<u8> = Vec::with_capacity(mib << 20);
        // Written, not only allocated: the host backs a page when it is touched.
        v.resize(mib << 20, 1);
        std::hint::black_box(&v);
        drop(v);
        println!(
            "(free page reporting stopped for the bench; {mib} MiB touched once in {:.1} s)",
            t.elapsed().as_secs_f64()
        );
        SteadyMemory(Some(was.trim().to_string()))
    }
}

impl Drop for SteadyMemory {
    fn drop(&mut self) {
        if let Some(was) = &self.0 {
            let _ = std::fs::write(PAGE_REPORTING_ORDER, was);
        }
    }
}

/// The machine's CPU time so far, from the first line of /proc/stat: (idle and iowait,
/// all), in ticks. Two readings give the share of a part the cores sat idle, which says
/// whether a part was bound by CPU or by waiting.
pub fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let all = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (idle, all)
}

/// The share of the time between two `machine_ticks` readings the cores were idle.
pub fn idle_share(before: (u64, u64), after: (u64, u64)) -> f64 {
    let all = after.1.saturating_sub(before.1);
    if all == 0 {
        return 0.0;
    }
    after.0.saturating_sub(before.0) as f64 / all as f64
}

/// A bench setting from the environment, or its default.
pub fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

/// Writes `count` files of `each` deterministic pseudo-random bytes into `dir` (created),
/// named `{prefix}{i:03}.bin`, seeded `seed + i`.
pub fn write_random_files(dir: &Path, prefix: &str, count: usize, each: usize, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    for i in 0..count {
        std::fs::write(
            dir.join(format!("{prefix}{i:03}.bin")),
            pseudo_random(seed + i as u64, each),
        )
        .unwrap();
    }
}

/// User plus system CPU seconds a process has used so far (0 if it is gone): what a
/// data path costs is judged by this, summed over every process on the path.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|hz| *hz > 0)
        .unwrap_or(100);
    ticks as f64 / hz as f64
}

/// User plus system CPU seconds of this process's children that have ended and been
/// waited for: what a CLI command run to its end cost (take the difference around it).
pub fn children_cpu_seconds() -> f64 {
    use nix::sys::time::TimeValLike;
    match nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN) {
        Ok(ru) => (ru.user_time().num_microseconds() + ru.system_time().num_microseconds()) as f64 / 1e6,
        Err(_) => 0.0,
    }
}

/// One kept-alive HTTP/1.1 connection for benches that time many requests on it (as a
/// scheduler keeps its connection to the metadata service).
pub struct KeptAlive {
    r: tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

impl KeptAlive {
    pub async fn connect(addr: std::net::SocketAddr) -> KeptAlive {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (r, w) = stream.into_split();
        KeptAlive {
            r: tokio::io::BufReader::new(r),
            w,
        }
    }

    /// The bytes of a JSON POST to `path`, built once and sent many times.
    pub fn post(path: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// Sends `req` and reads the whole answer: how long that took, and the body's size.
    pub async fn ask(&mut self, req: &str) -> (Duration, usize) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let t = Instant::now();
        self.w.write_all(req.as_bytes()).await.unwrap();
        let mut len = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            self.r.read_line(&mut line).await.unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut buf = vec![0u8; len];
        self.r.read_exact(&mut buf).await.unwrap();
        (t.elapsed(), len)
    }
}

/// MiB/s.
pub fn mbs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1 << 20) as f64
}

/// Reads `files` one after another in 1 MiB reads, as one sequential reader: (bytes, time).
pub fn read_sequentially(files: &[PathBuf]) -> (u64, Duration) {
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    let mut total = 0u64;
    for p in files {
        let mut f = std::fs::File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        loop {
            let n = f
                .read(&mut buf)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    (total, t.elapsed())
}

/// Every regular file under `dir`, sorted.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

const SINK: &str = "__locus-tcp-sink";
const SEND: &str = "__locus-tcp-send";

/// Call first in a bench's `main`: when the bench binary was re-run as a TCP helper
/// inside a host (by [`tcp_rate`]), does that job and exits.
pub fn serve_helper_role() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some(SINK) => {
            let l = TcpListener::bind(&args[2]).expect("bind the sink");
            println!("{}", l.local_addr().unwrap());
            std::io::stdout().flush().unwrap();
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = vec![0u8; 4 << 20];
            let mut n = 0u64;
            let mut first: Option<Instant> = None;
            loop {
                let k = s.read(&mut buf).expect("receive");
                if k == 0 {
                    break;
                }
                first.get_or_insert_with(Instant::now);
                n += k as u64;
            }
            let secs = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
            println!("{n} {secs}");
            std::process::exit(0);
        }
        Some(SEND) => {
            let to: SocketAddr = args[2].parse().unwrap();
            let bytes: u64 = args[3].parse().unwrap();
            let mut s = TcpStream::connect(to).expect("connect to the sink");
            let buf = vec![0x5au8; 4 << 20];
            let mut left = bytes;
            while left > 0 {
                let k = left.min(buf.len() as u64) as usize;
                s.write_all(&buf[..k]).expect("send");
                left -= k as u64;
            }
            std::process::exit(0);
        }
        _ => {}
    }
}

/// The start of a bench on the test bed: serves a helper role if this run is one, answers
/// `--list`, and says why not when the machine cannot build a bed. True: go on.
pub fn bed_bench_starts(name: &str) -> bool {
    serve_helper_role();
    if std::env::args().any(|a| a == "--list") {
        println!("{name}: bench");
        return false;
    }
    if let Some(why) = Netbed::unavailable() {
        eprintln!("{name} needs the multi-host test bed: {why}");
        return false;
    }
    true
}

/// One TCP stream of `bytes` from host `from` to host `to`, both ends this binary (see
/// [`serve_helper_role`]): MiB/s as the receiver saw it.
pub fn tcp_rate(from: &Host, to: &Host, bytes: u64) -> f64 {
    let me = std::env::current_exe().unwrap();
    let mut sink = to
        .command(&me)
        .args([SINK, &format!("{}:0", to.addr)])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the sink");
    let mut out = std::io::BufReader::new(sink.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let st = from
        .command(&me)
        .args([SEND, line.trim(), &bytes.to_string()])
        .status()
        .expect("run the sender");
    assert!(st.success(), "the TCP sender failed");
    let mut result = String::new();
    out.read_to_string(&mut result).unwrap();
    sink.wait().unwrap();
    let mut it = result.split_whitespace();
    let n: u64 = it.next().unwrap().parse().unwrap();
    let secs: f64 = it.next().unwrap().parse().unwrap();
    n as f64 / secs / (1 << 20) as f64
}

/// With `LOCUS_BENCH_PERF=DIR`: starts `perf record -a -g` into `DIR/<name>.data` (what
/// every process spent its CPU on) until [`stop_profile`]; None otherwise. With
/// `LOCUS_BENCH_PERF_DWARF=1` the call stacks are unwound from DWARF, which a release
/// build without frame pointers needs for its own callers (the files grow large).
pub fn profile(name: &str) -> Option<std::process::Child> {
    let dir = std::env::var("LOCUS_BENCH_PERF").ok()?;
    let stacks = match std::env::var_os("LOCUS_BENCH_PERF_DWARF") {
        Some(_) => "--call-graph=dwarf,16384",
        None => "--call-graph=fp",
    };
    let c = std::process::Command::new("perf")
        .args(["record", "-a", stacks, "-F", "499", "-o"])
        .arg(format!("{dir}/{name}.data"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    Some(c)
}

pub fn stop_profile(c: Option<std::process::Child>) {
    if let Some(mut c) = c {
        crate::signal(&c, nix::sys::signal::Signal::SIGINT);
        let _ = c.wait();
    }
}

/// CPU seconds spent copying `files` over one loopback TCP connection the way a lean data
/// plane would: `sendfile` from each file on one thread, `recv` of 4 MiB at a time
/// (`MSG_WAITALL`) into one reused buffer on another. The bound for moving blob bytes
/// between processes; drop the page cache first for a cold source (`cold_tcp_copy_cpu`).
/// Returns (bytes, CPU of both ends, CPU of the receiving thread alone).
///
/// Each end is the CPU of its own thread (/proc/thread-self), not this process's less
/// the receiver's: the process also runs the harness (its runtime, the pipes of the
/// daemons it started), and charging that to the sender made the reference's sender
/// cost 1.6–2× a node's `sendfile` of the same bytes, so a peer copy came out below the
/// bound (0.72× in one round). The sender advises sequential reads, as a node does. Of
/// the receiving patterns tried (1 MiB, 4 MiB and 64 KiB reads, 4 MiB sendfiles), 4 MiB
/// `MSG_WAITALL` receives cost both ends least and moved least between runs.
pub fn tcp_copy_cpu(files: &[PathBuf]) -> (u64, f64, f64) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sink = std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let (s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 4 << 20];
        let mut got = 0u64;
        let mine = thread_cpu_seconds();
        loop {
            // A whole 4 MiB per call: the receiver (and, on loopback, the sender that
            // delivers into its socket) wakes once per buffer, not once per segment.
            use nix::sys::socket::{recv, MsgFlags};
            match recv(s.as_raw_fd(), &mut buf, MsgFlags::MSG_WAITALL) {
                Ok(0) => return (got, thread_cpu_seconds() - mine),
                Ok(n) => got += n as u64,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => panic!("tcp copy receiver: {e}"),
            }
        }
    });
    let files = files.to_vec();
    let source = std::thread::spawn(move || {
        let mine = thread_cpu_seconds();
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        for p in &files {
            let f = std::fs::File::open(p).unwrap();
            let len = f.metadata().unwrap().len();
            // As a node's sender advises its blob files: read ahead in larger steps.
            let _ =
                nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL);
            let mut off: i64 = 0;
            while (off as u64) < len {
                let left = (len - off as u64) as usize;
                let n = nix::sys::sendfile::sendfile64(&s, &f, Some(&mut off), left)
                    .unwrap_or_else(|e| panic!("sendfile: {e}"));
                assert!(n > 0, "sendfile sent nothing before the end of {}", p.display());
            }
        }
        drop(s);
        thread_cpu_seconds() - mine
    });
    let sender = source.join().unwrap();
    let (got, receiver) = sink.join().unwrap();
    (got, sender + receiver, receiver)
}

/// `tcp_copy_cpu` from a cold page cache, `tries` times, the page cache dropped before
/// each: the try that cost both ends least. A bound is what the kernel charges at the
/// least; on these machines one cold copy of the same 1 GiB cost both ends 0.25–0.59
/// ms/MiB from one try to the next (the receiving pattern and the disk underneath
/// unchanged), so a single try let a peer copy come out below its bound.
pub fn cold_tcp_copy_cpu(files: &[PathBuf], tries: usize) -> (u64, f64, f64) {
    (0..tries.max(1))
        .map(|_| {
            drop_caches();
            tcp_copy_cpu(files)
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("at least one try")
}

/// CPU seconds of one pass computing each file's BLAKE3 root and its outboard together
/// (`locus_proto::outboard`), one thread, files read into memory first; and the outboard
/// bytes per MiB.
pub fn outboard_cpu(files: &[PathBuf]) -> (f64, f64) {
    let (mut cpu, mut ob, mut total) = (0.0, 0usize, 0usize);
    for p in files {
        let data = std::fs::read(p).unwrap();
        let before = cpu_seconds(std::process::id());
        // As a node's store builds it: pushed in the pieces a transfer delivers.
        let mut b = locus_proto::outboard::Builder::new(data.len() as u64, Vec::new());
        for piece in data.chunks(512 << 10) {
            b.update(piece);
        }
        let (root, o) = b.finish().unwrap();
        cpu += cpu_seconds(std::process::id()) - before;
        assert_eq!(root.0, *blake3::hash(&data).as_bytes());
        ob += o.len();
        total += data.len();
    }
    (cpu, ob as f64 / (total as f64 / (1 << 20) as f64))
}

/// CPU seconds the calling thread has used.
fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    ticks as f64 / 100.0
}

/// CPU seconds of one BLAKE3 pass, one thread, over `files` (each read into memory
/// first, outside the measured part).
pub fn blake3_cpu(files: &[PathBuf]) -> f64 {
    let mut cpu = 0.0;
    for p in files {
        let data = std::fs::read(p).unwrap();
        let before = cpu_seconds(std::process::id());
        let mut h = blake3::Hasher::new();
        h.update(&data);
        std::hint::black_box(h.finalize());
        cpu += cpu_seconds(std::process::id()) - before;
    }
    cpu
}
