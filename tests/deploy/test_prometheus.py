"""deploy/ on a real Prometheus: the rules pass promtool, and every query returns data.

    pytest -m prometheus tests/deploy        # needs `prometheus` and `promtool` on PATH

Debian's `prometheus` package carries both (`apt-get install prometheus`; its service is not
used: the test starts the binary itself). Without them the tier skips.

One Prometheus (temporary config and storage, loopback, 1 s scrapes and rule evaluations,
the rules loaded) scrapes the emulator (`python -m kneegate.emulator --profile
cpu-tiny`) and
a gateway in front of it, configured small (a limit of at most 6, a queue of 12, tight
objectives) while a bounded load of streamed requests from two classes overruns it: queueing,
sheds, queue timeouts, goodput and misses all happen. Then one refused config reload and one
oversized body (413). Every query is then evaluated at the moment the load ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from helpers.deploy import (
    RULE_TESTS,
    RULES,
    alert_rules,
    alert_signal,
    dashboard,
    dashboard_queries,
    metric_names,
    variable_metrics,
)

from kneegate_bench.overhead import _free_port

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("promtool")),
        reason="needs `prometheus` and `promtool` on PATH (Debian: apt-get install prometheus)"),
]

LOAD_SECONDS = 12.0  # arrivals stop then; every request ends by LOAD_SECONDS + REQUEST_TIMEOUT
REQUEST_TIMEOUT = 8.0
USERS = 40  # closed-loop streams, half of them in the batch class
MAX_REQUESTS = 3000
PROMPT = [100 + i for i in range(128)]

GATEWAY_CONFIG = """\
server: {{host: 127.0.0.1, port: {port}}}
upstreams:
  - name: emu
    url: http://127.0.0.1:{engine}
    controller: knee
    params: {{initial: 4, min_limit: 1, max_limit: 6}}
    scrape: true
    scrape_interval: 0.5
classes:
  interactive: {{priority: 10, ttft_objective: 1.0, max_wait: 1.0, queue_share: 0.5}}
  batch: {{priority: 0, ttft_objective: 30.0, max_wait: 0.5, header: true}}
