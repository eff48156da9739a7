//! `locus metadata audit`: reads the metadata service's audit log (JSON lines, on the
//! service's host) and answers the operator's questions of it — who mounted a dataset
//! last month, what a token was refused, what an admin deleted — without a JSON tool.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  # Who mounted imagenet in the last 30 days, from which hosts
  locus metadata audit --data-dir /var/lib/locus/metadata --dataset imagenet --action mount --since 30d
  # What team-a's tokens were refused today
  locus metadata audit --data-dir /var/lib/locus/metadata --who team-a --refused --since 1d
  # Every deletion, as JSON lines
  locus metadata audit --file /var/lib/locus/metadata/audit.log --action version.delete --json")]
pub struct AuditArgs {
    /// The metadata service's data dir (its audit log is DATA_DIR/audit.log).
    #[arg(long, value_name = "DIR", conflicts_with = "file")]
    pub data_dir: Option<PathBuf>,
    /// The audit log itself (the service's --audit-log).
    #[arg(long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Only lines about this dataset (any version of it).
    #[arg(long, value_name = "NAME")]
    pub dataset: Option<String>,
    /// Only lines of this principal (a token's name).
    #[arg(long, value_name = "NAME")]
    pub who: Option<String>,
    /// Only actions starting with this (`mount`, `version.delete`, `grant`, `refused`, …).
    #[arg(long, value_name = "PREFIX")]
    pub action: Option<String>,
    /// Only lines this recent (`30d`, `12h`).
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// Only refusals (the auth layer's and tokens' dataset scopes).
    #[arg(long)]
    pub refused: bool,
    /// At most this many lines, the latest.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub limit: usize,
}

/// Whether the line's target names `dataset`: `NAME`, `NAME@N`, or a grant's `…/read`
/// does not (grants name nodes).
fn about(target: &str, dataset: &str) -> bool {
    target == dataset || target.strip_prefix(dataset).is_some_and(|r| r.starts_with('@'))
}

pub fn run(a: AuditArgs, json: bool) -> anyhow::Result<()> {
    let path = match (&a.file, &a.data_dir) {
        (Some(f), _) => f.clone(),
        (None, Some(d)) => d.join("audit.log"),
        (None, None) => anyhow::bail!(
            "give the metadata service's --data-dir (its audit log is DATA_DIR/audit.log) or the log's --file"
        ),
    };
    let since = match &a.since {
        Some(s) => {
            let d = crate::config::duration_arg("--since", s)?;
            let now = locus_proto::grant::now_ms() as i64;
            // The log's times are RFC 3339 in UTC with milliseconds: they sort as text.
            Some(locus_proto::human::format_time_ms(now - d.as_millis() as i64))
        }
        None => None,
    };
    let f = std::fs::File::open(&path)
        .with_context(|| format!("cannot read the audit log {}", path.display()))?;
    let mut kept: std::collections::VecDeque<serde_json::Value> = Default::default();
    let mut unreadable = 0u64;
    for line in std::io::BufReader::new(f).lines() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            unreadable += 1;
            continue;
        };
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("");
        if since.as_deref().is_some_and(|s| field("time") < s)
            || a.who.as_deref().is_some_and(|w| field("who") != w)
            || a.action
                .as_deref()
                .is_some_and(|p| !field("action").starts_with(p))
            || a.dataset.as_deref().is_some_and(|d| !about(field("target"), d))
            || (a.refused && field("result") != "refused")
        {
            continue;
        }
        if kept.len() == a.limit {
            kept.pop_front();
        }
        kept.push_back(v);
    }
    if unreadable > 0 {
        eprintln!(
            "{unreadable} line(s) of {} are not JSON and were skipped",
            path.display()
        );
    }
    if json {
        for v in &kept {
            println!("{v}");
        }
        return Ok(());
    }
    let s = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    let rows: Vec<Vec<String>> = kept
        .iter()
        .map(|v| {
            vec![
                s(v, "time"),
                s(v, "who"),
                s(v, "action"),
                s(v, "target"),
                s(v, "result"),
                s(v, "detail"),
            ]
        })
        .collect();
    crate::output::table(&["TIME", "WHO", "ACTION", "TARGET", "RESULT", "DETAIL"], &rows);
    // The question most asked of it: who mounted what, counted.
    let mut mounts: std::collections::BTreeMap<(String, String), u64> = Default::default();
    for v in kept.iter().filter(|v| s(v, "action") == "mount.start") {
        *mounts.entry((s(v, "target"), s(v, "who"))).or_default() += 1;
    }
    if !mounts.is_empty() {
        println!();
        for ((target, who), n) in mounts {
            println!("{target}: mounted {n} time(s) by {who}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dataset_filter_matches_the_dataset_and_its_versions_only() {
        assert!(super::about("imagenet", "imagenet"));
        assert!(super::about("imagenet@3", "imagenet"));
        assert!(!super::about("imagenet2@3", "imagenet"));
        assert!(!super::about("session 12", "imagenet"));
    }
}
