"""Gateway tests run their async code on asyncio (uvloop is what `kneegate serve` uses)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
