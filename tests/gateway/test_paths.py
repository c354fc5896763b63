"""Paths and methods (issue 11, defect 7): the allow-list judges the path the engine routes.

The requests are written verbatim on a raw socket: httpx (like browsers) resolves dot
segments itself, which is exactly what an attacker does not do.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from helpers.gateway import FakeEngine, assert_conserved, total
from helpers.rig import Rig, serve_rig

from kneegate.gateway.errors import InvalidPath
from kneegate.gateway.forwarding import normalise_path, proxied_path

pytestmark = pytest.mark.anyio


async def raw_request(base: str, method: str, target: str, body: bytes = b""
                      ) -> tuple[int, dict[str, str], bytes]:
    """Send one request line exactly as given; (status, headers, body)."""
    host, port = base.removeprefix("http://").split(":")
    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n"
                         f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                         + body)
            raw = await reader.read(-1)  # the server closes: connection: close
        finally:
            writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, payload


def error_code(body: bytes) -> Any:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["code"]


ATTACKS = [
    ("GET", "/v1/../metrics", 404),
    ("POST", "/v1/%2e%2e/kneegate/reload", 404),
    ("POST", "/v1/%2E%2E/kneegate/reload", 404),
    ("GET", "/v1/..%2fadmin%2fslowdown", 400),
    ("GET", "/v1/..%2Fmetrics", 400),
    ("GET", "/v1/..%5cmetrics", 400),
    ("GET", "/v1/..\\metrics", 400),
    ("GET", "/v1/./../kneegate/status", 404),
    ("GET", "/v1/models/../../health", 404),
    ("GET", "/v1/..", 404),
    ("GET", "/v1/.%2e/metrics", 404),
    ("GET", "/tokenize/..", 404),
    ("GET", "/v1//../../metrics", 404),
]


async def test_paths_that_leave_the_allow_list_are_refused_and_never_forwarded() -> None:
    async with serve_rig(FakeEngine()) as rig:
        for method, target, status in ATTACKS:
            code, headers, body = await raw_request(rig.gw, method, target, b"{}")
            assert code == status, target
            assert headers["content-type"] == "application/json"
            assert error_code(body) == ("not_found" if status == 404 else "invalid_path")
        assert rig.engine.requests == 0
        # refused before admission: not counted as received, so nothing moved
        m = await rig.metrics()
        assert_conserved(m)
        assert (await rig.client.get(rig.gw + "/ready")).status_code == 200  # still served


# issue 44: forms that servers read differently. Each is refused (400 invalid_path, or 404
# when it leaves the allow-list), or reaches the engine inside what kneegate proxies.
FORMS = [
    ("GET", "/v1/..;/metrics", 400),  # Tomcat-style matrix parameter on '..'
    ("POST", "/v1/..;/kneegate/reload", 400),
    ("GET", "/v1/..;x/..;y/health", 400),
    ("GET", "/v1/%2e%2e;/metrics", 400),
    ("GET", "/v1/..%3b/metrics", 400),
    ("GET", "/v1/%252e%252e/metrics", 400),  # double encoding
    ("GET", "/v1/%252e%252e%252fmetrics", 400),
    ("GET", "/v1/%2e%2e/metrics", 404),
    ("GET", "/v1/%2E%2e/%2e%2e/kneegate/status", 404),
    ("GET", "/v1\\..\\metrics", 400),  # backslashes
    ("GET", "/v1/..\\metrics", 400),
    ("GET", "//metrics", 404),  # '//': another path, never the engine's
    ("GET", "//v1/../metrics", 404),
    ("GET", "/v1//../../kneegate/status", 404),
    ("POST", "//kneegate/reload", 404),
]


async def test_every_path_form_stays_inside_what_kneegate_proxies() -> None:
    engine = FakeEngine()
    seen: list[str] = []
    engine_call = engine.__call__

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["raw_path"].decode("latin-1"))
        await engine_call(scope, receive, send)

    async with serve_rig(recording) as rig:  # type: ignore[arg-type]
        before = list(seen)  # the gateway's own probes (/health, /v1/models, /metrics)
        for method, target, status in FORMS:
            code, headers, body = await raw_request(rig.gw, method, target, b"{}")
            assert code == status, target
            assert headers["content-type"] == "application/json", target
            assert error_code(body) == ("not_found" if status == 404 else "invalid_path")
            # another client, between two of them: served as usual
            code, _, _ = await raw_request(rig.gw, "POST", "/v1/completions",
                                           b'{"max_tokens": 1}')
            assert code == 200
        forwarded = seen[len(before):]
        assert forwarded.count("/v1/completions") == len(FORMS)
        # the engine saw the other client's requests and the gateway's own probes only
        assert set(forwarded) <= {"/v1/completions", "/health", "/metrics",
                                          "/v1/models"}, forwarded
        m = await rig.metrics()
        assert total(m, "kneegate_config_reloads_total") == 0  # the admin endpoint: unreached
        clean = sum(1 for _, target, _ in FORMS if "/." not in target and "%" not in target
                    and "\\" not in target)  # not normalised: the gateway's own 404
        assert total(m, "kneegate_client_rejections_total", reason="invalid_path") == (
            len(FORMS) - clean)
        assert total(m, "kneegate_client_rejections_total", reason="not_found") == clean
        assert total(m, "kneegate_requests_received_total") == len(FORMS)
        assert_conserved(m)


async def test_dot_segments_inside_v1_are_forwarded_resolved() -> None:
    async with serve_rig(FakeEngine()) as rig:
        for target, forwarded in [
            ("/v1/a/./b/../c?x=1&y=/../z", "/v1/a/c?x=1&y=/../z"),  # the query is not a path
            ("/v1/%2e/models/%2E%2e/completions", "/v1/completions"),
            ("/v1/x/..", "/v1/"),
            ("/v1/chat/../completions%20x", "/v1/completions%20x"),
        ]:
            code, _, _ = await raw_request(rig.gw, "POST", target, b'{"max_tokens": 1}')
            assert code == 200, target
            assert rig.engine.last_path == forwarded
        assert rig.engine.requests == 4
        await assert_idle(rig)


async def test_only_the_openai_methods_are_forwarded() -> None:
    async with serve_rig(FakeEngine()) as rig:
        for method in ("TRACE", "CONNECT", "PUT", "PATCH", "PROPFIND"):
            code, headers, body = await raw_request(rig.gw, method, "/v1/completions", b"{}")
            assert code == 405, method
            assert headers["allow"] == "GET, POST, DELETE, HEAD, OPTIONS"
            assert error_code(body) == "method_not_allowed"
        # CONNECT's own authority form is no path at all: the HTTP parser refuses it
        code, _, _ = await raw_request(rig.gw, "CONNECT", "127.0.0.1:443")
        assert code in (400, 404, 405)
        assert rig.engine.requests == 0
        for method in ("GET", "POST", "DELETE", "OPTIONS", "HEAD"):
            code, _, _ = await raw_request(rig.gw, method, "/v1/completions", b"{}")
            assert code == 200, method
        assert rig.engine.requests == 5
        await assert_idle(rig)


async def test_wrong_method_on_an_own_endpoint_is_405_in_the_openai_shape() -> None:
    async with serve_rig(FakeEngine()) as rig:
        code, headers, body = await raw_request(rig.gw, "GET", "/kneegate/reload")
        assert code == 405 and "POST" in headers["allow"]
        assert error_code(body) == "method_not_allowed"


async def assert_idle(rig: Rig) -> None:
    m = await rig.metrics()
    assert_conserved(m)
    assert sum(v for (n, _), v in m.items() if n == "kneegate_in_flight") == 0


@pytest.mark.parametrize(("raw", "out"), [
    (b"/v1/models", b"/v1/models"),
    (b"/a/b/c/./../../g", b"/a/g"),  # RFC 3986 §5.4.2
    (b"/v1/a/./b/../c", b"/v1/a/c"),
    (b"/v1/a/b/..", b"/v1/a/"),
    (b"/v1/a/.", b"/v1/a/"),
    (b"/..", b"/"),
    (b"/v1//../x", b"/v1/x"),
    (b"/v1/..//metrics", b"//metrics"),
    (b"/v1/%2E%2e/x", b"/x"),
    (b"/v1/%2%65/x", b"/v1/%2%65/x"),  # not decoded: %65 would complete a new escape
])
def test_normalise_path(raw: bytes, out: bytes) -> None:
    assert normalise_path(raw) == out


@pytest.mark.parametrize("raw", [
    b"/v1/..;/metrics", b"/v1/.;/x", b"/v1/%2e%2e;x/y", b"/v1/..%3B/x", b"/v1/%252e%252e/x",
    b"/v1/%252F", b"/v1/%255cx",
])
def test_ambiguous_path_forms_raise(raw: bytes) -> None:
    with pytest.raises(InvalidPath):
        normalise_path(raw)


def test_proxied_path_allow_list() -> None:
    assert proxied_path(b"/v1/completions") == b"/v1/completions"
    assert proxied_path(b"/tokenize") == b"/tokenize"
    assert proxied_path(b"/v1/../tokenize") == b"/tokenize"
    assert proxied_path(b"/v1") is None
    assert proxied_path(b"/v1/../metrics") is None
    assert proxied_path(b"/%761/models") is None  # only dots are decoded: stays unknown
