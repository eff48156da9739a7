//! `locus backup run|list|verify|gc` and `locus restore`: arguments and printing. What
//! the commands do is library code: `locus::ops::backup` (run, verify and repair),
//! `locus::ops::restore`, and `locus_backup` (listing, retention, garbage collection).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use locus::ops;
use locus::ops::backup::{RunOptions, RunReport, VerifyOptions};
use locus_backup::format::now_ms;
use locus_backup::retention::Policy;
use locus_backup::{SnapshotState, Target};
use locus_proto::pb;

use crate::config::Resolved;
use crate::output::{self, TermObserver};

#[derive(Subcommand, Debug)]
pub enum BackupCmd {
    /// Back the cluster up: a consistent snapshot of the metadata plus every blob the
    /// target does not hold yet, uploaded by the nodes in parallel. The snapshot is valid
    /// only once its COMMITTED marker is written, last; an interrupted run is resumed by
    /// running it again. Exit status 0 only if the snapshot was committed.
    #[command(after_help = "\
Examples:
  # Back up to S3, signed, keeping 7 daily and 4 weekly snapshots
  locus backup run --to s3://backups/locus --signing-key /etc/locus/backup.key --keep-daily 7 --keep-weekly 4
  # To a directory (the [backup] section of the config file can hold these)
  locus backup run --to file:///mnt/backup")]
    Run(RunArgs),
    /// List the snapshots in a backup target: id, time, datasets, bytes, new bytes,
    /// duration, state.
    #[command(after_help = "\
Examples:
  # The snapshots at a target, newest last
  locus backup list --to s3://backups/locus")]
    List(TargetArg),
    /// Re-read and re-hash stored blobs (all, or a sample) and the catalogue of a
    /// snapshot; report missing or corrupt ones (exit status 1 if any).
    #[command(after_help = "\
Examples:
  # Check the newest snapshot's signature and every blob it names
  locus backup verify --to s3://backups/locus --trust-key /etc/locus/backup.key.pub
  # A 5% sample, putting back what is missing or damaged
  locus backup verify --to file:///mnt/backup --sample 0.05 --repair")]
    Verify(VerifyArgs),
    /// Apply retention and delete blobs no kept snapshot needs. Safe while a backup runs.
    #[command(after_help = "\
Examples:
  # Show what retention would delete
  locus backup gc --to s3://backups/locus --keep-daily 7 --dry-run
  # Delete it
  locus backup gc --to s3://backups/locus --keep-daily 7")]
    Gc(GcArgs),
    /// Create an Ed25519 signing key for snapshots (PKCS#8, mode 0600, never overwrites)
    /// and print its public key (also written to FILE.pub). Runs given the key sign their
    /// snapshots; restore and verify trust the public key (`--trust-key`).
    #[command(after_help = "\
Examples:
  # A signing key (kept by the backup job) and its public half (for restore)
  locus backup keygen --out /etc/locus/backup.key")]
    Keygen {
        /// Where to write the private key.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

/// Which snapshots restore and verify accept.
#[derive(Args, Debug, Default, Clone)]
pub struct TrustArgs {
    /// A public key (64 hex digits, or a file holding them) whose signature a snapshot
    /// must carry; repeatable [default: `trusted_keys` in the config's [backup] section].
    #[arg(long = "trust-key", value_name = "KEY|FILE")]
    pub trust_keys: Vec<String>,
    /// Use a snapshot that is unsigned or signed by a key not trusted here: its catalogue
    /// then rests on the bucket's access control alone. A trusted key's signature that
    /// does not match is refused regardless.
    #[arg(long)]
    pub allow_unsigned: bool,
}

impl TrustArgs {
    fn trust(&self, cfg: &Resolved) -> anyhow::Result<locus_backup::sign::Trust> {
        let keys = if self.trust_keys.is_empty() {
            cfg.backup.trusted_keys.clone()
        } else {
            self.trust_keys.clone()
        };
        Ok(locus_backup::sign::Trust::from_args(&keys, self.allow_unsigned)?)
    }
}

#[derive(Args, Debug)]
pub struct TargetArg {
    /// Backup target: file:///DIR or s3://BUCKET/PREFIX (S3 credentials and endpoint from
    /// the AWS_* environment). Default: `to` in the config file's [backup] section.
    #[arg(long, visible_alias = "target", value_name = "URL")]
    pub to: Option<String>,
}

#[derive(Args, Debug, Default)]
pub struct RetentionArgs {
    /// Keep the N newest snapshots.
    #[arg(long, value_name = "N")]
    pub keep_last: Option<u32>,
    /// Keep the newest snapshot of each of the last N days that have one.
    #[arg(long, value_name = "N")]
    pub keep_daily: Option<u32>,
    /// Keep the newest snapshot of each of the last N ISO weeks that have one.
    #[arg(long, value_name = "N")]
    pub keep_weekly: Option<u32>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub target: TargetArg,
    /// After a committed run, apply this retention and collect garbage (also read from
    /// the config file's [backup] section). Without any, nothing is deleted.
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Uploads in flight per node.
    #[arg(long, default_value_t = 4)]
    pub parallel: u32,
    /// Sign the snapshot with this Ed25519 key (`locus backup keygen`) [default:
    /// `signing_key` in the config's [backup] section].
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub target: TargetArg,
    /// Snapshot to verify [default: the newest committed one].
    #[arg(long, value_name = "ID")]
    pub snapshot: Option<String>,
    /// Fraction of the snapshot's blobs to re-read, chosen at random (0 < F ≤ 1).
    #[arg(long, default_value_t = 1.0, value_name = "FRACTION")]
    pub sample: f64,
    /// Blobs read at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Mend what is found: nodes holding a missing or corrupt blob upload it again
    /// (needs the metadata service and an admin token). Exit status 0 if all were mended.
    #[arg(long)]
    pub repair: bool,
    #[command(flatten)]
    pub trust: TrustArgs,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    #[command(flatten)]
    pub target: TargetArg,
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Incomplete snapshots older than this are taken as abandoned runs and deleted;
    /// younger ones may still be running and their blobs are kept.
    #[arg(long, default_value = "24h", value_name = "DURATION")]
    pub abandoned_after: String,
    /// Report what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Backup target to restore from (file:///DIR or s3://BUCKET/PREFIX).
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// Snapshot to restore [default: the newest committed one].
    #[arg(long, value_name = "ID")]
    pub snapshot: Option<String>,
    /// Rebuild a whole metadata service here: a new data dir, which must not exist or be
    /// empty. Start the service on it afterwards (`locus metadata serve --data-dir DIR`).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "dataset",
        conflicts_with = "dataset"
    )]
    pub data_dir: Option<PathBuf>,
    /// Or bring one version back into the running cluster (a deleted dataset, say):
    /// NAME[@VERSION] as the snapshot holds it [default version: its newest there]. It
    /// becomes the next version of the dataset (numbers are never reused); blobs come
    /// from nodes that still hold them, else from the backup.
    #[arg(long, value_name = "NAME[@VERSION]")]
    pub dataset: Option<String>,
    /// With --dataset: restore under this dataset name instead.
    #[arg(long = "as", value_name = "NAME", requires = "dataset")]
    pub as_name: Option<String>,
    /// With --dataset: replicas of every shard [default: as the version had].
    #[arg(long, value_name = "R", requires = "dataset")]
    pub replicas: Option<u32>,
    /// With --dataset: the snapshot may be of another cluster (bringing a version over
    /// on purpose); without it such a snapshot is refused.
    #[arg(long, requires = "dataset")]
    pub from_other_cluster: bool,
    #[command(flatten)]
    pub trust: TrustArgs,
}

