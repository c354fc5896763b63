"""The KV-cache edge and the token budget: where a request count is too coarse.

At the edge of the KV cache one request is a large part of it (on L4, 11 large requests
fill the cache and 12 start a preemption storm), so two limits in tokens act beside the
curve's. The engine's running count, KV use and cache are everyone's in front of it: beside
other gateways each applies its share of the edge and of the budget (`part`, the policy's
`Share`, 1 alone): held by the share of the curve's target alone, several gateways sat
together under the room by a floor each. Measured: docs/design/knee.md, "Several
gateways".

KV edge, set by each scrape (running n, KV use u) once the capacity C is known, with
prompt p (the learned size in tokens), mean answer o and a new request's peak p + o:

    C     <- blend(C, n x (p + held) / u, kv_learn)   learnt while sizes settled,
             tokens per estimate calibrated, u >= 0.3, no queue and no preemption
    free  = (kv_target - u) x C - o - reserve x (p + o)
             (reserve = kv_reserve without a token budget, 0 with one)
    limit = n - f + floor((free + sum of the f finishes' prompt + answer) / new)
             where f counts the requests finished since the scrape (a small one frees
             a fraction of a large one's slot); finishes are kept `max_window` s;
             new = p + o without a token budget, p + held with one

With a token budget a new request counts what it holds on average (p + held, held the
answer a running request holds, as `fits` counts it), not its peak: the budget bounds
the sum already, and at the peak the edge admitted fewer than the budget allows.
Measured: docs/design/knee.md, "The KV-cache edge".

Token budget (`fits`), when the engine reports its KV cache's size R (vLLM's
num_gpu_blocks x block_size), once an answer has finished:

    budget = share x max(R, C / SHARED)     (a learnt capacity beyond SHARED x R
                                             means a shared prefix held once)
    share  = kv_budget, or kv_budget_burst in a burst (the engine drained within a
             request's life: `Knee._burst`)
    fits   : k x (in-flight estimates + this one) + (in-flight + 1) x held <= budget x part

with k tokens per estimate and held = E[o^2] / 2 E[o] (`Calibration`). `held` is what a
running request holds on average once requests of every age run; a burst's requests are
younger, and its margin below the cache is `kv_budget_burst`'s. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque

from kneegate.controllers.base import EngineStats
from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.point import blend
from kneegate.controllers.knee.tokens import Calibration

__all__ = ["SHARED", "KvEdge"]

SHARED = 1.25  # learned over reported KV capacity beyond noise: a shared prefix


class KvEdge:
    """The in-flight count that fills the KV cache to `kv_target`, and the token budget."""

    def __init__(self, cfg: KneeConfig) -> None:
        self.cfg = cfg
        self.learned: float | None = None  # the engine's KV capacity, in prompt tokens
        self.reported: float | None = None  # the KV cache's size, as the engine reports it
        self.limit: float | None = None  # in-flight that fills it to kv_target, now
        self.use = 0.0  # the last scrape's KV use
        # the last scrape's (time, running, free KV tokens, a new request's peak tokens)
        self._scrape: tuple[float, float, float, float] | None = None
        self._finished: deque[tuple[float, float]] = deque()  # (finished_at, KV tokens freed)
        self._prev: EngineStats | None = None

    def scrape(self, st: EngineStats, prompt: float, cal: Calibration, learn: bool) -> None:
        """One scrape; `prompt`: the learned prompt size in tokens; `learn`: sizes settled
        and tokens per estimate calibrated, so the capacity may be learnt."""
        prev, c = self._prev, self.cfg
        self._prev = st
        if st.kv_capacity_tokens > 0:  # NaN (not reported) is not
            self.reported = st.kv_capacity_tokens
        p, out, kv = prompt, cal.out_done, st.kv_cache_usage
        if st.running <= 0 or kv <= 0 or p <= 0 or out <= 0:
            return
        preempted = prev is not None and st.preemptions_total > prev.preemptions_total
        # a storm reads the cache full with fewer requests
        if learn and kv >= 0.3 and st.waiting == 0 and not preempted:
            cap = st.running * (p + cal.held_answer()) / kv
            self.learned = blend(self.learned, cap, c.kv_learn)
        if self.learned is None:
            return
        budget = self.token_budget() is not None
        # with a token budget a new request counts what it holds on average, as `fits` counts
        # it, not its peak: the budget already bounds the sum (see the docstring)
        new = p + (cal.held_answer() if budget else out)
        # the token budget weighs each request's own size: no reserve against large ones
        reserve = 0.0 if budget else c.kv_reserve
        free = (c.kv_target - kv) * self.learned - out - reserve * new
        self._scrape = (st.at, st.running, free, new)
        self.use = kv
        self._update()

    def finish(self, at: float, freed: float) -> None:
        """A request finished at `at`, freeing `freed` tokens (prompt + answer)."""
        self._finished.append((at, freed))
        while self._finished and self._finished[0][0] < at - self.cfg.max_window:
            self._finished.popleft()
        self._update()

    def reset(self) -> None:
        """Sizes changed: the next scrape sizes the edge anew."""
        self.limit = self._scrape = None

    def _update(self) -> None:
        if self._scrape is None:
            return
        at, running, free, new = self._scrape
        since = [fp for t, fp in self._finished if t > at]
        self.limit = running - len(since) + math.floor((free + sum(since)) / new)

    def token_budget(self, burst: bool = False) -> float | None:
        """`kv_budget` (`kv_budget_burst` in a burst) x the KV cache, in tokens as `fits`
        counts them; None: no budget."""
        if self.reported is None or self.cfg.kv_budget <= 0:
            return None
        shared = (self.learned or 0.0) / SHARED
        share = self.cfg.kv_budget_burst if burst else self.cfg.kv_budget
        return share * max(self.reported, shared)

    def fits(
        self,
        inflight: int,
        inflight_tokens: int,
        tokens: int,
        cal: Calibration,
        part: float = 1.0,
        burst: bool = False,
    ) -> bool:
        """One more request of `tokens` (an estimate) fits in `part` of the budget (its burst
        share in a burst); True without one, or before an answer has finished."""
        budget = self.token_budget(burst)
        if budget is None or cal.out_done <= 0:
            return True
        need = cal.k * (inflight_tokens + tokens) + (inflight + 1) * cal.held_answer()
        return need <= budget * part
