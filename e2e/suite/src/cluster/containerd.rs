//! The real container runtime, the suite's default: the kubelet runs on containerd 2.x and
//! runc (built by `e2e/runtime/build.sh`); `MIGDRA_E2E_RUNTIME=fake-cri` (the benchmark) puts
//! the fake CRI there instead.
//!
//! Everything containerd keeps lives under `<run>/ctrd` (root, state, sockets, shim sockets,
//! runc's root, the pods' network namespaces). containerd runs inside a network namespace made
//! for the run (bind-mounted on `<run>/ctrd/netns/node`), so the CNI bridge and the pods'
//! addresses never touch the host's; the kubelet stays in the host's namespace and talks to
//! containerd over its unix socket. containerd also has a mount namespace of its own (a slave
//! of the host's), so that its mounts vanish with it and the simulated host's
//! `nvidia-cdi-hook` shows at its host path there; the kubelet root is a shared mount so that
//! pod volumes reach it. The pods' cgroups live under a cgroup root of the run's own
//! ([`Cluster::prepare_cgroup_root`]). `e2e/runtime/images.sh` builds a pause (sandbox) image
//! and a busybox image, imported here with `ctr`. Teardown, and the next run
//! after a crash, go through `e2e/runtime/clean.sh` (shared with the runtime's smoke test).
//!
//! The kubelet runs in the node's network namespace too, as on a real node: its HTTP probes
//! reach the pods' addresses and containerd's stream server (`kubectl exec`). The two
//! namespaces meet only through unix sockets in the run dir, relayed by socat
//! ([`Cluster::start_relays`]): the API server (host loopback) is reached in the node's
//! namespace at the `kubernetes` Service's ClusterIP, port 443 (in-cluster config), and at
//! 127.0.0.1 on its own port (the kubelet's kubeconfig); the kubelet's port is relayed back to
//! the host's loopback, where the API server reaches it (`kubectl logs`). With migdra from its
//! chart, its images are pulled from a registry in the node's namespace ([`super::registry`]);
//! containerd's config points at that registry's hosts dir.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::json;

use super::{Cluster, HOOK_PATH, NODE, repo_root, write};

/// The environment variable that selects the runtime: `fake-cri`, or unset/empty/`containerd`.
pub const RUNTIME_ENV: &str = "MIGDRA_E2E_RUNTIME";
/// The pod sandbox image (`e2e/runtime/pause/pause.c`), pinned in containerd's config.
pub const PAUSE_IMAGE: &str = "migdra.dev/e2e/pause:e2e";
/// Debian's static busybox, for test containers (`imagePullPolicy: Never`).
pub const BUSYBOX_IMAGE: &str = "migdra.dev/e2e/busybox:e2e";
/// The busybox image the shared workloads (`crate::workload`) name: [`BUSYBOX_IMAGE`] is
/// tagged with it too, so their pods start on containerd without a pull.
const WORKLOAD_IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.36";
/// The pods' subnet on the node's bridge (inside the node's network namespace).
pub const POD_SUBNET: &str = "10.88.0.0/24";
/// containerd's namespace for the CRI.
const CRI_NAMESPACE: &str = "k8s.io";
/// The `kubernetes` Service's ClusterIP: the first address of the API server's
/// `--service-cluster-ip-range` (a SAN of its self-signed serving certificate). Pods find it in
/// `KUBERNETES_SERVICE_HOST`; the node's namespace has it on `lo`, with a relay behind it.
pub const API_SERVICE_IP: &str = "10.96.0.1";
/// The API server's ClusterIP range (`--service-cluster-ip-range`).
pub(super) const SERVICE_CLUSTER_IP_RANGE: &str = "10.96.0.0/16";

/// The container runtime under the kubelet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Runtime {
    /// The fake CRI (`e2e/upstream/cmd/fake-cri`): records containers, runs nothing.
    FakeCri,
    /// containerd with runc: real containers.
    #[default]
    Containerd,
}

