"""The monitoring objects: PodMonitors, the Grafana dashboard ConfigMap and the PrometheusRule.

Off by default; values-custom.yaml turns all three on. The alerts and the dashboard's queries
are checked by evaluating them with promtool (built from the Prometheus Go module pinned in
promtool/go.mod by promtool/build.sh):

- `promtool check rules` on the rule groups the chart ships (its rendered PrometheusRule and
  files/alerts.yaml) and on recording rules generated from every dashboard query (so every
  query parses as PromQL);
- `promtool test rules` on promtool/alerts_test.yaml (each alert fires on a series that should
  trigger it, after its `for:`, and not on a healthy one) and promtool/dashboard_test.yaml (the
  dashboard's queries, as recording rules, on synthetic migdra and DCGM exporter series: each
  pod's GPU usage comes out with its namespace, pod and claim, whatever the DCGM host name
  says, and a MIG instance recreated with the same GPU instance ID for another pod is never
  attributed to the old pod).

Every metric a dashboard query or an alert expression names must also be one the processes
really expose: metric_names.txt is the list the e2e test
`metrics_and_gpunode_status_show_each_instance_with_its_pod` scrapes from the plugin and the
controller of the e2e cluster (and rewrites with MIGDRA_UPDATE_METRIC_NAMES=1).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import CHART, NAMESPACE, TESTS

METRIC_NAMES = TESTS / "metric_names.txt"
PROMTOOL_TESTS = TESTS / "promtool"
# The pinned Prometheus module; Prometheus 3.MM.P is published as v0.3MM.P.
PROMETHEUS_MODULE = re.compile(r"github\.com/prometheus/prometheus v0\.(\d)(\d\d)\.(\d+)")
# A metric name in PromQL: migdra's own, or an external exporter's we join with (DCGM).
MIGDRA_METRIC = re.compile(r"\bmigdra_[a-z0-9_]+\b")
EXTERNAL_METRIC = re.compile(r"\bDCGM_FI_[A-Z0-9_]+\b")
MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}

# Grafana's interval variables, as the dashboard would get them with the PodMonitors' 15s scrape.
GRAFANA_INTERVALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
# The dashboard's template variables: the name of the generated recording rules' group and
# their record prefix, and each variable's value. `all` is what Grafana sends for "All" (the
# variable's allValue); `node` picks one node.
VARIABLE_CASES = {
    "dashboard": {"node": ".*"},
    "dashboard_node": {"node": "gpu-node-a"},
}
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(?!\d)(\w+)")


# --- helpers ---------------------------------------------------------------------------------


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


def chart_dashboard() -> dict:
    return json.loads((CHART / "files" / "dashboard.json").read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, with those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def dashboard_queries(dashboard: dict) -> dict[str, str]:
    """Every PromQL query of the dashboard by a stable name: `<panel title>:<refId>` for a
    panel's targets, `variable_<name>` for a query variable (Grafana's label_values(m, l)
    becomes the PromQL it stands for, `count by (l) (m)`)."""
    queries = {}
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            name = f"{slug(panel['title'])}:{target['refId']}"
            assert name not in queries, f"two queries named {name}"
            queries[name] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert m, f"variable {variable['name']}: only label_values(metric, label) is supported: {query!r}"
        queries[f"variable_{variable['name']}"] = f"count by ({m.group(2)}) ({m.group(1)})"
    return queries


def substitute(expr: str, values: dict[str, str]) -> str:
    """The query as Prometheus gets it: Grafana's variables replaced by their values."""

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        assert name in values, f"no test value for the variable ${name} in {expr!r}"
        return values[name]

    return GRAFANA_VARIABLE.sub(value, expr)


def dashboard_rule_groups(dashboard: dict) -> dict:
    """The dashboard's queries as recording rules `<case>:<query name>`, one group per case of
    VARIABLE_CASES."""
    queries = dashboard_queries(dashboard)
    return {
        "groups": [
            {
                "name": case,
                "rules": [{"record": f"{case}:{name}", "expr": substitute(expr, values)} for name, expr in queries.items()],
            }
            for case, values in VARIABLE_CASES.items()
        ]
    }


def rule_spec(rendered) -> dict:
    (rule,) = rendered.all("PrometheusRule")
    return rule["spec"]


def rules_of(rendered) -> list[dict]:
    return [r for group in rule_spec(rendered)["groups"] for r in group["rules"]]


