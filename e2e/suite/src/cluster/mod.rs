//! A local cluster from upstream parts: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and one kubelet on containerd and runc ([`containerd`]), with migdra's
//! controller and kubelet plugin installed by its chart and running in its pods ([`chart_mode`])
//! against the fake NVML library simulating GPUs. The benchmark opts into the other modes in
//! its [`ClusterConfig`] (or with these variables): the fake CRI under the kubelet
//! (`MIGDRA_E2E_RUNTIME=fake-cri`) and migdra as host processes (`MIGDRA_E2E_MIGDRA=host`, with
//! tokens of the chart's ServiceAccounts, see [`migdra`]).
//!
//! Everything lives in one run directory (kept after teardown, for its logs). [`Cluster::start`]
//! boots the upstream parts ([`boot`]), then migdra (the chart's pods, or its two processes);
//! [`Cluster::teardown`] stops every process this launcher started (by its pid), unmounts
//! whatever the kubelet mounted under the run directory, and removes the log symlinks the
//! kubelet made for our pods ([`teardown`]). This module holds what they share: the names, the
//! layout, the component table and the GPU state.

mod boot;
mod chart_mode;
mod chart_ops;
mod containerd;
mod k8s_minor;
mod kueue;
mod migdra;
mod migdra_pods;
mod pod_identity;
mod registry;
mod teardown;

pub use chart_mode::{MIGDRA_MODE_ENV, MigdraMode};
pub use chart_ops::CHART_DIR_ENV;
pub use containerd::{API_SERVICE_IP, BUSYBOX_IMAGE, PAUSE_IMAGE, POD_SUBNET, RUNTIME_ENV, Runtime};
pub use k8s_minor::{K8S_MINOR_ENV, K8sMinor};
pub use kueue::{GPU_MEMORY, KUEUE, KUEUE_API_VERSION, KUEUE_NAMESPACE, kueue_api, kueue_resource};
pub use migdra::{PLUGIN, PluginIdentities, STALE_CLAIM_GC_INTERVAL_SECONDS};
pub use migdra_pods::{
    CONTROLLER, KilledPlugin, PLUGIN_CONTAINER, Registrations, plugin_container, plugin_ready,
};
pub use registry::{REGISTRY, probe_image, pulled_name};

use std::{
    collections::BTreeMap,
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use kube::Client;
use migdra_fake_nvml::{
    config::GpuConfig,
    state::{FakeState, read_state, update_state},
};

/// DRA driver name used by the cluster.
pub const DRIVER: &str = "gpu.migdra.dev";
/// The kubelet's node name.
pub const NODE: &str = "gpu-node-1";
/// Token of the cluster admin (system:masters).
const ADMIN_TOKEN: &str = "migdra-e2e-admin";
/// Namespace the chart is installed into.
pub const CHART_NAMESPACE: &str = "migdra-system";
/// The chart's controller ServiceAccount (release name `migdra`).
pub const CONTROLLER_ACCOUNT: &str = "migdra-controller";
/// Host path of the fake `nvidia-cdi-hook` (under [`Layout::host_root`]); the fake runtime
/// records hooks, it does not run them.
pub const HOOK_PATH: &str = "/usr/bin/nvidia-cdi-hook";

/// The chart's kubelet-plugin ServiceAccount.
pub const PLUGIN_ACCOUNT: &str = "migdra-kubelet-plugin";

/// What to simulate.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The simulated GPUs, in NVML index order (the fake's per-GPU configuration).
    pub gpus: Vec<GpuConfig>,
    /// Base directory for run directories.
    pub runs_dir: PathBuf,
    /// The controller's `--heartbeat-timeout-seconds` (the e2e tests use a short one).
    pub controller_heartbeat_timeout_seconds: u64,
    /// Let anonymous clients read the kubelet's HTTPS endpoints (for `/metrics`; the
    /// benchmark reads the kubelet's DRA metrics). Off for the tests.
    pub kubelet_anonymous_reads: bool,
    /// The client-side API rate of the scheduler and the controller manager (`--kube-api-qps`,
    /// burst twice that); `None` keeps upstream's defaults (scheduler 50 QPS, controller
    /// manager 20 QPS: its ResourceClaim controller creates each pod's claim and records it in
    /// the pod's status, so 20 QPS caps pods with a claim template at about 10/s).
    pub control_plane_api_qps: Option<u32>,
    /// The container runtime under the kubelet; `None` reads [`RUNTIME_ENV`] (unset:
    /// containerd).
    pub runtime: Option<Runtime>,
    /// How migdra runs; `None` reads [`MIGDRA_MODE_ENV`] (unset: the chart's pods).
    pub migdra_mode: Option<MigdraMode>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            // The two H100s have their device minors swapped relative to their NVML
            // indexes, as on machines whose PCI order differs from the driver's numbering
            // (mig-nvml.md §12): index 0 is minor 1, index 1 is minor 0. Device names carry
            // the minor, so a product that confused the two would act on the wrong GPU.
            gpus: vec![
                GpuConfig::new("H100-80GB", true).with_minor(1),
                GpuConfig::new("H100-80GB", true).with_minor(0),
                GpuConfig::new("A100-SXM4-40GB", true).with_minor(2),
            ],
            runs_dir: repo_root().join("target").join("e2e-runs"),
            controller_heartbeat_timeout_seconds: 20,
            kubelet_anonymous_reads: false,
            control_plane_api_qps: None,
            runtime: None,
            migdra_mode: None,
        }
    }
}

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from("."))
}

