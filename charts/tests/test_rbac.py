"""Least-privilege RBAC of the two ServiceAccounts, and the access matrix in rbac_matrix.txt.

`Authorizer` is a small offline model of the RBAC authorizer: it only knows the chart's own
Roles and bindings (a real cluster adds the default system:* bindings, which grant neither
ServiceAccount anything the matrix asks about).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from conftest import NAMESPACE, TESTS
from test_admission import evaluate_policy, plugin_request
from test_admission_claim_status import claim, entry, on_node
from test_admission_claim_status import write as claim_status_write

MATRIX = TESTS / "rbac_matrix.txt"
NODE = "gpu-node-1"


@dataclass(frozen=True)
class Row:
    line: int
    subject: str
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    expected: bool
    check: str


def parse_matrix(path: Path = MATRIX) -> list[Row]:
    rows = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        assert len(fields) == 8, f"{path.name}:{number}: expected 8 columns, got {fields}"
        subject, verb, resource, sub, ns, name, expected, check = fields
        assert subject in ("plugin", "controller"), number
        assert expected in ("yes", "no"), number
        assert check in ("can-i", "admission", "claim-status", "claim-status-policy"), number
        plural, _, group = resource.partition(".")
        rows.append(
            Row(
                number,
                subject,
                verb,
                group,
                plural,
                "" if sub == "-" else sub,
                "" if ns == "-" else ns.replace("$RELEASE_NS", NAMESPACE),
                "" if name == "-" else name.replace("$NODE", NODE),
                expected == "yes",
                check,
            )
        )
    return rows


class Authorizer:
    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}

    def rules_for(self, sa_namespace: str, sa_name: str) -> list[tuple[str, dict]]:
        """(scope namespace or "" for cluster-wide, rule) for every rule bound to the SA."""
        out = []
        for b in self.docs:
            if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
                continue
            if not any(
                s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == sa_namespace
                for s in b.get("subjects", [])
            ):
                continue
            ref = b["roleRef"]
            scope = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
            role_ns = "" if ref["kind"] == "ClusterRole" else scope
            role = self.roles.get((ref["kind"], role_ns, ref["name"]))
            assert role is not None, f"{b['metadata']['name']} refers to missing {ref}"
            out += [(scope, rule) for rule in role.get("rules", [])]
        return out

    def allowed(self, sa_name: str, row: Row) -> bool:
        resource = f"{row.resource}/{row.subresource}" if row.subresource else row.resource
        for scope, rule in self.rules_for(NAMESPACE, sa_name):
            if scope and scope != row.namespace:
                continue
            if not ({"*", row.group} & set(rule.get("apiGroups", []))):
                continue
            if not ({"*", resource} & set(rule.get("resources", []))):
                continue
            if not ({"*", row.verb} & set(rule.get("verbs", []))):
                continue
            names = rule.get("resourceNames")
            if names and row.name not in names:
                continue
            return True
        return False


def sa_name(rendered, component: str) -> str:
    (sa,) = [
        s["metadata"]["name"]
        for s in rendered.all("ServiceAccount")
        if s["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return sa


SUBJECTS = {"plugin": "kubelet-plugin", "controller": "controller"}
ROWS = parse_matrix()


def test_matrix_covers_the_required_checks():
    def has(subject, verb, resource, expected, check="can-i", name=None, sub=""):
        return any(
            r.subject == subject
            and r.verb == verb
            and f"{r.resource}.{r.group}".rstrip(".") == resource
            and r.expected == expected
            and r.check == check
            and r.subresource == sub
            and (name is None or r.name == name)
            for r in ROWS
        )

    assert has("plugin", "create", "resourceslices.resource.k8s.io", False)
    assert has("plugin", "delete", "resourceslices.resource.k8s.io", False)
    assert has("plugin", "patch", "gpunodes.gpu.migdra.dev", False, "admission", name="other-node")
    assert has("plugin", "get", "resourceclaims.resource.k8s.io", True)
    assert has("plugin", "list", "secrets", False)
    assert has("plugin", "patch", "resourceclaims.resource.k8s.io", True, "claim-status", name=NODE, sub="status")
    assert has("plugin", "patch", "resourceclaims.resource.k8s.io", False, "claim-status", name="other-node", sub="status")
    for node, expected in ((NODE, True), ("other-node", False)):
        assert has("plugin", "patch", "resourceclaims.resource.k8s.io", expected, "claim-status-policy", name=node, sub="status")
    assert has("controller", "create", "resourceslices.resource.k8s.io", True)
    assert has("controller", "patch", "gpunodes.gpu.migdra.dev", True, sub="status")
    assert has("controller", "get", "secrets", False)
    assert has("controller", "create", "pods", False)
    assert has("controller", "watch", "leases.coordination.k8s.io", True)


@pytest.mark.parametrize("row", [r for r in ROWS if r.check == "can-i"], ids=lambda r: f"line{r.line}")
def test_matrix_can_i(default, row):
    auth = Authorizer(default.docs)
    sa = sa_name(default, SUBJECTS[row.subject])
    assert auth.allowed(sa, row) is row.expected, row


@pytest.mark.parametrize("row", [r for r in ROWS if r.check == "admission"], ids=lambda r: f"line{r.line}")
def test_matrix_admission(default, row):
    """RBAC allows the write; the ValidatingAdmissionPolicy decides."""
    assert row.subject == "plugin"
    auth = Authorizer(default.docs)
    sa = sa_name(default, "kubelet-plugin")
    assert auth.allowed(sa, row), f"RBAC must allow {row} for the admission check to mean anything"
    operation = "CREATE" if row.verb == "create" else "UPDATE"
    request = plugin_request(default, node=NODE, operation=operation, subresource=row.subresource)
    allowed, _ = evaluate_policy(default, request, object_name=row.name)
    assert allowed is row.expected, row


def device_status_write_allowed(auth: Authorizer, sa: str, row: Row, token_node: str, driver: str) -> bool:
    """What the API server decides for a write of `driver`'s status.devices entries by `sa`
    with a token bound to `token_node`, on a claim allocated on `row.name` (1.36+): RBAC on
    resourceclaims/status, plus resourceclaims/driver named `driver` with associated-node:<verb>
    when the claim's node is the token's, else arbitrary-node:<verb>."""
    status = auth.allowed(sa, replace(row, name=""))

    def driver_verb(prefix: str) -> bool:
        return auth.allowed(sa, replace(row, verb=f"{prefix}:{row.verb}", subresource="driver", name=driver))

    associated = row.name == token_node and driver_verb("associated-node")
    return status and (associated or driver_verb("arbitrary-node"))


@pytest.mark.parametrize("row", [r for r in ROWS if r.check == "claim-status"], ids=lambda r: f"line{r.line}")
def test_matrix_claim_status(default, default_values, row):
    assert row.subject == "plugin" and row.subresource == "status"
    auth = Authorizer(default.docs)
    sa = sa_name(default, "kubelet-plugin")
    allowed = device_status_write_allowed(auth, sa, row, token_node=NODE, driver=default_values["driverName"])
    assert allowed is row.expected, row


@pytest.mark.parametrize("row", [r for r in ROWS if r.check == "claim-status-policy"], ids=lambda r: f"line{r.line}")
def test_matrix_claim_status_policy(default, default_values, row):
    """Without the 1.36+ checks: RBAC allows the write, the admission policy decides."""
    assert row.subject == "plugin" and row.subresource == "status"
    auth = Authorizer(default.docs)
    sa = sa_name(default, "kubelet-plugin")
    assert auth.allowed(sa, replace(row, name="")), f"RBAC must allow {row} for the check to mean anything"
    driver = default_values["driverName"]
    old = claim(on_node(row.name))
    new = claim(on_node(row.name), [entry(NODE, driver=driver)])
    allowed, _ = claim_status_write(default, NODE, old, new)
    assert allowed is row.expected, row


def test_claim_status_rules_name_the_driver(case):
    rendered, values = case
    role = cluster_role(rendered, "kubelet-plugin")
    (rule,) = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    assert rule["resourceNames"] == [values["driverName"]]
    assert rule["verbs"] == ["associated-node:patch"], "never arbitrary-node: only claims on the plugin's node"
    assert rule["resources"] == ["resourceclaims/driver"]


# ---- direct structural checks ------------------------------------------------------------


def cluster_role(rendered, component):
    return next(
        r
        for r in rendered.all("ClusterRole")
        if r["metadata"]["labels"]["app.kubernetes.io/component"] == component
    )


def test_plugin_has_no_resourceslice_access(case):
    rendered, _ = case
    role = cluster_role(rendered, "kubelet-plugin")
    for rule in role["rules"]:
        assert not any(r.startswith("resourceslices") for r in rule["resources"]), rule
        assert "*" not in rule["resources"] and "*" not in rule["apiGroups"] and "*" not in rule["verbs"], rule


def test_controller_has_resourceslice_access(case):
    rendered, _ = case
    role = cluster_role(rendered, "controller")
    rules = [r for r in role["rules"] if "resourceslices" in r["resources"]]
    assert rules and rules[0]["apiGroups"] == ["resource.k8s.io"]
    assert set(rules[0]["verbs"]) == {"get", "list", "watch", "create", "update", "patch", "delete"}


def test_no_wildcards_or_secrets_anywhere(case):
    rendered, _ = case
    for role in rendered.all("ClusterRole") + rendered.all("Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            assert "secrets" not in rule["resources"], role["metadata"]["name"]
            assert "pods" not in rule["resources"], role["metadata"]["name"]


def test_exact_rule_sets(default):
    def flatten(role):
        return {
            (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
        }

    events = {(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")}
    assert flatten(cluster_role(default, "kubelet-plugin")) == {
        ("resource.k8s.io", "resourceclaims", "get"),
        ("resource.k8s.io", "resourceclaims/status", "patch"),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch"),
        ("", "nodes", "get"),
        ("gpu.migdra.dev", "gpunodes", "get"),
        ("gpu.migdra.dev", "gpunodes", "create"),
        ("gpu.migdra.dev", "gpunodes", "patch"),
        ("gpu.migdra.dev", "gpunodes/status", "patch"),
    } | events
    slices = {("resource.k8s.io", "resourceslices", v) for v in ("get", "list", "watch", "create", "update", "patch", "delete")}
    assert flatten(cluster_role(default, "controller")) == slices | events | {
        ("gpu.migdra.dev", "gpunodes", "get"),
        ("gpu.migdra.dev", "gpunodes", "list"),
        ("gpu.migdra.dev", "gpunodes", "watch"),
        ("gpu.migdra.dev", "gpunodes/status", "get"),
        ("gpu.migdra.dev", "gpunodes/status", "patch"),
        ("gpu.migdra.dev", "gpunodes/status", "update"),
        ("gpu.migdra.dev", "migpolicies", "get"),
        ("gpu.migdra.dev", "migpolicies", "list"),
        ("gpu.migdra.dev", "migpolicies", "watch"),
        ("resource.k8s.io", "resourceclaims", "list"),
        ("resource.k8s.io", "resourceclaims", "watch"),
        ("", "nodes", "get"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
    }
    roles = {r["metadata"]["name"].rsplit("-controller-", 1)[-1].rsplit("-kubelet-plugin-", 1)[-1]: r for r in default.all("Role")}
    assert sorted(roles) == ["heartbeat", "heartbeats", "leader-election", "node-leases"]
    for name, role in roles.items():
        assert role["metadata"]["namespace"] == ("kube-node-lease" if name == "node-leases" else NAMESPACE)
    leases = lambda *verbs: {("coordination.k8s.io", "leases", v) for v in verbs}  # noqa: E731
    assert flatten(roles["leader-election"]) == leases("get", "create", "update", "patch")
    assert flatten(roles["heartbeats"]) == leases("get", "list", "watch")
    assert flatten(roles["heartbeat"]) == leases("get", "create", "patch")
    assert flatten(roles["node-leases"]) == leases("get", "list", "watch")


def test_bindings_point_at_the_workload_service_accounts(case):
    rendered, _ = case
    pods = {
        "controller": rendered.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"],
        "kubelet-plugin": rendered.one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"],
    }
    for binding in rendered.all("ClusterRoleBinding") + rendered.all("RoleBinding"):
        component = binding["metadata"]["labels"]["app.kubernetes.io/component"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pods[component], "namespace": NAMESPACE}]
        role_kind = binding["roleRef"]["kind"]
        assert any(r["metadata"]["name"] == binding["roleRef"]["name"] for r in rendered.all(role_kind))


def test_custom_service_account_name(custom):
    assert custom.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "custom-controller"
    roles = [r["metadata"]["name"] for r in custom.all("Role")]
    assert not any(n.endswith("leader-election") for n in roles), "leader election is off in values-custom.yaml"
    assert len(roles) == 3, "only the heartbeat Lease access of the controller and the plugin, and the node Leases"
