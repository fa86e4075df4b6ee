"""Writes dashboard_test.yaml: the scenario and expected results of the dashboard's query unit
tests (see the header below). `python3 dashboard_test_gen.py` rewrites the file;
test_observability.py fails when the file is not this script's output."""

import re
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent / "dashboard_test.yaml"
HEADER = """# Unit tests (`promtool test rules`) of the Grafana dashboard's queries
# (charts/migdra/files/dashboard.json). test_observability.py turns every panel query (and the
# $node variable's label_values query) into a recording rule, written to dashboard.rules.yaml
# next to a copy of this file, in two groups: `dashboard:<panel title>:<refId>` with the node
# variable on "All" (`.*`) and `dashboard_node:<panel title>:<refId>` with node gpu-node-a;
# $__rate_interval is 5m.
#
# Written by dashboard_test_gen.py (edit the script and run it; test_observability.py checks
# that this file is its output) from one scenario: three nodes (gpu-node-c's plugin is
# not live), a leading controller (10.0.0.10) and a standby (10.0.0.11) that led before and
# still exposes its old values, and NVIDIA's DCGM exporter scraped without honorLabels (its
# series carry the exporter pod's namespace/pod) with the labels it puts on MIG series: UUID
# (the parent GPU's UUID), GPU_I_ID, GPU_I_PROFILE, gpu, device, modelName, pci_bus_id and the
# host name, which is `Hostname="gpu-node-a"` on gpu-node-a, the machine's own spelling
# `Hostname="GPU-Node-B"` on gpu-node-b and `hostname` (lower-case label name) on gpu-node-c.
# GPU instance ID 1 exists on three GPUs; GPU GPU-0b7d2a91-... has its instance 2 destroyed and
# recreated for another pod at 15m (the old info series ends with a staleness marker, as a
# scrape that no longer has it writes; the new one starts in the same scrape). DCGM also
# reports a foreign instance (GPU_I_ID 9, no migdra info series) and the whole GPU (no GPU_I_ID):
# neither may be attributed to any pod.
"""