pub async fn run(cmd: BackupCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Run(a) => backup_run(a, cfg).await,
        BackupCmd::List(a) => list(&open_target(&a, cfg)?, cfg).await,
        BackupCmd::Verify(a) => verify(a, cfg).await,
        BackupCmd::Gc(a) => gc(a, cfg).await,
        BackupCmd::Keygen { out } => {
            let public = locus_backup::sign::SigningKey::generate(&out)?;
            let pub_path = PathBuf::from(format!("{}.pub", out.display()));
            std::fs::write(&pub_path, format!("{public}\n"))
                .with_context(|| format!("cannot write {}", pub_path.display()))?;
            if cfg.json {
                output::json(&serde_json::json!({ "key": out, "public_key": public }))
            } else {
                println!(
                    "signing key written to {} (keep it secret); public key {public} (also in {}): \
                     give it to restore and verify as --trust-key",
                    out.display(),
                    pub_path.display()
                );
                Ok(())
            }
        }
    }
}

fn open_target(a: &TargetArg, cfg: &Resolved) -> anyhow::Result<Target> {
    let Some(url) = a.to.clone().or_else(|| cfg.backup.to.clone()) else {
        bail!("no backup target: give --to URL or set `to` in the config file's [backup] section");
    };
    Ok(Target::open(&url)?)
}

