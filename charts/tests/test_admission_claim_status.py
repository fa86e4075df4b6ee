"""The ValidatingAdmissionPolicy that pins each kubelet plugin's ResourceClaim status writes to
claims allocated on its own node and to its own driver's entries for that node's pool: what
the API server enforces from 1.36 by resourceclaims/driver and resourceclaims/binding
authorization, and on 1.35 nothing but this policy.

Evaluated with cel-python like test_admission.py: matchConstraints, matchConditions,
variables, validations, on AdmissionRequest-shaped inputs with the claim before (oldObject)
and after (object) the write.
"""

from __future__ import annotations

import copy

import pytest

from conftest import NAMESPACE, render
from test_admission import NODE_KEY, plugin_username, run_policy

POLICY_SUFFIX = "-kubelet-plugin-own-claims"
CLAIMS = {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"}
DRIVER = "gpu.migdra.dev"


def claim_policy(rendered, kind="ValidatingAdmissionPolicy") -> dict:
    (found,) = [d for d in rendered.all(kind) if d["metadata"]["name"].endswith(POLICY_SUFFIX)]
    return found


def on_node(node: str) -> dict:
    """The nodeSelector the scheduler writes for a claim allocated from a node-local pool."""
    return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}


def claim(node_selector: dict | None, devices: list[dict] | None = None, reserved=None) -> dict:
    status: dict = {}
    if node_selector is not None:
        status["allocation"] = {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "x", "device": "gpu-0"}]},
            "nodeSelector": node_selector,
        }
    if reserved is not None:
        status["reservedFor"] = reserved
    if devices is not None:
        status["devices"] = devices
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": status,
    }


def entry(node: str, device="gpu-0", driver=DRIVER, ready=True) -> dict:
    return {
        "driver": driver,
        "pool": f"{node}/{driver}",
        "device": device,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "R", "message": "m"}],
        "data": {"type": "gpu", "uuid": f"GPU-{node}-{device}"},
    }


def status_request(rendered, token_node: str | None, username=None, extra=None) -> dict:
    user = {"username": username or plugin_username(rendered), "groups": ["system:serviceaccounts"]}
    if extra is not None:
        user["extra"] = extra
    elif token_node is not None:
        user["extra"] = {NODE_KEY: [token_node], "authentication.kubernetes.io/pod-name": ["plugin-x"]}
    return {"operation": "UPDATE", "resource": CLAIMS, "subResource": "status", "userInfo": user}


def evaluate(rendered, request: dict, old: dict, new: dict) -> tuple[bool, list[str]]:
    """(allowed, denial messages) of the rendered policy for one claim status write."""
    return run_policy(claim_policy(rendered)["spec"], request, {"object": new, "oldObject": old})


def write(rendered, token_node, old, new, **kwargs):
    return evaluate(rendered, status_request(rendered, token_node, **kwargs), old, new)


def test_policy_matches_claim_status_updates_only(default):
    spec = claim_policy(default)["spec"]
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["*"],
        "operations": ["UPDATE"],
        "resources": ["resourceclaims/status"],
    }
    assert spec["failurePolicy"] == "Fail"
    (condition,) = spec["matchConditions"]
    assert f'"{plugin_username(default)}"' in condition["expression"]
    # Not the main resource: the plugin has no RBAC for it, and users write claims there.
    request = status_request(default, "node-a")
    request["subResource"] = ""
    assert evaluate(default, request, claim(None), claim(None, [entry("x")])) == (True, [])


