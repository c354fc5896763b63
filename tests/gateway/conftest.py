"""Gateway tests run their async code on uvloop, the loop `kneegate serve` runs on."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "asyncio", {"use_uvloop": True}
