"""Every simulator scenario: `knee` over its oracle at seed 7 keeps its floor.

The floors (`sim_floors.yaml`) are the ratios last measured, less 0.02: a change to `knee`,
the admission queue or the wait prediction that costs any scenario more than that fails
here, before a wall-clock run is needed (docs/changing-knee.md). Opt-in, about 3.5 minutes
on 2 cores: `pytest -m simulator`; CI runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kneegate.sim.cli import load_scenario, scenario_names, simulate

FLOORS: dict[str, float] = yaml.safe_load(Path(__file__).with_name("sim_floors.yaml").read_text())


def test_every_scenario_has_a_floor() -> None:
    assert sorted(FLOORS) == scenario_names()


@pytest.mark.simulator
@pytest.mark.parametrize("name", scenario_names())
def test_knee_keeps_its_floor_against_the_oracle(name: str) -> None:
    row = simulate(load_scenario(name), ["knee"], 7, None)[0]
    assert row.controller.startswith("knee")
    assert row.ratio >= FLOORS[name], f"{name}: {row.ratio:.3f} of the oracle, floor {FLOORS[name]}"
