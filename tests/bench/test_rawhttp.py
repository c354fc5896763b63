"""The overhead benchmark's closed-loop client: a staggered start spreads the workers.

Workers started together stay in lock-step when every stream takes the same time, and the
benchmark then counts waves instead of measuring a rate (see `rawhttp.run_load`). Real
sockets on 127.0.0.1, the real upstream; each run is bounded by its seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import pytest

from kneegate_bench.rawhttp import LoadResult, cpu_seconds, run_load, serve

WORKERS = 8


async def _load(stagger: float) -> tuple[float, int]:
    server = await serve("127.0.0.1", 0, events=2, interval=0.05)
    port = server.sockets[0].getsockname()[1]
    async with server:
        r = await run_load(f"http://127.0.0.1:{port}/v1/completions", WORKERS, seconds=0.5,
                           warmup=0.5, stagger=stagger)
    assert len(r.first_sent) == WORKERS
    return max(r.first_sent) - min(r.first_sent), r.ok


@pytest.mark.anyio
async def test_staggered_workers_send_their_first_requests_over_the_stagger() -> None:
    spread, ok = await _load(stagger=0.4)
    # worker i starts at i/8 of 0.4 s: the last one 0.35 s after the first
    assert 0.3 <= spread < 0.6
    assert ok > 0


@pytest.mark.anyio
async def test_unstaggered_workers_start_together() -> None:
    spread, ok = await _load(stagger=0.0)
    assert spread < 0.2
    assert ok > 0


@pytest.mark.anyio
async def test_the_window_reports_the_measured_process_cpu_per_request() -> None:
    # this process is the upstream and the client: its CPU is what the window reads
    server = await serve("127.0.0.1", 0, events=2, interval=0.0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        r = await run_load(f"http://127.0.0.1:{port}/v1/completions", WORKERS, seconds=0.5,
                           warmup=0.2, cpu_pid=os.getpid())
    assert r.cpu is not None and r.cpu > 0  # a busy closed loop on loopback for 0.5 s
    assert r.ok > 0
    assert r.cpu_per(r.ok) == pytest.approx(r.cpu / r.ok * 1e6)


def test_no_cpu_pid_means_no_cpu_figures() -> None:
    r = LoadResult(seconds=1.0, ok=10, events=100)
    assert math.isnan(r.cpu_per(r.ok))


def test_cpu_seconds_counts_this_process_burning_cpu() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.monotonic() + 5
    while cpu_seconds(os.getpid()) - before < 0.05 and time.monotonic() < deadline:
        sum(range(10_000))
    assert cpu_seconds(os.getpid()) - before >= 0.05


@pytest.mark.anyio
async def test_tokenize_is_answered_at_once_as_vllm_does_and_render_is_not_found() -> None:
    """A gateway that asks the engine for token ids before routing (vllm-router) gets them
    at once, not after the events a completion streams."""
    server = await serve("127.0.0.1", 0, events=64, interval=0.05)  # a completion: 3.2 s
    port = server.sockets[0].getsockname()[1]
    async with server:
        answers = []
        for path in ("/tokenize", "/v1/chat/completions/render"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"model":"bench","prompt":"hi"}'
            writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                         % (path.encode(), len(body), body))
            t0 = time.monotonic()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1.0)
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            answers.append((head.split(b" ")[1], await reader.readexactly(length),
                            time.monotonic() - t0))
            writer.close()
    (ok, tokens, t_tok), (missing, _, _) = answers
    assert ok == b"200" and missing == b"404" and t_tok < 1.0
    parsed = json.loads(tokens)
    assert parsed["count"] == len(parsed["tokens"]) > 0
