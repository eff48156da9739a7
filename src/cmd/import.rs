//! `locus dataset import`: parses the arguments, runs `locus::ops::import` with a
//! progress line on the terminal, and prints what it did.

use anyhow::bail;
use clap::Args;
use std::sync::Arc;

use locus::ops::cluster::{GrpcCluster, ImportCluster};
use locus::ops::import::{ImportError, ImportOptions, ImportReport};

use crate::config::Resolved;
use crate::output::{self, TermObserver};

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Dataset name; the import becomes its next version.
    pub name: String,
    /// A local directory, file://PATH, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or
    /// az://CONTAINER/PREFIX. Credentials come from each cloud's usual environment: AWS_*
    /// (AWS_ENDPOINT_URL and AWS_ALLOW_HTTP for S3-compatible servers),
    /// GOOGLE_SERVICE_ACCOUNT / GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_NAME
    /// and AZURE_STORAGE_ACCOUNT_KEY (AZURE_STORAGE_USE_EMULATOR for Azurite).
    pub source: String,
    /// Replicas of every shard, on distinct hosts (1 to 16).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub replicas: u32,
    /// Target shard size: files are grouped in path order into shards of about this many
    /// bytes; a larger file is a shard of its own.
    #[arg(long, default_value = "1GiB", value_name = "SIZE")]
    pub shard_size: String,
    /// Chunk size for hashes and partial transfers (power of two, 64KiB..1GiB). A mount
    /// with no local copy fetches whole chunks for sequential readers; a reader that
    /// jumps around (Parquet pages, LMDB, HDF5, indexed TFRecord or tar) is sent only the
    /// 16 KiB groups it reads, with their proof, whatever the chunk size: about 1.3x the
    /// bytes of each 64 KiB read and 5x of each 4 KiB one (nodes of this build; older
    /// ones send whole chunks).
    #[arg(long, default_value = "4MiB", value_name = "SIZE")]
    pub chunk_size: String,
    /// Blob uploads (or, read by the nodes, objects) in flight at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Who reads an object-store source: `nodes` (each object is read by the first node
    /// of its shard, with that node's credentials, hashed as it streams in and stored;
    /// the shard's other replicas copy it from that node), `client` (this command reads
    /// every object and sends it to the nodes), or `auto`: the nodes, and this command
    /// for the objects a node cannot read (no credentials or no route to the store; a
    /// warning names the node). A local directory is always read by this command.
    #[arg(long, value_enum, default_value_t = ReadByArg::Auto, value_name = "WHO")]
    pub read_by: ReadByArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum ReadByArg {
    Auto,
    Nodes,
    Client,
}

impl ImportArgs {
    /// The library's options: sizes parsed, the caller's token for the nodes.
    pub fn options(&self, cfg: &Resolved) -> anyhow::Result<ImportOptions> {
        let chunk_size = locus_proto::human::parse_size(&self.chunk_size)
            .map_err(|e| anyhow::anyhow!("--chunk-size: {}", e.reason))?;
        let Ok(chunk_size) = u32::try_from(chunk_size) else {
            bail!("--chunk-size must be a power of two from 64KiB to 1GiB");
        };
        let shard_size = locus_proto::human::parse_size(&self.shard_size)
            .map_err(|e| anyhow::anyhow!("--shard-size: {}", e.reason))?;
        Ok(ImportOptions {
            name: self.name.clone(),
            source: self.source.clone(),
            replicas: self.replicas,
            shard_size,
            chunk_size,
            parallel: self.parallel,
            token: cfg.token.clone(),
            read_by: match self.read_by {
                ReadByArg::Auto => locus::ops::import::ReadBy::Auto,
                ReadByArg::Nodes => locus::ops::import::ReadBy::Nodes,
                ReadByArg::Client => locus::ops::import::ReadBy::Client,
            },
        })
    }
}

pub async fn run(a: ImportArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let o = a.options(cfg)?;
    let cluster: Arc<dyn ImportCluster> = Arc::new(GrpcCluster::new(cfg.connect().await?, cfg.token.clone()));
    let r = match locus::ops::import::import(&cluster, &o, &TermObserver::default()).await {
        Ok(r) => r,
        // Failures once bytes move: what was sent stays on the nodes, the version does not
        // exist, and the same command picks up where this one stopped.
        Err(e @ (ImportError::Transfer { .. } | ImportError::Metadata(_))) => {
            let advice = match &e {
                ImportError::Transfer { cause, .. } => format!("\n{}.", cause.advice()),
                _ => String::new(),
            };
            bail!(
                "{e}{advice}\nnothing was committed: {} has no new version. Rerun the same command \
                 once that is fixed; blobs the nodes already received are not sent again",
                o.name
            )
        }
        Err(e) => return Err(e.into()),
    };
    print_report(&r, cfg)
}

/// The summary of an import: JSON for scripts, two lines for people.
pub fn print_report(r: &ImportReport, cfg: &Resolved) -> anyhow::Result<()> {
    let v = &r.version;
    let secs = r.total_time.as_secs_f64();
    if cfg.json {
        return output::json(&serde_json::json!({
            "dataset": v.dataset,
            "version": v.version,
            "files": v.files,
            "dirs": v.dirs,
            "symlinks": v.symlinks,
            "bytes": v.bytes,
            "shards": v.shards,
            "replicas": r.replicas,
            "distinct_blobs": r.distinct_blobs,
            "uploaded_bytes": r.uploaded_bytes,
            "skipped_bytes": r.skipped_bytes,
            "left_out": r.left_out,
            "hash_seconds": r.hash_time.as_secs_f64(),
            "upload_seconds": r.upload_time.as_secs_f64(),
            "phases": r
                .phases
                .iter()
                .map(|(p, d)| serde_json::json!({"phase": p, "seconds": d.as_secs_f64()}))
                .collect::<Vec<_>>(),
            "seconds": secs,
            "throughput_bytes_per_second": (v.bytes as f64 / secs) as u64,
        }));
    }
    println!(
        "imported {}@{}: {} files ({}), {} dirs, {} symlinks in {} shard(s) × {} replicas",
        v.dataset,
        v.version,
        v.files,
        output::size(v.bytes),
        v.dirs,
        v.symlinks,
        v.shards,
        r.replicas
    );
    println!(
        "sent {} to nodes, skipped {} already there; {:.1}s ({}/s)",
        output::size(r.uploaded_bytes),
        output::size(r.skipped_bytes),
        secs,
        output::size((v.bytes as f64 / secs.max(0.001)) as u64)
    );
    if let Some(first) = r.left_out.first() {
        println!(
            "left out {} path(s) that are not files, directories or symlinks (FIFOs, sockets, \
             devices), such as {first}",
            r.left_out.len()
        );
    }
    Ok(())
}
