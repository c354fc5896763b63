"""Pure concurrency-limit algorithms. No I/O, no clocks, no asyncio."""

from kneegate.controllers.aimd import Aimd, AimdConfig
from kneegate.controllers.base import (
    BaseControllerConfig,
    Controller,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    is_distress,
)
from kneegate.controllers.fixed import Fixed, FixedConfig
from kneegate.controllers.gradient import Gradient, GradientConfig
from kneegate.controllers.knee import Knee, KneeConfig
from kneegate.controllers.registry import CONTROLLERS, build_controller

__all__ = [
    "CONTROLLERS",
    "Aimd",
    "AimdConfig",
    "BaseControllerConfig",
    "Controller",
    "EngineStats",
    "Fixed",
    "FixedConfig",
    "Gradient",
    "GradientConfig",
    "Knee",
    "KneeConfig",
    "LimitController",
    "Outcome",
    "Sample",
    "build_controller",
    "is_distress",
]
