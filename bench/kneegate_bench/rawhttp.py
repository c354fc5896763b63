"""Lean raw-asyncio HTTP/1.1 peers for the overhead benchmark: an SSE upstream and a client.

Both are deliberately minimal (keep-alive HTTP/1.1, chunked SSE, pre-encoded bytes, one
protocol object per connection, no per-event allocation beyond the write) so that the thing
measured in `kneegate_bench.overhead` is the proxy between them, not its peers. They speak
only what the benchmark needs and are not general HTTP implementations.

    python -m kneegate_bench.rawhttp serve --port 9000 --events 64 --interval 0.02
    python -m kneegate_bench.rawhttp load --url http://127.0.0.1:9000/v1/completions \
        --concurrency 256 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["LoadResult", "SseUpstream", "cpu_seconds", "event_payload", "run_load", "serve"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_END = b"0\r\n\r\n"
# vLLM's POST /tokenize answer, at once, for a gateway that asks the engine for token ids
# before it routes (vllm-router's cache-aware policy asks every engine, within a 1 s budget;
# answered like a completion, 64 events 20 ms apart, the router waited out that budget)
_TOKENS = json.dumps({"count": 16, "max_model_len": 2048, "tokens": list(range(100, 116)),
                      "token_strs": None}, separators=(",", ":")).encode()
_TOKENIZE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
             % (len(_TOKENS), _TOKENS))
_NOT_FOUND = (b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
              b"content-length: 22\r\n\r\n{\"detail\":\"Not Found\"}")


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def event_payload(i: int) -> bytes:
    """The i-th SSE event the upstream sends, before HTTP's chunked framing."""
    body = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": "bench",
        "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _event(i: int) -> bytes:
    return _chunk(event_payload(i))


class SseUpstream(asyncio.Protocol):
    """Answers every request with `events` SSE events, `interval` seconds apart, but
    `POST /tokenize` (vLLM's JSON, 16 token ids) and `.../render` (404) at once."""

    def __init__(self, events: list[bytes], interval: float) -> None:
        self.events = events
        self.interval = interval
        self.whole = _HEAD + b"".join(events) + _chunk(b"data: [DONE]\n\n") + _END
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = _content_length(self.buf[:end])
            if len(self.buf) < end + 4 + length:
                return
            line = self.buf[: self.buf.find(b"\r\n")]
            self.buf = self.buf[end + 4 + length :]
            self._respond(line)

    def _respond(self, line: bytes) -> None:
        assert self.transport is not None
        path = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
        if path == b"/tokenize":
            self.transport.write(_TOKENIZE)
            return
        if path.endswith(b"/render"):  # not a vLLM 0.32 route; vllm-router then asks /tokenize
            self.transport.write(_NOT_FOUND)
            return
        if self.interval <= 0:
            self.transport.write(self.whole)
            return
        self.transport.write(_HEAD)
        self.loop.call_later(self.interval, self._send, 0)

    def _send(self, i: int) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if i < len(self.events):
            t.write(self.events[i])
            self.loop.call_later(self.interval, self._send, i + 1)
        else:
            t.write(_chunk(b"data: [DONE]\n\n") + _END)


def _content_length(head: bytes) -> int:
    low = head.lower()
    i = low.find(b"content-length:")
    if i < 0:
        return 0
    j = low.find(b"\r\n", i)
    return int(low[i + 15 : j if j >= 0 else None].strip())


async def serve(host: str, port: int, events: int, interval: float) -> asyncio.Server:
    """Start the upstream; returns the listening server."""
    evs = [_event(i) for i in range(events)]
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: SseUpstream(evs, interval), host, port, backlog=4096, reuse_address=True
    )


def cpu_seconds(pid: int) -> float:
    """User+system CPU of `pid` and its children (uvicorn workers), from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@dataclass
class LoadResult:
    seconds: float
    ok: int = 0
    errors: int = 0
    events: int = 0
    ttfts: list[float] = field(default_factory=list)
    first_sent: list[float] = field(default_factory=list)  # each worker's first request
    # CPU seconds the measured process (`cpu_pid`) spent inside the window; None: not asked
    cpu: float | None = None

    @property
    def rps(self) -> float:
        return self.ok / self.seconds

    @property
    def eps(self) -> float:
        return self.events / self.seconds

    def cpu_per(self, count: int) -> float:
        """Microseconds of the measured process's CPU per one of `count` (in the window)."""
        if self.cpu is None or count <= 0:
            return float("nan")
        return self.cpu / count * 1e6

    def ttft_pct(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        if len(self.ttfts) < 2:
            return self.ttfts[0]
        return statistics.quantiles(self.ttfts, n=100, method="inclusive")[int(q) - 1]


class _Client(asyncio.Protocol):
    """One keep-alive connection running requests back to back (a closed-loop worker)."""

    def __init__(self, request: bytes, result: LoadResult, window: tuple[float, float],
                 done: asyncio.Future[None], delay: float = 0.0) -> None:
        self.request, self.result, self.window, self.done = request, result, window, done
        self.delay = delay  # before the first request (staggered start)
        self.first = True
        self.transport: asyncio.Transport | None = None
        self._reset()

    def _reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.length: int | None = None  # content-length body; None means chunked
        self.got = 0
        self.tail = b""
        self.events = 0
        self.status = 0
        self.sent_at = 0.0
        self.first_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.delay > 0:
            asyncio.get_running_loop().call_later(self.delay, self._send)
        else:
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _send(self) -> None:
        assert self.transport is not None
        if time.perf_counter() >= self.window[1]:
            self.transport.close()
            return
        self._reset()
        self.sent_at = time.perf_counter()
        if self.first:
            self.first = False
            self.result.first_sent.append(self.sent_at)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4 :]
            self.status = int(head[9:12])
            self.in_body = True
            if b"chunked" not in head.lower():
                self.length = _content_length(head)
        self._body(data)

    def _body(self, data: bytes) -> None:
        now = time.perf_counter()
        n = (self.tail + data).count(b"data: ")
        if n and self.first_at is None:
            self.first_at = now
        self.events += n
        self.got += len(data)
        joined = self.tail + data
        self.tail = joined[-8:]
        finished = self.got >= self.length if self.length is not None else joined.endswith(_END)
        if finished:
            self._finish(now)

    def _finish(self, now: float) -> None:
        r = self.result
        if self.window[0] <= now <= self.window[1]:  # throughput: completions in the window
            if self.status == 200:
                r.ok += 1
                r.events += max(0, self.events - 1)  # the [DONE] line is not a token
                # latency: only requests sent inside the window, so the warm-up wave (which
                # also pays for opening the proxy's upstream connections) is not a sample
                if self.first_at is not None and self.sent_at >= self.window[0]:
                    r.ttfts.append(self.first_at - self.sent_at)
            else:
                r.errors += 1
        self._send()


