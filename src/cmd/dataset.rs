//! `locus dataset …`: list, inspect and delete datasets and versions.

use anyhow::bail;
use clap::Subcommand;
use locus_proto::manifest::BlobHash;
use locus_proto::{pb, DatasetName, DatasetRef, VersionSel};

use crate::config::Resolved;
use crate::output::{self, StatusExt};

#[derive(Subcommand, Debug)]
pub enum DatasetCmd {
    /// Import a local directory as the next version of a dataset: hash every file, place
    /// shards on cache nodes, send each node its blobs (verified), then commit.
    #[command(after_help = "\
Examples:
  # A local directory as the next version, two replicas on different hosts
  locus dataset import imagenet /data/imagenet --replicas 2
  # From an S3 bucket, the nodes reading it themselves
  locus dataset import laion s3://bucket/laion/ --read-by nodes")]
    Import(super::import::ImportArgs),
    /// List datasets with their latest version and size.
    #[command(after_help = "\
Examples:
  # Every dataset with its latest version and size
  locus dataset list")]
    List,
    /// Show a dataset's versions (NAME) or one version in detail (NAME@VERSION,
    /// NAME@latest), with the bytes each node holds.
    #[command(after_help = "\
Examples:
  # A dataset's versions
  locus dataset show imagenet
  # One version: files, bytes, shards and the bytes each node holds
  locus dataset show imagenet@3")]
    Show {
        /// NAME, NAME@VERSION or NAME@latest.
        dataset: String,
    },
    /// List the entries of a version: one directory, or the whole tree with --recursive.
    #[command(after_help = "\
Examples:
  # One directory of a version
  locus dataset ls imagenet@3 train/n01440764
  # Every entry, as JSON
  locus dataset ls imagenet@latest --recursive --json")]
    Ls {
        /// NAME, NAME@VERSION or NAME@latest.
        dataset: String,
        /// Directory inside the version; the root when left out.
        #[arg(default_value = "", hide_default_value = true)]
        directory: String,
        /// Every entry of the version, not only one directory's.
        #[arg(long, short)]
        recursive: bool,
    },
    /// Give a version committed by a Locus from before sealed namespaces the namespace
    /// mounts need (built from its entries, stored with its first shard, checked by the
    /// metadata service). A version that has one is left as it is.
    #[command(after_help = "\
Examples:
  # Give a version committed by an older Locus the namespace mounts need
  locus dataset seal imagenet@3")]
    Seal {
        /// NAME@VERSION or NAME@latest.
        dataset: String,
    },
    /// Delete a version (NAME@VERSION), or every version of a dataset (NAME
    /// --all-versions). Version numbers are never reused. A version that a mount serves
    /// (on any host) is refused, naming the mounts, unless --force.
    #[command(after_help = "\
Examples:
  # Delete one version
  locus dataset rm imagenet@2
  # Delete every version of a dataset, even while mounts serve them
  locus dataset rm imagenet --all-versions --force")]
    Rm {
        /// NAME@VERSION, or NAME with --all-versions.
        dataset: String,
        /// Required to delete a whole dataset.
        #[arg(long)]
        all_versions: bool,
        /// Delete even what mounts serve now: their readers fail once the bytes are
        /// collected from the nodes.
        #[arg(long)]
        force: bool,
    },
}

pub async fn run(cmd: DatasetCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        DatasetCmd::Import(a) => super::import::run(a, cfg).await,
        DatasetCmd::List => list(cfg).await,
        DatasetCmd::Show { dataset } => show(cfg, &dataset).await,
        DatasetCmd::Ls {
            dataset,
            directory,
            recursive,
        } => ls(cfg, &dataset, &directory, recursive).await,
        DatasetCmd::Seal { dataset } => seal(cfg, &dataset).await,
        DatasetCmd::Rm {
            dataset,
            all_versions,
            force,
        } => rm(cfg, &dataset, all_versions, force).await,
    }
}

async fn seal(cfg: &Resolved, s: &str) -> anyhow::Result<()> {
    let r = parse_ref(s)?;
    let version = r.version.to_wire();
    let mut c = cfg.connect().await?;
    let cluster: std::sync::Arc<dyn locus::ops::cluster::ImportCluster> = std::sync::Arc::new(
        locus::ops::cluster::GrpcCluster::new(c.clone(), cfg.token.clone()),
    );
    let done = locus::ops::seal::seal(&mut c, &cluster, r.name.as_str(), version).await?;
    let v = &done.version;
    if cfg.json {
        let mut j = version_json(v);
        j["sealed_now"] = done.sealed_now.into();
        return output::json(&j);
    }
    if done.sealed_now {
        println!(
            "sealed {}@{}: {} entries, namespace {} ({})",
            v.dataset,
            v.version,
            done.entries,
            output::size(v.namespace_size),
            BlobHash::from_slice("namespace", &v.namespace_blob)
                .map_or_else(|_| "?".into(), |h| h.to_string())
        );
    } else {
        println!("{}@{} is sealed already; nothing to do", v.dataset, v.version);
    }
    Ok(())
}