impl Runtime {
    /// The runtime [`RUNTIME_ENV`] selects.
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var(RUNTIME_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::Containerd),
            Ok(v) if v.is_empty() || v == "containerd" => Ok(Self::Containerd),
            Ok(v) if v == "fake-cri" => Ok(Self::FakeCri),
            Ok(v) => bail!("{RUNTIME_ENV}={v:?}: expected \"containerd\" or \"fake-cri\""),
            Err(e) => bail!("{RUNTIME_ENV}: {e}"),
        }
    }
}

/// The containerd directory of a run dir.
pub(super) fn ctrd_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("ctrd")
}

/// The node's network namespace of a run dir (a bind mount of the namespace).
pub(super) fn node_netns(run_dir: &Path) -> PathBuf {
    ctrd_dir(run_dir).join("netns/node")
}

/// The unix socket of containerd (CRI runtime and image service) of a run dir.
pub(super) fn containerd_socket(run_dir: &Path) -> PathBuf {
    ctrd_dir(run_dir).join("containerd.sock")
}

/// The kubelet's cgroup root for a run: `migdra-e2e-<stamp>` under this process's memory
/// cgroup (so the pods count against the memory limits the run itself has), the same path in
/// every hierarchy, as the kubelet uses one name for all (where this process sits elsewhere
/// in another hierarchy, the path's parents are made there: [`Cluster::prepare_cgroup_root`]).
pub(super) fn cgroup_root_for(run_dir: &Path) -> anyhow::Result<String> {
    let name = run_dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("run dir without a name")?;
    let stamp = name.rsplit('-').next().unwrap_or(name);
    let own = own_cgroup("memory")?;
    Ok(format!("{}/migdra-e2e-{stamp}", own.trim_end_matches('/')))
}

/// This process's cgroup in the v1 hierarchy of `controller`.
fn own_cgroup(controller: &str) -> anyhow::Result<String> {
    let text = fs::read_to_string("/proc/self/cgroup")?;
    text.lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrls
                .split(',')
                .any(|c| c == controller)
                .then(|| path.to_string())
        })
        .next()
        .with_context(|| format!("no {controller} cgroup in /proc/self/cgroup"))
}

/// Mount points of the cgroup v1 hierarchies (from /proc/self/mountinfo).
fn cgroup_v1_mounts() -> anyhow::Result<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mount = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == "cgroup").then(|| PathBuf::from(mount))
        })
        .collect())
}

/// Runs a script of `e2e/runtime` that prints a directory last, and returns that directory.
fn run_script(script: &str, args: &[&Path]) -> anyhow::Result<String> {
    run_script_with(script, args, &[])
}

/// Runs an e2e/runtime script with `args` and `env`; returns the last line it printed.
pub(super) fn run_script_with(script: &str, args: &[&Path], env: &[(&str, &Path)]) -> anyhow::Result<String> {
    let path = repo_root().join("e2e/runtime").join(script);
    let output = Command::new("bash")
        .arg(&path)
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    if !output.status.success() {
        bail!("{} failed with {}", path.display(), output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.lines().last().unwrap_or_default().trim().to_string())
}

/// Cleans up after the containerd of run dir `run_dir` (`clean.sh`): containers, containerd
/// and its shims, mounts, cgroups. `alias` is the run dir's other path (the short link).
pub(super) fn clean(run_dir: &Path, alias: Option<&Path>) -> anyhow::Result<()> {
    let ctrd = ctrd_dir(run_dir);
    if !ctrd.exists() || ctrd.join("cleaned").exists() {
        return Ok(());
    }
    let alias = alias.map(ctrd_dir);
    let mut args: Vec<&Path> = vec![&ctrd];
    args.extend(alias.as_deref());
    run_script("clean.sh", &args).map(drop)
}

/// Cleans up what earlier runs in `runs_dir` left when their launcher died before teardown
/// (runs whose launcher still lives are left alone).
pub(super) fn clean_leftovers(runs_dir: &Path, current: &Path) -> anyhow::Result<()> {
    let Ok(entries) = fs::read_dir(runs_dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let ctrd = ctrd_dir(&dir);
        if dir == current || !ctrd.is_dir() || ctrd.join("cleaned").exists() {
            continue;
        }
        let launcher = fs::read_to_string(ctrd.join("launcher.pid")).unwrap_or_default();
        if !launcher.trim().is_empty() && Path::new("/proc").join(launcher.trim()).exists() {
            continue;
        }
        let stamp = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("run-"))
            .unwrap_or_default()
            .to_string();
        let short = PathBuf::from(format!("/tmp/migdra-e2e-{stamp}"));
        eprintln!("e2e: cleaning up containerd leftovers of {}", dir.display());
        clean(&dir, Some(&short))?;
        if fs::read_link(&short).is_ok_and(|t| t == dir) {
            let _ = fs::remove_file(&short);
        }
    }
    Ok(())
}

