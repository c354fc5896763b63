"""deploy/ without a Prometheus: the dashboard is importable and the rules are complete.

Every series the dashboard and the rules read is one the gateway exports (a renamed metric
fails here, in the default suite); the live check is tests/deploy/test_prometheus.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from helpers.deploy import (
    RULE_TESTS,
    alert_rules,
    alert_signal,
    dashboard,
    dashboard_queries,
    metric_names,
    panels,
    variable_metrics,
)
from prometheus_client import CollectorRegistry

from kneegate.gateway.observability.metrics import GatewayMetrics

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported() -> set[str]:
    """Every series name a gateway's /metrics can hold."""
    m = GatewayMetrics(CollectorRegistry())
    m.bind_live(lambda: [], lambda: [])
    return {f.name + s for f in m.registry.collect() for s in _SUFFIXES[f.type]}


def test_exported_names_are_found() -> None:
    names = exported()
    assert {"kneegate_limit", "kneegate_engine_kv_cache_usage", "kneegate_requests_shed_total",
            "kneegate_request_ttft_seconds_bucket"} <= names


def test_dashboard_reads_only_exported_series() -> None:
    names, dash = exported(), dashboard()
    reads = {n for _, e in dashboard_queries(dash) for n in metric_names(e)}
    reads |= {metric for metric, _ in variable_metrics(dash).values()}
    assert reads - names == set()
    # the panels the issue asks for read these
    assert {"kneegate_limit", "kneegate_in_flight", "kneegate_knee_estimate",
            "kneegate_queue_depth", "kneegate_queue_wait_seconds_bucket",
            "kneegate_requests_shed_total", "kneegate_requests_queue_timeout_total",
            "kneegate_client_rejections_total", "kneegate_request_ttft_seconds_bucket",
            "kneegate_ttft_seconds_bucket", "kneegate_tpot_seconds_bucket",
            "kneegate_engine_running", "kneegate_engine_waiting",
            "kneegate_engine_kv_cache_usage", "kneegate_goodput_tokens_total",
            "kneegate_output_tokens_total"} <= reads


def test_rules_read_only_exported_series() -> None:
    names = exported()
    for rule in alert_rules():
        reads = set(metric_names(rule["expr"]))
        assert reads and reads <= names, rule["alert"]


def test_dashboard_is_importable_as_is() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variable_metrics(dash) == {"upstream": ("kneegate_limit", "upstream"),
                                      "class": ("kneegate_queue_depth", "class")}
    ids = [p["id"] for p in dash["panels"]] + [p["id"] for p in panels(dash)
                                                if p not in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    exprs = " ".join(e for _, e in ((p, t["expr"]) for p in panels(dash) for t in p["targets"]))
    assert "$upstream" in exprs and "$class" in exprs
    for p in panels(dash):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_rule_is_complete(rule: dict[str, Any]) -> None:
    alert_signal(rule["expr"])  # the shape test_prometheus.py evaluates
    assert "for" in rule
    assert rule["labels"]["severity"] in {"critical", "warning"}
    assert {"summary", "description", "runbook"} <= set(rule["annotations"])


def test_every_alert_is_unit_tested_firing_and_not() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    alerts = {r["alert"] for r in alert_rules()}
    assert alerts - fires == set(), "alerts never shown firing"
    assert alerts - silent == set(), "alerts never shown silent"


def test_alert_signal_splits_the_comparison() -> None:
    assert alert_signal("sum by (job) (x) == 0") == ("sum by (job) (x)", "==", 0.0)
    assert alert_signal("a\n/ b\n>= 0.1") == ("a\n/ b", ">=", 0.1)
    with pytest.raises(AssertionError):
        alert_signal("absent(kneegate_limit)")
