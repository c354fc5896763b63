"""Closed-loop load against the core in virtual time: a sweep point in milliseconds.

`closed_loop(...)` keeps `concurrency` requests in the engine: each finished request is
replaced by a new one (after `client_gap` virtual seconds, the client's turnaround), of the
same lengths or, with `lengths`, of the next (prompt, output) pair of a mix in turn. Time
is the sum of step durations, so results are deterministic for a seed and take no sleep.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kneegate.emulator.core import EngineCore, EngineRequest

__all__ = ["LoopResult", "closed_loop"]


@dataclass(frozen=True, slots=True)
class LoopResult:
    concurrency: int
    throughput: float  # output tokens / s over the measured window
    ttft_p50: float  # seconds, arrival to the end of the step with the first token
    tpot_p50: float  # seconds per output token after the first
    ttft_p90: float
    tpot_p90: float
    completed: int  # requests finished inside the window
    preemptions: int  # over the whole run
    mean_running: float  # step-weighted mean of the running set
    max_running: int
    max_waiting: int
    ttft_p99: float


class _Tracker:
    __slots__ = ("arrived", "first", "tokens")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.first = -1.0
        self.tokens = 0


def closed_loop(
    core_factory: Callable[[], EngineCore],
    concurrency: int,
    seconds: float,
    prompt_tokens: int,
    max_tokens: int,
    *,
    warmup: float = 0.0,
    client_gap: float = 0.0,
    started_after_warmup: bool = False,
    lengths: Sequence[tuple[int, int]] = (),
) -> LoopResult:
    """Run `concurrency` clients for `seconds` of virtual time; measure after `warmup`.

    Latencies are those of requests finished after `warmup`; with `started_after_warmup`,
    of requests that also arrived after it, as kneegate_bench.loadgen counts a live run (the
    first wave, all clients arriving at once, then stays out of TTFT p99). `lengths`: the
    requests' (prompt, output) tokens in turn, cycling (a production mix) in place of
    `prompt_tokens` and `max_tokens`.
    """
    core = core_factory()
    live: dict[str, _Tracker] = {}
    arrivals: list[tuple[float, int]] = [(0.0, i) for i in range(concurrency)]
    ttfts: list[float] = []
    tpots: list[float] = []
    now, tokens, serial = 0.0, 0, 0
    running_sum = running_time = 0.0
    max_running = max_waiting = 0
    while now < seconds:
        while arrivals and arrivals[0][0] <= now:
            heapq.heappop(arrivals)
            serial += 1
            rid = f"v{serial}"
            live[rid] = _Tracker(now)
            if lengths:
                prompt_tokens, max_tokens = lengths[(serial - 1) % len(lengths)]
            core.add_request(EngineRequest(rid, prompt_tokens, max_tokens))
        if not core.has_unfinished():
            now = arrivals[0][0]  # every client is between requests: jump to the next arrival
            continue
        result = core.step()
        stats = core.stats()
        running_sum += stats.running * result.duration
        running_time += result.duration
        max_running = max(max_running, stats.running)
        max_waiting = max(max_waiting, stats.waiting)
        now += result.duration
        for ev in result.events:
            t = live[ev.request_id]
            t.tokens += ev.new_tokens
            if now > warmup:
                tokens += ev.new_tokens
            if ev.first:
                t.first = now
            if ev.finished is None:
                continue
            del live[ev.request_id]
            heapq.heappush(arrivals, (now + client_gap, serial))
            if t.arrived >= warmup if started_after_warmup else now > warmup:
                ttfts.append(t.first - t.arrived)
                if t.tokens > 1:
                    tpots.append((now - t.first) / (t.tokens - 1))
    return LoopResult(
        concurrency=concurrency,
        throughput=tokens / max(seconds - warmup, 1e-9),
        ttft_p50=_pct(ttfts, 50),
        tpot_p50=_pct(tpots, 50),
        ttft_p90=_pct(ttfts, 90),
        tpot_p90=_pct(tpots, 90),
        completed=len(ttfts),
        preemptions=core.stats().num_preemptions_total,
        mean_running=running_sum / running_time if running_time else 0.0,
        max_running=max_running,
        max_waiting=max_waiting,
        ttft_p99=_pct(ttfts, 99),
    )


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
