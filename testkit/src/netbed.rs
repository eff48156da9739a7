//! Several hosts on one machine: each host a Linux network namespace with its own address
//! on a bridge per rack, racks joined by an uplink, links shaped with `tc` token buckets.
//!
//! Layout of bed `N` (a number 0–199 claimed for the bed's life, so parallel test
//! processes never share one): subnet `10.251.N.0/24`; rack `r`'s bridge `lbN-r`; host
//! `k` is namespace `lbN-hk` with address `10.251.N.(10+k)` on `eth0`, whose peer `lbN-hk`
//! in the root namespace is a port of its rack's bridge; rack `r > 0` reaches rack 0
//! through the veth pair `lbN-ur` / `lbN-vr`. The root namespace has `10.251.N.1` on rack
//! 0's bridge: a process started normally (the metadata service, the CLI) is "in rack 0's
//! switch room", reachable from every host. One L2 segment, so no routing is involved.
//!
//! Shaping is egress-only in Linux, so a host link or uplink is shaped at both ends. `tbf`
//! works on these machines; `netem` does not (no delay injection).
//!
//! Processes enter a host with `nsenter --net`, which changes only the network stack: a
//! FUSE mount made "on" a host is visible to every process, and paths are shared.
//!
//! Declare the bed before the cluster in a test, so the cluster's processes stop before
//! the bed's namespaces go (locals drop in reverse order).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::*;

/// One host of the bed.
#[derive(Clone, Debug)]
pub struct Host {
    /// `h0`, `h1`, …
    pub name: String,
    pub rack: usize,
    pub addr: Ipv4Addr,
    /// The namespace's name under /var/run/netns.
    pub netns: String,
    /// The root-namespace end of its link.
    veth: String,
}

impl Host {
    /// `nsenter --net=… program`: `program` run on this host.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/var/run/netns/{}", self.netns)).arg(program);
        c
    }
}

pub struct Netbed {
    id: u8,
    racks: usize,
    pub hosts: Vec<Host>,
    claim: PathBuf,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if !out.status.success() {
        return Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

const CLAIMS: &str = "/run/locus-netbed";

/// Claims a bed number no live process holds; removes what a dead holder left behind.
fn claim() -> Result<(u8, PathBuf), String> {
    std::fs::create_dir_all(CLAIMS).map_err(|e| format!("{CLAIMS}: {e}"))?;
    for id in 0..200u8 {
        let p = Path::new(CLAIMS).join(id.to_string());
        let holder = std::fs::read_to_string(&p)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let Some(pid) = holder {
            // SAFETY-free liveness check: /proc/PID exists while the process does.
            if Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            sweep(id);
            let _ = std::fs::remove_file(&p);
        }
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&p) {
            Ok(mut f) => {
                use std::io::Write;
                let _ = write!(f, "{}", std::process::id());
                sweep(id);
                return Ok((id, p));
            }
            Err(_) => continue,
        }
    }
    Err("every test-bed number 0–199 is held by a live process".into())
}

/// Removes every namespace and link of bed `id` (left by a crashed run).
fn sweep(id: u8) {
    let prefix = format!("lb{id}-");
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            let name = l.split_whitespace().next().unwrap_or_default();
            if name.starts_with(&prefix) {
                let _ = run(&["ip", "netns", "del", name]);
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(name) = l.split(": ").nth(1) else {
                continue;
            };
            let name = name.split('@').next().unwrap_or_default();
            if name.starts_with(&prefix) {
                let _ = run(&["ip", "link", "del", name]);
            }
        }
    }
}

impl Netbed {
    /// Whether this machine can build a bed (root, iproute2, nsenter); the reason if not.
    pub fn unavailable() -> Option<String> {
        let root = nix::unistd::geteuid().is_root();
        if !root {
            return Some("network namespaces need root".into());
        }
        for tool in ["ip", "nsenter", "tc"] {
            let found = Command::new(tool)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok();
            if !found {
                return Some(format!("{tool} is not installed"));
            }
        }
        None
    }

    /// A bed of `per_rack[r]` hosts in rack `r`; hosts are numbered across racks in order.
    pub fn new(per_rack: &[usize]) -> Result<Netbed, String> {
        if let Some(why) = Self::unavailable() {
            return Err(why);
        }
        let (id, claim) = claim()?;
        let mut bed = Netbed {
            id,
            racks: per_rack.len(),
            hosts: Vec::new(),
            claim,
        };
        bed.build(per_rack)?;
        Ok(bed)
    }

