"""The stand-in app that `benchmarks.overhead --granian` runs under another ASGI server is the
app `kneegate serve` runs with the benchmark's flags, pointed at the benchmark's upstream."""

from __future__ import annotations

import importlib

import pytest


def test_the_stand_in_is_kneegates_app_with_the_benchmarks_flags(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNEEGATE_BENCH_UPSTREAM", "http://127.0.0.1:45678")
    import kneegate.benchmarks.asgi_app as mod
    from kneegate.gateway.app import KneegateApp

    app = importlib.reload(mod).app
    assert isinstance(app, KneegateApp)
    cfg = app.gateway.config
    [up] = cfg.upstreams
    assert up.url == "http://127.0.0.1:45678"
    assert up.controller == "fixed" and up.params["initial"] == 100000
    assert cfg.server.access_log is False
