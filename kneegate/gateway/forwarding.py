"""What is forwarded, and how: the proxy's header, path and refusal policy (pure: no I/O).

Paths and methods: `proxied_path` decides from the raw request path, normalised first
when it could hide a dot segment (RFC 3986), so the allow-list judges the path the engine
will route; `FORWARDED_METHODS` are the methods the OpenAI API uses.

Request headers (`forward_headers`, once per request): hop-by-hop fields dropped
(`HOP_BY_HOP`), X-Forwarded-For added, X-Request-Id kept or made, the API key checked when
the config requires one (gateway/api_keys.py), and the class picked
(`ProxySettings.classify`: API key, else header, else the default). `x-kneegate-ttft-ms`
(`TTFT_HEADER`) is kneegate's own: read (`parse_objective`), never forwarded. Response headers
lose the same fields but Content-Length (`RESPONSE_DROP`).

vLLM's own admission valve (`--max-num-queued-reqs` / `--max-num-queued-tokens`) refuses
with a small 503 before the engine starts the request: `small_body` says a response is
small enough to read whole, `VALVE` is the phrase that tells the refusal from other 503s,
and `ReadResponse` relays such a response from memory when it stands.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kneegate.admission.types import ANONYMOUS, TenantPolicy
from kneegate.gateway.api_keys import ApiKeys
from kneegate.gateway.config.gateway import GatewayConfig
from kneegate.gateway.errors import InvalidApiKey, InvalidHeader, InvalidPath
from kneegate.gateway.tenants import Tenants
from kneegate.gateway.types import Scope

__all__ = [
    "ALLOW", "FORWARDED_METHODS", "HOP_BY_HOP", "OBJECTIVE_MAX_MS", "PROXIED_EXACT",
    "REQUEST_ID_MAX", "RESPONSE_DROP",
    "TTFT_HEADER",
    "VALVE", "ProxySettings", "ReadResponse", "content_length", "forward_headers",
    "forward_target", "is_sse", "normalise_path", "parse_objective", "proxied_path",
    "remove_dot_segments", "small_body",
]

# The methods of the OpenAI API, and what a proxy forwards for them (HEAD, OPTIONS).
# CONNECT, TRACE, PUT, PATCH, ... get 405: never a tunnel, never an echo.
FORWARDED_METHODS = frozenset({"GET", "POST", "DELETE", "HEAD", "OPTIONS"})
ALLOW = b"GET, POST, DELETE, HEAD, OPTIONS"
PROXIED_EXACT = frozenset({b"/tokenize", b"/detokenize", b"/version"})
_DOT = re.compile(rb"%2[eE]")
# after %2E is decoded: a dot segment with a parameter ('..;x', Tomcat's matrix form, or
# its ';' encoded) that an engine could strip to '..', or a '.', '/' or '\\' encoded twice
_AMBIGUOUS = re.compile(rb"/\.{1,2}(?:;|%3[bB])|%25(?:2[eEfF]|5[cC])")

# RFC 9110 §7.6.1 connection-specific fields, plus what the client library recomputes.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
    b"host", b"content-length", b"expect",
})
RESPONSE_DROP = HOP_BY_HOP - {b"content-length"}

TTFT_HEADER = b"x-kneegate-ttft-ms"
REQUEST_ID_MAX = 200  # bytes of X-Request-Id kept, logged and forwarded; longer: 400


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the hot path reads, prepared once per config (load or reload)."""

    max_body: int
    class_header: bytes
    classes: dict[bytes, str]  # only those a request may pick by header (`header: true`)
    api_keys: dict[bytes, str]
    default_class: str
    first_byte: float
    idle: float
    tenants: Tenants
    keys: ApiKeys | None  # require_api_key: the keys a request must bear

    @classmethod
    def from_config(cls, cfg: GatewayConfig, previous: ProxySettings | None = None
                    ) -> ProxySettings:
        return cls(
            max_body=cfg.max_body_bytes,
            class_header=cfg.class_header.lower().encode("latin-1"),
            classes={name.encode(): name for name, c in cfg.classes.items() if c.header},
            api_keys={key.encode(): name for key, name in cfg.api_keys.items()},
            default_class=cfg.default_class,
            first_byte=cfg.timeouts.first_byte,
            idle=cfg.timeouts.idle,
            tenants=Tenants.from_config(cfg, previous.tenants if previous else None),
            keys=ApiKeys.from_config(cfg),
        )

    def classify(self, header: bytes | None, auth: bytes | None,
                 tenant: TenantPolicy = ANONYMOUS) -> str:
        """An API key's class, else its configured tenant's, else an opted-in class the
        header names, else the default."""
        if auth is not None and self.api_keys and auth[:7].lower() == b"bearer ":
            cls = self.api_keys.get(auth[7:].strip())
            if cls is not None:
                return cls
        if self.tenants.classes:
            cls = self.tenants.class_of(tenant)
            if cls is not None:
                return cls
        if header is not None:
            return self.classes.get(header.strip(), self.default_class)
        return self.default_class


