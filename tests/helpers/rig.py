"""A gateway over real sockets: a fake engine, the gateway in front of it, a client for both.

    async with serve_rig(FakeEngine(), limit=4) as rig:
        await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 1})
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from helpers.gateway import FakeEngine, gw_config, scrape, serve
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import GatewayConfig


class Rig:
    """An engine, a gateway in front of it, and a client for both."""

    def __init__(self, engine: FakeEngine, app: KneegateApp, up: str, gw: str,
                 client: httpx.AsyncClient) -> None:
        self.engine, self.app, self.up, self.gw, self.client = engine, app, up, gw, client

    async def metrics(self) -> dict[Any, float]:
        token = self.app.gateway.admin_token  # /metrics on the API port needs it when set
        auth = {} if token is None else {"authorization": "Bearer " + token.decode()}
        return scrape((await self.client.get(self.gw + "/metrics", headers=auth)).text)


@contextlib.asynccontextmanager
async def serve_rig(engine: FakeEngine, cfg: GatewayConfig | None = None, **kw: Any
                    ) -> AsyncIterator[Rig]:
    """`engine` served, a gateway in front of it (`cfg`, else `gw_config(**kw)`), a client."""
    async with serve(engine) as up:
        app = build_app(cfg or gw_config(up, **kw))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            yield Rig(engine, app, up, gw, client)
