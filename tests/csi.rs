//! `locus csi`, driven over its Unix socket the way kubelet drives it: identity, node
//! info, publish for two pods of one version and one of another, unpublish; and the
//! errors Kubernetes expects for bad volume attributes and target paths.

use locus_testkit as support;

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use locus_proto::csi;
use support::*;

fn mount_request(volume: &str, target: &Path, dataset: Option<&str>) -> csi::NodePublishVolumeRequest {
    csi_publish_request(volume, target, dataset, None)
}

/// `locus csi` for node `n`, as kubelet runs it (see [`spawn_csi_driver`]).
fn spawn_plugin(h: &Harness, m: &Metadata, n: &Node) -> Child {
    spawn_csi_driver(h, m, n, "node")
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
    let mut plugin = MountingProcess {
        child: spawn(),
        root: h.path(""),
    };
    wait_for_socket(&sock).await;
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

    let _plugin = MountingProcess {
        child: spawn_plugin(&h, &m, &n),
        root: h.path(""),
    };
    let sock = h.path("csi/csi.sock");
    wait_for_socket(&sock).await;
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

fn capability(mode: csi::volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(csi::volume_capability::AccessType::Mount(Default::default())),
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
    }
}

fn claim(
    name: &str,
    params: &[(&str, &str)],
    mode: csi::volume_capability::access_mode::Mode,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability(mode)],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

