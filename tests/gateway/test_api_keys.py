"""`require_api_key`: the gateway checks the engine's keys itself, before admission
(gateway/api_keys.py). A request without a configured key gets 401 `invalid_api_key` in
OpenAI's error shape, is counted once (`kneegate_client_rejections_total{reason=
"invalid_api_key"}`, never `received`), is never queued, never reaches the engine, names no
tenant, and its key is never logged. Over real sockets, in front of a FakeEngine."""

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
from prometheus_client import generate_latest

from kneegate.gateway.api_keys import ApiKeys
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.errors import ConfigError

pytestmark = pytest.mark.anyio

CLASS_KEY, TENANT_KEY = "sk-batch-jobs-0001", "sk-acme-0001"
WRONG = "sk-guessed-9999"
KEYS: dict[str, Any] = {
    "require_api_key": True,
    "classes": {"default": {}, "batch": {}},
    "api_keys": {CLASS_KEY: "batch"},
    "tenants": {"acme": {"keys": [TENANT_KEY]}},
}


class Rig:
    def __init__(self, engine: FakeEngine, app: KneegateApp, gw: str,
                 client: httpx.AsyncClient) -> None:
        self.engine, self.app, self.gw, self.client = engine, app, gw, client

    def metrics(self) -> dict[Any, float]:
        return scrape(generate_latest(self.app.gateway.metrics.registry).decode())

    async def post(self, auth: str | None, path: str = "/v1/completions") -> httpx.Response:
        headers = {} if auth is None else {"authorization": auth}
        return await self.client.post(self.gw + path, json={"max_tokens": 2}, headers=headers)


@contextlib.asynccontextmanager
async def _rig(**kw: Any) -> AsyncIterator[Rig]:
    engine = FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up, **kw))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            yield Rig(engine, app, gw, client)


def _assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"],
                                  "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}}
    assert r.headers["www-authenticate"] == "Bearer"
    assert len(r.headers["x-request-id"]) == 32
    assert WRONG not in r.text


async def test_a_request_without_a_configured_key_is_401_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = [None, f"Bearer {WRONG}", "Bearer", f"Basic {CLASS_KEY}", f"Bearer {CLASS_KEY}x",
               f"{CLASS_KEY}"]
    served = [f"Bearer {CLASS_KEY}", f"bearer {TENANT_KEY}", f"Bearer  {TENANT_KEY}"]
    async with _rig(**KEYS) as rig:
        with caplog.at_level(logging.INFO, "kneegate"):
            for auth in refused:
                _assert_refused(await rig.post(auth))
            for auth in served:
                assert (await rig.post(auth)).status_code == 200, auth
            # the other guarded paths too; /version is open, as in vLLM, and so is OPTIONS
            _assert_refused(await rig.post(f"Bearer {WRONG}", "/tokenize"))
            _assert_refused(await rig.client.get(rig.gw + "/v1/models"))
            assert (await rig.client.get(rig.gw + "/version")).status_code == 200
            r = await rig.client.options(rig.gw + "/v1/completions")
            assert r.status_code != 401
        m = rig.metrics()
        bad = len(refused) + 2
        good = len(served) + 2
        assert total(m, "kneegate_client_rejections_total", reason="invalid_api_key") == bad
        assert total(m, "kneegate_client_rejections_total") == bad  # in one reason only
        assert total(m, "kneegate_requests_received_total") == good
        assert rig.engine.requests == good
        assert_conserved(m)
        # never a tenant of its own (no `key-` label), never demand, never a key in the log
        tenants = rig.app.gateway.proxy.settings.tenants
        named = {v for (_, ls) in m for _, v in ls if v.startswith("key-")}
        assert named == {tenants.resolve(f"Bearer {CLASS_KEY}".encode()).name}  # served only
        assert total(m, "kneegate_requests_received_total", **{"class": "batch"}) == 1
        assert WRONG not in caplog.text and CLASS_KEY not in caplog.text
        assert caplog.text.count("outcome=invalid_api_key") == bad


async def test_the_401_comes_before_the_body_is_read() -> None:
    async with _rig(**KEYS) as rig:
        host, port = rig.gw.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # a head announcing 1 MB that never comes: answered at once all the same
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n"
                     b"content-type: application/json\r\ncontent-length: 1000000\r\n"
                     b"authorization: Bearer " + WRONG.encode() + b"\r\n\r\n")
        await writer.drain()
        with anyio.fail_after(5):
            head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 401 ")
        assert rig.engine.requests == 0
        assert total(rig.metrics(), "kneegate_client_rejections_total",
                     reason="invalid_api_key") == 1


async def test_without_require_api_key_any_key_passes() -> None:
    async with _rig(**{**KEYS, "require_api_key": False}) as rig:
        assert (await rig.post(f"Bearer {WRONG}")).status_code == 200
        assert (await rig.post(None)).status_code == 200
        assert total(rig.metrics(), "kneegate_client_rejections_total") == 0


def test_keys_are_required_only_where_some_are_configured() -> None:
    with pytest.raises(ConfigError, match="require_api_key: no key is configured"):
        gw_config(require_api_key=True)
    assert gw_config(require_api_key=True, tenants={"t": {"keys": ["k-1"]}}).require_api_key
    keys = ApiKeys.from_config(gw_config(**KEYS))
    assert keys is not None and ApiKeys.from_config(gw_config()) is None
    assert keys.admits("POST", b"/v1/completions", f"BEARER {TENANT_KEY}".encode())
    assert not keys.admits("POST", b"/detokenize", None)
    assert keys.admits("GET", b"/version", None)


async def test_a_reload_that_leaves_it_out_keeps_requiring_keys(tmp_path: Path) -> None:
    path = tmp_path / "kneegate.yaml"
    async with _rig(**KEYS) as rig:
        rig.app.gateway.config_path = str(path)
        up = rig.app.gateway.config.upstreams[0]
        doc = {**KEYS, "upstreams": [{"name": "e0", "url": up.url}]}
        del doc["require_api_key"]
        path.write_text(json.dumps(doc))
        ok, _ = rig.app.gateway.reload()
        assert ok
        _assert_refused(await rig.post(f"Bearer {WRONG}"))
        path.write_text(json.dumps({**doc, "require_api_key": False}))
        assert rig.app.gateway.reload()[0]
        assert (await rig.post(f"Bearer {WRONG}")).status_code == 200
