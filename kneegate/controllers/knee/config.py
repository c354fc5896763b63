"""`KneeConfig`: the knee controller's parameters, their defaults, ranges and meanings.

Groups: the curve (`step_gain`, `decline`, `power_floor`, `pair`, `bin_ratio`, `smoothing`,
`change`, `memory`, `objective_memory`); the regions (`headroom`, `climb`, `tpot_aim`,
`probe_every`, `probe_step`, `backoff`, `saturation`); the engine's room (`room_rise`,
`queue_jitter`); windows (`window`, `min_samples`, `max_window`); prompt-size shifts
(`admit_*`, `confirm_jump`, `footprint_jump`); the KV edge and token budget (`kv_*`).
"""

from __future__ import annotations

from pydantic import Field

from kneegate.controllers.base import BaseControllerConfig

__all__ = ["KneeConfig"]


class KneeConfig(BaseControllerConfig):
    headroom: float = Field(0.95, gt=0.1, le=1.0, description="limit = headroom x knee")
    step_gain: float = Field(
        0.02, ge=0.005, le=0.5, description="a 20% step adding less throughput is past the knee"
    )
    climb: float = Field(1.0, gt=0, le=4, description="most growth per window, x (1 + climb)")
    tpot_aim: float = Field(
        0.85,
        gt=0.1,
        le=1.0,
        description="growth stops where TPOT p50, grown in step with the level, reaches this"
        " x tpot_objective (lowered by one standard deviation of the measured noise)",
    )
    decline: float = Field(0.2, gt=0, lt=0.9, description="throughput drop that ends the curve")
    power_floor: float = Field(
        0.5, ge=0, lt=1, description="power under this x the best ends a curve that stopped paying"
    )
    pair: float = Field(
        1.15, gt=1.05, le=2, description="levels this far apart measure a step's gain"
    )
    probe_every: int = Field(4, ge=1, le=1000, description="windows between upward probes")
    probe_step: float = Field(0.1, gt=0, le=2, description="a probe goes this far above the knee")
    backoff: float = Field(0.9, ge=0.5, lt=1, description="cut on breach or drop")
    room_rise: float = Field(
        0.5, gt=0, le=1, description="weight of a higher room reading (a lower one counts at once)"
    )
    queue_jitter: float = Field(
        0.01, ge=0, le=0.5, description="an engine queue under this x running is no full engine"
    )
    change: float = Field(
        0.35, gt=0, lt=1, description="throughput shift at one level that resets the curve"
    )
    memory: float = Field(300.0, gt=0, le=86_400, description="seconds a curve point is kept")
    objective_memory: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="seconds a level stays marked as over the objectives (a decline read once,"
        " and a level as a decline's reference, as long)",
    )
    bin_ratio: float = Field(0.05, gt=0, le=1, description="relative width of a level bin")
    smoothing: float = Field(0.5, gt=0, le=1, description="weight of a new window at its level")
    saturation: float = Field(
        0.5, gt=0, le=1, description="share of a window at the limit that means demand > limit"
    )
    window: float = Field(5.0, gt=0, le=600, description="minimum window length, seconds")
    min_samples: int = Field(8, ge=1, le=10_000, description="samples before a window closes")
    max_window: float = Field(30.0, gt=0, le=3600, description="a window closes by this age")
    admit_recent: int = Field(
        20, ge=2, le=10_000, description="admissions averaged as the recent prompt size"
    )
    admit_learned: int = Field(
        200, ge=2, le=100_000, description="admissions averaged as the learned prompt size"
    )
    admit_last: int = Field(
        4, ge=1, le=1000, description="admissions averaged to size a shift once one is seen"
    )
    admit_clip: float = Field(
        8.0, gt=1, le=1000, description="an admission counts at most this x the learned size"
    )
    admit_confirm: int = Field(
        8, ge=1, le=1000, description="admissions after a rescale that size it again"
    )
    confirm_jump: float = Field(
        1.05, ge=1.0, le=10, description="footprint ratio, confirmed to cut, that cuts deeper"
    )
    footprint_jump: float = Field(
        1.3, gt=1.05, le=10, description="footprint ratio, recent to learned, that rescales"
    )
    shift_z: float = Field(
        4.0, ge=0, le=20,
        description="a size shift must also stand this many standard errors of the recent mean "
        "from the learned size (a wide mix of lengths is no shift)",
    )
    kv_target: float = Field(
        0.98, gt=0.1, le=1.0, description="KV-cache use the KV-edge limit admits up to"
    )
    kv_reserve: float = Field(
        0.5,
        ge=0,
        le=4,
        description="new requests' peaks kept free below kv_target (without a token budget)",
    )
    kv_budget: float = Field(
        0.95, ge=0, le=1.0, description="KV-cache share in-flight requests' sizes may fill (0: off)"
    )
    kv_budget_burst: float = Field(
        1.0,
        ge=0,
        le=1.0,
        description="the token budget's KV-cache share for a request's life after a drain",
    )
    kv_learn: float = Field(
        0.05, gt=0, le=1, description="weight of one scrape in the KV capacity estimate"
    )
