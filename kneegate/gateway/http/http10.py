"""The request cycle for HTTP/1.0 clients: close-delimited bodies, never chunked.

HTTP/1.0 clients cannot read chunked bodies: a response without Content-Length goes to
them close-delimited (raw bytes, the end of the body is the end of the connection).
`KneegateHttpProtocol` (gateway/http/wire.py) gives an HTTP/1.0 request this cycle, when the
probe of uvicorn's request cycle found what it reads (`body_writer.CYCLE_NEEDS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent

__all__ = ["CloseDelimitedCycle"]


class CloseDelimitedCycle(RequestResponseCycle):
    """A request cycle for an HTTP/1.0 client: a body without Content-Length is sent
    as it is and ends when the connection closes (RFC 9112 §6.3), never chunked.

    uvicorn answers every request HTTP/1.1-style and adds chunked framing when the app
    gives no Content-Length, which an HTTP/1.0 client cannot read. HTTP/1.0 requests are
    never kept alive by uvicorn, so the close is due anyway.
    """

    _raw = False  # the response started without framing: bodies go out as they are

    async def send(self, message: ASGISendEvent) -> None:
        if not self.response_started:
            if message["type"] == "http.response.start" and _unframed(
                    message.get("headers", ()), message["status"], self.scope["method"]):
                self._raw = True
                self.chunked_encoding = False  # uvicorn then adds no transfer-encoding
            await super().send(message)
            return
        if not self._raw or self.response_complete or message["type"] != "http.response.body":
            await super().send(message)
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        body = message.get("body", b"")
        if body:
            self.transport.write(body)
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()  # the end of the body
            self.on_response()


def _unframed(headers: Any, status: int, method: str) -> bool:
    """True when uvicorn would frame this response with chunked encoding."""
    if method == "HEAD" or status in (204, 304):
        return False
    return not any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
