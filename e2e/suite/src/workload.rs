//! Workloads for the tests and the demo: claim templates, pods, and what happened to them
//! (allocation, container records of the fake runtime, events).

use std::{path::Path, time::Duration};

use anyhow::{Context, bail};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::{Event, Pod, PodCondition},
    resource::v1::{DeviceRequestAllocationResult, ResourceClaim, ResourceClaimTemplate},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::cluster::{DRIVER, wait_until};

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

/// Creates a pod with one container `main` running `command`, using a claim from `template`.
/// `restart_never` makes a finished container end the pod.
pub async fn create_pod(
    client: &Client,
    name: &str,
    template: &str,
    command: &[&str],
    restart_never: bool,
) -> anyhow::Result<()> {
    create_pod_with(client, name, template, &[("main", command)], restart_never).await
}

/// Creates a pod with one container `main` that uses one claim per template, the claims
/// named `claim-0`, `claim-1`, … in the order of `templates`.
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
            "containers": [{"name": "main", "image": "registry.k8s.io/e2e-test-images/busybox:1.36", "command": ["sleep", "3600"], "resources": {"claims": claims}}],
            "resourceClaims": resource_claims,
        }
    }))?;
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// Creates a pod whose containers all use the one claim made from `template`.
pub async fn create_pod_with(
    client: &Client,
    name: &str,
    template: &str,
    containers: &[(&str, &[&str])],
    restart_never: bool,
) -> anyhow::Result<()> {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(n, cmd)| json!({"name": n, "image": "registry.k8s.io/e2e-test-images/busybox:1.36", "command": cmd, "resources": {"claims": [{"name": "gpu"}]}}))
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

/// What the fake runtime recorded about one container.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRecord {
    /// Pod name.
    pub pod_name: String,
    /// Container name.
    pub container_name: String,
    /// CDI devices the kubelet asked for.
    #[serde(default)]
    pub cdi_devices: Vec<String>,
    /// Device nodes after CDI injection.
    #[serde(default)]
    pub device_nodes: Vec<DeviceNodeRecord>,
    /// The de-duplicated CDI devices the runtime resolved and injected.
    #[serde(default, rename = "injectedCDIDevices")]
    pub injected_cdi_devices: Vec<String>,
    /// Environment after CDI injection.
    #[serde(default)]
    pub env: Vec<String>,
    /// Mounts after CDI injection.
    #[serde(default)]
    pub mounts: Vec<MountRecord>,
    /// OCI hooks after CDI injection.
    #[serde(default)]
    pub hooks: Vec<HookRecord>,
    /// created | running | exited.
    pub state: String,
    /// Exit code once exited.
    #[serde(default)]
    pub exit_code: Option<i32>,
}

/// A device node the container received.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNodeRecord {
    /// Path in the container.
    pub path: String,
    /// Major.
    #[serde(default)]
    pub major: i64,
    /// Minor.
    #[serde(default)]
    pub minor: i64,
}

/// A mount the container received.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MountRecord {
    /// Host path.
    pub source: String,
    /// Path in the container.
    pub destination: String,
    /// Mount options.
    #[serde(default)]
    pub options: Vec<String>,
}

/// An OCI hook the container received.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HookRecord {
    /// OCI stage, e.g. `createContainer`.
    pub stage: String,
    /// Executable on the host.
    pub path: String,
    /// Full argv.
    #[serde(default)]
    pub args: Vec<String>,
}

