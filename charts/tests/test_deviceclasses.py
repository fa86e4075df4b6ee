"""DeviceClasses: names, the configured driver name in the CEL, and what each class selects.

The selectors are evaluated with cel-python on devices shaped like DRA's CEL input
(device.driver, device.attributes[domain], device.capacity[domain]).
"""

from __future__ import annotations

import pytest

from test_admission import cel


def device(driver: str, type_: str, profile: str | None = None) -> dict:
    attrs = {"type": type_, "productName": "NVIDIA H100 80GB HBM3"}
    if profile:
        attrs["profile"] = profile
    return {"driver": driver, "attributes": {driver: attrs}, "capacity": {driver: {}}}


def selects(device_class: dict, dev: dict) -> bool:
    return all(bool(cel(s["cel"]["expression"], {"device": dev})) for s in device_class["spec"]["selectors"])


def classes(rendered) -> dict[str, dict]:
    return {c["metadata"]["name"]: c for c in rendered.all("DeviceClass")}


def test_default_class_names(default):
    assert set(classes(default)) == {"gpu.migdra.dev", "mig.migdra.dev"}


def test_custom_class_names(custom):
    assert set(classes(custom)) == {
        "gpu.example.com",
        "mig.example.com",
        "1g-10gb.mig.example.com",
        "1g-10gb-me.mig.example.com",
        "1g-23gb-no-me.mig.example.com",
        "3g-40gb.mig.example.com",
    }


def test_cel_uses_configured_driver_name(case):
    rendered, values = case
    driver = values["driverName"]
    for c in rendered.all("DeviceClass"):
        for s in c["spec"]["selectors"]:
            expr = s["cel"]["expression"]
            assert expr.startswith(f'device.driver == "{driver}" &&'), expr
            assert f'device.attributes["{driver}"]' in expr
            other = {"gpu.migdra.dev", "mig.example.com"} - {driver}
            assert not any(f'"{o}"' in expr for o in other), expr


def test_whole_gpu_and_mig_classes_select_the_right_devices(case):
    rendered, values = case
    driver = values["driverName"]
    cs = classes(rendered)
    gpu, mig = cs[values["deviceClasses"]["gpu"]["name"]], cs[values["deviceClasses"]["mig"]["name"]]
    whole, part = device(driver, "gpu"), device(driver, "mig", "3g.40gb")
    assert selects(gpu, whole) and not selects(gpu, part)
    assert selects(mig, part) and not selects(mig, whole)


def test_classes_ignore_other_drivers(case):
    """A device of another driver has no attributes in our domain; the driver check must come
    first so the lookup is never reached."""
    rendered, _ = case
    foreign = {"driver": "gpu.nvidia.com", "attributes": {"gpu.nvidia.com": {"type": "mig"}}, "capacity": {}}
    for c in rendered.all("DeviceClass"):
        assert not selects(c, foreign), c["metadata"]["name"]


@pytest.mark.parametrize("profile", ["1g.10gb", "1g.10gb+me", "1g.23gb-me", "3g.40gb"])
def test_profile_classes_select_exactly_their_profile(custom, profile):
    cs = classes(custom)
    name = profile.replace("-", "-no-").replace("+", "-").replace(".", "-") + ".mig.example.com"
    c = cs[name]
    for other in ["1g.10gb", "1g.10gb+me", "1g.23gb-me", "3g.40gb", "7g.80gb"]:
        assert selects(c, device("mig.example.com", "mig", other)) is (other == profile), (name, other)
    assert not selects(c, device("mig.example.com", "gpu"))


def test_extended_resource_name(default, custom):
    assert all("extendedResourceName" not in c["spec"] for c in default.all("DeviceClass"))
    assert classes(custom)["gpu.example.com"]["spec"]["extendedResourceName"] == "example.com/gpu"


def test_classes_can_be_disabled():
    from conftest import render

    rendered = render(sets=["deviceClasses.gpu.enabled=false", "deviceClasses.mig.enabled=false"])
    assert not rendered.all("DeviceClass")


# --- Device-plugin compatibility: deviceClasses.extendedResources ---------------------------