/// The provisioning flow the external-provisioner and kubelet drive: a claim of a
/// StorageClass naming `imagenet` (no version) gets the version that was latest when it
/// was provisioned, and keeps it after a newer one is committed; a pod of that volume
/// reads that version's bytes; writer modes, block volumes, clones and unknown datasets
/// are refused for what they are; deleting the volume leaves the dataset alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_keeps_the_version_latest_was_at_provisioning_and_writer_modes_are_refused() {
    use csi::volume_capability::access_mode::Mode;
    let h = Harness::new("csi-provision");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let n = h.start_node("n1", &m, NodeOpts::host(1)).await;
    let (v1, v2) = (h.path("src-v1"), h.path("src-v2"));
    make_tree(&v1, 9);
    make_tree(&v2, 4);
    std::fs::write(v2.join("only-in-v2.txt"), b"2").unwrap();
    let o = import(&m, "imagenet", &v1, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let sock = h.path("csi/csi.sock");
    let _driver = MountingProcess {
        child: spawn_csi_driver(&h, &m, &n, "all"),
        root: h.path(""),
    };
    wait_for_socket(&sock).await;
    let channel = locus_proto::client::unix_channel(&sock);
    let mut id = csi::identity_client::IdentityClient::new(channel.clone());
    let mut ctl = csi::controller_client::ControllerClient::new(channel.clone());
    let mut node = csi::node_client::NodeClient::new(channel);

    let caps = id
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1, "{caps:?}");
    let ccaps = ctl
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    use csi::controller_service_capability::{rpc::Type, Type as Cap};
    let offered: Vec<i32> = ccaps
        .capabilities
        .iter()
        .filter_map(|c| c.r#type.as_ref().map(|Cap::Rpc(r)| r.r#type))
        .collect();
    assert_eq!(offered, vec![Type::CreateDeleteVolume as i32]);

    // Provisioned while version 1 is the latest; a retry of the same claim gets the same
    // volume, another claim another volume of the same version.
    let params = [("dataset", "imagenet")];
    let create = |r: csi::CreateVolumeRequest| {
        let mut ctl = ctl.clone();
        async move { ctl.create_volume(r).await.map(|r| r.into_inner().volume.unwrap()) }
    };
    let first = create(claim("pvc-1", &params, Mode::MultiNodeReaderOnly))
        .await
        .unwrap();
    assert_eq!(
        first.volume_context.get("dataset").map(String::as_str),
        Some("imagenet@1")
    );
    assert!(first.volume_id.starts_with("imagenet@1:"), "{}", first.volume_id);
    assert_eq!(first.capacity_bytes, 0, "capacity is reported unknown");
    let again = create(claim("pvc-1", &params, Mode::MultiNodeReaderOnly))
        .await
        .unwrap();
    assert_eq!(again.volume_id, first.volume_id);
    let other = create(claim("pvc-other", &params, Mode::SingleNodeReaderOnly))
        .await
        .unwrap();
    assert_ne!(other.volume_id, first.volume_id);

    // Version 2 is committed: a new claim gets it, the old volume still shows version 1.
    let o = import(&m, "imagenet", &v2, &["--replicas", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let second = create(claim("pvc-2", &params, Mode::MultiNodeReaderOnly))
        .await
        .unwrap();
    assert_eq!(
        second.volume_context.get("dataset").map(String::as_str),
        Some("imagenet@2")
    );
    let pinned = create(claim(
        "pvc-pinned",
        &[("dataset", "imagenet"), ("version", "1")],
        Mode::MultiNodeReaderOnly,
    ))
    .await
    .unwrap();
    assert_eq!(
        pinned.volume_context.get("dataset").map(String::as_str),
        Some("imagenet@1")
    );

    // Kubelet publishes each volume with the context the provisioner recorded in its PV.
    let kubelet = h.path("kubelet");
    let target = |pod: &str| kubelet.join(format!("pods/{pod}/volumes/kubernetes.io~csi/pv/mount"));
    for (pod, vol) in [("p1", &first), ("p2", &second)] {
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            target_path: target(pod).display().to_string(),
            volume_capability: Some(capability(Mode::MultiNodeReaderOnly)),
            readonly: true,
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("publish {pod}: {e:?}"));
    }
    assert_same_tree(&v1, &target("p1"));
    assert_same_tree(&v2, &target("p2"));

    // Validation: read-only mount capabilities are confirmed, a writer mode is not, and
    // a volume that does not exist is NOT_FOUND.
    let validate = |id: &str, mode: Mode| {
        let mut ctl = ctl.clone();
        let id = id.to_string();
        async move {
            ctl.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: id,
                volume_capabilities: vec![capability(mode)],
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
        }
    };
    let ok = validate(&first.volume_id, Mode::MultiNodeReaderOnly)
        .await
        .unwrap();
    assert!(ok.confirmed.is_some(), "{ok:?}");
    let writer = validate(&first.volume_id, Mode::SingleNodeWriter).await.unwrap();
    assert!(
        writer.confirmed.is_none() && writer.message.contains("SINGLE_NODE_WRITER"),
        "{writer:?}"
    );
    for missing in ["imagenet@9:0123456789abcdef", "not-a-locus-volume"] {
        let e = validate(missing, Mode::MultiNodeReaderOnly).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{missing}: {e:?}");
    }

    // Refusals, each for its own reason, and none of them provisions anything.
    let mut block = claim("pvc-b", &params, Mode::MultiNodeReaderOnly);
    block.volume_capabilities[0].access_type =
        Some(csi::volume_capability::AccessType::Block(Default::default()));
    let mut clone = claim("pvc-c", &params, Mode::MultiNodeReaderOnly);
    clone.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: first.volume_id.clone(),
            },
        )),
    });
    let mut no_caps = claim("pvc-n", &params, Mode::MultiNodeReaderOnly);
    no_caps.volume_capabilities.clear();
    let cases = [
        (
            claim("pvc-w", &params, Mode::SingleNodeWriter),
            tonic::Code::InvalidArgument,
            "ReadOnlyMany",
        ),
        (
            claim("pvc-m", &params, Mode::MultiNodeMultiWriter),
            tonic::Code::InvalidArgument,
            "MULTI_NODE_MULTI_WRITER",
        ),
        (block, tonic::Code::InvalidArgument, "block device"),
        (clone, tonic::Code::InvalidArgument, "snapshot or another volume"),
        (no_caps, tonic::Code::InvalidArgument, "volume_capabilities"),
        (
            claim("", &params, Mode::MultiNodeReaderOnly),
            tonic::Code::InvalidArgument,
            "name",
        ),
        (
            claim("pvc-x", &[("dataset", "nosuch")], Mode::MultiNodeReaderOnly),
            tonic::Code::NotFound,
            "nosuch",
        ),
        (
            claim(
                "pvc-y",
                &[("dataset", "imagenet"), ("version", "7")],
                Mode::MultiNodeReaderOnly,
            ),
            tonic::Code::NotFound,
            "imagenet",
        ),
        (
            claim("pvc-z", &[("datasett", "imagenet")], Mode::MultiNodeReaderOnly),
            tonic::Code::InvalidArgument,
            "datasett",
        ),
    ];
    for (req, want, says) in cases {
        let e = create(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), want, "{req:?}: {e:?}");
        assert!(
            e.message().contains(says),
            "{:?} does not say {says:?}",
            e.message()
        );
    }

    // Deleting volumes (twice, and one never made) frees nothing and deletes no data.
    for vol in [&first.volume_id, &first.volume_id, &"made-up".to_string()] {
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let e = ctl
        .delete_volume(csi::DeleteVolumeRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_same_tree(&v1, &target("p1"));
    let o = m.cli(&["dataset", "show", "imagenet@1"]);
    assert!(
        o.status.success(),
        "the dataset went with its volume: {}",
        stderr(&o)
    );
}

/// `--mode controller` serves Identity and Controller only: it needs no node socket, no
/// kubelet directory, and answers Node calls with UNIMPLEMENTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_alone_serves_no_node_calls_and_needs_no_host_paths() {
    let h = Harness::new("csi-controller");
    let m = h.start_metadata("meta", MetadataOpts::with_tokens()).await;
    let sock = h.path("ctl.sock");
    let mut child = Command::new(locus())
        .args(["csi", "--mode", "controller", "--endpoint"])
        .arg(format!("unix://{}", sock.display()))
        .args([
            "--state-dir",
            "/nonexistent/state",
            "--kubelet-dir",
            "/nonexistent/kubelet",
        ])
        .env("LOCUS_METADATA", m.url())
        .env("LOCUS_TOKEN", m.token("reader").unwrap())
        .env_remove("LOCUS_CONFIG")
        .spawn()
        .unwrap();
    wait_for_socket(&sock).await;
    let channel = locus_proto::client::unix_channel(&sock);
    let mut ctl = csi::controller_client::ControllerClient::new(channel.clone());
    let caps = ctl
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
    let e = csi::node_client::NodeClient::new(channel)
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    assert!(!Path::new("/nonexistent/state").exists());
    let _ = child.kill();
    let _ = child.wait();
}