def test_binding_denies(default):
    binding = claim_policy(default, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == claim_policy(default)["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    for v in claim_policy(default)["spec"]["validations"]:
        assert "\n" not in v.get("message", ""), v


def test_own_entries_on_own_nodes_claim_are_written_and_cleared(default):
    old = claim(on_node("node-a"))
    ready = claim(on_node("node-a"), [entry("node-a"), entry("node-a", "mig-0-1g.10gb-0")])
    assert write(default, "node-a", old, ready) == (True, [])
    changed = claim(on_node("node-a"), [entry("node-a", ready=False)])
    assert write(default, "node-a", ready, changed) == (True, [])
    assert write(default, "node-a", ready, claim(on_node("node-a"), [])) == (True, [])
    assert write(default, "node-a", ready, old) == (True, [])


def test_claim_of_another_node_is_refused(default):
    old = claim(on_node("node-b"))
    allowed, messages = write(default, "node-a", old, claim(on_node("node-b"), [entry("node-a")]))
    assert not allowed
    assert any("node node-a" in m and "allocated to node node-b" in m for m in messages), messages
    # Nor clearing what node-b's plugin wrote, in node-b's pool.
    written = claim(on_node("node-b"), [entry("node-b")])
    allowed, messages = write(default, "node-a", written, claim(on_node("node-b"), []))
    assert not allowed
    assert any("pool node-a/gpu.migdra.dev" in m for m in messages), messages


def test_entries_of_other_pools_and_drivers_stay(default):
    theirs = entry("node-a", driver="net.example.com")
    old = claim(on_node("node-a"), [theirs])
    for new_devices in (
        [],  # removed
        [{**theirs, "data": {"ip": "10.0.0.1"}}],  # changed
        [theirs, entry("node-a", "gpu-1", driver="net.example.com")],  # added
        [theirs, entry("node-b")],  # this driver, another node's pool
    ):
        allowed, messages = write(default, "node-a", old, claim(on_node("node-a"), new_devices))
        assert not allowed, new_devices
        assert any("entries of driver gpu.migdra.dev in pool node-a/gpu.migdra.dev" in m for m in messages)
    # Written next to them, in any order: allowed.
    both = claim(on_node("node-a"), [entry("node-a"), theirs])
    assert write(default, "node-a", old, both) == (True, [])
    assert write(default, "node-a", both, claim(on_node("node-a"), [theirs])) == (True, [])


def test_allocation_and_reservations_are_not_the_plugins(default):
    pod = {"resource": "pods", "name": "p", "uid": "u1"}
    old = claim(on_node("node-a"), reserved=[pod])
    deallocated = copy.deepcopy(old)
    del deallocated["status"]["allocation"]
    moved = claim(on_node("node-b"), reserved=[pod])
    for new, field in ((deallocated, "status.allocation"), (moved, "status.allocation")):
        allowed, messages = write(default, "node-a", old, new)
        assert not allowed and any(field in m for m in messages), messages
    allocated_now = claim(on_node("node-a"), reserved=[pod])
    allowed, _ = write(default, "node-a", claim(None, reserved=[pod]), allocated_now)
    assert not allowed
    for reserved in ([], [pod, {"resource": "pods", "name": "q", "uid": "u2"}]):
        new = claim(on_node("node-a"), reserved=reserved)
        allowed, messages = write(default, "node-a", old, new)
        assert not allowed and any("status.reservedFor" in m for m in messages), messages
    unreserved = claim(on_node("node-a"))
    allowed, _ = write(default, "node-a", old, unreserved)
    assert not allowed


def test_no_change_passes_whatever_the_claim(default):
    """Clearing entries the API server already dropped (the claim was deallocated)."""
    for old in (claim(None), claim(on_node("node-b"), [entry("node-b")])):
        assert write(default, "node-a", old, copy.deepcopy(old)) == (True, [])


@pytest.mark.parametrize(
    "selector",
    [
        None,
        {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]}]},
        {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a", "node-b"]}]}]},
        {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-b"]}]}]},
        {
            "nodeSelectorTerms": [
                {
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}],
                    "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}],
                }
            ]
        },
        {"nodeSelectorTerms": [on_node("node-a")["nodeSelectorTerms"][0], on_node("node-b")["nodeSelectorTerms"][0]]},
    ],
    ids=["unallocated", "label-selector", "two-nodes", "not-in", "field-and-label", "two-terms"],
)
def test_claim_not_on_exactly_this_node_is_refused(default, selector):
    old = claim(selector)
    allowed, messages = write(default, "node-a", old, claim(selector, [entry("node-a")]))
    assert not allowed, selector
    assert any("allocated to" in m for m in messages), messages


@pytest.mark.parametrize(
    "extra",
    [{}, {"authentication.kubernetes.io/pod-name": ["p"]}, {NODE_KEY: []}, {NODE_KEY: [""]}],
    ids=["no-extra", "no-node-key", "empty-list", "empty-name"],
)
def test_token_without_node_is_refused(default, extra):
    old = claim(on_node("node-a"))
    allowed, messages = write(default, None, old, claim(on_node("node-a"), [entry("node-a")]), extra=extra)
    assert not allowed
    assert any("node-bound ServiceAccount token" in m for m in messages), messages


def test_other_users_unaffected(default):
    """The scheduler allocating and reserving, other drivers, the controller: not matched."""
    old = claim(None)
    new = claim(on_node("node-b"), [entry("node-b", driver="net.example.com")], reserved=[{"resource": "pods", "name": "p", "uid": "u"}])
    for user in (
        "system:kube-scheduler",
        "system:serviceaccount:kube-system:net-driver",
        f"system:serviceaccount:{NAMESPACE}:migdra-controller",
        "system:serviceaccount:other:migdra-kubelet-plugin",
    ):
        assert write(default, "node-a", old, new, username=user) == (True, []), user


def test_policy_follows_driver_and_service_account_names():
    rendered = render(sets=["driverName=gpu.example.com", "kubeletPlugin.serviceAccount.name=my-plugin"])
    assert plugin_username(rendered).endswith(":my-plugin")
    old = claim(on_node("n1"))
    own = entry("n1", driver="gpu.example.com")
    assert write(rendered, "n1", old, claim(on_node("n1"), [own])) == (True, [])
    allowed, _ = write(rendered, "n1", old, claim(on_node("n1"), [entry("n1")]))
    assert not allowed, "gpu.migdra.dev is another driver here"


def test_policy_can_be_disabled(custom):
    assert not [d for d in custom.all("ValidatingAdmissionPolicy") if d["metadata"]["name"].endswith(POLICY_SUFFIX)]
