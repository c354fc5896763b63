"""Prompt-size shifts: when requests grow, cut at once by how much; and the rescale's epoch.

Prompt estimates arrive where requests join the queue (`on_arrival`) or, for a gateway
that does not report arrivals, at admission. Each one, clipped to `admit_clip` x the
learned size (one huge prompt is no shift), feeds

    recent   running mean, then EWMA, over ~`admit_recent`     tells a shift
    last     plain mean of the last `admit_last`                sizes it
    learned  running mean, then EWMA, over ~`admit_learned`    what the curve was learnt at
    spread   running mean, then EWMA, over ~`admit_learned`    of (p / learned - 1)^2 over
                                                               prompts that are no shift: the
                                                               mix's squared coefficient of
                                                               variation, cv^2

A move of `recent` is a shift only where it is also *significant*: |recent / learned - 1| >
`shift_z` x cv / sqrt(2 x admit_recent - 1), the standard error of an EWMA of weight
1 / admit_recent over a mix of that spread. Production mixes are wide, and there a short
mean passes `footprint_jump` x the long one often by chance alone: each such pass cut the
limit, and nothing raised it again (measured: docs/experiments/2026-12-07-trace-scale.md).
Uniform mixes (cv <= 0.3) keep the plain ratio test: the significance bound (<= 0.19 at
z = 4) is under `footprint_jump` - 1.

State machine, with r = footprint ratio (recent, learned) (`Calibration.footprint_ratio`):

    start      fewer than `admit_recent` noted: learned = recent
    steady     r > footprint_jump and significant:     cut by max(r, ratio(last, learned))
                                                       -> confirming
               r < 1 / footprint_jump and significant: learned = recent (rebase; probing
                                                       finds the room)
               else:                                   learned follows the new estimate
    confirming the next `admit_confirm` estimates size the cut again: if their mean's
               ratio to the size the cut assumed is over `confirm_jump`, a second cut by
               that ratio (never a rise) -> steady; else -> steady as if unconfirmed

A cut (`Cut`: ratio, and the confirmed size or None) is applied by the policy; it then
rebases `learned` and `recent` to the size the cut assumed.

`Epoch` is the rescale's bookkeeping: when the last one began (a cut within `max_window`
of it corrects it and keeps its start), the last finish of a request admitted before it
(`old_finish`: until then the engine still holds small requests, so the room does not
rise and the share is not learnt), and the requests finished since it (tokens per
estimate are learnt again only after `admit_learned` of them; `admit_recent` at the
start). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kneegate.controllers.base import Sample
from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.tokens import Calibration

__all__ = ["Cut", "Epoch", "PromptSizes"]

Cut = tuple[float, float | None]  # (footprint ratio, confirmed prompt size or None)


class PromptSizes:
    """Means of prompt estimates that tell a shift in size and measure it."""

    def __init__(self, cfg: KneeConfig) -> None:
        self.cfg = cfg
        self.noted = 0  # prompts noted (arrivals, or admissions without them)
        self.recent = 0.0  # mean over ~admit_recent: detects a shift
        # the last admit_last, unweighted: measures a shift's size (an EWMA still holds
        # the old size when the slow mean tells the shift, 3-5 admissions in)
        self.last: deque[float] = deque(maxlen=cfg.admit_last)
        self.learned = 0.0  # mean over ~admit_learned, rebased after a rescale
        self.spread = 0.0  # mean of (p / learned - 1)^2 over ~admit_learned: cv^2 of the mix
        self.confirm: list[float] | None = None  # estimates since a cut, until admit_confirm

    def note(self, prompt_tokens: int, cal: Calibration) -> Cut | None:
        """One prompt estimate; the cut it calls for, if any."""
        c, p = self.cfg, float(max(prompt_tokens, 1))
        self.noted += 1
        if self.noted == 1:
            self.recent = self.learned = p
            self.last.append(p)
            return None
        # one huge prompt among small ones is no shift: a single one moves the means little
        p = min(p, c.admit_clip * self.learned)
        # running means until their windows fill: an EWMA from the first prompt holds a
        # third of it after 20 and biased the learned size (and the KV capacity) for minutes
        self.recent += (p - self.recent) / min(self.noted, c.admit_recent)
        self.last.append(p)
        if self.confirm is not None and (cut := self._confirmed(p, cal)) is not None:
            return cut
        if self.noted < c.admit_recent:
            self._spread(p)
            self.learned = self.recent  # too few to tell a shift from the start
            return None
        r = cal.footprint_ratio(self.recent, self.learned)
        significant = abs(self.recent / self.learned - 1) > c.shift_z * math.sqrt(
            self.spread / (2 * c.admit_recent - 1))
        if r > c.footprint_jump and significant:
            # the slow mean tells a shift; the last few admissions how far it went
            return max(r, cal.footprint_ratio(self._last_mean(), self.learned)), None
        if r < 1 / c.footprint_jump and significant:
            self.learned = self.recent  # smaller prompts: probing finds the room again
        else:  # no shift: the mix's mean and spread follow
            self._spread(p)
            self.learned += (p - self.learned) / min(self.noted, c.admit_learned)
        return None

    def _spread(self, p: float) -> None:
        """Learn the mix's spread from a prompt that is no shift: the prompts of a shift
        would widen it and hide the shift itself."""
        deviation = (p / self.learned - 1) ** 2
        self.spread += (deviation - self.spread) / min(self.noted, self.cfg.admit_learned)

    def _confirmed(self, p: float, cal: Calibration) -> Cut | None:
        """The admissions after a cut size it again: a cut sized by a few admissions (3-5,
        some still from before the shift) is often short. Only ever deeper."""
        assert self.confirm is not None
        self.confirm.append(p)
        if len(self.confirm) < self.cfg.admit_confirm:
            return None
        size = sum(self.confirm) / len(self.confirm)
        self.confirm = None
        r = cal.footprint_ratio(size, self.learned)
        if r <= self.cfg.confirm_jump:
            return None
        return r, size

    def _last_mean(self) -> float:
        return sum(self.last) / len(self.last)

    def rebase(self, size: float | None) -> None:
        """After a cut: the learned size is the one it assumed; a first cut is confirmed."""
        self.learned = self.recent = size or max(self.recent, self._last_mean())
        self.confirm = [] if size is None else None


@dataclass(slots=True)
class Epoch:
    """The last rescale, and the requests from before it that still finish."""

    rescaled_at: float = -math.inf  # when the last rescale began
    old_finish: float = -math.inf  # last finish of a request admitted before it
    dones_since: int = 0  # requests finished since it

    def begin(self, now: float, max_window: float) -> None:
        """A rescale at `now`; one within `max_window` of the last corrects it: requests
        admitted between the two already have the new size, the old ones are older."""
        if now - self.rescaled_at > max_window:
            self.rescaled_at = now
            self.dones_since = 0
        self.old_finish = now

    def finish(self, s: Sample) -> None:
        if s.admitted_at < self.rescaled_at:
            self.old_finish = max(self.old_finish, s.finished_at)
        self.dones_since += 1

    def draining(self, since: float) -> bool:
        """A request sized before the rescale finished at or after `since`."""
        return self.old_finish >= since

    def settled(self, now: float, window: float, max_window: float) -> bool:
        """No rescale lately and no request sized before it still finishing."""
        return now > self.old_finish + window and (now > self.rescaled_at + max_window)

    def calibrated(self, recent: int, learned: int) -> bool:
        """Enough finishes since the start (`recent`) or the rescale (`learned`) for the two
        slow prompt means to hold the same sizes (the admitted one leads by the requests in
        flight: 0.8 where it is 1, after a 4x jump)."""
        need = learned if math.isfinite(self.rescaled_at) else recent
        return self.dones_since >= need
