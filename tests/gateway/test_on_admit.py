"""The gateway tells the upstream's controller each admission's prompt-size estimate."""

from __future__ import annotations

import json

import httpx
import pytest
from gw_helpers import FakeEngine, gw_config, serve

from gateway.app import build_app

pytestmark = pytest.mark.anyio


async def test_controller_sees_on_admit_with_the_body_size_estimate() -> None:
    engine = FakeEngine(interval=0.002)
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=4))
        seen: list[int] = []
        ctl = app.gateway.pool.active[0].controller
        ctl.on_admit = seen.append  # type: ignore[method-assign]
        small = json.dumps({"prompt": "x" * 40, "max_tokens": 3}).encode()
        large = json.dumps({"prompt": "x" * 4000, "max_tokens": 3}).encode()
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            for body in (small, large):
                r = await client.post(gw + "/v1/completions", content=body,
                                      headers={"content-type": "application/json"})
                assert r.status_code == 200
        # one call per admitted request, before its answer: bytes // 4, JSON included
        assert seen == [len(small) // 4, len(large) // 4]
