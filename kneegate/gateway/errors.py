"""Every error the gateway raises or answers with, and the one wire format for them.

    KneegateError
    ├── ConfigError            a config file or reload failed validation (field path + reason)
    ├── CannotListen           a listening port could not be bound (in use, privileged, ...)
    └── HTTPError              answered to the caller as an OpenAI-style error body
        ├── Rejection          admission said no; always carries Retry-After
        │   ├── QueueFull          429 queue_full
        │   ├── OverObjective      429 over_objective: no first token within the objective now
        │   ├── QueueTimeout       503 queue_timeout
        │   ├── NoUpstream         503 no_upstream
        │   ├── TooManyConnections 503 too_many_connections: over limits.max_connections
        │   │   └── ClientConnectionLimit  the same, over limits.max_connections_per_client
        │   ├── ShuttingDown       503 shutting_down: the gateway is draining
        │   └── TenantQuota        429 tenant_quota: the tenant is at its own cap
        ├── MalformedRequest   400: not valid HTTP/1.1 (request line, a header, Content-Length)
        ├── UpgradeNotSupported 400: asks to switch protocols (WebSocket, h2c): never proxied
        ├── InvalidPath        400: '%2F', '%5C' or '\\' in the path (ambiguous)
        ├── InvalidHeader      400: a kneegate request header with a value it cannot use
        ├── InvalidBody        400: a generation request whose body is not a JSON object
        ├── ContextTooLong     400: surely longer than the engine's context (as vLLM answers)
        ├── NotFound           404: not a proxied path (never an open proxy)
        ├── MethodNotAllowed   405: a method the OpenAI API does not use (with Allow)
        ├── BodyTooLarge       413: over max_body_bytes (closes the connection)
        ├── HeadersTooLarge    431: request head over limits.max_header_bytes / max_headers
        ├── RequestTimeout     408: request head or body slower than limits.*_timeout
        ├── Unauthorized       401: admin endpoint without the right bearer token
        ├── InvalidApiKey      401: no configured API key, with require_api_key
        └── UpstreamError      502: the engine failed or broke off
            ├── UpstreamConnectError  502: could not connect (marks the upstream unusable)
            └── UpstreamTimeout       504: first byte / idle timeout
                └── UpstreamConnectTimeout  504: connect timed out (marks it unusable too)

`render(exc)` is the single translation to the wire: status, headers (Retry-After and
`X-Kneegate-Reject-Reason` for rejections) and the body
`{"error": {"message", "type", "param", "code"}}` that OpenAI clients understand.

An `UpstreamError`'s message is for the log (URL, the transport's own words); a client sees
`exc.public(name)`: the upstream's configured name and a generic `reason`, never an internal
address or exception text.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Sequence
from typing import ClassVar

from kneegate.gateway.types import Send

__all__ = [
    "BodyTooLarge",
    "CannotListen",
    "ClientConnectionLimit",
    "ConfigError",
    "ContextTooLong",
    "HTTPError",
    "HeadersTooLarge",
    "InvalidApiKey",
    "InvalidBody",
    "InvalidHeader",
    "InvalidPath",
    "KneegateError",
    "MalformedRequest",
    "MethodNotAllowed",
    "NoUpstream",
    "NotFound",
    "OverObjective",
    "QueueFull",
    "QueueTimeout",
    "Rejection",
    "RequestTimeout",
    "ShuttingDown",
    "TenantQuota",
    "TooManyConnections",
    "Unauthorized",
    "UpgradeNotSupported",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamTimeout",
    "render",
    "send_error",
]

REASON_HEADER = b"x-kneegate-reject-reason"


class KneegateError(Exception):
    """Base of everything kneegate raises on purpose."""


class ConfigError(KneegateError):
    """A config document failed validation: `source`, the dotted `field` path, `reason`."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {reason}")


class CannotListen(KneegateError):
    """A listening socket could not be bound; the message says what to change
    (`flag`: the command-line option that picks another)."""

    def __init__(self, host: str, port: int, exc: OSError, flag: str = "--port") -> None:
        self.host, self.port, self.flag = host, port, flag
        super().__init__(_cannot_listen(host, port, exc, flag))


