"""Every simulator scenario: `knee` over its oracle at seed 7 keeps its floor.

The floors (`sim_floors.yaml`) are the ratios last measured, less 0.02: a change to `knee`,
the admission queue or the wait prediction that costs any scenario more than that fails
here, before a wall-clock run is needed (docs/changing-knee.md). Opt-in: `pytest -m
simulator`; CI runs it. The scenarios selected run at once, one process per core (the
simulator is virtual time: the ratios do not depend on the machine or its load), about
3 minutes on 2 cores.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml

from kneegate.sim.cli import load_scenario, scenario_names, simulate

FLOORS: dict[str, float] = yaml.safe_load(Path(__file__).with_name("sim_floors.yaml").read_text())


def _ratio(name: str) -> tuple[str, float]:
    """`knee` over its oracle for one scenario at seed 7 (in a worker process)."""
    row = simulate(load_scenario(name), ["knee"], 7, None)[0]
    assert row.controller.startswith("knee")
    return name, row.ratio


@pytest.fixture(scope="session")
def ratios(request: pytest.FixtureRequest) -> dict[str, float]:
    """Every selected scenario's ratio, run in parallel, the longest first."""
    names = [str(item.callspec.params["name"]) for item in request.session.items
             if isinstance(item, pytest.Function)
             and item.originalname == "test_knee_keeps_its_floor_against_the_oracle"]
    names.sort(key=lambda n: not n.startswith("trace-"))  # the traces take longest
    with ProcessPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        return dict(pool.map(_ratio, names))


def test_every_scenario_has_a_floor() -> None:
    assert sorted(FLOORS) == scenario_names()


@pytest.mark.simulator
@pytest.mark.parametrize("name", scenario_names())
def test_knee_keeps_its_floor_against_the_oracle(name: str, ratios: dict[str, float]) -> None:
    ratio = ratios[name]
    assert ratio >= FLOORS[name], f"{name}: {ratio:.3f} of the oracle, floor {FLOORS[name]}"
