//! `locus`: one binary for every role of a Locus cluster — the metadata service, the
//! operator's commands, and a self-contained demo.
//!
//! Errors are reported here and only here: a command returns `anyhow::Error`, `main`
//! prints it as one plain sentence (never a debug dump) and picks the exit status.

mod cmd;
mod config;
#[cfg(test)]
mod help_tests;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Locus keeps training datasets on GPU nodes' local NVMe, mounts them read-only, and
/// tells schedulers where each dataset's bytes already are.
#[derive(Parser, Debug)]
#[command(name = "locus", version, propagate_version = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    global: config::GlobalArgs,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run or manage the metadata service.
    #[command(subcommand)]
    Metadata(cmd::metadata::MetadataCmd),
    /// Run, list and drain cache nodes.
    #[command(subcommand)]
    Node(cmd::node::NodeCmd),
    /// List, inspect and delete datasets and their versions.
    #[command(subcommand)]
    Dataset(cmd::dataset::DatasetCmd),
    /// Rank nodes by how much of a dataset version they hold and what the rest would cost
    /// to bring there (where a job should run).
    #[command(after_help = "\
Examples:
  # Where should a job reading imagenet@3 run?
  locus locality imagenet@3
  # Only among the nodes of one zone, as JSON for a scheduler
  locus locality imagenet@latest --where zone=us-east-1a --json
  # Two datasets one job reads together
  locus locality imagenet@3 captions@1
  # The best 8 nodes of a large cluster
  locus locality imagenet@3 --limit 8")]
    Locality(cmd::locality::LocalityArgs),
    /// Split a dataset version's shards among a job's ranks: each shard once, balanced,
    /// read locally where possible (JSON for data-loader samplers).
    #[command(after_help = "\
Examples:
  # Split imagenet@3's shards among 2 nodes x 4 ranks, local reads first
  locus assign imagenet@3 --nodes gpu-01,gpu-02 --ranks-per-node 4 --json
  # With each shard's files, for a sampler that opens files
  locus assign imagenet@3 --nodes gpu-01,gpu-02 --with-files --json")]
    Assign(cmd::locality::AssignArgs),
    /// Copy a dataset version onto chosen nodes before a job starts (peer to peer,
    /// idempotent: a rerun resumes).
    #[command(after_help = "\
Examples:
  # Copy imagenet@3 onto the nodes a job will run on
  locus warm imagenet@3 --nodes gpu-01,gpu-02
  # Allow at most 10 GiB from the origin for what no node holds
  locus warm imagenet@3 --nodes gpu-03 --max-origin-bytes 10GiB")]
    Warm(cmd::locality::WarmArgs),
    /// Slurm helpers: node features from locality, best-node hostlists.
    #[command(subcommand)]
    Slurm(cmd::slurm::SlurmCmd),
    /// Back the cluster up to object storage; list, verify and prune backups.
    #[command(subcommand)]
    Backup(cmd::backup::BackupCmd),
    /// Bring a cluster back from a backup snapshot: the whole metadata service (into an
    /// empty data dir), or one dataset version into the running cluster.
    #[command(after_help = "\
Examples:
  # The whole catalogue, into an empty data dir, from the newest snapshot
  locus restore --from s3://backups/locus --data-dir /var/lib/locus/metadata --trust-key /etc/locus/backup.key.pub
  # One version back into the running cluster, under another name
  locus restore --from file:///mnt/backup --dataset imagenet@3 --as imagenet-restored")]
    Restore(cmd::backup::RestoreArgs),
    /// Mount a dataset version as a read-only file tree (returns once it is readable).
    ///
    /// A mount is two processes: its holder keeps the FUSE connection and restarts the
    /// server that answers the kernel if it dies (a crash, an OOM kill, kill -9); readers
    /// pause for a moment and see no error. `locus status` shows both pids. Signals to the
    /// holder: TERM unmounts; HUP restarts the server from the executable now at the same
    /// path, to upgrade under live readers.
    #[command(after_help = "\
Examples:
  # Mount a version read-only, reading through this host's node
  locus mount imagenet@3 /mnt/imagenet --node-socket /run/locus/node.sock
  # On a host without a node (bytes come from peers), for every user
  locus mount imagenet@latest /mnt/imagenet --allow-other
  # Unmount
  locus umount /mnt/imagenet")]
    Mount(Box<cmd::mount::MountArgs>),
    /// Unmount a Locus mount.
    #[command(after_help = "\
Examples:
  # Unmount; waits for the mount's process to finish
  locus umount /mnt/imagenet")]
    Umount(cmd::mount::UmountArgs),
    /// One-screen summary of the cluster: service, nodes, capacity, datasets.
    #[command(after_help = "\
Examples:
  # The cluster at a glance
  locus status
  # The same as JSON, against another service
  locus --metadata https://meta.example:7400 status --json")]
    Status,
    /// Kubernetes CSI driver: dataset versions as read-only pod volumes (one shared mount
    /// per version on each host), provisioned from claims of a Locus StorageClass.
    #[command(after_help = "\
Examples:
  # The node plugin, as the DaemonSet in deploy/kubernetes/csi.yaml runs it
  locus csi --endpoint unix:///csi/csi.sock --node-socket /run/locus/node.sock
  # The controller, beside the csi-provisioner sidecar (a reader token in LOCUS_TOKEN)
  locus csi --mode controller --endpoint unix:///csi/csi.sock")]
    Csi(cmd::csi::CsiArgs),
    /// Kubernetes mutating admission webhook: pods using Locus data get preferred node
    /// affinity to the hosts holding their bytes; a pod is never refused or held up.
    #[command(after_help = "\