def proxied_path(raw: bytes) -> bytes | None:
    """The path to forward for a request's raw path, or None when it is not proxied.

    Proxied: `/v1/*` and `PROXIED_EXACT`. A clean path (no '%', '/.' or '\\': nearly every
    request) is judged as it is; any other is normalised first (`normalise_path`), and the
    normalised path is what is judged and forwarded. Raises InvalidPath.
    """
    if b"%" in raw or b"/." in raw or b"\\" in raw:
        raw = normalise_path(raw)
    if raw.startswith(b"/v1/") or raw in PROXIED_EXACT:
        return raw
    return None


def normalise_path(raw: bytes) -> bytes:
    """`raw` with %2E decoded and dot segments removed (RFC 3986 §6.2.2.2, §5.2.4).

    Other escapes stay as sent: decoding %65 could complete a new escape ('%2%65' is
    '%2e' for an engine that decodes once). After this no segment of the path decodes to
    '.' or '..' for the engine. Raise InvalidPath where servers disagree on what a path
    means (Envoy rejects these the same way): an encoded '/' or '\\', a bare '\\', a dot
    segment with a parameter ('/..;/', which Tomcat-style servers read as '/../'), and a
    '.', '/' or '\\' encoded twice ('%252e', which a server that decodes twice reads as '.').
    """
    low = raw.lower()
    if b"%2f" in low or b"%5c" in low or b"\\" in raw:
        raise InvalidPath("the path contains an encoded '/' or a '\\'; send it unencoded")
    path = _DOT.sub(b".", raw)
    if _AMBIGUOUS.search(path):
        raise InvalidPath("the path has a dot segment with a ';' parameter or a character "
                          "encoded twice; send it plain")
    return remove_dot_segments(path)


def remove_dot_segments(path: bytes) -> bytes:
    """RFC 3986 §5.2.4 for an absolute path: '/a/./b/../c' -> '/a/c', '/..' -> '/'."""
    if not path.startswith(b"/"):
        return path  # '*' or an absolute URI: never proxied anyway
    segments = path.split(b"/")[1:]
    out: list[bytes] = []
    for seg in segments:
        if seg == b"..":
            if out:
                out.pop()
        elif seg != b".":
            out.append(seg)
    # a path ending in '.' or '..' names a directory: it keeps its trailing '/'
    tail = b"/" if segments[-1] in (b".", b"..") and out else b""
    return b"/" + b"/".join(out) + tail


def forward_target(scope: Scope) -> bytes:
    """The request target sent upstream: the raw path and the query string as received."""
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    qs: bytes = scope.get("query_string", b"")
    return path + b"?" + qs if qs else path


