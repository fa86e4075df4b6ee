//! Workloads for the tests and the demo: claim templates, pods, and what happened to them
//! (allocation, what the containers saw from inside, events).

use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context, bail};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::{Event, Pod, PodCondition},
    resource::v1::{DeviceRequestAllocationResult, ResourceClaim, ResourceClaimTemplate},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, LogParams, PostParams},
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::cluster::{DRIVER, probe_image, wait_until};

/// Namespace of all test workloads.
pub const NAMESPACE: &str = "default";

/// CEL selecting one exact MIG profile.
pub fn profile_is(profile: &str) -> String {
    format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"")
}

/// CEL selecting devices of one parent GPU (MIG) or that GPU itself.
pub fn on_gpu(uuid: &str) -> String {
    format!(
        "(has(device.attributes[\"{DRIVER}\"].parentUUID) && device.attributes[\"{DRIVER}\"].parentUUID == \"{uuid}\") || \
         (has(device.attributes[\"{DRIVER}\"].uuid) && device.attributes[\"{DRIVER}\"].uuid == \"{uuid}\")"
    )
}

/// One request of a claim template.
#[derive(Clone, Debug)]
pub enum Request {
    /// Exactly one device of `class` matching every CEL selector.
    Exactly {
        /// DeviceClass.
        class: String,
        /// CEL selectors.
        selectors: Vec<String>,
    },
    /// The first alternative that can be satisfied: (subrequest name, class, selectors).
    FirstAvailable(Vec<(String, String, Vec<String>)>),
}

fn selectors_json(selectors: &[String]) -> Value {
    Value::Array(
        selectors
            .iter()
            .map(|s| json!({"cel": {"expression": s}}))
            .collect(),
    )
}

/// Creates a ResourceClaimTemplate with one request named `gpu`, plus optional opaque config.
pub async fn create_template(
    client: &Client,
    name: &str,
    request: Request,
    config: Option<Value>,
) -> anyhow::Result<()> {
    create_template_tolerating(client, name, request, config, &[]).await
}

/// [`create_template`] whose request tolerates the device taints with these keys (every
/// effect): the scheduler may then allocate devices that carry them.
pub async fn create_template_tolerating(
    client: &Client,
    name: &str,
    request: Request,
    config: Option<Value>,
    tolerated_taints: &[&str],
) -> anyhow::Result<()> {
    let tolerations: Vec<Value> = tolerated_taints
        .iter()
        .map(|key| json!({"key": key, "operator": "Exists"}))
        .collect();
    // A device request (exactly, or one firstAvailable alternative) with the tolerations.
    let device_request = |mut request: Value| {
        if !tolerations.is_empty() {
            request["tolerations"] = Value::Array(tolerations.clone());
        }
        request
    };
    let request = match request {
        Request::Exactly { class, selectors } => {
            json!({"name": "gpu", "exactly": device_request(json!({"deviceClassName": class, "selectors": selectors_json(&selectors)}))})
        }
        Request::FirstAvailable(alternatives) => {
            json!({"name": "gpu", "firstAvailable": alternatives.iter().map(|(n, class, sel)| {
            device_request(json!({"name": n, "deviceClassName": class, "selectors": selectors_json(sel)}))
        }).collect::<Vec<_>>()})
        }
    };
    let mut spec = json!({"devices": {"requests": [request]}});
    if let Some(parameters) = config {
        spec["devices"]["config"] =
            json!([{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]);
    }
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"spec": spec},
    }))?;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &template)
        .await?;
    Ok(())
}

/// Creates a pod with one container `main` running the gpu-probe with `command` as its
/// arguments (`["sleep", "3600"]`: report, then wait; see `e2e/runtime/gpu-probe`), using a
/// claim from `template`. `restart_never` makes a finished container end the pod.
pub async fn create_pod(
    client: &Client,
    name: &str,
    template: &str,
    command: &[&str],
    restart_never: bool,
) -> anyhow::Result<()> {
    create_pod_with(client, name, template, &[("main", command)], restart_never).await
}

