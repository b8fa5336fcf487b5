"""The Grafana dashboard and the Prometheus alert rules of deploy/ against the
real server: every query names a metric attnserve exports (scraped from a
running server, not a list kept here), every dashboard query evaluates in a
real Prometheus scraping that server and returns series, the alert rules pass
`promtool check rules` and their unit tests, and the dashboard JSON is
well-formed for Grafana (which is not packaged in Debian, so it is checked
statically)."""

import json
import os
import re
import subprocess
import urllib.request

import pytest
import yaml

import harness
import serving_util as su
from prometheus_util import PROMTOOL, Prometheus, have_prometheus

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
DEPLOY = os.path.join(ROOT, "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "dashboards", "attnserve.json")
ALERTS = os.path.join(DEPLOY, "prometheus", "alerts.yml")
# Metrics Prometheus itself makes for every target.
PROMETHEUS_MADE = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan"}
QUEUE_SIZE = 77  # an unusual --max-queue-size, to see it come back as the capacity


def _dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def _panels(dash):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows hold their panels


def _dashboard_queries(dash):
    """(panel title, expr) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in _panels(dash) for t in p.get("targets", [])]


def _alert_queries():
    with open(ALERTS) as f:
        rules = yaml.safe_load(f)
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def _grafana_to_promql(expr, rate_interval="1m"):
    """What Grafana sends for the 'All' selection of every variable."""
    return (expr.replace("$__rate_interval", rate_interval)
            .replace("$model", ".*").replace("$instance", ".*"))


def metric_names(expr):
    """The metric names a PromQL expression reads: identifiers outside label
    matchers, ranges, strings and by/without lists, not called as functions."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        after = e[m.end():].lstrip()
        if after.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # a number's tail: 1e3, 0.5
        names.add(word)
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.99, sum by (model, le) '
                        '(rate(a_bucket{model=~"x|y", code!="OK"}[5m]))) > 1') == {"a_bucket"}
    assert metric_names("sum(rate(a[1m])) / ignoring(code) b or vector(0)") == {"a", "b"}
    assert metric_names("max by (job) (x / y) > 0.8") == {"x", "y"}


