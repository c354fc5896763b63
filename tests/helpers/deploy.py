"""The PromQL shipped in deploy/: the Grafana dashboard's queries and the alert rules."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kneegate.json"
RULES = ROOT / "deploy" / "prometheus" / "kneegate-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kneegate-rules.test.yaml"

# What a query gets in place of Grafana's variables when a test evaluates it: every upstream
# and class, and windows that hold the whole of a short load.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$upstream": ".*", "$class": ".*"}

# An alert's expression: `<signal> <comparison> <threshold>`.
_ALERT = re.compile(r"(?P<signal>.*\S)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<threshold>-?[0-9.]+)\s*",
                    re.DOTALL)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, also those inside a collapsed row."""
    for p in dash["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title + refId, PromQL with Grafana's variables filled in) of every target."""
    out = []
    for p in panels(dash):
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value).replace("${" + var[1:] + "}", value)
            out.append((f"{p['title']} [{t['refId']}]", expr))
    return out


def variable_metrics(dash: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Template variable -> (metric, label) of its `label_values(metric, label)` query."""
    out = {}
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["query"])
            assert m, f"variable {v['name']}: not label_values(metric, label): {v['query']}"
            out[v["name"]] = (m.group(1), m.group(2))
    return out


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def alert_signal(expr: str) -> tuple[str, str, float]:
    """Split an alert's expression into (signal, comparison, threshold)."""
    m = _ALERT.fullmatch(expr)
    assert m, f"not `<signal> <comparison> <threshold>`: {expr}"
    return m.group("signal"), m.group("op"), float(m.group("threshold"))


def metric_names(expr: str) -> list[str]:
    """The kneegate_* series an expression reads; a `__name__=~` regex gives each of its
    alternatives (one level of `(a|b)`)."""
    names = []
    for regex in re.findall(r'__name__=~"([^"]*)"', expr):
        m = re.search(r"\(([^()]*)\)", regex)
        alts = m.group(1).split("|") if m else [""]
        names += [regex[: m.start()] + a + regex[m.end():] if m else regex for a in alts]
    plain = re.sub(r'__name__=~"[^"]*"', "", expr)
    return names + re.findall(r"\bkneegate_[a-z_]+\b", plain)