/// The device UUIDs in the environment the gpu-probe image reported
/// (`e2e/runtime/gpu-probe`): the values of its `MIGDRA_DEVICE_UUID_*` variables.
pub fn probe_device_uuids(report: &Value) -> Vec<&str> {
    report["env"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("MIGDRA_DEVICE_UUID_"))
        .filter_map(|(_, v)| v.as_str())
        .collect()
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

impl ContainerRecord {
    /// The UUID the container sees for `device` (its per-device variable).
    pub fn device_uuid(&self, device: &str) -> Option<&str> {
        self.env_value(&device_uuid_variable(device))
    }

    /// Checks that the container got the driver's files exactly once: `libcuda.so.<version>`
    /// and `libnvidia-ml.so.<version>` bind-mounted read-only from `driver_root` (a host
    /// path) at their path in the root, one `create-symlinks` hook (`nvidia-cdi-hook` at
    /// `hook_path`) linking the sonames `libcuda.so.1` / `libnvidia-ml.so.1` to them, one
    /// `update-ldcache` hook for their directory, one `enable-cuda-compat` hook for the
    /// driver version and one `disable-device-node-modification` hook, no mount destination
    /// twice, and `NVIDIA_VISIBLE_DEVICES=void`.
    pub fn check_driver_files(
        &self,
        driver_root: &Path,
        version: &str,
        hook_path: &str,
    ) -> anyhow::Result<()> {
        const LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";
        let mut destinations: Vec<&str> = self.mounts.iter().map(|m| m.destination.as_str()).collect();
        destinations.sort_unstable();
        let before = destinations.len();
        destinations.dedup();
        if destinations.len() != before {
            bail!("a mount destination appears twice: {:?}", self.mounts);
        }
        for library in ["libcuda", "libnvidia-ml"] {
            let destination = format!("{LIB_DIR}/{library}.so.{version}");
            let mount = self
                .mounts
                .iter()
                .find(|m| m.destination == destination)
                .with_context(|| format!("no mount of {destination} in {:?}", self.mounts))?;
            let source = driver_root.join(destination.trim_start_matches('/'));
            if Path::new(&mount.source) != source {
                bail!(
                    "{destination} mounted from {}, not {}",
                    mount.source,
                    source.display()
                );
            }
            if !mount.options.iter().any(|o| o == "ro") || !mount.options.iter().any(|o| o == "rbind") {
                bail!("{destination} is not a read-only bind mount: {:?}", mount.options);
            }
        }
        let hooks = |name: &str| -> Vec<&HookRecord> {
            self.hooks
                .iter()
                .filter(|h| h.args.get(1).map(String::as_str) == Some(name))
                .collect()
        };
        let symlinks = hooks("create-symlinks");
        if symlinks.len() != 1 {
            bail!("expected one create-symlinks hook, got {:?}", self.hooks);
        }
        let symlinks = symlinks[0];
        if symlinks.path != hook_path || symlinks.stage != "createContainer" {
            bail!("create-symlinks hook {symlinks:?} is not {hook_path} at createContainer");
        }
        for (soname, library) in [("libcuda.so.1", "libcuda"), ("libnvidia-ml.so.1", "libnvidia-ml")] {
            let link = format!("{library}.so.{version}::{LIB_DIR}/{soname}");
            if !symlinks.args.contains(&link) {
                bail!("create-symlinks does not link {soname}: {:?}", symlinks.args);
            }
        }
        let ldcache = hooks("update-ldcache");
        if ldcache.len() != 1 || !ldcache[0].args.iter().any(|a| a == LIB_DIR) || ldcache[0].path != hook_path
        {
            bail!(
                "expected one update-ldcache hook for {LIB_DIR}, got {:?}",
                self.hooks
            );
        }
        let compat = hooks("enable-cuda-compat");
        let host_version = format!("--host-driver-version={version}");
        if compat.len() != 1 || compat[0].args[2..] != [host_version] || compat[0].path != hook_path {
            bail!(
                "expected one enable-cuda-compat hook for driver {version}, got {:?}",
                self.hooks
            );
        }
        let device_nodes = hooks("disable-device-node-modification");
        if device_nodes.len() != 1 || device_nodes[0].path != hook_path {
            bail!(
                "expected one disable-device-node-modification hook, got {:?}",
                self.hooks
            );
        }
        let visible: Vec<&String> = self
            .env
            .iter()
            .filter(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES="))
            .collect();
        if visible != [&"NVIDIA_VISIBLE_DEVICES=void".to_string()] {
            bail!("NVIDIA_VISIBLE_DEVICES entries {visible:?}, expected exactly \"void\"");
        }
        Ok(())
    }

    /// An environment variable's value.
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find_map(|e| e.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')))
    }
}

/// The latest record of a pod's container.
pub fn container_record(records_dir: &Path, pod: &str, container: &str) -> anyhow::Result<ContainerRecord> {
    let prefix = format!("{NAMESPACE}_{pod}_{container}_");
    let mut newest: Option<(std::time::SystemTime, ContainerRecord)> = None;
    for entry in std::fs::read_dir(records_dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.starts_with(&prefix) || !name.ends_with(".json") {
            continue;
        }
        let modified = entry.metadata()?.modified()?;
        let record: ContainerRecord = serde_json::from_slice(&std::fs::read(entry.path())?)?;
        if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
            newest = Some((modified, record));
        }
    }
    match newest {
        Some((_, record)) => Ok(record),
        None => bail!("no container record for {pod}/{container}"),
    }
}
