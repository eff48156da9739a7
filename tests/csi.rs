//! `locus csi`, driven over its Unix socket the way kubelet drives it: identity, node
//! info, publish for two pods of one version and one of another, unpublish; and the
//! errors Kubernetes expects for bad volume attributes and target paths.

use locus_testkit as support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use locus_proto::csi;
use support::*;

/// The plugin process, and whatever it mounted, gone when the test ends however it ends.
struct Plugin {
    child: Child,
    root: PathBuf,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for m in mounts_under(&self.root).into_iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
    }
}

/// Mount points under `root`, outermost first.
fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(root))
        .collect()
}

fn mount_request(volume: &str, target: &Path, dataset: Option<&str>) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: volume.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(csi::VolumeCapability {
            access_type: Some(csi::volume_capability::AccessType::Mount(Default::default())),
            access_mode: Some(csi::volume_capability::AccessMode {
                mode: csi::volume_capability::access_mode::Mode::MultiNodeReaderOnly as i32,
            }),
        }),
        readonly: true,
        volume_context: dataset
            .map(|d| [("dataset".to_string(), d.to_string())].into())
            .unwrap_or_default(),
        ..Default::default()
    }
}

/// `locus csi` for node `n`, as kubelet runs it: socket `csi/csi.sock`, state in
/// `csi-state`, kubelet's dir `kubelet` (all under the harness), a reader's token.
fn spawn_plugin(h: &Harness, m: &Metadata, n: &Node) -> Child {
    let kubelet = h.path("kubelet");
    std::fs::create_dir_all(kubelet.join("pods")).unwrap();
    Command::new(locus())
        .args(["csi", "--endpoint"])
        .arg(format!("unix://{}", h.path("csi/csi.sock").display()))
        .args(["--node-id", "n1", "--node-socket"])
        .arg(&n.socket)
        .arg("--state-dir")
        .arg(h.path("csi-state"))
        .arg("--kubelet-dir")
        .arg(&kubelet)
        .env("LOCUS_METADATA", m.url())
        .env("LOCUS_TOKEN", m.token("reader").unwrap())
        .env("LOCUS_RUNTIME_DIR", h.path("runtime"))
        .env_remove("LOCUS_CONFIG")
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(h.path("csi.log"))
                .unwrap(),
        )
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_publishes_shared_counted_mounts_that_outlive_a_plugin_restart_and_refuses_bad_volumes() {
    let h = Harness::new("csi");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let (a, b) = (h.path("src-a"), h.path("src-b"));
    make_tree(&a, 20);
    make_tree(&b, 7);
    std::fs::write(b.join("only-in-b.txt"), b"b").unwrap();
    for (name, src) in [("imagenet", &a), ("laion", &b)] {
        let o = import(&m, name, src, &["--replicas", "1"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }

    let kubelet = h.path("kubelet");
    let state = h.path("csi-state");
    let sock = h.path("csi/csi.sock");
    let spawn = || spawn_plugin(&h, &m, &n);
    let mut plugin = Plugin {
        child: spawn(),
        root: h.path(""),
    };
    wait_until("the CSI socket", Duration::from_secs(10), || async {
        sock.exists().then_some(())
    })
    .await;
    let channel = locus_proto::client::unix_channel(&sock);
    let mut id = csi::identity_client::IdentityClient::new(channel.clone());
    let mut node = csi::node_client::NodeClient::new(channel);

    // What kubelet and the registrar ask first.
    let info = id
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "csi.locus.io");
    let probe = id.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready.map(|r| r.value), Some(true));
    let caps = id
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.is_empty(), "no controller service");
    let ni = node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ni.node_id, "n1");

    // Two pods of imagenet@1, one of laion@1.
    let target = |pod: &str| kubelet.join(format!("pods/{pod}/volumes/kubernetes.io~csi/data/mount"));
    let publish = [("p1", "imagenet@1"), ("p2", "imagenet@1"), ("p3", "laion@1")];
    for (pod, ds) in publish {
        node.node_publish_volume(mount_request(&format!("vol-{pod}"), &target(pod), Some(ds)))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "publish {pod}: {e:?}; log: {}",
                    std::fs::read_to_string(h.path("csi.log")).unwrap_or_default()
                )
            });
    }
    // Publishing again is idempotent.
    node.node_publish_volume(mount_request("vol-p1", &target("p1"), Some("imagenet@1")))
        .await
        .unwrap();
    assert_same_tree(&a, &target("p1"));
    assert_same_tree(&a, &target("p2"));
    assert_same_tree(&b, &target("p3"));
    let shared = || mounts_under(&state.join("mounts"));
    assert_eq!(shared().len(), 2, "one shared mount per version: {:?}", shared());
    // The pods' volumes are read-only.
    let w = std::fs::write(target("p1").join("new"), b"x").unwrap_err();
    assert_eq!(w.raw_os_error(), Some(libc::EROFS), "{w}");

    // The first unpublish of a version leaves its shared mount for the other pod.
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: "vol-p1".into(),
        target_path: target("p1").display().to_string(),
    })
    .await
    .unwrap();
    assert!(!target("p1").exists(), "the target is removed");
    assert_eq!(shared().len(), 2);
    assert_same_tree(&a, &target("p2"));

    // The plugin dies and comes back: the pods' volumes stay readable meanwhile (the
    // shared mounts are processes of their own), and the new plugin knows what is
    // published from its state file.
    plugin.child.kill().unwrap();
    plugin.child.wait().unwrap();
    assert_same_tree(&a, &target("p2"));
    assert_same_tree(&b, &target("p3"));
    plugin.child = spawn();
    wait_until("the restarted plugin", Duration::from_secs(10), || {
        let mut id = id.clone();
        async move { id.probe(csi::ProbeRequest {}).await.ok().map(drop) }
    })
    .await;
    // The last removes it.
    for pod in ["p2", "p3"] {
        node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: format!("vol-{pod}"),
            target_path: target(pod).display().to_string(),
        })
        .await
        .unwrap();
    }
    assert!(shared().is_empty(), "{:?}", shared());
    // Unpublishing again is idempotent.
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: "vol-p3".into(),
        target_path: target("p3").display().to_string(),
    })
    .await
    .unwrap();

    // Bad volumes get the codes Kubernetes expects, and nothing is mounted.
    let code =
        |r: Result<tonic::Response<csi::NodePublishVolumeResponse>, tonic::Status>| r.map(drop).unwrap_err();
    let cases: Vec<(csi::NodePublishVolumeRequest, tonic::Code, &str)> = vec![
        (
            mount_request("v", &target("x"), None),
            tonic::Code::InvalidArgument,
            "dataset is required",
        ),
        (
            mount_request("v", &target("x"), Some("imagenet@@1")),
            tonic::Code::InvalidArgument,
            "imagenet@@1",
        ),
        (
            mount_request("v", &target("x"), Some("nosuch@1")),
            tonic::Code::NotFound,
            "nosuch",
        ),
        (
            mount_request("v", Path::new("/tmp/elsewhere/mount"), Some("imagenet@1")),
            tonic::Code::InvalidArgument,
            "outside the kubelet directory",
        ),
        (
            mount_request("v", &kubelet.join("pods/../../escape"), Some("imagenet@1")),
            tonic::Code::InvalidArgument,
            "..",
        ),
        (
            mount_request("", &target("x"), Some("imagenet@1")),
            tonic::Code::InvalidArgument,
            "volume_id",
        ),
    ];
    for (req, want, says) in cases {
        let e = code(node.node_publish_volume(req.clone()).await);
        assert_eq!(e.code(), want, "{req:?}: {e:?}");
        assert!(
            e.message().contains(says),
            "{:?} does not say {says:?}",
            e.message()
        );
    }
    let mut block = mount_request("v", &target("x"), Some("imagenet@1"));
    block.volume_capability.as_mut().unwrap().access_type =
        Some(csi::volume_capability::AccessType::Block(Default::default()));
    let e = code(node.node_publish_volume(block).await);
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        shared().is_empty(),
        "a refused publish mounted something: {:?}",
        shared()
    );
    // A symlink planted under the kubelet dir cannot lead a target outside it.
    std::os::unix::fs::symlink("/tmp", kubelet.join("pods/evil")).unwrap();
    let e = code(
        node.node_publish_volume(mount_request(
            "v",
            &kubelet.join("pods/evil/mount"),
            Some("imagenet@1"),
        ))
        .await,
    );
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // An endpoint path holding anything but a socket is left alone, and said so.
    let precious = h.path("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let o = Command::new(locus())
        .args(["csi", "--node-id", "n1", "--endpoint"])
        .arg(format!("unix://{}", precious.display()))
        .arg("--state-dir")
        .arg(h.path("state-2"))
        .arg("--kubelet-dir")
        .arg(&kubelet)
        .env("LOCUS_METADATA", m.url())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is not a socket"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
}

