"""Load generator for OpenAI-compatible servers: closed loop, Poisson open loop, trace replay.

    python -m kneegate_bench.loadgen --url http://127.0.0.1:8000 --concurrency 32 \
        --max-seconds 30 --max-requests 10000 --out run.json
    python -m kneegate_bench.loadgen --url ... --rate 20          # Poisson arrivals, 20 req/s
    python -m kneegate_bench.loadgen --url ... --trace trace.jsonl  # {"t": s, "max_tokens": n}

Per request: TTFT (streaming only), TPOT = (e2e - ttft) / (tokens - 1), end-to-end time,
output tokens, outcome ("ok", "http_<status>", "transport_error", "timeout", "cancelled" for
requests still in flight when the run's time ran out). Every run stops at `max_requests` or
`max_seconds`, whichever comes first. Prompts are sent as token-id lists by default, so the
prompt length is exact on vLLM and on the emulator alike. One aiohttp session with an
unlimited connector carries everything; SSE is parsed by line without JSON per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["LoadConfig", "LoadResult", "RequestRecord", "closed_loop", "open_loop", "run_trace"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first id of GET /v1/models
    prompt_tokens: int = 128
    max_tokens: int = 64
    stream: bool = True
    chat: bool = False
    ignore_eos: bool = True
    max_requests: int = 10_000
    max_seconds: float = 30.0
    warmup: float = 0.0  # seconds at the start excluded from throughput and latency figures
    request_timeout: float = 600.0
    text_prompt: bool = False  # send "x x x ..." instead of token ids


@dataclass(slots=True)
class RequestRecord:
    start: float  # seconds since the run began
    outcome: str = "cancelled"
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class LoadResult:
    mode: str
    level: float  # concurrency or rate
    duration: float
    measured_seconds: float
    output_tokens: int  # tokens received after the warm-up
    records: list[RequestRecord] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        measured = [r for r in self.records if r.outcome == "ok"]
        outcomes: dict[str, int] = {}
        for r in self.records:
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        ttft = [r.ttft for r in measured if r.ttft is not None]
        tpot = [t for r in measured if (t := r.tpot) is not None]
        e2e = [r.e2e for r in measured if r.e2e is not None]
        return {
            "mode": self.mode,
            "level": self.level,
            "duration_s": round(self.duration, 3),
            "requests": len(self.records),
            "outcomes": outcomes,
            "output_tokens": self.output_tokens,
            "throughput_tok_s": self.output_tokens / max(self.measured_seconds, 1e-9),
            "requests_per_s": len(measured) / max(self.measured_seconds, 1e-9),
            **_pcts("ttft", ttft),
            **_pcts("tpot", tpot),
            **_pcts("e2e", e2e),
        }

    def to_json(self) -> dict[str, Any]:
        records = [{**asdict(r), "tpot": r.tpot} for r in self.records]
        return {"summary": self.summary(), "records": records}


def _pcts(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p50": None, f"{name}_p90": None, f"{name}_p99": None}
    if len(values) == 1:
        return {f"{name}_p{q}": values[0] for q in (50, 90, 99)}
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {f"{name}_p50": qs[49], f"{name}_p90": qs[89], f"{name}_p99": qs[98]}


class _Run:
    """State shared by the workers of one run: session, clock, counters, bounds."""

    def __init__(self, cfg: LoadConfig, session: aiohttp.ClientSession, model: str) -> None:
        self.cfg, self.session, self.model = cfg, session, model
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.max_seconds
        self.measure_from = self.t0 + cfg.warmup
        self.records: list[RequestRecord] = []
        self.tokens = 0  # received after the warm-up
        self.inflight = 0
        path = "/v1/chat/completions" if cfg.chat else "/v1/completions"
        self.endpoint = cfg.url.rstrip("/") + path

    def may_start(self) -> bool:
        return len(self.records) < self.cfg.max_requests and time.monotonic() < self.deadline

    def body(self, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": cfg.stream,
            "ignore_eos": cfg.ignore_eos,
        }
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if cfg.chat:
            body["messages"] = [{"role": "user", "content": "x" * (4 * max(prompt_tokens - 9, 1))}]
        elif cfg.text_prompt:
            body["prompt"] = "x" * (4 * prompt_tokens)
        else:
            body["prompt"] = [100 + i % 1000 for i in range(prompt_tokens)]
        return body

    async def one(self, prompt_tokens: int | None = None, max_tokens: int | None = None) -> None:
        rec = RequestRecord(start=time.monotonic() - self.t0)
        self.records.append(rec)
        self.inflight += 1
        body = self.body(prompt_tokens or self.cfg.prompt_tokens, max_tokens or self.cfg.max_tokens)
        try:
            await asyncio.wait_for(self._send(rec, body), self.cfg.request_timeout)
        except TimeoutError:
            rec.outcome = "timeout"
        except (aiohttp.ClientError, OSError, ValueError):
            rec.outcome = "transport_error"
        finally:
            self.inflight -= 1

    async def _send(self, rec: RequestRecord, body: dict[str, Any]) -> None:
        sent = time.monotonic()
        async with self.session.post(self.endpoint, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                rec.outcome = f"http_{resp.status}"
                return
            if self.cfg.stream:
                await self._read_stream(rec, resp, sent)
            else:
                data = await resp.json()
                rec.output_tokens = int(data["usage"]["completion_tokens"])
                self._count(rec.output_tokens)
        rec.e2e = time.monotonic() - sent
        rec.outcome = "ok"

    async def _read_stream(
        self, rec: RequestRecord, resp: aiohttp.ClientResponse, sent: float
    ) -> None:
        usage: int | None = None
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            if b'"usage":{' in line:
                usage = int(json.loads(line[6:])["usage"]["completion_tokens"])
            elif b'"choices":[{' in line and b'"role"' not in line:
                if rec.ttft is None:
                    rec.ttft = time.monotonic() - sent
                rec.output_tokens += 1
                self._count(1)
        if usage is not None and usage != rec.output_tokens:
            self._count(usage - rec.output_tokens)
            rec.output_tokens = usage

    def _count(self, n: int) -> None:
        if time.monotonic() >= self.measure_from:
            self.tokens += n

    def result(self, mode: str, level: float) -> LoadResult:
        end = min(time.monotonic(), self.deadline)
        records = [r for r in self.records if self.t0 + r.start >= self.measure_from]
        return LoadResult(
            mode, level, end - self.t0, max(end - self.measure_from, 1e-9), self.tokens, records
        )


async def _with_run(
    cfg: LoadConfig, body: Callable[[_Run], Coroutine[Any, Any, None]], mode: str, level: float
) -> LoadResult:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        model = cfg.model or await _first_model(session, cfg.url)
        run = _Run(cfg, session, model)
        progress = asyncio.create_task(_progress(run)) if sys.stderr.isatty() else None
        task = asyncio.create_task(body(run))
        try:
            await asyncio.wait_for(asyncio.shield(task), max(cfg.max_seconds, 0.001))
        except TimeoutError:
            task.cancel()  # the time bound: in-flight requests end as "cancelled"
            await asyncio.gather(task, return_exceptions=True)
        finally:
            if progress:
                progress.cancel()
                print(file=sys.stderr)
        return run.result(mode, level)


async def _first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url.rstrip("/") + "/v1/models") as r:
        data = await r.json()
    model: str = data["data"][0]["id"]
    return model


async def _progress(run: _Run) -> None:
    while True:
        await asyncio.sleep(1.0)
        elapsed = time.monotonic() - run.t0
        done = sum(r.outcome == "ok" for r in run.records)
        print(
            f"\r{elapsed:6.1f}s  {done} done  {run.inflight} in flight  "
            f"{run.tokens / max(elapsed - run.cfg.warmup, 1e-9):8.0f} tok/s",
            end="",
            file=sys.stderr,
            flush=True,
        )


async def closed_loop(cfg: LoadConfig, concurrency: int) -> LoadResult:
    """`concurrency` workers, each sending its next request when the last one ends."""

    async def body(run: _Run) -> None:
        async def worker() -> None:
            while run.may_start():
                await run.one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    return await _with_run(cfg, body, "closed", concurrency)


async def open_loop(cfg: LoadConfig, rate: float, *, seed: int = 0) -> LoadResult:
    """Poisson arrivals at `rate` requests/s, whatever the server's speed."""
    rng = random.Random(seed)

    async def body(run: _Run) -> None:
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()
        while run.may_start():
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if not run.may_start():
                break
            t = asyncio.create_task(run.one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)

    return await _with_run(cfg, body, "open", rate)


