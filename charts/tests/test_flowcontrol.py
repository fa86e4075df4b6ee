"""API Priority and Fairness: which FlowSchema, and so which priority level, each request of
migdra's two ServiceAccounts lands in.

`classify` is a small offline model of the API server's matching (flowcontrol v1: the
lowest matchingPrecedence whose rules match, ties by name) over the chart's FlowSchemas plus
the upstream ones a ServiceAccount's request can meet: `kube-system-service-accounts` (900,
every ServiceAccount of kube-system, workload-high) and `service-accounts` (9000, every
ServiceAccount, workload-low). The requests are the "yes" rows of rbac_matrix.txt: what the
components are allowed, hence what they send. The end-to-end suite checks the same against a
real API server (the response's X-Kubernetes-PF-FlowSchema-UID).
"""

from __future__ import annotations

import functools

import pytest

from conftest import NAMESPACE, RELEASE, CHART, KUBE_VERSION, Rendered, run_helm
from test_rbac import ROWS, Row, sa_name

def upstream_schema(name: str, precedence: int, level: str, group: str) -> dict:
    """An upstream FlowSchema that matches every request of a ServiceAccount group."""
    return {
        "metadata": {"name": name},
        "spec": {
            "matchingPrecedence": precedence,
            "priorityLevelConfiguration": {"name": level},
            "rules": [
                {
                    "subjects": [{"kind": "Group", "group": {"name": group}}],
                    "resourceRules": [
                        {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True, "namespaces": ["*"]}
                    ],
                }
            ],
        },
    }


UPSTREAM = [
    upstream_schema("kube-system-service-accounts", 900, "workload-high", "system:serviceaccounts:kube-system"),
    upstream_schema("service-accounts", 9000, "workload-low", "system:serviceaccounts"),
]


def subject_matches(subject: dict, sa_namespace: str, sa: str) -> bool:
    if subject["kind"] == "ServiceAccount":
        s = subject["serviceAccount"]
        return s["namespace"] == sa_namespace and s["name"] in ("*", sa)
    if subject["kind"] == "Group":
        return subject["group"]["name"] in ("system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}")
    return subject["kind"] == "User" and subject["user"]["name"] == f"system:serviceaccount:{sa_namespace}:{sa}"


def resource_rule_matches(rule: dict, row: Row) -> bool:
    resource = f"{row.resource}/{row.subresource}" if row.subresource else row.resource
    if not ({"*", row.verb} & set(rule["verbs"])) or not ({"*", row.group} & set(rule["apiGroups"])):
        return False
    if not ({"*", resource} & set(rule["resources"])):
        return False
    if row.namespace:
        return bool({"*", row.namespace} & set(rule.get("namespaces", [])))
    return rule.get("clusterScope", False)


def classify(schemas: list[dict], sa_namespace: str, sa: str, row: Row) -> dict:
    def matches(schema):
        return any(
            any(subject_matches(s, sa_namespace, sa) for s in rule["subjects"])
            and any(resource_rule_matches(r, row) for r in rule.get("resourceRules", []))
            for rule in schema["spec"]["rules"]
        )

    ordered = sorted(schemas, key=lambda s: (s["spec"]["matchingPrecedence"], s["metadata"]["name"]))
    return next(s for s in ordered if matches(s))


def level(schema: dict) -> str:
    return schema["spec"]["priorityLevelConfiguration"]["name"]


SENT = [r for r in ROWS if r.expected and r.check == "can-i"]
SUBJECTS = {"plugin": "kubelet-plugin", "controller": "controller"}


def expected_level(row: Row) -> str:
    heartbeat = row.group == "coordination.k8s.io" and row.verb in ("get", "create", "patch")
    if row.subject == "plugin" and (heartbeat or row.group == "gpu.migdra.dev"):
        return "node-high"
    leader_lease = row.group == "coordination.k8s.io" and row.namespace != "kube-node-lease"
    if row.subject == "controller" and leader_lease and row.verb in ("get", "create", "update", "patch"):
        return "leader-election"
    return "workload-high"


@functools.cache
def render_in(namespace: str, *sets: str) -> Rendered:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    return Rendered(run_helm(*args).stdout)


def test_the_matrix_has_requests_of_every_level():
    levels = {(r.subject, expected_level(r)) for r in SENT}
    assert {("plugin", "node-high"), ("plugin", "workload-high"), ("controller", "leader-election"), ("controller", "workload-high")} <= levels


@pytest.mark.parametrize("namespace", [NAMESPACE, "kube-system"])
@pytest.mark.parametrize("row", SENT, ids=lambda r: f"line{r.line}")
def test_every_request_lands_in_its_level(namespace, row):
    rendered = render_in(namespace)
    sa = sa_name(rendered, SUBJECTS[row.subject])
    row = Row(**{**row.__dict__, "namespace": namespace if row.namespace == NAMESPACE else row.namespace})
    schema = classify(rendered.all("FlowSchema") + UPSTREAM, namespace, sa, row)
    assert schema["metadata"]["name"].startswith("migdra-"), f"{row} falls to {schema['metadata']['name']}"
    assert level(schema) == expected_level(row), (row, schema["metadata"]["name"])


def test_other_service_accounts_are_not_matched(default):
    other = Row(0, "plugin", "patch", "coordination.k8s.io", "leases", "", NAMESPACE, "x", True, "can-i")
    schema = classify(default.all("FlowSchema") + UPSTREAM, NAMESPACE, "someone-else", other)
    assert schema["metadata"]["name"] == "service-accounts"


def test_heartbeat_rules_stay_in_the_release_namespace(default):
    sa = sa_name(default, "kubelet-plugin")
    elsewhere = Row(0, "plugin", "patch", "coordination.k8s.io", "leases", "", "default", "x", True, "can-i")
    assert level(classify(default.all("FlowSchema") + UPSTREAM, NAMESPACE, sa, elsewhere)) == "workload-high"


def test_values_choose_levels_and_precedence():
    rendered = render_in(
        NAMESPACE,
        "flowControl.matchingPrecedence=300",
        "flowControl.heartbeatPriorityLevel=system",
        "flowControl.priorityLevel=custom-level",
    )
    schemas = {s["metadata"]["name"]: s["spec"] for s in rendered.all("FlowSchema")}
    assert schemas["migdra-kubelet-plugin-heartbeat"]["matchingPrecedence"] == 300
    assert schemas["migdra-kubelet-plugin-heartbeat"]["priorityLevelConfiguration"]["name"] == "system"
    assert schemas["migdra-kubelet-plugin"]["matchingPrecedence"] == 310
    assert schemas["migdra-controller"]["priorityLevelConfiguration"]["name"] == "custom-level"


def test_precedence_must_stay_below_kube_system_service_accounts():
    proc = run_helm(
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", "flowControl.matchingPrecedence=900", check=False
    )
    assert proc.returncode != 0 and "matchingPrecedence" in proc.stderr


def test_disabled_renders_no_flowschema():
    assert render_in(NAMESPACE, "flowControl.enabled=false").all("FlowSchema") == []


def test_without_leader_election_there_is_no_leader_election_schema(custom):
    names = sorted(s["metadata"]["name"] for s in custom.all("FlowSchema"))
    assert names == ["gpu-stack-controller", "gpu-stack-kubelet-plugin", "gpu-stack-kubelet-plugin-heartbeat"]
