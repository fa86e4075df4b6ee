//! A state directory that cannot be written (read-only or full): the plugin still starts and
//! still frees the GPU on unprepare; every checkpoint write that fails is the claim's failure
//! message and a metric, never lost in silence.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{fs, path::Path, process::Command};

use migdra_kubelet_plugin::metrics::Metrics;
use migdra_testkit::plugin::*;

/// Makes a directory and everything in it unwritable for as long as it lives: mode bits for an
/// unprivileged user, the immutable attribute for root (which ignores mode bits).
struct Unwritable<'a>(&'a Path);

impl<'a> Unwritable<'a> {
    fn new(dir: &'a Path) -> Self {
        let guard = Self(dir);
        for entry in fs::read_dir(dir).unwrap() {
            guard.set(&entry.unwrap().path(), true);
        }
        guard.set(dir, true);
        let probe = dir.join("probe");
        assert!(
            fs::write(&probe, b"x").is_err(),
            "cannot make {} unwritable here (chattr unavailable?)",
            dir.display()
        );
        guard
    }

    fn set(&self, path: &Path, locked: bool) {
        use std::os::unix::fs::PermissionsExt;
        let is_dir = path.is_dir();
        if !locked {
            let _ = Command::new("chattr").arg("-i").arg(path).status();
        }
        let mode = match (locked, is_dir) {
            (true, true) => 0o555,
            (true, false) => 0o444,
            (false, true) => 0o700,
            (false, false) => 0o600,
        };
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
        if locked {
            // Fails for an unprivileged user, whom the mode bits stop already.
            let _ = Command::new("chattr").arg("+i").arg(path).status();
        }
    }
}

impl Drop for Unwritable<'_> {
    fn drop(&mut self) {
        self.set(self.0, false);
        for entry in fs::read_dir(self.0).unwrap() {
            self.set(&entry.unwrap().path(), false);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_state_dir_starts_tears_down_and_reports_failed_writes() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-3g40gb-0")]));
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-0-mig-3g40gb-4")]));
    {
        let (driver, _) = node.start(None);
        prepare_one(&driver, "uid-1", "c1").await.unwrap();
    }
    let state_dir = node.state_dir();
    let unwritable = Unwritable::new(&state_dir);
    let metrics = Metrics::new();
    let (driver, report) = node
        .try_start_with(None, metrics.clone())
        .expect("a read-only state directory does not stop the start");
    assert!(report.pending.is_empty(), "{report:?}");
    assert_eq!(driver.recorded_claims().len(), 1);

    // A prepare cannot record its intent: it fails with that, before touching the GPU.
    let err = prepare_one(&driver, "uid-2", "c2").await.unwrap_err();
    assert!(err.contains("cannot write"), "{err}");
    assert!(err.contains("checkpoint.json"), "{err}");
    assert!(err.contains("read-only or full"), "{err}");
    assert_eq!(node.instances(0).len(), 1, "nothing was created for c2");
    let failed_writes = |n: u32| {
        let line = format!(r#"migdra_kubelet_plugin_state_write_failures_total{{file="checkpoint"}} {n}"#);
        metrics.encode().lines().any(|l| l == line)
    };
    assert!(failed_writes(1), "{}", metrics.encode());
    assert!(
        metrics.encode().lines().any(|l| l
            == r#"migdra_kubelet_plugin_claim_failures_total{operation="prepare",reason="CheckpointError"} 1"#),
        "{}",
        metrics.encode()
    );

    // Unprepare frees the GPU, and says the record could not be updated.
    let err = unprepare_one(&driver, "uid-1", "c1").await.unwrap_err();
    assert!(err.contains("read-only or full"), "{err}");
    assert!(
        node.instances(0).is_empty(),
        "the instance is destroyed all the same"
    );
    assert!(failed_writes(2), "{}", metrics.encode());

    // Once the directory is writable again, the kubelet's retry finishes the unprepare.
    drop(unwritable);
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert!(driver.recorded_claims().is_empty());
    assert!(node.cdi_specs().is_empty(), "{:?}", node.cdi_specs());
}