default_class: interactive
max_queue: 12
max_body_bytes: 65536
"""


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules() -> None:
    run = _promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in run.stdout


def test_promtool_unit_tests_of_every_alert() -> None:
    # test_deploy_files.py checks that each alert is shown firing and silent in this file
    run = _promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


# -- the live stack --------------------------------------------------------------------------


@dataclass
class Stack:
    prom: httpx.Client
    gateway: str
    at: float  # unix time just after the load: every query is evaluated there

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        r = self.prom.get("/api/v1/query", params={"query": expr, "time": at or self.at})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]  # type: ignore[no-any-return]


def _until(what: str, seconds: float, check: Any) -> Any:
    """Poll `check()` until it returns something true; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.TransportError):
            if got := check():
                return got
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start `cmd` (output to `log`), wait until GET `ready` answers 200, stop it after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, f"{cmd[:3]} exited:\n{log.read_text()[-3000:]}"
            return httpx.get(ready, timeout=1).status_code == 200

        _until(f"{ready} ready", 30, up)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prometheus_config(tmp: Path, targets: dict[str, int]) -> Path:
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in targets.items()],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _load(url: str) -> dict[int, int]:
    """USERS closed-loop streams for LOAD_SECONDS; answers counted by status."""
    statuses: dict[int, int] = {}
    sent = 0
    stop = time.monotonic() + LOAD_SECONDS

    async def user(session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        nonlocal sent
        body = {"model": "cpu-tiny", "prompt": PROMPT, "max_tokens": 64, "stream": True,
                "ignore_eos": True}
        while time.monotonic() < stop and sent < MAX_REQUESTS:
            sent += 1
            status = 0  # no answer
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(url + "/v1/completions", json=body,
                                        headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    status = r.status
            statuses[status] = statuses.get(status, 0) + 1
            if status != 200:
                await asyncio.sleep(0.25)  # a refused user comes back, not in a busy loop

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(user(session, {"x-kneegate-class": "batch"} if i % 2 else {})
                               for i in range(USERS)))
    return statuses


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus")
    ep, gp, pp = _free_port(), _free_port(), _free_port()
    gateway, prom_url = f"http://127.0.0.1:{gp}", f"http://127.0.0.1:{pp}"
    config = tmp / "kneegate.yaml"
    config.write_text(GATEWAY_CONFIG.format(port=gp, engine=ep))
    prom_config = _prometheus_config(tmp, {"kneegate": gp, "engine": ep})
    prom_cmd = ["prometheus", f"--config.file={prom_config}", f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{pp}"]
    with (
        _process([sys.executable, "-m", "kneegate.emulator", "--profile", "cpu-tiny",
                  "--port", str(ep)], tmp / "engine.log", f"http://127.0.0.1:{ep}/health"),
        _process([sys.executable, "-m", "kneegate", "serve", "--config", str(config)],
                 tmp / "kneegate.gateway.log", gateway + "/ready"),
        _process(prom_cmd, tmp / "prometheus.log", prom_url + "/-/ready"),
        httpx.Client(base_url=prom_url, timeout=10) as prom,
    ):
        def targets_up() -> bool:
            active = prom.get("/api/v1/targets").json()["data"]["activeTargets"]
            return len(active) == 2 and all(t["health"] == "up" for t in active)

        _until("both targets up", 20, targets_up)
        t0 = time.monotonic()
        statuses = asyncio.run(_load(gateway))
        print(f"answers by status (0: none): {statuses} in {time.monotonic() - t0:.1f} s")
        served = statuses.get(200, 0)
        assert served > 20 and sum(statuses.values()) - served > 20, statuses
        big = httpx.post(gateway + "/v1/completions", content=b"x" * 70_000,
                         headers={"content-type": "application/json"})
        assert big.status_code == 413  # kneegate_client_rejections_total{reason="body_too_large"}
        config.write_text("upstreams: []\n")  # refused: no upstream
        assert httpx.post(gateway + "/kneegate/reload").status_code != 200
        live = Stack(prom, gateway, time.time())
        # a scrape after the 413 and the reload is in; queries are evaluated from then on
        _until("a scrape after the load", 15, lambda: live.query(
            'kneegate_config_reloads_total{result="error"} > 0', time.time()))
        live.at = time.time()
        yield live


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    """Each target of each panel, Grafana's variables filled in (deploy_exprs.GRAFANA_VARS:
    every upstream and class, 1 m rate windows), returns at least one series, and one of
    them holds a number (a quantile of no traffic is NaN, and that would not show that
    the panel draws anything). One exception: the knee estimate is NaN until the
    controller has one (its help text), which takes longer than this load: its series
    must exist."""
    empty, nan = [], []
    for title, expr in dashboard_queries(dashboard()):
        result = stack.query(expr)
        if not result:
            empty.append(f"{title}: {expr}")
        elif (all(math.isnan(float(s["value"][1])) for s in result)
              and metric_names(expr) != ["kneegate_knee_estimate"]):
            nan.append(f"{title}: {expr}")
    assert empty == [], "no data"
    assert nan == [], "only NaN"


def test_every_dashboard_variable_has_values(stack: Stack) -> None:
    for name, (metric, label) in variable_metrics(dashboard()).items():
        r = stack.prom.get(f"/api/v1/label/{label}/values", params={"match[]": metric})
        assert r.json()["data"], f"${name}: no {label} on {metric}"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_signal_returns_data(stack: Stack, rule: dict[str, Any]) -> None:
    """The alert's expression without its comparison, and every series it reads, return data.

    With the comparison, an empty answer means "not firing", which a misspelt metric or a
    missing label gives too: the signal itself must answer (for a ratio, the ratio: both
    sides exist and match on their labels). A signal may fall back on a default where a
    series is absent (`or ... * 0` in KneegateGoodputShareLow), so each series the
    expression names is also asked for on its own.
    """
    signal, _, _ = alert_signal(rule["expr"])
    result = stack.query(signal)
    assert result, f"{rule['alert']}: no data for {signal}"
    assert any(not math.isnan(float(s["value"][1])) for s in result), (signal, result)
    for name in metric_names(rule["expr"]):
        assert stack.query(f"count({name})"), f"{rule['alert']}: no series {name}"


def test_rules_evaluate_on_live_data(stack: Stack) -> None:
    """Prometheus loaded the rules and evaluates them without error; the overload makes
    the rejection alert pending and the refused reload the reload alert; a gateway that
    serves has a usable upstream."""
    rules = stack.prom.get("/api/v1/rules").json()["data"]["groups"][0]["rules"]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []

    def active() -> set[str]:
        return {a["labels"]["alertname"]
                for a in stack.prom.get("/api/v1/alerts").json()["data"]["alerts"]}

    wanted = {"KneegateRejectionRatioHigh", "KneegateConfigReloadFailed"}
    _until(f"{wanted} active", 10, lambda: wanted <= active())
    assert "KneegateNoUsableUpstream" not in active()
    rule = next(r for r in alert_rules() if r["alert"] == "KneegateRejectionRatioHigh")
    ratio = stack.query(alert_signal(rule["expr"])[0])
    assert float(ratio[0]["value"][1]) > 0.1, ratio


def test_the_keda_query_reads_the_overload(stack: Stack) -> None:
    """The ScaledObject's query (deploy/kubernetes/keda/scaledobject.yaml), its Kubernetes
    labels swapped for this Prometheus's job, returns one number, over 1 after an overload;
    the gateway's own suggested count agrees that one engine is not enough."""
    keda = yaml.safe_load((RULES.parents[1] / "kubernetes" / "keda" / "scaledobject.yaml")
                          .read_text())
    query = keda["spec"]["triggers"][0]["metadata"]["query"]
    query = re.sub(r"\{[^}]*\}", '{job="kneegate"}', query)
    (result,) = stack.query(query)
    assert float(result["value"][1]) > 1.0, (query, result)
    (suggested,) = stack.query('kneegate_suggested_replicas{job="kneegate"}')
    assert float(suggested["value"][1]) >= 2, suggested
    print(f"demand ratio {result['value'][1]}, suggested replicas {suggested['value'][1]}")
