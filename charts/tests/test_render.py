"""Lint, render, schema and cross-field checks of the whole chart."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import jsonschema
import pytest
import yaml

from conftest import (
    CHART,
    CUSTOM_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    Rendered,
    deep_merge,
    run_helm,
    template_args,
)

TEMPLATES = sorted(p.name for p in (CHART / "templates").glob("*.yaml"))


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_lint_strict(values):
    args = ["lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART)]
    if values:
        args += ["-f", str(values)]
    proc = run_helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    # --strict turns warnings into failures; INFO lines (icon is recommended) are allowed.
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_every_template_renders(default, custom):
    """Each template file produces at least one object in the default or the custom render."""
    rendered = {s.split("/", 1)[1] for s in default.source_files() | custom.source_files()}
    for template in TEMPLATES:
        assert f"templates/{template}" in rendered, f"{template} rendered nothing in either values set"


def test_objects_are_well_formed(case):
    rendered, _ = case
    seen = set()
    for doc in rendered.docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        meta = doc["metadata"]
        assert meta.get("name"), doc
        key = (doc["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, f"duplicate object {key}"
        seen.add(key)
        assert len(meta["name"]) <= 253
        if doc["kind"] != "CustomResourceDefinition":
            labels = meta.get("labels", {})
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", key
            assert labels.get("app.kubernetes.io/part-of") == "migdra", key
            for value in labels.values():
                assert len(str(value)) <= 63, (key, value)


def test_namespaced_objects_use_the_release_namespace(case):
    rendered, _ = case
    namespaced = {
        "ServiceAccount",
        "Deployment",
        "DaemonSet",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
        "ConfigMap",
        "PodMonitor",
        "PrometheusRule",
    }
    cluster = {
        "ClusterRole",
        "ClusterRoleBinding",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "FlowSchema",
        "CustomResourceDefinition",
    }
    for doc in rendered.docs:
        kind = doc["kind"]
        assert kind in namespaced | cluster, f"unexpected kind {kind}"
        if kind in namespaced:
            # Except the controller's read access to the kubelets' node Leases.
            node_leases = kind in ("Role", "RoleBinding") and doc["metadata"]["name"].endswith("-node-leases")
            expected = "kube-node-lease" if node_leases else NAMESPACE
            assert doc["metadata"].get("namespace") == expected, doc["metadata"]
        else:
            assert "namespace" not in doc["metadata"], doc["metadata"]


def test_kube_version_constraint():
    ok = run_helm(*template_args(kube_version="1.35.0"), check=False)
    assert ok.returncode == 0, ok.stderr
    old = run_helm(*template_args(kube_version="1.34.3"), check=False)
    assert old.returncode != 0
    assert "kubeVersion" in old.stderr


# ---- values.schema.json ----------------------------------------------------------------


@pytest.fixture(scope="module")
def schema():
    return json.loads((CHART / "values.schema.json").read_text())


def test_schema_is_valid_draft7(schema):
    jsonschema.Draft7Validator.check_schema(schema)


def test_schema_accepts_shipped_values(schema, default_values, custom_values):
    jsonschema.validate(default_values, schema)
    jsonschema.validate(custom_values, schema)


def test_schema_accepts_the_documented_null_node_selector(schema, default_values):
    """values.yaml says `kubeletPlugin.nodeSelector: null` drops the selector; `helm upgrade
    --reuse-values` validates that stored null against the schema."""
    values = copy.deepcopy(default_values)
    values["kubeletPlugin"]["nodeSelector"] = None
    jsonschema.validate(values, schema)
    values["kubeletPlugin"]["nodeSelector"] = "gpu"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema)


def test_schema_documents_every_key(schema, default_values):
    """Every key of values.yaml is declared in the schema (additionalProperties is false)."""

    def walk(values, node, path):
        for key, value in values.items():
            props = node.get("properties", {})
            assert key in props, f"{path}{key} missing from values.schema.json"
            if isinstance(value, dict) and props[key].get("additionalProperties") is False:
                walk(value, props[key], f"{path}{key}.")

    walk(default_values, schema, "")


BAD_VALUES = [
    ("replicas-string", ["--set-string", "controller.replicas=two"], "/controller/replicas"),
    ("log-format", ["--set", "logging.format=xml"], "/logging/format"),
    ("mig-mode", ["--set", "controller.defaultMigMode=sometimes"], "/controller/defaultMigMode"),
    ("unknown-key", ["--set", "controler.replicas=1"], "controler"),
    ("driver-upper", ["--set", "driverName=GPU.Migdra.Dev"], "/driverName"),
    ("driver-no-domain", ["--set", "driverName=migdra"], "/driverName"),
    ("root-relative", ["--set", "kubeletRootDir=var/lib/kubelet"], "/kubeletRootDir"),
    ("bad-profile", ["--set", "deviceClasses.profiles.names={3g.40GB}"], "/deviceClasses/profiles/names"),
    ("bad-port", ["--set", "kubeletPlugin.grpcHealthPort=70000"], "/kubeletPlugin/grpcHealthPort"),
    ("negative-gc-interval", ["--set", "kubeletPlugin.staleClaimGcIntervalSeconds=-1"], "/kubeletPlugin/staleClaimGcIntervalSeconds"),
    ("bad-surge", ["--set", "kubeletPlugin.maxSurge=-1"], "/kubeletPlugin/maxSurge"),
    ("bad-surge-percent", ["--set", "kubeletPlugin.maxSurge=150%"], "/kubeletPlugin/maxSurge"),
    ("bad-pull-policy", ["--set", "controller.image.pullPolicy=Sometimes"], "/controller/image/pullPolicy"),
    ("registry-trailing-slash", ["--set", "imageRegistry=mirror.example.com/"], "/imageRegistry"),
    ("registry-with-space", ["--set", "imageRegistry=mirror example"], "/imageRegistry"),
    ("bad-failure-policy", ["--set", "admissionPolicy.failurePolicy=Warn"], "/admissionPolicy/failurePolicy"),
    ("lease-too-short", ["--set", "controller.leaderElection.leaseDurationSeconds=1"], "leaseDurationSeconds"),
]


@pytest.mark.parametrize("args,where", [(a, w) for _, a, w in BAD_VALUES], ids=[i for i, _, _ in BAD_VALUES])
def test_schema_rejects_bad_values_in_helm(args, where):
    proc = run_helm(*template_args(), *args, check=False)
    assert proc.returncode != 0, f"helm accepted {args}"
    assert "schema" in proc.stderr, proc.stderr
    assert where in proc.stderr, proc.stderr


def test_schema_rejects_bad_values_in_jsonschema(schema, default_values):
    bad = deep_merge(default_values, {"controller": {"replicas": "two"}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


# ---- checks the schema cannot express (template `fail`) -----------------------------------

FAILS = [
    (
        "replicas-without-leader-election",
        ["controller.replicas=2", "controller.leaderElection.enabled=false"],
        "requires controller.leaderElection.enabled",
    ),
    ("heartbeat-timeout", ["heartbeat.intervalSeconds=15", "heartbeat.timeoutSeconds=22"], "heartbeat.timeoutSeconds"),
    ("same-ports", ["kubeletPlugin.httpPort=9000", "kubeletPlugin.grpcHealthPort=9000"], "must differ"),
    ("same-class-names", ["deviceClasses.mig.name=gpu.migdra.dev"], "must differ"),
    (
        "update-cannot-progress",
        ["kubeletPlugin.maxSurge=0", "kubeletPlugin.maxUnavailable=0"],
        "cannot both be 0",
    ),
    (
        "update-cannot-progress-percent",
        ["kubeletPlugin.maxSurge=0%", "kubeletPlugin.maxUnavailable=0"],
        "cannot both be 0",
    ),
]


@pytest.mark.parametrize("sets,message", [(s, m) for _, s, m in FAILS], ids=[i for i, _, _ in FAILS])
def test_cross_field_checks(sets, message):
    proc = run_helm(*template_args(sets=sets), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_single_replica_without_leader_election_renders():
    rendered = Rendered(
        run_helm(*template_args(sets=["controller.replicas=1", "controller.leaderElection.enabled=false"])).stdout
    )
    roles = sorted(r["metadata"]["name"] for r in rendered.all("Role"))
    assert roles == [
        "migdra-controller-heartbeats",
        "migdra-controller-node-leases",
        "migdra-kubelet-plugin-heartbeat",
    ], "without leader election only the heartbeat and node Lease access"
    assert len(rendered.all("RoleBinding")) == 3
    assert not rendered.all("PodDisruptionBudget")
    env = {e["name"]: e.get("value") for e in rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LEADER_ELECT"] == "false"


# ---- NOTES.txt ----------------------------------------------------------------------------


def render_notes(tmp_path, *extra: str) -> str:
    """helm template does not print NOTES.txt, and install --dry-run needs a cluster: wrap the
    notes into a ConfigMap template of a copy of the chart and render that."""
    chart = tmp_path / "migdra"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "zz-notes-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n"
        '{{ include "migdra.test.notes" . | indent 4 }}\n'
        '{{- define "migdra.test.notes" }}' + notes + "{{ end }}\n"
    )
    proc = run_helm(
        *template_args(chart=chart), "--show-only", "templates/zz-notes-test.yaml", *extra
    )
    return yaml.safe_load(proc.stdout)["data"]["notes"]


def test_notes_render(tmp_path):
    notes = render_notes(tmp_path)
    assert "kubectl get gpunodes.gpu.migdra.dev" in notes
    assert "kubectl get resourceslices --field-selector spec.driver=gpu.migdra.dev" in notes
    assert "deviceClassName: mig.migdra.dev" in notes
    assert 'device.capacity["gpu.migdra.dev"].memory' in notes
    assert "migdra-kubelet-plugin-own-gpunode" in notes
    # The embedded example is valid YAML.
    example = notes.split("kubectl apply -f -\n", 1)[1].split("  YAML\n", 1)[0]
    docs = list(yaml.safe_load_all("\n".join(line[2:] for line in example.splitlines())))
    assert [d["kind"] for d in docs] == ["ResourceClaimTemplate", "Pod"]


def test_notes_follow_values(tmp_path):
    notes = render_notes(tmp_path, "-f", str(CUSTOM_VALUES))
    assert "spec.driver=mig.example.com" in notes
    assert "3g-40gb.mig.example.com" in notes
    assert "own-gpunode" not in notes
    assert "the nodes kubeletPlugin.affinity selects" in notes and "null" not in notes


# ---- Kubernetes OpenAPI validation (kubernetes-validate, offline) --------------------------


@pytest.mark.parametrize("which", ["default", "custom"])
def test_objects_validate_against_kubernetes_schemas(which, default, custom, tmp_path):
    rendered = default if which == "default" else custom
    # kubernetes-validate knows built-in kinds only; CRDs are checked in test_crds.py, the
    # Prometheus Operator's kinds in test_observability.py.
    docs = [
        d
        for d in rendered.docs
        if d["kind"] != "CustomResourceDefinition" and not d["apiVersion"].startswith("monitoring.coreos.com/")
    ]
    path = tmp_path / f"{which}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    minor = KUBE_VERSION.rsplit(".", 1)[0] + ".0"
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", minor, str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
