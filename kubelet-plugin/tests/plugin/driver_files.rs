//! The container contract beyond device nodes: the node-wide driver CDI spec every prepared
//! device names (the driver's files, `nvidia-cdi-hook` hooks, `NVIDIA_VISIBLE_DEVICES=void`),
//! its re-discovery after a driver change, and prepares that fail, with nothing created on
//! the GPU, when the node cannot run CUDA containers.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::fs;

use migdra_fake_nvml::driver_root::{DriverRootOptions, LIB_DIR, create_driver_root};
use migdra_kubelet_plugin::driver::ClaimFailure;
use migdra_testkit::plugin::*;
use serde_json::Value;

const H100_3G_AT_4: &str = "gpu-0-mig-3g40gb-4";

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// The driver device's container edits.
fn driver_edits(node: &Node) -> Value {
    let spec = node.driver_spec();
    assert_eq!(spec["kind"], "gpu.migdra.dev/driver");
    assert_eq!(spec["devices"].as_array().unwrap().len(), 1);
    assert_eq!(spec["devices"][0]["name"], "files");
    spec["devices"][0]["containerEdits"].clone()
}

/// The mount of `container_path` in the driver edits.
fn mount<'a>(edits: &'a Value, container_path: &str) -> Option<&'a Value> {
    edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["containerPath"] == container_path)
}

