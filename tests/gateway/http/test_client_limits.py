"""Client-side limits over raw sockets: header size and count, slow or idle clients, early
413, the connection cap, and close-delimited bodies for HTTP/1.0 (issue 11, defects 4, 5
and 11).

Each test speaks HTTP by hand (asyncio.open_connection), so nothing between the test and
the gateway fixes up what a careless or hostile client sends. Timeouts are set small in the
test's config; every wait is bounded; afterwards the outcome identities hold and, where a
request was refused, the engine never saw it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from helpers.gateway import (
    FakeEngine,
    assert_conserved,
    gw_config,
    scrape,
    serve,
    total,
    until,
)
from prometheus_client import generate_latest
from uvicorn.server import ServerState

from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.sections import LimitsConfig
from kneegate.gateway.http.body_writer import FALLBACK_ENV
from kneegate.gateway.http.limits import ClientLimits
from kneegate.gateway.http.wire import KneegateHttpProtocol, WireConfig
from kneegate.gateway.server.serving import QuietServer, running, uvicorn_config

pytestmark = pytest.mark.anyio

FALLBACK = os.environ.get(FALLBACK_ENV) == "1"  # the run is on wire.py's fallback (CI)
FAST: dict[str, Any] = {"header_timeout": 0.3, "body_timeout": 0.3, "keepalive_timeout": 0.3}


class Gw:
    """A gateway (limits from `limits`) in front of a FakeEngine; raw connections to it."""

    def __init__(self, engine: FakeEngine, app: KneegateApp, url: str) -> None:
        self.engine, self.app = engine, app
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    def metrics(self) -> dict[Any, float]:
        # read in-process: a scrape over HTTP would be one more client connection
        return scrape(generate_latest(self.app.gateway.metrics.registry).decode())

    def rejected(self, reason: str) -> float:
        return total(self.metrics(), "kneegate_client_rejections_total", reason=reason)

    def assert_untouched(self) -> None:
        """Nothing reached admission or the engine; the identities hold."""
        m = self.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 0
        assert self.engine.requests == 0


@contextlib.asynccontextmanager
async def _gw(engine: FakeEngine | None = None, /, **limits: Any) -> AsyncIterator[Gw]:
    engine = engine or FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up, limits=limits))
        async with serve(app) as url:
            yield Gw(engine, app, url)


def _request(method: str = "POST", path: str = "/v1/completions", body: bytes = b"",
             headers: list[str] | None = None, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: gw", *(headers or [])]
    if body or method == "POST":
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {}
    for f in fields:
        k, _, v = f.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), headers, body


async def _until_eof(reader: asyncio.StreamReader, bound: float = 3.0) -> bytes:
    """Everything the gateway sends until it closes; fails if it has not closed in `bound`."""
    with anyio.fail_after(bound):
        return await reader.read()


async def _send_ignoring_reset(writer: asyncio.StreamWriter, data: bytes) -> None:
    # the gateway may close while we still send (it drops what comes after a refusal)
    with contextlib.suppress(ConnectionError):
        writer.write(data)
        await writer.drain()


def _error_code(body: bytes) -> str:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return str(err["code"])


# --- defect 4: request head size and count ------------------------------------------


@pytest.mark.parametrize("head", [
    pytest.param([f"x-big: {'a' * (1 << 20)}"], id="one-1MiB-header"),
    pytest.param([f"x-h{i}: v" for i in range(10_000)], id="10000-headers"),
    pytest.param([f"x{i}:" for i in range(5_000)], id="5000-headers-in-40KiB"),
    pytest.param([f"x-h{i}: {'b' * 1000}" for i in range(32 * 1024)], id="32MiB-block"),
])
async def test_oversized_request_head_gets_431_and_never_reaches_the_engine(
    head: list[str],
) -> None:
    async with _gw() as gw:
        reader, writer = await gw.connect()
        sending = asyncio.create_task(
            _send_ignoring_reset(writer, _request(body=b"{}", headers=head)))
        status, headers, body = _parse(await _until_eof(reader))
        writer.close()
        sending.cancel()
        assert status == 431 and headers["connection"] == "close"
        assert _error_code(body) == "headers_too_large"
        # headers are counted once the head is whole (its bytes bound its memory): a head
        # of many small ones that fits max_header_bytes is refused by the count
        reason = "header_count" if len(head) == 5_000 else "header_bytes"
        assert gw.rejected(reason) == 1
        gw.assert_untouched()


async def test_header_limits_are_exact() -> None:
    # a head of exactly max_header_bytes passes (its body in the same write), one byte
    # more does not; max_headers fields pass, one more does not
    body = b'{"max_tokens": 1}'

    def head_of(size: int) -> bytes:
        base = _request(body=body, headers=["connection: close", "x-pad: "])
        pad = size - (base.index(b"\r\n\r\n") + 4)
        return _request(body=body, headers=["connection: close", "x-pad: " + "p" * pad])

    def fields(n: int) -> bytes:  # host, connection, content-type and -length, and n - 4
        return _request(body=body, headers=["connection: close",
                                            *(f"x-{i}: v" for i in range(n - 4))])

    async with _gw(max_header_bytes=2048, max_headers=10) as gw:
        async def status_of(raw: bytes) -> int:
            reader, writer = await gw.connect()
            writer.write(raw)
            status, _, _ = _parse(await _until_eof(reader))
            writer.close()
            return status

        assert head_of(2048).index(b"\r\n\r\n") + 4 == 2048
        assert await status_of(head_of(2048)) == 200
        assert await status_of(head_of(2049)) == 431
        assert await status_of(fields(10)) == 200
        assert await status_of(fields(11)) == 431
        assert gw.rejected("header_bytes") == 1 and gw.rejected("header_count") == 1
        assert gw.engine.requests == 2
        assert_conserved(gw.metrics())


class _Transport:
    """Just enough of an asyncio transport for the protocol: records what it writes."""

    def __init__(self) -> None:
        self.written = b""
        self.closing = self.eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 9) if name in ("peername", "sockname") else default

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def test_a_huge_head_is_never_buffered() -> None:
    # memory stays flat: the parser is fed at most max_header_bytes of a head, however
    # much the client sends and however it is cut into reads
    counted: list[str] = []
    limits = ClientLimits(LimitsConfig(max_header_bytes=4096), counted.append)
    config = WireConfig(build_app(gw_config()), client_limits=limits, lifespan="off")
    proto = KneegateHttpProtocol(config, server_state=ServerState(), app_state={})
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    parser, fed = proto.parser, []

    class Spy:
        def feed_data(self, data: bytes) -> None:
            fed.append(len(data))
            parser.feed_data(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(parser, name)

    proto.parser = Spy()  # type: ignore[assignment]
    block = _request(headers=[f"x-{i}: {'v' * 1000}" for i in range(32 * 1024)])
    for i in range(0, len(block), 65536):  # the reads a socket would deliver
        proto.data_received(block[i:i + 65536])
    assert sum(fed) <= 4096
    assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.eof
    assert counted == ["header_bytes"]
    proto.connection_lost(None)


# --- defect 5: slow and idle clients, early 413, the connection cap ------------------


async def test_slowloris_head_is_answered_408_and_closed_within_the_timeout() -> None:
    async with _gw(**FAST) as gw:
        reader, writer = await gw.connect()
        head = _request(body=b"{}")

        async def drip() -> None:  # one byte every 50 ms: the head would take seconds
            for i in range(len(head)):
                await _send_ignoring_reset(writer, head[i:i + 1])
                await asyncio.sleep(0.05)

        dripping = asyncio.create_task(drip())
        t0 = time.monotonic()
        raw = await _until_eof(reader, bound=2.0)
        elapsed = time.monotonic() - t0
        dripping.cancel()
        writer.close()
        status, headers, body = _parse(raw)
        assert status == 408 and headers["connection"] == "close"
        assert _error_code(body) == "request_timeout"
        assert 0.25 < elapsed < 1.5
        assert gw.rejected("header_timeout") == 1
        gw.assert_untouched()


async def test_connections_that_send_nothing_are_closed_after_the_header_timeout() -> None:
    async with _gw(**FAST) as gw:
        conns = [await gw.connect() for _ in range(20)]
        for reader, _ in conns:
            assert await _until_eof(reader, bound=2.0) == b""  # closed without a word
        for _, writer in conns:
            writer.close()
        assert gw.rejected("header_timeout") == 20
        gw.assert_untouched()


async def test_slow_body_gets_408_and_a_steady_one_does_not() -> None:
    async with _gw(**FAST) as gw:
        # headers announce 100 bytes, 10 come, then nothing
        reader, writer = await gw.connect()
        writer.write(_request(body=b"x" * 100)[:-90])
        raw = await _until_eof(reader, bound=2.0)
        writer.close()
        if not FALLBACK:  # the fallback cuts a body under way without a word (wire.py)
            status, headers, body = _parse(raw)
            assert status == 408 and headers["connection"] == "close"
            assert _error_code(body) == "request_timeout"
        else:
            assert raw == b""
        assert gw.rejected("body_timeout") == 1
        gw.assert_untouched()

        # the timeout is between two reads, not for the whole body (nginx
        # client_body_timeout): a body dripping every 0.05 s for 0.5 s is fine
        reader, writer = await gw.connect()
        raw = _request(body=b'{"max_tokens": 1}   ', headers=["connection: close"])
        cut = raw.index(b"\r\n\r\n") + 4
        writer.write(raw[:cut])
        for i in range(cut, len(raw), 2):
            await asyncio.sleep(0.05)
            writer.write(raw[i:i + 2])
        status, _, _ = _parse(await _until_eof(reader, bound=3.0))
        writer.close()
        assert status == 200 and gw.engine.requests == 1
        assert gw.rejected("body_timeout") == 1
        assert_conserved(gw.metrics())


async def _drip(writer: asyncio.StreamWriter, data: bytes, every: float = 0.05) -> None:
    """Send `data` two bytes at a time, `every` seconds apart: never a pause the per-read
    bound sees, however long the whole takes."""
    for i in range(0, len(data), 2):
        await _send_ignoring_reset(writer, data[i:i + 2])
        await asyncio.sleep(every)


async def _served(gw: Gw) -> int:
    reader, writer = await gw.connect()
    writer.write(_request(body=b'{"max_tokens": 1}', headers=["connection: close"]))
    status, _, _ = _parse(await _until_eof(reader))
    writer.close()
    return status


async def test_a_body_dripped_past_the_whole_body_deadline_gets_408() -> None:
    # every pause is well under body_timeout, but the whole body takes longer than
    # body_deadline: the per-read bound alone would hold the connection for ever
    async with _gw(body_timeout=0.3, body_deadline=0.5) as gw:
        reader, writer = await gw.connect()
        raw = _request(body=b'{"max_tokens": 1, "prompt": "' + b"x" * 400 + b'"}')
        cut = raw.index(b"\r\n\r\n") + 4
        writer.write(raw[:cut])
        dripping = asyncio.create_task(_drip(writer, raw[cut:]))
        t0 = time.monotonic()
        assert await _served(gw) == 200  # another client, meanwhile: served as usual
        raw = await _until_eof(reader, bound=2.0)
        elapsed = time.monotonic() - t0
        dripping.cancel()
        writer.close()
        if not FALLBACK:  # the fallback cuts a body under way without a word (wire.py)
            status, headers, body = _parse(raw)
            assert status == 408 and headers["connection"] == "close"
            assert _error_code(body) == "request_timeout"
            assert b"within 0.5s" in body
        else:
            assert raw == b""
        assert 0.4 < elapsed < 1.5
        assert gw.rejected("body_deadline") == 1 and gw.rejected("body_timeout") == 0
        assert gw.engine.requests == 1  # only the other client's
        m = gw.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 1
        assert await _served(gw) == 200  # and after


@pytest.mark.parametrize("relay", ["send"], indirect=True)
async def test_with_the_relay_off_a_slow_body_is_still_cut_and_counted(relay: str) -> None:
    # uvicorn's request cycle is not what wire.py reads: it cannot tell whether a response
    # started, so the refusal closes the connection without an answer
    async with _gw(**FAST) as gw:
        reader, writer = await gw.connect()
        writer.write(_request(body=b"x" * 100)[:-90])
        assert await _until_eof(reader, bound=2.0) == b""
        writer.close()
        assert gw.rejected("body_timeout") == 1
        gw.assert_untouched()


async def test_idle_keepalive_connection_is_closed() -> None:
    async with _gw(**FAST) as gw:
        reader, writer = await gw.connect()
        writer.write(_request("GET", "/health"))
        with anyio.fail_after(2):
            head = await reader.readuntil(b"\r\n\r\n")
            status, headers, _ = _parse(head)
            await reader.readexactly(int(headers["content-length"]))
        assert status == 200 and "connection" not in headers  # kept alive
        t0 = time.monotonic()
        assert await _until_eof(reader, bound=2.0) == b""
        assert time.monotonic() - t0 > 0.2
        writer.close()
        assert total(gw.metrics(), "kneegate_client_rejections_total") == 0  # no refusal
        gw.assert_untouched()


async def test_huge_content_length_gets_413_before_any_body_is_read() -> None:
    async with _gw() as gw:  # default timeouts: a 413 must not wait for anything
        reader, writer = await gw.connect()
        head = _request(body=b"").replace(b"content-length: 0",
                                          b"content-length: 10000000000")
        writer.write(head + b"0123456789")
        t0 = time.monotonic()
        status, headers, body = _parse(await _until_eof(reader, bound=2.0))
        writer.close()
        assert time.monotonic() - t0 < 1.0
        assert status == 413 and headers["connection"] == "close"
        assert _error_code(body) == "body_too_large"
        assert gw.rejected("body_too_large") == 1
        gw.assert_untouched()


async def test_connection_over_the_cap_gets_a_clear_503() -> None:
    async with _gw(max_connections=3, max_connections_per_client=3) as gw:
        held = [await gw.connect() for _ in range(3)]
        reader, writer = await gw.connect()  # the fourth
        writer.write(_request(body=b'{"max_tokens": 1}'))
        status, headers, body = _parse(await _until_eof(reader, bound=2.0))
        writer.close()
        assert status == 503 and headers["connection"] == "close"
        assert headers["retry-after"] == "1"
        assert headers["x-kneegate-reject-reason"] == "connection_limit"
        assert _error_code(body) == "too_many_connections"
        # the three within the cap are served
        r0, w0 = held[0]
        w0.write(_request(body=b'{"max_tokens": 1}', headers=["connection: close"]))
        assert _parse(await _until_eof(r0))[0] == 200
        for _, w in held:
            w.close()
        assert gw.rejected("connection_limit") == 1
        assert gw.engine.requests == 1
        assert_conserved(gw.metrics())


async def test_one_address_cannot_take_every_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up, limits={"max_connections_per_client": 2}))
        server = QuietServer(uvicorn_config(app))
        async with running(server) as url:
            gw = Gw(engine, app, url)
            table = server.config.client_limits.open_by_client
            held = [await gw.connect() for _ in range(2)]
            await until(lambda: table.get("127.0.0.1") == 2)
            reader, writer = await gw.connect()  # a third from the same address
            with caplog.at_level(logging.INFO, logger="kneegate"):
                writer.write(_request(body=b'{"max_tokens": 1}'))
                status, headers, body = _parse(await _until_eof(reader, bound=2.0))
            writer.close()
            assert status == 503 and headers["connection"] == "close"
            assert headers["retry-after"] == "1"
            assert headers["x-kneegate-reject-reason"] == "client_connection_limit"
            assert _error_code(body) == "too_many_connections"
            assert b"more than 2 open connections from your address" in body
            assert any("refused: client_connection_limit" in r.getMessage()
                       for r in caplog.records)
            # another address is served meanwhile, and so are the two within the cap
            other_r, other_w = await asyncio.open_connection(
                gw.host, gw.port, local_addr=("127.0.0.2", 0))
            other_w.write(_request(body=b'{"max_tokens": 1}', headers=["connection: close"]))
            assert _parse(await _until_eof(other_r))[0] == 200
            other_w.close()
            for r, w in held:
                w.write(_request(body=b'{"max_tokens": 1}', headers=["connection: close"]))
                assert _parse(await _until_eof(r))[0] == 200
                w.close()
            await until(lambda: not table)  # no address is kept once its connections close
            assert await _served(gw) == 200  # the address may connect again
            assert gw.rejected("client_connection_limit") == 1
            assert gw.rejected("connection_limit") == 0
            assert gw.engine.requests == 4
            m = gw.metrics()
            assert_conserved(m)
            assert total(m, "kneegate_requests_received_total") == 4


def test_the_per_client_cap_defaults_to_a_quarter_of_the_connections() -> None:
    assert LimitsConfig().per_client_connections == 2500
    assert LimitsConfig(max_connections=10).per_client_connections == 2
    assert LimitsConfig(max_connections=3).per_client_connections == 1
    assert LimitsConfig(max_connections_per_client=7).per_client_connections == 7


# --- issue 44: numeric headers ------------------------------------------------------


BAD_LENGTHS = ["abc", "-1", "+2", "2.0", "0x2", "1, 1", "1 2", "", "99999999999999999999999"]


async def test_a_malformed_content_length_is_a_clear_400_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _gw() as gw:
        with caplog.at_level(logging.INFO, logger="kneegate"):
            for value in BAD_LENGTHS:
                reader, writer = await gw.connect()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n"
                             b"content-length: " + value.encode() + b"\r\n\r\n{}")
                status, headers, body = _parse(await _until_eof(reader))
                writer.close()
                assert status == 400 and headers["connection"] == "close", value
                assert headers["content-type"] == "application/json", value
                assert _error_code(body) == "malformed_request", value
                assert await _served(gw) == 200  # another client, between two of them
        assert gw.rejected("malformed_request") == len(BAD_LENGTHS)
        lines = [r.getMessage() for r in caplog.records if "malformed_request" in r.getMessage()]
        assert lines and "abc" not in lines[0]  # the reason, never the client's text
        assert gw.engine.requests == len(BAD_LENGTHS)  # the other client's only
        m = gw.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == len(BAD_LENGTHS)


@pytest.mark.parametrize("value", [
    "nan", "inf", "-inf", "-5", "0", "0.0", "abc", "1e308", "1e-300", "1_000", "+5", "0x10",
    "5ms", "3600001", "99999999999", "1.5.5", "",
])
async def test_a_ttft_objective_that_is_not_plain_bounded_milliseconds_is_a_400(
    value: str,
) -> None:
    async with _gw() as gw:
        reader, writer = await gw.connect()
        writer.write(_request(body=b'{"max_tokens": 1}',
                              headers=[f"x-kneegate-ttft-ms: {value}", "connection: close"]))
        status, _, body = _parse(await _until_eof(reader))
        writer.close()
        assert status == 400
        err = json.loads(body)["error"]
        assert (err["code"], err["param"]) == ("invalid_header", "x-kneegate-ttft-ms")
        assert await _served(gw) == 200  # another client: served as usual
        assert gw.rejected("invalid_header") == 1
        assert gw.engine.requests == 1
        m = gw.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 1


async def test_a_ttft_objective_within_bounds_is_taken_and_clamped_to_its_class() -> None:
    async with _gw() as gw:
        for value in ("3600000", "1500", "1000.25", " 60000 "):  # an hour: the class's 2 s applies
            reader, writer = await gw.connect()
            writer.write(_request(body=b'{"max_tokens": 1}', headers=[
                f"x-kneegate-ttft-ms: {value}", "connection: close"]))
            assert _parse(await _until_eof(reader))[0] == 200, value
            writer.close()
        assert total(gw.metrics(), "kneegate_client_rejections_total") == 0


# --- issue 44: requests to switch protocols --------------------------------------------


UPGRADES = {
    "websocket": ("GET", "/v1/realtime", ["upgrade: websocket", "connection: Upgrade",
                                          "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==",
                                          "sec-websocket-version: 13"], b""),
    "h2c": ("GET", "/v1/models", ["upgrade: h2c", "connection: Upgrade, HTTP2-Settings",
                                  "http2-settings: AAMAAABkAARAAAAAAAIAAAAA"], b""),
    "post-with-body": ("POST", "/v1/completions", ["upgrade: foo", "connection: upgrade"],
                       b'{"max_tokens": 1}'),
    "to-an-own-endpoint": ("GET", "/metrics", ["upgrade: websocket", "connection: upgrade"],
                           b""),
}


@pytest.mark.parametrize("form", list(UPGRADES))
async def test_a_request_to_switch_protocols_is_refused_and_never_proxied(
    relay: str, form: str,
) -> None:
    method, path, head, body = UPGRADES[form]
    engine = FakeEngine(interval=0.05)
    async with _gw(engine) as gw:
        # a stream of another client's runs throughout
        other_r, other_w = await gw.connect()
        other_w.write(_request(body=b'{"max_tokens": 8, "stream": true}',
                               headers=["connection: close"]))
        with anyio.fail_after(5):
            await engine.started.wait()
        reader, writer = await gw.connect()
        writer.write(_request(method, path, body=body, headers=head))
        status, headers, answer = _parse(await _until_eof(reader))
        writer.close()
        assert status == 400 and headers["connection"] == "close"
        assert _error_code(answer) == "upgrade_not_supported"
        m = gw.metrics()
        assert total(m, "kneegate_in_flight") == 1  # the other client's only: no slot held
        assert gw.rejected("upgrade") == 1
        status, _, streamed = _parse(await _until_eof(other_r))
        other_w.close()
        assert status == 200 and b"data: [DONE]" in streamed  # unchanged
        assert engine.requests == 1
        m = gw.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 1


async def test_an_upgrade_header_without_connection_upgrade_is_served_and_not_forwarded(
) -> None:
    async with _gw() as gw:
        reader, writer = await gw.connect()
        writer.write(_request(body=b'{"max_tokens": 1}',
                              headers=["upgrade: websocket", "connection: close"]))
        assert _parse(await _until_eof(reader))[0] == 200
        writer.close()
        assert "upgrade" not in gw.engine.last_headers
        assert gw.rejected("upgrade") == 0


# --- defect 11: HTTP/1.0 clients get close-delimited bodies --------------------------


@pytest.mark.skipif(FALLBACK, reason="the fallback leaves HTTP/1.0 to uvicorn's framing")
async def test_http10_client_gets_a_close_delimited_stream() -> None:
    engine = FakeEngine(interval=0.002)
    async with _gw(engine) as gw:
        req = json.dumps({"max_tokens": 5, "stream": True}).encode()
        reader, writer = await gw.connect()
        writer.write(_request(body=req, version="1.0"))
        status, headers, body = _parse(await _until_eof(reader))  # the close ends it
        writer.close()
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert "transfer-encoding" not in headers and headers["connection"] == "close"
        events = [e for e in body.split(b"\n\n") if e]
        assert events[0].startswith(b"data: {") and events[-1] == b"data: [DONE]"
        assert len(events) == 5 + 2  # five tokens, usage, [DONE]: no chunk sizes between

        # a non-streamed answer without Content-Length: the same; one with it: unchanged
        for req, framed in ((_request(body=b'{"max_tokens": 2}', version="1.0"), False),
                            (_request("GET", "/health", version="1.0"), True)):
            reader, writer = await gw.connect()
            writer.write(req)
            status, headers, body = _parse(await _until_eof(reader))
            writer.close()
            assert status == 200 and "transfer-encoding" not in headers
            assert ("content-length" in headers) is framed
            assert json.loads(body)  # no chunk sizes around it
        m = gw.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_finished_total", outcome="completed") == 2


def test_every_refusal_is_counted_and_logged_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []
    limits = ClientLimits(LimitsConfig(), counted.append)
    with caplog.at_level(logging.INFO, logger="kneegate"):
        for i in range(5):
            limits.refused("header_bytes", "10.0.0.1:5", now=100.0 + i)
        limits.refused("header_bytes", "10.0.0.1:5", now=111.0)
    assert counted == ["header_bytes"] * 6
    assert [r.getMessage() for r in caplog.records] == [
        "client 10.0.0.1:5 refused: header_bytes",
        "client 10.0.0.1:5 refused: header_bytes (4 more since the last line)"]


def test_limits_change_only_with_a_restart() -> None:
    # the server's connections read them at start-up: a reload keeps the running ones
    app = build_app(gw_config("http://127.0.0.1:9"))
    app.gateway.apply(gw_config("http://127.0.0.1:9", limits={"max_headers": 7}))
    assert app.gateway.config.limits == LimitsConfig()