def selector(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


# Target labels of the scrapes (PodMonitors with honorLabels: the processes' own labels win).
CONTROLLER = {"job": "migdra-system/migdra-controller"}
LEADER = {"instance": "10.0.0.10:8080", **CONTROLLER}
STANDBY = {"instance": "10.0.0.11:8080", **CONTROLLER}
PLUGIN = {"job": "migdra-system/migdra-kubelet-plugin"}
PLUGIN_A = {"instance": "10.0.1.1:8080", **PLUGIN, "node": "gpu-node-a"}
PLUGIN_B = {"instance": "10.0.2.1:8080", **PLUGIN, "node": "gpu-node-b"}
PLUGIN_C = {"instance": "10.0.3.1:8080", **PLUGIN, "node": "gpu-node-c"}
UUID_A0 = "GPU-6c1f5b2e-0d3a-4c55-9a61-1f0e2d7c3b10"
UUID_A1 = "GPU-0b7d2a91-5e44-4f0c-8d3e-7a9c1e2f4b21"
UUID_B0 = "GPU-93e0c4d7-2b18-4a6f-b5c2-8d1e7f3a6c42"
UUID_C0 = "GPU-5a2b8c1d-7e9f-4036-a1b2-c3d4e5f60718"
# The plugin's per-GPU labels.
GPUS = {
    "a0": {**PLUGIN_A, "gpu": "0", "gpu_minor": "0", "gpu_uuid": UUID_A0},
    "a1": {**PLUGIN_A, "gpu": "1", "gpu_minor": "1", "gpu_uuid": UUID_A1},
    "b0": {**PLUGIN_B, "gpu": "0", "gpu_minor": "0", "gpu_uuid": UUID_B0},
    "c0": {**PLUGIN_C, "gpu": "0", "gpu_minor": "0", "gpu_uuid": UUID_C0},
}


def info(gpu, gi, mig_uuid, profile, placement, namespace, pod, claim):
    """The labels of one migdra_kubelet_plugin_mig_instance_info series."""
    return {
        **GPUS[gpu], "gi": gi, "ci": "0", "mig_uuid": mig_uuid, "profile": profile, "placement": placement,
        "namespace": namespace, "pod": pod, "claim": claim,
    }


# migdra's instances. GPU instance 1 exists on three GPUs; instance 2 of GPU a1 is destroyed
# at 15m ("old", whose series then gets a staleness marker) and created again for another
# claim in the same scrape ("new").
INSTANCES = {
    "train0": info("a0", "1", "MIG-4f8e2c1a-3b5d-5e7f-9a0b-1c2d3e4f5a60", "3g.40gb", "4", "ml", "train-0", "train-0-gpu"),
    "infer": info("a0", "5", "MIG-7a1b2c3d-4e5f-5a6b-8c9d-0e1f2a3b4c51", "1g.10gb", "0", "serving", "infer-7d9c-x2x", "infer-gpu"),
    "old": info("a1", "2", "MIG-0c9d8e7f-6a5b-5c4d-9e3f-2a1b0c9d8e72", "2g.20gb", "0", "ml", "old-job", "old-claim"),
    "new": info("a1", "2", "MIG-1d2e3f4a-5b6c-5d7e-8f9a-0b1c2d3e4f83", "2g.20gb", "0", "research", "new-job", "new-claim"),
    "train1": info("b0", "1", "MIG-2e3f4a5b-6c7d-5e8f-9a0b-1c2d3e4f5a94", "3g.40gb", "4", "ml", "train-1", "train-1-gpu"),
    "train2": info("c0", "1", "MIG-3f4a5b6c-7d8e-5f9a-8b0c-1d2e3f4a5ba5", "1g.10gb", "0", "ml", "train-2", "train-2-gpu"),
}
INSTANCE_VALUES = {
    "train0": "1x30", "infer": "1x30", "old": "1x14 stale", "new": "_x15 1x14", "train1": "1x30", "train2": "1x30",
}

# DCGM exporter's target labels (scraped without honorLabels: namespace/pod are the exporter's).
DCGM_TARGET = {"job": "gpu-operator/nvidia-dcgm-exporter", "namespace": "gpu-operator", "container": "nvidia-dcgm-exporter"}


def dcgm(target, uuid, gpu, gi, profile, model="NVIDIA A100-SXM4-80GB", bus="00000000:07:00.0"):
    """The labels dcgm-exporter puts on a MIG instance's series (gi None: the whole GPU's)."""
    instance, exporter_pod, host_label, host = target
    labels = {
        **DCGM_TARGET, "instance": instance, "pod": exporter_pod, "UUID": uuid, "gpu": gpu, "device": f"nvidia{gpu}",
        "modelName": model, "pci_bus_id": bus, host_label: host,
    }
    if gi is not None:
        labels["GPU_I_ID"] = gi
        labels["GPU_I_PROFILE"] = profile
    return labels


DCGM_A = ("10.0.1.50:9400", "nvidia-dcgm-exporter-7xk2p", "Hostname", "gpu-node-a")
DCGM_B = ("10.0.2.50:9400", "nvidia-dcgm-exporter-9fz4q", "Hostname", "GPU-Node-B")  # the machine's own spelling
DCGM_C = ("10.0.3.50:9400", "nvidia-dcgm-exporter-2mw8r", "hostname", "gpu-node-c")  # lower-case label name
# (labels, DCGM_FI_PROF_GR_ENGINE_ACTIVE values, DCGM_FI_DEV_FB_USED values in MiB)
DCGM = [
    (dcgm(DCGM_A, UUID_A0, "0", "1", "3g.40gb"), "0.75x30", "20480x30"),
    (dcgm(DCGM_A, UUID_A0, "0", "5", "1g.10gb"), "0.25x30", "4096x30"),
    (dcgm(DCGM_A, UUID_A0, "0", "9", "1g.10gb"), "0.5x30", "9000x30"),  # a foreign instance: no pod
    (dcgm(DCGM_A, UUID_A0, "0", None, None), None, "33576x30"),  # the whole GPU
    (dcgm(DCGM_A, UUID_A1, "1", "2", "2g.20gb", bus="00000000:0F:00.0"), "0.2x14 0.9x15", "1024x14 8192x15"),
    (dcgm(DCGM_B, UUID_B0, "0", "1", "3g.40gb"), "0.6x30", "30000x30"),
    (dcgm(DCGM_C, UUID_C0, "0", "1", "1g.10gb", model="NVIDIA H100 80GB HBM3"), "0.4x30", "100x30"),
]

series = []


def add(name, labels, values):
    series.append({"series": selector(name, labels), "values": values})


# The controller: 10.0.0.10 leads; 10.0.0.11 led before and keeps its old values.
add("migdra_controller_leader", LEADER, "1x30")
add("migdra_controller_leader", STANDBY, "0x30")
add("migdra_controller_published_pools", LEADER, "2x30")
add("migdra_controller_published_pools", STANDBY, "3x30")
for n, live, dev, sl in [("gpu-node-a", 1, 7, 2), ("gpu-node-b", 1, 4, 1), ("gpu-node-c", 0, 0, 0)]:
    add("migdra_controller_plugin_live", {**LEADER, "node": n}, f"{live}x30")
    add("migdra_controller_published_devices", {**LEADER, "node": n}, f"{dev}x30")
    add("migdra_controller_published_slices", {**LEADER, "node": n}, f"{sl}x30")
add("migdra_controller_plugin_live", {**STANDBY, "node": "gpu-node-a"}, "0x30")
add("migdra_controller_plugin_live", {**STANDBY, "node": "gpu-node-c"}, "1x30")
add("migdra_controller_published_devices", {**STANDBY, "node": "gpu-node-c"}, "9x30")
add("migdra_controller_published_slices", {**STANDBY, "node": "gpu-node-c"}, "3x30")
# 10 reconciles a second: 6 under 10ms, 9 under 100ms
for le, per_min in [("0.01", 360), ("0.1", 540), ("+Inf", 600)]:
    add("migdra_controller_reconcile_duration_seconds_bucket", {**LEADER, "le": le}, f"0+{per_min}x30")
    add("migdra_controller_reconcile_duration_seconds_bucket", {**STANDBY, "le": le}, f"{per_min}x30")
add("migdra_controller_reconciles_total", {**LEADER, "result": "success"}, "0+540x30")
add("migdra_controller_reconciles_total", {**LEADER, "result": "error"}, "0+60x30")
add("migdra_controller_reconciles_total", {**STANDBY, "result": "success"}, "700x30")
add("migdra_controller_slice_writes_total", {**LEADER, "operation": "create"}, "0+60x30")
add("migdra_controller_slice_writes_total", {**LEADER, "operation": "update"}, "0+120x30")

# The plugins.
health = {"a0": 1, "a1": 0, "b0": 1, "c0": 1}
slices = {"a0": (4, 3), "a1": (2, 5), "b0": (3, 4), "c0": (1, 6)}
for g, lab in GPUS.items():
    add("migdra_kubelet_plugin_gpu_healthy", lab, f"{health[g]}x30")
    add("migdra_kubelet_plugin_gpu_mig_mode", lab, "1x30")
    add("migdra_kubelet_plugin_gpu_memory_slices", {**lab, "state": "used"}, f"{slices[g][0]}x30")
    add("migdra_kubelet_plugin_gpu_memory_slices", {**lab, "state": "free"}, f"{slices[g][1]}x30")
for g, prof, owner, n in [("a0", "3g.40gb", "migdra", 1), ("a0", "1g.10gb", "migdra", 1), ("a0", "1g.10gb", "foreign", 1),
                          ("a1", "2g.20gb", "migdra", 1), ("b0", "3g.40gb", "migdra", 1), ("c0", "1g.10gb", "migdra", 1)]:
    add("migdra_kubelet_plugin_gpu_mig_instances", {**GPUS[g], "profile": prof, "owner": owner}, f"{n}x30")
for p, ours, foreign, prepared, pending in [(PLUGIN_A, 3, 1, 3, 1), (PLUGIN_B, 1, 0, 1, 0), (PLUGIN_C, 1, 2, 1, 0)]:
    add("migdra_kubelet_plugin_mig_instances", {**p, "owner": "migdra"}, f"{ours}x30")
    add("migdra_kubelet_plugin_mig_instances", {**p, "owner": "foreign"}, f"{foreign}x30")
    add("migdra_kubelet_plugin_prepared_claims", p, f"{prepared}x30")
    add("migdra_kubelet_plugin_pending_repairs", p, f"{pending}x30")
# one prepare a second on gpu-node-a (40% under 100ms, 90% under 1s), one unprepare a second (all under 100ms)
for op, buckets in [("prepare", [("0.1", 24), ("1", 54), ("+Inf", 60)]), ("unprepare", [("0.1", 60), ("1", 60), ("+Inf", 60)])]:
    for le, per_min in buckets:
        add("migdra_kubelet_plugin_call_duration_seconds_bucket", {**PLUGIN_A, "operation": op, "le": le}, f"0+{per_min}x30")
# gpu-node-b: one prepare every other second, all under 100ms
for le in ["0.1", "1", "+Inf"]:
    add("migdra_kubelet_plugin_call_duration_seconds_bucket", {**PLUGIN_B, "operation": "prepare", "le": le}, "0+30x30")
add("migdra_kubelet_plugin_claim_failures_total", {**PLUGIN_A, "operation": "prepare", "reason": "UnknownProfile"}, "0+60x30")
add("migdra_kubelet_plugin_claim_failures_total", {**PLUGIN_C, "operation": "unprepare", "reason": "NvmlError"}, "0+30x30")
for k, lab in INSTANCES.items():
    add("migdra_kubelet_plugin_mig_instance_info", lab, INSTANCE_VALUES[k])
for lab, act, fb in DCGM:
    if act:
        add("DCGM_FI_PROF_GR_ENGINE_ACTIVE", lab, act)
    add("DCGM_FI_DEV_FB_USED", lab, fb)



def s(labels, value):
    """An expected sample (the record's name is put in front below)."""
    return {"labels": selector("", labels) if labels else "{}", "value": value}


def pods(keys, values):
    """The expected per-claim samples of the DCGM panels."""
    return [s({k: INSTANCES[i][k] for k in ("claim", "namespace", "pod")}, values[i]) for i in keys]


util = {"train0": 0.75, "infer": 0.25, "old": 0.2, "new": 0.9, "train1": 0.6, "train2": 0.4}
mem = {"train0": 20480, "infer": 4096, "old": 1024, "new": 8192, "train1": 30000, "train2": 100}
before = ["train0", "infer", "old", "train1", "train2"]
after = ["train0", "infer", "new", "train1", "train2"]
a_before = ["train0", "infer", "old"]
a_after = ["train0", "infer", "new"]
U = "gpu_utilisation_by_pod_dcgm:A"
M = "gpu_memory_used_by_pod_dcgm:A"
join_cases = []
for t, keys, akeys in [("10m", before, a_before), ("14m", before, a_before), ("15m", after, a_after), ("25m", after, a_after)]:
    join_cases += [
        {"expr": f"dashboard:{U}", "eval_time": t, "exp_samples": pods(keys, util)},
        {"expr": f"dashboard:{M}", "eval_time": t, "exp_samples": pods(keys, mem)},
        {"expr": f"dashboard_node:{U}", "eval_time": t, "exp_samples": pods(akeys, util)},
        {"expr": f"dashboard_node:{M}", "eval_time": t, "exp_samples": pods(akeys, mem)},
    ]
# No pod is ever the old job's after the swap, nor the DCGM exporter's own pod.
join_cases += [
    {"expr": f'dashboard:{U}{{pod=~"old-job|nvidia-dcgm-exporter.*"}}', "eval_time": "15m", "exp_samples": []},
    {"expr": f'dashboard:{M}{{pod=~"old-job|nvidia-dcgm-exporter.*"}}', "eval_time": "25m", "exp_samples": []},
]

T = "20m"
panel_cases = [
    {"expr": "dashboard:published_pools:A", "eval_time": T, "exp_samples": [s({}, 2)]},
    {"expr": "dashboard:plugins_not_live:A", "eval_time": T, "exp_samples": [s({}, 1)]},
    {"expr": "dashboard:unhealthy_gpus:A", "eval_time": T, "exp_samples": [s({}, 1)]},
    {"expr": "dashboard_node:unhealthy_gpus:A", "eval_time": T, "exp_samples": [s({}, 1)]},
    {"expr": "dashboard:free_memory_slices:A", "eval_time": T, "exp_samples": [s({}, 18)]},
    {"expr": "dashboard_node:free_memory_slices:A", "eval_time": T, "exp_samples": [s({}, 8)]},
    {"expr": "dashboard:migdra_mig_instances:A", "eval_time": T, "exp_samples": [s({}, 5)]},
    {"expr": "dashboard_node:migdra_mig_instances:A", "eval_time": T, "exp_samples": [s({}, 3)]},
    {"expr": "dashboard:foreign_mig_instances:A", "eval_time": T, "exp_samples": [s({}, 3)]},
    {"expr": "dashboard:used_memory_slices_by_gpu:A", "eval_time": T,
     "exp_samples": [s({**GPUS[g], "state": "used"}, slices[g][0]) for g in GPUS]},
    {"expr": "dashboard:mig_instances_by_profile:A", "eval_time": T, "exp_samples": [
        s({"owner": "migdra", "profile": "3g.40gb"}, 2), s({"owner": "migdra", "profile": "1g.10gb"}, 2),
        s({"owner": "foreign", "profile": "1g.10gb"}, 1), s({"owner": "migdra", "profile": "2g.20gb"}, 1)]},
    {"expr": "dashboard:mig_instances_and_their_pods:A", "eval_time": T, "exp_samples": [s(INSTANCES[k], 1) for k in after]},
    {"expr": "dashboard_node:mig_instances_and_their_pods:A", "eval_time": "10m", "exp_samples": [s(INSTANCES[k], 1) for k in a_before]},
    {"expr": "dashboard:gpu_health_and_mig_mode:A", "eval_time": T, "exp_samples": [s(GPUS[g], health[g]) for g in GPUS]},
    {"expr": "dashboard:gpu_health_and_mig_mode:B", "eval_time": T, "exp_samples": [s(GPUS[g], 1) for g in GPUS]},
    # prepare: 1.5/s in all (1 on a, 0.5 on b); p50 rank 0.75 of which 0.4+0.5 = 0.9 under 100ms
    {"expr": "dashboard:prepare_unprepare_latency_p50_p95:A", "eval_time": T, "exp_samples": [
        s({"operation": "prepare"}, 0.1 * 0.75 / 0.9), s({"operation": "unprepare"}, 0.05)]},
    {"expr": "dashboard:prepare_unprepare_latency_p50_p95:B", "eval_time": T, "exp_samples": [
        s({"operation": "prepare"}, 1.0), s({"operation": "unprepare"}, 0.095)]},
    {"expr": "dashboard_node:prepare_unprepare_latency_p50_p95:A", "eval_time": T, "exp_samples": [
        s({"operation": "prepare"}, 0.1 + 0.9 * (0.5 - 0.4) / (0.9 - 0.4)), s({"operation": "unprepare"}, 0.05)]},
    {"expr": "dashboard:claim_failures_by_reason:A", "eval_time": T, "exp_samples": [
        s({"operation": "prepare", "reason": "UnknownProfile"}, 1), s({"operation": "unprepare", "reason": "NvmlError"}, 0.5)]},
    {"expr": "dashboard_node:claim_failures_by_reason:A", "eval_time": T, "exp_samples": [
        s({"operation": "prepare", "reason": "UnknownProfile"}, 1)]},
    {"expr": "dashboard:claims_prepared_and_repairs_pending:A", "eval_time": T, "exp_samples": [
        s({"node": "gpu-node-a"}, 3), s({"node": "gpu-node-b"}, 1), s({"node": "gpu-node-c"}, 1)]},
    {"expr": "dashboard:claims_prepared_and_repairs_pending:B", "eval_time": T, "exp_samples": [
        s({"node": "gpu-node-a"}, 1), s({"node": "gpu-node-b"}, 0), s({"node": "gpu-node-c"}, 0)]},
    {"expr": "dashboard:reconcile_latency_p50_p95:A", "eval_time": T, "exp_samples": [s({}, 0.01 * 5 / 6)]},
    {"expr": "dashboard:reconcile_latency_p50_p95:B", "eval_time": T, "exp_samples": [s({}, 0.1)]},
    {"expr": "dashboard:resourceslice_writes_by_kind:A", "eval_time": T, "exp_samples": [
        s({"operation": "create"}, 1), s({"operation": "update"}, 2)]},
    {"expr": "dashboard:published_devices_and_slices_by_node:A", "eval_time": T, "exp_samples": [
        s({**LEADER, "node": "gpu-node-a"}, 7), s({**LEADER, "node": "gpu-node-b"}, 4), s({**LEADER, "node": "gpu-node-c"}, 0)]},
    {"expr": "dashboard:published_devices_and_slices_by_node:B", "eval_time": T, "exp_samples": [
        s({**LEADER, "node": "gpu-node-a"}, 2), s({**LEADER, "node": "gpu-node-b"}, 1), s({**LEADER, "node": "gpu-node-c"}, 0)]},
    {"expr": "dashboard:reconciliations_by_result:A", "eval_time": T, "exp_samples": [
        s({"result": "success"}, 9), s({"result": "error"}, 1)]},
    {"expr": "dashboard:plugin_liveness_by_node:A", "eval_time": T, "exp_samples": [
        s({**LEADER, "node": "gpu-node-a"}, 1), s({**LEADER, "node": "gpu-node-b"}, 1), s({**LEADER, "node": "gpu-node-c"}, 0)]},
    {"expr": "dashboard:variable_node", "eval_time": T, "exp_samples": [
        s({"node": "gpu-node-a"}, 2), s({"node": "gpu-node-b"}, 1), s({"node": "gpu-node-c"}, 1)]},
]

for case in join_cases + panel_cases:
    record = re.match(r"[\w:]+", case["expr"]).group(0)
    for sample in case["exp_samples"]:
        sample["labels"] = record + sample["labels"]

doc = {
    "rule_files": ["dashboard.rules.yaml"],
    "evaluation_interval": "1m",
    "fuzzy_compare": True,
    "tests": [
        {
            "name": "each pod's DCGM usage comes out with its namespace, pod and claim",
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": join_cases,
        },
        {
            "name": "every panel on a cluster of three nodes, a standby controller and a DCGM exporter",
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": panel_cases,
        },
    ],
}


class Dumper(yaml.SafeDumper):
    def generate_anchor(self, node):
        return "scenario"


Dumper.add_representer(float, lambda d, v: d.represent_scalar("tag:yaml.org,2002:float", repr(v)))


def render() -> str:
    return HEADER + yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=200)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