/// Paths and ports of a running cluster.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Run directory.
    pub run_dir: PathBuf,
    /// Upstream binaries.
    pub upstream_bin: PathBuf,
    /// migdra's binaries (target/<profile>).
    pub migdra_bin: PathBuf,
    /// The helm binary.
    pub helm: PathBuf,
    /// Admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The kubelet's root dir.
    pub kubelet_root: PathBuf,
    /// CDI spec dir shared by plugin and runtime.
    pub cdi_dir: PathBuf,
    /// Fake CRI's container records.
    pub records_dir: PathBuf,
    /// The simulated GPU host (fake NVML library, config, state, /proc).
    pub gpu_host: PathBuf,
    /// Plugin state dir.
    pub plugin_state: PathBuf,
    /// API server port.
    pub apiserver_port: u16,
    /// The upstream Kubernetes minor the binaries are.
    pub k8s_minor: K8sMinor,
    /// The container runtime under the kubelet.
    pub runtime: Runtime,
    /// How migdra runs: host processes or the chart's pods.
    pub migdra_mode: MigdraMode,
    /// Real path of the logs directory.
    logs: PathBuf,
}

impl Layout {
    /// The fake NVML state file.
    pub fn gpu_state_path(&self) -> PathBuf {
        self.gpu_host.join("fake-nvml-state.json")
    }

    /// The simulated host's NVIDIA driver installation (the plugin's `--driver-root`).
    pub fn driver_root(&self) -> PathBuf {
        self.gpu_host.join("driver-root")
    }

    /// The simulated host's `/dev` (the plugin's `--dev-root`): the control device nodes.
    pub fn dev_root(&self) -> PathBuf {
        self.gpu_host.join("dev")
    }

    /// The simulated host's `/` (the plugin's `--host-root`): holds the fake
    /// `nvidia-cdi-hook` at [`HOOK_PATH`].
    pub fn host_root(&self) -> PathBuf {
        self.gpu_host.join("host")
    }

    /// Log file of a component.
    pub fn log(&self, component: &str) -> PathBuf {
        self.run_dir.join("logs").join(format!("{component}.log"))
    }

    /// The CRI socket the kubelet uses (the fake CRI's or containerd's).
    pub fn cri_socket(&self) -> PathBuf {
        match self.runtime {
            Runtime::FakeCri => self.run_dir.join("cri.sock"),
            Runtime::Containerd => containerd::containerd_socket(&self.run_dir),
        }
    }

    /// The logs directory by its real path (the short `/tmp` link goes away at teardown).
    pub fn logs_dir(&self) -> PathBuf {
        self.logs.clone()
    }
}

