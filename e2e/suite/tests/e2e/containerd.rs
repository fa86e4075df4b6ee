//! The kubelet on a real runtime (the suite's default, see `migdra_e2e::cluster::Runtime`):
//! pods made by the kubelet through containerd's CRI, run by runc from the local images, their
//! logs read with `kubectl logs`; and a MIG claim's CDI spec, written by migdra's plugin,
//! applied by containerd.

use std::time::Duration;

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::{
    Api,
    api::{ListParams, PostParams},
};
use migdra_e2e::{
    cluster::{
        API_SERVICE_IP, BUSYBOX_IMAGE, CHART_NAMESPACE, Cluster, POD_SUBNET, REGISTRY, Runtime, probe_image,
        wait_until,
    },
    workload::{self, NAMESPACE, create_pod, create_template, delete_pods, profile_is, wait_phase},
};
use serde_json::json;

use crate::support::{claim_specs, mig, require_chart, settle};

tests![
    containerd_runs_a_plain_pod,
    containerd_pods_reach_the_apiserver,
    containerd_kubelet_probes_a_pod,
    containerd_applies_a_mig_claims_cdi_spec,
    containerd_chart_probe_sees_exactly_its_spec,
    containerd_chart_images_are_pulled_from_the_registry
];

/// Fails unless the cluster runs on containerd (`MIGDRA_E2E_RUNTIME=fake-cri` opts out).
fn require_containerd(cluster: &Cluster) -> anyhow::Result<()> {
    ensure!(
        cluster.layout.runtime == Runtime::Containerd,
        "the cluster runs on the fake CRI: run with MIGDRA_E2E_RUNTIME=containerd"
    );
    Ok(())
}

/// `kubectl logs` of a pod's container (through the API server and the kubelet).
fn kubectl_logs(cluster: &Cluster, pod: &str, container: &str) -> anyhow::Result<String> {
    let out = std::process::Command::new(cluster.layout.upstream_bin.join("kubectl"))
        .arg(format!("--kubeconfig={}", cluster.layout.kubeconfig.display()))
        .args(["logs", "--namespace", NAMESPACE, pod, "-c", container])
        .output()
        .context("running kubectl")?;
    ensure!(
        out.status.success(),
        "kubectl logs {pod} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The pod, once the kubelet reported its container finished: the container ID's runtime
/// prefix and the pod's IP.
async fn finished(cluster: &Cluster, pod: &str) -> anyhow::Result<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), NAMESPACE);
    let status = pods.get(pod).await?.status.context("no pod status")?;
    let container = status
        .container_statuses
        .as_deref()
        .and_then(|s| s.first())
        .context("no container status")?;
    Ok((
        container.container_id.clone().unwrap_or_default(),
        status.pod_ip.clone().unwrap_or_default(),
    ))
}

async fn containerd_runs_a_plain_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_containerd(cluster)?;
    let name = "ctrd-plain";
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                // `$$$$`: the kubelet expands `$(VAR)` in commands, and `$$` to `$`.
                "command": ["sh", "-c", "echo migdra-e2e says hello; echo \"pid $$$$\"; cat /proc/self/cgroup; ip -4 -o addr show eth0"],
            }],
        }
    }))?;
    Api::<Pod>::namespaced(cluster.client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    wait_phase(&cluster.client, name, "Succeeded", Duration::from_secs(120)).await?;
    let (container_id, pod_ip) = finished(cluster, name).await?;
    ensure!(
        container_id.starts_with("containerd://"),
        "container ID {container_id:?} is not containerd's"
    );
    let subnet = POD_SUBNET.trim_end_matches(".0/24");
    ensure!(
        pod_ip.starts_with(&format!("{subnet}.")),
        "pod IP {pod_ip:?} not in {POD_SUBNET}"
    );
    let logs = kubectl_logs(cluster, name, "main")?;
    eprintln!("e2e: kubectl logs {name}:\n{logs}");
    ensure!(logs.contains("migdra-e2e says hello"), "no greeting in the logs");
    ensure!(
        logs.contains("pid 1\n"),
        "the container is not pid 1 of its own pid namespace"
    );
    ensure!(
        logs.contains(&format!("inet {pod_ip}/24")),
        "eth0 does not carry the pod IP {pod_ip}"
    );
    // The container's memory cgroup: under the kubelet's cgroup root, in its QoS hierarchy
    // (a BestEffort pod).
    let memory = logs
        .lines()
        .find(|l| l.contains(":memory:"))
        .context("no memory cgroup in the logs")?;
    ensure!(
        memory.contains("/migdra-e2e-") && memory.contains("/kubepods/besteffort/pod"),
        "the container's memory cgroup is not under the run's cgroup root: {memory}"
    );
    delete_pods(&cluster.client, &[name]).await?;
    settle(cluster).await
}

