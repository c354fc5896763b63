"""Logs: one access line per request from a real served gateway (fields, JSON shape, no key or
prompt; an engine's 4xx not `ok`; a stream's tokens as the engine's own count), `--no-access-log`,
and `kneegate serve` as a user runs it: every line one JSON object, uvicorn's start-up lines
once, a normal start at INFO, an engine that does not answer at start said so."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gateway import FakeEngine, gw_config, serve

from kneegate.gateway.access import AccessLog
from kneegate.gateway.app import build_app
from kneegate.gateway.observability.logs import JsonFormatter
from kneegate.gateway.request_size import read_request

KEY = "sk-very-secret-key-0042"
PROMPT = "the user's private prompt text"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """Every record, formatted as `--log-format json` formats it, into a string."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def _access(stream: io.StringIO) -> list[dict[str, Any]]:
    return [r for r in _lines(stream) if r["logger"] == "kneegate.access"]


async def _until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


@pytest.mark.anyio
async def test_one_access_line_per_request_with_its_fields(json_log: io.StringIO) -> None:
    engine = FakeEngine()
    async with contextlib.AsyncExitStack() as stack:
        up = await stack.enter_async_context(serve(engine))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        gw = await stack.enter_async_context(serve(build_app(gw_config(up, limit=1,
                                                                       max_queue=0))))
        secret = {"authorization": f"Bearer {KEY}", "x-request-id": "r-1"}
        r = await client.post(gw + "/v1/completions", headers=secret,
                              json={"prompt": PROMPT, "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        r = await client.post(gw + "/v1/completions", headers={"x-request-id": "r-2"},
                              json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200

        # hold the only slot with a slow answer, and be refused behind it
        engine.first_delay = 30
        held = asyncio.create_task(client.post(
            gw + "/v1/completions", headers={"x-request-id": "r-3"},
            json={"prompt": PROMPT, "max_tokens": 2}))
        await _until(lambda: engine.running == 1, "the slot held")
        r = await client.post(gw + "/v1/completions", headers={"x-request-id": "r-4"},
                              json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429
        reason = r.headers["x-kneegate-reject-reason"]
        held.cancel()  # the client leaves: the gateway cancels the engine's request
        await _until(lambda: len(_access(json_log)) == 4, "four access lines")

    text = json_log.getvalue()
    assert KEY not in text and PROMPT not in text and "Bearer" not in text
    lines = {a["request_id"]: a for a in _access(json_log)}
    assert set(lines) == {"r-1", "r-2", "r-3", "r-4"}
    for a in lines.values():
        assert {"time", "level", "logger", "message"} <= set(a)
        assert a["level"] == "INFO" and a["message"] == "access"
        assert a["class"] == "default"
    streamed = lines["r-1"]
    # the keyed request's tenant by its hash (the key itself is checked absent above)
    assert streamed["tenant"].startswith("key-") and len(streamed["tenant"]) == 16
    assert {lines[r]["tenant"] for r in ("r-2", "r-3", "r-4")} == {"anonymous"}
    assert streamed["upstream"] == "e0" and streamed["outcome"] == "ok"
    assert streamed["status"] == 200
    assert streamed["prompt_tokens"] == 3 and streamed["output_tokens"] == 3
    assert 0 <= streamed["queue_wait"] <= streamed["ttft"] <= streamed["duration"]
    whole = lines["r-2"]
    assert whole["outcome"] == "ok" and whole["ttft"] is None and whole["output_tokens"] == 2
    assert lines["r-3"]["outcome"] == "client_cancelled" and lines["r-3"]["upstream"] == "e0"
    refused = lines["r-4"]
    assert refused["outcome"] == reason and refused["status"] == 429
    assert refused["upstream"] is None and refused["retry_after"] >= 1


@pytest.mark.anyio
async def test_no_access_log_when_turned_off(json_log: io.StringIO) -> None:
    async with serve(FakeEngine()) as up, httpx.AsyncClient(timeout=10) as client:
        cfg = gw_config(up, server={"access_log": False})
        async with serve(build_app(cfg)) as gw:
            r = await client.post(gw + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
            r = await client.post(gw + "/v1/completions", json={},
                                  headers={"x-kneegate-ttft-ms": "soon"})
            assert r.status_code == 400
    assert _access(json_log) == []


def test_text_lines_quote_what_the_client_chose(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kneegate.access")
    AccessLog(time.monotonic)._write({"request_id": 'a b" x=1', "upstream": None, "status": 400})
    (record,) = caplog.records
    assert record.getMessage() == 'request_id="a b\\" x=1" upstream=- status=400'


def test_nothing_is_made_when_the_logger_is_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kneegate.access")
    assert not AccessLog(time.monotonic).on()
    assert not AccessLog(time.monotonic, enabled=False).on()


# --- `kneegate serve` as a user runs it ---------------------------------------------------

class Lines:
    """A child's stderr, line by line, each wait bounded."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        self.proc, self._buf = proc, b""
        self.seen: list[str] = []
        self._sel = selectors.DefaultSelector()
        self._sel.register(proc.stderr, selectors.EVENT_READ)

    def until(self, needle: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if needle in line:
                    return str(line)
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {needle!r} in:\n" + "\n".join(self.seen))

    def _read(self, timeout: float) -> bool:
        if not self._sel.select(timeout):
            return True  # nothing yet: the deadline decides
        assert self.proc.stderr is not None
        chunk = os.read(self.proc.stderr.fileno(), 65536)
        if not chunk:
            return False
        self._buf += chunk
        *done, self._buf = self._buf.split(b"\n")
        self.seen += [d.decode() for d in done]
        return True

    def rest(self, timeout: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(deadline - time.monotonic()):
            pass
        return self.seen


def test_serve_logs_json_once_per_line_and_no_secret(tmp_path: Path) -> None:
    # no upstream: the embedded emulator, whose uvicorn logs through the same loggers
    with subprocess.Popen(
        [sys.executable, "-m", "kneegate", "serve", "--port", "0", "--log-format", "json"],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
    ) as proc:
        out = Lines(proc)
        try:
            listening = json.loads(out.until("kneegate listening on"))["message"]
            url = listening.split()[3]
            out.until("Application startup complete")
            r = httpx.post(url + "/v1/completions", timeout=10,
                           headers={"authorization": f"Bearer {KEY}", "x-request-id": "cli-1"},
                           json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
            assert r.status_code == 200
            # a chat stream as the openai client sends it: no usage asked for
            r = httpx.post(url + "/v1/chat/completions", timeout=10,
                           headers={"x-request-id": "cli-2"},
                           json={"model": "cpu-tiny", "max_tokens": 16, "stream": True,
                                 "messages": [{"role": "user", "content": PROMPT}]})
            assert r.status_code == 200 and r.text.count("data:") == 18  # role, 16, [DONE]
            out.until('"request_id": "cli-2"')
        finally:
            proc.send_signal(signal.SIGINT)
            lines = out.rest()
            assert proc.wait(20) == 0
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    messages = [r["message"] for r in records]
    for startup in ("Started server process", "Waiting for application startup.",
                    "Application startup complete."):
        assert sum(m.startswith(startup) for m in messages) == 1, (startup, messages)
    assert any(r["logger"] == "uvicorn.error" for r in records)
    # a normal start is news, not a warning; addresses as URLs, never a Python tuple
    assert [r["message"] for r in records if r["level"] != "INFO"] == []
    (emulator,) = [m for m in messages if m.startswith("no upstream configured")]
    assert re.search(r"\(cpu-tiny\) on http://127\.0\.0\.1:\d+$", emulator), emulator
    assert not any(re.search(r"\('[\d.]+', \d+\)", m) for m in messages), messages
    access = {r["request_id"]: r for r in records if r["logger"] == "kneegate.access"}
    assert access["cli-1"]["upstream"] == "embedded" and access["cli-1"]["output_tokens"] == 4
    chat = access["cli-2"]
    assert chat["outcome"] == "ok" and chat["output_tokens"] == 16  # the role event is no token
    assert chat["prompt_tokens"] > 0  # the stream carries no usage: the prompt as sized
    text = "\n".join(lines)
    assert KEY not in text and PROMPT not in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_serve_says_when_its_engine_does_not_answer_at_start() -> None:
    engine = f"http://127.0.0.1:{_closed_port()}"
    with subprocess.Popen(
        [sys.executable, "-m", "kneegate", "serve", "--port", "0", "--upstream", engine],
        cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
    ) as proc:
        out = Lines(proc)
        try:
            listening = out.until("kneegate listening on")
            assert " INFO kneegate listening on http://127.0.0.1:" in listening
            url = listening.split(" on ")[1].split()[0]
            line = out.until("does not answer yet")
            assert f" WARNING upstream upstream0 ({engine}) does not answer yet (cannot " \
                   f"connect to upstream {engine[7:]}: Connection refused): kneegate " \
                   "serves, but /ready answers 503 until an upstream does" in line
            deadline = time.monotonic() + 20
            while True:  # the port accepts once the start-up probes are done
                assert time.monotonic() < deadline, "not accepting within 20 s"
                try:
                    ready = httpx.get(url + "/ready", timeout=5)
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            assert ready.status_code == 503
        finally:
            proc.send_signal(signal.SIGINT)
            lines = out.rest()
            assert proc.wait(20) == 0
    assert not any("Traceback" in x for x in lines), lines


@pytest.mark.anyio
async def test_access_lines_through_the_emulator(json_log: io.StringIO) -> None:
    engine_server = pytest.importorskip("kneegate.emulator.server")
    chat = {"model": "cpu-tiny", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    completion = {"model": "cpu-tiny", "max_tokens": 16, "stream": True, "prompt": PROMPT}
    async with contextlib.AsyncExitStack() as stack:
        up = await stack.enter_async_context(serve(engine_server.build_app("cpu-tiny")))
        gw = await stack.enter_async_context(serve(build_app(gw_config(up))))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        for rid, path, body in (("chat", "/v1/chat/completions", chat),
                                ("text", "/v1/completions", completion),
                                ("usage", "/v1/completions",
                                 {**completion, "stream_options": {"include_usage": True}})):
            r = await client.post(gw + path, json=body, headers={"x-request-id": rid})
            assert r.status_code == 200
        r = await client.get(gw + "/v1/no-such-thing", headers={"x-request-id": "404"})
        assert r.status_code == 404
        await _until(lambda: len(_access(json_log)) == 4, "four access lines")
    lines = {a["request_id"]: a for a in _access(json_log)}
    for rid in ("chat", "text", "usage"):
        assert (lines[rid]["outcome"], lines[rid]["output_tokens"]) == ("ok", 16), rid
    # no usage in the stream: the prompt as admission read it from the content
    for rid, path, body in (("chat", b"/v1/chat/completions", chat),
                            ("text", b"/v1/completions", completion)):
        sized = read_request("POST", path, json.dumps(body).encode()).prompt
        assert lines[rid]["prompt_tokens"] == sized > 0
    assert (lines["404"]["outcome"], lines["404"]["status"]) == ("client_error", 404)
