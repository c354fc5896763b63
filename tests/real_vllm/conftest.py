"""Fixtures for the real-vLLM tier: one live vLLM (CPU build, tiny model) for the session.

Selected with `pytest -m real_vllm` (deselected by default). The first run on a machine
builds vLLM's environment (see vllm_server.py); every run starts vLLM once (60-95 s on 2
cores) and stops it by its process group at the end. To iterate on the tests against one
vLLM, start it with `python tests/real_vllm/vllm_server.py` and set KNEEGATE_VLLM_URL to
the URL it prints.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # vllm_server, also for kneegate_bench.calibrate_vllm's --start

from vllm_server import HOME, MAX_MODEL_LEN, VllmServer, running_vllm  # noqa: E402


@pytest.fixture(scope="session")
def vllm() -> Iterator[VllmServer]:
    if url := os.environ.get("KNEEGATE_VLLM_URL"):
        # started by vllm_server.py
        yield VllmServer(url.rstrip("/"), -1, "tiny", MAX_MODEL_LEN, HOME)
        return
    with running_vllm() as server:
        yield server


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "asyncio", {"use_uvloop": True}  # the loop `kneegate serve` runs on
