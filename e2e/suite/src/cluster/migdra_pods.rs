//! Acting on migdra and observing it the way an operator and the node's runtime can, in both
//! modes: killing the kubelet plugin (SIGKILL of its container's process, which the kubelet
//! restarts), taking it off the node and back (the DaemonSet's nodeSelector through `helm
//! upgrade`, then the rollback), reading the components' logs (the kubelet's pod log dir, CRI
//! lines, across container restarts) and scraping their `/metrics` (the pods' addresses live
//! in the node's network namespace, reached through `nsenter` and `socat`). With host
//! processes the same methods act on the launcher's processes and log files.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::Api;

use super::{CHART_NAMESPACE, Cluster, MigdraMode, PLUGIN, containerd::node_netns, wait_until};

/// What the plugin logs once the kubelet accepted its registration.
const REGISTERED: &str = "kubelet registered the plugin";
/// The plugin's container in the chart's DaemonSet.
pub const PLUGIN_CONTAINER: &str = "kubelet-plugin";
/// The controller's component name (host process and log file; the chart's Deployment).
pub const CONTROLLER: &str = "migdra-controller";
/// The node label [`Cluster::plugin_down`] makes the plugin DaemonSet require: no node has it.
const PLUGIN_DOWN_SELECTOR: &str = r#"kubeletPlugin.nodeSelector={"migdra-e2e/plugin-down":"true"}"#;
/// How long the plugin may take to come back (a pod start with an image pull included).
const PLUGIN_BACK: Duration = Duration::from_secs(120);

/// How often each of a component's log files said the kubelet registered it
/// ([`Cluster::registrations`]); compared with a later count by [`Cluster::registered_since`].
/// Per file, because the kubelet removes the logs of old pods and old container runs.
#[derive(Clone, Debug, Default)]
pub struct Registrations(BTreeMap<PathBuf, usize>);

/// The plugin's container as it was killed ([`Cluster::kill_plugin`]).
#[derive(Clone, Debug, Default)]
pub struct KilledPlugin {
    /// The plugin pod (chart mode).
    pod: String,
    /// Its container's restarts before the kill.
    restarts: i32,
}

/// The plugin container's status in a plugin pod.
pub fn plugin_container(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_deref()?
        .iter()
        .find(|s| s.name == PLUGIN_CONTAINER)
}

/// A pod's plugin container runs, Ready, and the pod is not being deleted.
pub fn plugin_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none() && plugin_container(pod).is_some_and(|s| s.ready)
}

/// The message of a CRI log line (`<time> <stream> <P|F> <message>`) and whether it goes on
/// in the next line (`P`, a partial line).
fn cri_message(line: &str) -> (&str, bool) {
    let mut fields = line.splitn(4, ' ');
    let (_time, _stream, tag) = (fields.next(), fields.next(), fields.next());
    (fields.next().unwrap_or_default(), tag == Some("P"))
}

/// A CRI log file's text as the container wrote it.
fn cri_log_text(path: &Path) -> String {
    let raw = fs::read_to_string(path).unwrap_or_default();
    let mut text = String::with_capacity(raw.len());
    for line in raw.lines() {
        let (message, partial) = cri_message(line);
        text.push_str(message);
        if !partial {
            text.push('\n');
        }
    }
    text
}

/// The log files under a pod's log dir (`<container>/<restart>.log`), by restart.
fn pod_log_files(pod_dir: &Path, container: &str) -> Vec<PathBuf> {
    let mut files: Vec<(u32, PathBuf)> = fs::read_dir(pod_dir.join(container))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let restart = path.file_name()?.to_str()?.strip_suffix(".log")?.parse().ok()?;
            Some((restart, path))
        })
        .collect();
    files.sort();
    files.into_iter().map(|(_, p)| p).collect()
}

/// The time of a log file's first line (CRI lines start with it): orders the logs of pods.
fn first_timestamp(path: &Path) -> String {
    fs::read_to_string(path)
        .ok()
        .and_then(|t| t.split(' ').next().map(str::to_string))
        .unwrap_or_default()
}

impl Cluster {
    fn chart_mode(&self) -> bool {
        self.layout.migdra_mode == MigdraMode::Chart
    }

    /// The kubelet's pod log dir.
    fn pod_logs_dir(&self) -> PathBuf {
        self.layout.run_dir.join("pod-logs")
    }

