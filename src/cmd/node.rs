//! `locus node …`: the cluster's cache nodes as the metadata service sees them.

use clap::Subcommand;
use locus_proto::pb;

use crate::config::Resolved;
use crate::output::{self, StatusExt};

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// List registered nodes with state, labels and space.
    List,
}

pub async fn run(cmd: NodeCmd, cfg: &Resolved) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::List => list(cfg).await,
    }
}

pub fn state_name(state: i32) -> &'static str {
    match pb::NodeState::try_from(state) {
        Ok(pb::NodeState::Up) => "up",
        Ok(pb::NodeState::Down) => "down",
        _ => "unknown",
    }
}

pub fn node_json(n: &pb::Node) -> serde_json::Value {
    serde_json::json!({
        "id": n.id,
        "address": n.address,
        "state": state_name(n.state),
        "labels": n.labels,
        "capacity_bytes": n.capacity_bytes,
        "used_bytes": n.used_bytes,
        "free_bytes": n.free_bytes,
        "last_seen_ms_ago": n.last_seen_ms_ago,
        "registered_at": output::time(n.registered_at_ms),
    })
}

async fn list(cfg: &Resolved) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let mut nodes = c.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
    nodes.sort_by(|a, b| a.id.cmp(&b.id));
    if cfg.json {
        return output::json(&nodes.iter().map(node_json).collect::<Vec<_>>());
    }
    let label = |n: &pb::Node, k: &str| n.labels.get(k).cloned().unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            vec![
                n.id.clone(),
                state_name(n.state).into(),
                n.address.clone(),
                label(n, "zone"),
                label(n, "rack"),
                label(n, "host"),
                output::size(n.capacity_bytes),
                output::size(n.used_bytes),
                output::size(n.free_bytes),
                format!("{:.1}s ago", n.last_seen_ms_ago as f64 / 1000.0),
            ]
        })
        .collect();
    output::table(
        &[
            "NODE", "STATE", "ADDRESS", "ZONE", "RACK", "HOST", "CAPACITY", "USED", "FREE", "SEEN",
        ],
        &rows,
    );
    Ok(())
}
