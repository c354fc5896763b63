"""What the API port shows (issue 44): with `server.admin_port` the admin endpoints are served
there only; without it `/metrics` needs the admin token whenever one is set; the token may
come from a file (a mounted Secret), read again at each reload. Over real sockets: a gateway
in front of a FakeEngine, with a configured tenant and an unlisted key that have both been
served, so that a leak would show their names in what a client reads."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, gw_config, scrape, serve, total

from kneegate.cli import main as kneegate
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.errors import ConfigError
from kneegate.gateway.server.serving import admin_server, running
from kneegate.gateway.server.workers import exposure_warning

pytestmark = pytest.mark.anyio

TOKEN = "admin-token-0042"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TENANT, TENANT_KEY, OTHER_KEY = "acme-corp", "sk-acme-0001", "sk-unlisted-0002"
ADMIN_PATHS = ("/metrics", "/kneegate/status", "/kneegate/history", "/kneegate/",
               "/kneegate/live.js")


class Rig:
    def __init__(self, app: KneegateApp, gw: str, admin: str | None,
                 client: httpx.AsyncClient) -> None:
        self.app, self.gw, self.admin, self.client = app, gw, admin, client

    async def serve_both_tenants(self) -> None:
        for key in (TENANT_KEY, OTHER_KEY):
            r = await self.client.post(self.gw + "/v1/completions", json={"max_tokens": 2},
                                       headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text


@contextlib.asynccontextmanager
async def _rig(admin_port: int | None, **kw: Any) -> AsyncIterator[Rig]:
    async with serve(FakeEngine()) as up:
        cfg = gw_config(up, tenants={TENANT: {"keys": [TENANT_KEY]}},
                        server={"admin_port": admin_port}, **kw)
        app = build_app(cfg)
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            if app.admin is None:
                yield Rig(app, gw, None, client)
                return
            async with running(admin_server(app)) as admin:
                yield Rig(app, gw, admin, client)


def _leaks(text: str) -> list[str]:
    return [s for s in (TENANT, "key-", "127.0.0.1") if s in text]


async def test_the_admin_port_serves_what_the_api_port_answers_404() -> None:
    async with _rig(0, admin_token=TOKEN) as rig:
        assert rig.admin is not None
        await rig.serve_both_tenants()
        for path in ADMIN_PATHS:  # not even with the token: not there at all
            r = await rig.client.get(rig.gw + path, headers=AUTH)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
            assert not _leaks(r.text), path
        r = await rig.client.post(rig.gw + "/kneegate/reload", headers=AUTH)
        assert r.status_code == 404
        for base in (rig.gw, rig.admin):  # the probes on both: Kubernetes probes either
            assert (await rig.client.get(base + "/health")).status_code == 200
            assert (await rig.client.get(base + "/ready")).json()["ready"] is True
        # the admin port: /metrics open (the port is the boundary), the rest behind the token
        r = await rig.client.get(rig.admin + "/metrics")
        assert r.status_code == 200 and TENANT in r.text and "key-" in r.text
        m = scrape(r.text)
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 2
        assert (await rig.client.get(rig.admin + "/kneegate/status")).status_code == 401
        status = await rig.client.get(rig.admin + "/kneegate/status", headers=AUTH)
        assert status.status_code == 200 and status.json()["upstreams"][0]["name"] == "e0"
        r = await rig.client.post(rig.admin + "/kneegate/reload")
        assert r.status_code == 401
        # and the admin port proxies nothing
        r = await rig.client.post(rig.admin + "/v1/completions", json={"max_tokens": 2})
        assert r.status_code == 404
        m = scrape((await rig.client.get(rig.admin + "/metrics")).text)
        assert total(m, "kneegate_requests_received_total") == 2


async def test_without_an_admin_port_metrics_on_the_api_port_need_the_token() -> None:
    async with _rig(None, admin_token=TOKEN) as rig:
        await rig.serve_both_tenants()
        for headers in ({}, {"authorization": "Bearer wrong-token"},
                        {"authorization": f"Basic {TOKEN}"}):
            r = await rig.client.get(rig.gw + "/metrics", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "unauthorized"
            assert not _leaks(r.text)
        r = await rig.client.get(rig.gw + "/metrics", headers=AUTH)
        assert r.status_code == 200 and TENANT in r.text and "key-" in r.text  # what was kept
        assert_conserved(scrape(r.text))
        for path in ("/kneegate/status", "/kneegate/history"):
            assert (await rig.client.get(rig.gw + path)).status_code == 401, path
        assert (await rig.client.post(rig.gw + "/kneegate/reload")).status_code == 401


async def test_without_token_or_admin_port_the_api_port_shows_them_and_start_up_says_so(
) -> None:
    async with _rig(None) as rig:
        await rig.serve_both_tenants()
        r = await rig.client.get(rig.gw + "/metrics")
        assert r.status_code == 200 and TENANT in r.text  # today's behaviour, kept
        warning = exposure_warning(rig.app.gateway.config)
        assert warning is not None and "server.admin_port" in warning
    assert exposure_warning(gw_config(admin_token=TOKEN)) is None
    assert exposure_warning(gw_config(server={"admin_port": 9090})) is None


async def test_the_token_from_a_file_is_read_again_at_each_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    secret = tmp_path / "admin-token"
    secret.write_text("first-token-0001\n")  # `echo` leaves a newline: it is not the token's
    path = tmp_path / "kneegate.yaml"
    async with serve(FakeEngine()) as up, httpx.AsyncClient(timeout=10) as client:
        doc = {"tick_interval": 0.02, "admin_token_file": str(secret), "upstreams": [
            {"name": "e0", "url": up, "controller": "fixed", "params": {"initial": 2}}]}
        path.write_text(json.dumps(doc))
        app = build_app(gw_config(up, admin_token_file=str(secret)), config_path=str(path))
        async with serve(app) as gw:
            def bearer(token: str) -> dict[str, str]:
                return {"authorization": f"Bearer {token}"}

            async def code(token: str) -> int:
                r = await client.get(gw + "/kneegate/status", headers=bearer(token))
                return r.status_code

            assert await code("first-token-0001") == 200
            secret.write_text("second-token-0002")  # the Secret rotated: taken at the reload
            assert await code("second-token-0002") == 401
            r = await client.post(gw + "/kneegate/reload", headers=bearer("first-token-0001"))
            assert r.status_code == 200, r.text
            assert await code("second-token-0002") == 200
            assert await code("first-token-0001") == 401
            secret.unlink()  # a reload that cannot read it keeps the running token
            with caplog.at_level(logging.ERROR, "kneegate"):
                r = await client.post(gw + "/kneegate/reload",
                                      headers=bearer("second-token-0002"))
            assert r.status_code == 400 and "admin_token_file" in r.json()["message"]
            assert await code("second-token-0002") == 200
            assert "second-token-0002" not in caplog.text
    secret.write_text("  \n")
    with pytest.raises(ConfigError, match="holds no token"):
        build_app(gw_config(admin_token_file=str(secret)))
    with pytest.raises(ConfigError, match="not both"):
        gw_config(admin_token=TOKEN, admin_token_file=str(secret))


def test_the_admin_port_must_differ_from_the_api_port() -> None:
    with pytest.raises(ConfigError, match=r"server\.admin_port: 8080 is also the API port"):
        gw_config(server={"port": 8080, "admin_port": 8080})
    assert gw_config(server={"port": 0, "admin_port": 0}).server.admin_port == 0


def test_serve_refuses_a_token_file_it_cannot_read_and_check_config_notes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "kneegate.yaml"
    path.write_text(f"admin_token_file: {tmp_path / 'absent'}\n")
    assert kneegate(["check-config", str(path)]) == 0  # the Secret may exist only where it runs
    assert "note: cannot read" in capsys.readouterr().out
    assert kneegate(["serve", "--config", str(path), "--port", "0"]) == 2  # before binding
    err = capsys.readouterr().err
    assert "admin_token_file: cannot read" in err and "absent" in err
