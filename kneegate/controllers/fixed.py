"""`fixed`: the hand-tuned baseline. The limit is whatever the operator wrote.

In every region it holds `initial`; it reads no Sample field. It is the oracle's
shape in the simulator (the best fixed limit, found by sweeping).
"""

from __future__ import annotations

from kneegate.controllers.base import BaseControllerConfig, LimitController

__all__ = ["Fixed", "FixedConfig"]


class FixedConfig(BaseControllerConfig):
    pass


class Fixed(LimitController):
    name = "fixed"
    adaptive = False  # the operator's number: no slow start past it

    def __init__(self, cfg: FixedConfig | None = None) -> None:
        super().__init__(cfg or FixedConfig())