fn parse_ref(s: &str) -> anyhow::Result<DatasetRef> {
    s.parse::<DatasetRef>().map_err(|e| {
        anyhow::anyhow!(
            "{s:?} is not a dataset reference (NAME, NAME@VERSION or NAME@latest): {}",
            e.reason
        )
    })
}

pub fn version_json(v: &pb::Version) -> serde_json::Value {
    serde_json::json!({
        "dataset": v.dataset,
        "version": v.version,
        "created_at": output::time(v.created_at_ms),
        "origin": v.origin,
        "replication": v.replication,
        "chunk_size": v.chunk_size,
        "files": v.files,
        "dirs": v.dirs,
        "symlinks": v.symlinks,
        "bytes": v.bytes,
        "shards": v.shards,
        "committed_by": v.committed_by,
        "namespace": (!v.namespace_blob.is_empty()).then(|| serde_json::json!({
            "blob": BlobHash::from_slice("namespace", &v.namespace_blob).map(|h| h.to_string()).unwrap_or_default(),
            "bytes": v.namespace_size,
        })),
        "resident": v.resident.iter().map(|r| serde_json::json!({"node": r.node, "bytes": r.bytes})).collect::<Vec<_>>(),
    })
}

fn dataset_json(d: &pb::Dataset) -> serde_json::Value {
    serde_json::json!({
        "name": d.name,
        "created_at": output::time(d.created_at_ms),
        "latest": d.latest,
        "versions": d.version_count,
        "bytes": d.bytes,
        "version_list": d.versions.iter().map(version_json).collect::<Vec<_>>(),
    })
}

async fn list(cfg: &Resolved) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let ds = c
        .list_datasets(pb::ListDatasetsRequest {})
        .await
        .or_status()?
        .datasets;
    if cfg.json {
        return output::json(&ds.iter().map(dataset_json).collect::<Vec<_>>());
    }
    let rows: Vec<Vec<String>> = ds
        .iter()
        .map(|d| {
            vec![
                d.name.clone(),
                if d.latest == 0 {
                    "-".into()
                } else {
                    d.latest.to_string()
                },
                d.version_count.to_string(),
                output::size(d.bytes),
                output::time(d.created_at_ms),
            ]
        })
        .collect();
    output::table(
        &["DATASET", "LATEST", "VERSIONS", "BYTES (ALL VERSIONS)", "CREATED"],
        &rows,
    );
    Ok(())
}

async fn show(cfg: &Resolved, s: &str) -> anyhow::Result<()> {
    let r = parse_ref(s)?;
    let mut c = cfg.connect().await?;
    if !s.contains('@') {
        let d = c
            .get_dataset(pb::GetDatasetRequest {
                name: r.name.to_string(),
            })
            .await
            .or_status()?;
        if cfg.json {
            return output::json(&dataset_json(&d));
        }
        println!(
            "dataset {}: {} versions, latest {}",
            d.name, d.version_count, d.latest
        );
        let rows: Vec<Vec<String>> = d
            .versions
            .iter()
            .map(|v| {
                vec![
                    v.version.to_string(),
                    v.files.to_string(),
                    output::size(v.bytes),
                    v.shards.to_string(),
                    v.origin.clone(),
                    output::time(v.created_at_ms),
                    v.committed_by.clone(),
                ]
            })
            .collect();
        output::table(
            &["VERSION", "FILES", "BYTES", "SHARDS", "ORIGIN", "CREATED", "BY"],
            &rows,
        );
        return Ok(());
    }
    let v = c
        .get_version(pb::GetVersionRequest {
            r#ref: Some((&r).into()),
        })
        .await
        .or_status()?;
    if cfg.json {
        return output::json(&version_json(&v));
    }
    println!("{}@{}", v.dataset, v.version);
    println!(
        "  created      {} by {}",
        output::time(v.created_at_ms),
        v.committed_by
    );
    println!("  origin       {}", v.origin);
    println!(
        "  files        {} ({}), {} dirs, {} symlinks",
        v.files,
        output::size(v.bytes),
        v.dirs,
        v.symlinks
    );
    println!("  shards       {} (replication {})", v.shards, v.replication);
    println!("  chunk size   {}", output::size(u64::from(v.chunk_size)));
    if v.namespace_blob.is_empty() {
        println!(
            "  namespace    none (committed before sealed namespaces: `locus dataset seal {}@{}`)",
            v.dataset, v.version
        );
    } else {
        println!("  namespace    {} (sealed)", output::size(v.namespace_size));
    }
    if v.resident.is_empty() {
        println!("  resident     on no node");
    } else {
        println!("  resident");
        for r in &v.resident {
            let frac = if v.bytes == 0 {
                1.0
            } else {
                r.bytes as f64 / v.bytes as f64
            };
            println!(
                "    {:<20} {:>10}  {:5.1}%",
                r.node,
                output::size(r.bytes),
                frac * 100.0
            );
        }
    }
    Ok(())
}

