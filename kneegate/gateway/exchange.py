"""One request in flight, as the proxy holds it: what ends it from outside, and its body.

An `Exchange` is what the client's watcher, the sweeper (first-byte and idle deadlines,
compared by chunk counters at each tick) and `Proxy.cut` need to end a request: each
cancels its task with a reason (`abort`), once, and never after the last byte is on its
way (`finished`). `read_body` reads the request body whole, up to a limit; `watch` is the
watcher on any ASGI server without the body writer's disconnect callback.
"""

from __future__ import annotations

import asyncio

from kneegate.controllers.base import Outcome
from kneegate.gateway.errors import BodyTooLarge
from kneegate.gateway.gate import Permit
from kneegate.gateway.tap import Tap
from kneegate.gateway.types import Receive
from kneegate.gateway.upstream.state import Upstream

__all__ = ["Exchange", "read_body", "watch"]


class Exchange:
    """One request in flight: what the watcher and the sweeper need to end it."""

    __slots__ = (
        "aborted", "admitted_at", "chunks", "finished", "permit", "seen_at", "seen_chunks",
        "sending", "started", "tap", "task", "upstream",
    )

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.upstream: Upstream | None = None  # set at admission (and at a reroute)
        self.permit: Permit | None = None  # set at admission
        self.tap: Tap | None = None  # set when the response head came
        self.aborted: Outcome | None = None
        self.started = False  # response headers sent to the client
        self.finished = False  # the last byte is on its way: nothing may abort now
        self.admitted_at = 0.0
        self.chunks = 0
        self.seen_chunks = 0
        self.seen_at = 0.0
        self.sending = False  # awaiting the client's socket (back-pressure) in `send`

    def abort(self, outcome: Outcome) -> None:
        if self.aborted is None and not self.finished:
            self.aborted = outcome
            self.task.cancel()


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client left first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body: bytes = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes; send a smaller request")
        if not msg.get("more_body", False):
            return body if not chunks else b"".join([*chunks, body])
        chunks.append(body)


async def watch(receive: Receive, ex: Exchange) -> None:
    # After the body, receive() returns only when the client disconnects (or the response
    # completed, which `finished` tells apart).
    while (await receive())["type"] != "http.disconnect":
        pass
    ex.abort(Outcome.CLIENT_CANCELLED)
