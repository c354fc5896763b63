"""The gauges read at scrape time: one Collector over the live state, never pushed.

Gauges that mirror live state (limit, in-flight, queue depth, knee estimate) are read at
scrape time by a small Collector, never pushed from the hot path. So are the scraped engine
figures of each upstream that is scraped: `kneegate_engine_{running,waiting,kv_cache_usage}`
only while fresh (stale figures are absent, not repeated), `kneegate_engine_stats_age_seconds`
and `kneegate_engine_stale` (1 when there are no figures younger than `stale_after`), and
`kneegate_upstream_stalled` (running requests, no new tokens). Scrapes are counted by outcome
in `kneegate_engine_scrapes_total`.

The scale-out signal of the pool of upstreams (admission/demand.py), read at scrape time too:
`kneegate_demand_ratio` (offered load over what the usable upstreams serve at their
limits), `kneegate_suggested_replicas` (ceil(usable upstreams x ratio / scale.target)), and
the two rates the ratio is made of, `kneegate_demand_offered_requests_per_second` and
`kneegate_demand_capacity_requests_per_second`, so that several gateways in front of the
same engines add up as one pool: sum(offered) / sum(capacity). All four are absent until
the gateway has seen `warm` completions, and while no upstream is usable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kneegate.admission.demand import DemandEstimate
from kneegate.gateway.types import Clock
from kneegate.gateway.upstream.telemetry import Telemetry

__all__ = ["LiveCollector", "LiveUpstream"]


class LiveUpstream(Protocol):
    """What the scrape-time collector reads from an upstream."""

    name: str
    inflight: int
    handing: int  # of `inflight`, slots whose caller has not resumed (counted as queued)
    passing: int  # requests that are not generation in flight (no slot; not in `inflight`)
    usable: bool
    prefilling: int  # streamed requests in flight with no first token yet
    prefill_cap: int  # at most this many of them (0: no cap yet)
    models: dict[str, int | None] | None  # what it serves, where known

    @property
    def limit(self) -> int: ...

    @property
    def knee_estimate(self) -> float | None: ...

    def telemetry(self, now: float) -> Telemetry | None: ...


def _engine_families() -> dict[str, GaugeMetricFamily]:
    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=["upstream"])

    return {
        "running": gauge("kneegate_engine_running", "Requests the engine runs (fresh scrape)"),
        "waiting": gauge("kneegate_engine_waiting", "Requests queued in the engine (fresh scrape)"),
        "kv": gauge("kneegate_engine_kv_cache_usage", "Engine KV-cache use 0..1 (fresh scrape)"),
        "age": gauge("kneegate_engine_stats_age_seconds", "Age of the last good engine scrape"),
        "stale": gauge("kneegate_engine_stale", "1 when no engine figures are fresh enough to use"),
        "stalled": gauge("kneegate_upstream_stalled",
                         "1 when the engine runs requests but makes no new tokens"),
    }


def _add_engine(fams: dict[str, GaugeMetricFamily], name: str, t: Telemetry) -> None:
    fams["stale"].add_metric([name], 1.0 if t.stale else 0.0)
    fams["stalled"].add_metric([name], 1.0 if t.stalled else 0.0)
    if t.age is not None:
        fams["age"].add_metric([name], t.age)
    if t.stats is not None and not t.stale:
        fams["running"].add_metric([name], t.stats.running)
        fams["waiting"].add_metric([name], t.stats.waiting)
        if not math.isnan(t.stats.kv_cache_usage):
            fams["kv"].add_metric([name], t.stats.kv_cache_usage)


def _demand_families(pools: list[tuple[str, DemandEstimate | None]]) -> Iterator[Metric]:
    """The scale-out signal (admission/demand.py) of each pool of engines, labelled `model`
    by the models it serves ("" while unknown): absent, not zero, until it is known, so an
    autoscaler holds rather than scales in on a gateway that has measured nothing yet."""
    gauges = (
        ("kneegate_demand_ratio", "Offered load over what the usable upstreams serve at "
         "their limits (~1 just full, 3 at three times that, < 1 room)", "ratio"),
        ("kneegate_suggested_replicas", "Engines needed at the current demand: "
         "ceil(usable upstreams x demand ratio / scale.target)", "suggested_replicas"),
        ("kneegate_demand_offered_requests_per_second", "Requests offered per second, "
         "refused ones included", "offered"),
        ("kneegate_demand_capacity_requests_per_second", "Requests per second the usable "
         "upstreams serve at their limits", "capacity"),
    )
    for name, doc, attr in gauges:
        fam = GaugeMetricFamily(name, doc, labels=["model"])
        for model, e in pools:
            if e is not None:
                fam.add_metric([model], float(getattr(e, attr)))
        yield fam


class LiveCollector(Collector):
    def __init__(
        self,
        upstreams: Callable[[], Iterable[LiveUpstream]],
        queue_depths: Callable[[], Iterable[tuple[str, int]]],
        clock: Clock,
        demand: Callable[[float], list[tuple[str, DemandEstimate | None]]] | None = None,
    ) -> None:
        self._upstreams, self._depths, self._clock = upstreams, queue_depths, clock
        self._demand = demand

    def collect(self) -> Iterator[Metric]:
        ups = list(self._upstreams())
        families = {
            "limit": GaugeMetricFamily(
                "kneegate_limit", "Concurrency limit per upstream", labels=["upstream"]),
            "in_flight": GaugeMetricFamily(
                "kneegate_in_flight", "Requests holding a slot per upstream", labels=["upstream"]),
            "usable": GaugeMetricFamily(
                "kneegate_upstream_usable", "1 when the upstream takes requests",
                labels=["upstream"]),
            "knee": GaugeMetricFamily(
                "kneegate_knee_estimate", "Controller's knee estimate (NaN when none)",
                labels=["upstream"]),
            "prefilling": GaugeMetricFamily(
                "kneegate_awaiting_first_token",
                "Streamed requests in flight with no first token yet, per upstream",
                labels=["upstream"]),
            "prefill_cap": GaugeMetricFamily(
                "kneegate_prefill_cap",
                "Most streamed requests awaiting a first token per upstream (0: no cap yet)",
                labels=["upstream"]),
            "models": GaugeMetricFamily(
                "kneegate_upstream_model", "1 for each model an upstream serves (its "
                "/v1/models, or the config's); join on `upstream` for a series by model",
                labels=["upstream", "model"]),
        }
        engine = _engine_families()
        now = self._clock()
        for u in ups:
            knee = u.knee_estimate
            families["limit"].add_metric([u.name], u.limit)
            families["in_flight"].add_metric([u.name], u.inflight + u.passing - u.handing)
            families["usable"].add_metric([u.name], 1.0 if u.usable else 0.0)
            families["knee"].add_metric([u.name], math.nan if knee is None else knee)
            families["prefilling"].add_metric([u.name], u.prefilling)
            families["prefill_cap"].add_metric([u.name], u.prefill_cap)
            for model in u.models or ():
                families["models"].add_metric([u.name, model], 1.0)
            t = u.telemetry(now)
            if t is not None:
                _add_engine(engine, u.name, t)
        yield from families.values()
        yield from engine.values()
        depth = GaugeMetricFamily(
            "kneegate_queue_depth", "Requests waiting for a slot, by class", labels=["class"])
        for cls, n in self._depths():
            depth.add_metric([cls], n)
        yield depth
        yield from _demand_families([] if self._demand is None else self._demand(now))
