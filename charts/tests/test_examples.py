"""The manifests in examples/: well-formed, consistent with the chart, and selecting what their
comments say (CEL evaluated with cel-python, with a small stand-in for quantity())."""

from __future__ import annotations

import re
import subprocess
import sys
from decimal import Decimal

import celpy
import jsonschema
import pytest
import yaml
from celpy import celtypes

from conftest import CRD_FILES, KUBE_VERSION, REPO

EXAMPLES = REPO / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))
DRIVER = "gpu.migdra.dev"
ATTRIBUTES = {
    "type", "profile", "productName", "parentUUID", "uuid", "placementStart", "memorySlices",
    "computeSlices", "cudaComputeCapability", "driverVersion", "architecture", "pciBusID", "numaNode",
}
CAPACITIES = {"memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines"}
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(s) -> celtypes.IntType:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(s))
    assert m, s
    return celtypes.IntType(int(Decimal(m[1]) * UNITS.get(m[2], 1)))


def compare_to(a, b) -> celtypes.IntType:
    return celtypes.IntType((a > b) - (a < b))


_env = celpy.Environment()


def evaluate(expression: str, dev: dict) -> bool:
    program = _env.program(_env.compile(expression), functions={"quantity": quantity, "compareTo": compare_to})
    activation = celpy.json_to_cel(dev)
    for name, value in dev.get("capacity", {}).get(DRIVER, {}).items():
        activation["capacity"][DRIVER][name] = quantity(value)
    return bool(program.evaluate({"device": activation}))


def mig(profile: str, memory: str, product="NVIDIA H100 80GB HBM3") -> dict:
    g = int(profile.split("g", 1)[0])
    return {
        "driver": DRIVER,
        "attributes": {DRIVER: {"type": "mig", "profile": profile, "computeSlices": g, "productName": product}},
        "capacity": {DRIVER: {"memory": memory}},
    }


def gpu(product="NVIDIA H100 80GB HBM3") -> dict:
    return {
        "driver": DRIVER,
        "attributes": {DRIVER: {"type": "gpu", "productName": product}},
        "capacity": {DRIVER: {"memory": "81559Mi"}},
    }


DEVICES = {
    "1g.10gb": mig("1g.10gb", "9728Mi"),
    "1g.10gb+me": mig("1g.10gb+me", "9728Mi"),
    "1g.20gb": mig("1g.20gb", "19968Mi"),
    "2g.20gb": mig("2g.20gb", "19968Mi"),
    "3g.40gb": mig("3g.40gb", "40192Mi"),
    "4g.40gb": mig("4g.40gb", "40192Mi"),
    "7g.80gb": mig("7g.80gb", "80896Mi"),
}


def load(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def docs_of(name: str) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in load(EXAMPLES / name)}


def requests_of(rct: dict) -> list[dict]:
    return rct["spec"]["spec"]["devices"]["requests"]


def selectors(request: dict) -> list[str]:
    return [s["cel"]["expression"] for s in request.get("selectors", [])]


def class_selects(chart_class: dict, dev: dict) -> bool:
    return all(evaluate(s["cel"]["expression"], dev) for s in chart_class["spec"]["selectors"])


def request_selects(default, request: dict, dev: dict) -> bool:
    (chart_class,) = [c for c in default.all("DeviceClass") if c["metadata"]["name"] == request["deviceClassName"]]
    return class_selects(chart_class, dev) and all(evaluate(e, dev) for e in selectors(request))


def test_expected_examples_exist():
    names = {p.name for p in FILES}
    for expected in (
        "mig-exact-profile.yaml",
        "mig-min-memory.yaml",
        "mig-first-available.yaml",
        "whole-gpu.yaml",
        "shared-claim.yaml",
        "migpolicy.yaml",
        "device-plugin-style.yaml",
        "shared-partition.yaml",
    ):
        assert expected in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_is_commented_and_well_formed(path, default):
    assert path.read_text().startswith("#"), "each example starts with a comment"
    docs = load(path)
    assert docs
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    classes = {c["metadata"]["name"] for c in default.all("DeviceClass")}
    for d in docs:
        assert d["kind"] in {"ResourceClaimTemplate", "ResourceClaim", "Pod", "MigPolicy"}, d["kind"]
        assert "namespace" not in d["metadata"], "examples go into the current namespace"
        if d["kind"] == "ResourceClaimTemplate":
            assert d["apiVersion"] == "resource.k8s.io/v1"
            for req in requests_of(d):
                subs = req.get("firstAvailable") or [req["exactly"]]
                for sub in subs:
                    assert sub["deviceClassName"] in classes, sub["deviceClassName"]
                    for expr in selectors(sub):
                        _env.compile(expr)
                        for dom, name in re.findall(r'device\.attributes\["([^"]+)"\]\.(\w+)', expr):
                            assert dom == DRIVER and name in ATTRIBUTES, (dom, name)
                        for dom, name in re.findall(r'device\.capacity\["([^"]+)"\]\.(\w+)', expr):
                            assert dom == DRIVER and name in CAPACITIES, (dom, name)
            for cfg in d["spec"]["spec"]["devices"].get("config", []):
                opaque = cfg["opaque"]
                assert opaque["driver"] == DRIVER
                params = opaque["parameters"]
                assert params["apiVersion"] == "gpu.migdra.dev/v1alpha1" and params["kind"] == "DeviceConfig"
                assert set(params) <= {"apiVersion", "kind", "env"}, "DeviceConfig is strict"
        if d["kind"] == "Pod":
            spec = d["spec"]
            assert spec.get("automountServiceAccountToken") is False
            pod_claims = {c["name"]: c for c in spec.get("resourceClaims", [])}
            for c in pod_claims.values():
                assert c["resourceClaimTemplateName"] in templates, c
            for ctr in spec["containers"]:
                for ref in ctr["resources"].get("claims", []):
                    claim = pod_claims[ref["name"]]
                    if "request" in ref:
                        names = [r["name"] for r in requests_of(templates[claim["resourceClaimTemplateName"]])]
                        assert ref["request"] in names


