"""The embedded engine: what `kneegate serve` runs as its upstream when the config names none.

The emulator (`cpu-tiny`), loaded only when asked: a production image that names its
upstreams never imports the load tools.
"""

from __future__ import annotations

from typing import Any

__all__ = ["emulator_app"]


def emulator_app() -> Any:
    """The emulator's ASGI app (`kneegate.benchmarks.engine`, the `bench` extra)."""
    from kneegate.benchmarks.engine.server import build_app

    return build_app("cpu-tiny")