/// A busybox pod (restart Never, no token) running `script`; `host_network` puts it in the
/// node's network namespace.
fn busybox_pod(name: &str, host_network: bool, script: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
        "spec": {
            "restartPolicy": "Never",
            "hostNetwork": host_network,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
            }],
        }
    }))?)
}

/// Pods on the pod network and on the node's network (hostNetwork) reach the API server where
/// in-cluster config looks for it: `KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`. A plain
/// HTTP request to that TLS port gets Go's answer to HTTP on an HTTPS server, which only the
/// API server at the end of the relay can give.
async fn containerd_pods_reach_the_apiserver(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_containerd(cluster)?;
    // `$$`: the kubelet expands `$(VAR)` in commands, and `$$` to `$`.
    let script = "echo \"service $${KUBERNETES_SERVICE_HOST}:$${KUBERNETES_SERVICE_PORT}\"; \
        printf 'GET /version HTTP/1.0\\r\\n\\r\\n' | nc -w 5 \"$$KUBERNETES_SERVICE_HOST\" \"$$KUBERNETES_SERVICE_PORT\"; echo; echo end";
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), NAMESPACE);
    let names = ["ctrd-api-pod", "ctrd-api-host"];
    for (name, host_network) in names.into_iter().zip([false, true]) {
        pods.create(&PostParams::default(), &busybox_pod(name, host_network, script)?)
            .await?;
    }
    for name in names {
        wait_phase(&cluster.client, name, "Succeeded", Duration::from_secs(120)).await?;
        let logs = kubectl_logs(cluster, name, "main")?;
        eprintln!("e2e: kubectl logs {name}:\n{logs}");
        ensure!(
            logs.contains(&format!("service {API_SERVICE_IP}:443")),
            "{name}: KUBERNETES_SERVICE_HOST/PORT are not the kubernetes Service's {API_SERVICE_IP}:443"
        );
        ensure!(
            logs.contains("Client sent an HTTP request to an HTTPS server"),
            "{name}: no answer from the API server at {API_SERVICE_IP}:443"
        );
    }
    delete_pods(&cluster.client, &names).await?;
    settle(cluster).await
}

/// The kubelet's HTTP readiness probe reaches a pod's address: a pod serving HTTP becomes
/// Ready, and one whose probe path answers 404 stays unready with the probe's failure in an
/// event.
async fn containerd_kubelet_probes_a_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_containerd(cluster)?;
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), NAMESPACE);
    let names = ["ctrd-probe-ok", "ctrd-probe-404"];
    for (name, path) in names.into_iter().zip(["/ready", "/missing"]) {
        let mut pod = busybox_pod(
            name,
            false,
            "mkdir -p /tmp/www && echo ok > /tmp/www/ready && exec httpd -f -p 8080 -h /tmp/www",
        )?;
        let spec = pod.spec.as_mut().context("no pod spec")?;
        spec.containers[0].readiness_probe = Some(serde_json::from_value(json!({
            "httpGet": {"path": path, "port": 8080},
            "periodSeconds": 1,
            "failureThreshold": 1,
        }))?);
        pods.create(&PostParams::default(), &pod).await?;
    }
    let ready = |pod: Pod| {
        pod.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    };
    wait_until(Duration::from_secs(120), || async {
        ready(pods.get(names[0]).await.ok()?).then_some(())
    })
    .await
    .context("the pod serving its probe path did not become Ready")?;
    // Probes before httpd listens fail with "connection refused"; then 404 from httpd.
    wait_until(Duration::from_secs(60), || async {
        let events = migdra_e2e::workload::pod_events(&cluster.client, names[1])
            .await
            .ok()?;
        events
            .into_iter()
            .filter_map(|e| e.message)
            .find(|m| m.contains("Readiness probe failed") && m.contains("statuscode: 404"))
    })
    .await
    .context("no readiness probe failure with status 404 for the pod without its probe path")?;
    ensure!(
        !ready(pods.get(names[1]).await?),
        "the pod whose probe answers 404 is Ready"
    );
    delete_pods(&cluster.client, &names).await?;
    settle(cluster).await
}