async def run_trace(cfg: LoadConfig, trace: list[dict[str, Any]]) -> LoadResult:
    """Replay arrivals: each entry {"t": offset s, "prompt_tokens"?, "max_tokens"?}."""

    async def body(run: _Run) -> None:
        tasks = []
        for entry in sorted(trace, key=lambda e: float(e["t"])):
            await asyncio.sleep(max(0.0, run.t0 + float(entry["t"]) - time.monotonic()))
            if not run.may_start():
                break
            tasks.append(
                asyncio.create_task(run.one(entry.get("prompt_tokens"), entry.get("max_tokens")))
            )
        await asyncio.gather(*tasks)

    return await _with_run(cfg, body, "trace", len(trace))


def _load_trace(path: str) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        entries: list[dict[str, Any]] = json.loads(text)
        return entries
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", required=True)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with N workers")
    mode.add_argument("--rate", type=float, help="open loop, Poisson arrivals per second")
    mode.add_argument("--trace", help="replay a JSON / JSON-lines trace")
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--text-prompt", action="store_true")
    ap.add_argument("--max-requests", type=int, default=10_000)
    ap.add_argument("--max-seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the summary and every request as JSON here")
    args = ap.parse_args(argv)
    cfg = LoadConfig(
        url=args.url,
        model=args.model,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        chat=args.chat,
        max_requests=args.max_requests,
        max_seconds=args.max_seconds,
        warmup=args.warmup,
        text_prompt=args.text_prompt,
    )
    if args.concurrency is not None:
        result = asyncio.run(closed_loop(cfg, args.concurrency))
    elif args.rate is not None:
        result = asyncio.run(open_loop(cfg, args.rate, seed=args.seed))
    else:
        result = asyncio.run(run_trace(cfg, _load_trace(args.trace)))
    print(json.dumps(result.summary(), indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