def promtool_run(promtool: str, *args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run([promtool, *args], capture_output=True, text=True, cwd=cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed ({proc.returncode}):\n{output}"
    return output


def check_rules(promtool: str, path: Path) -> str:
    return promtool_run(promtool, "check", "rules", "--lint=all", "--lint-fatal", str(path))


def unit_test(promtool: str, tmp_path: Path, test_file: str, rule_files: dict[str, dict]) -> str:
    """Runs `promtool test rules` on promtool/<test_file> next to the generated rule files."""
    for name, groups in rule_files.items():
        (tmp_path / name).write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(PROMTOOL_TESTS / test_file, tmp_path / test_file)
    return promtool_run(promtool, "test", "rules", "--diff", test_file, cwd=tmp_path)


def unit_test_file(name: str) -> dict:
    return yaml.safe_load((PROMTOOL_TESTS / name).read_text())


def alert_rule_files(rendered) -> dict[str, dict]:
    """The chart's rule groups for the unit tests: each alert keeps its summary annotation (the
    tests check its templating) and drops the longer ones (`promtool check rules` checks that
    their templates parse)."""
    spec = json.loads(json.dumps(rule_spec(rendered)))
    for group in spec["groups"]:
        for rule in group["rules"]:
            if "annotations" in rule:
                rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    return {"alerts.rules.yaml": spec}


def assert_names_exist(expr: str, scraped: set[str]) -> None:
    names = MIGDRA_METRIC.findall(expr)
    assert names or EXTERNAL_METRIC.search(expr), f"no metric in {expr!r}"
    missing = sorted(set(names) - scraped)
    assert not missing, f"{missing} in {expr!r} are not exposed (see metric_names.txt)"


def duration_seconds(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)([smhd])", text)
    assert "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


# --- objects ---------------------------------------------------------------------------------


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
    assert dashboard == chart_dashboard()
    assert dashboard["uid"] == "migdra-overview"


def test_the_default_sidecar_label_is_grafana_dashboard_1():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}


def test_prometheus_rule_object(custom):
    (rule,) = custom.all("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The object carries the chart's file unchanged (helm does not expand `{{ $labels.x }}`).
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())


# --- promtool --------------------------------------------------------------------------------


def test_promtool_is_the_pinned_prometheus_release(promtool):
    m = PROMETHEUS_MODULE.search((PROMTOOL_TESTS / "go.mod").read_text())
    assert m, "promtool/go.mod pins github.com/prometheus/prometheus v0.3MM.P"
    version = f"{m.group(1)}.{int(m.group(2))}.{m.group(3)}"
    out = promtool_run(promtool, "--version")
    assert re.search(rf"promtool, version {re.escape(version)}\b", out), out


def test_the_chart_rule_files_pass_promtool_check_rules(custom, promtool, tmp_path):
    rendered = tmp_path / "prometheusrule.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule_spec(custom), sort_keys=False))
    out = check_rules(promtool, rendered)
    assert re.search(r"SUCCESS: \d+ rules found", out), out
    check_rules(promtool, CHART / "files" / "alerts.yaml")


def test_promtool_check_rules_rejects_a_broken_expression(promtool, tmp_path):
    # The checks below rely on promtool failing on what does not parse.
    path = tmp_path / "broken.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": "sum(up"}]}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "parse error" in proc.stdout + proc.stderr, proc


def test_alerts_are_well_formed(custom, scraped_names):
    for alert in rules_of(custom):
        name = alert["alert"]
        assert_names_exist(alert["expr"], scraped_names)
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        if "for" in alert:
            duration_seconds(alert["for"])


def test_alert_unit_tests_pass(custom, promtool, tmp_path):
    out = unit_test(promtool, tmp_path, "alerts_test.yaml", alert_rule_files(custom))
    assert "SUCCESS" in out, out


