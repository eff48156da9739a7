//! The Python sampler (`python/locus_sampler`) against a real metadata service's
//! `POST /v1/assign`: every sample once, equal counts, and ranks reading from their own
//! node, against DistributedSampler's order for the same job.

use locus_testkit as support;

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sampler_reads_each_ranks_own_shards_and_every_sample_once() {
    let h = Harness::new("sampler");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let _nodes = [
        h.start_node("n1", &m, NodeOpts::host(1)).await,
        h.start_node("n2", &m, NodeOpts::host(2)).await,
    ];
    let src = h.path("src");
    make_tree(&src, 200);
    let o = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // No token: 401. A bad request: 400 with the reason.
    let body = r#"{"dataset":"ds@1","rank_nodes":["n1"]}"#;
    let (code, _) = try_http_request(m.http, "POST", "/v1/assign", &[], body)
        .await
        .unwrap();
    assert_eq!(code, 401);
    let auth = format!("Bearer {}", m.token("reader").unwrap());
    let hdr = [("authorization", auth.as_str())];
    let (code, text) = try_http_request(m.http, "POST", "/v1/assign", &hdr, r#"{"dataset":"ds@1"}"#)
        .await
        .unwrap();
    assert!(code == 400 && text.contains("rank_nodes"), "{code} {text}");
    let (code, text) = try_http_request(
        m.http,
        "POST",
        "/v1/assign",
        &hdr,
        r#"{"dataset":"nope@1","rank_nodes":["n1"]}"#,
    )
    .await
    .unwrap();
    assert_eq!(code, 404, "{text}");

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/e2e_assign.py");
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script)
        .arg(format!("http://{}", m.http))
        .arg("ds@1")
        .arg(&src)
        .arg("n1,n2,n1,n2");
    match m.token("reader") {
        Some(t) => cmd.env("LOCUS_TOKEN", t),
        None => cmd.env_remove("LOCUS_TOKEN"),
    };
    let o = cmd.output().expect("python3");
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("sampler scores: {v}");
    for k in ["locus", "distributed"] {
        assert_eq!(v[k]["covered"], true, "{k}: {v}");
        assert_eq!(v[k]["equal"], true, "{k}: {v}");
    }
    let (locus, plain) = (
        v["locus"]["local_byte_share"].as_f64().unwrap(),
        v["distributed"]["local_byte_share"].as_f64().unwrap(),
    );
    // Two nodes: DistributedSampler reads about half the bytes locally; the Locus
    // sampler all but what balancing the counts moves (the smallest samples).
    assert!(
        locus >= 0.95,
        "the Locus sampler read {locus} of the bytes locally: {v}"
    );
    assert!(
        plain < 0.7,
        "DistributedSampler's order read {plain} of the bytes locally: {v}"
    );
}
