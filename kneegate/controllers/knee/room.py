"""The engine's room (what it holds) and this gateway's share of it, read from its scrapes.

Room, per closed window with engine scrapes (mean running `run`, mean KV use `kv`):

    full  = fewest waiting in any scrape > queue_jitter x run, or a preemption
    room  = run                 if full      (what runs when the queue forms)
          = run / kv            otherwise    (what runs when the KV cache would be full)
    room' = room                if room <= room_prev     (a fall is news: at once)
          = room_prev                if room <  room_prev and app-limited (`idle`)
          = room_prev x (1 - room_rise) + room x room_rise   (a rise is smoothed)

A queue under `queue_jitter` of the running count is the scheduler's jitter (a prefill
waiting for the next step's token budget), not a full engine. While requests sized before
a rescale still finish the room does not rise (the engine still holds small ones). A
reading is *grounded* (measured, not extrapolated) from a queue or from a KV cache at
least `GROUNDED_KV` full: one request in 0.06% of the cache "reads" room for 1600.

App-limited (`idle`: in-flight under the limit for most of the window, the token budget
refused nothing, the engine not full, no breach) a lower room is no news: as the engine
drains, the longest answers are the last to finish and each holds more KV than the mean,
so running / KV use falls with no change in the engine. Read as news it drew the limit
down between bursts, and each burst started short (measured: docs/design/knee.md, "The
engine's room").

Share: this gateway's part of the engine's in-flight, smoothed with weight `smoothing`;
learnt only in windows that did not move the limit (scrapes lag a move by seconds), nor
drain a rescale, nor were app-limited (a drain's in-flight falls at the gateway before
the scrapes show it). Read like for like: this gateway's in-flight at each scrape's own
time (the last tick at or before it) over the engine's running + waiting in it, summed
over the window's scrapes; min(1, in-flight / level) where no tick came before them.
The scrapes come seconds late: read side by side with the window's mean in-flight,
gateways ramping together each read far more than their part and kept their initial
limit while the engine queued. `alone()`: the share is at least 0.9 (1 on a gateway's
own curve): the target, the KV edge and the token budget then apply no share (a gateway
alone read under 1 while in-flight ramped between ticks); beside others each applies
the share. Measured: docs/design/knee.md, "Several gateways". Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kneegate.controllers.knee.point import blend
from kneegate.controllers.window import Summary

__all__ = ["GROUNDED_KV", "Room", "Share", "queued"]

GROUNDED_KV = 0.25  # KV use from which running / use is a reading, not a guess


def queued(w: Summary, jitter: float) -> bool:
    """The engine is full: its queue never emptied in the window, or it preempted."""
    waiting, running = w.engine_waiting or 0.0, w.engine_running or 0.0
    full_queue = waiting > jitter * running
    return full_queue or (w.engine_preempted or 0.0) > 0


@dataclass(slots=True)
class Room:
    """The engine's capacity in sequences; inf until a window with scrapes measures it."""

    value: float = math.inf
    grounded: bool = False  # the last reading was measured, not extrapolated

    def measure(
        self, w: Summary, full: bool, draining: bool, rise: float, idle: bool = False
    ) -> None:
        """Read one closed window (`full`: `queued`; `draining`: a rescale's old requests;
        `idle`: app-limited, demand under the limit and the engine not full)."""
        run, kv = w.engine_running, w.engine_kv
        if run is None or run <= 0:
            return
        room = run if full else (run / kv if kv and kv > 0 else math.inf)
        if room > self.value and draining:
            return  # the engine still holds requests sized before a rescale: no rise yet
        if room < self.value and idle and math.isfinite(self.value):
            return  # a drain keeps the longest answers: each holds more KV than the mean
        self.grounded = full or (kv is not None and kv >= GROUNDED_KV)
        # fast down (a change is news), slow up (one window may be a lucky mix of lengths)
        up = blend(self.value, room, rise) if math.isfinite(self.value) else room
        self.value = min(room, up or room)

    def rescale(self, r: float) -> None:
        """Each request now holds r x the KV it held."""
        if math.isfinite(self.value):
            self.value /= r


@dataclass(slots=True)
class Share:
    """This gateway's part of the engine's in-flight; None until a window reads it."""

    estimate: float | None = None
    # (time, in-flight) of the last ticks, to read this gateway at each scrape's own time
    _ticks: deque[tuple[float, int]] = field(default_factory=deque)
    _mine: float = 0.0  # this window's in-flight at its scrapes' times, summed
    _engine: float = 0.0  # and the engine's (running + waiting) in them

    def tick(self, now: float, inflight: int, keep: float) -> None:
        self._ticks.append((now, inflight))
        while self._ticks and self._ticks[0][0] < now - keep:
            self._ticks.popleft()

    def scrape(self, at: float, engine: float) -> None:
        """The engine held `engine` at `at`: beside it, this gateway's in-flight then."""
        mine = None
        for t, n in self._ticks:  # the last tick at or before the scrape
            if t > at:
                break
            mine = n
        if mine is not None and engine > 0:
            self._mine += mine
            self._engine += engine

    def update(self, w: Summary, level: float, settled: bool, smoothing: float) -> float:
        """Learn from a `settled` window (no move, no drain); the share to apply now."""
        if self._engine > 0:  # like for like: the scrapes lag the gateway by seconds
            now = min(1.0, self._mine / self._engine)
        else:
            now = min(1.0, w.inflight / level) if level > 0 else 1.0
        self._mine = self._engine = 0.0
        if self.estimate is None or settled:
            self.estimate = blend(self.estimate, now, smoothing)
        # alone, the share's noise is no news (a ramp between ticks reads 0.95-0.99)
        return 1.0 if self.alone() else (self.estimate or now)

    def alone(self) -> bool:
        """This gateway holds (nearly) all the engine's in-flight requests."""
        return (self.estimate or 1.0) >= 0.9
