"""Which outcomes are the caller's doing (never a sample) and which the engine's drops."""

from __future__ import annotations

from kneegate.controllers.base import Outcome


def test_only_the_callers_outcomes_are_client_and_only_overload_and_timeout_are_drops() -> None:
    assert {o for o in Outcome if o.is_client} == {Outcome.CLIENT_CANCELLED,
                                                   Outcome.CLIENT_STALLED}
    assert {o for o in Outcome if o.is_drop} == {Outcome.TIMEOUT, Outcome.UPSTREAM_OVERLOADED}
