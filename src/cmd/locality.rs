//! `locus locality`: where a job that reads a dataset should run — every candidate node
//! ranked by what it already holds and what the rest would cost to bring there.

use clap::Args;
use locus_proto::pb;

use crate::config::Resolved;
use crate::output::{self, StatusExt};

#[derive(Args, Debug)]
pub struct LocalityArgs {
    /// DATASET[@VERSION] (latest when no version is given); several add up.
    #[arg(required = true)]
    pub targets: Vec<String>,
    /// Only these candidate nodes (comma-separated) [default: every live node].
    #[arg(long, value_delimiter = ',', value_name = "NODE,...")]
    pub nodes: Vec<String>,
    /// Only nodes with all these labels, e.g. gpu=h100,zone=z1.
    #[arg(long = "where", value_name = "K=V,...")]
    pub selector: Option<String>,
    /// Only these shards (one dataset version).
    #[arg(long, value_delimiter = ',', value_name = "ID,...")]
    pub shards: Vec<u32>,
    /// Only files under this path (repeatable).
    #[arg(long = "path", value_name = "PATH")]
    pub paths: Vec<String>,
    /// Show only the best N nodes (the ranking is the same) [default: every candidate].
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
}

pub async fn run(a: LocalityArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let refs = a
        .targets
        .iter()
        .map(|t| {
            let r: locus_proto::DatasetRef = t.parse().map_err(|e| anyhow::anyhow!("{t:?}: {e}"))?;
            Ok(pb::VersionRef::from(&r))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let selector = match &a.selector {
        Some(s) => {
            locus_metadata::http_api::parse_selector(s).map_err(|e| anyhow::anyhow!("--where: {e}"))?
        }
        None => Default::default(),
    };
    let mut c = cfg.connect().await?;
    let out = c
        .locality(pb::LocalityRequest {
            refs,
            path_prefixes: a.paths,
            shards: a.shards,
            nodes: a.nodes,
            selector,
            limit: a.limit.unwrap_or(0),
            labels: true,
        })
        .await
        .or_status()?;
    if cfg.json {
        let nodes: Vec<_> = out
            .nodes
            .iter()
            .map(|n| {
                serde_json::json!({
                    "node": n.node, "rank": n.rank, "live": n.live,
                    "resident_bytes": n.resident_bytes, "resident_fraction": n.resident_fraction,
                    "transfer_cost": n.transfer_cost,
                    "same_host_bytes": n.same_host_bytes, "same_rack_bytes": n.same_rack_bytes,
                    "same_zone_bytes": n.same_zone_bytes, "other_zone_bytes": n.other_zone_bytes,
                    "origin_bytes": n.origin_bytes, "labels": n.labels,
                })
            })
            .collect();
        return output::json(&serde_json::json!({
            "datasets": out.refs.iter().map(|r| format!("{}@{}", r.dataset, r.version)).collect::<Vec<_>>(),
            "total_bytes": out.total_bytes,
            "nodes": nodes,
        }));
    }
    let what: Vec<String> = out
        .refs
        .iter()
        .map(|r| format!("{}@{}", r.dataset, r.version))
        .collect();
    println!(
        "{} ({}), best node first:",
        what.join(" + "),
        output::size(out.total_bytes)
    );
    let label = |n: &pb::NodeLocality, k: &str| n.labels.get(k).cloned().unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = out
        .nodes
        .iter()
        .map(|n| {
            let mut rest = Vec::new();
            for (b, what) in [
                (n.same_host_bytes, "host"),
                (n.same_rack_bytes, "rack"),
                (n.same_zone_bytes, "zone"),
                (n.other_zone_bytes, "other zone"),
                (n.origin_bytes, "object store"),
            ] {
                if b > 0 {
                    rest.push(format!("{} {what}", output::size(b)));
                }
            }
            vec![
                n.rank.to_string(),
                n.node.clone(),
                label(n, "zone"),
                label(n, "rack"),
                output::size(n.resident_bytes),
                format!("{:.1}%", n.resident_fraction * 100.0),
                format!("{:.2}", n.transfer_cost),
                if rest.is_empty() {
                    "-".into()
                } else {
                    rest.join(", ")
                },
            ]
        })
        .collect();
    output::table(
        &[
            "RANK",
            "NODE",
            "ZONE",
            "RACK",
            "RESIDENT",
            "FRACTION",
            "COST",
            "REST FROM",
        ],
        &rows,
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct AssignArgs {
    /// DATASET[@VERSION] (latest when no version is given).
    pub target: String,
    /// The job's nodes, comma-separated; with --ranks-per-node, ranks are numbered node
    /// by node (0..k on the first node, and so on).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "NODE,...",
        conflicts_with = "rank_nodes"
    )]
    pub nodes: Vec<String>,
    /// Ranks on each node given with --nodes.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ranks_per_node: usize,
    /// The node of every rank, in rank order (rank i runs on the i-th), e.g. a,a,b,b.
    #[arg(long, value_delimiter = ',', value_name = "NODE,...")]
    pub rank_nodes: Vec<String>,
    /// Also list each rank's files.
    #[arg(long)]
    pub with_files: bool,
}

pub async fn assign(a: AssignArgs, cfg: &Resolved) -> anyhow::Result<()> {
    let r: locus_proto::DatasetRef = a
        .target
        .parse()
        .map_err(|e| anyhow::anyhow!("{:?}: {e}", a.target))?;
    let rank_nodes: Vec<String> = if !a.rank_nodes.is_empty() {
        a.rank_nodes
    } else if !a.nodes.is_empty() {
        if a.ranks_per_node == 0 {
            anyhow::bail!("--ranks-per-node must be at least 1");
        }
        a.nodes
            .iter()
            .flat_map(|n| std::iter::repeat_n(n.clone(), a.ranks_per_node))
            .collect()
    } else {
        anyhow::bail!("say where the ranks run: --nodes a,b --ranks-per-node 4, or --rank-nodes a,a,b,b");
    };
    let mut c = cfg.connect().await?;
    let out = c
        .assign(pb::AssignRequest {
            r#ref: Some(pb::VersionRef::from(&r)),
            rank_nodes,
            with_files: a.with_files,
        })
        .await
        .or_status()?;
    let v = out.r#ref.clone().unwrap_or_default();
    // A shard is the unit of assignment: fewer shards than ranks leaves ranks idle, which
    // the table alone shows as ranks with nothing to read "100% locally".
    let idle = out.ranks.iter().filter(|r| r.shards.is_empty()).count();
    if idle > 0 {
        let shards: std::collections::BTreeSet<u32> =
            out.ranks.iter().flat_map(|r| r.shards.iter().copied()).collect();
        eprintln!(
            "warning: {idle} of {} ranks get no shard: {}@{} has {} shard(s). Import it again \
             with a --shard-size of at most {} to give every rank a share",
            out.ranks.len(),
            v.dataset,
            v.version,
            shards.len(),
            output::size((out.total_bytes / out.ranks.len().max(1) as u64).max(1)),
        );
    }
    if cfg.json {
        let ranks: Vec<_> = out
            .ranks
            .iter()
            .map(|r| {
                let mut j = serde_json::json!({
                    "rank": r.rank, "node": r.node, "shards": r.shards, "bytes": r.bytes,
                    "local_bytes": r.local_bytes, "local_fraction": r.local_fraction,
                });
                if a.with_files {
                    j["files"] = serde_json::json!(r.files);
                }
                j
            })
            .collect();
        return output::json(&serde_json::json!({
            "dataset": v.dataset, "version": v.version, "total_bytes": out.total_bytes,
            "local_fraction": out.local_fraction, "ranks": ranks,
        }));
    }
    println!(
        "{}@{}: {} over {} ranks, {:.1}% read locally",
        v.dataset,
        v.version,
        output::size(out.total_bytes),
        out.ranks.len(),
        out.local_fraction * 100.0
    );
    let rows: Vec<Vec<String>> = out
        .ranks
        .iter()
        .map(|r| {
            vec![
                r.rank.to_string(),
                r.node.clone(),
                r.shards.len().to_string(),
                output::size(r.bytes),
                if r.shards.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.1}%", r.local_fraction * 100.0)
                },
            ]
        })
        .collect();
    output::table(&["RANK", "NODE", "SHARDS", "BYTES", "LOCAL"], &rows);
    Ok(())
}

