"""The monitoring objects: PodMonitors, the Grafana dashboard ConfigMap and the PrometheusRule.

Off by default; values-custom.yaml turns all three on. Every metric a dashboard query or an
alert expression names must be one the processes really expose: metric_names.txt is the list
the e2e test `metrics_and_gpunode_status_show_each_instance_with_its_pod` scrapes from the
plugin and the controller of the e2e cluster (and rewrites with MIGDRA_UPDATE_METRIC_NAMES=1).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import CHART, NAMESPACE, TESTS

METRIC_NAMES = TESTS / "metric_names.txt"
# A metric name in PromQL: migdra's own, or an external exporter's we join with (DCGM).
MIGDRA_METRIC = re.compile(r"\bmigdra_[a-z0-9_]+\b")
EXTERNAL_METRIC = re.compile(r"\bDCGM_FI_[A-Z0-9_]+\b")
MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def scraped_names() -> set[str]:
    names = [line.strip() for line in METRIC_NAMES.read_text().splitlines() if line.strip()]
    assert names == sorted(set(names)), "metric_names.txt is sorted and has no duplicates"
    return set(names)


def dashboard_of(rendered) -> dict:
    (config_map,) = [d for d in rendered.all("ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    (name,) = config_map["data"]
    assert name.endswith(".json")
    return json.loads(config_map["data"][name])


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def rules_of(rendered) -> list[dict]:
    (rule,) = rendered.all("PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def assert_names_exist(expr: str, scraped: set[str]) -> None:
    names = MIGDRA_METRIC.findall(expr)
    assert names or EXTERNAL_METRIC.search(expr), f"no metric in {expr!r}"
    missing = sorted(set(names) - scraped)
    assert not missing, f"{missing} in {expr!r} are not exposed (see metric_names.txt)"


def balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    in_string = False
    for c in expr:
        if c == '"':
            in_string = not in_string
        elif not in_string and c in depth:
            depth[c] += 1
        elif not in_string and c in closing:
            depth[closing[c]] -= 1
            if depth[closing[c]] < 0:
                return False
    return not in_string and all(v == 0 for v in depth.values())


def test_nothing_is_rendered_by_default(default):
    kinds = {d["kind"] for d in default.docs}
    assert not kinds & MONITORING_KINDS
    assert not [d for d in default.all("ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]


def test_metric_names_come_from_a_scrape_with_every_family_the_issue_asks_for(scraped_names):
    for name in [
        "migdra_kubelet_plugin_mig_instance_info",
        "migdra_kubelet_plugin_gpu_memory_slices",
        "migdra_kubelet_plugin_gpu_mig_instances",
        "migdra_kubelet_plugin_gpu_mig_mode",
        "migdra_kubelet_plugin_gpu_healthy",
        "migdra_kubelet_plugin_call_duration_seconds_bucket",
        "migdra_kubelet_plugin_claim_failures_total",
        "migdra_controller_published_pools",
        "migdra_controller_published_devices",
        "migdra_controller_published_slices",
        "migdra_controller_reconcile_duration_seconds_bucket",
        "migdra_controller_slice_writes_total",
        "migdra_controller_plugin_live",
    ]:
        assert name in scraped_names, name


def test_pod_monitors_scrape_both_components_with_their_own_labels(custom):
    monitors = {d["metadata"]["name"]: d for d in custom.all("PodMonitor")}
    assert set(monitors) == {"gpu-stack-controller", "gpu-stack-kubelet-plugin"}
    workloads = {d["kind"]: d for d in custom.docs if d["kind"] in ("Deployment", "DaemonSet")}
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == NAMESPACE
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s", "honorLabels": True}
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        # The selector picks exactly the component's pods, whose container has the http port.
        kind = "Deployment" if name.endswith("-controller") else "DaemonSet"
        pod = workloads[kind]["spec"]["template"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items(), (name, selector)
        ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        assert "http" in ports


def test_dashboard_is_a_sidecar_configmap_of_valid_json(custom):
    (config_map,) = [d for d in custom.all("ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    dashboard = dashboard_of(custom)
    # The ConfigMap carries the chart's file unchanged.
    assert dashboard == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert dashboard["uid"] == "migdra-overview"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_default_sidecar_label_is_grafana_dashboard_1():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}


def test_dashboard_queries_name_only_scraped_metrics(custom, scraped_names):
    exprs = dashboard_exprs(dashboard_of(custom))
    assert len(exprs) >= 15
    for expr in exprs:
        assert balanced(expr), expr
        assert_names_exist(expr, scraped_names)


def test_dashboard_joins_dcgm_to_pods_by_gpu_uuid_and_gpu_instance():
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    joins = [e for e in dashboard_exprs(dashboard) if "DCGM_FI_" in e]
    assert joins, "a panel attributes DCGM usage to pods"
    for expr in joins:
        assert "on (UUID, GPU_I_ID)" in expr and "migdra_kubelet_plugin_mig_instance_info" in expr, expr


def test_alerts_cover_what_matters(custom, scraped_names):
    rules = rules_of(custom)
    alerts = {r["alert"]: r for r in rules}
    assert {
        "MigdraPluginNotLive",
        "MigdraGpuUnhealthy",
        "MigdraPrepareFailures",
        "MigdraForeignInstancesAppeared",
        "MigdraPoolNotPublished",
    } <= set(alerts)
    (rule,) = custom.all("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for name, alert in alerts.items():
        assert balanced(alert["expr"]), name
        assert_names_exist(alert["expr"], scraped_names)
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        if "for" in alert:
            assert re.fullmatch(r"([0-9]+[smh])+", alert["for"]), name
        # Templated annotations reach Prometheus as written (helm must not expand them).
        for text in alert["annotations"].values():
            assert "{{ $labels." in text or "{{ $value" in text or "{{" not in text, (name, text)
    assert "{{ $labels.node }}" in alerts["MigdraPluginNotLive"]["annotations"]["summary"]
    # Controller series count from the leader only: a standby keeps stale values.
    for name in ("MigdraPluginNotLive", "MigdraPoolNotPublished"):
        assert "migdra_controller_leader == 1" in alerts[name]["expr"], name
