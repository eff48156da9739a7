//! `locus slurm …`: helpers that let Slurm place jobs next to their data.
//!
//! - `features` gives each node a feature `locus_<dataset>_<version>` for every dataset
//!   version it holds above a threshold and applies them with `scontrol update`; jobs then
//!   ask `--prefer=locus_imagenet_3` (or `--constraint` to insist). Only features that
//!   start with `locus_` are ever added or removed; the node's other features are kept.
//! - `nodelist` prints the best nodes for a version as a Slurm hostlist (`gpu[01-04]`),
//!   for `sbatch --nodelist` or `-w`.
//!
//! Examples for slurm.conf, a cli_filter and a burst-buffer hook are in deploy/slurm/.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use locus_proto::pb;

use crate::config::Resolved;
use crate::output::StatusExt;

pub const FEATURE_PREFIX: &str = "locus_";

#[derive(Subcommand, Debug)]
pub enum SlurmCmd {
    /// Set each node's locus_<dataset>_<version> features from what it holds.
    #[command(after_help = "\
Examples:
  # Tag nodes that hold 90% of imagenet@3 with a Slurm feature
  locus slurm features imagenet@3
  # See what would change, without calling scontrol
  locus slurm features imagenet@3 --threshold 0.5 --dry-run")]
    Features(FeaturesArgs),
    /// The best nodes for a dataset version as a Slurm hostlist expression.
    #[command(after_help = "\
Examples:
  # The 4 best nodes for a job, as a hostlist for sbatch
  sbatch --nodelist=$(locus slurm nodelist imagenet@3 -N 4) train.sh
  # The same, printed
  locus slurm nodelist imagenet@3 -N 4")]
    Nodelist(NodelistArgs),
}