impl Cluster {
    /// Records 127.0.0.1 as the node's InternalIP, so that the API server finds the kubelet
    /// for `kubectl logs`: the kubelet listens on loopback only and refuses a loopback
    /// `--node-ip` ("failed to validate nodeIP: nodeIP can't be loopback address"), so it
    /// publishes no address at all; since that check fails before it touches the addresses,
    /// it leaves these alone.
    pub(super) async fn publish_loopback_node_address(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = json!({"status": {"addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": NODE},
        ]}});
        nodes
            .patch_status(NODE, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .context("recording the node's loopback address")?;
        Ok(())
    }

    /// Creates the kubelet's cgroup root ([`cgroup_root_for`]) in every cgroup v1 hierarchy,
    /// recording the directories it made (`ctrd/cgroups-created`) for the cleanup; in the
    /// cpuset hierarchy each new cgroup gets its parent's CPUs and memory nodes.
    fn prepare_cgroup_root(&self) -> anyhow::Result<String> {
        let ctrd = ctrd_dir(&self.layout.run_dir);
        let root = cgroup_root_for(&fs::canonicalize(&self.layout.run_dir)?)?;
        write(&ctrd.join("cgroup-root"), &root)?;
        let mut created = String::new();
        for mount in cgroup_v1_mounts()? {
            let mut dir = mount.clone();
            for part in root.trim_start_matches('/').split('/') {
                let parent = dir.clone();
                dir.push(part);
                if dir.exists() {
                    continue;
                }
                fs::create_dir(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
                created.push_str(&format!("{}\n", dir.display()));
                write(&ctrd.join("cgroups-created"), &created)?;
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    if let Ok(value) = fs::read_to_string(parent.join(file)) {
                        fs::write(dir.join(file), value.trim())
                            .with_context(|| format!("writing {}", dir.join(file).display()))?;
                    }
                }
            }
        }
        Ok(root)
    }

    /// Starts containerd in a network namespace of its own, with the local images
    /// (`images.sh`) imported; returns the kubelet's cgroup root.
    pub(super) fn start_containerd(&mut self, runs_dir: &Path) -> anyhow::Result<String> {
        let run = self.layout.run_dir.clone();
        let real_run = fs::canonicalize(&run)?;
        clean_leftovers(runs_dir, &real_run)?;
        let bin = PathBuf::from(run_script("build.sh", &[])?);
        let images = PathBuf::from(run_script("images.sh", &[])?);
        let ctrd = ctrd_dir(&run);
        for dir in [
            "root",
            "state",
            "tmp",
            "runc",
            "s",
            "opt",
            "cni/net.d",
            "cni/ipam",
            "netns",
        ] {
            fs::create_dir_all(ctrd.join(dir))?;
        }
        write(&ctrd.join("launcher.pid"), &std::process::id().to_string())?;
        let cgroup_root = self.prepare_cgroup_root()?;
        write(
            &ctrd.join("containerd.toml"),
            &containerd_config(&ctrd, &bin, &self.layout.cdi_dir),
        )?;
        write(
            &ctrd.join("cni/net.d/10-migdra-e2e.conflist"),
            &cni_config(&ctrd.join("cni/ipam")),
        )?;
        // The node's network namespace: a file under the run dir, bind-mounted by unshare.
        let netns = node_netns(&run);
        fs::write(&netns, b"")?;
        run_checked(
            Command::new("unshare")
                .arg(format!("--net={}", netns.display()))
                .arg("true"),
        )?;
        run_checked(
            Command::new("nsenter")
                .arg(format!("--net={}", netns.display()))
                .args(["ip", "link", "set", "lo", "up"]),
        )?;
        run_checked(
            Command::new("nsenter")
                .arg(format!("--net={}", netns.display()))
                .args(["ip", "addr", "add", &format!("{API_SERVICE_IP}/32"), "dev", "lo"]),
        )?;
        // The kubelet root becomes a shared mount, so that the volumes the kubelet mounts
        // there reach containerd's mount namespace (below): the run dir's kubelet dir
        // bind-mounted on the kubelet's `--root-dir` itself when that is a directory outside
        // the run dir (chart mode), else on itself. The kubelet bind-mounts its root again at
        // every start unless that path is a shared mount point (by the path it was given, not
        // the one symlinks resolve to), and each bind on a shared mount doubles the stack:
        // a tmpfs volume mounted below it then survives its unmount, and the pod never goes.
        let run_kubelet = fs::canonicalize(self.layout.run_dir.join("kubelet"))?;
        let kubelet_root = if self.layout.kubelet_root.starts_with(&self.layout.run_dir) {
            run_kubelet.clone()
        } else {
            write(
                &ctrd.join("kubelet-root"),
                self.layout
                    .kubelet_root
                    .to_str()
                    .context("non-UTF-8 kubelet root")?,
            )?;
            self.layout.kubelet_root.clone()
        };
        run_checked(
            Command::new("mount")
                .arg("--bind")
                .arg(&run_kubelet)
                .arg(&kubelet_root),
        )?;
        run_checked(Command::new("mount").arg("--make-shared").arg(&kubelet_root))?;
        self.spawn_containerd(&bin)?;
        let ctr = |args: &[&str]| ctr(&bin, &run, args);
        let list = fs::read_to_string(images.join("images.txt"))?;
        for line in list.lines() {
            let (_, tarball) = line.split_once('\t').context("bad images.txt line")?;
            ctr(&["images", "import", "--snapshotter", "overlayfs", tarball])?;
        }
        ctr(&["images", "tag", "--force", BUSYBOX_IMAGE, WORKLOAD_IMAGE])?;
        Ok(cgroup_root)
    }

    /// Starts containerd (the component `containerd`) in the node's network namespace and a
    /// mount namespace of its own, and waits until its CRI plugins are loaded. Also what a
    /// restart of containerd runs: its state is all under `<run>/ctrd`.
    pub(super) fn spawn_containerd(&mut self, bin: &Path) -> anyhow::Result<()> {
        let run = self.layout.run_dir.clone();
        let ctrd = ctrd_dir(&run);
        let netns = node_netns(&run);
        // containerd runs in a mount namespace of its own (a slave of the host's), where the
        // simulated host's directory of nvidia-cdi-hook is overlaid on the host's, read-only:
        // the runtime runs CDI hooks by their host path ([`HOOK_PATH`]), which exists only
        // under the simulated host root. Its mounts are made shared too (and stay slaves of
        // the host's), as a real node's are: runc refuses `mountPropagation: HostToContainer`
        // (the chart's driver root and /dev) from a private mount, which the host's / may be.
        // unshare, sh and nsenter all exec (nsenter forks
        // only with --pid or --fork), so the component's pid is containerd's.
        let hook_dir = Path::new(HOOK_PATH)
            .parent()
            .context("hook path without a directory")?;
        let hook_lower = self.layout.host_root().join(hook_dir.strip_prefix("/")?);
        let path = format!(
            "PATH={}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let tmpdir = format!("TMPDIR={}", ctrd.join("tmp").display());
        let net = format!("--net={}", netns.display());
        let containerd = bin.join("containerd");
        let config = ctrd.join("containerd.toml");
        let utf8 = |p: &Path| p.to_str().map(str::to_string).context("non-UTF-8 path");
        let args: Vec<String> = vec![
            "--mount".into(),
            "--propagation".into(),
            "slave".into(),
            "--".into(),
            "sh".into(),
            "-c".into(),
            r#"mount --make-rshared / && mount -t overlay migdra-e2e-cdi-hook -o "lowerdir=$1:$2" "$2" && shift 2 && exec "$@""#.into(),
            "sh".into(),
            utf8(&hook_lower)?,
            utf8(hook_dir)?,
            "nsenter".into(),
            net,
            "env".into(),
            path,
            tmpdir,
            utf8(&containerd)?,
            "--config".into(),
            utf8(&config)?,
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.start_component("containerd", Path::new("unshare"), &args)?;
        let ctr = |args: &[&str]| ctr(bin, &run, args);
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = ctr(&["version"]) {
            if !self.is_running("containerd") || Instant::now() > deadline {
                return Err(e.context(format!(
                    "containerd did not come up (log: {})",
                    self.layout.log("containerd").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let plugins = ctr(&["plugins", "ls"])?;
        for (kind, id) in [
            ("io.containerd.snapshotter.v1", "overlayfs"),
            ("io.containerd.grpc.v1", "cri"),
            ("io.containerd.cri.v1", "runtime"),
        ] {
            let ok = plugins.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.first() == Some(&kind) && f.get(1) == Some(&id) && f.last() == Some(&"ok")
            });
            if !ok {
                bail!("containerd plugin {kind} {id} did not load:\n{plugins}");
            }
        }
        Ok(())
    }
}

impl Cluster {
    /// Starts the socat relays between the host's loopback and the node's network namespace
    /// (see the module docs), each a component of its own; the sockets live in `<run>/ctrd`.
    /// The node-side listeners run in the namespace through `nsenter`, which execs socat, so
    /// each component's pid is its socat's; socat forks one child per connection.
    pub(super) fn start_relays(&mut self) -> anyhow::Result<()> {
        let run = self.layout.run_dir.clone();
        let ctrd = ctrd_dir(&run);
        let net = format!("--net={}", node_netns(&run).display());
        let api_port = self.layout.apiserver_port;
        let kubelet_port = self.port("kubelet")?;
        let api_socket = ctrd.join("apiserver.sock");
        let kubelet_socket = ctrd.join("kubelet.sock");
        let unix_listen = |p: &Path| format!("UNIX-LISTEN:{},fork,unlink-early,mode=600", p.display());
        let unix_connect = |p: &Path| format!("UNIX-CONNECT:{}", p.display());
        let tcp_listen = |ip: &str, port: u16| format!("TCP-LISTEN:{port},bind={ip},fork,reuseaddr");
        let relays: [(&'static str, bool, String, String); 5] = [
            (
                "relay-apiserver-host",
                false,
                unix_listen(&api_socket),
                format!("TCP:127.0.0.1:{api_port}"),
            ),
            (
                "relay-apiserver-service",
                true,
                tcp_listen(API_SERVICE_IP, 443),
                unix_connect(&api_socket),
            ),
            (
                "relay-apiserver-node",
                true,
                tcp_listen("127.0.0.1", api_port),
                unix_connect(&api_socket),
            ),
            (
                "relay-kubelet-node",
                true,
                unix_listen(&kubelet_socket),
                format!("TCP:127.0.0.1:{kubelet_port}"),
            ),
            (
                "relay-kubelet-host",
                false,
                tcp_listen("127.0.0.1", kubelet_port),
                unix_connect(&kubelet_socket),
            ),
        ];
        for (name, in_node, from, to) in relays {
            let mut args: Vec<&str> = Vec::new();
            let bin = if in_node {
                args.extend([net.as_str(), "socat"]);
                "nsenter"
            } else {
                "socat"
            };
            args.extend([from.as_str(), to.as_str()]);
            self.start_component(name, Path::new(bin), &args)?;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for socket in [&api_socket, &kubelet_socket] {
            while !socket.exists() {
                if Instant::now() > deadline {
                    bail!("the relay socket {} did not appear", socket.display());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }
}

fn run_checked(command: &mut Command) -> anyhow::Result<()> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Whether this process has CAP_SYS_RESOURCE, which lowering a process's `oom_score_adj`
/// (the kubelet asks -998 for pod sandboxes) takes; some sandboxes run root without it.
fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// containerd's config (`e2e/runtime/containerd.toml`, shared with smoke.sh): every path under `ctrd`; CDI specs
/// from the cluster's CDI dir (where migdra's plugin writes them); the local pause image
/// pinned as the sandbox image; runc with the cgroupfs driver; without CAP_SYS_RESOURCE, the
/// OOM score adjustments the kubelet asks are clamped to containerd's own (runc would fail
/// with "nsexec: failed to update /proc/self/oom_score_adj: Permission denied").
fn containerd_config(ctrd: &Path, bin: &Path, cdi_dir: &Path) -> String {
    include_str!("../../../runtime/containerd.toml")
        .replace("@RUN@", &ctrd.display().to_string())
        .replace("@BIN@", &bin.display().to_string())
        .replace("@CDI_DIR@", &cdi_dir.display().to_string())
        .replace("@SANDBOX_IMAGE@", PAUSE_IMAGE)
        .replace("@RESTRICT_OOM_SCORE_ADJ@", &(!has_cap_sys_resource()).to_string())
}

/// The pod network: a bridge (in containerd's network namespace) with host-local addresses
/// from [`POD_SUBNET`] and a default route through it (the node's addresses, among them
/// [`API_SERVICE_IP`], are local there); no masquerading (nothing leaves the node's namespace).
fn cni_config(ipam_dir: &Path) -> String {
    format!(
        r#"{{
  "cniVersion": "1.0.0",
  "name": "migdra-e2e",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "migdra0",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{POD_SUBNET}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}],
        "dataDir": "{}"
      }}
    }}
  ]
}}
"#,
        ipam_dir.display()
    )
}