def test_every_alert_is_tested_firing_quiet_and_pending(custom):
    """Each alert has a test where it fires and one where it does not; an alert with `for: D`
    has a test group where it is quiet at some time and fires less than D later (its pending
    period, on the same series)."""
    alerts = {r["alert"]: r for r in rules_of(custom)}
    wanted = {
        "MigdraPluginNotLive",
        "MigdraGpuUnhealthy",
        "MigdraPrepareFailures",
        "MigdraUnprepareFailures",
        "MigdraForeignInstancesAppeared",
        "MigdraRecoveryPending",
        "MigdraNvmlNotAnswering",
        "MigdraPoolNotPublished",
        "MigdraHeartbeatWithdrawalsHeld",
        "MigdraSlicesWiped",
        "MigdraNoControllerLeader",
    }
    assert wanted <= set(alerts)
    tests = unit_test_file("alerts_test.yaml")
    assert tests["rule_files"] == ["alerts.rules.yaml"]
    firing, quiet, pending = set(), set(), set()
    for group in tests["tests"]:
        by_alert: dict[str, list[tuple[int, bool]]] = {}
        for case in group["alert_rule_test"]:
            assert case["alertname"] in alerts, f"{group['name']}: no alert {case['alertname']}"
            fires = bool(case["exp_alerts"])
            (firing if fires else quiet).add(case["alertname"])
            by_alert.setdefault(case["alertname"], []).append((duration_seconds(case["eval_time"]), fires))
        for name, cases in by_alert.items():
            if "for" not in alerts[name]:
                continue
            hold = duration_seconds(alerts[name]["for"])
            for t_quiet, fires_then in cases:
                if not fires_then and any(f and 0 < t - t_quiet < hold for t, f in cases):
                    pending.add(name)
    assert firing == set(alerts), f"never seen firing: {sorted(set(alerts) - firing)}"
    assert quiet == set(alerts), f"never seen quiet: {sorted(set(alerts) - quiet)}"
    with_for = {n for n, a in alerts.items() if "for" in a}
    assert pending == with_for, f"no pending-period case: {sorted(with_for - pending)}"


# --- dashboard -------------------------------------------------------------------------------


def test_dashboard_lint():
    """Every panel has a Prometheus datasource (the dashboard's variable), ids are unique,
    panels fit the 24-column grid, every target has a unique refId and a query, and every
    variable a query uses is defined."""
    dashboard = chart_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    prometheus = {"type": "prometheus", "uid": "${datasource}"}
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        title = panel["title"]
        assert title.strip(), panel["id"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, title
        if panel["type"] == "row":
            assert not panel.get("targets"), title
            continue
        assert panel["datasource"] == prometheus, title
        assert panel["targets"], title
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), title
        for target in panel["targets"]:
            assert target.get("datasource", prometheus) == prometheus, title
            assert target["expr"].strip(), title
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == prometheus, variable["name"]
    used = {m.group(1) or m.group(2) for e in dashboard_queries(dashboard).values() for m in GRAFANA_VARIABLE.finditer(e)}
    assert used - set(GRAFANA_INTERVALS) <= set(variables), used
    # Every variable a query uses has a value in each evaluated case.
    for values in VARIABLE_CASES.values():
        assert used - set(GRAFANA_INTERVALS) <= set(values), used


def test_dashboard_queries_parse(promtool, tmp_path):
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(dashboard_rule_groups(chart_dashboard()), sort_keys=False))
    check_rules(promtool, path)


def test_dashboard_queries_name_only_scraped_metrics(scraped_names):
    queries = dashboard_queries(chart_dashboard())
    assert len(queries) >= 15
    for expr in queries.values():
        assert_names_exist(expr, scraped_names)


def test_dashboard_query_unit_tests_pass(promtool, tmp_path):
    groups = dashboard_rule_groups(chart_dashboard())
    out = unit_test(promtool, tmp_path, "dashboard_test.yaml", {"dashboard.rules.yaml": groups})
    assert "SUCCESS" in out, out


def test_every_dashboard_query_is_evaluated():
    """dashboard_test.yaml checks every query with "All" nodes, and every query that joins DCGM
    series to pods also with one node selected."""
    records = {r["record"]: r["expr"] for g in dashboard_rule_groups(chart_dashboard())["groups"] for r in g["rules"]}
    tests = unit_test_file("dashboard_test.yaml")
    assert tests["rule_files"] == ["dashboard.rules.yaml"]
    tested = {re.match(r"[\w:]+", case["expr"]).group(0) for g in tests["tests"] for case in g["promql_expr_test"]}
    assert tested <= set(records), sorted(tested - set(records))
    wanted = {r for r in records if r.startswith("dashboard:")}
    wanted |= {r for r, e in records.items() if r.startswith("dashboard_node:") and EXTERNAL_METRIC.search(e)}
    assert wanted <= tested, f"untested dashboard queries: {sorted(wanted - tested)}"


def test_dashboard_test_yaml_is_the_generator_output():
    """promtool/dashboard_test.yaml is written by promtool/dashboard_test_gen.py (edit the script
    and run it)."""
    spec = importlib.util.spec_from_file_location("dashboard_test_gen", PROMTOOL_TESTS / "dashboard_test_gen.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (PROMTOOL_TESTS / "dashboard_test.yaml").read_text() == gen.render(), (
        "run python3 charts/tests/promtool/dashboard_test_gen.py"
    )