# The NVIDIA device plugin's mixed-strategy names (k8s-device-plugin internal/rm/rm.go,
# AddDefaultResourcesToConfig: "mig-" + profile with "+" replaced by "."; prefix nvidia.com).
DEVICE_PLUGIN_NAMES = {
    "1g.10gb": "nvidia.com/mig-1g.10gb",
    "1g.10gb+me": "nvidia.com/mig-1g.10gb.me",
    "1g.10gb+me.all": "nvidia.com/mig-1g.10gb.me.all",
    "1g.23gb-me": "nvidia.com/mig-1g.23gb-me",
    "1g.20gb+gfx": "nvidia.com/mig-1g.20gb.gfx",
    "3g.40gb": "nvidia.com/mig-3g.40gb",
    "7g.80gb": "nvidia.com/mig-7g.80gb",
}
# An extended resource name: <DNS subdomain>/<qualified name of at most 63 characters>.
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


def compat_render(*sets: str):
    from conftest import render

    names = ",".join(DEVICE_PLUGIN_NAMES)
    return render(sets=["deviceClasses.extendedResources.enabled=true", f"deviceClasses.profiles.names={{{names}}}", *sets])


def test_extended_resources_off_by_default(default, default_values):
    assert default_values["deviceClasses"]["extendedResources"]["enabled"] is False
    assert default_values["deviceClasses"]["profiles"]["enabled"] is False
    assert not [c["metadata"]["name"] for c in default.all("DeviceClass") if "extendedResourceName" in c["spec"]]


def test_extended_resources_use_the_device_plugin_names():
    import re

    cs = classes(compat_render())
    served = {c["spec"]["extendedResourceName"]: name for name, c in cs.items() if "extendedResourceName" in c["spec"]}
    assert set(served) == {"nvidia.com/gpu", *DEVICE_PLUGIN_NAMES.values()}
    assert served["nvidia.com/gpu"] == "gpu.migdra.dev"
    assert "extendedResourceName" not in cs["mig.migdra.dev"]["spec"], "the any-MIG class must not take a profile's name"
    for resource in served:
        assert re.match(RESOURCE_NAME, resource), resource


@pytest.mark.parametrize("profile", sorted(DEVICE_PLUGIN_NAMES))
def test_each_extended_resource_selects_exactly_its_profile(profile):
    by_resource = {c["spec"].get("extendedResourceName"): c for c in compat_render().all("DeviceClass")}
    c = by_resource[DEVICE_PLUGIN_NAMES[profile]]
    for other in DEVICE_PLUGIN_NAMES:
        assert selects(c, device("gpu.migdra.dev", "mig", other)) is (other == profile), (profile, other)
    assert not selects(c, device("gpu.migdra.dev", "gpu")), "a whole GPU is not a MIG profile"
    assert not selects(by_resource["nvidia.com/gpu"], device("gpu.migdra.dev", "mig", profile))
    assert selects(by_resource["nvidia.com/gpu"], device("gpu.migdra.dev", "gpu"))


def test_extended_resources_default_profile_list_gets_classes():
    from conftest import render

    rendered = render(sets=["deviceClasses.extendedResources.enabled=true"])
    import yaml

    from conftest import CHART

    names = yaml.safe_load((CHART / "values.yaml").read_text())["deviceClasses"]["profiles"]["names"]
    served = {c["spec"].get("extendedResourceName") for c in rendered.all("DeviceClass")}
    assert served - {None} == {"nvidia.com/gpu", *(f"nvidia.com/mig-{p.replace('+', '.')}" for p in names)}


def test_extended_resources_prefix_and_explicit_gpu_name():
    cs = classes(
        compat_render("deviceClasses.extendedResources.prefix=example.com", "deviceClasses.gpu.extendedResourceName=example.com/whole")
    )
    assert cs["gpu.migdra.dev"]["spec"]["extendedResourceName"] == "example.com/whole"
    assert cs["1g-10gb-me.mig.migdra.dev"]["spec"]["extendedResourceName"] == "example.com/mig-1g.10gb.me"


def test_extended_resources_without_whole_gpu_class():
    cs = classes(compat_render("deviceClasses.gpu.enabled=false"))
    assert "gpu.migdra.dev" not in cs
    assert all(c["spec"]["extendedResourceName"] != "nvidia.com/gpu" for c in cs.values() if "extendedResourceName" in c["spec"])


@pytest.mark.parametrize(
    "bad",
    ["deviceClasses.extendedResources.prefix=Not_A_Domain", "deviceClasses.extendedResources.strategy=mixed"],
)
def test_extended_resources_schema_rejects(bad):
    from conftest import run_helm, template_args

    proc = run_helm(*template_args(sets=["deviceClasses.extendedResources.enabled=true", bad]), check=False)
    assert proc.returncode != 0 and "schema" in proc.stderr.lower(), proc.stderr
