//! The overview page (`GET /` on the metadata service's HTTP port) in a real headless
//! browser (Debian's chromium): what it shows of a running cluster is checked against the
//! CLI's JSON, a hostile string in the catalogue is shown as text (never markup), the
//! page asks a browser for a token where the API does, and a screenshot is kept
//! (target/tmp/overview.png).

use locus_testkit as support;

use std::process::Command;

use serde_json::Value;
use support::*;

/// The page as chromium rendered it (the DOM after parsing), and a screenshot.
fn browse(url: &str, screenshot: &std::path::Path) -> String {
    let run = |extra: &[&str]| {
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1280,1400",
            ])
            .args(extra)
            .arg(url)
            .output()
            .unwrap_or_else(|e| {
                panic!("chromium: {e} (apt-get install chromium; scripts/setup-debian.sh does)")
            })
    };
    let dom = run(&["--dump-dom"]);
    assert!(dom.status.success(), "{}", String::from_utf8_lossy(&dom.stderr));
    let shot = format!("--screenshot={}", screenshot.display());
    let s = run(&[shot.as_str()]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    String::from_utf8(dom.stdout).unwrap()
}

fn json(o: &std::process::Output) -> Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_str(&stdout(o)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_page_shows_the_cluster_as_the_cli_does_and_escapes_what_it_shows() {
    let h = Harness::new("overview");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let _n1 = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let _n2 = h.start_node("n2", &m, NodeOpts::host(2)).await;
    // An import source whose path is markup: the version's origin names it.
    let src = h.path("src").join("<script>alert(1)<script>");
    make_tree(&src, 40);
    let out = import(&m, "ds", &src, &["--replicas", "1", "--shard-size", "64KiB"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // Without a token: 401, and a browser is asked for one.
    let (code, _) = http_request(m.http, "GET", "/", &[], "").await;
    assert_eq!(code, 401);
    let reader = m.token("reader").unwrap();
    let (code, body) = http_request(
        m.http,
        "GET",
        "/",
        &[("authorization", &format!("Bearer {reader}"))],
        "",
    )
    .await;
    assert_eq!(code, 200, "{body}");

    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("overview.png");
    let _ = std::fs::remove_file(&shot);
    // A browser sends Basic credentials; the token is the password.
    let dom = browse(&format!("http://reader:{reader}@{}/", m.http), &shot);
    assert!(dom.contains("id=\"nodes\""), "{dom}");
    assert!(
        std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0) > 10_000,
        "a screenshot at {}",
        shot.display()
    );

    // The hostile origin is text: escaped in the DOM, no element made of it.
    assert!(dom.contains("&lt;script&gt;alert(1)&lt;script&gt;"), "{dom}");
    assert!(
        !dom.contains("<script"),
        "markup from the catalogue became an element"
    );

    // The cluster as `locus status --json` sums it up, its nodes as `locus node list
    // --json` lists them.
    let status = json(&m.cli(&["status", "--json"]));
    let up = status["nodes"]["up"].as_u64().unwrap();
    assert_eq!(up, 2);
    assert!(
        dom.contains(&format!(
            "<b id=\"nodes-up\">{up}</b> of {}",
            status["nodes"]["total"]
        )),
        "{dom}"
    );
    let id = status["metadata"]["cluster_id"].as_str().unwrap();
    assert!(
        dom.contains(&format!("<code id=\"cluster\">{id}</code>")),
        "{dom}"
    );
    let list = json(&m.cli(&["node", "list", "--json"]));
    let nodes = list
        .as_array()
        .or_else(|| list["nodes"].as_array())
        .expect("node list");
    assert_eq!(nodes.len(), 2);
    for n in nodes {
        let id = n["id"].as_str().unwrap();
        let state = n["state"].as_str().unwrap_or_default().to_ascii_lowercase();
        let row = format!("<tr data-node=\"{id}\"><td>{id}</td><td class=\"ok\">{state}</td>");
        assert!(dom.contains(&row), "{row}: {dom}");
    }

    // The dataset, as `locus dataset show --json` describes its version.
    let show = json(&m.cli(&["dataset", "show", "ds@1", "--json"]));
    let files = show["files"].as_u64().expect("files in dataset show");
    let row = format!(
        "<tr data-dataset=\"ds\"><td>ds</td><td class=\"n\">1</td><td class=\"n\">1</td><td class=\"n\">{files}</td>"
    );
    assert!(dom.contains(&row), "ds with {files} files: {dom}");

    // Where the bytes are, as `locus locality --json` has it.
    let loc = json(&m.cli(&["locality", "ds@1", "--json"]));
    let mut on_both = 0;
    for n in loc["nodes"].as_array().unwrap() {
        let id = n["node"].as_str().unwrap();
        let f = n["resident_fraction"].as_f64().unwrap();
        let cell = format!("data-node=\"{id}\" data-fraction=\"{f:.4}\"");
        assert!(dom.contains(&cell), "{cell}: {dom}");
        if f > 0.0 {
            on_both += 1;
        }
    }
    assert_eq!(on_both, 2, "one replica, small shards: both nodes hold a part");
}