    /// The log files of a component ([`PLUGIN`] or [`CONTROLLER`]), oldest first: its log
    /// file as a host process, else those of its pods' containers that the kubelet still keeps
    /// (`<ns>_<pod>_<uid>/<container>/<restart>.log`; the chart names the pods after the
    /// component).
    fn component_log_files(&self, component: &str) -> Vec<PathBuf> {
        if !self.chart_mode() {
            return vec![self.layout.log(component)];
        }
        let prefix = format!("{CHART_NAMESPACE}_{component}-");
        let container = if component == PLUGIN {
            PLUGIN_CONTAINER
        } else {
            "controller"
        };
        let mut files: Vec<PathBuf> = fs::read_dir(self.pod_logs_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .flat_map(|e| pod_log_files(&e.path(), container))
            .collect();
        files.sort_by_cached_key(|f| first_timestamp(f));
        files
    }

    /// A component's log ([`PLUGIN`] or [`CONTROLLER`]) without the terminal colour codes
    /// tracing writes around field names: the host process's log file, or what its pods'
    /// containers wrote, oldest first. Empty when there is none yet.
    pub fn component_log(&self, component: &str) -> String {
        let text: String = self
            .component_log_files(component)
            .iter()
            .map(|f| self.component_log_text(f))
            .collect();
        super::strip_ansi(&text)
    }

    /// What one of [`Cluster::component_log_files`] holds: the host process's log as written,
    /// or a container log's messages.
    fn component_log_text(&self, file: &Path) -> String {
        if self.chart_mode() {
            cri_log_text(file)
        } else {
            fs::read_to_string(file).unwrap_or_default()
        }
    }

    /// What one pod's container wrote, across its restarts (those the kubelet still keeps),
    /// without colour codes.
    pub fn pod_log(&self, pod: &Pod, container: &str) -> String {
        let dir = self.pod_logs_dir().join(format!(
            "{}_{}_{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default()
        ));
        let text: String = pod_log_files(&dir, container)
            .iter()
            .map(|f| cri_log_text(f))
            .collect();
        super::strip_ansi(&text)
    }

    /// How often each of the component's log files says the kubelet registered the plugin.
    pub fn registrations(&self, component: &str) -> Registrations {
        Registrations(
            self.component_log_files(component)
                .into_iter()
                .map(|f| {
                    let count = self.component_log_text(&f).matches(REGISTERED).count();
                    (f, count)
                })
                .collect(),
        )
    }

    /// Whether some log of the component says the kubelet registered it more often than at
    /// `before` (a new log counts from zero).
    pub fn registered_since(&self, component: &str, before: &Registrations) -> bool {
        self.registrations(component)
            .0
            .iter()
            .any(|(file, count)| *count > before.0.get(file).copied().unwrap_or(0))
    }

    /// Waits until the kubelet registered the component again since `before`.
    pub async fn wait_registered_since(&self, component: &str, before: &Registrations) -> anyhow::Result<()> {
        wait_until(Duration::from_secs(60), || async {
            self.registered_since(component, before).then_some(())
        })
        .await
        .with_context(|| format!("the kubelet did not register {component} again"))
    }

    /// The one plugin pod, Ready.
    pub async fn the_plugin_pod(&self) -> anyhow::Result<Pod> {
        let pods = self.plugin_pods().await?;
        match pods.as_slice() {
            [pod] if plugin_ready(pod) => Ok(pod.clone()),
            _ => bail!(
                "expected one Ready plugin pod, found {:?}",
                pods.iter()
                    .map(|p| (p.metadata.name.clone(), plugin_ready(p)))
                    .collect::<Vec<_>>()
            ),
        }
    }

    /// Sends `signal` to the main process of the plugin pod's container (its pid from
    /// containerd).
    fn signal_plugin_container(&self, pod: &Pod, signal: libc::c_int) -> anyhow::Result<()> {
        let container = plugin_container(pod)
            .and_then(|s| s.container_id.clone())
            .context("the plugin pod has no container id")?;
        let pid = i32::try_from(self.container_pid(&container)?)?;
        // SAFETY: kill(2) on the pid containerd reports for the plugin's container.
        #[allow(unsafe_code)]
        let sent = unsafe { libc::kill(pid, signal) };
        ensure!(
            sent == 0,
            "kill -{signal} {pid}: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    /// The kubelet plugin crashes: SIGKILL of its process (in chart mode its container's main
    /// process; the kubelet restarts the container). Bring it back with
    /// [`Cluster::restart_killed_plugin`].
    pub async fn kill_plugin(&mut self) -> anyhow::Result<KilledPlugin> {
        if !self.chart_mode() {
            self.kill(PLUGIN);
            return Ok(KilledPlugin::default());
        }
        let pod = self.the_plugin_pod().await?;
        let restarts = plugin_container(&pod).map_or(0, |s| s.restart_count);
        self.signal_plugin_container(&pod, libc::SIGKILL)?;
        Ok(KilledPlugin {
            pod: pod.metadata.name.clone().unwrap_or_default(),
            restarts,
        })
    }

    /// After [`Cluster::kill_plugin`]: waits until the kubelet restarted the plugin's container
    /// (one more restart, Ready, its last run ended by the SIGKILL) and registered it again (the new run's log says so); a host
    /// process is started again. Returns the plugin pod (chart mode).
    pub async fn restart_killed_plugin(&mut self, killed: &KilledPlugin) -> anyhow::Result<Option<Pod>> {
        if !self.chart_mode() {
            let before = self.registrations(PLUGIN);
            self.start_plugin()?;
            self.wait_registered_since(PLUGIN, &before).await?;
            return Ok(None);
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        let pod = wait_until(PLUGIN_BACK, || async {
            let pod = pods.get(&killed.pod).await.ok()?;
            let status = plugin_container(&pod)?;
            (status.restart_count > killed.restarts && status.ready).then_some(pod)
        })
        .await
        .with_context(|| {
            format!(
                "the kubelet did not restart the plugin container of {}",
                killed.pod
            )
        })?;
        let exit = plugin_container(&pod)
            .and_then(|s| s.last_state.as_ref()?.terminated.as_ref())
            .context("no last state of the killed plugin container")?;
        ensure!(
            exit.exit_code == 128 + libc::SIGKILL,
            "the killed plugin container's last state: {exit:?}"
        );
        self.wait_plugin_pod_registered(&pod).await?;
        Ok(Some(pod))
    }

    /// Waits until the current run of the pod's plugin container logged its registration.
    async fn wait_plugin_pod_registered(&self, pod: &Pod) -> anyhow::Result<()> {
        let restarts = plugin_container(pod).map_or(0, |s| s.restart_count);
        let log = self
            .pod_logs_dir()
            .join(format!(
                "{CHART_NAMESPACE}_{}_{}",
                pod.metadata.name.as_deref().unwrap_or_default(),
                pod.metadata.uid.as_deref().unwrap_or_default()
            ))
            .join(PLUGIN_CONTAINER)
            .join(format!("{restarts}.log"));
        wait_until(Duration::from_secs(60), || async {
            cri_log_text(&log).contains(REGISTERED).then_some(())
        })
        .await
        .with_context(|| format!("{} does not say the kubelet registered the plugin", log.display()))
    }

    /// The kubelet plugin dies and stays down, unregistered by nobody: a host process is
    /// SIGKILLed; in chart mode the plugin container's process is frozen (SIGSTOP, so it
    /// cannot deregister when asked to stop), the DaemonSet is kept off the node (`helm
    /// upgrade` with a nodeSelector no node matches), and once the kubelet deletes the pod
    /// the frozen process is SIGKILLed. Returns once no plugin pod is left.
    pub async fn plugin_down(&mut self) -> anyhow::Result<()> {
        if !self.chart_mode() {
            self.kill(PLUGIN);
            return Ok(());
        }
        let pod = self.the_plugin_pod().await?;
        self.signal_plugin_container(&pod, libc::SIGSTOP)?;
        if let Err(e) = self.upgrade_chart_json(&[PLUGIN_DOWN_SELECTOR]) {
            let _ = self.signal_plugin_container(&pod, libc::SIGCONT);
            return Err(e);
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        let name = pod.metadata.name.clone().unwrap_or_default();
        wait_until(Duration::from_secs(60), || async {
            let now = pods.get_opt(&name).await.ok()?;
            now.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
                .then_some(())
        })
        .await
        .context("the DaemonSet did not delete the plugin pod off the node")?;
        // Gone already when the kubelet's own SIGKILL came first.
        let _ = self.signal_plugin_container(&pod, libc::SIGKILL);
        wait_until(Duration::from_secs(60), || async {
            self.plugin_pods().await.ok()?.is_empty().then_some(())
        })
        .await
        .context("a plugin pod stayed on the node")
    }

    /// After [`Cluster::plugin_down`]: the plugin runs again and is registered, and the pool
    /// is published (chart mode: the release rolled back to its installed values).
    pub async fn plugin_up(&mut self) -> anyhow::Result<()> {
        if !self.chart_mode() {
            let before = self.registrations(PLUGIN);
            self.start_plugin()?;
            return self.wait_registered_since(PLUGIN, &before).await;
        }
        self.restore_chart().await?;
        let pod = self.the_plugin_pod().await?;
        self.wait_plugin_pod_registered(&pod).await
    }

    /// The address of a component's metrics endpoint: the host process's loopback port, or
    /// the pod address and `http` container port of its Ready pod (the newest, when a rollout
    /// runs two), in the node's network namespace.
    async fn metrics_address(&self, component: &str) -> anyhow::Result<(String, u16)> {
        if !self.chart_mode() {
            let endpoint = if component == PLUGIN {
                "plugin-http"
            } else {
                "controller-http"
            };
            let port = self
                .endpoint_port(endpoint)
                .with_context(|| format!("{endpoint} has no port: not started?"))?;
            return Ok(("127.0.0.1".into(), port));
        }
        let pods = if component == PLUGIN {
            self.plugin_pods().await?
        } else {
            self.release_pods("controller").await?
        };
        let ready = |p: &Pod| {
            p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .is_some_and(|c| c.iter().all(|c| c.ready))
        };
        let pod = pods
            .iter()
            .filter(|p| ready(p))
            .max_by_key(|p| p.metadata.creation_timestamp.clone())
            .with_context(|| format!("{component} has no Ready pod"))?;
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .with_context(|| format!("{component}'s pod has no address"))?;
        let port = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some("http"))
            .map(|p| p.container_port)
            .with_context(|| format!("{component}'s pod has no http port"))?;
        Ok((ip, u16::try_from(port)?))
    }

    /// GETs `/metrics` from a component ([`PLUGIN`] or [`CONTROLLER`]) as Prometheus would:
    /// over HTTP/1.0 (the server closes after the response), from the host's loopback or, for
    /// a pod, from the node's network namespace. Returns the body of a 200 response.
    pub async fn scrape_metrics(&self, component: &str) -> anyhow::Result<String> {
        let (ip, port) = self.metrics_address(component).await?;
        let request = format!("GET /metrics HTTP/1.0\r\nHost: {ip}\r\n\r\n");
        let mut command = if self.chart_mode() {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", node_netns(&self.layout.run_dir).display()))
                .arg("socat");
            c
        } else {
            Command::new("socat")
        };
        // shut-none: no half-close after the request (the server would drop the connection
        // unanswered); -t: then wait for the whole response, until the server closes.
        command.args(["-t", "10", "-T", "10", "-", &format!("TCP:{ip}:{port},shut-none")]);
        let response = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
            let mut child = command
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("running socat")?;
            child
                .stdin
                .take()
                .context("socat's stdin")?
                .write_all(request.as_bytes())?;
            let out = child.wait_with_output()?;
            ensure!(
                out.status.success(),
                "socat to {ip}:{port}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        })
        .await??;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .with_context(|| format!("{component}: no HTTP header in the response"))?;
        ensure!(
            head.starts_with("HTTP/1.") && head.contains(" 200 "),
            "{component}: {head}"
        );
        Ok(body.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_lines_give_the_messages_and_join_partial_lines() {
        let dir = std::env::temp_dir().join(format!("migdra-cri-log-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("0.log");
        fs::write(
            &path,
            "2026-12-04T19:07:36.385Z stdout F starting version=1\n\
             2026-12-04T19:07:36.386Z stderr P a long \n\
             2026-12-04T19:07:36.386Z stderr F line\n\
             2026-12-04T19:07:36.387Z stdout F \n",
        )
        .unwrap();
        assert_eq!(cri_log_text(&path), "starting version=1\na long line\n\n");
        assert_eq!(cri_log_text(&dir.join("missing.log")), "");
        fs::remove_dir_all(&dir).unwrap();
    }
}
