"""The ValidatingAdmissionPolicy that pins each kubelet plugin to its own node's GpuNode and
heartbeat Lease.

The policy's CEL is evaluated with cel-python (a pure-Python CEL implementation) on
AdmissionRequest-shaped inputs, following the VAP evaluation order: matchConstraints, then
matchConditions (all must hold, else the policy does not apply), then variables, then
validations (all must hold, else the request is denied). The API server's CEL environment has
more libraries; these expressions use only standard CEL (has, in, size, ==, ?:, +).
"""

from __future__ import annotations

import celpy
import pytest

from conftest import NAMESPACE, render

NODE_KEY = "authentication.kubernetes.io/node-name"
_env = celpy.Environment()


def cel(expression: str, activation: dict):
    program = _env.program(_env.compile(expression))
    return program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})


GPUNODE_POLICY_SUFFIX = "-kubelet-plugin-own-gpunode"


def gpunode_policy(rendered, kind="ValidatingAdmissionPolicy") -> dict:
    """The policy (or its binding) pinning plugins to their own GpuNode."""
    (found,) = [d for d in rendered.all(kind) if d["metadata"]["name"].endswith(GPUNODE_POLICY_SUFFIX)]
    return found


def plugin_username(rendered) -> str:
    sa = rendered.one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
    return f"system:serviceaccount:{NAMESPACE}:{sa}"


GPUNODES = {"group": "gpu.migdra.dev", "version": "v1alpha1", "resource": "gpunodes"}
LEASES = {"group": "coordination.k8s.io", "version": "v1", "resource": "leases"}


def plugin_request(
    rendered, node: str | None, operation="UPDATE", subresource="", username=None, extra=None, resource=None
):
    user = {"username": username or plugin_username(rendered), "groups": ["system:serviceaccounts"]}
    if extra is not None:
        user["extra"] = extra
    elif node is not None:
        user["extra"] = {NODE_KEY: [node], "authentication.kubernetes.io/pod-name": ["plugin-x"]}
    return {
        "operation": operation,
        "resource": resource or GPUNODES,
        "subResource": subresource,
        "userInfo": user,
    }


def run_policy(spec: dict, request: dict, activation: dict) -> tuple[bool, list[str]]:
    """(allowed, denial messages) of a ValidatingAdmissionPolicy `spec` for `request`, with
    `activation` holding `object` (and `oldObject`) as the API server would bind them."""
    resource = request["resource"]["resource"] + (f"/{request['subResource']}" if request["subResource"] else "")
    matched = any(
        request["resource"]["group"] in rule["apiGroups"]
        and resource in rule["resources"]
        and request["operation"] in rule["operations"]
        for rule in spec["matchConstraints"]["resourceRules"]
    )
    if not matched:
        return True, []
    activation = {"request": request, **activation}
    for condition in spec.get("matchConditions", []):
        if not bool(cel(condition["expression"], activation)):
            return True, []
    variables: dict = {}
    for var in spec.get("variables", []):
        variables[var["name"]] = cel(var["expression"], {**activation, "variables": variables})
    activation["variables"] = variables
    messages = []
    for validation in spec["validations"]:
        if not bool(cel(validation["expression"], activation)):
            if "messageExpression" in validation:
                messages.append(str(cel(validation["messageExpression"], activation)))
            else:
                messages.append(validation["message"])
    return not messages, messages


def evaluate_policy(rendered, request: dict, object_name: str) -> tuple[bool, list[str]]:
    """(allowed, denial messages) of the rendered policy for one GpuNode write."""
    group = request["resource"]["group"]
    obj = {"apiVersion": f"{group}/{request['resource']['version']}", "metadata": {"name": object_name}}
    return run_policy(gpunode_policy(rendered)["spec"], request, {"object": obj})


