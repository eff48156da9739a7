//! The audit log records refused calls, and a flood of them cannot fill it: every refusal
//! is either written or counted in a later line.

use locus_testkit as support;

use futures_util::StreamExt;
use locus_proto::pb;
use support::*;

fn lines(m: &Metadata) -> Vec<serde_json::Value> {
    std::fs::read_to_string(m.data_dir.join("audit.log"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("an audit line is JSON"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_calls_are_audited_and_a_flood_of_them_is_counted_not_written() {
    let h = Harness::new("audit-refused");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let mut reader = m.client(Some("reader")).await;
    let e = reader
        .begin_version(pb::BeginVersionRequest {
            dataset: "ds".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied);
    let audit = lines(&m);
    let denied = audit
        .iter()
        .find(|l| l["action"] == "refused" && l["reason"] == "denied")
        .expect("the denial is audited");
    assert!(
        denied["target"].as_str().unwrap().ends_with("/BeginVersion"),
        "{denied}"
    );
    assert!(
        denied["detail"]
            .as_str()
            .unwrap()
            .contains("trainer (role reader)"),
        "the line names who was refused: {denied}"
    );

    // A flood with a made-up token.
    let opts = m.client_options(Some("not-a-token-of-this-cluster".into()));
    let bad = locus_proto::client::connect(&opts).await.unwrap();
    const FLOOD: usize = 2000;
    let mut calls = futures_util::stream::iter((0..FLOOD).map(|_| {
        let mut c = bad.clone();
        async move { c.list_datasets(pb::ListDatasetsRequest::default()).await }
    }))
    .buffer_unordered(32);
    while let Some(r) = calls.next().await {
        assert_eq!(r.unwrap_err().code(), tonic::Code::Unauthenticated);
    }
    // One more refusal in a later second writes the count of those left out.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let e = bad
        .clone()
        .list_datasets(pb::ListDatasetsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);

    let audit = lines(&m);
    let written = audit
        .iter()
        .filter(|l| l["action"] == "refused" && l["reason"] == "bad_token")
        .count();
    let counted: u64 = audit
        .iter()
        .filter(|l| l["action"] == "refused.not-written")
        .map(|l| l["count"].as_u64().unwrap())
        .sum();
    assert!(
        written < FLOOD,
        "all {written} refusals of the flood were written: nothing throttled them"
    );
    assert_eq!(
        written as u64 + counted,
        FLOOD as u64 + 1,
        "every refusal is written or counted ({written} written, {counted} counted)"
    );
}
