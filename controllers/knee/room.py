"""The engine's room (what it holds) and this gateway's share of it, read from its scrapes.

Room, per closed window with engine scrapes (mean running `run`, mean KV use `kv`):

    full  = fewest waiting in any scrape > queue_jitter x run, or a preemption
    room  = run                 if full      (what runs when the queue forms)
          = run / kv            otherwise    (what runs when the KV cache would be full)
    room' = room                if room <= room_prev     (a fall is news: at once)
          = room_prev x (1 - room_rise) + room x room_rise   (a rise is smoothed)

A queue under `queue_jitter` of the running count is the scheduler's jitter (a prefill
waiting for the next step's token budget), not a full engine. While requests sized before
a rescale still finish the room does not rise (the engine still holds small ones). A
reading is *grounded* (measured, not extrapolated) from a queue or from a KV cache at
least `GROUNDED_KV` full: one request in 0.06% of the cache "reads" room for 1600.

Share: this gateway's part of the engine's in-flight, min(1, in-flight / level), smoothed
with weight `smoothing`; learnt only in windows that did not move the limit (scrapes lag
a move by seconds) nor drain a rescale. `alone()`: the share is at least 0.9 (1 on a
gateway's own curve), so the KV edge and the token budget, which count only this
gateway's requests, may act. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kneegate.controllers.knee.curve import blend
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

    def measure(self, w: Summary, full: bool, draining: bool, rise: float) -> None:
        """Read one closed window (`full`: `queued`; `draining`: a rescale's old requests)."""
        run, kv = w.engine_running, w.engine_kv
        if run is None or run <= 0:
            return
        room = run if full else (run / kv if kv and kv > 0 else math.inf)
        self.grounded = full or (kv is not None and kv >= GROUNDED_KV)
        if room > self.value and draining:
            return  # the engine still holds requests sized before a rescale: no rise yet
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

    def update(self, w: Summary, level: float, settled: bool, smoothing: float) -> float:
        """Learn from a `settled` window (no move, no drain); the share to apply now."""
        now = min(1.0, w.inflight / level) if level > 0 else 1.0
        if self.estimate is None or settled:
            self.estimate = blend(self.estimate, now, smoothing)
        return self.estimate or now

    def alone(self) -> bool:
        """This gateway holds (nearly) all the engine's in-flight requests."""
        return (self.estimate or 1.0) >= 0.9
