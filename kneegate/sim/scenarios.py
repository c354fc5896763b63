"""Scenarios: the simulator's workloads, read from the YAML files in kneegate/sim/scenarios/.


A `Scenario` names its engine profile, traffic classes, phases (load, slowdown, bursts)
and tenants; `load_scenario` reads one by name, `scenario_names` lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SCENARIOS", "Burst", "Phase", "Scenario", "Tenant", "TrafficClass", "load_scenario",
           "scenario_names"]


SCENARIOS = Path(__file__).with_name("scenarios")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Burst(_Strict):
    on_s: float = Field(gt=0, description="seconds of arrivals")
    off_s: float = Field(gt=0, description="seconds of silence")


class Phase(_Strict):
    """From `at` on; fields left out keep the previous phase's value."""

    at: float = Field(0.0, ge=0)
    load: float | None = Field(None, ge=0, description="arrival rate, x the knee's request rate")
    slowdown: float | None = Field(None, gt=0, description="engine step-time multiplier")
    prompt_scale: float | None = Field(None, gt=0, description="prompt length multiplier")
    burst: Burst | None = None


class TrafficClass(_Strict):
    name: str = "default"
    share: float = Field(1.0, gt=0, description="fraction of arrivals")
    priority: int = 0
    max_wait: float = Field(5.0, gt=0, description="seconds in the gateway queue before 503")
    ttft: float | None = Field(None, gt=0, description="TTFT objective; default the scenario's")
    tpot: float | None = Field(None, gt=0, description="TPOT objective; default the scenario's")


class Tenant(_Strict):
    """One tenant of a scenario: its part of the arrivals and its weight (fair shares)."""

    name: str
    share: float = Field(gt=0, description="fraction of arrivals (relative to the others)")
    weight: float = Field(1.0, gt=0, description="its fair-share weight in the gateway")
    listed: bool = Field(True, description="a tenant the config lists; false: an API key "
                         "no config lists (`TenantPolicy.unlisted`)")
    mint: bool = Field(False, description="a fresh unlisted key for each request (a client "
                       "minting keys, or each request a new user's first)")


class Scenario(_Strict):
    name: str
    description: str = ""
    profile: str
    profile_overrides: dict[str, Any] = Field(default_factory=dict)
    duration: float = Field(180.0, gt=0)
    warmup: float = Field(30.0, ge=0)
    prompt_tokens: int = Field(512, ge=1)
    output_tokens: int = Field(256, ge=2)
    ttft: float = Field(2.0, gt=0, description="TTFT objective, seconds")
    tpot: float = Field(0.15, gt=0, description="TPOT objective, seconds")
    classes: list[TrafficClass] = Field(default_factory=lambda: [TrafficClass()])
    max_queue: int = Field(256, ge=1)
    gateways: int = Field(1, ge=1, le=16)
    phases: list[Phase] = Field(default_factory=lambda: [Phase(load=3.0)])
    controller_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    oracle_limits: list[int] | None = None
    tenants: list[Tenant] = Field(
        default_factory=list, description="none: every request is the same (anonymous) tenant")
    trace: str | None = Field(
        None, description="a production trace (`kneegate.sim.trace.TRACES`): its arrivals' "
        "spacing and its requests' lengths, fitted to the profile's context, replace the "
        "Poisson arrivals and the uniform lengths; `load` is then x the capacity for its mix")
    trace_start: int = Field(0, ge=0, description="the trace row seed 0 starts at")

    @model_validator(mode="after")
    def _trace_has_no_bursts(self) -> Scenario:
        if self.trace is not None and any(p.burst for p in self.phases):
            raise ValueError("a trace scenario keeps the trace's own bursts: no `burst` phases")
        return self

    @property
    def changes(self) -> list[float]:
        return [p.at for p in self.phases if p.at > 0 and (p.slowdown or p.prompt_scale)]


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load_scenario(name: str) -> Scenario:
    path = SCENARIOS / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"unknown scenario {name!r}; choose one of {scenario_names()} or 'all'")
    return Scenario(**yaml.safe_load(path.read_text()))

