//! Booting the cluster: the upstream binaries (built or cached by `e2e/upstream/build.sh`),
//! helm, the run directory and its credentials; etcd, kube-apiserver, the chart, the controller
//! manager and scheduler; the simulated GPU host, the fake CRI (or containerd, see
//! [`super::containerd`]) and the kubelet. Ends by starting migdra (see [`super::migdra`]) and
//! waiting until it published the node's pool.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use k8s_openapi::{
    api::core::v1::Node, apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::Api;
use migdra_fake_nvml::{
    config::{CONFIG_FILE_NAME, DEFAULT_DRIVER_VERSION, FakeConfig},
    driver_root::{DriverRootOptions, create_driver_root},
    state::ensure_state,
    testing::{HOST_LIBRARY, fake_library_path},
};

use super::{
    ADMIN_TOKEN, CHART_NAMESPACE, CONTROLLER_ACCOUNT, Cluster, ClusterConfig, DRIVER, HOOK_PATH, K8sMinor,
    Layout, MigdraMode, NODE, PLUGIN_ACCOUNT, Runtime,
    containerd::{SERVICE_CLUSTER_IP_RANGE, node_netns},
    free_port, kubeconfig_yaml,
    migdra::migdra_bin_dir,
    registry::migdra_images_dir,
    repo_root,
    teardown::KUBELET_HOST_DIRS,
    wait_until, write,
};

/// Token of the kubelet (system:node:<NODE>).
const KUBELET_TOKEN: &str = "migdra-e2e-kubelet";
/// Chart values for the e2e install with migdra as host processes: the chart's own workloads
/// stay idle; heartbeats are fast so tests see a dead plugin quickly (with the chart's pods,
/// `e2e/values-fake-gpu.yaml` sets them).
const HOST_PROCESS_VALUES: [&str; 3] = [
    "controller.replicas=0",
    "heartbeat.intervalSeconds=3",
    "heartbeat.timeoutSeconds=20",
];
/// Chart values for every e2e install: the device-plugin names are served (nvidia.com/gpu,
/// nvidia.com/mig-<profile>), with a class for 1g.12gb, a profile no simulated GPU has.
const CHART_VALUES: [&str; 2] = [
    "deviceClasses.extendedResources.enabled=true",
    "deviceClasses.profiles.names={1g.10gb,1g.10gb+me,2g.20gb,3g.40gb,7g.80gb,1g.12gb}",
];

