"""Build a controller from its name and parameters (what the gateway config names)."""

from __future__ import annotations

from typing import Any

from kneegate.controllers.aimd import Aimd, AimdConfig
from kneegate.controllers.base import BaseControllerConfig, LimitController
from kneegate.controllers.fixed import Fixed, FixedConfig
from kneegate.controllers.gradient import Gradient, GradientConfig
from kneegate.controllers.knee import Knee, KneeConfig

__all__ = ["CONTROLLERS", "build_controller"]

# name -> (config model, controller class): a new algorithm is added here by hand.
CONTROLLERS: dict[str, tuple[type[BaseControllerConfig], type[LimitController]]] = {
    "aimd": (AimdConfig, Aimd),
    "fixed": (FixedConfig, Fixed),
    "gradient": (GradientConfig, Gradient),
    "knee": (KneeConfig, Knee),
}


def build_controller(name: str, params: dict[str, Any] | None = None) -> LimitController:
    """Validate `params` against the named controller's config and build it."""
    try:
        cfg_cls, ctl_cls = CONTROLLERS[name]
    except KeyError:
        raise ValueError(
            f"unknown controller {name!r}; choose one of {sorted(CONTROLLERS)}"
        ) from None
    return ctl_cls(cfg_cls(**(params or {})))
