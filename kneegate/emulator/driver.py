"""Runs the clock-free core in real time: one asyncio task steps it and sleeps.

    r = core.step(); sleep(r.duration / speed); hand r.events to per-request queues

The sleep is paced against a deadline so timer slack does not accumulate (but a backlog of
more than `_MAX_DEBT` seconds is forgiven rather than replayed as a burst). When no work
exists the task waits on an event that `submit` sets. Events for a request go to its
`asyncio.Queue`; `None` in a queue means "stop" (the client went away).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kneegate.emulator.core import EngineCore, EngineRequest, StepResult, TokenEvent
from kneegate.emulator.metrics import EngineMetrics

__all__ = ["RealTimeDriver", "TokenQueue"]

TokenQueue = asyncio.Queue[TokenEvent | None]
_MAX_DEBT = 0.05  # seconds the driver may run behind its deadline before it stops catching up


class _Stream:
    __slots__ = ("arrived", "last", "queue")

    def __init__(self, arrived: float) -> None:
        self.queue: TokenQueue = asyncio.Queue()
        self.arrived = arrived
        self.last = arrived


class RealTimeDriver:
    """Owns the stepping task; `submit` and `abort` are called from request handlers."""

    def __init__(
        self,
        core: EngineCore,
        metrics: EngineMetrics,
        *,
        speed: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.core, self.metrics, self.speed, self._clock = core, metrics, speed, clock
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()

    def submit(self, req: EngineRequest) -> TokenQueue:
        stream = _Stream(self._clock())
        self.core.add_request(req)
        self._streams[req.request_id] = stream
        self._wake.set()
        return stream.queue

    def abort(self, request_id: str) -> bool:
        """Abort in the core now (blocks freed); counted as finished_reason="abort"."""
        self._streams.pop(request_id, None)
        if not self.core.abort_request(request_id):
            return False
        self.metrics.success["abort"].inc()
        return True

    async def run(self) -> None:
        deadline = self._clock()
        while True:
            if not self.core.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                deadline = self._clock()
                continue
            start = self._clock()
            result = self.core.step()
            self._observe_started(result, start)
            deadline = max(deadline, start - _MAX_DEBT) + result.duration / self.speed
            delay = deadline - self._clock()
            # a zero-length step with work left means nothing fit: yield, do not spin
            await asyncio.sleep(delay if delay > 0 else (0 if result.duration else 0.001))
            self._deliver(result.events, self._clock())

    def _observe_started(self, result: StepResult, start: float) -> None:
        for rid in result.started:
            stream = self._streams.get(rid)
            if stream is not None:
                self.metrics.queue.observe(start - stream.arrived)

    def _deliver(self, events: list[TokenEvent], now: float) -> None:
        m = self.metrics
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if ev.first:
                m.ttft.observe(now - stream.arrived)
            else:
                m.itl.observe(now - stream.last)
            stream.last = now
            stream.queue.put_nowait(ev)
            if ev.finished is not None:
                m.e2e.observe(now - stream.arrived)
                m.success[ev.finished].inc()
                del self._streams[ev.request_id]
