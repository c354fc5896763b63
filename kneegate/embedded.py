"""The embedded engine: what `kneegate serve` runs as its upstream when the config names none.

The emulator (`cpu-tiny`), loaded only when asked: a production image that names its
upstreams never imports the load tools.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["emulator_app", "emulator_installed"]


def emulator_installed() -> bool:
    """Whether the emulator is here: the container image leaves the load tools out."""
    try:
        return importlib.util.find_spec("kneegate.benchmarks.engine") is not None
    except ModuleNotFoundError:  # kneegate.benchmarks itself is missing
        return False


def emulator_app() -> Any:
    """The emulator's ASGI app (`kneegate.benchmarks.engine`, the `bench` extra)."""
    from kneegate.benchmarks.engine.server import build_app

    return build_app("cpu-tiny")
