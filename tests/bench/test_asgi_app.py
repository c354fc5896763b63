"""The stand-in app that `kneegate_bench.overhead --granian` runs under another ASGI server is the
app `kneegate serve` runs with the benchmark's flags, pointed at the benchmark's upstream."""

from __future__ import annotations

import importlib

import pytest


def test_the_stand_in_is_kneegates_app_with_the_benchmarks_flags(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNEEGATE_BENCH_UPSTREAM", "http://127.0.0.1:45678")
    import kneegate_bench.asgi_app as mod
    from kneegate.gateway.app import KneegateApp

    app = importlib.reload(mod).app
    assert isinstance(app, KneegateApp)
    cfg = app.gateway.config
    [up] = cfg.upstreams
    assert up.url == "http://127.0.0.1:45678"
    assert up.controller == "fixed" and up.params["initial"] == 100000
    assert cfg.server.access_log is False


def test_the_stand_ins_config_is_what_the_command_line_builds() -> None:
    """The load tools sit below the CLI, so the stand-in builds its config itself; it must
    stay the config that `kneegate serve` builds from the same flags."""
    from kneegate.cli import _parser, apply_flags
    from kneegate.gateway.config.gateway import GatewayConfig
    from kneegate_bench.asgi_app import LIMIT, config

    url = "http://127.0.0.1:45678"
    flags = ["serve", "--upstream", url, "--controller", "fixed", "--limit", str(LIMIT),
             "--no-access-log"]
    assert config(url) == apply_flags(GatewayConfig(), _parser().parse_args(flags))


@pytest.mark.anyio
async def test_the_floor_answers_the_stream_the_benchmarks_upstream_sends() -> None:
    """`kneegate_bench.overhead --floor` compares like with like: uvicorn's stock HTTP protocol
    serving, by itself, the same events the relay carries."""
    import httpx

    from kneegate.gateway.server.serving import serving
    from kneegate_bench.asgi_floor import app
    from kneegate_bench.rawhttp import event_payload

    async with serving(app, http="httptools") as url, httpx.AsyncClient() as client:
        assert (await client.get(url + "/health")).status_code == 200
        r = await client.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert r.content == b"".join(event_payload(i) for i in range(16)) + b"data: [DONE]\n\n"