fn kind_char(k: i32) -> char {
    match pb::EntryKind::try_from(k) {
        Ok(pb::EntryKind::Dir) => 'd',
        Ok(pb::EntryKind::Symlink) => 'l',
        _ => '-',
    }
}

async fn ls(cfg: &Resolved, s: &str, dir: &str, recursive: bool) -> anyhow::Result<()> {
    let r = parse_ref(s)?;
    let dir = dir.trim_end_matches('/');
    let mut c = cfg.connect().await?;
    let directory = if recursive { None } else { Some(dir.to_string()) };
    if recursive && !dir.is_empty() {
        bail!("--recursive lists the whole version; leave out the directory");
    }
    let (version, entries) = locus_proto::client::list_all_entries(&mut c, (&r).into(), directory, true)
        .await
        .map_err(output::status_error)?;
    if cfg.json {
        // The listing leaves chunk hashes out (a tree is all it shows); the count follows
        // from the size and the version's chunk size.
        let chunk_size = c
            .get_version(pb::GetVersionRequest {
                r#ref: Some(pb::VersionRef {
                    dataset: r.name.to_string(),
                    version,
                }),
            })
            .await
            .or_status()?
            .chunk_size
            .max(1);
        let v: Vec<_> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "path": e.path,
                    "kind": match kind_char(e.kind) { 'd' => "dir", 'l' => "symlink", _ => "file" },
                    "size": e.size,
                    "mode": format!("{:o}", e.mode),
                    "mtime_ns": e.mtime_ns,
                    "blob": BlobHash::from_slice("blob", &e.blob).map(|h| h.to_hex()).ok(),
                    "chunks": e.size.div_ceil(u64::from(chunk_size)),
                    "shard": e.shard,
                    "target": e.symlink_target,
                })
            })
            .collect();
        return output::json(&serde_json::json!({"dataset": r.name, "version": version, "entries": v}));
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            let mut name = e.path.clone();
            if !e.symlink_target.is_empty() {
                name = format!("{name} -> {}", e.symlink_target);
            }
            vec![
                format!("{}{:04o}", kind_char(e.kind), e.mode),
                if kind_char(e.kind) == '-' {
                    output::size(e.size)
                } else {
                    "-".into()
                },
                name,
            ]
        })
        .collect();
    output::table(&["MODE", "SIZE", "PATH"], &rows);
    Ok(())
}

async fn rm(cfg: &Resolved, s: &str, all_versions: bool, force: bool) -> anyhow::Result<()> {
    let r = parse_ref(s)?;
    let mut c = cfg.connect().await?;
    match (s.contains('@'), r.version) {
        (true, VersionSel::Number(n)) => {
            c.delete_version(pb::DeleteVersionRequest {
                dataset: r.name.to_string(),
                version: n,
                force,
            })
            .await
            .or_status()?;
            if cfg.json {
                return output::json(&serde_json::json!({"deleted": format!("{}@{n}", r.name)}));
            }
            println!("deleted {}@{n}", r.name);
        }
        (true, VersionSel::Latest) => {
            bail!(
                "name the version to delete ({}@N); \"latest\" is too easy to get wrong",
                r.name
            )
        }
        (false, _) => {
            if !all_versions {
                bail!(
                    "{s} names a whole dataset; to delete every version add --all-versions, \
                     to delete one name it as {s}@N"
                );
            }
            let name: DatasetName = r.name;
            let n = c
                .delete_dataset(pb::DeleteDatasetRequest {
                    name: name.to_string(),
                    force,
                })
                .await
                .or_status()?
                .versions_deleted;
            if cfg.json {
                return output::json(&serde_json::json!({"deleted": name, "versions": n}));
            }
            println!("deleted dataset {name} ({n} versions)");
        }
    }
    Ok(())
}
