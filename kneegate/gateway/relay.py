"""The relay: the upstream's response to the client, head first, then chunk by chunk.

Every chunk passes through the `Tap` as it arrives, with no StreamingResponse and no
re-encoding. Under kneegate's server the upstream socket's callback writes each chunk to
the client itself (gateway/http/body_writer.py: `BodyWriter`), and the relay's task wakes
only at the end or to wait out the client's back-pressure; on any other ASGI server it goes
through `send`. A short answer whose whole body came with its head goes out as one write.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from kneegate.gateway.exchange import Exchange
from kneegate.gateway.forwarding import RESPONSE_DROP, ReadResponse
from kneegate.gateway.http.body_writer import EXTENSION as WIRE_EXTENSION
from kneegate.gateway.http.body_writer import BodyWriter
from kneegate.gateway.tap import Tap
from kneegate.gateway.types import Scope, Send
from kneegate.gateway.upstream.client import UpstreamResponse

__all__ = ["Response", "body_writer", "relay"]

Response = UpstreamResponse | ReadResponse

_END = {"type": "http.response.body", "body": b"", "more_body": False}


async def relay(
    ex: Exchange, resp: Response, tap: Tap, send: Send, rid: bytes,
    writer: BodyWriter | None,
) -> None:
    """Send `resp`'s head and body to the client, each chunk through `tap` as it comes
    (`ex` counts them and says when the last byte is on its way)."""
    headers = []
    has_rid = False
    for h in resp.headers:  # one pass: what is relayed, and whether it names the request
        k = h[0]
        if k not in RESPONSE_DROP:
            headers.append(h)
            has_rid = has_rid or k == b"x-request-id"
    if not has_rid:
        headers.append((b"x-request-id", rid))
    start = {"type": "http.response.start", "status": resp.status, "headers": headers}
    feed = tap.feed
    if writer is not None and resp.ended():
        # the whole body came with the head (a short answer): head and body in one write
        chunk = await resp.read()
        if chunk:
            ex.chunks += 1
            feed(chunk)
        ex.finished = True
        await writer.send_whole(send, start, chunk)
        ex.started = True
        return
    await send(start)
    ex.started = True
    if writer is not None and writer.ready():
        # Push: the upstream socket's callback writes each chunk to the client itself
        # (gateway/http/wire.py); this task wakes only at the end, or to wait out the
        # client's back-pressure through `send` with the chunk the writer refused.
        def sink(data: bytes) -> bool:
            if not writer.write(data):
                return False
            ex.chunks += 1
            feed(data)
            return True

        more: Callable[[], Awaitable[bytes]] = partial(resp.pipe, sink)
    else:
        more = resp.read
    ended = resp.ended
    while chunk := await more():
        ex.chunks += 1
        feed(chunk)
        if ended():  # the last bytes: one write with the end of the response
            ex.finished = True
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
            return
        # `send` waits while the client does not read: the sweeper tells that apart
        ex.sending = True
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ex.sending = False
    ex.finished = True
    await send(_END)


def body_writer(scope: Scope) -> BodyWriter | None:
    extensions = scope.get("extensions")
    return extensions.get(WIRE_EXTENSION) if extensions else None
