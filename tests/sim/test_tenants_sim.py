"""Fair shares between tenants in the simulator (issue 15): the same arrivals served with
fair shares and with one FIFO."""

from __future__ import annotations

import pytest

from kneegate.admission.fairness import jain_index
from kneegate.sim.cli import (
    Tenant,
    load_scenario,
    run,
    tenant_rows,
    water_fill,
)
from kneegate.sim.goodput import goodput


def test_water_fill_caps_each_at_its_demand_and_shares_the_rest_by_weight() -> None:
    assert water_fill(90, {"a": 10, "b": 100, "c": 100}, {"a": 1, "b": 1, "c": 2}) == {
        "a": 10, "b": pytest.approx(80 / 3), "c": pytest.approx(160 / 3)}
    assert water_fill(300, {"a": 10, "b": 20}, {"a": 1, "b": 1}) == {"a": 10, "b": 20}
    assert jain_index([1, 1, 1]) == 1.0 and jain_index([3, 0, 0]) == pytest.approx(1 / 3)


def test_a_lone_tenant_gets_exactly_what_one_fifo_gives_it() -> None:
    # work-conserving: alone, the fair queue is a FIFO, decision for decision
    sc = load_scenario("tenants-heavy-light").model_copy(
        update={"duration": 60.0, "warmup": 10.0, "tenants": [Tenant(name="solo", share=1)]})
    fair, fifo = run(sc, "knee", 7), run(sc, "knee", 7, fair=False)
    assert [(r.fate, r.dispatched) for r in fair.requests] == [
        (r.fate, r.dispatched) for r in fifo.requests]
    assert goodput(fair, sc, 10.0, 60.0) == goodput(fifo, sc, 10.0, 60.0) > 0


def test_light_tenants_get_their_share_where_one_fifo_gave_them_a_fraction() -> None:
    sc = load_scenario("tenants-heavy-light").model_copy(update={"duration": 90.0})
    rows, total, total_fifo = tenant_rows(sc, "knee", 7)
    light = [r for r in rows if r.tenant.startswith("light")]
    assert len(light) == 5
    for r in light:
        due = min(r.fair_share, r.demand)
        assert r.goodput >= 0.85 * due, r  # 0.91 at the least here; the goal (0.9): docs
        # one FIFO leaves them well under it (0.37-0.63 here: the gateway's slow start lets
        # the first seconds' burst in, where the FIFO's first light arrivals fare better)
        assert r.fifo <= 0.66 * due, r
    heavy = next(r for r in rows if r.tenant == "heavy")
    assert heavy.fifo > 2.5 * heavy.fair_share > heavy.goodput
    assert total == pytest.approx(total_fifo, rel=0.05)