def test_device_plugin_style_pod_is_served_by_the_chart():
    """The example's limits use names the chart serves with deviceClasses.extendedResources on,
    through a class that selects the profile the name stands for."""
    from conftest import render

    (pod,) = [d for d in load(EXAMPLES / "device-plugin-style.yaml") if d["kind"] == "Pod"]
    assert "resourceClaims" not in pod["spec"], "the point is: no claim"
    limits = {k: v for c in pod["spec"]["containers"] for k, v in c["resources"]["limits"].items()}
    assert limits == {"nvidia.com/mig-1g.10gb": 1}
    served = {
        c["spec"]["extendedResourceName"]: c
        for c in render(sets=["deviceClasses.extendedResources.enabled=true"]).all("DeviceClass")
        if "extendedResourceName" in c["spec"]
    }
    picked = {p for p, dev in DEVICES.items() if class_selects(served["nvidia.com/mig-1g.10gb"], dev)}
    assert picked == {"1g.10gb"}


def test_exact_profile(default):
    (req,) = requests_of(docs_of("mig-exact-profile.yaml")["ResourceClaimTemplate/mig-3g-40gb"])
    picked = {p for p, dev in DEVICES.items() if request_selects(default, req["exactly"], dev)}
    assert picked == {"3g.40gb"}
    assert not request_selects(default, req["exactly"], gpu())


def test_min_memory(default):
    (req,) = requests_of(docs_of("mig-min-memory.yaml")["ResourceClaimTemplate/mig-min-20gi"])
    picked = {p for p, dev in DEVICES.items() if request_selects(default, req["exactly"], dev)}
    # NVML's "20gb" profiles have 19968Mi < 20Gi (the example's comment says so).
    assert picked == {"3g.40gb", "4g.40gb", "7g.80gb"}


def test_first_available_chain(default):
    (req,) = requests_of(docs_of("mig-first-available.yaml")["ResourceClaimTemplate/mig-2g-else-1g"])
    first, second = req["firstAvailable"]
    assert {p for p, d in DEVICES.items() if request_selects(default, first, d)} == {"2g.20gb"}
    assert {p for p, d in DEVICES.items() if request_selects(default, second, d)} == {"1g.10gb", "1g.20gb"}


def test_whole_gpu(default):
    (req,) = requests_of(docs_of("whole-gpu.yaml")["ResourceClaimTemplate/whole-gpu"])
    assert request_selects(default, req["exactly"], gpu())
    assert not request_selects(default, req["exactly"], gpu("NVIDIA L4"))
    assert not any(request_selects(default, req["exactly"], d) for d in DEVICES.values())


def test_shared_claim():
    docs = docs_of("shared-claim.yaml")
    pod = docs["Pod/shared-claim"]["spec"]
    (claim,) = pod["resourceClaims"]
    assert len(pod["containers"]) == 2
    for ctr in pod["containers"]:
        assert ctr["resources"]["claims"] == [{"name": claim["name"]}]


def test_examples_validate_against_kubernetes_schemas(tmp_path):
    docs = [d for path in FILES for d in load(path) if d["kind"] != "MigPolicy"]
    path = tmp_path / "examples.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    minor = KUBE_VERSION.rsplit(".", 1)[0] + ".0"
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", minor, str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "path, name",
    [
        ("migpolicy.yaml", "MigPolicy/inference-small-partitions"),
        ("shared-partition.yaml", "MigPolicy/share-small-partitions"),
    ],
)
def test_migpolicy_matches_crd_schema(path, name):
    (crd,) = [d for d in yaml.safe_load_all(CRD_FILES["migpolicies.gpu.migdra.dev"].read_text()) if d]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = version["schema"]["openAPIV3Schema"]
    policy = docs_of(path)[name]
    jsonschema.validate(policy, schema)
    # Structural schemas prune unknown fields silently; make sure every field we show is declared.
    declared = set(schema["properties"]["spec"]["properties"])
    assert set(policy["spec"]) <= declared, set(policy["spec"]) - declared