async fn containerd_applies_a_mig_claims_cdi_spec(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_containerd(cluster)?;
    let c = cluster.client.clone();
    let name = "ctrd-mig";
    create_template(&c, name, mig(&[profile_is("1g.10gb")]), None).await?;
    create_pod(
        &c,
        name,
        name,
        &[
            "sh",
            "-c",
            "ls -ln /dev/nvidia*; env | grep -E '^(NVIDIA|MIGDRA|CUDA)' | sort; ls /usr/lib/x86_64-linux-gnu 2>&1 | grep -i nvidia; mount | grep -iE 'nvidia|cuda'; echo end",
        ],
        true,
    )
    .await?;
    let ended = wait_until(Duration::from_secs(120), || async {
        let phase = workload::phase(&cluster.client, name).await?;
        matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
    })
    .await;
    let events = migdra_e2e::workload::pod_events(&c, name)
        .await
        .unwrap_or_default();
    for e in &events {
        eprintln!(
            "e2e: event {}: {}",
            e.reason.as_deref().unwrap_or_default(),
            e.message.as_deref().unwrap_or_default()
        );
    }
    let phase = ended.context("the MIG pod did not finish")?;
    let logs = kubectl_logs(cluster, name, "main")?;
    eprintln!("e2e: kubectl logs {name} ({phase}):\n{logs}");
    ensure!(phase == "Succeeded", "the MIG pod ended {phase}");
    // The claim's CDI spec: the GPU's node, the control node, the UVM nodes and the MIG
    // capability nodes, as character devices (created by runc from the spec's major/minor).
    for node in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        ensure!(
            logs.lines().any(|l| l.starts_with('c') && l.ends_with(node)),
            "no character device {node} in the container"
        );
    }
    ensure!(
        logs.lines()
            .any(|l| l.starts_with('c') && l.contains("nvidia-cap")),
        "no MIG capability node in the container"
    );
    delete_pods(&c, &[name]).await?;
    settle(cluster).await
}

/// Checks that the kubelet pulled `image` from the run's registry for a pod of `namespace`: an
/// event `Pulled` "Successfully pulled image ..." (an image containerd already had gives
/// "Container image ... already present on machine" instead), and the registry's log shows
/// the tag resolved and blobs fetched.
async fn pulled_from_registry(cluster: &Cluster, namespace: &str, image: &str) -> anyhow::Result<()> {
    let (repository, tag) = image
        .strip_prefix(&format!("{REGISTRY}/"))
        .and_then(|r| r.rsplit_once(':'))
        .with_context(|| format!("{image} is not an image of the registry {REGISTRY}"))?;
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), namespace);
    let pulled = format!("Successfully pulled image \"{image}\"");
    let messages: Vec<String> = events
        .list(&ListParams::default().fields("reason=Pulled"))
        .await?
        .items
        .into_iter()
        .filter_map(|e| e.message)
        .collect();
    ensure!(
        messages.iter().any(|m| m.starts_with(&pulled)),
        "no event says the kubelet pulled {image} in {namespace}; Pulled events: {messages:?}"
    );
    // containerd resolves the tag (HEAD on the manifest; a 404 line would end with its code),
    // then GETs the manifest by digest and the blobs it lacks (at least the image's config).
    let log = cluster.registry_log()?;
    let resolved = format!("HEAD /v2/{repository}/manifests/{tag}");
    let fetched = format!("GET /v2/{repository}/blobs/sha256:");
    ensure!(
        log.lines().any(|l| l.ends_with(&resolved)) && log.lines().any(|l| l.contains(&fetched)),
        "the registry's log has no {resolved:?} or no {fetched:?}:\n{log}"
    );
    Ok(())
}

/// migdra from its chart: the plugin DaemonSet's and the controller Deployment's pods run
/// images the kubelet pulled from the run's loopback registry (the chart's repositories under
/// `imageRegistry`, its default pull policy), not images imported into containerd.
async fn containerd_chart_images_are_pulled_from_the_registry(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), CHART_NAMESPACE);
    let mut images = std::collections::BTreeSet::new();
    for pod in pods.list(&ListParams::default()).await?.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        for c in pod.spec.map(|s| s.containers).unwrap_or_default() {
            let image = c.image.unwrap_or_default();
            ensure!(
                image.starts_with(&format!("{REGISTRY}/migdra/")),
                "pod {name} container {} runs {image}, not an image of the registry {REGISTRY}",
                c.name
            );
            ensure!(
                c.image_pull_policy.as_deref() == Some("IfNotPresent"),
                "pod {name} container {}: pull policy {:?}, the chart's default is IfNotPresent",
                c.name,
                c.image_pull_policy
            );
            images.insert(image);
        }
    }
    let expected = [
        format!("{REGISTRY}/migdra/migdra-controller:0.1.0"),
        format!("{REGISTRY}/migdra/migdra-kubelet-plugin:0.1.0"),
    ];
    ensure!(
        images.iter().eq(expected.iter()),
        "the chart's pods run {images:?}, expected {expected:?}"
    );
    for image in &images {
        pulled_from_registry(cluster, CHART_NAMESPACE, image).await?;
    }
    Ok(())
}