/// Creates a pod with one gpu-probe container `main` (report, then wait) that uses one claim
/// per template, the claims named `claim-0`, `claim-1`, … in the order of `templates`.
pub async fn create_pod_with_claims(client: &Client, name: &str, templates: &[&str]) -> anyhow::Result<()> {
    let claims: Vec<Value> = (0..templates.len())
        .map(|i| json!({"name": format!("claim-{i}")}))
        .collect();
    let resource_claims: Vec<Value> = templates
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"name": format!("claim-{i}"), "resourceClaimTemplateName": t}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
        "spec": {
            "restartPolicy": "Always",
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": probe_image(), "args": ["sleep"], "resources": {"claims": claims}}],
            "resourceClaims": resource_claims,
        }
    }))?;
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// Creates a pod whose gpu-probe containers, each with its arguments (see [`create_pod`]),
/// all use the one claim made from `template`.
pub async fn create_pod_with(
    client: &Client,
    name: &str,
    template: &str,
    containers: &[(&str, &[&str])],
    restart_never: bool,
) -> anyhow::Result<()> {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(n, args)| json!({"name": n, "image": probe_image(), "args": args, "resources": {"claims": [{"name": "gpu"}]}}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
        "spec": {
            "restartPolicy": if restart_never { "Never" } else { "Always" },
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": containers,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        }
    }))?;
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// The pod's phase.
pub async fn phase(client: &Client, pod: &str) -> Option<String> {
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .get(pod)
        .await
        .ok()?
        .status?
        .phase
}

/// Waits until the pod reaches `want`.
pub async fn wait_phase(client: &Client, pod: &str, want: &str, timeout: Duration) -> anyhow::Result<()> {
    let result = wait_until(timeout, || async {
        (phase(client, pod).await.as_deref() == Some(want)).then_some(())
    })
    .await;
    let last = phase(client, pod).await;
    result.with_context(|| format!("pod {pod} did not reach {want} (phase now {last:?})"))
}

/// Waits until the scheduler reports the pod unschedulable (`PodScheduled=False`, reason
/// `Unschedulable`) and checks it is bound to no node: "the scheduler refused", as opposed to a
/// pod that is scheduled but Pending because its prepare fails. Returns the condition.
pub async fn wait_unschedulable(
    client: &Client,
    pod: &str,
    timeout: Duration,
) -> anyhow::Result<PodCondition> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let condition = wait_until(timeout, || async {
        pods.get(pod)
            .await
            .ok()?
            .status?
            .conditions?
            .into_iter()
            .find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
    })
    .await
    .with_context(|| format!("pod {pod} never got PodScheduled=False reason Unschedulable"))?;
    let bound = pods.get(pod).await?.spec.and_then(|s| s.node_name);
    if let Some(node) = bound {
        bail!("pod {pod} is bound to {node} although the scheduler reported it unschedulable");
    }
    Ok(condition)
}

/// The ResourceClaim generated for the pod's claim `gpu`.
pub async fn pod_claim(client: &Client, pod: &str) -> anyhow::Result<ResourceClaim> {
    pod_claim_named(client, pod, "gpu").await
}

/// The ResourceClaim generated for the pod's claim `claim`.
pub async fn pod_claim_named(client: &Client, pod: &str, claim: &str) -> anyhow::Result<ResourceClaim> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let name = wait_until(Duration::from_secs(30), || async {
        let pod = pods.get(pod).await.ok()?;
        pod.status?
            .resource_claim_statuses?
            .into_iter()
            .find(|s| s.name == claim)?
            .resource_claim_name
    })
    .await
    .with_context(|| format!("pod {pod} has no generated claim"))?;
    Ok(Api::<ResourceClaim>::namespaced(client.clone(), NAMESPACE)
        .get(&name)
        .await?)
}

/// The allocation results of a claim (none while it is unallocated).
pub fn allocation_results(claim: &ResourceClaim) -> Vec<DeviceRequestAllocationResult> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
}

/// The allocated (request, device) pairs of a claim.
pub fn allocated(claim: &ResourceClaim) -> Vec<(String, String)> {
    allocation_results(claim)
        .into_iter()
        .map(|r| (r.request, r.device))
        .collect()
}

/// Deletes pods and waits until they are gone.
pub async fn delete_pods(client: &Client, pods: &[&str]) -> anyhow::Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for pod in pods {
        let _ = api.delete(pod, &DeleteParams::default()).await;
    }
    for pod in pods {
        wait_until(Duration::from_secs(90), || async {
            api.get_opt(pod)
                .await
                .ok()
                .and_then(|p| p.is_none().then_some(()))
        })
        .await
        .with_context(|| format!("pod {pod} was not deleted"))?;
    }
    Ok(())
}

/// The label every test object carries.
pub const TEST_LABEL: &str = "app.kubernetes.io/part-of=migdra-e2e";

/// Deletes every test Job (first: the Job controller would recreate their pods), pod and
/// claim template.
pub async fn delete_all(client: &Client) -> anyhow::Result<()> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), NAMESPACE);
    jobs.delete_collection(
        &DeleteParams::background(),
        &ListParams::default().labels(TEST_LABEL),
    )
    .await?;
    wait_until(Duration::from_secs(60), || async {
        let left = jobs.list(&ListParams::default().labels(TEST_LABEL)).await.ok()?;
        left.items.is_empty().then_some(())
    })
    .await
    .context("test Jobs were not deleted")?;
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let pods = api.list(&ListParams::default().labels(TEST_LABEL)).await?;
    let names: Vec<String> = pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    delete_pods(client, &refs).await?;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    templates
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    Ok(())
}