def _cannot_listen(host: str, port: int, exc: OSError, flag: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use; choose another with {flag}"
    if exc.errno == errno.EACCES:
        return (f"port {port} on {host} needs privileges (ports below 1024); choose another "
                f"with {flag}")
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (f"cannot listen on {host}: not an address of this machine; choose another "
                "with --host")
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


class HTTPError(KneegateError):
    """An error answered to the HTTP caller."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str) -> None:
        self.message = message
        self.param: str | None = None  # the request field at fault, where there is one
        super().__init__(message)

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        return []


class Rejection(HTTPError):
    """Admission refused the request; the caller should retry after `retry_after` seconds."""

    reason: ClassVar[str] = "rejected"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"retry-after", str(self.retry_after).encode()),
            (REASON_HEADER, self.reason.encode()),
        ]


class QueueFull(Rejection):
    status, type, code, reason = 429, "rate_limit_error", "queue_full", "queue_full"


class OverObjective(Rejection):
    status, type, code, reason = 429, "rate_limit_error", "over_objective", "over_objective"


class QueueTimeout(Rejection):
    status, type, code, reason = 503, "server_error", "queue_timeout", "queue_timeout"


class NoUpstream(Rejection):
    status, type, code, reason = 503, "server_error", "no_upstream", "no_upstream"


class TooManyConnections(Rejection):
    status, type, code, reason = 503, "server_error", "too_many_connections", "connection_limit"


class ClientConnectionLimit(TooManyConnections):
    reason = "client_connection_limit"


class ShuttingDown(Rejection):
    status, type, code, reason = 503, "server_error", "shutting_down", "shutting_down"


class TenantQuota(Rejection):
    status, type, code, reason = 429, "rate_limit_error", "tenant_quota", "tenant_quota"


class MalformedRequest(HTTPError):
    status, type, code = 400, "invalid_request_error", "malformed_request"


class UpgradeNotSupported(HTTPError):
    status, type, code = 400, "invalid_request_error", "upgrade_not_supported"


class InvalidHeader(HTTPError):
    status, type, code = 400, "invalid_request_error", "invalid_header"

    def __init__(self, message: str, header: str) -> None:
        super().__init__(message)
        self.param = header


class InvalidBody(HTTPError):
    status, type, code = 400, "invalid_request_error", "invalid_body"


class ContextTooLong(HTTPError):
    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


class ModelNotFound(HTTPError):
    """A request names a model no engine behind the gateway serves (OpenAI's 404)."""

    status, type, code = 404, "invalid_request_error", "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.param = "model"


class ModelRequired(HTTPError):
    """A request names no model, and the engines serve several."""

    status, type, code = 400, "invalid_request_error", "model_required"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.param = "model"


class InvalidPath(HTTPError):
    status, type, code = 400, "invalid_request_error", "invalid_path"


class NotFound(HTTPError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(HTTPError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, allow: bytes) -> None:
        super().__init__(message)
        self.allow = allow

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"allow", self.allow)]


class BodyTooLarge(HTTPError):
    status, type, code = 413, "invalid_request_error", "body_too_large"

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        # the rest of the body is never read: the connection cannot carry another request
        return [(b"connection", b"close")]


class HeadersTooLarge(HTTPError):
    status, type, code = 431, "invalid_request_error", "headers_too_large"


class RequestTimeout(HTTPError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class Unauthorized(HTTPError):
    status, type, code = 401, "invalid_request_error", "unauthorized"


class InvalidApiKey(HTTPError):
    """No bearer key, or not one the gateway knows (`require_api_key`); OpenAI's code.
    `request_id` is the request's, for the answer and the log (the key is never shown)."""

    status, type, code = 401, "invalid_request_error", "invalid_api_key"

    def __init__(self, message: str, request_id: bytes) -> None:
        super().__init__(message)
        self.request_id = request_id

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b"Bearer")]  # RFC 6750 §3


class UpstreamError(HTTPError):
    """The engine failed. `message` is for the log; `reason` (generic) is for the client."""

    status, type, code = 502, "server_error", "upstream_error"
    # the request never reached the engine (no connection was made): safe to send elsewhere,
    # and no evidence about the engine's latency
    unreached: ClassVar[bool] = False

    def __init__(self, message: str, reason: str = "bad response") -> None:
        super().__init__(message)
        self.reason = reason

    def public(self, upstream: str) -> UpstreamError:
        """This error as a client may see it: the upstream's configured name, no internals."""
        return type(self)(f"upstream '{upstream}' failed: {self.reason}; retry later",
                          self.reason)


class UpstreamConnectError(UpstreamError):
    status, type, code = 502, "server_error", "upstream_unreachable"
    unreached = True


class UpstreamTimeout(UpstreamError):
    status, type, code = 504, "server_error", "upstream_timeout"


class UpstreamConnectTimeout(UpstreamTimeout):
    unreached = True


def render(exc: HTTPError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The one wire format: (status, headers, body) for an HTTPError."""
    body = json.dumps(
        {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                   "code": exc.code}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *exc.extra_headers(),
    ]
    return exc.status, headers, body


async def send_error(
    send: Send, exc: HTTPError, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer `exc` on an ASGI `send` whose response has not started."""
    status, headers, body = render(exc)
    headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
