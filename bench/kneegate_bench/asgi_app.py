"""kneegate's app for another ASGI server, to measure that server against uvicorn.

    KNEEGATE_BENCH_UPSTREAM=http://127.0.0.1:8001 granian --interface asgi --loop uvloop \
        kneegate_bench.asgi_app:app

The same app `kneegate serve --upstream URL --controller fixed --limit 100000
--no-access-log` runs (what `kneegate_bench.overhead` measures), built on import. Under a
server other than kneegate's own uvicorn protocol it relays through plain ASGI `send`, as
any ASGI app would, and has no client limits of gateway/http/wire.py: a benchmark's stand-in,
not a way to deploy kneegate. Used by `kneegate_bench.overhead --granian` (issue 16).
"""

from __future__ import annotations

import os

from kneegate.gateway.app import build_app
from kneegate.gateway.config.gateway import GatewayConfig, parse_config

__all__ = ["app", "config"]

UPSTREAM = os.environ.get("KNEEGATE_BENCH_UPSTREAM", "http://127.0.0.1:8001")
LIMIT = 100000


def config(upstream: str = UPSTREAM) -> GatewayConfig:
    """What `kneegate serve --upstream URL --controller fixed --limit 100000 --no-access-log`
    runs (tests/bench/test_asgi_app.py holds the two equal): built here from the
    gateway's config, so that the load tools never import the command line above them."""
    data = GatewayConfig().model_dump()
    params = {"initial": LIMIT, "max_limit": LIMIT, "min_limit": 1}
    data["upstreams"] = [
        {"name": "upstream0", "url": upstream, "controller": "fixed", "params": params}
    ]
    data["server"]["access_log"] = False
    return parse_config(data, "kneegate_bench.asgi_app")


app = build_app(config())