/// Events about a pod, newest last.
pub async fn pod_events(client: &Client, pod: &str) -> anyhow::Result<Vec<Event>> {
    let api: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let list = api
        .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await?;
    Ok(list.items)
}

/// What a workload container reported from inside: the gpu-probe's report
/// (`e2e/runtime/gpu-probe`), read from the container's log.
#[derive(Clone, Debug, Deserialize)]
pub struct ContainerView {
    /// Pod name.
    #[serde(skip)]
    pub pod: String,
    /// Container name.
    #[serde(skip)]
    pub container: String,
    /// How often the kubelet restarted the container (its status's `restartCount`) when
    /// the report was read: the report is the current container's.
    #[serde(skip)]
    pub restart_count: i32,
    /// Every `/dev/nvidia*` and `/dev/nvidia-caps/*` entry.
    pub devices: Vec<DeviceView>,
    /// Every `NVIDIA_*`, `CUDA_*` and `MIGDRA_*` variable.
    pub env: BTreeMap<String, String>,
    /// What the dynamic linker does with the driver's sonames, by soname.
    pub libraries: BTreeMap<String, LibraryView>,
    /// The directories `/etc/ld.so.conf.d` lists.
    pub ld_so_conf: Vec<String>,
    /// The container's mounts (`/proc/self/mountinfo`).
    pub mounts: Vec<MountView>,
    /// `nvidia-smi -L`, when nvidia-smi is on the container's PATH.
    pub nvidia_smi: Option<NvidiaSmiView>,
}

/// An entry of the container's `/dev/nvidia*` or `/dev/nvidia-caps`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct DeviceView {
    /// Path in the container.
    pub path: String,
    /// `c` (character device), `b`, `dir`, `link`, `file` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Major number of a device node.
    #[serde(default)]
    pub major: Option<i64>,
    /// Minor number of a device node.
    #[serde(default)]
    pub minor: Option<i64>,
}

/// What the dynamic linker does with one soname in the container.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct LibraryView {
    /// The path the linker's cache (`ldconfig -p`) lists.
    pub ldconfig: Option<String>,
    /// The path `dlopen` loaded.
    pub dlopen: Option<String>,
    /// `dlopen`'s error.
    pub error: Option<String>,
    /// The file the linker found, symlinks resolved.
    pub resolved: Option<String>,
}

/// A mount of the container.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct MountView {
    /// Mount point in the container.
    pub path: String,
    /// The mounted directory or file within its filesystem (a bind mount's source, relative
    /// to the root of the filesystem that holds it).
    pub root: String,
    /// Filesystem type.
    pub fstype: String,
    /// Filesystem source.
    pub source: String,
    /// Read-only.
    pub ro: bool,
}

/// `nvidia-smi -L` run in the container.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct NvidiaSmiView {
    /// Exit status.
    pub exit_code: i32,
    /// stdout and stderr.
    pub output: String,
}

/// The variable that carries a device's UUID in its containers (the plugin's contract):
/// `MIGDRA_DEVICE_UUID_` and the device name upper-cased, other characters as `_`.
pub fn device_uuid_variable(device: &str) -> String {
    let suffix: String = device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("MIGDRA_DEVICE_UUID_{suffix}")
}

impl ContainerView {
    /// The UUID the container sees for `device` (its per-device variable).
    pub fn device_uuid(&self, device: &str) -> Option<&str> {
        self.env_value(&device_uuid_variable(device))
    }

