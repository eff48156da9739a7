//! The overview page: `GET /` on the metadata service's HTTP port, the cluster at a glance
//! for an operator's browser — health, nodes, datasets and versions, where each dataset's
//! bytes are (dataset × node), repairs and backups.
//!
//! Server-rendered HTML with its style inline: no script, no build step, nothing fetched
//! from elsewhere. Every value that comes from the catalogue or a caller (names, origins,
//! labels, backup targets) goes through `esc`. With tokens configured it asks for a reader
//! token like the rest of the HTTP API — as `Authorization: Bearer`, or as the password of
//! HTTP Basic auth, which a browser asks for by itself (`WWW-Authenticate`).

use std::fmt::Write as _;

use locus_proto::human::{format_size, format_time_ms};
use locus_proto::pb;

use crate::catalog::{Catalog, CatalogError};
use crate::metrics::Metrics;

/// Datasets and nodes drawn in the residency map; the rest is counted, not drawn.
const MAP_DATASETS: usize = 40;
const MAP_NODES: usize = 64;
/// Rows of the datasets table (each reads its latest version's record).
const LIST_DATASETS: usize = 500;

/// HTML-escapes text for element content and quoted attributes.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// The group as this member sees it: (members with their roles, the leader's name).
pub type GroupView = (Vec<pb::GroupMember>, String);