    fn bridge(&self, rack: usize) -> String {
        format!("lb{}-r{rack}", self.id)
    }

    /// The root namespace's address: where the metadata service and the CLI live.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 251, self.id, 1)
    }

    fn build(&mut self, per_rack: &[usize]) -> Result<(), String> {
        let id = self.id;
        for r in 0..self.racks {
            let br = self.bridge(r);
            run(&["ip", "link", "add", &br, "type", "bridge"])?;
            run(&["ip", "link", "set", &br, "up"])?;
            if r > 0 {
                let (u, v) = (format!("lb{id}-u{r}"), format!("lb{id}-v{r}"));
                run(&["ip", "link", "add", &u, "type", "veth", "peer", "name", &v])?;
                run(&["ip", "link", "set", &u, "master", &br, "up"])?;
                run(&["ip", "link", "set", &v, "master", &self.bridge(0), "up"])?;
            }
        }
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", self.gateway()),
            "dev",
            &self.bridge(0),
        ])?;
        let mut k = 0;
        for (rack, n) in per_rack.iter().enumerate() {
            for _ in 0..*n {
                let name = format!("h{k}");
                let netns = format!("lb{id}-{name}");
                let veth = format!("lb{id}-{name}");
                let addr = Ipv4Addr::new(10, 251, id, 10 + k as u8);
                run(&["ip", "netns", "add", &netns])?;
                run(&[
                    "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
                ])?;
                run(&["ip", "link", "set", &veth, "master", &self.bridge(rack), "up"])?;
                run(&[
                    "ip",
                    "-n",
                    &netns,
                    "addr",
                    "add",
                    &format!("{addr}/24"),
                    "dev",
                    "eth0",
                ])?;
                run(&["ip", "-n", &netns, "link", "set", "eth0", "up"])?;
                run(&["ip", "-n", &netns, "link", "set", "lo", "up"])?;
                self.hosts.push(Host {
                    name,
                    rack,
                    addr,
                    netns,
                    veth,
                });
                k += 1;
            }
        }
        Ok(())
    }

    /// Shapes host `k`'s link to `mbit` Mbit/s in each direction (0 removes the shaping).
    pub fn shape_host(&self, k: usize, mbit: u64) -> Result<(), String> {
        let h = &self.hosts[k];
        shape(None, &h.veth, mbit)?;
        shape(Some(&h.netns), "eth0", mbit)
    }

    /// Shapes the uplink between rack `r` (> 0) and rack 0 to `mbit` Mbit/s each way.
    pub fn shape_uplink(&self, r: usize, mbit: u64) -> Result<(), String> {
        assert!(
            r > 0 && r < self.racks,
            "rack 0 is the spine; uplinks join racks 1.. to it"
        );
        shape(None, &format!("lb{}-u{r}", self.id), mbit)?;
        shape(None, &format!("lb{}-v{r}", self.id), mbit)
    }

    /// Takes host `k`'s link down (a cable pulled: its processes live on, unreachable) or
    /// back up.
    pub fn set_link(&self, k: usize, up: bool) -> Result<(), String> {
        run(&[
            "ip",
            "link",
            "set",
            &self.hosts[k].veth,
            if up { "up" } else { "down" },
        ])
    }

    /// Bytes host `k` has sent and received over its link, counted at the link's
    /// root-namespace end (what it receives is what the host sent). Sysfs shows the
    /// namespace it was mounted in, so the count is read there and not inside the host.
    pub fn link_bytes(&self, k: usize) -> (u64, u64) {
        let read = |what: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{what}", self.hosts[k].veth))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        (read("rx_bytes"), read("tx_bytes"))
    }
}

impl Harness {
    /// A metadata service on the bed's gateway (reachable from every host).
    pub async fn start_metadata_on(&self, bed: &Netbed, opts: MetadataOpts) -> Metadata {
        self.start_metadata(
            "meta",
            MetadataOpts {
                ip: Some(bed.gateway()),
                ..opts
            },
        )
        .await
    }
}

