//! Locus with a real Slurm (Debian's slurm-wlm: slurmctld, one slurmd per test-bed
//! host): the feature sync, the cli_filter's `--prefer`, placement of a hinted job,
//! `nodelist` → `sbatch -w`, hints across `scontrol reconfigure`, and the burst-buffer
//! hook warming a job's node before it starts.

use locus_testkit as support;

use std::time::Duration;

use locus_proto::pb;
use support::*;

fn out(c: &mut std::process::Command) -> std::process::Output {
    c.output().expect("run a Slurm command")
}

/// Submits `args` as user nobody; the job id.
fn submit(s: &Slurm, args: &[&str]) -> String {
    let o = out(s.command_as_nobody("sbatch").arg("--parsable").args(args));
    assert!(o.status.success(), "sbatch {args:?}: {}", stderr(&o));
    stdout(&o).trim().split(';').next().unwrap().to_string()
}

fn prefer(s: &Slurm, job: &str) -> String {
    let o = out(s.command("squeue").args(["-h", "-j", job, "-O", "prefer"]));
    stdout(&o).trim().to_string()
}

/// Waits until the job has finished; its node list.
async fn finished(s: &Slurm, job: &str, within: Duration) -> String {
    wait_until(&format!("job {job} to finish"), within, || async {
        (s.show("job", job, "JobState").as_deref() == Some("COMPLETED"))
            .then(|| s.show("job", job, "NodeList").unwrap_or_default())
    })
    .await
}

async fn fraction_on(m: &Metadata, node: &str) -> f64 {
    let mut c = m.client(Some("admin")).await;
    let l = c
        .locality(pb::LocalityRequest {
            refs: vec![pb::VersionRef {
                dataset: "ds".into(),
                version: 1,
            }],
            nodes: vec![node.into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    l.nodes
        .iter()
        .find(|n| n.node == node)
        .map_or(0.0, |n| n.resident_fraction)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_real_slurm_hinted_jobs_land_on_their_data_and_the_burst_buffer_warms_the_rest() {
    let bed = Netbed::new(&[2]).expect("the test bed");
    let h = Harness::new("slurm-real");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    // Only n2 is up for the import, so it holds all of ds@1; n1 and n3 join after. n3
    // is a Locus node on a host Slurm does not know.
    let mut nodes = vec![h.start_node("n2", &m, NodeOpts::host(2)).await];
    let src = h.path("src");
    make_tree(&src, 30);
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    nodes.push(h.start_node("n1", &m, NodeOpts::host(1)).await);
    nodes.push(h.start_node("n3", &m, NodeOpts::host(3)).await);

    let ctld_env = vec![
        ("LOCUS_BIN".to_string(), locus().display().to_string()),
        ("LOCUS_METADATA".to_string(), m.url()),
        ("LOCUS_TOKEN".to_string(), m.token("admin").unwrap()),
    ];
    let s = Slurm::start(&h, &bed, &["n1", "n2"], &ctld_env);
    let slurm_env = [("SLURM_CONF", s.conf.display().to_string())];

    // Feature sync: n3 is skipped with a warning, the others are updated.
    let o = m.cli_env(&["slurm", "features"], &slurm_env);
    assert!(
        o.status.success(),
        "one node outside Slurm must not stop the sync: {}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("no node named n3"), "{}", stderr(&o));
    assert_eq!(
        s.show("node", "n2", "AvailableFeatures").as_deref(),
        Some("locus_ds_1")
    );
    assert_eq!(
        s.show("node", "n1", "AvailableFeatures").as_deref(),
        Some("(null)")
    );

    // The cli_filter prefers features some node has, and only those: Slurm refuses a
    // job whose --prefer names a feature no node has.
    let job = submit(&s, &["-H", "--comment=dataset:ds@1", "--wrap", "true"]);
    assert_eq!(prefer(&s, &job), "locus_ds_1");
    let job = submit(&s, &["-H", "--comment=dataset:nothere@9", "--wrap", "true"]);
    assert_eq!(
        prefer(&s, &job),
        "(null)",
        "a dataset no node holds adds no preference"
    );
    let job = submit(&s, &["-H", "--comment=dataset:ds@1,nothere@9", "--wrap", "true"]);
    assert_eq!(prefer(&s, &job), "locus_ds_1");

    // A hinted job runs where the data is.
    let job = submit(&s, &["--comment=dataset:ds@1", "--wrap", "true"]);
    assert_eq!(finished(&s, &job, Duration::from_secs(60)).await, "n2");

    // `locus slurm nodelist` feeds `sbatch -w`.
    let o = m.cli(&["slurm", "nodelist", "ds@1", "-N", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let best = stdout(&o).trim().to_string();
    assert_eq!(best, "n2");
    let job = submit(&s, &["-w", &best, "--wrap", "true"]);
    assert_eq!(finished(&s, &job, Duration::from_secs(60)).await, "n2");

    // `scontrol reconfigure` drops the synced features: a hinted job still runs (with no
    // preference) rather than being refused, and the next sync restores them.
    let o = out(s.command("scontrol").arg("reconfigure"));
    assert!(o.status.success(), "{}", stderr(&o));
    wait_until(
        "features dropped by reconfigure",
        Duration::from_secs(30),
        || async { (s.show("node", "n2", "AvailableFeatures").as_deref() == Some("(null)")).then_some(()) },
    )
    .await;
    let job = submit(&s, &["--comment=dataset:ds@1", "--wrap", "true"]);
    assert_eq!(prefer(&s, &job), "(null)");
    finished(&s, &job, Duration::from_secs(60)).await;
    let o = m.cli_env(&["slurm", "features"], &slurm_env);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        s.show("node", "n2", "AvailableFeatures").as_deref(),
        Some("locus_ds_1")
    );

    // The burst-buffer hook warms a job's node before the job starts.
    assert!(fraction_on(&m, "n1").await < 0.01, "n1 holds none of ds@1 yet");
    // The script on sbatch's stdin: user nobody submits it.
    let job = {
        use std::io::Write;
        let mut c = s
            .command_as_nobody("sbatch")
            .args(["--parsable", "-w", "n1"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin
            .take()
            .unwrap()
            .write_all(b"#!/bin/sh\n#BB_LUA locus_dataset=ds@1\ntrue\n")
            .unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "sbatch: {}", stderr(&o));
        stdout(&o).trim().to_string()
    };
    // Burst-buffer jobs wait for the backfill scheduler (~20 s on Debian's defaults).
    assert_eq!(finished(&s, &job, Duration::from_secs(120)).await, "n1");
    assert!(
        fraction_on(&m, "n1").await > 0.99,
        "the hook did not warm n1; slurmctld log: {}",
        std::fs::read_to_string(s.dir.join("slurmctld.log")).unwrap_or_default()
    );

    // A node losing its last Locus feature is left with none (not a feature `""`).
    let o = m.cli(&["dataset", "rm", "ds", "--all-versions"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m.cli_env(&["slurm", "features"], &slurm_env);
    assert!(o.status.success(), "{}", stderr(&o));
    for n in ["n1", "n2"] {
        assert_eq!(
            s.show("node", n, "AvailableFeatures").as_deref(),
            Some("(null)"),
            "{n} keeps a feature after its last dataset went"
        );
    }
}