#[derive(Args, Debug)]
pub struct WarmArgs {
    /// DATASET[@VERSION] (latest when no version is given).
    pub target: String,
    /// Nodes that should hold every shard before the job starts (comma-separated).
    #[arg(long, value_delimiter = ',', value_name = "NODE,...", required = true)]
    pub nodes: Vec<String>,
    /// Most bytes that may come from outside the cluster — a recorded backup, else the
    /// version's origin — for shards no live node holds (0: such shards are refused).
    #[arg(long, value_name = "SIZE", default_value = "0")]
    pub max_origin_bytes: String,
}

pub async fn warm(a: WarmArgs, cfg: &Resolved) -> anyhow::Result<()> {
    use std::io::{IsTerminal, Write};
    let r: locus_proto::DatasetRef = a
        .target
        .parse()
        .map_err(|e| anyhow::anyhow!("{:?}: {e}", a.target))?;
    let budget = crate::config::size_arg("--max-origin-bytes", &a.max_origin_bytes)?;
    let mut c = cfg.connect().await?;
    let started = std::time::Instant::now();
    let mut stream = c
        .warm(pb::WarmRequest {
            r#ref: Some(pb::VersionRef::from(&r)),
            nodes: a.nodes.clone(),
            max_origin_bytes: budget,
        })
        .await
        .or_status()?;
    let tty = std::io::stderr().is_terminal() && !cfg.json;
    let mut last = pb::WarmProgress::default();
    let mut failures = Vec::new();
    while let Some(p) = stream.message().await.map_err(output::status_error)? {
        if !p.message.is_empty() {
            failures.push(p.message.clone());
            if !cfg.json {
                eprintln!("{}warning: {}", if tty { "\r\x1b[K" } else { "" }, p.message);
            }
        }
        if tty {
            eprint!(
                "\r\x1b[Kwarming: {}/{} copies, {} of {}",
                p.copies_done + p.copies_failed,
                p.copies_total,
                output::size(p.bytes_done),
                output::size(p.bytes_total)
            );
            let _ = std::io::stderr().flush();
        }
        last = p;
    }
    if tty {
        eprintln!();
    }
    if !last.finished {
        anyhow::bail!("the metadata service stopped answering before warm-up finished; rerun to resume");
    }
    let secs = started.elapsed().as_secs_f64();
    if cfg.json {
        output::json(&serde_json::json!({
            "dataset": r.name.as_str(), "version": last.version, "nodes": a.nodes,
            "copies": last.copies_total, "copied": last.copies_done, "failed": last.copies_failed,
            "bytes_copied": last.bytes_done, "bytes_already_present": last.bytes_already,
            "seconds": secs, "errors": failures,
        }))?;
    } else {
        println!(
            "warmed {}@{} on {}: copied {} ({} shard copies) peer to peer, {} already there; {:.1}s",
            r.name.as_str(),
            last.version,
            a.nodes.join(","),
            output::size(last.bytes_done),
            last.copies_done,
            output::size(last.bytes_already),
            secs
        );
    }
    if last.copies_failed > 0 {
        anyhow::bail!(
            "{} of {} copies failed (rerun to retry only those)",
            last.copies_failed,
            last.copies_total
        );
    }
    Ok(())
}