Examples:
  # As deploy/kubernetes/webhook.yaml runs it (a reader token in LOCUS_TOKEN)
  locus webhook --listen 0.0.0.0:8443 --tls-cert /tls/tls.crt --tls-key /tls/tls.key \\
      --metadata https://locus-metadata:7400")]
    Webhook(cmd::webhook::WebhookArgs),
    /// Check this host (FUSE, passthrough, the node's socket and disks, limits,
    /// certificates) and the cluster (reachable, clock, nodes, last backup); say what to
    /// fix. Exits non-zero when a check fails.
    #[command(after_help = "\
Examples:
  # Check this host and the cluster
  locus doctor --node-socket /run/locus/node.sock
  # Only this host, and a node's data dir
  locus doctor --local --data-dir /nvme/locus")]
    Doctor(cmd::doctor::DoctorArgs),
    /// Make the cluster CA and the certificates daemons serve with (TLS on every hop).
    #[command(subcommand)]
    Tls(cmd::tls::TlsCmd),
    /// Start a throwaway local cluster, commit a sample dataset through the real API and
    /// list it.
    #[command(after_help = "\
Examples:
  # A throwaway cluster in a temporary dir: import, list, back up, then stop
  locus demo
  # Keep it running in ./demo to try other commands against it
  locus demo --dir ./demo --keep-running")]
    Demo(cmd::demo::DemoArgs),
}

/// Keeps large buffers (blob pieces of 2–8 MiB, gRPC receive buffers) on the heap and
/// freed memory in the process, instead of glibc's default of mapping each large
/// allocation afresh and unmapping it on free: on the data path that default costs a page
/// fault and a zeroed page per 4 KiB of every buffer, which the remote-read profile
/// showed as the mount's largest single cost (bench/RESULTS.md). Memory is still bounded
/// by what the code holds; only its return to the kernel is lazier (above 256 MiB free).
#[allow(unsafe_code)]
fn keep_large_buffers() {
    // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// A reader that stops reading (`| head`, quitting `less`, `grep -m1`) is a normal end of
/// a command's output, as for any Unix tool: the print that finds stdout closed ends the
/// process quietly with status 0, instead of a panic message and status 101. Every
/// print of every command goes through `print!`/`println!`, which panic on a closed pipe
/// (Rust ignores SIGPIPE, so the write fails with EPIPE): this hook is the one place
/// that turns that end into an exit.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info)
    }));
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    keep_large_buffers();
    locus_proto::tls::install_provider();
    let cli = Cli::parse();
    let cfg = match config::Resolved::load(&cli.global) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = locus_proto::net::peer_idle_setting() {
        eprintln!("error: {}: {}", e.field, e.reason);
        return ExitCode::from(2);
    }
    // The serving daemons set their client TLS themselves (they present their own
    // certificate); every other command now.
    let serves = matches!(
        &cli.command,
        Command::Metadata(cmd::metadata::MetadataCmd::Serve(_)) | Command::Node(cmd::node::NodeCmd::Serve(_))
    );
    if !serves {
        if let Err(e) = cfg.init_client_tls(None, None) {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    }
    let is_daemon = match &cli.command {
        Command::Metadata(cmd::metadata::MetadataCmd::Serve(_))
        | Command::Node(cmd::node::NodeCmd::Serve(_))
        | Command::Csi(_)
        | Command::Webhook(_) => true,
        Command::Mount(m) => m.foreground || m.notify_ready || m.serve,
        _ => false,
    };
    config::init_logging(&cfg, is_daemon);

    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Metadata(c) => cmd::metadata::run(c, &cfg).await,
            Command::Node(c) => cmd::node::run(c, &cfg).await,
            Command::Dataset(c) => cmd::dataset::run(c, &cfg).await,
            Command::Locality(a) => cmd::locality::run(a, &cfg).await,
            Command::Assign(a) => cmd::locality::assign(a, &cfg).await,
            Command::Warm(a) => cmd::locality::warm(a, &cfg).await,
            Command::Slurm(c) => cmd::slurm::run(c, &cfg).await,
            Command::Backup(c) => cmd::backup::run(c, &cfg).await,
            Command::Restore(a) => cmd::backup::restore(a, &cfg).await,
            Command::Mount(a) => cmd::mount::run(*a, &cfg).await,
            Command::Umount(a) => cmd::mount::umount(a).await,
            Command::Tls(c) => cmd::tls::run(c, cfg.json),
            Command::Status => cmd::status::run(&cfg).await,
            Command::Doctor(a) => cmd::doctor::run(a, &cfg).await,
            Command::Csi(a) => cmd::csi::run(a, &cfg).await,
            Command::Webhook(a) => cmd::webhook::run(a, &cfg).await,
            Command::Demo(a) => cmd::demo::run(a, &cfg).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where a relative path given on the command line points.
/// Lexically, so `./mnt` shows as `/dir/mnt`, not `/dir/./mnt` (a `..` is kept: it may
/// pass through a symlink).
pub fn absolute(p: PathBuf) -> PathBuf {
    std::path::absolute(&p).unwrap_or(p)
}