fn policy(r: &RetentionArgs, cfg: &Resolved) -> Policy {
    Policy {
        keep_last: r.keep_last.or(cfg.backup.keep_last).unwrap_or(0),
        keep_daily: r.keep_daily.or(cfg.backup.keep_daily).unwrap_or(0),
        keep_weekly: r.keep_weekly.or(cfg.backup.keep_weekly).unwrap_or(0),
    }
}

async fn backup_run(a: RunArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let t = open_target(&a.target, cfg)?;
    let start = Instant::now();
    let started_ms = now_ms();
    let id = locus_backup::format::new_snapshot_id(started_ms);
    let mut report = RunReport {
        snapshot: id.clone(),
        target: t.url.clone(),
        ..Default::default()
    };
    let signing_key = match a.signing_key.clone().or_else(|| cfg.backup.signing_key.clone()) {
        Some(p) => Some(std::sync::Arc::new(locus_backup::sign::SigningKey::load(&p)?)),
        None => None,
    };
    let o = RunOptions {
        id: id.clone(),
        started_ms,
        parallel: a.parallel,
        retention: policy(&a.retention, cfg),
        signing_key,
    };
    let r = match cfg.connect().await {
        Ok(m) => ops::backup::run(
            &ops::cluster::GrpcCluster::new(m, cfg.token.clone()),
            &t,
            &o,
            &TermObserver::default(),
            &mut report,
        )
        .await
        .map_err(anyhow::Error::from),
        Err(e) => Err(e),
    };
    report.duration_s = start.elapsed().as_secs_f64();
    if let Err(e) = &r {
        report.errors.push(format!("{e:#}"));
    }
    if cfg.json {
        output::json(&report)?;
    } else if r.is_ok() {
        println!(
            "snapshot {} committed to {}: {} dataset(s), {} version(s), {} blobs ({}); uploaded {} blobs ({}), \
             skipped {} already stored ({}); {:.1}s",
            id,
            t.url,
            report.datasets,
            report.versions,
            report.blobs,
            output::size(report.bytes_scanned),
            report.blobs_uploaded,
            output::size(report.bytes_uploaded),
            report.blobs_skipped,
            output::size(report.bytes_skipped),
            report.duration_s
        );
        if let Some(g) = &report.gc {
            println!(
                "retention: kept {} snapshot(s), deleted {}; deleted {} unreferenced blobs ({})",
                g.snapshots_kept.len(),
                g.snapshots_deleted.len(),
                g.blobs_deleted,
                output::size(g.bytes_deleted)
            );
        }
    }
    r.with_context(|| {
        format!(
            "backup to {} failed; snapshot {id} was not committed (earlier snapshots are untouched; \
             rerun to resume: blobs already stored are not sent again)",
            t.url
        )
    })
}

