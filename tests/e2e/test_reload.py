"""Reloads over real sockets: a bad file is refused, the old config keeps serving, secrets stay
put and are never printed (issue 11, defects 2 and 9)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, gw_config, scrape, serve, total

from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import load_config
from kneegate.gateway.server.workers import embedded_upstream

pytestmark = pytest.mark.anyio

TOKEN = "run-token-0042"
KEY = "sk-live-abcdef123456"
CLASSES = {"interactive": {"priority": 10}, "batch": {"priority": 0}}


class Rig:
    """An engine, a gateway started from a config file, and a client speaking to it."""

    def __init__(self, app: KneegateApp, gw: str, path: Path, up: str,
                 client: httpx.AsyncClient) -> None:
        self.app, self.gw, self.path, self.up, self.client = app, gw, path, up, client
        self.auth = {"authorization": f"Bearer {TOKEN}"}

    def doc(self, **extra: Any) -> dict[str, Any]:
        """A valid config document for this rig's engine, with `extra` laid over it."""
        return {"tick_interval": 0.02, "upstreams": [{
            "name": "e0", "url": self.up, "controller": "fixed", "params": {"initial": 2}}],
            **extra}

    async def reload(self, content: str | bytes | dict[str, Any]) -> httpx.Response:
        if isinstance(content, dict):
            content = json.dumps(content)  # JSON is YAML
        if isinstance(content, str):
            content = content.encode()
        self.path.write_bytes(content)
        return await self.client.post(self.gw + "/kneegate/reload", headers=self.auth)

    async def metrics(self) -> dict[Any, float]:
        return scrape((await self.client.get(self.gw + "/metrics", headers=self.auth)).text)

    async def still_serves(self, **headers: str) -> None:
        r = await self.client.post(self.gw + "/v1/completions", json={"max_tokens": 2},
                                   headers=headers)
        assert r.status_code == 200, r.text
        assert self.app.gateway.pool.active[0].name == "e0"


@contextlib.asynccontextmanager
async def _rig(tmp_path: Path, prepare: Any = None, **extra: Any) -> AsyncIterator[Rig]:
    path = tmp_path / "kneegate.yaml"
    async with serve(FakeEngine()) as up, httpx.AsyncClient(timeout=10) as client:
        doc = {"tick_interval": 0.02, "upstreams": [{
            "name": "e0", "url": up, "controller": "fixed", "params": {"initial": 2}}],
            "classes": CLASSES,
            "default_class": "interactive", "admin_token": TOKEN, "api_keys": {KEY: "batch"},
            **extra}
        path.write_text(json.dumps(doc))
        cfg = load_config(path)
        app = build_app(prepare(cfg) if prepare else cfg, config_path=str(path), prepare=prepare)
        async with serve(app) as gw:
            rig = Rig(app, gw, path, up, client)
            yield rig
            m = await rig.metrics()
            assert total(m, "kneegate_in_flight") == 0
            assert_conserved(m)


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
) + "upstreams: *i\n"
HEAD = "classes: {interactive: {priority: 10}, batch: {}}\ndefault_class: interactive\n"


