"""Estimate-to-token calibration: slow means that put the gateway's prompt estimates into the
engine's tokens, and the answers' lengths and lives.

The gateway's prompt size is an estimate (body bytes / 4, JSON included): only ratios of
estimates mean anything until they are put into tokens. Three running means (a plain mean
until `admit_learned` values, then an EWMA with weight 1 / `admit_learned`):

    p_slow   admitted estimates         (never rebased)
    p_done   finished prompts' tokens   (the engine's usage count)
    o, o2    finished answers' tokens, and their squares
    life     answered requests' lives, dispatch to last byte, in seconds

    k        = clamp(p_done / p_slow, 0.25, 4)   tokens per estimate, taken at each
               finish while `ready` (both means hold the same sizes: `Epoch.calibrated`)
    held     = E[o^2] / 2 E[o]    answer tokens a running request holds on average (long
               answers stay longer than the mean)
    footprint ratio, recent over learned prompt estimates, with k' the same clamp of
               p_done / p_slow read live (1 before both are known):
               (k' x recent + o/2) / (k' x learned + o/2)

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kneegate.controllers.base import Outcome, Sample

__all__ = ["Calibration"]


@dataclass(slots=True)
class Calibration:
    """Slow means of admitted estimates and finished requests' tokens."""

    learned: int  # values after which a running mean becomes an EWMA (`admit_learned`)
    admitted: int = 0
    p_slow: float = 0.0  # admitted estimates
    dones: int = 0
    p_done: float = 0.0  # finished prompts' tokens
    outs: int = 0
    out_done: float = 0.0  # every finished request's answer
    out_sq: float = 0.0  # and its square
    k: float = 1.0  # engine prompt tokens per admitted estimate, learnt while sizes hold
    lives: int = 0
    life: float = 0.0  # an answered request's life, dispatch to last byte, seconds

    def admit(self, prompt_tokens: int) -> None:
        """An admission's estimate (admissions are the population whose prompts finish)."""
        self.admitted += 1
        p = float(max(prompt_tokens, 1))
        self.p_slow += (p - self.p_slow) / min(self.admitted, self.learned)

    def learn_k(self, ready: bool) -> None:
        """Take the ratio of the two prompt means as tokens per estimate, when `ready`."""
        if ready and self.p_done > 0 and self.p_slow > 0:
            self.k = max(0.25, min(4.0, self.p_done / self.p_slow))

    def finish(self, s: Sample) -> None:
        """A finished request's prompt and answer tokens (counted apart: a gateway may not
        know the prompt's tokens), and its life."""
        if s.prompt_tokens > 0:
            self.dones += 1
            w = 1 / min(self.dones, self.learned)
            self.p_done += (s.prompt_tokens - self.p_done) * w
        if s.output_tokens > 0:
            self.outs += 1
            w = 1 / min(self.outs, self.learned)
            self.out_done += (s.output_tokens - self.out_done) * w
            self.out_sq += (s.output_tokens**2 - self.out_sq) * w
        if s.outcome is Outcome.OK:  # an error ends a request early
            self.lives += 1
            self.life += (s.duration - self.life) / min(self.lives, self.learned)

    def tokens(self, estimate: float) -> float:
        """A prompt estimate in the engine's tokens."""
        return self.k * estimate

    def held_answer(self) -> float:
        """Answer tokens a running request holds on average, E[o^2] / 2 E[o]."""
        return self.out_sq / (2 * self.out_done)

    def footprint_ratio(self, recent: float, learned: float) -> float:
        """Recent over learned KV footprint of a running request: prompt + half the answer."""
        k = self.p_done / self.p_slow if self.p_done > 0 and self.p_slow > 0 else 1.0
        k = max(0.25, min(4.0, k))  # read live: it damps a short run of large prompts
        out = self.out_done / 2  # a running request holds half its answer, on average
        return (k * recent + out) / (k * learned + out)
