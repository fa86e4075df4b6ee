"""The kubelet-plugin DaemonSet and the controller Deployment."""

from __future__ import annotations

import re

import pytest

from conftest import CHART, REPO, render, run_helm, template_args


def plugin_pod(rendered):
    ds = rendered.one("DaemonSet")
    return ds, ds["spec"]["template"]["spec"]


def container(pod_spec):
    (c,) = pod_spec["containers"]
    return c


def env_of(c) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def mounts_by_host_path(pod_spec, c) -> dict[str, dict]:
    """host path -> the container mount of that hostPath volume (readOnly etc.)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    out = {}
    for m in c["volumeMounts"]:
        v = volumes[m["name"]]
        if "hostPath" in v:
            out[v["hostPath"]["path"]] = m
    return out


# ---- kubelet plugin -------------------------------------------------------------------


def test_plugin_socket_dirs_mounted_at_host_paths(case):
    rendered, values = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    mounts = mounts_by_host_path(pod, c)
    root = values["kubeletRootDir"].rstrip("/")
    for sub in ("plugins", "plugins_registry"):
        host = f"{root}/{sub}"
        assert host in mounts, f"{host} not mounted; mounts: {sorted(mounts)}"
        assert mounts[host]["mountPath"] == host, "the kubelet dials the absolute socket path: same path inside"
        assert not mounts[host].get("readOnly"), host
    assert env_of(c)["KUBELET_ROOT_DIR"]["value"] == root


def test_plugin_mounts_cdi_dev_and_driver_root(case):
    rendered, values = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    mounts = mounts_by_host_path(pod, c)
    env = env_of(c)

    cdi = values["cdiRoot"].rstrip("/")
    assert mounts[cdi]["mountPath"] == cdi and not mounts[cdi].get("readOnly")
    assert env["CDI_ROOT"]["value"] == cdi

    dev = values["devRoot"].rstrip("/")
    assert mounts[dev]["mountPath"] == dev, "device nodes at the same path inside"
    assert env["DEV_ROOT"]["value"] == dev

    driver_root = values["nvidiaDriverRoot"]
    m = mounts[driver_root]
    assert m["readOnly"] is True, "the driver root is mounted read-only"
    if values["nvmlLibPath"]:
        nvml = env["NVML_LIB_PATH"]["value"]
        assert nvml == m["mountPath"].rstrip("/") + "/" + values["nvmlLibPath"].lstrip("/")
        assert nvml.endswith("libnvidia-ml.so.1")
    else:
        # The plugin searches the driver root mount for its own architecture's library.
        assert "NVML_LIB_PATH" not in env
        assert env["DRIVER_ROOT_MOUNT"]["value"] == m["mountPath"]


def test_default_values_name_no_architecture(default):
    """Nothing x86-only in the defaults: the same values work on arm64 nodes."""
    _, pod = plugin_pod(default)
    text = repr(pod)
    assert "x86_64" not in text and "aarch64" not in text, text


def test_plugin_extra_volumes_follow_values(case):
    rendered, values = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    for extra in values["kubeletPlugin"]["extraVolumes"]:
        assert volumes[extra["name"]] == extra
    for extra in values["kubeletPlugin"]["extraVolumeMounts"]:
        assert mounts[extra["name"]] == extra
    assert len(volumes) == len(pod["volumes"]), "volume names are unique"


@pytest.mark.parametrize("bad", ["devRoot=dev", "kubeletPlugin.extraVolumes.name=x"])
def test_device_root_and_extra_volumes_schema_rejects(bad):
    from conftest import run_helm, template_args

    proc = run_helm(*template_args(sets=[bad]), check=False)
    assert proc.returncode != 0 and "schema" in proc.stderr.lower(), proc.stderr


def test_plugin_gets_the_driver_files_settings(case):
    """Driver root (host path and where the plugin sees it), the device root and the hook's
    host dir."""
    rendered, values = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    mounts = mounts_by_host_path(pod, c)
    env = env_of(c)

    driver_root = values["nvidiaDriverRoot"]
    assert env["DRIVER_ROOT"]["value"] == driver_root, "CDI mounts name host paths"
    assert env["DRIVER_ROOT_MOUNT"]["value"] == mounts[driver_root]["mountPath"]
    assert env["DEV_ROOT"]["value"] == mounts[values["devRoot"].rstrip("/")]["mountPath"]

    hook = values["kubeletPlugin"]["cdiHook"]
    from_image = hook["source"] == "image"
    if from_image:
        hook_path = hook["hostDir"].rstrip("/") + "/nvidia-cdi-hook"
        assert env["NVIDIA_CDI_HOOK_SOURCE"]["value"] == "/usr/local/bin/nvidia-cdi-hook"
    else:
        hook_path = hook["hostPath"]
        assert "NVIDIA_CDI_HOOK_SOURCE" not in env, "a host hook is never overwritten"
    assert env["NVIDIA_CDI_HOOK_PATH"]["value"] == hook_path
    hook_dir = hook_path.rsplit("/", 1)[0]
    m = mounts[hook_dir]
    # Written only when the plugin installs the hook.
    assert m["readOnly"] is (not from_image)
    # The plugin looks the hook up (and installs it) at HOST_ROOT + its host path.
    assert m["mountPath"] == env["HOST_ROOT"]["value"].rstrip("/") + hook_dir


def test_default_hook_comes_from_the_image(default):
    _, pod = plugin_pod(default)
    env = env_of(container(pod))
    assert env["NVIDIA_CDI_HOOK_PATH"]["value"] == "/var/lib/migdra/bin/nvidia-cdi-hook"
    assert env["NVIDIA_CDI_HOOK_SOURCE"]["value"] == "/usr/local/bin/nvidia-cdi-hook"


@pytest.mark.parametrize(
    "sets",
    [
        ["kubeletPlugin.cdiHook.source=toolkit"],
        ["kubeletPlugin.cdiHook.hostDir=/"],
        ["kubeletPlugin.cdiHook.hostPath=nvidia-cdi-hook"],
    ],
)
def test_bad_hook_values_are_refused(sets):
    result = run_helm(*template_args(sets=sets), check=False)
    assert result.returncode != 0, result.stdout
    assert "cdiHook" in result.stderr, result.stderr


def test_plugin_state_dir_persists(case):
    """The checkpoint lives in <root>/plugins/<driver> (the binary's default) on a hostPath."""
    rendered, _ = case
    _, pod = plugin_pod(rendered)
    env = env_of(container(pod))
    assert "STATE_DIR" not in env


def test_plugin_is_privileged_and_node_critical(case):
    rendered, _ = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    assert c["securityContext"]["privileged"] is True
    assert pod["priorityClassName"] == "system-node-critical"


def test_plugin_update_strategy_follows_values(case):
    rendered, values = case
    ds, _ = plugin_pod(rendered)
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == values["kubeletPlugin"]["maxSurge"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == values["kubeletPlugin"]["maxUnavailable"]


def test_plugin_default_update_strategy_surges_without_downtime(default):
    ds, _ = plugin_pod(default)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_plugin_instance_is_named_by_its_pod_uid(case):
    rendered, _ = case
    _, pod = plugin_pod(rendered)
    env = env_of(container(pod))
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


def test_plugin_node_name_from_downward_api(case):
    rendered, _ = case
    _, pod = plugin_pod(rendered)
    env = env_of(container(pod))
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The heartbeat Lease goes to the pod's (the release) namespace, where the controller watches.
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_plugin_env_follows_values(case):
    rendered, values = case
    _, pod = plugin_pod(rendered)
    env = {k: v.get("value") for k, v in env_of(container(pod)).items()}
    p = values["kubeletPlugin"]
    assert env["DRIVER_NAME"] == values["driverName"]
    assert env["LOG_FORMAT"] == values["logging"]["format"]
    assert env["LOG_LEVEL"] == values["logging"]["level"]
    assert env["HEARTBEAT_INTERVAL_SECONDS"] == str(values["heartbeat"]["intervalSeconds"])
    assert "GPUNODE_HEARTBEAT_INTERVAL_SECONDS" not in env
    assert env["HEALTH_RESEND_INTERVAL_SECONDS"] == str(p["healthResendIntervalSeconds"])
    assert env["LOCK_TIMEOUT_SECONDS"] == str(p["lockTimeoutSeconds"])
    assert env["NVML_CALL_TIMEOUT_SECONDS"] == str(p["nvmlCallTimeoutSeconds"])
    assert env["STALE_CLAIM_GC_INTERVAL_SECONDS"] == str(p["staleClaimGcIntervalSeconds"])
    assert env["HTTP_ADDRESS"].endswith(f":{p['httpPort']}")
    assert env["GRPC_HEALTH_ADDRESS"].endswith(f":{p['grpcHealthPort']}")


def test_ipv6_bind_address(custom):
    _, pod = plugin_pod(custom)
    env = env_of(container(pod))
    assert env["GRPC_HEALTH_ADDRESS"]["value"] == "[::]:50051"
    assert env["HTTP_ADDRESS"]["value"] == "[::]:9091"


@pytest.mark.parametrize(
    ("address", "http"), [("127.0.0.1", "127.0.0.1:8080"), ("::1", "[::1]:8080")], ids=["ipv4", "ipv6"]
)
def test_plugin_metrics_can_be_kept_off_the_network(address, http):
    rendered = render(sets=[f"kubeletPlugin.metricsBindAddress={address}"])
    _, pod = plugin_pod(rendered)
    env = {k: v.get("value") for k, v in env_of(container(pod)).items()}
    assert env["HTTP_ADDRESS"] == http
    # The probes' server stays where the kubelet reaches it; the controller is unaffected.
    assert env["GRPC_HEALTH_ADDRESS"] == "0.0.0.0:51515"
    controller = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in controller["env"]}["HTTP_ADDRESS"] == "0.0.0.0:8080"


def test_plugin_grpc_probes(case):
    rendered, values = case
    _, pod = plugin_pod(rendered)
    c = container(pod)
    port = values["kubeletPlugin"]["grpcHealthPort"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    # Readiness asks for NVML answering on the node (the plugin's READINESS_SERVICE).
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": "ready"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": values["kubeletPlugin"]["httpPort"], "grpc-health": port}


def test_plugin_scheduling_defaults(default):
    _, pod = plugin_pod(default)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_plugin_scheduling_custom(custom):
    _, pod = plugin_pod(custom)
    assert "nodeSelector" not in pod
    assert "tolerations" not in pod
    assert pod["affinity"]["nodeAffinity"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]


def test_plugin_service_account_and_image(case):
    rendered, values = case
    ds, pod = plugin_pod(rendered)
    sas = {sa["metadata"]["name"] for sa in rendered.all("ServiceAccount")}
    assert pod["serviceAccountName"] in sas
    image = values["kubeletPlugin"]["image"]
    assert container(pod)["image"] == f"{image['repository']}:{image['tag'] or '0.1.0'}"
    selector = ds["spec"]["selector"]["matchLabels"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


@pytest.mark.parametrize("registry,repository,expected", [
    # The registry host is replaced; the path and the tag stay.
    ("127.0.0.1:5000", None, "127.0.0.1:5000/migdra/{name}:0.1.0"),
    ("mirror.example.com/ghcr", None, "mirror.example.com/ghcr/migdra/{name}:0.1.0"),
    ("mirror.example.com", "localhost/team/{name}", "mirror.example.com/team/{name}:0.1.0"),
    ("mirror.example.com", "registry:5000/{name}", "mirror.example.com/{name}:0.1.0"),
    # A repository without a registry host (Docker Hub's "team/name") gets the registry prefixed.
    ("mirror.example.com", "team/{name}", "mirror.example.com/team/{name}:0.1.0"),
    ("mirror.example.com", "{name}", "mirror.example.com/{name}:0.1.0"),
])
def test_image_registry_overrides_the_registry_host(registry, repository, expected):
    sets = [f"imageRegistry={registry}"]
    for key, name in (("controller", "migdra-controller"), ("kubeletPlugin", "migdra-kubelet-plugin")):
        if repository is not None:
            sets.append(f"{key}.image.repository={repository.format(name=name)}")
    rendered = render(sets=sets)
    _, plugin = plugin_pod(rendered)
    _, controller = controller_pod(rendered)
    assert container(plugin)["image"] == expected.format(name="migdra-kubelet-plugin")
    assert container(controller)["image"] == expected.format(name="migdra-controller")


def test_image_registry_keeps_the_pull_policy():
    _, plugin = plugin_pod(render(sets=["imageRegistry=127.0.0.1:5000"]))
    assert container(plugin)["imagePullPolicy"] == "IfNotPresent"


# ---- controller -----------------------------------------------------------------------


def controller_pod(rendered):
    d = rendered.one("Deployment")
    return d, d["spec"]["template"]["spec"]


def test_controller_defaults(default):
    d, pod = controller_pod(default)
    assert d["spec"]["replicas"] == 2
    c = container(pod)
    env = env_of(c)
    assert env["LEADER_ELECT"]["value"] == "true"
    assert env["LEASE_NAME"]["value"] == "migdra-controller"
    assert c["image"] == "ghcr.io/migdra/migdra-controller:0.1.0"
    pdb = default.one("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == d["spec"]["selector"]
    assert pod["affinity"]["podAntiAffinity"], "replicas spread over nodes by default"


def test_controller_downward_api(case):
    rendered, _ = case
    _, pod = controller_pod(rendered)
    env = env_of(container(pod))
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_controller_env_follows_values(case):
    rendered, values = case
    _, pod = controller_pod(rendered)
    env = {k: v.get("value") for k, v in env_of(container(pod)).items()}
    c = values["controller"]
    assert env["DRIVER_NAME"] == values["driverName"]
    assert env["LEADER_ELECT"] == str(c["leaderElection"]["enabled"]).lower()
    assert env["LEASE_DURATION_SECONDS"] == str(c["leaderElection"]["leaseDurationSeconds"])
    assert env["HEARTBEAT_TIMEOUT_SECONDS"] == str(values["heartbeat"]["timeoutSeconds"])
    assert env["KEEP_MEMORY_COUNTER"] == str(c["keepMemoryCounter"]).lower()
    assert env["DEFAULT_MIG_MODE"] == c["defaultMigMode"]
    assert env["HTTP_ADDRESS"].endswith(f":{c['httpPort']}")
    assert env["LOG_FORMAT"] == values["logging"]["format"]
    assert env["LOG_LEVEL"] == values["logging"]["level"]
    for extra in c["extraEnv"]:
        assert env[extra["name"]] == extra["value"]


def test_the_kueue_values_example_keeps_the_memory_counter():
    rendered = render([CHART / "examples" / "values-kueue.yaml"])
    _, pod = controller_pod(rendered)
    env = {k: v.get("value") for k, v in env_of(container(pod)).items()}
    assert env["KEEP_MEMORY_COUNTER"] == "true"


def test_the_default_mig_mode_never_switches():
    _, pod = controller_pod(render([]))
    env = {k: v.get("value") for k, v in env_of(container(pod)).items()}
    assert env["DEFAULT_MIG_MODE"] == "current"


def test_controller_probes_and_metrics_port(case):
    rendered, values = case
    _, pod = controller_pod(rendered)
    c = container(pod)
    assert c["ports"] == [{"name": "http", "containerPort": values["controller"]["httpPort"], "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_controller_security_context(case):
    rendered, _ = case
    _, pod = controller_pod(rendered)
    c = container(pod)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_metrics_annotations(default, custom):
    for rendered, expect in ((default, True), (custom, False)):
        for kind in ("Deployment", "DaemonSet"):
            annotations = rendered.one(kind)["spec"]["template"]["metadata"].get("annotations", {})
            assert (annotations.get("prometheus.io/scrape") == "true") is expect, (kind, annotations)


@pytest.mark.parametrize("kind", ["Deployment", "DaemonSet"])
def test_no_host_namespaces(case, kind):
    rendered, _ = case
    pod = rendered.one(kind)["spec"]["template"]["spec"]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(field), field


# ---- the chart sets only environment variables the binaries read -----------------------

CRATES = {"DaemonSet": "kubelet-plugin", "Deployment": "controller"}


def binary_env_names(crate: str) -> set[str]:
    """The `env = "NAME"` names of the crate's clap arguments (read from its source, and from
    migdra-runtime's, whose `ProcessArgs` both binaries flatten into their own)."""
    names = set()
    for src in (REPO / crate / "src", REPO / "runtime" / "src"):
        for path in src.rglob("*.rs"):
            names |= set(re.findall(r'\benv\s*=\s*"([A-Z0-9_]+)"', path.read_text()))
    return names


@pytest.mark.parametrize("kind", sorted(CRATES))
def test_env_names_match_the_binary(default, kind):
    names = binary_env_names(CRATES[kind])
    assert names, f"no clap env names found in {CRATES[kind]}/src or runtime/src"
    c = container(default.one(kind)["spec"]["template"]["spec"])
    unknown = {e["name"] for e in c["env"]} - names
    assert not unknown, f"{kind} sets env vars {CRATES[kind]} does not read: {sorted(unknown)}"
