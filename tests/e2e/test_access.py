"""Who may do what, over real sockets: header-picked classes are opt-in per class and API keys
win (issue 11, defect 11); the admin bearer scheme is case-insensitive (RFC 9110 §11.1)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.gateway import EXAMPLE, FakeEngine, assert_conserved
from helpers.rig import serve_rig

from kneegate.gateway.config.gateway import load_config
from kneegate.gateway.forwarding import ProxySettings

pytestmark = pytest.mark.anyio

CLASSES: dict[str, dict[str, Any]] = {"standard": {"priority": 10}, "top": {"priority": 20}}


async def _received(headers: list[dict[str, str]], **cfg_kw: Any) -> dict[str, float]:
    """Send one request with each of `headers`; the requests received, by class."""
    async with serve_rig(FakeEngine(), default_class="standard", **cfg_kw) as rig:
        for h in headers:
            r = await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 1},
                                      headers=h)
            assert r.status_code == 200
        m = await rig.metrics()
        assert_conserved(m)
        return {dict(labels)["class"]: v for (name, labels), v in m.items()
                if name == "kneegate_requests_received_total"}


async def test_a_client_cannot_pick_a_class_that_did_not_opt_in() -> None:
    got = await _received([{"x-kneegate-class": "top"}], classes=CLASSES)
    assert got == {"standard": 1}


async def test_the_header_picks_an_opted_in_class_and_keys_win() -> None:
    classes = {**CLASSES, "batch": {"priority": 0, "header": True}}
    got = await _received([
        {"x-kneegate-class": "batch"},  # opted in
        {"x-kneegate-class": "batch", "authorization": "Bearer sk-top"},  # the key wins
        {"x-kneegate-class": "top", "authorization": "Bearer sk-unknown"},  # neither
    ], classes=classes, api_keys={"sk-top": "top"})
    assert got == {"batch": 1, "top": 1, "standard": 1}


def test_the_header_set_is_prepared_from_the_config() -> None:
    s = ProxySettings.from_config(load_config(EXAMPLE))
    assert s.classes == {b"batch": "batch"}
    assert s.classify(b"interactive", None) == "interactive"  # the default anyway
    assert s.classify(b"batch", b"bearer sk-batch-jobs-0001") == "batch"


async def test_the_bearer_scheme_is_case_insensitive() -> None:
    cases = [
        ("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER   s3cret", 200),
        ("bearer nope", 401), ("Basic s3cret", 401), ("s3cret", 401), ("bearer", 401),
        ("bearer s3cret2", 401), (None, 401),
    ]
    async with serve_rig(FakeEngine(), admin_token="s3cret") as rig:
        for authorization, status in cases:
            headers = {"authorization": authorization} if authorization is not None else {}
            r = await rig.client.get(rig.gw + "/kneegate/status", headers=headers)
            assert r.status_code == status, authorization
            if status == 401:
                assert r.json()["error"]["code"] == "unauthorized"
        r = await rig.client.post(rig.gw + "/kneegate/reload",
                                  headers={"authorization": "bearer s3cret"})
        assert r.status_code == 400 and "no config file" in r.json()["message"]  # past the check
        assert_conserved(await rig.metrics())