async fn list(t: &Target, cfg: &Resolved) -> anyhow::Result<()> {
    let snaps = t.list_snapshots().await?;
    if cfg.json {
        return output::json(&snaps);
    }
    let rows: Vec<Vec<String>> = snaps
        .iter()
        .map(|s| {
            let m = s.manifest.as_ref();
            let c = s.committed.as_ref();
            vec![
                s.id.clone(),
                output::time(s.created_ms()),
                match (s.state, s.damage.is_empty()) {
                    (SnapshotState::Committed, true) => "committed".into(),
                    (SnapshotState::Incomplete, true) => "incomplete".into(),
                    (SnapshotState::Committed, false) => "committed, DAMAGED".into(),
                    (SnapshotState::Incomplete, false) => "incomplete, DAMAGED".into(),
                },
                m.map(|m| {
                    m.datasets
                        .iter()
                        .map(|d| format!("{}({})", d.name, d.versions.len()))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_else(|| "-".into()),
                m.map(|m| output::size(m.blob_bytes))
                    .unwrap_or_else(|| "-".into()),
                c.map(|c| output::size(c.bytes_uploaded))
                    .unwrap_or_else(|| "-".into()),
                c.map(|c| format!("{:.1}s", (c.finished_ms - c.started_ms) as f64 / 1000.0))
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    output::table(
        &[
            "ID",
            "TIME",
            "STATE",
            "DATASETS",
            "BYTES",
            "NEW BYTES",
            "DURATION",
        ],
        &rows,
    );
    Ok(())
}

async fn verify(a: VerifyArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let t = open_target(&a.target, cfg)?;
    let o = VerifyOptions {
        snapshot: a.snapshot.clone(),
        sample: a.sample,
        parallel: a.parallel,
        repair: a.repair,
        trust: a.trust.trust(cfg)?,
    };
    let cluster = if a.repair {
        Some(ops::cluster::GrpcCluster::new(
            cfg.connect().await?,
            cfg.token.clone(),
        ))
    } else {
        None
    };
    let cluster = cluster.as_ref().map(|c| c as &dyn ops::cluster::BackupCluster);
    let report = ops::backup::verify(&t, cluster, &o, &TermObserver::default()).await?;
    if cfg.json {
        output::json(&report)?;
    } else {
        match &report.signature {
            Some(locus_backup::sign::Checked::Trusted(k)) => println!("signature: ok, by trusted key {k}"),
            Some(locus_backup::sign::Checked::Unchecked(why)) => {
                println!("signature: NOT CHECKED ({why}; --allow-unsigned)")
            }
            None => {}
        }
        println!(
            "snapshot {}: catalogue {}; {} of {} blobs re-read ({}): {} missing, {} corrupt; {:.1}s",
            report.snapshot,
            if report.catalog_ok {
                "ok"
            } else {
                "MISSING OR CORRUPT"
            },
            report.blobs_checked,
            report.blobs_total,
            output::size(report.bytes_checked),
            report.missing.len(),
            report.corrupt.len(),
            report.duration_s
        );
        for h in &report.missing {
            println!("missing  {h}");
        }
        for h in &report.corrupt {
            println!("corrupt  {h}");
        }
        for h in &report.repaired {
            println!("repaired {h}");
        }
    }
    if let Some(e) = &report.repair_error {
        bail!("snapshot {} failed verification and repair: {e}", report.snapshot);
    }
    if report.failed() {
        bail!("snapshot {} failed verification", report.snapshot);
    }
    Ok(())
}

async fn gc(a: GcArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let t = open_target(&a.target, cfg)?;
    let abandoned = crate::config::duration_arg("--abandoned-after", &a.abandoned_after)?;
    let r = locus_backup::gc::collect(&t, policy(&a.retention, cfg), abandoned, a.dry_run).await?;
    if cfg.json {
        return output::json(&r);
    }
    let verb = if a.dry_run { "would delete" } else { "deleted" };
    println!(
        "kept {} snapshot(s), {verb} {} ({}); {} in progress kept; kept {} blobs, {verb} {} ({})",
        r.snapshots_kept.len(),
        r.snapshots_deleted.len(),
        r.snapshots_deleted.join(", "),
        r.snapshots_in_progress.len(),
        r.blobs_kept,
        r.blobs_deleted,
        output::size(r.bytes_deleted)
    );
    Ok(())
}

pub async fn restore(a: RestoreArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let dir = a.data_dir.clone().map(crate::absolute);
    if let Some(dir) = &dir {
        // Said before anything is downloaded (ops::restore checks it again, for every
        // caller).
        if std::fs::read_dir(dir).is_ok_and(|mut rd| rd.next().is_some()) {
            bail!(
                "{} is not empty: restore only into a new or empty data dir (nothing was changed)",
                dir.display()
            );
        }
    }
    let t = Target::open(&a.from)?;
    let trust = a.trust.trust(cfg)?;
    let fetched = ops::restore::fetch_catalog(&t, a.snapshot.as_deref(), &trust).await?;
    if let locus_backup::sign::Checked::Unchecked(why) = &fetched.checked {
        eprintln!(
            "warning: snapshot {} is {why}; restoring it anyway (--allow-unsigned)",
            fetched.id
        );
    }
    let Some(dir) = dir else {
        return restore_version(&a, cfg, &t, fetched).await;
    };
    let (snapshot, manifest) = (fetched.id.clone(), fetched.manifest.clone());
    let st = ops::restore::restore_catalog(fetched, &dir, &t.url)
        .await
        .context("restore failed; the data dir was left as it was")?;
    let versions: usize = manifest.datasets.iter().map(|d| d.versions.len()).sum();
    if cfg.json {
        return output::json(&serde_json::json!({
            "snapshot": snapshot,
            "data_dir": dir,
            "rows": st.rows,
            "datasets": manifest.datasets,
            "blobs": manifest.blobs,
            "blob_bytes": manifest.blob_bytes,
        }));
    }
    println!(
        "restored snapshot {} ({}) into {}: {} dataset(s), {} version(s), {} blobs ({}).\n\
         Next: start `locus metadata serve --data-dir {}`, then the cache nodes. Nodes refill \
         their replicas from {} (blobs no node holds are read from the backup), or run \
         `locus warm` to bring a version onto chosen nodes first.",
        snapshot,
        output::time(manifest.created_ms),
        dir.display(),
        manifest.datasets.len(),
        versions,
        manifest.blobs,
        output::size(manifest.blob_bytes),
        dir.display(),
        t.url
    );
    Ok(())
}

/// `restore --dataset`: one version of the snapshot imported again into the running
/// cluster, through the import path (placement, verified writes to the nodes, one commit).
async fn restore_version(
    a: &RestoreArgs,
    cfg: &Resolved,
    t: &Target,
    fetched: ops::restore::Fetched,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let want = a.dataset.clone().unwrap_or_default();
    let r: locus_proto::DatasetRef = want
        .parse()
        .map_err(|e: locus_proto::InvalidInput| anyhow::anyhow!("--dataset {want}: {}", e.reason))?;
    let name = r.name.to_string();
    let number = match r.version {
        locus_proto::VersionSel::Latest => None,
        locus_proto::VersionSel::Number(n) => Some(n),
    };
    let snapshot = fetched.id.clone();
    let snapshot = snapshot.as_str();
    let mut m = cfg.connect().await?;
    let cluster_id = m
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}", ops::status_sentence(&s)))?
        .into_inner()
        .cluster_id;
    let (v, scanned) =
        ops::restore::read_version(t, fetched, &name, number, &cluster_id, a.from_other_cluster).await?;
    let o = ops::import::ImportOptions {
        name: a.as_name.clone().unwrap_or_else(|| name.clone()),
        source: t.url.clone(),
        replicas: match a.replicas {
            Some(0) => bail!("--replicas must be at least 1"),
            Some(r) => r,
            None => v.replication.max(1),
        },
        // The snapshot's shards are reused as they were: no new grouping.
        shard_size: 0,
        chunk_size: v.chunk_size,
        parallel: 8,
        token: cfg.token.clone(),
        // Blobs come from the backup's layout, which only this client reads.
        read_by: ops::import::ReadBy::Client,
    };
    if !cfg.json {
        println!(
            "restoring {}@{} from snapshot {snapshot} as the next version of {}",
            v.dataset, v.number, o.name
        );
    }
    let cluster: std::sync::Arc<dyn ops::cluster::ImportCluster> =
        std::sync::Arc::new(ops::cluster::GrpcCluster::new(m.clone(), cfg.token.clone()));
    let report = ops::import::commit_scanned(
        &cluster,
        &o,
        &scanned,
        Some(t.store.clone()),
        v.origin,
        &TermObserver::default(),
        started,
        Duration::ZERO,
    )
    .await?;
    super::import::print_report(&report, cfg)?;
    // The backup is now a source for this version's blobs too (not a fresh backup).
    if let Err(e) = ops::restore::record_source(&mut m, &t.url, snapshot).await {
        eprintln!("warning: could not record {} as a source of blobs: {e}", t.url);
    }
    Ok(())
}