#[derive(Args, Debug)]
pub struct FeaturesArgs {
    /// Only these versions [default: the latest version of every dataset].
    pub targets: Vec<String>,
    /// A node gets a version's feature when it holds at least this fraction of it.
    #[arg(long, default_value_t = 0.9)]
    pub threshold: f64,
    /// Print the scontrol commands instead of running them.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug)]
pub struct NodelistArgs {
    /// DATASET[@VERSION].
    pub target: String,
    /// How many nodes.
    #[arg(short = 'N', long = "nodes", default_value_t = 1)]
    pub count: usize,
    /// Only nodes with these labels (e.g. gpu=h100).
    #[arg(long = "where", value_name = "K=V,...")]
    pub selector: Option<String>,
}

/// The Slurm feature for a dataset version: letters, digits and underscores only.
pub fn feature_name(dataset: &str, version: u64) -> String {
    let clean: String = dataset
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{FEATURE_PREFIX}{clean}_{version}")
}

/// Compresses host names into a Slurm hostlist: `gpu01,gpu02,gpu03,cpu7` →
/// `cpu7,gpu[01-03]`. Numeric suffixes keep their zero padding; names without one are
/// listed as they are.
pub fn hostlist(hosts: &[String]) -> String {
    let mut groups: BTreeMap<(String, usize), BTreeSet<u64>> = BTreeMap::new();
    let mut plain = BTreeSet::new();
    for h in hosts {
        let digits = h.chars().rev().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || digits > 18 {
            plain.insert(h.clone());
            continue;
        }
        let (prefix, num) = h.split_at(h.len() - digits);
        let width = if num.starts_with('0') && num.len() > 1 {
            num.len()
        } else {
            0
        };
        groups
            .entry((prefix.to_string(), width))
            .or_default()
            .insert(num.parse().unwrap_or(0));
    }
    let mut parts: Vec<String> = plain.into_iter().collect();
    for ((prefix, width), nums) in groups {
        let fmt = |n: u64| format!("{n:0width$}");
        let nums: Vec<u64> = nums.into_iter().collect();
        let mut ranges = Vec::new();
        let mut i = 0;
        while i < nums.len() {
            let mut j = i;
            while j + 1 < nums.len() && nums[j + 1] == nums[j] + 1 {
                j += 1;
            }
            ranges.push(if i == j {
                fmt(nums[i])
            } else {
                format!("{}-{}", fmt(nums[i]), fmt(nums[j]))
            });
            i = j + 1;
        }
        if nums.len() == 1 {
            parts.push(format!("{prefix}{}", ranges[0]));
        } else {
            parts.push(format!("{prefix}[{}]", ranges.join(",")));
        }
    }
    parts.join(",")
}

/// What scontrol says of a node.
enum SlurmNode {
    /// Its (available, active) features.
    Known(Vec<String>, Vec<String>),
    /// Slurm has no node of that name (a Locus node on a host outside the cluster).
    Unknown,
    /// scontrol is not installed here.
    NoScontrol,
}

/// A node's current features as scontrol reports them.
fn current_features(node: &str) -> anyhow::Result<SlurmNode> {
    let out = match Command::new("scontrol")
        .args(["show", "node", node, "--oneliner"])
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SlurmNode::NoScontrol),
        Err(e) => return Err(e).context("running scontrol"),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // scontrol says "Node X not found" on stdout, not stderr.
        let said = format!("{} {}", text.trim(), String::from_utf8_lossy(&out.stderr).trim());
        if said.contains("not found") {
            return Ok(SlurmNode::Unknown);
        }
        bail!("scontrol show node {node}: {}", said.trim());
    }
    let get = |key: &str| -> Vec<String> {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .filter(|v| *v != "(null)")
            .map(|v| {
                v.split(',')
                    .filter(|f| !f.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok(SlurmNode::Known(
        get("AvailableFeatures="),
        get("ActiveFeatures="),
    ))
}

/// Replaces the Locus features in `current` by `ours`, keeping every other feature. A
/// feature `""` is dropped: earlier versions of this command stored one (two quote
/// characters, passed without a shell) when a node lost its last Locus feature.
pub fn merge_features(current: &[String], ours: &BTreeSet<String>) -> Vec<String> {
    let mut out: Vec<String> = current
        .iter()
        .filter(|f| !f.starts_with(FEATURE_PREFIX) && f.as_str() != "\"\"")
        .cloned()
        .collect();
    out.extend(ours.iter().cloned());
    out
}

pub async fn run(c: SlurmCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match c {
        SlurmCmd::Features(a) => features(a, cfg).await,
        SlurmCmd::Nodelist(a) => nodelist(a, cfg).await,
    }
}

async fn features(a: FeaturesArgs, cfg: &Resolved) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.threshold) {
        bail!("--threshold must be between 0 and 1");
    }
    let mut c = cfg.connect().await?;
    let targets: Vec<pb::VersionRef> = if a.targets.is_empty() {
        c.list_datasets(pb::ListDatasetsRequest {})
            .await
            .or_status()?
            .datasets
            .into_iter()
            .filter(|d| d.latest > 0)
            .map(|d| pb::VersionRef {
                dataset: d.name,
                version: d.latest,
            })
            .collect()
    } else {
        a.targets
            .iter()
            .map(|t| {
                let r: locus_proto::DatasetRef = t.parse().map_err(|e| anyhow::anyhow!("{t:?}: {e}"))?;
                Ok(pb::VersionRef::from(&r))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let nodes = c.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
    let mut want: BTreeMap<String, BTreeSet<String>> =
        nodes.iter().map(|n| (n.id.clone(), BTreeSet::new())).collect();
    for t in targets {
        let all: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
        let l = c
            .locality(pb::LocalityRequest {
                refs: vec![t],
                nodes: all,
                ..Default::default()
            })
            .await
            .or_status()?;
        let Some(v) = l.refs.first() else { continue };
        let feature = feature_name(&v.dataset, v.version);
        for n in l
            .nodes
            .iter()
            .filter(|n| n.live && n.resident_fraction >= a.threshold)
        {
            want.entry(n.node.clone()).or_default().insert(feature.clone());
        }
    }
    let (mut failed, mut unknown) = (0, Vec::new());
    for (node, ours) in &want {
        let current = current_features(node)?;
        let (avail, active) = match &current {
            SlurmNode::Known(av, ac) => (merge_features(av, ours), merge_features(ac, ours)),
            SlurmNode::Unknown => {
                // One Locus node outside Slurm must not keep every other node stale.
                unknown.push(node.clone());
                continue;
            }
            SlurmNode::NoScontrol => {
                if !a.dry_run {
                    bail!("scontrol was not found: run this on a host with the Slurm client tools, or use --dry-run");
                }
                let v: Vec<String> = ours.iter().cloned().collect();
                (v.clone(), v)
            }
        };
        if let SlurmNode::Known(av, ac) = &current {
            if av == &avail && ac == &active {
                continue; // nothing to change
            }
        }
        // No features: an empty value, which scontrol takes as "none". (The command runs
        // without a shell, so quotes would become part of the feature.)
        let list = |v: &[String]| v.join(",");
        let args = [
            "update".to_string(),
            format!("NodeName={node}"),
            format!("AvailableFeatures={}", list(&avail)),
            format!("ActiveFeatures={}", list(&active)),
        ];
        if a.dry_run {
            println!("scontrol {}", args.join(" "));
            continue;
        }
        let out = Command::new("scontrol")
            .args(&args)
            .output()
            .context("running scontrol")?;
        if out.status.success() {
            println!(
                "{node}: {}",
                if ours.is_empty() {
                    "-".into()
                } else {
                    list(&ours.iter().cloned().collect::<Vec<_>>())
                }
            );
        } else {
            failed += 1;
            eprintln!(
                "warning: scontrol update NodeName={node}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    if !unknown.is_empty() {
        eprintln!(
            "warning: Slurm has no node named {}: skipped (a Locus node id must be its Slurm node name)",
            unknown.join(", ")
        );
    }
    if failed > 0 {
        bail!("{failed} node(s) could not be updated");
    }
    Ok(())
}

async fn nodelist(a: NodelistArgs, cfg: &Resolved) -> anyhow::Result<()> {
    if a.count == 0 {
        bail!("-N must be at least 1");
    }
    let r: locus_proto::DatasetRef = a
        .target
        .parse()
        .map_err(|e| anyhow::anyhow!("{:?}: {e}", a.target))?;
    let selector = match &a.selector {
        Some(s) => {
            locus_metadata::http_api::parse_selector(s).map_err(|e| anyhow::anyhow!("--where: {e}"))?
        }
        None => Default::default(),
    };
    let mut c = cfg.connect().await?;
    let l = c
        .locality(pb::LocalityRequest {
            refs: vec![pb::VersionRef::from(&r)],
            selector,
            ..Default::default()
        })
        .await
        .or_status()?;
    if l.nodes.len() < a.count {
        bail!(
            "only {} live node(s) qualify, {} asked for",
            l.nodes.len(),
            a.count
        );
    }
    let best: Vec<String> = l.nodes.iter().take(a.count).map(|n| n.node.clone()).collect();
    println!("{}", hostlist(&best));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_names_are_slurm_safe() {
        assert_eq!(feature_name("imagenet", 3), "locus_imagenet_3");
        assert_eq!(feature_name("laion-5b.en", 12), "locus_laion_5b_en_12");
    }

    #[test]
    fn hostlists_compress_ranges_and_keep_padding() {
        let h = |v: &[&str]| hostlist(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(h(&["gpu01", "gpu02", "gpu03", "gpu07"]), "gpu[01-03,07]");
        assert_eq!(h(&["node9", "node10", "node11"]), "node[9-11]");
        assert_eq!(h(&["a1"]), "a1");
        assert_eq!(h(&["login", "gpu2", "gpu1"]), "login,gpu[1-2]");
    }

    #[test]
    fn only_locus_features_change() {
        let cur = vec!["h100".to_string(), "locus_old_1".to_string(), "ib".to_string()];
        let ours = BTreeSet::from(["locus_imagenet_3".to_string()]);
        assert_eq!(merge_features(&cur, &ours), ["h100", "ib", "locus_imagenet_3"]);
        assert_eq!(merge_features(&cur, &BTreeSet::new()), ["h100", "ib"]);
        // The two-quote feature an earlier version stored is cleaned up.
        let cur = vec!["\"\"".to_string(), "ib".to_string()];
        assert_eq!(merge_features(&cur, &BTreeSet::new()), ["ib"]);
    }
}
