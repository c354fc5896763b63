"""Pure concurrency-limit algorithms. No I/O, no clocks, no asyncio."""

from controllers.aimd import Aimd, AimdConfig
from controllers.base import (
    BaseControllerConfig,
    Controller,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    is_distress,
)
from controllers.fixed import Fixed, FixedConfig
from controllers.gradient import Gradient, GradientConfig
from controllers.knee import Knee, KneeConfig
from controllers.registry import CONTROLLERS, build_controller

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