/// migdra from its chart: a pod with a MIG claim runs the probe image, and what the container
/// reports it saw (device nodes with their numbers, environment, the libraries the dynamic
/// linker resolves after the hooks ran) is exactly what the claim's CDI spec, written by the
/// plugin's pod, asks for.
async fn containerd_chart_probe_sees_exactly_its_spec(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let c = cluster.client.clone();
    let name = "ctrd-probe";
    create_template(&c, name, mig(&[profile_is("1g.10gb")]), None).await?;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
            "containers": [{
                "name": "main",
                // Pulled from the run's registry (the default pull policy).
                "image": probe_image(),
                // Print, then wait: a finished pod's claim is unprepared, its spec removed.
                "args": ["sleep"],
                "resources": {"claims": [{"name": "gpu"}]}
            }]
        }
    }))?;
    Api::<Pod>::namespaced(c.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    wait_phase(&c, name, "Running", Duration::from_secs(120)).await?;
    let seen = workload::container_view(&c, name, "main").await?;
    eprintln!("e2e: the probe in {name} saw:\n{seen:#?}");
    pulled_from_registry(cluster, NAMESPACE, &probe_image()).await?;

    // The claim's spec, as the plugin's pod wrote it to the CDI directory containerd reads.
    let specs = claim_specs(cluster)?;
    ensure!(specs.len() == 1, "expected one claim spec, found {specs:?}");
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&specs[0])?)?;
    let all_edits = spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| &d["containerEdits"])
        .chain(std::iter::once(&spec["containerEdits"]));
    let wanted: Vec<(String, i64, i64)> = all_edits
        .flat_map(|e| e["deviceNodes"].as_array().cloned().unwrap_or_default())
        .filter_map(|n| {
            Some((
                n["path"].as_str()?.to_string(),
                n["major"].as_i64()?,
                n["minor"].as_i64()?,
            ))
        })
        .collect();
    ensure!(
        wanted.iter().any(|(p, _, _)| p.starts_with("/dev/nvidia-caps/")),
        "the spec names no MIG capability node: {spec}"
    );
    let devices = &seen.devices;
    for (path, major, minor) in &wanted {
        let found = devices.iter().find(|d| d.path == *path);
        let found = found.with_context(|| format!("{path} is not in the container: {devices:?}"))?;
        ensure!(
            found.kind == "c" && found.major == Some(*major) && found.minor == Some(*minor),
            "{path} in the container is {found:?}, the spec says c {major}:{minor}"
        );
    }
    // No capability node of another instance: the container sees only its own.
    let caps_seen = devices
        .iter()
        .filter(|d| d.path.starts_with("/dev/nvidia-caps/nvidia-cap"))
        .count();
    let caps_wanted = wanted
        .iter()
        .filter(|(p, _, _)| p.starts_with("/dev/nvidia-caps/nvidia-cap"))
        .count();
    ensure!(
        caps_seen == caps_wanted,
        "the container sees {caps_seen} capability nodes, its spec {caps_wanted}"
    );

    ensure!(
        seen.env_value("NVIDIA_VISIBLE_DEVICES") == Some("void"),
        "env: {:?}",
        seen.env
    );
    seen.ensure_one_mig_uuid()?;
    // The dynamic linker resolves the driver's libraries to the files the spec mounts from the
    // driver root. The fake driver's libraries are stubs, not ELF, so dlopen names the file
    // it found and refuses it ("file too short"), and ldconfig leaves them out of its cache.
    for soname in ["libnvidia-ml.so.1", "libcuda.so.1"] {
        let library = seen.libraries.get(soname);
        let error = library.and_then(|l| l.error.as_deref()).unwrap_or_default();
        ensure!(
            error.contains(&format!("/{soname}: file too short")),
            "the dynamic linker did not find the driver's {soname}: {library:?}"
        );
    }
    // The fake driver root's nvidia-smi, mounted by the spec, runs in the container.
    ensure!(
        seen.nvidia_smi.as_ref().is_some_and(|n| n.exit_code == 0),
        "nvidia-smi: {:?}",
        seen.nvidia_smi
    );
    delete_pods(&c, &[name]).await?;
    settle(cluster).await
}
