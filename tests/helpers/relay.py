"""The gateway tests' fixtures: async code on uvloop, the loop `kneegate serve` runs on.

`relay` runs a test through both relays of kneegate's server (gateway/http/wire.py): the push
relay, and plain ASGI `send`, which the server falls back to when its probe finds uvicorn's
request cycle changed (forced here: the probe is asked for an attribute no uvicorn has).
With `KNEEGATE_WIRE_FALLBACK=1` in the environment the whole process runs on the fallback
(as CI does for the wire and client-limit tests): the "push" runs are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import uvicorn

from kneegate.gateway.http import body_writer
from kneegate.gateway.http.body_writer import FALLBACK_ENV
from kneegate.gateway.http.wire import KneegateHttpProtocol

WARNING = "relaying through ASGI send instead"
FALLBACK = os.environ.get(FALLBACK_ENV) == "1"  # the whole run is on the fallback


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(params=["push", "send"])
def relay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
          caplog: pytest.LogCaptureFixture) -> Iterator[str]:
    """Which relay carries the test's responses ("push" or "send"); the probe runs afresh.
    Ask for it before the fixtures that start servers. Afterwards it checks the relay
    was the one asked for, and that the fallback said so in exactly one warning."""
    if FALLBACK and request.param == "push":
        pytest.skip(f"{FALLBACK_ENV}=1: the push relay is off in this run")
    monkeypatch.setattr(KneegateHttpProtocol, "relay", None)
    if request.param == "send":
        needs = (*body_writer.CYCLE_NEEDS, ("renamed_by_a_newer_uvicorn", bool))
        monkeypatch.setattr(body_writer, "CYCLE_NEEDS", needs)
    yield request.param
    assert KneegateHttpProtocol.relay is (request.param == "push"), (
        f"asked for the {request.param} relay; on uvicorn {uvicorn.__version__} the probe "
        "said otherwise (its warning names what gateway/http/body_writer.py reads and is not "
        "there)")
    warned = [r for phase in ("setup", "call") for r in caplog.get_records(phase)
              if WARNING in r.getMessage()]
    assert len(warned) == (request.param == "send"), [r.getMessage() for r in warned]
