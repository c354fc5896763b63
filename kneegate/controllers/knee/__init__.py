"""`knee`: learn the throughput-vs-concurrency curve from live traffic; hold just below its knee.

    limit = min(headroom x knee, objective ceiling) x share

The knee is the lowest of the curve's (fitted bend, measured plateau, last level before a
decline) and the engine's room (what it holds when full); the objective ceiling is the
highest level measured below the lowest one that broke the TTFT or TPOT objective; the
share is this gateway's part of the engine's in-flight, so several gateways hold the
engine at `headroom x knee` together without talking. At the KV cache's edge, limits in
tokens act beside it (each gateway its share of them), and a shift in prompt sizes cuts at
once by its ratio.

The parts, each pure (no clock, no I/O) and none calling back into the policy:

    config.py   KneeConfig: every parameter, its default, range and meaning
    point.py    Point: the curve at one level; `blend`, the weighted mean the parts share
    fit.py      the saturating curve fitted to the kept levels, and its knee
    shape.py    Shape: what the points say: the decline, the plateau, the knee, the ceiling
    curve.py    Curve (a Shape): the points learnt per level from windows, the noise
    room.py     Room, Share, queued: the engine's room and this gateway's share of it
    tokens.py   Calibration: prompt estimates put into tokens; the answers' mean lengths
    sizes.py    PromptSizes, Epoch: prompt-size shifts, and the rescale they start
    kv.py       KvEdge: the KV-cache edge and the token budget (`fits`)
    signals.py  what a closed window says beside its means: a breach, a ramp, a climb, a stall
    steps.py    how far a saturated window may move the limit: the climb, a probe, the
                latency bounds (TTFT in step with the limit, TPOT with the level)
    policy.py   Knee: windows in, regions, one limit out

Inputs and outputs are `LimitController`'s (controllers/base.py); windows are
`controllers.window.Windowed`'s. The reasoning behind each rule, with what was tried and
measured: docs/design/knee.md.
"""

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.point import Point
from kneegate.controllers.knee.policy import Knee

__all__ = ["Knee", "KneeConfig", "Point"]
