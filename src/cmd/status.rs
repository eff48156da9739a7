//! `locus status`: the cluster on one screen.

use locus_proto::pb;

use crate::config::Resolved;
use crate::output::{self, StatusExt};

pub async fn run(cfg: &Resolved) -> anyhow::Result<()> {
    let mut c = cfg.connect().await?;
    let info = c
        .get_cluster_info(pb::GetClusterInfoRequest {})
        .await
        .or_status()?;
    let nodes = c.list_nodes(pb::ListNodesRequest {}).await.or_status()?.nodes;
    let datasets = c
        .list_datasets(pb::ListDatasetsRequest {})
        .await
        .or_status()?
        .datasets;
    let up: Vec<_> = nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Up as i32)
        .collect();
    let capacity: u64 = up.iter().map(|n| n.capacity_bytes).sum();
    let free: u64 = up.iter().map(|n| n.free_bytes).sum();
    let versions: u64 = datasets.iter().map(|d| d.version_count).sum();
    let bytes: u64 = datasets.iter().map(|d| d.bytes).sum();
    // This host's mounts of this cluster (the runtime dir may hold others').
    let mounts: Vec<_> = crate::cmd::mount::statuses()
        .into_iter()
        .filter(|m| m.cluster_id.is_empty() || m.cluster_id == info.cluster_id)
        .collect();
    let backups = c
        .list_backups(pb::ListBackupsRequest {})
        .await
        .or_status()?
        .backups;
    if cfg.json {
        return output::json(&serde_json::json!({
            "metadata": {
                "url": cfg.metadata_url,
                "cluster_id": info.cluster_id,
                "server_version": info.server_version,
                "schema_version": info.schema_version,
                "uptime_ms": info.uptime_ms,
                "open_import_sessions": info.open_sessions,
                "caller": {"name": info.caller_name, "role": info.caller_role,
                           "scope": (!info.caller_scope.is_empty()).then_some(&info.caller_scope)},
                // A replicated group as the member that answered sees it; absent for a
                // single service.
                "group": (!info.members.is_empty()).then(|| serde_json::json!({
                    "answered_by": info.member,
                    "leader": (!info.leader.is_empty()).then_some(&info.leader),
                    "members": info.members.iter().map(|m| serde_json::json!({
                        "name": m.name, "raft_address": m.raft_address, "role": m.role,
                        "leader": m.name == info.leader,
                    })).collect::<Vec<_>>(),
                })),
            },
            "nodes": {"total": nodes.len(), "up": up.len(), "down": nodes.len() - up.len(),
                      "capacity_bytes": capacity, "free_bytes": free,
                      "refilling": nodes.iter().filter(|n| n.refill_blobs > 0).map(|n| serde_json::json!({
                          "id": n.id, "blobs": n.refill_blobs, "bytes": n.refill_bytes,
                          "rate_bytes_per_second": n.refill_rate, "failing": n.refill_failing,
                      })).collect::<Vec<_>>()},
            "datasets": {"count": datasets.len(), "versions": versions, "bytes": bytes},
            "teams": info.teams.iter().map(|t| serde_json::json!({
                "name": t.name, "datasets": t.datasets,
                "pinned_bytes": t.pinned_bytes, "pinned_limit_bytes": t.pinned_limit_bytes,
                "cached_bytes": t.cached_bytes,
            })).collect::<Vec<_>>(),
            "mounts": mounts,
            "backups": backups.iter().map(|b| serde_json::json!({
                "url": b.url, "snapshot": b.snapshot, "recorded_at_ms": b.recorded_at_ms,
                "restored_from": b.restored,
            })).collect::<Vec<_>>(),
        }));
    }
    println!(
        "metadata   {} (cluster {}, v{}, up {:.0}s)",
        cfg.metadata_url,
        info.cluster_id,
        info.server_version,
        info.uptime_ms as f64 / 1000.0
    );
    if !info.members.is_empty() {
        let members: Vec<String> = info
            .members
            .iter()
            .map(|m| {
                let mut s = format!("{} {}", m.name, m.raft_address);
                if m.name == info.leader {
                    s.push_str(" leader");
                } else if m.role == "learner" {
                    s.push_str(" learner");
                }
                s
            })
            .collect();
        let leader = if info.leader.is_empty() {
            "no leader right now".to_string()
        } else {
            format!("leader {}", info.leader)
        };
        println!(
            "group      {} members, {leader} (answered by {}): {}",
            info.members.len(),
            info.member,
            members.join(", ")
        );
    }
    match info.caller_scope.as_str() {
        "" => println!("you        {} (role {})", info.caller_name, info.caller_role),
        scope => println!(
            "you        {} (role {}, narrowed to datasets {scope})",
            info.caller_name, info.caller_role
        ),
    }
    println!(
        "nodes      {} up, {} down; {} free of {} on live nodes",
        up.len(),
        nodes.len() - up.len(),
        output::size(free),
        output::size(capacity)
    );
    for n in nodes.iter().filter(|n| n.state != pb::NodeState::Up as i32) {
        println!(
            "  down: {} ({}), last seen {:.0}s ago",
            n.id,
            n.address,
            n.last_seen_ms_ago as f64 / 1000.0
        );
    }
    for n in &nodes {
        if let Some(r) = crate::cmd::node::refill_summary(n) {
            println!("  refilling: {}, {r}", n.id);
        }
    }
    println!(
        "datasets   {} with {} versions, {}",
        datasets.len(),
        versions,
        output::size(bytes)
    );
    for t in &info.teams {
        println!(
            "team       {}: {} pinned of {} allowed ({:.0}%), {} cached on nodes up, datasets {}",
            t.name,
            output::size(t.pinned_bytes),
            output::size(t.pinned_limit_bytes),
            100.0 * t.pinned_bytes as f64 / t.pinned_limit_bytes.max(1) as f64,
            output::size(t.cached_bytes),
            t.datasets.join(", ")
        );
    }
    let quarantined: u64 = nodes.iter().map(|n| n.quarantined).sum();
    if quarantined > 0 {
        println!("integrity  {quarantined} blob(s) failed verification and were quarantined (see `locus node list --json`)");
    }
    if backups.is_empty() {
        println!("backups    none recorded (locus backup run --to URL)");
    }
    for b in &backups {
        if b.snapshot.is_empty() {
            // Recorded when a run began; none has committed there yet.
            println!(
                "backup     {}: no committed snapshot yet (a run began {})",
                b.url,
                output::time(b.recorded_at_ms)
            );
            continue;
        }
        println!(
            "backup     {}: {} snapshot {} at {}",
            b.url,
            if b.restored { "restored from" } else { "last" },
            b.snapshot,
            output::time(b.recorded_at_ms)
        );
    }
    if info.open_sessions > 0 {
        println!("imports    {} in progress", info.open_sessions);
    }
    for m in &mounts {
        let t = &m.totals;
        let opens = t.opens_passthrough + t.opens_local + t.opens_remote;
        // Files the kernel opens by itself reach the mount only when their pages are
        // missing, so what is counted then is files first read, not opens.
        let opens = if m.kernel_opens {
            format!(
                "opened by the kernel, {opens} files read ({} local, {} remote)",
                t.opens_local, t.opens_remote
            )
        } else {
            format!(
                "{opens} opens ({} passthrough, {} local, {} remote)",
                t.opens_passthrough, t.opens_local, t.opens_remote
            )
        };
        println!(
            "mount      {}@{} at {} (pid {}{}): {opens}; \
             read {} local, {} remote, {} from origin, {} from memory; {} read errors{}",
            m.dataset,
            m.version,
            m.mountpoint.display(),
            m.pid,
            match (m.server_pid != 0 && m.server_pid != m.pid, m.transport.is_empty()) {
                (true, true) => format!(", server {}", m.server_pid),
                (true, false) => format!(", server {} via {}", m.server_pid, m.transport),
                (false, true) => String::new(),
                (false, false) => format!(", via {}", m.transport),
            },
            output::size(t.bytes_local),
            output::size(t.bytes_remote),
            output::size(t.bytes_origin),
            output::size(t.bytes_cache),
            t.read_errors,
            if t.corrupt_chunks > 0 {
                format!(", {} corrupt chunks refused", t.corrupt_chunks)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