/// Runs `ctr` on the run's containerd, in the CRI's namespace; returns what it printed.
fn ctr(bin: &Path, run: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(bin.join("ctr"))
        .arg("--address")
        .arg(containerd_socket(run))
        .args(["--namespace", CRI_NAMESPACE])
        .args(args)
        .output()
        .context("running ctr")?;
    if !output.status.success() {
        bail!("ctr {args:?}: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

impl Cluster {
    /// Stops the run's containerd (SIGTERM to its pid, SIGKILL after 10 s) and starts it
    /// again with the same configuration and state; the pods' containers keep running under
    /// their shims meanwhile, as on a node whose containerd restarts.
    pub fn restart_containerd(&mut self) -> anyhow::Result<()> {
        let bin = PathBuf::from(run_script("build.sh", &[])?);
        self.stop("containerd", Duration::from_secs(10));
        self.spawn_containerd(&bin)
    }

    /// How many mounts sit at the kubelet's root dir (in this mount namespace): one, the
    /// run's shared bind mount, unless a kubelet start stacked its own on it.
    pub fn kubelet_root_mounts(&self) -> anyhow::Result<usize> {
        let root = self
            .layout
            .kubelet_root
            .to_str()
            .context("non-UTF-8 kubelet root")?;
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
        Ok(mountinfo
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(root))
            .count())
    }

    /// The host pid of a container's main process (`containerd://<id>` or the bare id, as in
    /// a pod's container status), from containerd's task list.
    pub fn container_pid(&self, container_id: &str) -> anyhow::Result<u32> {
        let id = container_id.strip_prefix("containerd://").unwrap_or(container_id);
        let bin = PathBuf::from(run_script("build.sh", &[])?);
        let tasks = ctr(&bin, &self.layout.run_dir, &["tasks", "ls"])?;
        tasks
            .lines()
            .find_map(|l| {
                let mut fields = l.split_whitespace();
                (fields.next() == Some(id)).then(|| fields.next()?.parse().ok())?
            })
            .with_context(|| format!("container {id} has no running task:\n{tasks}"))
    }
}
