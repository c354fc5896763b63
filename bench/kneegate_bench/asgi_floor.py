"""The floor under any gateway built on uvicorn: uvicorn's request cycle with nothing behind it.

    KNEEGATE_FLOOR_EVENTS=16 KNEEGATE_FLOOR_INTERVAL=0 uvicorn --loop uvloop --http httptools \
        --no-access-log kneegate_bench.asgi_floor:app

A plain ASGI app that answers every request itself with the SSE stream the benchmark's
upstream sends (`kneegate_bench.rawhttp`: the same events, one `send` each, then `[DONE]`),
`KNEEGATE_FLOOR_INTERVAL` seconds apart. It has no upstream, no admission, no metrics: what
it costs per request is what uvicorn costs before a gateway does anything, so no app under
uvicorn can relay a request for less. `kneegate_bench.overhead --floor` runs it beside kneegate
(`uvicorn-floor` rows), the reference for issue 16's per-request goal.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kneegate_bench.rawhttp import event_payload

__all__ = ["app"]

_EVENTS = [event_payload(i) for i in range(int(os.environ.get("KNEEGATE_FLOOR_EVENTS", "16")))]
_DONE = b"data: [DONE]\n\n"
_INTERVAL = float(os.environ.get("KNEEGATE_FLOOR_INTERVAL", "0"))
_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    more = True
    while more:  # the request's body, read whole as a proxy would
        more = (await receive()).get("more_body", False)
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    for ev in _EVENTS:
        if _INTERVAL:
            await asyncio.sleep(_INTERVAL)
        await send({"type": "http.response.body", "body": ev, "more_body": True})
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})