/// A dataset holding a setuid-root binary and a device node (anyone who can put files
/// into a directory an operator imports could plant them), published to a pod: the
/// pod's view is nosuid and nodev, the binary runs without its owner's rights, and the
/// device is not there at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_volume_never_runs_a_setuid_binary_as_root_and_holds_no_device_file() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new("csi-setuid");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let src = h.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::copy("/usr/bin/id", src.join("id")).unwrap();
    std::fs::set_permissions(src.join("id"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let st = Command::new("mknod")
        .arg(src.join("null"))
        .args(["c", "1", "3"])
        .status()
        .unwrap();
    assert!(st.success(), "mknod");
    std::fs::write(src.join("plain.txt"), b"data").unwrap();
    let o = import(&m, "ds", &src, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let _plugin = Plugin {
        child: spawn_plugin(&h, &m, &n),
        root: h.path(""),
    };
    let sock = h.path("csi/csi.sock");
    wait_until("the CSI socket", Duration::from_secs(10), || async {
        sock.exists().then_some(())
    })
    .await;
    let mut node = csi::node_client::NodeClient::new(locus_proto::client::unix_channel(&sock));
    let target = h.path("kubelet/pods/p1/volumes/kubernetes.io~csi/data/mount");
    node.node_publish_volume(mount_request("vol-p1", &target, Some("ds@1")))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "publish: {e:?}; {}",
                std::fs::read_to_string(h.path("csi.log")).unwrap_or_default()
            )
        });
    // The pod's mount: nosuid and nodev (a bind remount that names neither drops them).
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = target.display().to_string();
    let line = info
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(want.as_str()))
        .unwrap_or_else(|| panic!("{want} is not mounted"));
    let opts = line.split(' ').nth(5).unwrap();
    for o in ["ro", "nosuid", "nodev"] {
        assert!(
            opts.split(',').any(|x| x == o),
            "the pod's view lacks {o}: {line}"
        );
    }
    // The binary runs as whoever runs it, not as root.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(target.join("id"))
        .arg("-u")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out).trim(),
        "65534",
        "the setuid binary ran as uid {}",
        stdout(&out).trim()
    );
    let mode = std::fs::metadata(target.join("id")).unwrap().permissions().mode();
    assert_eq!(mode & 0o6000, 0, "setuid/setgid bits shown: {mode:o}");
    assert!(
        !target.join("null").exists(),
        "a device file is in the pod's view"
    );
    assert_eq!(std::fs::read(target.join("plain.txt")).unwrap(), b"data");
}
