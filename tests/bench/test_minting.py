"""A client that mints a fresh API key per request, against the tenants' fair shares, in the
simulator (kneegate_bench.minting; issue 44)."""

from __future__ import annotations

from kneegate.sim.cli import load_scenario, run
from kneegate_bench.minting import compare, newcomers, served


def test_light_tenants_keep_their_share_when_the_heavy_client_mints_a_key_per_request() -> None:
    # issue 44: each minted key used to start level with the least served, one share each
    # (the light tenants' good share fell to 0.02x); pooled until served, they share one
    sc = load_scenario("tenants-minting").model_copy(update={"duration": 90.0})
    rows = compare(sc, "knee", 7)
    for name, (one_key, minting) in rows.items():
        if name.startswith("light"):
            assert minting.good >= 0.9 * one_key.good, (name, one_key, minting)
    heavy_one, heavy_minting = rows["heavy"]
    assert heavy_minting.goodput <= 1.1 * heavy_one.goodput


def test_a_new_users_first_request_is_served_promptly() -> None:
    # each request of `new` is a key never seen: it waits in the pool, not behind everyone
    sc = load_scenario("tenants-minting").model_copy(update={"duration": 90.0})
    s = served(run(newcomers(sc, 0.5), "knee", 7), sc, "new")
    assert s.arrived > 50 and s.served >= 0.95, s
    assert s.waits[len(s.waits) * 9 // 10] <= 0.5 and s.waits[-1] <= 2.0, s.waits