    /// An environment variable's value.
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// The values of the container's `MIGDRA_DEVICE_UUID_*` variables.
    pub fn device_uuids(&self) -> Vec<&str> {
        self.env
            .iter()
            .filter(|(k, _)| k.starts_with("MIGDRA_DEVICE_UUID_"))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Fails unless the container's environment names exactly one device UUID, a MIG one.
    pub fn ensure_one_mig_uuid(&self) -> anyhow::Result<()> {
        let uuids = self.device_uuids();
        anyhow::ensure!(
            uuids.len() == 1 && uuids[0].starts_with("MIG-"),
            "one MIG UUID expected in the env of {}/{}: {:?}",
            self.pod,
            self.container,
            self.env
        );
        Ok(())
    }

    /// The character devices in the container's `/dev/nvidia*` and `/dev/nvidia-caps`.
    pub fn device_nodes(&self) -> Vec<&DeviceView> {
        self.devices.iter().filter(|d| d.kind == "c").collect()
    }

    /// The paths of the container's character devices.
    pub fn device_paths(&self) -> Vec<&str> {
        self.device_nodes().into_iter().map(|d| d.path.as_str()).collect()
    }

    /// The minors of the container's MIG capability nodes (`/dev/nvidia-caps/*`).
    pub fn capability_minors(&self) -> Vec<i64> {
        self.device_nodes()
            .into_iter()
            .filter(|d| d.path.starts_with("/dev/nvidia-caps/"))
            .filter_map(|d| d.minor)
            .collect()
    }

    /// Checks that the container got the driver's files once and can use them, as it sees
    /// them: the sonames `libcuda.so.1` and `libnvidia-ml.so.1` resolve, through the dynamic
    /// linker, to `libcuda.so.<version>` / `libnvidia-ml.so.<version>` in the library
    /// directory (the links nvidia-cdi-hook's create-symlinks makes); each of those files is
    /// mounted exactly once, read-only, from its path under `driver_root` (a host path); no
    /// mount point appears twice; and `NVIDIA_VISIBLE_DEVICES=void`.
    pub fn check_driver_files(&self, driver_root: &Path, version: &str) -> anyhow::Result<()> {
        const LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";
        let mut points: Vec<&str> = self.mounts.iter().map(|m| m.path.as_str()).collect();
        points.sort_unstable();
        if let Some(twice) = points.windows(2).find(|w| w[0] == w[1]) {
            bail!("{} is mounted twice: {:?}", twice[0], self.mounts);
        }
        for library in ["libcuda", "libnvidia-ml"] {
            let file = format!("{LIB_DIR}/{library}.so.{version}");
            let soname = format!("{library}.so.1");
            let seen = self
                .libraries
                .get(&soname)
                .with_context(|| format!("the probe reported no {soname}"))?;
            if seen.resolved.as_deref() != Some(file.as_str()) {
                bail!("the dynamic linker does not resolve {soname} to {file}: {seen:?}");
            }
            let mounts: Vec<&MountView> = self.mounts.iter().filter(|m| m.path == file).collect();
            let [mount] = mounts[..] else {
                bail!("{file} is mounted {} times, not once: {mounts:?}", mounts.len());
            };
            // mountinfo names the file by its real path, symlinks resolved.
            let source = driver_root
                .canonicalize()
                .with_context(|| format!("resolving {}", driver_root.display()))?
                .join(file.trim_start_matches('/'));
            if mount.root == "/" || !source.ends_with(mount.root.trim_start_matches('/')) {
                bail!(
                    "{file} is mounted from {:?}, not from {}",
                    mount.root,
                    source.display()
                );
            }
            if !mount.ro {
                bail!("{file} is mounted read-write: {mount:?}");
            }
        }
        match self.env_value("NVIDIA_VISIBLE_DEVICES") {
            Some("void") => Ok(()),
            other => bail!("NVIDIA_VISIBLE_DEVICES is {other:?}, expected \"void\""),
        }
    }
}

/// The first JSON value of a container's log: the gpu-probe's report, once complete.
fn parse_report(log: &str) -> Option<ContainerView> {
    serde_json::Deserializer::from_str(log)
        .into_iter::<ContainerView>()
        .next()?
        .ok()
}

/// What a pod's container reports from inside (see [`ContainerView`]): waits until the
/// container has started (running, or finished) and its log holds the whole report. After
/// restarts, the report of the current container.
pub async fn container_view(client: &Client, pod: &str, container: &str) -> anyhow::Result<ContainerView> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    // The restart count of the container once it has started (running, or finished).
    let started = |p: &Pod| {
        let status = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .find(|s| s.name == container)?;
        let state = status.state.as_ref()?;
        (state.running.is_some() || state.terminated.is_some()).then_some(status.restart_count)
    };
    let params = LogParams {
        container: Some(container.to_string()),
        ..LogParams::default()
    };
    let view = wait_until(Duration::from_secs(60), || async {
        let restart_count = started(&pods.get(pod).await.ok()?)?;
        let view = parse_report(&pods.logs(pod, &params).await.ok()?)?;
        Some(ContainerView {
            pod: pod.to_string(),
            container: container.to_string(),
            restart_count,
            ..view
        })
    })
    .await;
    match view {
        Ok(view) => Ok(view),
        Err(_) => {
            let log = pods.logs(pod, &params).await;
            bail!("{pod}/{container} reported nothing from inside (log: {log:?})")
        }
    }
}