def test_alert_rules_pass_promtool_and_their_unit_tests():
    if not os.access(PROMTOOL, os.X_OK):
        pytest.skip("Debian package prometheus not installed (scripts/install-deps.sh installs it)")
    here = os.path.join(DEPLOY, "prometheus")
    for argv in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                 ["check", "config", "prometheus.yml"]):
        out = subprocess.run([PROMTOOL, *argv], cwd=here, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"promtool {' '.join(argv)}:\n{out.stdout}{out.stderr}"
    names = {a for a, _ in _alert_queries()}
    assert {"AttnserveTargetDown", "AttnserveHighErrorRatio", "AttnserveHighP99Latency",
            "AttnserveQueueSaturated"} <= names
    # Every alert has a unit test that expects it to fire.
    with open(os.path.join(here, "alerts_test.yml")) as f:
        tests = yaml.safe_load(f)["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert fired == names


def test_dashboard_is_well_formed_for_grafana():
    dash = _dashboard()
    assert dash["uid"] == "attnserve" and dash["title"] and dash["schemaVersion"] >= 36
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        (source,) = yaml.safe_load(f)["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"model", "instance"} <= variables
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in _panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel '{p['title']}' overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for ds in [p["datasource"]] + [t["datasource"] for t in p["targets"]]:
            assert ds == {"type": "prometheus", "uid": source["uid"]}, p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var == "__rate_interval", f"{p['title']}: ${var} undefined"
    # Where the compose file mounts the dashboards is where the provider reads them.
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards", "attnserve.yml")) as f:
        (provider,) = yaml.safe_load(f)["providers"]
    with open(os.path.join(DEPLOY, "docker-compose.yml")) as f:
        grafana = yaml.safe_load(f)["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    # What the issue asks the dashboard to show.
    queries = " ".join(e for _, e in _dashboard_queries(dash))
    for needle in ("attnserve_requests_total", "histogram_quantile(0.5,", "histogram_quantile(0.9,",
                   "histogram_quantile(0.99,", "attnserve_queue_duration_seconds_bucket",
                   "attnserve_compute_duration_seconds_bucket", "attnserve_queue_depth",
                   "attnserve_batch_requests_bucket", "attnserve_batch_tokens_bucket",
                   "sum by (model, code)"):
        assert needle in queries, needle


@have_prometheus
def test_every_query_reads_exported_metrics_and_returns_data(tmp_path):
    srv = harness.ServerProcess(f"--max-queue-size={QUEUE_SIZE}")
    prom = None
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{su.metrics_port(srv)}", rule_files=[ALERTS])
        su.wait_for(lambda: prom.query('up{job="attnserve"}') == 1, 30, "the first scrape",
                    interval=0.25)
        bench = [su.attn_bench_bin(), f"--target={srv.target}", "--model=demo-mha", "--json"]
        ok = subprocess.run(bench + ["--concurrency=4", "--requests=200"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] == 200, ok.stdout + ok.stderr
        # A client mistake, so the error panels have a code to show.
        bad = subprocess.run(bench + ["--layout=mha", "--embed-dim=7", "--requests=3"],
                             capture_output=True, text=True, timeout=60)
        assert json.loads(bad.stdout)["errors"] == {"INVALID_ARGUMENT": 3}, bad.stdout + bad.stderr

        with urllib.request.urlopen(f"http://127.0.0.1:{su.metrics_port(srv)}/metrics", timeout=10) as r:
            exposition = r.read().decode()
        exported = {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][\w:]*)[{ ]", exposition, re.M)}
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition,
                              capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, f"promtool check metrics:\n{lint.stdout}{lint.stderr}"

        dash_queries = _dashboard_queries(_dashboard())
        for where, expr in dash_queries + _alert_queries():
            unknown = metric_names(_grafana_to_promql(expr)) - exported - PROMETHEUS_MADE
            assert not unknown, f"'{where}' reads {sorted(unknown)}, which attnserve does not export"

        # rate() needs a scrape after the traffic as well as one before it.
        su.wait_for(lambda: prom.query("sum(attnserve_requests_total)") == 203, 30,
                    "Prometheus to scrape the traffic", interval=0.25)
        for title, expr in dash_queries:
            result = prom.query_result(_grafana_to_promql(expr))
            assert result, f"panel '{title}' shows nothing: {expr}"
        by_title = {}
        for t, e in dash_queries:
            by_title.setdefault(t, []).append(_grafana_to_promql(e))
        errors = {(r["metric"]["model"], r["metric"]["code"]): float(r["value"][1])
                  for r in prom.query_result(by_title["Errors/s by code"][0])}
        assert errors[("demo-mha", "INVALID_ARGUMENT")] > 0, errors
        assert errors[("demo-mha", "INTERNAL")] == 0 and errors[("sdpa", "INVALID_ARGUMENT")] == 0
        depth, capacity = (prom.query_result(e) for e in by_title["Queue depth and capacity"])
        assert {r["metric"]["model"]: float(r["value"][1]) for r in depth}["demo-mha"] == 0
        assert {r["metric"]["model"]: float(r["value"][1]) for r in capacity}["demo-mha"] == QUEUE_SIZE

        # The rules load and evaluate cleanly; nothing fires on a healthy server.
        def healthy_rules():
            return [r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]
                    if r["health"] == "ok"]
        su.wait_for(lambda: len(healthy_rules()) == len(_alert_queries()), 30,
                    "every alert rule to evaluate cleanly", interval=0.25)
        assert prom.api("alerts")["data"]["alerts"] == []
    finally:
        if prom is not None:
            prom.stop()
        code = srv.stop()
    assert code == 0, srv.log()