/// A running local cluster. Dropping it tears everything down.
pub struct Cluster {
    /// Paths and ports.
    pub layout: Layout,
    /// Admin client.
    pub client: Client,
    components: BTreeMap<&'static str, Child>,
    ports: BTreeMap<&'static str, u16>,
    created_host_dirs: Vec<&'static str>,
    controller_kubeconfig: Option<PathBuf>,
    plugin_kubeconfig: Option<PathBuf>,
    controller_heartbeat_timeout_seconds: u64,
    /// Whether the controller runs with `--keep-memory-counter` ([`Cluster::set_keep_memory_counter`]).
    controller_keep_memory_counter: bool,
    kubelet_anonymous_reads: bool,
    /// The kubelet's `cgroupRoot` (containerd only: pods get QoS cgroups under it).
    kubelet_cgroup_root: Option<String>,
    torn_down: bool,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn kubeconfig_yaml(port: u16, token: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:{port}
    insecure-skip-tls-verify: true
users:
- name: e2e
  user:
    token: {token}
contexts:
- name: e2e
  context:
    cluster: e2e
    user: e2e
current-context: e2e
"
    )
}

/// The client configuration of a kubeconfig for the API server on loopback `port` with
/// bearer `token`.
async fn token_config(port: u16, token: &str) -> anyhow::Result<kube::Config> {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&kubeconfig_yaml(port, token))?;
    Ok(kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?)
}

impl Cluster {
    fn port(&mut self, name: &'static str) -> anyhow::Result<u16> {
        if let Some(p) = self.ports.get(name) {
            return Ok(*p);
        }
        let p = free_port()?;
        self.ports.insert(name, p);
        Ok(p)
    }

    fn start_component(&mut self, name: &'static str, bin: &Path, args: &[&str]) -> anyhow::Result<()> {
        if self.components.contains_key(name) {
            bail!("{name} is already running");
        }
        let log = self.layout.log(name);
        let out = fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let err = out.try_clone()?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        fs::write(
            self.layout.run_dir.join(format!("{name}.pid")),
            child.id().to_string(),
        )?;
        self.components.insert(name, child);
        Ok(())
    }

    /// The loopback port given to a component's endpoint (`"plugin-http"`,
    /// `"controller-http"`, …), once the component was started.
    pub fn endpoint_port(&self, name: &str) -> Option<u16> {
        self.ports.get(name).copied()
    }

    /// The simulated GPUs' current state.
    pub fn gpus(&self) -> anyhow::Result<FakeState> {
        Ok(read_state(&self.layout.gpu_state_path())?)
    }

    /// The position in the fake's state (`FakeState::gpus`, which is NVML index order) of
    /// the GPU with device `minor`, the number device names carry. The two differ on this
    /// cluster, so tests that edit the state of a GPU they know by minor go through this.
    pub fn state_index_of_minor(&self, minor: u32) -> anyhow::Result<usize> {
        self.gpus()?
            .gpus
            .iter()
            .position(|g| g.minor == minor)
            .with_context(|| format!("no simulated GPU has minor {minor}"))
    }

    /// Edits the simulated GPUs' state.
    pub fn update_gpus<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> anyhow::Result<T> {
        Ok(update_state(&self.layout.gpu_state_path(), f)?)
    }

    /// The pid of a running component (for /proc readings: CPU time, memory).
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.components.get(name).map(Child::id)
    }

    /// A port the launcher allocated (`"kubelet"`, `"controller-http"`, `"plugin-http"`, …).
    pub fn allocated_port(&self, name: &str) -> Option<u16> {
        self.ports.get(name).copied()
    }

    /// Resident memory of a running component in KiB (from /proc), for footprint reports.
    pub fn rss_kib(&self, name: &str) -> Option<u64> {
        let pid = self.components.get(name)?.id();
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
    }
}

/// Polls `check` until it returns `Some`, or fails after `timeout`.
pub async fn wait_until<T, F, Fut>(timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if Instant::now() > deadline {
            bail!("condition not met within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Drops ANSI colour sequences (the components' text logs carry them).
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte (a letter).
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