/// Runs a build script and returns the last line it printed (the directory it reports).
pub(super) fn script_output(script: &Path) -> anyhow::Result<PathBuf> {
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

impl Cluster {
    /// Builds (or reuses cached) upstream binaries, then starts the whole cluster and waits
    /// until migdra has published the node's pool.
    pub async fn start(config: ClusterConfig) -> anyhow::Result<Self> {
        let root = repo_root();
        // build.sh reads the same variable and builds (or finds) that minor's binaries.
        let k8s_minor = K8sMinor::from_env()?;
        let upstream_bin = script_output(&root.join("e2e/upstream/build.sh"))?;
        let helm = script_output(&root.join("charts/tests/helm.sh"))?;
        let migdra_bin = migdra_bin_dir()?;
        let runtime = match config.runtime {
            Some(runtime) => runtime,
            None => Runtime::from_env()?,
        };
        let migdra_mode = match config.migdra_mode {
            Some(mode) => mode,
            None => MigdraMode::from_env()?,
        };
        if migdra_mode == MigdraMode::Chart && runtime != Runtime::Containerd {
            bail!(
                "migdra's chart runs its pods on containerd only: with MIGDRA_E2E_RUNTIME=fake-cri, set MIGDRA_E2E_MIGDRA=host"
            );
        }
        fs::create_dir_all(&config.runs_dir)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis();
        let run_dir = config.runs_dir.join(format!("run-{stamp}"));
        fs::create_dir_all(run_dir.join("logs"))?;
        // A short symlink keeps socket paths under the 108-byte limit whatever the checkout path.
        let short = PathBuf::from(format!("/tmp/migdra-e2e-{stamp}"));
        std::os::unix::fs::symlink(&run_dir, &short).context("creating the short run-dir link")?;
        // The chart's plugin names its registration socket with its pod's UID
        // (plugins_registry/<driver>-<pod UID>-reg.sock), 115 bytes under the run dir's
        // kubelet root: a shorter path for it, a directory the run dir's kubelet root is
        // bind-mounted on ([`Cluster::start_containerd`]; unmounted and removed at teardown).
        let kubelet_root = match migdra_mode {
            MigdraMode::HostProcesses => short.join("kubelet"),
            MigdraMode::Chart => {
                fs::create_dir_all(run_dir.join("kubelet"))?;
                let dir = PathBuf::from(format!("/tmp/mk-{stamp}"));
                fs::create_dir(&dir).context("creating the short kubelet-root directory")?;
                dir
            }
        };
        // The chart's plugin keeps its state in its default dir, under the kubelet's.
        let plugin_state = match migdra_mode {
            MigdraMode::HostProcesses => short.join("plugin-state"),
            MigdraMode::Chart => kubelet_root.join("plugins").join(DRIVER),
        };
        let layout = Layout {
            kubeconfig: short.join("admin.kubeconfig"),
            kubelet_root,
            cdi_dir: short.join("cdi"),
            records_dir: short.join("records"),
            gpu_host: short.join("gpu-host"),
            plugin_state,
            run_dir: short,
            upstream_bin,
            migdra_bin,
            helm,
            apiserver_port: free_port()?,
            k8s_minor,
            runtime,
            migdra_mode,
            logs: run_dir.join("logs"),
        };
        // The fake CRI is rebuilt each run (seconds, thanks to Go's build cache).
        if runtime == Runtime::FakeCri {
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
            controller_heartbeat_timeout_seconds: config.controller_heartbeat_timeout_seconds,
            controller_keep_memory_counter: false,
            kubelet_anonymous_reads: config.kubelet_anonymous_reads,
            kubelet_cgroup_root: None,
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
            ]
            .into_iter()
            .map(String::from)
            .chain(client_rate(config.control_plane_api_qps))
            .chain(node_gates(l.k8s_minor))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        )?;
        let mut scheduler_args = vec![
            format!("--kubeconfig={}", l.kubeconfig.display()),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={scheduler_port}"),
            format!("--feature-gates={}", l.k8s_minor.control_plane_gates()),
            // The bench reads the scheduler's own metrics (attempt and DRA plugin times) and
            // CPU profiles (BENCH_SCHEDULER_PROFILE_SECONDS); it listens on loopback only.
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics,/debug/pprof/*".into(),
        ];
        scheduler_args.extend(client_rate(config.control_plane_api_qps));
        let scheduler_args: Vec<&str> = scheduler_args.iter().map(String::as_str).collect();
        self.start_component(
            "kube-scheduler",
            &l.upstream_bin.join("kube-scheduler"),
            &scheduler_args,
        )?;
        let from_chart = l.migdra_mode == MigdraMode::Chart;
        if !from_chart {
            self.install_chart().await?;
        }
        self.write_gpu_host(config)?;
        match l.runtime {
            Runtime::FakeCri => self.start_fake_cri()?,
            Runtime::Containerd => {
                let images_dir = if from_chart {
                    self.install_fake_nvml_in_driver_root()?;
                    Some(migdra_images_dir()?)
                } else {
                    None
                };
                self.kubelet_cgroup_root = Some(self.start_containerd(&config.runs_dir)?);
                // migdra's images are pulled by the kubelet, from the registry in the node's
                // network namespace.
                if let Some(dir) = images_dir {
                    self.start_registry(&dir)?;
                }
                self.start_relays()?;
            }
        }
        self.start_kubelet()?;
        self.wait_node_ready().await?;
        if l.runtime == Runtime::Containerd {
            self.publish_loopback_node_address().await?;
        }
        self.wait_default_service_account().await?;
        if from_chart {
            // The chart's pods, once the node is up and the images are imported.
            self.install_chart().await?;
            self.wait_chart_workloads_ready(Duration::from_secs(180)).await?;
            self.wait_published(Duration::from_secs(90)).await?;
            return Ok(());
        }
        self.controller_kubeconfig = Some(self.service_account_kubeconfig(CONTROLLER_ACCOUNT, false).await?);
        self.plugin_kubeconfig = Some(self.service_account_kubeconfig(PLUGIN_ACCOUNT, true).await?);
        self.start_migdra_controller()?;
        self.start_plugin()?;
        self.wait_published(Duration::from_secs(90)).await?;
        Ok(())
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
                &format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"),
                "--endpoint-reconciler-type=none",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=true",
                &format!("--feature-gates={}", l.k8s_minor.control_plane_gates()),
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
    /// policy). With migdra as host processes its workloads stay idle: the controller
    /// Deployment is scaled to zero and the plugin DaemonSet selects GPU-labelled nodes only;
    /// migdra's binaries run as host processes instead, with tokens of the chart's
    /// ServiceAccounts. From the chart, `e2e/values-fake-gpu.yaml` runs them as pods.
    async fn install_chart(&self) -> anyhow::Result<()> {
        let l = &self.layout;
        let chart = super::chart_ops::chart_dir();
        let helm = |args: &[&str]| self.helm(args);
        let chart_arg = chart.to_string_lossy().to_string();
        let mut install = vec![
            "install",
            "migdra",
            &chart_arg,
            "--namespace",
            CHART_NAMESPACE,
            "--create-namespace",
        ];
        let values_file;
        match l.migdra_mode {
            MigdraMode::HostProcesses => {
                install.extend(HOST_PROCESS_VALUES.iter().flat_map(|v| ["--set", *v]));
            }
            MigdraMode::Chart => {
                values_file = self.fake_gpu_values()?.to_string_lossy().to_string();
                install.extend(["--values", values_file.as_str()]);
            }
        }
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

    fn write_gpu_host(&self, config: &ClusterConfig) -> anyhow::Result<()> {
        let dir = &self.layout.gpu_host;
        fs::copy(fake_library_path()?, dir.join(HOST_LIBRARY))?;
        let fake = FakeConfig {
            gpus: config.gpus.clone(),
            uuid_seed: Some(NODE.into()),
            ..FakeConfig::default()
        };
        write(&dir.join(CONFIG_FILE_NAME), &serde_json::to_string_pretty(&fake)?)?;
        ensure_state(&fake, dir)?;
        // The driver's user-space files, of the version the fake NVML reports.
        let version = fake.driver_version.as_deref().unwrap_or(DEFAULT_DRIVER_VERSION);
        let driver_root = self.layout.driver_root();
        fs::create_dir_all(&driver_root)?;
        create_driver_root(&driver_root, version, &DriverRootOptions::default())
            .with_context(|| format!("creating the fake driver root {}", driver_root.display()))?;
        // The control device nodes every CUDA container needs (the plugin checks they exist).
        let dev = self.layout.dev_root();
        fs::create_dir_all(&dev)?;
        for node in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
            fs::write(dev.join(node), b"")?;
        }
        // NVIDIA's nvidia-cdi-hook on the "host", built from the container toolkit's Go module
        // at the version the plugin image ships (containerd runs it for real; the fake CRI
        // records the hooks only).
        let built = script_output(&repo_root().join("e2e/runtime/cdi-hook.sh"))?;
        let hook = self.layout.host_root().join(HOOK_PATH.trim_start_matches('/'));
        if let Some(parent) = hook.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::copy(&built, &hook)
            .with_context(|| format!("copying {} to {}", built.display(), hook.display()))?;
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

    fn write_kubelet_config(&mut self, anonymous_reads: bool) -> anyhow::Result<PathBuf> {
        let l = self.layout.clone();
        let port = self.port("kubelet")?;
        let healthz = self.port("kubelet-healthz")?;
        let path = l.run_dir.join("kubelet-config.yaml");
        // Settings that keep the kubelet inside its own root dir and off the host's cgroups.
        // On containerd, pods get real cgroups: the kubelet's QoS hierarchy (kubepods/…)
        // under a cgroup root of the run's own; the apiserver reaches the kubelet (logs)
        // without a client certificate, so reads are anonymous (the kubelet listens on
        // loopback only).
        let (cgroups, anonymous_reads) = match &self.kubelet_cgroup_root {
            Some(root) => (format!("cgroupsPerQOS: true\ncgroupRoot: {root}\n"), true),
            None => ("cgroupsPerQOS: false\n".to_string(), anonymous_reads),
        };
        let text = format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
{cgroups}enforceNodeAllocatable: []
failSwapOn: false
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: {anonymous_reads}}}
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
            cri = l.cri_socket().display(),
            logs = l.run_dir.join("pod-logs").display(),
        );
        write(&path, &text)?;
        Ok(path)
    }

    /// Starts the kubelet (again, after [`Cluster::stop_kubelet`]); it deletes the node's
    /// ResourceSlices when it starts.
    pub fn start_kubelet(&mut self) -> anyhow::Result<()> {
        let config = self.write_kubelet_config(self.kubelet_anonymous_reads)?;
        let l = self.layout.clone();
        let kubelet = l.upstream_bin.join("kubelet");
        // On containerd the kubelet runs in the node's network namespace (nsenter execs it).
        let (bin, netns) = match l.runtime {
            Runtime::FakeCri => (kubelet.clone(), Vec::new()),
            Runtime::Containerd => (
                PathBuf::from("nsenter"),
                vec![
                    format!("--net={}", node_netns(&l.run_dir).display()),
                    kubelet.display().to_string(),
                ],
            ),
        };
        let args: Vec<String> = netns
            .into_iter()
            .chain([
                format!("--config={}", config.display()),
                format!("--kubeconfig={}", l.run_dir.join("kubelet.kubeconfig").display()),
                format!("--root-dir={}", l.kubelet_root.display()),
                format!("--cert-dir={}", l.kubelet_root.join("pki").display()),
                format!("--hostname-override={NODE}"),
                "--node-ip=127.0.0.1".into(),
                "-v=2".into(),
            ])
            .chain(node_gates(l.k8s_minor))
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.start_component("kubelet", &bin, &args)
    }

    /// Restarts the kubelet (it deletes the node's ResourceSlices when it starts).
    pub fn restart_kubelet(&mut self) -> anyhow::Result<()> {
        self.stop_kubelet();
        self.start_kubelet()
    }

    /// Stops the kubelet (SIGTERM) and leaves it down; the pods' containers keep running in
    /// the fake runtime, as they do in a real one.
    pub fn stop_kubelet(&mut self) {
        self.stop("kubelet", Duration::from_secs(10));
    }

    /// Waits until the node reports Ready.
    pub async fn wait_node_ready(&self) -> anyhow::Result<()> {
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
}

/// A component's client-side API rate flags: `qps`, burst twice that; none for upstream's
/// defaults.
/// The controller-manager's and kubelet's `--feature-gates`, where the minor needs any.
fn node_gates(minor: K8sMinor) -> Option<String> {
    minor.node_gates().map(|gates| format!("--feature-gates={gates}"))
}

fn client_rate(qps: Option<u32>) -> Vec<String> {
    qps.map(|qps| {
        vec![
            format!("--kube-api-qps={qps}"),
            format!("--kube-api-burst={}", qps.saturating_mul(2)),
        ]
    })
    .unwrap_or_default()
}