async def run_load(url: str, concurrency: int, seconds: float, warmup: float = 1.0,
                   max_tokens: int = 64, stagger: float = 0.0,
                   cpu_pid: int | None = None) -> LoadResult:
    """Closed loop: `concurrency` connections, each request after the last, for `seconds`.

    `stagger`: worker i sends its first request i/concurrency of `stagger` seconds after
    connecting. Set it to about one request's duration: workers that all start together
    stay in lock-step (every request takes the same time), so completions come in waves
    and the count inside the window depends on how many waves it holds (a 6 s window and
    1.3 s streams: exactly 5 waves, 853.3 req/s at 1024, wherever the true rate is); spread
    over a cycle, they complete at an even rate and the window measures it. Keep `warmup`
    above one request's duration so the window opens on that even rate.

    `cpu_pid`: the process under test (the proxy); its CPU seconds are read from /proc when
    the window opens and when it closes, so `cpu` covers the same span as the counts (not
    the warm-up, the connects or the tail).
    """
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    body = json.dumps({"model": "bench", "prompt": "hi", "max_tokens": max_tokens,
                       "stream": True}).encode()
    request = (
        f"POST {u.path} HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)
    result = LoadResult(seconds=seconds)
    if cpu_pid is not None:
        _sample_cpu(loop, cpu_pid, window, result)
    dones: list[asyncio.Future[None]] = []
    for i in range(concurrency):
        done: asyncio.Future[None] = loop.create_future()
        dones.append(done)
        delay = stagger * i / concurrency
        await loop.create_connection(
            lambda d=done, w=delay: _Client(request, result, window, d, w),  # type: ignore[misc]
            host, port,
        )
    # every worker stops by itself at the window's end; the extra margin bounds a hung one
    await asyncio.wait(dones, timeout=warmup + seconds + 30)
    return result


def _sample_cpu(loop: asyncio.AbstractEventLoop, pid: int, window: tuple[float, float],
                result: LoadResult) -> None:
    opened: list[float] = []

    def close() -> None:
        if opened:
            result.cpu = cpu_seconds(pid) - opened[0]

    def open_() -> None:
        opened.append(cpu_seconds(pid))
        loop.call_later(max(0.0, window[1] - time.perf_counter()), close)

    loop.call_later(max(0.0, window[0] - time.perf_counter()), open_)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kneegate_bench.rawhttp")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--events", type=int, default=64)
    s.add_argument("--interval", type=float, default=0.02)
    s.add_argument("--seconds", type=float, default=3600, help="exit after this long")
    ld = sub.add_parser("load")
    ld.add_argument("--url", required=True)
    ld.add_argument("--concurrency", type=int, default=16)
    ld.add_argument("--seconds", type=float, default=10)
    ld.add_argument("--warmup", type=float, default=1.0)
    ld.add_argument("--stagger", type=float, default=0.0,
                    help="spread the workers' first requests over this many seconds")
    ld.add_argument("--cpu-pid", type=int,
                    help="report this process's CPU per request and per event in the window")
    args = p.parse_args(argv)
    _use_uvloop()
    if args.cmd == "serve":
        asyncio.run(_serve_for(args))
    else:
        r = asyncio.run(run_load(args.url, args.concurrency, args.seconds, args.warmup,
                                 stagger=args.stagger, cpu_pid=args.cpu_pid))
        out = {"rps": r.rps, "eps": r.eps, "ok": r.ok, "errors": r.errors,
               "ttft_p50": r.ttft_pct(50), "ttft_p99": r.ttft_pct(99),
               "cpu_s": r.cpu, "cpu_us_per_request": r.cpu_per(r.ok + r.errors),
               "cpu_us_per_event": r.cpu_per(r.events)}
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")


async def _serve_for(args: argparse.Namespace) -> None:
    server = await serve(args.host, args.port, args.events, args.interval)
    async with server:
        await asyncio.sleep(args.seconds)


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


if __name__ == "__main__":
    main()
