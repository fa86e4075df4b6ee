"""The generated CRDs in charts/migdra/crds/ (gpunodes.yaml, migpolicies.yaml).

They are produced by `make crds` (`cargo run -p migdra-controller -- print-crds`) and committed;
`make check-crds` fails on drift. A missing file fails these tests.
"""

from __future__ import annotations

import pytest
import yaml

from conftest import CHART, CRD_FILES
from test_admission import gpunode_policy


def test_crd_files_exist():
    missing = [str(p) for p in CRD_FILES.values() if not p.exists()]
    assert not missing, f"CRD files missing (run `make crds`): {missing}"


@pytest.fixture(scope="module")
def crds() -> dict[str, dict]:
    out = {}
    for name, path in CRD_FILES.items():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert len(docs) == 1, f"{path.name}: expected one document, got {len(docs)}"
        out[name] = docs[0]
    return out


def served_version(crd: dict, version="v1alpha1") -> dict:
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return v


@pytest.mark.parametrize(
    "name,kind,plural",
    [("gpunodes.gpu.migdra.dev", "GpuNode", "gpunodes"), ("migpolicies.gpu.migdra.dev", "MigPolicy", "migpolicies")],
)
def test_crd_identity(crds, name, kind, plural):
    crd = crds[name]
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == name
    spec = crd["spec"]
    assert spec["group"] == "gpu.migdra.dev"
    assert spec["scope"] == "Cluster"
    assert spec["names"]["kind"] == kind
    assert spec["names"]["plural"] == plural
    v = served_version(crd)
    assert v["served"] and v["storage"]
    assert v["schema"]["openAPIV3Schema"]["type"] == "object"


def test_gpunode_has_status_subresource(crds):
    v = served_version(crds["gpunodes.gpu.migdra.dev"])
    assert "status" in v.get("subresources", {}), "the plugin patches gpunodes/status"


def test_no_files_besides_the_two_crds():
    manifests = sorted(p.name for p in (CHART / "crds").iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    assert manifests == ["gpunodes.yaml", "migpolicies.yaml"]


def test_helm_renders_the_crds(default):
    names = {d["metadata"]["name"] for d in default.all("CustomResourceDefinition")}
    assert names == set(CRD_FILES)


def test_rbac_and_policy_name_real_resources(default, crds):
    plurals = {crd["spec"]["names"]["plural"] for crd in crds.values()}
    for role in default.all("ClusterRole"):
        for rule in role["rules"]:
            if "gpu.migdra.dev" in rule["apiGroups"]:
                for r in rule["resources"]:
                    assert r.split("/")[0] in plurals, r
    policy = gpunode_policy(default)
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        if "gpu.migdra.dev" in rule["apiGroups"]:
            for r in rule["resources"]:
                assert r.split("/")[0] in plurals, r