/// Replaces the node's driver root by one of `version`.
fn reinstall_driver(node: &Node, version: &str) {
    fs::remove_dir_all(node.driver_root()).unwrap();
    fs::create_dir_all(node.driver_root()).unwrap();
    create_driver_root(&node.driver_root(), version, &DriverRootOptions::default()).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_driver_spec_hands_every_device_the_driver_files_hooks_and_void() {
    let node = Node::new(&[("H100-80GB", true)]);
    let version = node.driver_version();
    let (driver, _) = node.start(None);
    // Written at start, before any claim.
    let edits = driver_edits(&node);
    for library in ["libcuda", "libnvidia-ml"] {
        let path = format!("{LIB_DIR}/{library}.so.{version}");
        let m = mount(&edits, &path).unwrap_or_else(|| panic!("no mount of {path}: {edits}"));
        assert_eq!(
            m["hostPath"],
            node.driver_root()
                .join(path.trim_start_matches('/'))
                .to_str()
                .unwrap(),
            "mounted from the driver root"
        );
        let options = strings(&m["options"]);
        assert!(
            options.contains(&"ro".to_string()) && options.contains(&"rbind".to_string()),
            "{options:?}"
        );
    }
    let hooks = edits["hooks"].as_array().unwrap();
    assert_eq!(hooks.len(), 4, "{hooks:?}");
    for hook in hooks {
        assert_eq!(hook["hookName"], "createContainer");
        assert_eq!(hook["path"], HOOK_PATH);
    }
    let symlinks = strings(&hooks[0]["args"]);
    assert_eq!(symlinks[..2], ["nvidia-cdi-hook", "create-symlinks"]);
    for soname in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        let library = soname.trim_end_matches(".so.1");
        assert!(
            symlinks.contains(&format!("{library}.so.{version}::{LIB_DIR}/{soname}")),
            "{soname} not linked: {symlinks:?}"
        );
    }
    // What nvcdi emits for compute,utility, in its order.
    assert_eq!(
        strings(&hooks[1]["args"]),
        [
            "nvidia-cdi-hook".to_string(),
            "enable-cuda-compat".to_string(),
            format!("--host-driver-version={version}")
        ]
    );
    let ldcache = strings(&hooks[2]["args"]);
    assert_eq!(
        ldcache,
        ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB_DIR]
    );
    assert_eq!(
        strings(&hooks[3]["args"]),
        ["nvidia-cdi-hook", "disable-device-node-modification"]
    );
    let env = strings(&edits["env"]);
    assert!(
        env.contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()),
        "{env:?}"
    );

    // Every prepared device names it; the claim's own spec carries no driver edits and no
    // NVIDIA_VISIBLE_DEVICES.
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(devices[0].cdi_device_ids.last().unwrap(), DRIVER_DEVICE_ID);
    let claim_edits = &node.cdi_spec("uid-1")["devices"][0]["containerEdits"];
    assert!(claim_edits.get("mounts").is_none() && claim_edits.get("hooks").is_none());
    assert!(
        !strings(&claim_edits["env"])
            .iter()
            .any(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES=")),
        "{claim_edits}"
    );

    // Unprepare removes the claim's spec, never the node-wide one.
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert!(node.cdi_specs().is_empty());
    assert!(node.cdi().driver_spec_path().is_file());
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_hook_the_sonames_are_mounts_and_there_are_no_hooks() {
    let node = Node::new(&[("H100-80GB", true)]);
    let version = node.driver_version();
    fs::remove_file(node.host_root().join(HOOK_PATH.trim_start_matches('/'))).unwrap();
    let _driver = node.start(None);
    let edits = driver_edits(&node);
    assert!(edits.get("hooks").is_none(), "{edits}");
    let link = mount(&edits, &format!("{LIB_DIR}/libcuda.so.1")).expect("libcuda.so.1 as a mount");
    assert!(
        link["hostPath"]
            .as_str()
            .unwrap()
            .ends_with(&format!("libcuda.so.{version}")),
        "the soname mount is the versioned file: {link}"
    );
}

/// The device number and mode of a character device.
fn char_device(path: &std::path::Path) -> (u64, u32) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        meta.file_type().is_char_device(),
        "{} is not a character device",
        path.display()
    );
    (meta.rdev(), meta.mode() & 0o7777)
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_uvm_nodes_are_created_from_the_major_in_proc_devices() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    for name in ["nvidia-uvm", "nvidia-uvm-tools"] {
        fs::remove_file(node.dev_root().join(name)).unwrap();
    }
    node.claims.put(claim("uid-m", "mig", &[("gpu", H100_3G_AT_4)]));
    prepare_typed(&driver, "uid-m", "mig").await.unwrap();
    // As nvidia-modprobe makes them: the module's major, minors 0 and 1, mode 0666.
    let major = migdra_fake_nvml::procfs::NVIDIA_UVM_MAJOR;
    assert_eq!(
        char_device(&node.dev_root().join("nvidia-uvm")),
        (libc::makedev(major, 0), 0o666)
    );
    assert_eq!(
        char_device(&node.dev_root().join("nvidia-uvm-tools")),
        (libc::makedev(major, 1), 0o666)
    );
    assert_eq!(node.total_instances(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn uvm_module_not_loaded_fails_prepare_before_anything_is_created() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    fs::remove_file(node.dev_root().join("nvidia-uvm")).unwrap();
    // The module is not loaded: /proc/devices has no nvidia-uvm, so there is nothing to make
    // the node from.
    let devices = node.host.proc_root().join("devices");
    let loaded = fs::read_to_string(&devices).unwrap();
    let unloaded: String = loaded
        .lines()
        .filter(|l| !l.ends_with(" nvidia-uvm"))
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(&devices, unloaded).unwrap();
    // A whole GPU on a MIG-enabled GPU: prepare would switch MIG mode off first.
    node.claims.put(claim("uid-w", "whole", &[("gpu", "gpu-0")]));
    node.claims.put(claim("uid-m", "mig", &[("gpu", H100_3G_AT_4)]));
    for (uid, name) in [("uid-w", "whole"), ("uid-m", "mig")] {
        let failure = prepare_typed(&driver, uid, name).await.unwrap_err();
        assert!(matches!(failure, ClaimFailure::NodeNotReady(_)), "{failure:?}");
        assert_eq!(failure.reason(), "DriverFilesUnavailable");
        let message = failure.to_string();
        assert!(
            message.contains("/dev/nvidia-uvm missing")
                && message.contains("the nvidia-uvm kernel module is not loaded"),
            "{message}"
        );
    }
    assert!(
        !node.dev_root().join("nvidia-uvm").exists(),
        "nothing made without a major"
    );
    assert_eq!(node.total_instances(), 0, "no instance was created");
    assert!(
        node.host.read_state().unwrap().gpus[0].mig_enabled,
        "MIG mode untouched"
    );
    assert!(node.cdi_specs().is_empty());
    assert!(driver.recorded_claims().is_empty(), "nothing recorded");

    // Loading the module is all it takes: the node is made then.
    fs::write(&devices, loaded).unwrap();
    prepare_typed(&driver, "uid-m", "mig").await.unwrap();
    assert_eq!(node.total_instances(), 1);
    assert_eq!(
        char_device(&node.dev_root().join("nvidia-uvm")).0,
        libc::makedev(migdra_fake_nvml::procfs::NVIDIA_UVM_MAJOR, 0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nvidia_modeset_is_passed_on_when_the_host_has_it() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let paths = |uid: &str| -> Vec<(String, u64, u64)> {
        node.cdi_spec(uid)["devices"][0]["containerEdits"]["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                (
                    n["path"].as_str().unwrap().to_string(),
                    n["major"].as_u64().unwrap(),
                    n["minor"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_typed(&driver, "uid-1", "c1").await.unwrap();
    assert!(
        !paths("uid-1").iter().any(|(p, _, _)| p == "/dev/nvidia-modeset"),
        "{:?}",
        paths("uid-1")
    );
    // The nvidia-modeset module loaded (its node exists on the host).
    fs::write(node.dev_root().join("nvidia-modeset"), b"").unwrap();
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-1-mig-3g40gb-4")]));
    prepare_typed(&driver, "uid-2", "c2").await.unwrap();
    assert!(
        paths("uid-2").contains(&("/dev/nvidia-modeset".to_string(), 195, 254)),
        "{:?}",
        paths("uid-2")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_driver_root_of_another_version_fails_prepare_until_it_matches() {
    let node = Node::new(&[("H100-80GB", true)]);
    let version = node.driver_version();
    reinstall_driver(&node, "470.256.02");
    // The plugin starts (and serves) anyway; no driver spec yet.
    let (driver, _) = node.start(None);
    assert!(!node.cdi().driver_spec_path().exists());
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    let failure = prepare_typed(&driver, "uid-1", "c1").await.unwrap_err();
    let message = failure.to_string();
    assert!(
        message.contains(&format!("no libcuda.so.{version} found under")),
        "{message}"
    );
    assert_eq!(node.total_instances(), 0);
    assert!(driver.recorded_claims().is_empty());

    // The failed discovery is not kept: once the files match, the next prepare works.
    reinstall_driver(&node, &version);
    prepare_typed(&driver, "uid-1", "c1").await.unwrap();
    assert!(mount(&driver_edits(&node), &format!("{LIB_DIR}/libcuda.so.{version}")).is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_driver_version_is_discovered_and_the_spec_rewritten() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let old = node.driver_version();
    let (driver, _) = node.start(None);
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_typed(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(
        node.driver_spec()["annotations"]["gpu.migdra.dev/driver-version"],
        old.as_str()
    );

    // A driver upgrade: new files and NVML reports the new version.
    let new = "590.10.01";
    reinstall_driver(&node, new);
    node.host
        .update_state(|s| s.driver_version = new.to_string())
        .unwrap();
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-1-mig-3g40gb-4")]));
    prepare_typed(&driver, "uid-2", "c2").await.unwrap();
    let edits = driver_edits(&node);
    assert!(
        mount(&edits, &format!("{LIB_DIR}/libcuda.so.{new}")).is_some(),
        "{edits}"
    );
    assert!(
        mount(&edits, &format!("{LIB_DIR}/libcuda.so.{old}")).is_none(),
        "{edits}"
    );
    assert_eq!(
        node.driver_spec()["annotations"]["gpu.migdra.dev/driver-version"],
        new
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_driver_upgrade_without_reboot_reinitialises_nvml_and_rewrites_the_spec() {
    use std::sync::Arc;

    use migdra_kubelet_plugin::{metrics::Metrics, nvml::ReloadingNvml};
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let nvml = ReloadingNvml::new(Some(&node.host.lib_path())).unwrap();
    let (driver, _) = node.start_over(Arc::new(nvml), None, Metrics::new()).unwrap();
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_typed(&driver, "uid-1", "c1").await.unwrap();

    // The driver is upgraded and its kernel module loaded again under the running plugin.
    let new = "590.10.01";
    reinstall_driver(&node, new);
    node.host
        .update_state(|s| {
            s.driver_upgrades += 1;
            s.driver_version = new.to_string();
        })
        .unwrap();
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-1-mig-3g40gb-4")]));
    prepare_typed(&driver, "uid-2", "c2").await.unwrap();
    assert_eq!(
        node.driver_spec()["annotations"]["gpu.migdra.dev/driver-version"],
        new
    );
    assert_eq!(node.total_instances(), 2);
    // The claim prepared before the upgrade is released through the new session.
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 1);
}