@pytest.mark.parametrize(("content", "reason"), [
    pytest.param("", "the config is empty", id="empty"),
    pytest.param("# all commented out\n\n   \n# upstreams: []\n", "the config is empty",
                 id="comments-only"),
    pytest.param('{"tick_interval": 0.02, "upstreams": [{"name": "e0", "url": "http://127.',
                 "not valid YAML", id="truncated-broken"),
    pytest.param(HEAD + "admin_token: run-token-0042\n", "names no upstream",
                 id="truncated-before-upstreams"),
    pytest.param(HEAD + "upstreams: []\n", "names no upstream", id="no-upstreams"),
    pytest.param(HEAD + "upstreams: [{name: e0, url: 'http://127.0.0.1:1'}]\nadmin_token:",
                 "admin_token: no value",
                 id="truncated-after-admin_token"),
    pytest.param(b"tick_interval: 0.02\nadmin_token: caf\xe9\n", "not UTF-8 text",
                 id="latin-1"),
    pytest.param("[" * 10_000, "nest", id="deep-nesting"),  # libyaml's cap (1000) or ours
    pytest.param("".join(" " * i + "k:\n" for i in range(100)), "nested deeper than 32",
                 id="deep-block-nesting"),
    pytest.param(BILLION_LAUGHS, "expands to more than", id="billion-laughs"),
    pytest.param("tick_interval: 0.02\nmax_queue: " + "9" * 5000 + "\n", "cannot be converted",
                 id="huge-integer"),
    pytest.param("tick_interval: 0.02\x00\n", "not allowed", id="nul-byte"),
])
async def test_a_bad_reload_is_refused_and_the_old_config_serves(
    tmp_path: Path, content: str | bytes, reason: str
) -> None:
    async with _rig(tmp_path) as rig:
        r = await rig.reload(content)
        assert r.status_code == 400, r.text
        assert r.json()["reloaded"] is False and reason in r.json()["message"]
        await rig.still_serves()
        await rig.still_serves(authorization=f"Bearer {KEY}")
        cfg = rig.app.gateway.config
        assert cfg.admin_token == TOKEN and cfg.api_keys == {KEY: "batch"}
        assert (await rig.client.get(rig.gw + "/kneegate/status")).status_code == 401
        m = await rig.metrics()
        assert total(m, "kneegate_config_reloads_total", result="error") == 1
        assert total(m, "kneegate_config_reloads_total", result="ok") == 0
        assert total(m, "kneegate_config_reloads_total", result="failed") == 0


async def test_a_file_without_upstreams_is_fine_while_prepare_fills_one(tmp_path: Path) -> None:
    # `kneegate serve` with the embedded engine: prepare points the file at it, on reload too
    async with serve(FakeEngine()) as embedded:
        fill = embedded_upstream(int(embedded.rsplit(":", 1)[1]))
        async with _rig(tmp_path, prepare=fill, upstreams=[]) as rig:
            assert [u.name for u in rig.app.gateway.pool.active] == ["embedded"]
            r = await rig.reload({"tick_interval": 0.02, "max_queue": 7, "classes": CLASSES,
                                  "default_class": "interactive"})
            assert r.status_code == 200, r.text
            assert rig.app.gateway.config.max_queue == 7
            assert [u.name for u in rig.app.gateway.pool.active] == ["embedded"]
            r = await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200


async def test_a_file_without_secrets_keeps_the_running_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kneegate")
    async with _rig(tmp_path) as rig:
        r = await rig.reload(rig.doc(classes=CLASSES, default_class="interactive"))
        assert r.status_code == 200, r.text
        assert rig.app.gateway.config.admin_token == TOKEN
        assert (await rig.client.get(rig.gw + "/kneegate/status")).status_code == 401
        await rig.still_serves(authorization=f"Bearer {KEY}")
        m = await rig.metrics()
        assert total(m, "kneegate_requests_received_total", **{"class": "batch"}) == 1
        assert "admin_token is not in the new file: the running token is kept" in caplog.text
        assert "api_keys is not in the new file: the running 1 keys are kept" in caplog.text
        assert TOKEN not in caplog.text and KEY not in caplog.text


async def test_kept_keys_must_fit_the_new_classes(tmp_path: Path) -> None:
    async with _rig(tmp_path) as rig:
        r = await rig.reload(rig.doc())  # the default classes only: no "batch" for the key
        assert r.status_code == 400
        message = r.json()["message"]
        assert "unknown class 'batch'" in message and "running api_keys were kept" in message
        assert KEY[:4] not in message
        await rig.still_serves(authorization=f"Bearer {KEY}")


