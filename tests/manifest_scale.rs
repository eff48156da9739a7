//! A 1,000,000-entry manifest goes through the real service: uploaded in pages that stay
//! under the message-size limit, committed atomically, listed back in pages, whole and by
//! directory. (Timings are measured by `cargo bench --bench manifest_1m`, not here.)

use locus_testkit as support;

use locus_proto::pb;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_entry_manifest_commits_and_lists_in_pages() {
    let files: usize = std::env::var("LOCUS_SCALE_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let h = Harness::new("scale");
    let m = h.start_metadata("meta", MetadataOpts::default()).await;
    let mut c = m.client(None).await;
    // 1000 files per directory, 10,000 files per shard, 4 MiB chunks.
    let (entries, shards) = synthetic_manifest("s", files, 1000, 10_000, 1 << 22);
    let total = entries.len();
    assert!(total >= files);
    let v = commit(&mut c, "big", 1 << 22, entries, shards).await.unwrap();
    assert_eq!(v.files as usize, files);
    assert_eq!(v.dirs as usize, total - files);

    // The whole manifest, page by page (10,000 per page, no chunk lists).
    let r = pb::VersionRef {
        dataset: "big".into(),
        version: v.version,
    };
    let mut token = Vec::new();
    let mut seen = 0usize;
    let mut pages = 0usize;
    let mut last_path = String::new();
    loop {
        let resp = c
            .list_entries(pb::ListEntriesRequest {
                r#ref: Some(r.clone()),
                directory: None,
                page_token: token,
                limit: 10_000,
                without_chunks: true,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        seen += resp.entries.len();
        if let Some(e) = resp.entries.last() {
            last_path = e.path.clone();
        }
        if resp.next_page_token.is_empty() {
            break;
        }
        token = resp.next_page_token;
    }
    assert_eq!(seen, total, "every entry listed exactly once");
    assert_eq!(pages, total.div_ceil(10_000));
    assert!(last_path.starts_with("top/d"), "{last_path}");

    // One directory, with its chunk hashes, matches what was sent.
    let (_, dir) = locus_proto::client::list_all_entries(&mut c, r.clone(), Some("top/d00042".into()), false)
        .await
        .unwrap();
    let want_dir = if files > 42_000 { 1000 } else { 0 };
    assert_eq!(dir.len(), want_dir);
    let (expect, _) = synthetic_manifest("s", files.min(43_000), 1000, 10_000, 1 << 22);
    let expect: Vec<_> = sorted(expect)
        .into_iter()
        .filter(|e| e.path.starts_with("top/d00042/"))
        .collect();
    assert_eq!(sorted(dir), expect);
}