def test_policy_targets_gpunodes_status_and_leases(default):
    policy = gpunode_policy(default)
    gpunodes, leases = policy["spec"]["matchConstraints"]["resourceRules"]
    assert gpunodes["apiGroups"] == ["gpu.migdra.dev"]
    assert sorted(gpunodes["resources"]) == ["gpunodes", "gpunodes/status"]
    assert leases["apiGroups"] == ["coordination.k8s.io"]
    assert leases["resources"] == ["leases"]
    for rule in (gpunodes, leases):
        assert sorted(rule["operations"]) == ["CREATE", "UPDATE"]
    assert policy["spec"]["failurePolicy"] == "Fail"


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_own_heartbeat_lease_allowed_others_denied(default, operation):
    request = plugin_request(default, "node-a", operation, resource=LEASES)
    assert evaluate_policy(default, request, "node-a.gpu.migdra.dev") == (True, [])
    for name in ("node-b.gpu.migdra.dev", "migdra-controller", "node-a", "node-a.other.dev"):
        allowed, messages = evaluate_policy(default, request, name)
        assert not allowed, name
        assert any("node-a.gpu.migdra.dev" in m and name in m for m in messages), messages


def test_heartbeat_lease_name_follows_the_driver_name():
    rendered = render(sets=["driverName=gpu.example.com"])
    request = plugin_request(rendered, "n1", resource=LEASES)
    assert evaluate_policy(rendered, request, "n1.gpu.example.com") == (True, [])
    assert not evaluate_policy(rendered, request, "n1.gpu.migdra.dev")[0]


def test_policy_references_plugin_service_account(default):
    policy = gpunode_policy(default)
    (condition,) = policy["spec"]["matchConditions"]
    assert f'"{plugin_username(default)}"' in condition["expression"]
    assert "migdra-kubelet-plugin" in plugin_username(default)


def test_policy_guards_the_node_name_lookup(default):
    text = " ".join(v["expression"] for v in gpunode_policy(default)["spec"]["variables"])
    assert "has(request.userInfo.extra)" in text
    assert f'"{NODE_KEY}" in request.userInfo.extra' in text
    assert "size(" in text


def test_binding_denies(default):
    policy = gpunode_policy(default)
    binding = gpunode_policy(default, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"] or binding["spec"]["matchResources"]


def test_messages_have_no_line_breaks(default):
    """The API server rejects a validation message with a line break."""
    for v in gpunode_policy(default)["spec"]["validations"]:
        assert "\n" not in v.get("message", ""), v


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
@pytest.mark.parametrize("subresource", ["", "status"])
def test_own_node_allowed_other_node_denied(default, operation, subresource):
    request = plugin_request(default, "node-a", operation, subresource)
    assert evaluate_policy(default, request, "node-a") == (True, [])
    allowed, messages = evaluate_policy(default, request, "node-b")
    assert not allowed
    assert any("node-a" in m and "node-b" in m for m in messages), messages


@pytest.mark.parametrize(
    "extra",
    [{}, {"authentication.kubernetes.io/pod-name": ["p"]}, {NODE_KEY: []}, {NODE_KEY: [""]}],
    ids=["no-extra", "no-node-key", "empty-list", "empty-name"],
)
def test_token_without_node_is_denied(default, extra):
    request = plugin_request(default, None, extra=extra)
    allowed, messages = evaluate_policy(default, request, "node-a")
    assert not allowed and messages


def test_request_without_extra_field_is_denied(default):
    request = plugin_request(default, None)
    assert "extra" not in request["userInfo"]
    allowed, _ = evaluate_policy(default, request, "")
    assert not allowed


def test_other_users_unaffected(default):
    for user in (
        "system:serviceaccount:migdra-system:migdra-controller",
        "system:serviceaccount:other:migdra-kubelet-plugin",
        "kubernetes-admin",
    ):
        request = plugin_request(default, "node-a", username=user)
        assert evaluate_policy(default, request, "node-b") == (True, []), user
        request = plugin_request(default, None, username=user)
        assert evaluate_policy(default, request, "anything") == (True, []), user


def test_policy_follows_service_account_name():
    rendered = render(sets=["kubeletPlugin.serviceAccount.name=my-plugin"])
    (condition,) = gpunode_policy(rendered)["spec"]["matchConditions"]
    assert '"system:serviceaccount:migdra-system:my-plugin"' in condition["expression"]
    request = plugin_request(rendered, "n1")
    assert request["userInfo"]["username"].endswith(":my-plugin")
    assert not evaluate_policy(rendered, request, "n2")[0]


def test_policy_can_be_disabled(custom):
    assert not custom.all("ValidatingAdmissionPolicy")
    assert not custom.all("ValidatingAdmissionPolicyBinding")