def forward_headers(
    scope: Scope, s: ProxySettings
) -> tuple[list[tuple[bytes, bytes]], bytes, str, TenantPolicy, bytes | None, bytes | None]:
    """Headers for the engine, the request id, the class, the tenant, the Content-Length
    and the request's own TTFT objective (`x-kneegate-ttft-ms`, ours: not forwarded).
    Raises InvalidHeader for ambiguous credentials (two Authorization headers) and an
    X-Request-Id over `REQUEST_ID_MAX` bytes, and InvalidApiKey when the config requires a
    key this request does not bear (before its tenant is named: an unknown key is none)."""
    out: list[tuple[bytes, bytes]] = []
    xff = rid = cls_value = auth = length = ttft = tenant_value = None
    tenant_header = s.tenants.header
    for k, v in scope["headers"]:
        if k in HOP_BY_HOP:
            if k == b"content-length" and v.isdigit():  # the parser checked it already
                length = v
            continue
        if k == b"x-forwarded-for":
            xff = v
            continue
        if k == TTFT_HEADER:
            ttft = v
            continue
        if k == b"x-request-id":
            if len(v) > REQUEST_ID_MAX:
                raise InvalidHeader(f"x-request-id is longer than {REQUEST_ID_MAX} bytes",
                                    "x-request-id")
            rid = v
        elif k == s.class_header:
            cls_value = v
        elif k == b"authorization":
            if auth is not None:  # which one counts? vLLM reads the first, others the last
                raise InvalidHeader("more than one Authorization header; send one",
                                    "authorization")
            auth = v
        elif k == tenant_header:
            tenant_value = v
        out.append((k, v))
    if rid is None:
        rid = os.urandom(16).hex().encode()  # as random as uuid4, a third of the cost
        out.append((b"x-request-id", rid))
    client = scope.get("client")
    if client:
        xff = client[0].encode() if xff is None else xff + b", " + client[0].encode()
    if xff is not None:
        out.append((b"x-forwarded-for", xff))
    if s.keys is not None and not s.keys.admits(
            scope["method"], scope.get("raw_path") or scope["path"].encode(), auth):
        raise InvalidApiKey("no API key; send 'Authorization: Bearer <key>'" if auth is None
                            else "incorrect API key provided", rid)
    tenant = s.tenants.resolve(auth, tenant_value)
    return out, rid, s.classify(cls_value, auth, tenant), tenant, length, ttft


_LENGTH_DIGITS = 18  # more significant digits than this is over any body limit


def content_length(value: bytes) -> int:
    """A Content-Length of digits (the parser checked them) as a number, without Python's
    cost for long ones (leading zeros are allowed and skipped; past 18 significant digits
    it is 10**18, over any limit)."""
    digits = value.lstrip(b"0")
    return int(digits) if len(digits) <= _LENGTH_DIGITS else 10 ** _LENGTH_DIGITS


# x-kneegate-ttft-ms: plain decimal milliseconds (no sign, exponent, '_', 'nan' or 'inf',
# all of which Python's float() would take), at most an hour: a class's largest objective
_OBJECTIVE = re.compile(rb"[0-9]{1,7}(?:\.[0-9]{1,9})?")
OBJECTIVE_MAX_MS = 3_600_000


def parse_objective(value: bytes | None) -> float:
    """The request's own TTFT objective in seconds from `x-kneegate-ttft-ms` (inf: none).

    It can only tighten its class's: a value above the class's objective is clamped to it
    (admission takes the smaller). A value that is not a plain decimal number of
    milliseconds in (0, OBJECTIVE_MAX_MS] is a 400 `invalid_header`, as Envoy refuses a
    malformed `grpc-timeout`: a client that sends one has a bug, and guessing could loosen
    or void its objective."""
    if value is None:
        return math.inf
    value = value.strip(b" \t")
    ms = float(value) if _OBJECTIVE.fullmatch(value) else 0.0
    if not 0 < ms <= OBJECTIVE_MAX_MS:
        raise InvalidHeader(
            f"x-kneegate-ttft-ms must be a decimal number of milliseconds above 0 and at most "
            f"{OBJECTIVE_MAX_MS}, got {value[:32].decode('latin-1')!r}", "x-kneegate-ttft-ms")
    return ms / 1000


def is_sse(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a response is a server-sent event stream (its Content-Type says so)."""
    for k, v in headers:
        if k == b"content-type":
            return v.startswith(b"text/event-stream")
    return False


# in both of vLLM 0.32's admission refusals (vllm/exceptions.py): "...busy and cannot accept
# new requests" and "...reached its prefill token backlog limit", each followed by this
VALVE = b"Please try again later or on a different instance"
_SMALL = 1 << 16  # bytes: a refusal is a short JSON error


def small_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a response's Content-Length says it is small enough to be a refusal."""
    for k, v in headers:
        if k == b"content-length":
            return v.isdigit() and int(v) <= _SMALL
    return False


class ReadResponse:
    """An engine's small response read whole (to look at it), relayed from memory: the
    parts of `UpstreamResponse` the relay uses."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self._body = status, headers, body

    async def read(self) -> bytes:
        body, self._body = self._body, b""
        return body

    async def pipe(self, sink: Callable[[bytes], bool]) -> bytes:
        return await self.read()

    def ended(self) -> bool:
        return True  # what `read` returns is the last of it

    def release(self) -> None:
        pass  # its connection went back to the pool when it was read

    def close(self) -> None:
        pass