/// Renders the page. `now_ms`: the time the page says it was made.
pub fn render(
    catalog: &Catalog,
    metrics: &Metrics,
    group: Option<GroupView>,
    now_ms: i64,
) -> Result<String, CatalogError> {
    let nodes = catalog.list_nodes()?;
    let datasets = catalog.list_datasets()?;
    let backups = catalog.list_backups()?;
    let up = nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Up as i32)
        .count();
    let capacity: u64 = nodes.iter().map(|n| n.capacity_bytes).sum();
    let used: u64 = nodes.iter().map(|n| n.used_bytes).sum();
    let under = metrics.shards_under_replicated.get();
    let lost = metrics.shards_lost.get();
    let last_backup = backups
        .iter()
        .filter(|(_, r)| !r.restored)
        .map(|(_, r)| r.recorded_at_ms)
        .max();

    let mut h = String::with_capacity(64 << 10);
    h.push_str(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>Locus</title><style>\
         body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}\
         h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}\
         table{border-collapse:collapse}td,th{padding:.25em .6em;border-bottom:1px solid #ddd;text-align:left}\
         td.n{text-align:right;font-variant-numeric:tabular-nums}\
         .ok{color:#176f2c}.bad{color:#b00020;font-weight:600}.warn{color:#8a5a00}\
         .map td{text-align:center;min-width:2.5em}\
         </style></head><body>",
    );
    let health = if lost > 0 {
        ("bad", format!("{lost} shard(s) with no live replica"))
    } else if up < nodes.len() {
        ("warn", format!("{} node(s) down", nodes.len() - up))
    } else if under > 0 {
        ("warn", format!("{under} shard(s) being repaired"))
    } else {
        ("ok", "healthy".to_string())
    };
    let _ = write!(
        h,
        "<h1>Locus cluster <code id=\"cluster\">{}</code></h1>\
         <p id=\"health\" class=\"{}\">{}</p><p>As of {} (UTC). Nodes up: <b id=\"nodes-up\">{up}</b> of \
         {}; capacity {}, used {}.</p>",
        esc(catalog.cluster_id()),
        health.0,
        esc(&health.1),
        esc(&format_time_ms(now_ms)),
        nodes.len(),
        format_size(capacity),
        format_size(used),
    );
    if let Some((members, leader)) = &group {
        h.push_str("<h2>Metadata group</h2><table id=\"group\"><tr><th>member</th><th>raft address</th><th>role</th></tr>");
        for m in members {
            let role = if m.name == *leader {
                "leader"
            } else {
                m.role.as_str()
            };
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&m.name),
                esc(&m.raft_address),
                esc(role)
            );
        }
        h.push_str("</table>");
        if leader.is_empty() {
            h.push_str("<p class=\"bad\">No leader: nothing can be imported, deleted or repaired.</p>");
        }
    }

    h.push_str(
        "<h2>Nodes</h2><table id=\"nodes\"><tr><th>node</th><th>state</th><th>host</th><th>rack</th>\
         <th>zone</th><th>capacity</th><th>used</th><th>pinned</th><th>blobs</th><th>refill</th>\
         <th>quarantined</th></tr>",
    );
    for n in &nodes {
        let state = if n.state == pb::NodeState::Up as i32 {
            if n.draining {
                ("warn", "draining")
            } else {
                ("ok", "up")
            }
        } else {
            ("bad", "down")
        };
        let refill = if n.refill_blobs == 0 {
            "—".to_string()
        } else {
            format!(
                "{} blobs, {} to go{}",
                n.refill_blobs,
                format_size(n.refill_bytes),
                if n.refill_failing > 0 {
                    format!(", {} failing", n.refill_failing)
                } else {
                    String::new()
                }
            )
        };
        let label = |k: &str| esc(n.labels.get(k).map_or("", String::as_str));
        let _ = write!(
            h,
            "<tr data-node=\"{id}\"><td>{id}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td>{}</td><td class=\"n\">{}</td></tr>",
            state.0,
            state.1,
            label("host"),
            label("rack"),
            label("zone"),
            format_size(n.capacity_bytes),
            format_size(n.used_bytes),
            format_size(n.pinned_bytes),
            n.blobs,
            esc(&refill),
            n.quarantined,
            id = esc(&n.id),
        );
    }
    h.push_str("</table>");

    h.push_str(
        "<h2>Datasets</h2><table id=\"datasets\"><tr><th>dataset</th><th>versions</th><th>latest</th>\
         <th>files</th><th>bytes (latest)</th><th>origin</th><th>committed</th></tr>",
    );
    let mut latest: Vec<(String, pb::Version)> = Vec::new();
    for d in datasets.iter().take(LIST_DATASETS) {
        let v = if d.latest == 0 {
            None
        } else {
            let r: locus_proto::DatasetRef = format!("{}@{}", d.name, d.latest)
                .parse()
                .map_err(|e: locus_proto::InvalidInput| CatalogError::Invalid(e))?;
            catalog.get_version(&r).ok()
        };
        let _ = write!(
            h,
            "<tr data-dataset=\"{name}\"><td>{name}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>",
            d.version_count,
            d.latest,
            name = esc(&d.name)
        );
        match &v {
            Some(v) => {
                let _ = write!(
                    h,
                    "<td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td></tr>",
                    v.files,
                    format_size(v.bytes),
                    esc(&v.origin),
                    esc(&format_time_ms(v.created_at_ms))
                );
                latest.push((d.name.clone(), v.clone()));
            }
            None => h.push_str("<td></td><td></td><td></td><td></td></tr>"),
        }
    }
    h.push_str("</table>");
    if datasets.len() > LIST_DATASETS {
        let _ = write!(
            h,
            "<p>Showing {LIST_DATASETS} of {} datasets; `locus dataset ls` lists them all.</p>",
            datasets.len()
        );
    }

    // Where each dataset's latest version is: the share of its bytes on each node.
    h.push_str("<h2>Where the bytes are (latest versions)</h2>");
    if latest.is_empty() || nodes.is_empty() {
        h.push_str("<p>Nothing yet.</p>");
    } else {
        let shown_nodes: Vec<&pb::Node> = nodes.iter().take(MAP_NODES).collect();
        h.push_str("<table class=\"map\" id=\"residency\"><tr><th></th>");
        for n in &shown_nodes {
            let _ = write!(h, "<th>{}</th>", esc(&n.id));
        }
        h.push_str("</tr>");
        for (name, v) in latest.iter().take(MAP_DATASETS) {
            let r: locus_proto::DatasetRef = format!("{name}@{}", v.version)
                .parse()
                .map_err(|e: locus_proto::InvalidInput| CatalogError::Invalid(e))?;
            let ids: Vec<String> = shown_nodes.iter().map(|n| n.id.clone()).collect();
            let loc = catalog.locality(
                std::slice::from_ref(&r),
                None,
                &[],
                &ids,
                &Default::default(),
                (usize::MAX, false),
            )?;
            let _ = write!(h, "<tr><th>{}@{}</th>", esc(name), v.version);
            for n in &shown_nodes {
                let f = loc
                    .nodes
                    .iter()
                    .find(|l| l.node == n.id)
                    .map_or(0.0, |l| l.resident_fraction);
                // Shade by share, so the map reads at a glance.
                let _ = write!(
                    h,
                    "<td data-node=\"{}\" data-fraction=\"{f:.4}\" style=\"background:rgba(23,111,44,{:.2})\">{}</td>",
                    esc(&n.id),
                    f * 0.8,
                    if f > 0.0 {
                        format!("{:.0}%", f * 100.0)
                    } else {
                        String::new()
                    }
                );
            }
            h.push_str("</tr>");
        }
        h.push_str("</table>");
        if latest.len() > MAP_DATASETS || nodes.len() > MAP_NODES {
            let _ = write!(
                h,
                "<p>Showing {} of {} datasets and {} of {} nodes; `locus locality DATASET` ranks every node.</p>",
                latest.len().min(MAP_DATASETS),
                latest.len(),
                shown_nodes.len(),
                nodes.len()
            );
        }
    }

    let ok = metrics
        .repairs
        .get_or_create(&crate::metrics::ReasonLabel { reason: "ok".into() })
        .get();
    let failed = metrics
        .repairs
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: "failed".into(),
        })
        .get();
    let _ = write!(
        h,
        "<h2>Repairs</h2><p id=\"repairs\">Shards below their replication: <b>{under}</b>; with no live \
         replica: <b class=\"{}\">{lost}</b>. Since this service started: {ok} repaired, {failed} failed \
         ({} copied).</p>",
        if lost > 0 { "bad" } else { "ok" },
        format_size(metrics.repair_bytes.get()),
    );

    h.push_str("<h2>Backups</h2>");
    match last_backup {
        Some(t) => {
            let _ = write!(
                h,
                "<p>Last committed backup: {} ({} ago).</p>",
                esc(&format_time_ms(t)),
                esc(&ago((now_ms - t).max(0) / 1000))
            );
        }
        None => h.push_str("<p class=\"warn\">No backup has been committed.</p>"),
    }
    if !backups.is_empty() {
        h.push_str("<table id=\"backups\"><tr><th>target</th><th>snapshot</th><th>when</th><th></th></tr>");
        let mut recent = backups.clone();
        recent.sort_by_key(|(_, r)| std::cmp::Reverse(r.recorded_at_ms));
        for (target, r) in recent.iter().take(10) {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(target),
                esc(&r.snapshot),
                esc(&format_time_ms(r.recorded_at_ms)),
                if r.restored { "restored from" } else { "" }
            );
        }
        h.push_str("</table>");
    }
    h.push_str("</body></html>\n");
    Ok(h)
}

fn ago(secs: i64) -> String {
    match secs {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} days", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_every_character_that_opens_markup() {
        assert_eq!(
            esc(r#"<img src=x onerror="alert('1')">&"#),
            "&lt;img src=x onerror=&quot;alert(&#39;1&#39;)&quot;&gt;&amp;"
        );
        assert_eq!(esc("imagenet@3"), "imagenet@3");
    }
}
