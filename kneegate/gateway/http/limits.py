"""The client-side limits: what a client may send, and the answers to one that sends more.

Client limits (`ClientLimits`, from the config's `limits`, fixed at start-up). What a client
sends is bounded before it reaches the app, in the protocol's callbacks, with no task and
at most one timer per connection and phase:

- the request head (request line and headers) is counted as bytes arrive, before httptools
  buffers them: past `max_header_bytes`, or past `max_headers` fields, the client gets 431
  (a pipelined head that starts within the read that ends the request before it is counted
  from its next read: it may reach twice the limit, never more);
- the head must arrive within `header_timeout` of the connection or of its first byte
  (slowloris): 408, or a silent close when nothing came at all (nginx does the same);
- a request body must not pause longer than `body_timeout` between two reads, and must
  arrive whole within `body_deadline` of its first read (a body dripped just fast enough to
  beat the pause bound would otherwise hold its connection for ever): 408, both timed by
  one timer, armed only for a body that spans reads;
- an idle keep-alive connection is closed after `keepalive_timeout` (uvicorn's own timer);
- a connection accepted past `max_connections` open ones is answered 503 on its request,
  and so is one past `max_connections_per_client` open ones from its client's address (one
  address must not take every connection; the table holds only addresses with a connection
  open, so it is never larger than the connections themselves).

A request the HTTP parser refuses (a malformed request line, header or Content-Length:
not digits, signed, two different values, past 2**64) gets 400 `malformed_request` the
same way, instead of uvicorn's plain-text 400 and a log line each.

A request that asks to switch protocols (`Connection: upgrade` with an `Upgrade` header:
WebSocket, h2c) gets 400 `upgrade_not_supported` before the app sees it: it is never
proxied and never holds a slot (the bytes after its head would be the new protocol's, so
the connection cannot go on as HTTP/1.1; Envoy refuses upgrades it is not configured for
the same way). An `Upgrade` header without `Connection: upgrade` means nothing (RFC 9110
§7.8): such a request is served, and the header is not forwarded (hop-by-hop).

Each refusal is counted (`kneegate_client_rejections_total{reason}`), answered with the
OpenAI-style body and `connection: close`, and the connection is then closed the way nginx
does it ("lingering close"): the answer is flushed with a FIN, and what the client still
sends is read and dropped for a few seconds; a plain close with unread input would make
the kernel send a reset that can destroy the answer before the client reads it.

They are enforced by `KneegateHttpProtocol` (gateway/http/wire.py); `ClientLimits` holds the
numbers, the answers (prepared once) and the count and log line of each refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from kneegate.gateway.config.sections import LimitsConfig
from kneegate.gateway.errors import (
    ClientConnectionLimit,
    HeadersTooLarge,
    HTTPError,
    MalformedRequest,
    RequestTimeout,
    TooManyConnections,
    UpgradeNotSupported,
    render,
)

__all__ = ["LOG_EVERY", "ClientLimits"]

LOG_EVERY = 10.0  # seconds between two log lines about refusals of one reason

log = logging.getLogger("kneegate")


def _ignore(reason: str) -> None:
    pass


def _answer(exc: HTTPError) -> bytes:
    """The whole response for a refusal, written by the protocol itself (no ASGI cycle)."""
    status, headers, body = render(exc)
    line = b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())
    lines = [line, *(k + b": " + v + b"\r\n" for k, v in headers)]
    return b"".join([*lines, b"connection: close\r\n\r\n", body])


class ClientLimits:
    """The `limits` one server's connections enforce, with their answers prepared once.

    `count(reason)` is called once per refusal (the gateway's metrics; a no-op elsewhere).
    """

    __slots__ = ("_logged", "answers", "body_deadline", "body_timeout", "count",
                 "header_timeout", "max_connections", "max_header_bytes", "max_headers",
                 "open_by_client", "per_client")

    def __init__(self, cfg: LimitsConfig, count: Callable[[str], None] | None = None) -> None:
        self.max_header_bytes, self.max_headers = cfg.max_header_bytes, cfg.max_headers
        self.header_timeout, self.body_timeout = cfg.header_timeout, cfg.body_timeout
        self.body_deadline = cfg.body_deadline
        self.max_connections = cfg.max_connections
        self.per_client = cfg.per_client_connections
        self.open_by_client: dict[str, int] = {}  # address -> its connections open now
        self.count = count or _ignore
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last line at, unlogged)
        self.answers: dict[str, bytes] = {
            "upgrade": _answer(UpgradeNotSupported(
                "kneegate does not switch protocols (Upgrade: WebSocket, h2c, ...); send "
                "plain HTTP/1.1 without 'Connection: upgrade'")),
            "malformed_request": _answer(MalformedRequest(
                "the request is not valid HTTP/1.1 (its request line, a header field or "
                "its Content-Length); fix the client")),
            "header_bytes": _answer(HeadersTooLarge(
                f"request line and headers exceed {cfg.max_header_bytes} bytes; "
                "send fewer or smaller headers")),
            "header_count": _answer(HeadersTooLarge(
                f"more than {cfg.max_headers} header fields; send fewer headers")),
            "header_timeout": _answer(RequestTimeout(
                f"request headers not received within {cfg.header_timeout:g}s")),
            "body_timeout": _answer(RequestTimeout(
                f"request body paused for more than {cfg.body_timeout:g}s; "
                "send it without pauses")),
            "body_deadline": _answer(RequestTimeout(
                f"request body not received whole within {cfg.body_deadline:g}s; "
                "send it faster or send less")),
            "connection_limit": _answer(TooManyConnections(
                f"more than {cfg.max_connections} open connections; retry after 1s", 1)),
            "client_connection_limit": _answer(ClientConnectionLimit(
                f"more than {self.per_client} open connections from your "
                "address; close some or retry after 1s", 1)),
        }

    def opened(self, host: str) -> bool:
        """A connection from `host` opened; True when it is over the per-client cap."""
        n = self.open_by_client.get(host, 0) + 1
        self.open_by_client[host] = n
        return n > self.per_client

    def closed(self, host: str) -> None:
        """A connection `opened` from `host` closed."""
        n = self.open_by_client.pop(host, 1) - 1
        if n > 0:
            self.open_by_client[host] = n


    def refused(self, reason: str, peer: str, now: float) -> None:
        """Count a refusal; log it, at most one line per reason every LOG_EVERY seconds
        (a flood of bad clients must not become a flood of log lines)."""
        self.count(reason)
        at, unlogged = self._logged.get(reason, (-LOG_EVERY, 0))
        if now - at < LOG_EVERY:
            self._logged[reason] = (at, unlogged + 1)
            return
        self._logged[reason] = (now, 0)
        more = f" ({unlogged} more since the last line)" if unlogged else ""
        log.info("client %s refused: %s%s", peer, reason, more)
