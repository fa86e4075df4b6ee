"""Shared fixtures of the offline chart tests: run helm, parse what it renders.

run.sh sets MIGDRA_HELM (the helm binary), MIGDRA_PROMTOOL (promtool, built by promtool/build.sh),
MIGDRA_CHART, MIGDRA_REPO and MIGDRA_CHART_KUBE_VERSION. Without MIGDRA_HELM the tests look for
`helm` on PATH; without MIGDRA_PROMTOOL they run promtool/build.sh (which builds promtool once
and caches it). A missing helm or promtool fails the tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).resolve().parent
REPO = Path(os.environ.get("MIGDRA_REPO", TESTS.parent.parent))
CHART = Path(os.environ.get("MIGDRA_CHART", REPO / "charts" / "migdra"))
KUBE_VERSION = os.environ.get("MIGDRA_CHART_KUBE_VERSION", "1.35.0")
NAMESPACE = "migdra-system"
RELEASE = "migdra"
CUSTOM_VALUES = TESTS / "values-custom.yaml"
CRD_FILES = {
    "gpunodes.gpu.migdra.dev": CHART / "crds" / "gpunodes.yaml",
    "migpolicies.gpu.migdra.dev": CHART / "crds" / "migpolicies.yaml",
}


def helm_binary() -> str:
    helm = os.environ.get("MIGDRA_HELM") or shutil.which("helm")
    if not helm:
        pytest.fail("no helm: run charts/tests/run.sh, or set MIGDRA_HELM")
    return helm


def promtool_binary() -> str:
    """The pinned promtool: MIGDRA_PROMTOOL, else what promtool/build.sh prints (it builds it)."""
    promtool = os.environ.get("MIGDRA_PROMTOOL")
    if not promtool:
        proc = subprocess.run(["bash", str(TESTS / "promtool" / "build.sh")], capture_output=True, text=True)
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.fail(f"no promtool: promtool/build.sh failed ({proc.returncode}):\n{proc.stderr}")
        promtool = proc.stdout.strip().splitlines()[-1]
    if not os.access(promtool, os.X_OK):
        pytest.fail(f"no promtool at {promtool!r}: run charts/tests/run.sh, or set MIGDRA_PROMTOOL")
    return promtool


@pytest.fixture(scope="session")
def promtool() -> str:
    return promtool_binary()


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, env={**os.environ, "KUBECONFIG": "/dev/null"}
    )
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def template_args(values_files=(), sets=(), include_crds=False, chart=CHART, kube_version=KUBE_VERSION):
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube_version]
    if include_crds:
        args.append("--include-crds")
    for f in values_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


class Rendered:
    """The objects of one `helm template` run, with the template each came from."""

    def __init__(self, text: str):
        self.text = text
        self.docs: list[dict] = []
        self.sources: dict[int, str] = {}
        for chunk in re.split(r"(?m)^---[ \t]*$", text):
            source = None
            for line in chunk.splitlines():
                if line.startswith("# Source: "):
                    source = line.removeprefix("# Source: ").strip()
                    break
            doc = yaml.safe_load(chunk)
            if doc is None:
                continue
            assert isinstance(doc, dict), f"not a mapping: {chunk[:200]}"
            self.sources[len(self.docs)] = source
            self.docs.append(doc)

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
        return found[0]

    def source_files(self) -> set[str]:
        return {s for s in self.sources.values() if s}


def render(values_files=(), sets=(), include_crds=False) -> Rendered:
    return Rendered(run_helm(*template_args(values_files, sets, include_crds)).stdout)


@pytest.fixture(scope="session")
def default() -> Rendered:
    return render(include_crds=True)


@pytest.fixture(scope="session")
def custom() -> Rendered:
    return render([CUSTOM_VALUES], include_crds=True)


@pytest.fixture(scope="session")
def default_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="session")
def custom_values() -> dict:
    """values.yaml deep-merged with values-custom.yaml (what the custom render sees)."""
    return deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), yaml.safe_load(CUSTOM_VALUES.read_text()))


@pytest.fixture(params=["default", "custom"])
def case(request, default, custom, default_values, custom_values):
    """Both renders with the values that produced them."""
    if request.param == "default":
        return default, default_values
    return custom, custom_values


def deep_merge(base: dict, override: dict) -> dict:
    """Helm's merge of a values file over the defaults: maps merge, null removes a key."""
    out = dict(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


