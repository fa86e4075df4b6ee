//! The simulated `/proc` files the kubelet plugin reads to build CDI device nodes:
//! `devices`, `driver/nvidia-caps/mig-minors`, and the per-instance capability files under
//! `driver/nvidia/capabilities/`, which exist exactly while their instance exists.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use crate::{FakeError, state::FakeState};

/// Major of `nvidia-uvm` in the simulated `/proc/devices`.
pub const NVIDIA_UVM_MAJOR: u32 = 510;
/// Major of `nvidia-caps` in the simulated `/proc/devices`.
pub const NVIDIA_CAPS_MAJOR: u32 = 508;
/// GPU-instance IDs per GPU in the minor table.
const GI_IDS: u32 = 15;
/// Compute-instance IDs per GPU instance in the minor table.
const CI_IDS: u32 = 8;
/// The driver's table covers this many GPU minors at least.
const TABLE_GPUS: u32 = 32;
/// `DeviceFileMode` of instance capabilities (0444).
const CAP_FILE_MODE: u32 = 292;

/// Capability minor of GPU instance `gi` on GPU minor `gpu_minor`.
pub fn gi_cap_minor(gpu_minor: u32, gi: u32) -> u32 {
    3 + 135 * gpu_minor + 9 * gi
}

/// Capability minor of compute instance `ci` of GPU instance `gi` on GPU minor `gpu_minor`.
pub fn ci_cap_minor(gpu_minor: u32, gi: u32, ci: u32) -> u32 {
    gi_cap_minor(gpu_minor, gi) + 1 + ci
}

/// `/proc/devices` content.
pub fn devices_text() -> String {
    format!(
        "Character devices:\n  1 mem\n  4 /dev/vc/0\n  4 tty\n  5 /dev/tty\n  5 /dev/console\n  5 /dev/ptmx\n \
         10 misc\n 13 input\n 89 i2c\n128 ptm\n136 pts\n195 nvidia\n195 nvidiactl\n{NVIDIA_CAPS_MAJOR} nvidia-caps\n\
         {NVIDIA_UVM_MAJOR} nvidia-uvm\n\nBlock devices:\n  7 loop\n  8 sd\n259 blkext\n"
    )
}

/// `/proc/driver/nvidia-caps/mig-minors` content for GPU minors `0..gpus` (at least the
/// driver's 32).
pub fn mig_minors_text(gpus: u32) -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    for gpu in 0..gpus.max(TABLE_GPUS) {
        for gi in 0..GI_IDS {
            let _ = writeln!(out, "gpu{gpu}/gi{gi}/access {}", gi_cap_minor(gpu, gi));
            for ci in 0..CI_IDS {
                let _ = writeln!(out, "gpu{gpu}/gi{gi}/ci{ci}/access {}", ci_cap_minor(gpu, gi, ci));
            }
        }
    }
    out
}

fn cap_file_text(minor: u32, mode: u32) -> String {
    format!("DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
}

fn write_if_changed(path: &Path, text: &str) -> Result<(), FakeError> {
    if std::fs::read_to_string(path).ok().as_deref() == Some(text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| FakeError::io(dir, e))?;
    }
    std::fs::write(path, text).map_err(|e| FakeError::io(path, e))
}

fn caps_dir(proc_root: &Path) -> PathBuf {
    proc_root.join("driver/nvidia/capabilities")
}

/// Writes the files that never change while the driver is loaded.
pub fn write_static(state: &FakeState) -> Result<(), FakeError> {
    let root = &state.proc_root;
    let max_minor = state.gpus.iter().map(|g| g.minor + 1).max().unwrap_or(0);
    write_if_changed(&root.join("devices"), &devices_text())?;
    write_if_changed(
        &root.join("driver/nvidia-caps/mig-minors"),
        &mig_minors_text(max_minor),
    )?;
    write_if_changed(&caps_dir(root).join("mig/config"), &cap_file_text(1, 256))?;
    write_if_changed(
        &caps_dir(root).join("mig/monitor"),
        &cap_file_text(2, CAP_FILE_MODE),
    )
}

/// Makes the per-instance capability files match the state: one `gi<G>/access` per GPU
/// instance and one `gi<G>/ci<C>/access` per compute instance, nothing else; and a
/// `<pid>/comm` for every client process (left behind when it goes, as nothing reads them
/// then).
pub fn sync(state: &FakeState) -> Result<(), FakeError> {
    for client in state.gpus.iter().flat_map(|g| &g.clients) {
        write_if_changed(
            &state.proc_root.join(client.pid.to_string()).join("comm"),
            &format!("{}\n", client.name),
        )?;
    }
    let caps = caps_dir(&state.proc_root);
    let mut wanted: BTreeMap<PathBuf, String> = BTreeMap::new();
    for gpu in &state.gpus {
        let mig = caps.join(format!("gpu{}/mig", gpu.minor));
        for gi in &gpu.gpu_instances {
            let gi_dir = mig.join(format!("gi{}", gi.id));
            wanted.insert(
                gi_dir.join("access"),
                cap_file_text(gi_cap_minor(gpu.minor, gi.id), CAP_FILE_MODE),
            );
            for ci in &gi.compute_instances {
                wanted.insert(
                    gi_dir.join(format!("ci{}/access", ci.id)),
                    cap_file_text(ci_cap_minor(gpu.minor, gi.id, ci.id), CAP_FILE_MODE),
                );
            }
        }
    }
    remove_unwanted(&caps, &wanted)?;
    for (path, text) in &wanted {
        write_if_changed(path, text)?;
    }
    Ok(())
}

/// Removes `gpu*/mig/gi*` and `gi*/ci*` directories whose access file is not wanted.
fn remove_unwanted(caps: &Path, wanted: &BTreeMap<PathBuf, String>) -> Result<(), FakeError> {
    let Ok(gpus) = std::fs::read_dir(caps) else {
        return Ok(());
    };
    for gpu in gpus.flatten() {
        if !gpu.file_name().to_string_lossy().starts_with("gpu") {
            continue;
        }
        let Ok(gis) = std::fs::read_dir(gpu.path().join("mig")) else {
            continue;
        };
        for gi in gis.flatten() {
            let gi_path = gi.path();
            if !wanted.contains_key(&gi_path.join("access")) {
                std::fs::remove_dir_all(&gi_path).map_err(|e| FakeError::io(&gi_path, e))?;
                continue;
            }
            let Ok(cis) = std::fs::read_dir(&gi_path) else {
                continue;
            };
            for ci in cis.flatten() {
                let ci_path = ci.path();
                if ci_path.is_dir() && !wanted.contains_key(&ci_path.join("access")) {
                    std::fs::remove_dir_all(&ci_path).map_err(|e| FakeError::io(&ci_path, e))?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_follow_the_closed_form() {
        assert_eq!(gi_cap_minor(0, 0), 3);
        assert_eq!(ci_cap_minor(0, 0, 7), 11);
        assert_eq!(gi_cap_minor(0, 1), 12);
        assert_eq!(gi_cap_minor(1, 0), 138);
        let table = mig_minors_text(1);
        assert!(table.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n"));
        assert!(table.contains("gpu1/gi2/ci3/access 160\n"));
        assert_eq!(table.lines().count(), 2 + 32 * 15 * 9);
    }

    #[test]
    fn devices_lists_the_nvidia_majors() {
        let text = devices_text();
        for line in [
            "195 nvidia\n",
            "195 nvidiactl\n",
            "508 nvidia-caps\n",
            "510 nvidia-uvm\n",
        ] {
            assert!(text.contains(line), "{line}");
        }
        assert!(text.starts_with("Character devices:\n"));
    }
}
