"""The ValidatingAdmissionPolicy that refuses adminAccess to MIG partitions.

adminAccess is served for whole GPUs only (a MIG partition exists only while a claim without
adminAccess uses it). The policy's CEL is evaluated with cel-python on AdmissionRequest-shaped
inputs for ResourceClaims and ResourceClaimTemplates, in the VAP order: matchConstraints,
variables, validations.
"""

from __future__ import annotations

import celpy
import pytest

from conftest import render

_env = celpy.Environment()


def to_cel(value):
    """JSON to CEL values; booleans stay booleans (celpy.json_to_cel makes them ints)."""
    if isinstance(value, bool):
        return celpy.celtypes.BoolType(value)
    if isinstance(value, dict):
        return celpy.celtypes.MapType({celpy.celtypes.StringType(k): to_cel(v) for k, v in value.items()})
    if isinstance(value, list):
        return celpy.celtypes.ListType([to_cel(v) for v in value])
    return celpy.json_to_cel(value)


def cel(expression: str, activation: dict):
    program = _env.program(_env.compile(expression))
    converted = {k: to_cel(v) for k, v in activation.items() if k != "variables"}
    if "variables" in activation:
        # Already CEL values (results of earlier expressions).
        converted["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in activation["variables"].items()}
        )
    return program.evaluate(converted)

SUFFIX = "-admin-access-whole-gpus"


def admin_policy(rendered, kind="ValidatingAdmissionPolicy") -> dict:
    (found,) = [d for d in rendered.all(kind) if d["metadata"]["name"].endswith(SUFFIX)]
    return found


def claim_spec(*requests) -> dict:
    return {"devices": {"requests": list(requests)}}


def exactly(name, device_class, admin=None) -> dict:
    request = {"name": name, "exactly": {"deviceClassName": device_class}}
    if admin is not None:
        request["exactly"]["adminAccess"] = admin
    return request


def evaluate(rendered, resource: str, spec: dict, operation="CREATE") -> tuple[bool, list[str]]:
    """(allowed, messages) for creating a ResourceClaim (spec) or a template (spec.spec)."""
    policy = admin_policy(rendered)["spec"]
    matched = any(
        "resource.k8s.io" in rule["apiGroups"] and resource in rule["resources"] and operation in rule["operations"]
        for rule in policy["matchConstraints"]["resourceRules"]
    )
    if not matched:
        return True, []
    kind = "ResourceClaimTemplate" if resource == "resourceclaimtemplates" else "ResourceClaim"
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "monitoring"},
        "spec": {"spec": spec} if kind == "ResourceClaimTemplate" else spec,
    }
    request = {
        "operation": operation,
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": resource},
        "userInfo": {"username": "someone"},
    }
    activation = {"request": request, "object": obj}
    variables = {}
    for var in policy.get("variables", []):
        variables[var["name"]] = cel(var["expression"], {**activation, "variables": variables})
    activation["variables"] = variables
    messages = [
        str(cel(v["messageExpression"], activation))
        for v in policy["validations"]
        if not bool(cel(v["expression"], activation))
    ]
    return not messages, messages


RESOURCES = ["resourceclaims", "resourceclaimtemplates"]


@pytest.mark.parametrize("resource", RESOURCES)
def test_admin_access_to_a_mig_partition_is_refused_with_the_request_and_the_way_out(default, resource):
    spec = claim_spec(exactly("gpu", "gpu.migdra.dev"), exactly("watch", "mig.migdra.dev", admin=True))
    allowed, (message,) = evaluate(default, resource, spec)
    assert not allowed
    assert message.startswith("request watch asks for adminAccess to a MIG partition (device class mig.migdra.dev)")
    assert "request the whole GPU with adminAccess (device class gpu.migdra.dev)" in message
    assert "\n" not in message


@pytest.mark.parametrize("resource", RESOURCES)
@pytest.mark.parametrize(
    "spec",
    [
        claim_spec(exactly("watch", "gpu.migdra.dev", admin=True)),
        claim_spec(exactly("gpu", "mig.migdra.dev")),
        claim_spec(exactly("gpu", "mig.migdra.dev", admin=False)),
        claim_spec(exactly("other", "nic.example.com", admin=True)),
        claim_spec({"name": "alt", "firstAvailable": [{"name": "a", "deviceClassName": "mig.migdra.dev"}]}),
        {"devices": {}},
        {},
    ],
    ids=["admin-whole-gpu", "mig", "mig-admin-false", "other-driver-admin", "first-available", "no-requests", "empty"],
)
def test_everything_else_is_allowed(default, resource, spec):
    assert evaluate(default, resource, spec) == (True, [])


def test_profile_classes_are_covered_too():
    rendered = render(sets=["deviceClasses.profiles.enabled=true"])
    allowed, (message,) = evaluate(
        rendered, "resourceclaims", claim_spec(exactly("m", "3g-40gb.mig.migdra.dev", admin=True))
    )
    assert not allowed and "3g-40gb.mig.migdra.dev" in message
    # The default render has no profile classes, so it lists only the any-MIG class.
    (classes,) = [v for v in admin_policy(rendered)["spec"]["variables"] if v["name"] == "migClasses"]
    assert '"3g-40gb.mig.migdra.dev"' in classes["expression"]


def test_only_creations_of_claims_and_templates_are_matched(default):
    (rule,) = admin_policy(default)["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"]
    assert sorted(rule["resources"]) == RESOURCES
    # The spec is immutable, so CREATE is the only operation that can introduce a request.
    assert rule["operations"] == ["CREATE"]
    binding = admin_policy(default, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == admin_policy(default)["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_names_follow_the_values():
    rendered = render(sets=["deviceClasses.mig.name=partitions.example.com", "deviceClasses.gpu.name=gpus.example.com"])
    spec = claim_spec(exactly("w", "partitions.example.com", admin=True))
    allowed, (message,) = evaluate(rendered, "resourceclaims", spec)
    assert not allowed and "device class gpus.example.com" in message
    assert evaluate(rendered, "resourceclaims", claim_spec(exactly("w", "mig.migdra.dev", admin=True)))[0]


def test_can_be_turned_off():
    names = [p["metadata"]["name"] for p in render(sets=["admissionPolicy.adminAccess=false"]).all("ValidatingAdmissionPolicy")]
    assert names and not any(n.endswith(SUFFIX) for n in names), names
    # Without any MIG class there is nothing to refuse, and no policy.
    rendered = render(sets=["deviceClasses.mig.enabled=false"])
    assert not any(p["metadata"]["name"].endswith(SUFFIX) for p in rendered.all("ValidatingAdmissionPolicy"))
