//! What ships under deploy/monitoring is checked against the real thing: the alert rules
//! by promtool (syntax, and a unit test per alert that makes it fire), the
//! PrometheusRule against the rules file it is made from, the dashboard's queries by
//! PromQL's parser, the runbook lines' commands against the CLI, and every metric the rules
//! and the dashboard name against what real daemons export on /metrics.

use locus_testkit as support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use support::*;

fn monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(monitoring().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Runs promtool; a machine without it fails the test with the way to get it.
fn promtool(args: &[&str], dir: &Path) -> std::process::Output {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool: {e} (install it: apt-get install prometheus; scripts/setup-debian.sh does)")
        });
    assert!(
        out.status.success(),
        "promtool {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The alert names in a rules file (`- alert: NAME`).
fn alerts(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn alert_rules_pass_promtool_and_every_alert_has_a_unit_test_where_it_fires() {
    let dir = monitoring();
    promtool(&["check", "rules", "locus-alerts.yml"], &dir);
    promtool(&["test", "rules", "locus-alerts.test.yml"], &dir);
    // promtool passes a test file that leaves an alert out; so every alert must appear in
    // a case that expects it to fire (an `exp_alerts` list that is not empty).
    let rules = read("locus-alerts.yml");
    let tests = read("locus-alerts.test.yml");
    let names = alerts(&rules);
    assert!(names.len() >= 15, "{names:?}");
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for name in &names {
        let fires = lines.windows(3).any(|w| {
            w[0] == format!("alertname: {name}") && w[1] == "exp_alerts:" && w[2].starts_with("- exp_labels")
        });
        assert!(fires, "no unit test makes {name} fire");
    }
    // Each alert says what is wrong and what to run.
    for block in rules.split("- alert: ").skip(1) {
        let name = block.lines().next().unwrap_or_default();
        for key in ["summary:", "description:", "runbook:", "severity:"] {
            assert!(block.contains(key), "{name} has no {key}");
        }
        let runbook = block
            .lines()
            .find(|l| l.trim().starts_with("runbook:"))
            .unwrap_or_default();
        assert!(
            runbook.contains("`locus "),
            "{name}'s runbook names no locus command: {runbook}"
        );
    }
}

/// What scripts/monitoring.sh writes: the rules file's groups under `spec:`.
#[test]
fn the_prometheus_rule_is_the_rules_file_under_spec() {
    let rules = read("locus-alerts.yml");
    let groups = &rules[rules.find("\ngroups:").expect("a groups: key") + 1..];
    let mut want = String::new();
    for l in groups.lines() {
        want.push_str("  ");
        want.push_str(l);
        want.push('\n');
    }
    let got = read("prometheus-rule.yaml");
    assert!(got.contains("kind: PrometheusRule"), "{got}");
    let spec = &got[got.find("\nspec:\n").expect("a spec: key") + "\nspec:\n".len()..];
    assert_eq!(
        spec, want,
        "prometheus-rule.yaml is stale: run scripts/monitoring.sh"
    );
}

/// Every backticked `locus …` command in the runbooks exists (its --help succeeds).
#[test]
fn every_runbook_command_exists() {
    let rules = read("locus-alerts.yml");
    let mut commands = BTreeSet::new();
    for piece in rules.split('`').skip(1).step_by(2) {
        if let Some(rest) = piece.strip_prefix("locus ") {
            // The subcommand words, up to the first option or placeholder.
            let words: Vec<&str> = rest
                .split_whitespace()
                .take_while(|w| !w.starts_with('-') && !w.chars().all(|c| c.is_ascii_uppercase()))
                .collect();
            commands.insert(words.join(" "));
        }
    }
    assert!(commands.len() >= 10, "{commands:?}");
    for c in &commands {
        let out = Command::new(locus())
            .args(c.split_whitespace())
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "`locus {c}` named in a runbook does not exist: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(rules.contains("`locus metadata serve --join`"));
    let serve = Command::new(locus())
        .args(["metadata", "serve", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&serve.stdout).contains("--join"));
}

/// The dashboard's queries, with its variables at their widest, as recording rules:
/// promtool parses every one.
#[test]
fn every_dashboard_query_parses() {
    let dash: serde_json::Value = serde_json::from_str(&read("grafana-dashboard.json")).unwrap();
    let exprs = dashboard_exprs(&dash);
    assert!(exprs.len() >= 30, "{}", exprs.len());
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let e = ["$metadata_job", "$node_job", "$mount_job", "$node", "$mount"]
            .iter()
            .fold(e.clone(), |e, v| e.replace(v, ".*"));
        rules.push_str(&format!(
            "      - record: dashboard_query_{i}\n        expr: {}\n",
            serde_json::to_string(&e).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dashboard.yml"), rules).unwrap();
    promtool(&["check", "rules", "dashboard.yml"], dir.path());
}

fn dashboard_exprs(dash: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    out
}

/// The `locus_…` metric names a text mentions.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("locus_") {
        let start = i + at;
        let ok_before = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_') {
            end += 1;
        }
        if ok_before {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// The sample names an exposition declares: a gauge `x` is `x`; a counter `x` is
/// `x_total`; a histogram `x` is `x_bucket`, `x_sum` and `x_count` (from the `# TYPE`
/// lines). A labelled family shows only once it has a series, which is why the daemons
/// create their known label values at start.
fn exported(exposition: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in exposition.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut it = rest.split_whitespace();
        let (Some(name), Some(kind)) = (it.next(), it.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                out.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["bucket", "sum", "count"] {
                    out.insert(format!("{name}_{s}"));
                }
            }
            _ => {
                out.insert(name.to_string());
            }
        }
    }
    out
}

fn missing(wanted: &BTreeSet<String>, have: &BTreeSet<String>) -> Vec<String> {
    wanted.difference(have).cloned().collect()
}

#[test]
fn the_metric_check_reports_a_name_no_daemon_exports() {
    let have = exported(
        "# TYPE locus_node_corrupt counter\n# TYPE locus_node_blobs gauge\n# TYPE locus_mount_read_seconds histogram\n",
    );
    let rules = "expr: increase(locus_node_corrupt_total[5m]) > 0 or locus_node_no_such_thing > 1\n\
                 expr: histogram_quantile(0.9, rate(locus_mount_read_seconds_bucket[5m])) and locus_node_blobs";
    assert_eq!(
        missing(&metric_names(rules), &have),
        vec!["locus_node_no_such_thing".to_string()]
    );
    assert!(
        !have.contains("locus_node_corrupt"),
        "a counter is exported as _total"
    );
}

/// Scrapes an HTTPS /metrics with the cluster CA.
fn scrape_tls(addr: std::net::SocketAddr, ca: &Path) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--fail", "--cacert"])
        .arg(ca)
        .arg(format!("https://{addr}/metrics"))
        .output()
        .expect("curl (scripts/setup-debian.sh installs it)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Real daemons as an operator runs them — a three-member metadata group with TLS, a
/// node with TLS, a mount serving metrics — scraped: every metric name in the rules and
/// the dashboard is one of theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_name_is_exported_by_real_daemons() {
    let h = Harness::new("monitoring");
    let ms = h
        .start_group(
            "meta",
            3,
            MetadataOpts {
                tls: true,
                ..Default::default()
            },
        )
        .await;
    let l = group_leader(&ms).await;
    let node = h
        .start_node(
            "n1",
            &ms[l],
            NodeOpts {
                tls: true,
                ..NodeOpts::host(1)
            },
        )
        .await;
    let src = h.path("src");
    make_tree(&src, 10);
    let out = import(&ms[l], "ds", &src, &["--replicas", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let port = free_low_port();
    let addr = format!("127.0.0.1:{port}");
    let mnt = ms[l].mount("mnt", "ds", Some(&node), &["--metrics-listen", &addr]);
    for (rel, _) in nonempty_files(&src).iter().take(3) {
        std::fs::read(mnt.path.join(rel)).unwrap();
    }

    let ca = ms[l].dir.join("ca.pem");
    let mut have = BTreeSet::new();
    for m in &ms {
        have.extend(exported(&scrape_tls(m.http, &ca)));
    }
    have.extend(exported(&scrape_tls(node.http, &ca)));
    have.extend(exported(&http_get(addr.parse().unwrap(), "/metrics").await));

    let rules = read("locus-alerts.yml");
    let dash: serde_json::Value = serde_json::from_str(&read("grafana-dashboard.json")).unwrap();
    let mut wanted = metric_names(&rules);
    for e in dashboard_exprs(&dash) {
        wanted.extend(metric_names(&e));
    }
    assert!(wanted.len() >= 30, "{wanted:?}");
    assert_eq!(
        missing(&wanted, &have),
        Vec::<String>::new(),
        "named by the rules or the dashboard, exported by no daemon"
    );
    // The certificate's expiry is the one the service serves with.
    let scraped = scrape_tls(ms[l].http, &ca);
    let expiry: i64 = scraped
        .lines()
        .find_map(|l| l.strip_prefix("locus_metadata_tls_cert_expiry_timestamp_seconds "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the expiry gauge has a value");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        expiry > now + 86_400,
        "the test certificate expires in the future: {expiry}"
    );
}
