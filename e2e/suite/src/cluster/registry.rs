//! The run's image registry (`MIGDRA_E2E_MIGDRA=chart`): migdra's images and the workload
//! probe image are pushed to a registry on loopback inside the node's network namespace
//! (`e2e/runtime/registry.sh`, go-containerregistry's `crane registry serve`), and the chart
//! pulls them from there with only `imageRegistry` set and its default `pullPolicy`, so the
//! kubelet's image pull path runs (containerd reads `<run>/ctrd/registry/hosts`, plain HTTP
//! for that host only). Its state lives in `<run>/ctrd/registry`; `clean.sh` stops it with
//! containerd, at teardown and after a crash.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::{Cluster, containerd};

/// The registry's address in the node's network namespace (nothing else listens there).
pub const REGISTRY: &str = "127.0.0.1:5000";
/// The workload probe image (`e2e/runtime/gpu-probe`) as `migdra-images.sh` names it.
const PROBE_SOURCE_IMAGE: &str = "migdra.dev/e2e/gpu-probe:e2e";

/// The name an image is pushed under (as `registry.sh` does): its registry host replaced by
/// [`REGISTRY`].
pub fn pulled_name(image: &str) -> String {
    let path = image.split_once('/').map_or(image, |(_, rest)| rest);
    format!("{REGISTRY}/{path}")
}

/// The workload probe image as pods pull it from the run's registry.
pub fn probe_image() -> String {
    pulled_name(PROBE_SOURCE_IMAGE)
}

/// The directory of migdra's images (controller, plugin, the gpu-probe workload):
/// `migdra-images.sh`'s output, with `images.txt`. They carry the binaries the rest of the suite
/// runs (`MIGDRA_BIN_DIR`, or the test's own target profile), so the images add no release
/// build of their own; the Dockerfile's stages are otherwise followed exactly.
pub(super) fn migdra_images_dir() -> anyhow::Result<PathBuf> {
    let bins = super::migdra::migdra_bin_dir()?;
    let dir = containerd::run_script_with("migdra-images.sh", &[], &[("MIGDRA_BIN_DIR", &bins)])?;
    Ok(PathBuf::from(dir))
}

/// The registry's directory of a run dir.
pub(super) fn registry_dir(run_dir: &Path) -> PathBuf {
    containerd::ctrd_dir(run_dir).join("registry")
}

impl Cluster {
    /// Starts the registry in the node's network namespace and pushes every image of
    /// `images_dir` (an `images.txt` directory) to it.
    pub(super) fn start_registry(&self, images_dir: &Path) -> anyhow::Result<()> {
        let run = &self.layout.run_dir;
        let dir = registry_dir(run);
        let netns = containerd::node_netns(run);
        containerd::run_script_with(
            "registry.sh",
            &[Path::new("start"), &dir, Path::new(REGISTRY), &netns, images_dir],
            &[],
        )
        .context("starting the loopback registry")?;
        Ok(())
    }

    /// The registry's log (`crane registry serve`: one line per request it served).
    pub fn registry_log(&self) -> anyhow::Result<String> {
        let path = registry_dir(&self.layout.run_dir).join("registry.log");
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulled_names_replace_the_registry_host() {
        assert_eq!(
            pulled_name("ghcr.io/migdra/migdra-kubelet-plugin:0.1.0"),
            "127.0.0.1:5000/migdra/migdra-kubelet-plugin:0.1.0"
        );
        assert_eq!(probe_image(), "127.0.0.1:5000/e2e/gpu-probe:e2e");
    }
}
