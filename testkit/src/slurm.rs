//! A real Slurm for tests: its own munged, slurmctld in the root namespace (on the bed's
//! gateway address) and one slurmd per test-bed host, each in that host's namespace with
//! its own host name (Debian's Slurm has no multiple-slurmd). Own ports, state and
//! config directory, so a system Slurm is never touched; `SLURM_CONF` points the client
//! tools at it. Locus' `deploy/slurm` Lua files are installed beside its slurm.conf.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::*;

pub struct Slurm {
    pub dir: PathBuf,
    pub conf: PathBuf,
    /// Slurm node names, one per bed host.
    pub nodes: Vec<String>,
    children: Vec<Child>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Why a real Slurm cannot be run here, if it cannot.
pub fn slurm_unavailable() -> Option<String> {
    for tool in [
        "slurmctld",
        "slurmd",
        "munged",
        "mungekey",
        "sbatch",
        "scontrol",
        "sinfo",
    ] {
        let found = ["/usr/sbin", "/usr/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(tool).exists());
        if !found {
            return Some(format!(
                "{tool} is not installed (scripts/setup-debian.sh installs slurm-wlm and munge)"
            ));
        }
    }
    Netbed::unavailable()
}

impl Slurm {
    /// Starts Slurm with node `names[k]` on bed host `k`; `env` goes to slurmctld (the
    /// burst-buffer hook runs `locus` from it). Waits until every node is idle.
    pub fn start(h: &Harness, bed: &Netbed, names: &[&str], env: &[(String, String)]) -> Slurm {
        if let Some(why) = slurm_unavailable() {
            panic!("this test needs a real Slurm: {why}");
        }
        let dir = h.path("slurm");
        std::fs::create_dir_all(dir.join("state")).unwrap();
        let key = dir.join("munge.key");
        let st = Command::new("mungekey")
            .arg("-c")
            .arg("-k")
            .arg(&key)
            .status()
            .unwrap();
        assert!(st.success(), "mungekey");
        let sock = dir.join("munge.sock");
        let mut s = Slurm {
            conf: dir.join("slurm.conf"),
            dir: dir.clone(),
            nodes: names.iter().map(|n| n.to_string()).collect(),
            children: Vec::new(),
        };
        let log = |name: &str| std::fs::File::create(dir.join(format!("{name}.out"))).unwrap();
        s.children.push(
            Command::new("munged")
                .arg("-F")
                .arg("-f")
                .arg(format!("--socket={}", sock.display()))
                .arg(format!("--key-file={}", key.display()))
                .arg(format!("--pid-file={}", dir.join("munged.pid").display()))
                .arg(format!("--log-file={}", dir.join("munged.log").display()))
                .arg(format!("--seed-file={}", dir.join("munged.seed").display()))
                .stdout(log("munged"))
                .stderr(log("munged.err"))
                .spawn()
                .expect("start munged"),
        );
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "munged did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
            .to_string();
        // slurmctld listens on the bed's gateway address, slurmd in each host's namespace.
        let gw_ip = bed.gateway();
        let ctld_port = free_low_port_on(gw_ip, &[]);
        let d_port = free_low_port_on(std::net::Ipv4Addr::LOCALHOST, &[ctld_port]);
        let d = dir.display();
        let mut conf = format!(
            "ClusterName=locustest\nSlurmctldHost={host}({gw})\nSlurmctldPort={ctld_port}\n\
             SlurmdPort={d_port}\nAuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n\
             SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool-%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n\
             ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nSelectType=select/cons_tres\n\
             ReturnToService=2\nSchedulerType=sched/backfill\nMpiDefault=none\n\
             JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
             JobAcctGatherType=jobacct_gather/none\nCliFilterPlugins=cli_filter/lua\n\
             BurstBufferType=burst_buffer/lua\n",
            gw = bed.gateway(),
            sock = sock.display(),
        );
        for (k, n) in names.iter().enumerate() {
            conf.push_str(&format!(
                "NodeName={n} NodeAddr={} CPUs=1 RealMemory=200 State=UNKNOWN\n",
                bed.hosts[k].addr
            ));
        }
        conf.push_str("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n");
        std::fs::write(&s.conf, conf).unwrap();
        std::fs::write(
            dir.join("cgroup.conf"),
            "CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n",
        )
        .unwrap();
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/slurm");
        for f in ["cli_filter.lua", "burst_buffer.lua"] {
            std::fs::copy(deploy.join(f), dir.join(f)).unwrap();
        }
        let mut ctld = Command::new("slurmctld");
        ctld.arg("-D")
            .arg("-f")
            .arg(&s.conf)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("SLURM_CONF", &s.conf)
            .stdout(log("slurmctld"))
            .stderr(log("slurmctld.err"));
        s.children.push(ctld.spawn().expect("start slurmctld"));
        for (k, n) in names.iter().enumerate() {
            let mut d = bed.hosts[k].command("unshare");
            d.arg("--uts")
                .arg("sh")
                .arg("-c")
                .arg(format!(
                    "hostname {n} && exec slurmd -D -N {n} -f {}",
                    s.conf.display()
                ))
                .stdout(log(&format!("slurmd-{n}")))
                .stderr(log(&format!("slurmd-{n}.err")));
            s.children.push(d.spawn().expect("start slurmd"));
        }
        let t0 = Instant::now();
        loop {
            let out = s
                .command("sinfo")
                .args(["-h", "-N", "-o", "%N %t"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let idle = text.lines().filter(|l| l.ends_with(" idle")).count();
            if idle == names.len() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "Slurm nodes not idle after 60 s: {text}; see {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        s
    }

    /// A Slurm client command (sbatch, scontrol, …) aimed at this Slurm.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// The same, run as user nobody (Slurm refuses burst buffers to root).
    pub fn command_as_nobody(&self, program: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "env"])
            .arg(format!("SLURM_CONF={}", self.conf.display()))
            .arg(program)
            .current_dir("/tmp");
        c
    }

    /// `key=value` of `scontrol show OBJECT ID --oneliner` (None when absent).
    pub fn show(&self, object: &str, id: &str, key: &str) -> Option<String> {
        let out = self
            .command("scontrol")
            .args(["show", object, id, "--oneliner"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let prefix = format!("{key}=");
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(prefix.as_str()))
            .map(str::to_string)
    }
}
