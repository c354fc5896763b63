"""kneegate's app for another ASGI server, to measure that server against uvicorn.

    KNEEGATE_BENCH_UPSTREAM=http://127.0.0.1:8001 granian --interface asgi --loop uvloop \
        kneegate.benchmarks.asgi_app:app

The same app `kneegate serve --upstream URL --controller fixed --limit 100000
--no-access-log` runs (what `benchmarks.overhead` measures), built on import. Under a
server other than kneegate's own uvicorn protocol it relays through plain ASGI `send`, as
any ASGI app would, and has no client limits of gateway/wire.py: a benchmark's stand-in,
not a way to deploy kneegate. Used by `benchmarks.overhead --granian` (issue 16).
"""

from __future__ import annotations

import os

from kneegate.cli import _load, _parser
from kneegate.gateway.app import build_app

__all__ = ["app"]

_ARGS = ["serve", "--upstream", os.environ.get("KNEEGATE_BENCH_UPSTREAM", "http://127.0.0.1:8001"),
         "--controller", "fixed", "--limit", "100000", "--no-access-log"]
app = build_app(_load(_parser().parse_args(_ARGS)))
