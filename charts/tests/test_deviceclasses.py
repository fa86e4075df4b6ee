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
