"""The embedded engine: what `kneegate serve` runs as its upstream when the config names none.

The emulator (`cpu-tiny`), loaded only when asked: a production image that names its
upstreams never imports it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["emulator_app", "emulator_installed"]


def emulator_installed() -> bool:
    """Whether the emulator is here: the container image leaves it out."""
    return importlib.util.find_spec("kneegate.emulator") is not None


def emulator_app() -> Any:
    """The emulator's ASGI app (`kneegate.emulator`)."""
    from kneegate.emulator.server import build_app

    return build_app("cpu-tiny")
