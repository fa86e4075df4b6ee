//! A local cluster from upstream parts: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and one kubelet (against the fake CRI runtime), plus migdra's controller and
//! kubelet plugin as host processes with the fake NVML library simulating GPUs.
//!
//! Everything lives in one run directory (kept after teardown, for its logs). Teardown stops
//! every process this launcher started (by its pid), unmounts whatever the kubelet mounted
//! under the run directory, and removes the log symlinks the kubelet made for our pods.

use std::{
    collections::BTreeMap,
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use k8s_openapi::{
    api::core::v1::Node, apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{Api, Client, api::PostParams};
use migdra_api::inventory::{GpuNode, pool_name};
use migdra_fake_nvml::{
    config::{CONFIG_FILE_NAME, FakeConfig, GpuConfig},
    state::{FakeState, ensure_state, read_state, update_state},
    testing::{HOST_LIBRARY, fake_library_path},
};
use serde_json::json;

/// DRA driver name used by the cluster.
pub const DRIVER: &str = "gpu.migdra.dev";
/// The kubelet's node name.
pub const NODE: &str = "gpu-node-1";
/// Token of the cluster admin (system:masters).
const ADMIN_TOKEN: &str = "migdra-e2e-admin";
/// Token of the kubelet (system:node:<NODE>).
const KUBELET_TOKEN: &str = "migdra-e2e-kubelet";
/// Namespace the chart is installed into.
pub const CHART_NAMESPACE: &str = "migdra-system";
/// The chart's controller ServiceAccount (release name `migdra`).
pub const CONTROLLER_ACCOUNT: &str = "migdra-controller";
/// The chart's kubelet-plugin ServiceAccount.
pub const PLUGIN_ACCOUNT: &str = "migdra-kubelet-plugin";
/// Chart values for the e2e install: the binaries run as host processes, so the chart's own
/// workloads stay idle; heartbeats are fast so tests see a dead plugin quickly.
const CHART_VALUES: [&str; 3] = [
    "controller.replicas=0",
    "heartbeat.intervalSeconds=3",
    "heartbeat.timeoutSeconds=20",
];
/// Feature gates for the API server and scheduler: the DRA features migdra uses, explicitly.
const FEATURE_GATES: &str = "DRAPartitionableDevices=true,DRADeviceTaints=true,DRAPrioritizedList=true";

/// What to simulate.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// GPUs: (catalog model, MIG mode at boot).
    pub gpus: Vec<(String, bool)>,
    /// Base directory for run directories.
    pub runs_dir: PathBuf,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            gpus: vec![
                ("H100-80GB".into(), true),
                ("H100-80GB".into(), true),
                ("A100-SXM4-40GB".into(), true),
            ],
            runs_dir: repo_root().join("target").join("e2e-runs"),
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
    /// Real path of the logs directory.
    logs: PathBuf,
}

impl Layout {
    /// The fake NVML state file.
    pub fn gpu_state_path(&self) -> PathBuf {
        self.gpu_host.join("fake-nvml-state.json")
    }

    /// Log file of a component.
    pub fn log(&self, component: &str) -> PathBuf {
        self.run_dir.join("logs").join(format!("{component}.log"))
    }

    /// The logs directory by its real path (the short `/tmp` link goes away at teardown).
    pub fn logs_dir(&self) -> PathBuf {
        self.logs.clone()
    }
}

/// Host directories the kubelet creates whatever its root dir is: the device-plugin socket
/// directory and the container-log symlink directory are compiled-in paths. Teardown removes
/// them again when this run created them and they are empty.
const KUBELET_HOST_DIRS: [&str; 3] = [
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet",
    "/var/log/containers",
];

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

/// Runs a build script and returns the last line it printed (the directory it reports).
fn script_output(script: &Path) -> anyhow::Result<PathBuf> {
    let output = Command::new("bash")
        .arg(script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!("{} failed with {}", script.display(), output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let last = text.lines().last().context("build script printed nothing")?;
    Ok(PathBuf::from(last.trim()))
}

/// Finds migdra's binaries: `$MIGDRA_BIN_DIR`, or the cargo target directory of the running
/// executable (tests run from target/<profile>/deps, binaries from target/<profile>).
fn migdra_bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MIGDRA_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        if dir.join("migdra-kubelet-plugin").is_file() && dir.join("migdra-controller").is_file() {
            return Ok(dir.to_path_buf());
        }
    }
    bail!(
        "migdra-controller and migdra-kubelet-plugin not found next to {}; run `cargo build --workspace` first",
        exe.display()
    )
}

impl Cluster {
    /// Builds (or reuses cached) upstream binaries, then starts the whole cluster and waits
    /// until migdra has published the node's pool.
    pub async fn start(config: ClusterConfig) -> anyhow::Result<Self> {
        let root = repo_root();
        let upstream_bin = script_output(&root.join("e2e/upstream/build.sh"))?;
        let helm = script_output(&root.join("charts/tests/helm.sh"))?;
        let migdra_bin = migdra_bin_dir()?;
        fs::create_dir_all(&config.runs_dir)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis();
        let run_dir = config.runs_dir.join(format!("run-{stamp}"));
        fs::create_dir_all(run_dir.join("logs"))?;
        // A short symlink keeps socket paths under the 108-byte limit whatever the checkout path.
        let short = PathBuf::from(format!("/tmp/migdra-e2e-{stamp}"));
        std::os::unix::fs::symlink(&run_dir, &short).context("creating the short run-dir link")?;
        let layout = Layout {
            kubeconfig: short.join("admin.kubeconfig"),
            kubelet_root: short.join("kubelet"),
            cdi_dir: short.join("cdi"),
            records_dir: short.join("records"),
            gpu_host: short.join("gpu-host"),
            plugin_state: short.join("plugin-state"),
            run_dir: short,
            upstream_bin,
            migdra_bin,
            helm,
            apiserver_port: free_port()?,
            logs: run_dir.join("logs"),
        };
        // The fake CRI is rebuilt each run (seconds, thanks to Go's build cache).
        let status = Command::new("go")
            .args(["build", "-o"])
            .arg(layout.run_dir.join("bin/fake-cri"))
            .arg("./cmd/fake-cri")
            .current_dir(root.join("e2e/upstream"))
            .env("GOFLAGS", "-mod=mod")
            .env("CGO_ENABLED", "0")
            .status()
            .context("building the fake CRI")?;
        if !status.success() {
            bail!("building the fake CRI failed");
        }
        write(
            &layout.kubeconfig,
            &kubeconfig_yaml(layout.apiserver_port, ADMIN_TOKEN),
        )?;
        let client = migdra_runtime::kube_client(Some(&layout.kubeconfig))
            .await
            .context("creating the admin client")?;
        let created_host_dirs = KUBELET_HOST_DIRS
            .into_iter()
            .filter(|d| !Path::new(d).exists())
            .collect();
        let mut cluster = Cluster {
            layout,
            client,
            components: BTreeMap::new(),
            ports: BTreeMap::new(),
            created_host_dirs,
            controller_kubeconfig: None,
            plugin_kubeconfig: None,
            torn_down: false,
        };
        if let Err(e) = cluster.boot(&config).await {
            let logs = cluster.layout.logs_dir();
            cluster.teardown();
            return Err(e.context(format!("cluster start failed; logs in {}", logs.display())));
        }
        Ok(cluster)
    }

    async fn boot(&mut self, config: &ClusterConfig) -> anyhow::Result<()> {
        let l = self.layout.clone();
        for dir in [
            &l.kubelet_root,
            &l.cdi_dir,
            &l.records_dir,
            &l.gpu_host,
            &l.plugin_state,
        ] {
            fs::create_dir_all(dir)?;
        }
        self.write_credentials()?;
        self.start_etcd()?;
        self.start_apiserver()?;
        self.wait_apiserver().await?;
        let (kcm_port, scheduler_port) = (self.port("kcm")?, self.port("scheduler")?);
        self.start_component(
            "kube-controller-manager",
            &l.upstream_bin.join("kube-controller-manager"),
            &[
                &format!("--kubeconfig={}", l.kubeconfig.display()),
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                &format!("--secure-port={kcm_port}"),
                &format!(
                    "--service-account-private-key-file={}",
                    l.run_dir.join("sa.key").display()
                ),
                &format!(
                    "--root-ca-file={}",
                    l.run_dir.join("certs/apiserver.crt").display()
                ),
                "--use-service-account-credentials=false",
            ],
        )?;
        self.start_component(
            "kube-scheduler",
            &l.upstream_bin.join("kube-scheduler"),
            &[
                &format!("--kubeconfig={}", l.kubeconfig.display()),
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                &format!("--secure-port={scheduler_port}"),
                &format!("--feature-gates={FEATURE_GATES}"),
            ],
        )?;
        self.install_chart().await?;
        self.write_gpu_host(config)?;
        self.start_fake_cri()?;
        self.start_kubelet()?;
        self.wait_node_ready().await?;
        self.wait_default_service_account().await?;
        self.controller_kubeconfig = Some(self.service_account_kubeconfig(CONTROLLER_ACCOUNT, false).await?);
        self.plugin_kubeconfig = Some(self.service_account_kubeconfig(PLUGIN_ACCOUNT, true).await?);
        self.start_migdra_controller()?;
        self.start_plugin()?;
        self.wait_published(Duration::from_secs(90)).await?;
        Ok(())
    }

    fn port(&mut self, name: &'static str) -> anyhow::Result<u16> {
        if let Some(p) = self.ports.get(name) {
            return Ok(*p);
        }
        let p = free_port()?;
        self.ports.insert(name, p);
        Ok(p)
    }

    fn write_credentials(&self) -> anyhow::Result<()> {
        let dir = &self.layout.run_dir;
        let status = Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(dir.join("sa.key"))
            .arg("2048")
            .stderr(Stdio::null())
            .status()
            .context("running openssl to make the service-account key")?;
        if !status.success() {
            bail!("openssl genrsa failed");
        }
        write(
            &dir.join("tokens.csv"),
            &format!(
                "{ADMIN_TOKEN},admin,admin,system:masters\n{KUBELET_TOKEN},system:node:{NODE},kubelet-{NODE},system:nodes\n"
            ),
        )?;
        write(
            &dir.join("kubelet.kubeconfig"),
            &kubeconfig_yaml(self.layout.apiserver_port, KUBELET_TOKEN),
        )
    }

    fn start_etcd(&mut self) -> anyhow::Result<()> {
        let client = self.port("etcd-client")?;
        let peer = self.port("etcd-peer")?;
        let data = self.layout.run_dir.join("etcd");
        let bin = self.layout.upstream_bin.join("etcd");
        self.start_component(
            "etcd",
            &bin,
            &[
                "--name=e2e",
                &format!("--data-dir={}", data.display()),
                &format!("--listen-client-urls=http://127.0.0.1:{client}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{client}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-cluster=e2e=http://127.0.0.1:{peer}"),
                "--listen-metrics-urls=",
                "--quota-backend-bytes=2147483648",
                "--unsafe-no-fsync",
            ],
        )
    }

    fn start_apiserver(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        let etcd = self.port("etcd-client")?;
        self.start_component(
            "kube-apiserver",
            &l.upstream_bin.join("kube-apiserver"),
            &[
                &format!("--etcd-servers=http://127.0.0.1:{etcd}"),
                &format!("--secure-port={}", l.apiserver_port),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--cert-dir={}", l.run_dir.join("certs").display()),
                &format!("--token-auth-file={}", l.run_dir.join("tokens.csv").display()),
                "--anonymous-auth=false",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                &format!(
                    "--service-account-key-file={}",
                    l.run_dir.join("sa.key").display()
                ),
                &format!(
                    "--service-account-signing-key-file={}",
                    l.run_dir.join("sa.key").display()
                ),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--endpoint-reconciler-type=none",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=true",
                &format!("--feature-gates={FEATURE_GATES}"),
            ],
        )
    }

    async fn wait_apiserver(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let ready = self.client.request_text(http_get("/readyz")?).await;
            if ready.is_ok_and(|body| body.trim() == "ok") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kube-apiserver not ready after 90s");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Installs migdra's Helm chart (CRDs, DeviceClasses, ServiceAccounts, RBAC, the admission
    /// policy). Its workloads stay idle: the controller Deployment is scaled to zero and the
    /// plugin DaemonSet selects GPU-labelled nodes only; migdra's binaries run as host
    /// processes instead, with tokens of the chart's ServiceAccounts.
    async fn install_chart(&self) -> anyhow::Result<()> {
        let l = &self.layout;
        let chart = repo_root().join("charts/migdra");
        let helm_home = l.run_dir.join("helm");
        let helm = |args: &[&str]| -> anyhow::Result<std::process::Output> {
            let output = Command::new(&l.helm)
                .args(args)
                .env("HELM_CONFIG_HOME", helm_home.join("config"))
                .env("HELM_CACHE_HOME", helm_home.join("cache"))
                .env("HELM_DATA_HOME", helm_home.join("data"))
                .env("KUBECONFIG", &l.kubeconfig)
                .output()
                .context("running helm")?;
            if !output.status.success() {
                bail!(
                    "helm {args:?} failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            Ok(output)
        };
        let chart_arg = chart.to_string_lossy().to_string();
        let mut install = vec![
            "install",
            "migdra",
            &chart_arg,
            "--namespace",
            CHART_NAMESPACE,
            "--create-namespace",
        ];
        install.extend(CHART_VALUES.iter().flat_map(|v| ["--set", *v]));
        helm(&install)?;
        // Keep the rendered manifests (default and non-default values) for the dry-run test.
        for (file, extra) in [
            ("chart-default.yaml", None),
            (
                "chart-custom.yaml",
                Some(repo_root().join("charts/tests/values-custom.yaml")),
            ),
        ] {
            let mut args = vec![
                "template".to_string(),
                "migdra".into(),
                chart_arg.clone(),
                "--namespace".into(),
                CHART_NAMESPACE.into(),
                "--include-crds".into(),
            ];
            if let Some(values) = extra {
                args.push("-f".into());
                args.push(values.to_string_lossy().to_string());
            }
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            write(
                &l.run_dir.join(file),
                &String::from_utf8_lossy(&helm(&refs)?.stdout),
            )?;
        }
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        for name in ["gpunodes.gpu.migdra.dev", "migpolicies.gpu.migdra.dev"] {
            wait_until(Duration::from_secs(30), || async {
                let crd = crds.get(name).await.ok()?;
                let established = crd
                    .status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                established.then_some(())
            })
            .await
            .with_context(|| format!("CRD {name} not established"))?;
        }
        Ok(())
    }

    /// Requests a token of one of the chart's ServiceAccounts and writes a kubeconfig with it.
    /// The plugin's token is bound to the Node, which gives it the node name the admission
    /// policy checks.
    async fn service_account_kubeconfig(&self, account: &str, bind_to_node: bool) -> anyhow::Result<PathBuf> {
        let mut request = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"audiences": [], "expirationSeconds": 86400},
        });
        if bind_to_node {
            let node = Api::<Node>::all(self.client.clone()).get(NODE).await?;
            request["spec"]["boundObjectRef"] =
                json!({"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node.metadata.uid});
        }
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        let response: serde_json::Value = accounts
            .create_subresource("token", account, &PostParams::default(), &request)
            .await
            .with_context(|| format!("requesting a token for {account}"))?;
        let token = response["status"]["token"]
            .as_str()
            .context("no token in the TokenRequest response")?;
        let path = self.layout.run_dir.join(format!("{account}.kubeconfig"));
        write(&path, &kubeconfig_yaml(self.layout.apiserver_port, token))?;
        Ok(path)
    }

    fn write_gpu_host(&self, config: &ClusterConfig) -> anyhow::Result<()> {
        let dir = &self.layout.gpu_host;
        fs::copy(fake_library_path()?, dir.join(HOST_LIBRARY))?;
        let fake = FakeConfig {
            gpus: config
                .gpus
                .iter()
                .map(|(model, mig)| GpuConfig::new(model, *mig))
                .collect(),
            uuid_seed: Some(NODE.into()),
            ..FakeConfig::default()
        };
        write(&dir.join(CONFIG_FILE_NAME), &serde_json::to_string_pretty(&fake)?)?;
        ensure_state(&fake, dir)?;
        Ok(())
    }

    fn start_fake_cri(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        self.start_component(
            "fake-cri",
            &l.run_dir.join("bin/fake-cri"),
            &[
                &format!("--listen={}", l.run_dir.join("cri.sock").display()),
                &format!("--record-dir={}", l.records_dir.display()),
                &format!("--cdi-spec-dir={}", l.cdi_dir.display()),
                &format!("--image-fs-path={}", l.run_dir.join("imagefs").display()),
            ],
        )?;
        wait_for_path(&l.run_dir.join("cri.sock"), Duration::from_secs(20))
    }

    fn write_kubelet_config(&mut self) -> anyhow::Result<PathBuf> {
        let l = self.layout.clone();
        let port = self.port("kubelet")?;
        let healthz = self.port("kubelet-healthz")?;
        let path = l.run_dir.join("kubelet-config.yaml");
        // Settings that keep the kubelet inside its own root dir and off the host's cgroups.
        let text = format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
containerRuntimeEndpoint: unix://{cri}
podLogsDir: {logs}
registerNode: true
evictionHard: {{}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
fileCheckFrequency: 5s
",
            cri = l.run_dir.join("cri.sock").display(),
            logs = l.run_dir.join("pod-logs").display(),
        );
        write(&path, &text)?;
        Ok(path)
    }

    fn start_kubelet(&mut self) -> anyhow::Result<()> {
        let config = self.write_kubelet_config()?;
        let l = self.layout.clone();
        self.start_component(
            "kubelet",
            &l.upstream_bin.join("kubelet"),
            &[
                &format!("--config={}", config.display()),
                &format!("--kubeconfig={}", l.run_dir.join("kubelet.kubeconfig").display()),
                &format!("--root-dir={}", l.kubelet_root.display()),
                &format!("--cert-dir={}", l.kubelet_root.join("pki").display()),
                &format!("--hostname-override={NODE}"),
                "--node-ip=127.0.0.1",
                "-v=2",
            ],
        )
    }

    async fn wait_node_ready(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        wait_until(Duration::from_secs(120), || async {
            let node = nodes.get(NODE).await.ok()?;
            let ready = node
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(())
        })
        .await
        .context("the node did not become Ready")
    }

    /// Pods can only be created once the controller manager made the namespace's default
    /// ServiceAccount (the ServiceAccount admission plugin checks it exists).
    async fn wait_default_service_account(&self) -> anyhow::Result<()> {
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client.clone(), "default");
        wait_until(Duration::from_secs(60), || async {
            accounts.get("default").await.ok().map(drop)
        })
        .await
        .context("the default ServiceAccount was not created")
    }

    /// Starts (or restarts) migdra's controller, as the chart's controller ServiceAccount.
    pub fn start_migdra_controller(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        let kubeconfig = self
            .controller_kubeconfig
            .clone()
            .context("no controller token yet")?;
        let http = self.port("controller-http")?;
        self.start_component(
            "migdra-controller",
            &l.migdra_bin.join("migdra-controller"),
            &[
                &format!("--kubeconfig={}", kubeconfig.display()),
                &format!("--driver-name={DRIVER}"),
                &format!("--namespace={CHART_NAMESPACE}"),
                "--identity=e2e-controller",
                &format!("--http-address=127.0.0.1:{http}"),
                "--heartbeat-timeout-seconds=20",
                "--log-level=info,migdra_controller=debug",
            ],
        )
    }

    /// Starts (or restarts) migdra's kubelet plugin, as the chart's plugin ServiceAccount with
    /// a token bound to the node.
    pub fn start_plugin(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        let kubeconfig = self.plugin_kubeconfig.clone().context("no plugin token yet")?;
        let http = self.port("plugin-http")?;
        let grpc = self.port("plugin-grpc-health")?;
        self.start_component(
            "migdra-kubelet-plugin",
            &l.migdra_bin.join("migdra-kubelet-plugin"),
            &[
                &format!("--kubeconfig={}", kubeconfig.display()),
                &format!("--node-name={NODE}"),
                &format!("--driver-name={DRIVER}"),
                &format!("--kubelet-root-dir={}", l.kubelet_root.display()),
                &format!("--cdi-dir={}", l.cdi_dir.display()),
                &format!("--nvml-lib-path={}", l.gpu_host.join(HOST_LIBRARY).display()),
                &format!("--state-dir={}", l.plugin_state.display()),
                &format!("--proc-root={}", l.gpu_host.join("proc-root").display()),
                &format!("--http-address=127.0.0.1:{http}"),
                &format!("--grpc-health-address=127.0.0.1:{grpc}"),
                "--heartbeat-interval-seconds=3",
                "--log-level=info,migdra_kubelet_plugin=debug",
            ],
        )
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

    /// Stops a component: SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, name: &str, grace: Duration) {
        let Some(mut component) = self.components.remove(name) else {
            return;
        };
        signal(&component, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = component.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = component.kill();
        let _ = component.wait();
    }

    /// Kills a component with SIGKILL (a crash).
    pub fn kill(&mut self, name: &str) {
        if let Some(mut component) = self.components.remove(name) {
            let _ = component.kill();
            let _ = component.wait();
        }
    }

    /// Restarts the kubelet (it deletes the node's ResourceSlices when it starts).
    pub fn restart_kubelet(&mut self) -> anyhow::Result<()> {
        self.stop("kubelet", Duration::from_secs(10));
        self.start_kubelet()
    }

    /// The whole node pool is published and the plugin registered.
    pub async fn wait_published(&self, timeout: Duration) -> anyhow::Result<()> {
        let nodes: Api<GpuNode> = Api::all(self.client.clone());
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(self.client.clone());
        let pool = pool_name(NODE, DRIVER);
        wait_until(timeout, || async {
            let node = nodes.get(NODE).await.ok()?;
            let status = node.status?;
            if !status.plugin?.registered {
                return None;
            }
            let expected = status.publication?.slices as usize;
            let list = slices.list(&Default::default()).await.ok()?;
            let ours: Vec<_> = list.items.iter().filter(|s| s.spec.pool.name == pool).collect();
            let generation = ours.iter().map(|s| s.spec.pool.generation).max()?;
            let current = ours
                .iter()
                .filter(|s| s.spec.pool.generation == generation)
                .count();
            (current == expected && expected > 0).then_some(())
        })
        .await
        .context("migdra did not publish the node's pool")
    }

    /// A client authenticated as the kubelet plugin (its node-bound ServiceAccount token).
    pub async fn plugin_client(&self) -> anyhow::Result<Client> {
        let path = self.plugin_kubeconfig.clone().context("no plugin token yet")?;
        Ok(migdra_runtime::kube_client(Some(&path)).await?)
    }

    /// The simulated GPUs' current state.
    pub fn gpus(&self) -> anyhow::Result<FakeState> {
        Ok(read_state(&self.layout.gpu_state_path())?)
    }

    /// Edits the simulated GPUs' state.
    pub fn update_gpus<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> anyhow::Result<T> {
        Ok(update_state(&self.layout.gpu_state_path(), f)?)
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

    /// Stops everything this launcher started, in reverse dependency order, and cleans up
    /// mounts, sockets and log symlinks. Idempotent.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        for name in [
            "migdra-kubelet-plugin",
            "migdra-controller",
            "kubelet",
            "fake-cri",
            "kube-scheduler",
            "kube-controller-manager",
            "kube-apiserver",
            "etcd",
        ] {
            self.stop(name, Duration::from_secs(10));
        }
        let names: Vec<&'static str> = self.components.keys().copied().collect();
        for name in names {
            self.stop(name, Duration::from_secs(5));
        }
        let run_dir = fs::canonicalize(&self.layout.run_dir).unwrap_or_else(|_| self.layout.run_dir.clone());
        unmount_under(&run_dir);
        unmount_under(&self.layout.run_dir);
        remove_log_symlinks_into(&[&run_dir, &self.layout.run_dir]);
        for socket in find_sockets(&run_dir) {
            let _ = fs::remove_file(socket);
        }
        for dir in &self.created_host_dirs {
            let _ = fs::remove_file(Path::new(dir).join("kubelet.sock"));
            let _ = fs::remove_dir(dir); // only succeeds when empty
        }
        let _ = fs::remove_file(&self.layout.run_dir); // the short symlink
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn signal(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    mounts.dedup();
    mounts
}

fn unmount_under(dir: &Path) {
    for _ in 0..3 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return;
        }
        for mount in mounts {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&mount)
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The kubelet links container logs into /var/log/containers; remove the links that point
/// into our run directory (by either of its paths; nothing else there is touched).
fn remove_log_symlinks_into(dirs: &[&Path]) {
    let Ok(entries) = fs::read_dir("/var/log/containers") else {
        return;
    };
    for entry in entries.flatten() {
        if let Ok(target) = fs::read_link(entry.path())
            && dirs.iter().any(|dir| target.starts_with(dir))
        {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn find_sockets(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_socket() {
                out.push(entry.path());
            }
        }
    }
    out
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

fn http_get(path: &str) -> anyhow::Result<http::Request<Vec<u8>>> {
    Ok(http::Request::get(path).body(Vec::new())?)
}

fn wait_for_path(path: &Path, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() > deadline {
            bail!("{} did not appear within {timeout:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
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
