"""Pure concurrency-limit algorithms. No I/O, no clocks, no asyncio."""

from controllers.base import (
    BaseControllerConfig,
    Controller,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
)
from controllers.fixed import Fixed, FixedConfig

__all__ = [
    "BaseControllerConfig",
    "Controller",
    "EngineStats",
    "Fixed",
    "FixedConfig",
    "LimitController",
    "Outcome",
    "Sample",
]
