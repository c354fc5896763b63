"""The emulator on a real socket, a fixture for the emulator's and the load tools' tests
(their conftest.py imports it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.uvicorn_thread import serve
from kneegate.emulator.server import build_app


@pytest.fixture(scope="module")
def emulator() -> Iterator[tuple[str, object]]:
    """cpu-tiny in real time; yields (base URL, app)."""
    app = build_app("cpu-tiny", speed=1.0)
    with serve(app) as url:
        yield url, app