async def test_secrets_are_removed_only_when_the_file_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kneegate")
    async with _rig(tmp_path) as rig:
        r = await rig.reload(rig.doc(classes=CLASSES, default_class="interactive",
                                     admin_token=None, api_keys={}))
        assert r.status_code == 200, r.text
        assert (await rig.client.get(rig.gw + "/kneegate/status")).status_code == 200
        assert rig.app.gateway.config.api_keys == {}
        assert "admin_token: null in the new file: the token is removed" in caplog.text
        assert "every API key is removed" in caplog.text


SECRET = "s3cr3t-token-xyz"


@pytest.mark.parametrize("content", [
    pytest.param(f"tick_interval: 0.02\nadmin_token: {SECRET}: [\n", id="on-the-line"),
    pytest.param(f'tick_interval: 0.02\nadmin_token: "{SECRET}\n', id="unclosed-quote"),
    pytest.param(f"admin_token: {SECRET}\nupstreams: [\n  {{name: : e0}}\n", id="next-line"),
    pytest.param(f"admin_token: {SECRET}\n\tupstreams: []\n", id="tab"),
])
async def test_a_yaml_error_never_shows_the_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _rig(tmp_path) as rig:
        r = await rig.reload(content)
        assert r.status_code == 400 and "not valid YAML" in r.json()["message"]
        assert "line " in r.json()["message"]  # where it is, without the line itself
        assert SECRET not in r.text and SECRET not in caplog.text
        assert "config reload rejected" in caplog.text
        await rig.still_serves()


def _pieces(secret: str, size: int = 4) -> list[str]:
    return [secret[i:i + size] for i in range(len(secret) - size + 1)]


@pytest.mark.parametrize(("api_keys", "field"), [
    pytest.param({"sk-new-key-778899": "vip"}, "api_keys", id="unknown-class"),
    pytest.param({"sk-new-key-778899": ["batch"]}, "api_keys.<key>", id="wrong-type"),
])
async def test_an_api_key_error_never_shows_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, api_keys: dict[str, Any], field: str
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _rig(tmp_path) as rig:
        r = await rig.reload(rig.doc(classes=CLASSES, default_class="interactive",
                                     api_keys=api_keys))
        assert r.status_code == 400
        message = r.json()["message"]
        assert f": {field}: " in message
        for piece in _pieces("sk-new-key-778899"):  # no 4 characters of the key in a row
            assert piece not in message and piece not in caplog.text, piece
        await rig.still_serves(authorization=f"Bearer {KEY}")


def test_the_classes_objectives_are_exported_and_follow_a_reload() -> None:
    app = build_app(gw_config("http://127.0.0.1:9", classes={
        "default": {}, "batch": {"ttft_objective": 60}}))
    reg = app.gateway.metrics.registry

    def objective(cls: str) -> float | None:
        return reg.get_sample_value("kneegate_ttft_objective_seconds", {"class": cls})

    assert (objective("default"), objective("batch")) == (2.0, 60.0)
    app.gateway.apply(gw_config("http://127.0.0.1:9", classes={"default": {"ttft_objective": 1.5}}))
    assert (objective("default"), objective("batch")) == (1.5, None)


async def test_a_reload_that_removes_a_class_while_a_body_arrives_serves_it_in_the_default(
    tmp_path: Path,
) -> None:
    async with _rig(tmp_path) as rig:
        host, port = rig.gw.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head.encode() + body[:5])  # its class (batch, by its key) is chosen
            await writer.drain()
            r = await rig.reload(rig.doc(classes={"interactive": {"priority": 10}},
                                         default_class="interactive", api_keys={}))
            assert r.status_code == 200, r.text
            writer.write(body[5:])
            await writer.drain()
            with anyio.fail_after(5):
                status = await reader.readline()
        finally:
            writer.close()
        assert status.split()[1] == b"200", status  # served, in the default class
        m = await rig.metrics()
        assert total(m, "kneegate_requests_received_total", **{"class": "interactive"}) == 1