impl Harness {
    /// A replicated metadata group with member `mI` on bed host `I-1` (its own namespace
    /// and address), so taking a host's link down partitions that member from the others
    /// and from this test. Every member's `url()` is the group's list, as in `start_group`.
    pub async fn start_group_on(&self, bed: &Netbed, name: &str, opts: MetadataOpts) -> Vec<Metadata> {
        super::metadata::launch_group(self.prepare_group_on(bed, name, opts)).await
    }

    /// `start_group_on`'s members, ports chosen and files written, not started. With TLS
    /// they share one cluster CA, each with a certificate for its own host address.
    pub fn prepare_group_on(&self, bed: &Netbed, name: &str, opts: MetadataOpts) -> Vec<Metadata> {
        let mut opts = opts;
        if !opts.tokens.is_empty() && !opts.tokens.iter().any(|t| t.role == "member") {
            opts.tokens.push(super::metadata::member_token());
        }
        // Each host is a namespace of its own: the same port numbers are free on all.
        let (grpc, http, raft) = (7400u16, 7401u16, 7410u16);
        let cluster: Vec<String> = bed
            .hosts
            .iter()
            .enumerate()
            .map(|(i, h)| format!("m{}={}:{raft}", i + 1, h.addr))
            .collect();
        let mut members: Vec<Metadata> = Vec::new();
        for (i, host) in bed.hosts.iter().enumerate() {
            let o = super::metadata::as_member(&opts, i, &cluster);
            // Ports are not chosen here (the host's address is in its namespace only):
            // every host has the same free ones.
            let mut m = self.prepare_metadata(&format!("{name}-m{}", i + 1), o, &[]);
            m.opts.ip = Some(host.addr);
            m.grpc = std::net::SocketAddr::from((host.addr, grpc));
            m.http = std::net::SocketAddr::from((host.addr, http));
            m.daemon.netns = Some(host.netns.clone());
            if m.opts.tls {
                // One CA (the first member's), a certificate for each member's address.
                let ca = members
                    .first()
                    .map_or(m.dir.clone(), |f: &Metadata| f.dir.clone());
                if ca != m.dir {
                    for f in ["ca.pem", "ca.key", "admin.pem", "admin.key"] {
                        std::fs::copy(ca.join(f), m.dir.join(f)).unwrap();
                    }
                    m.ca_pem = members[0].ca_pem.clone();
                }
                for f in ["server.pem", "server.key"] {
                    let _ = std::fs::remove_file(m.dir.join(f));
                }
                let issuer = members.first().unwrap_or(&m);
                issuer.issue_cert("server", &format!("localhost,127.0.0.1,{}", host.addr), &m.dir);
            }
            members.push(m);
        }
        // (This test process's clients trust the first member's CA, the shared one: its
        // prepare set the process's client TLS, and the first setting wins.)
        members
    }
}

impl Netbed {
    /// Bytes that crossed rack `r`'s uplink, both directions together.
    pub fn uplink_bytes(&self, r: usize) -> u64 {
        let read = |what: &str| {
            std::fs::read_to_string(format!("/sys/class/net/lb{}-v{r}/statistics/{what}", self.id))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        read("rx_bytes") + read("tx_bytes")
    }
}

/// tbf on `dev` (in `netns`, or the root namespace). The bucket holds 1 ms of traffic at
/// least, so a fast link is not held below its rate by its own burst size.
fn shape(netns: Option<&str>, dev: &str, mbit: u64) -> Result<(), String> {
    let mut base: Vec<String> = vec!["tc".into()];
    if let Some(ns) = netns {
        base.extend(["-n".into(), ns.into()]);
    }
    let del: Vec<String> = base
        .iter()
        .cloned()
        .chain(["qdisc", "del", "dev", dev, "root"].map(String::from))
        .collect();
    let _ = run(&del.iter().map(String::as_str).collect::<Vec<_>>());
    if mbit == 0 {
        return Ok(());
    }
    let burst_kb = (mbit * 1000 / 8 / 1000).max(256);
    let add: Vec<String> = base
        .into_iter()
        .chain(
            [
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                &format!("{mbit}mbit"),
                "burst",
                &format!("{burst_kb}kb"),
                "latency",
                "50ms",
            ]
            .map(String::from),
        )
        .collect();
    run(&add.iter().map(String::as_str).collect::<Vec<_>>())
}

impl Drop for Netbed {
    fn drop(&mut self) {
        sweep(self.id);
        let _ = std::fs::remove_file(&self.claim);
    }
}
