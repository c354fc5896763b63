"""Every `kneegate_*` series, declared once, bound to an injected registry.

Counting is arranged so that nothing is lost without a count. At every scrape:

    received = admitted + shed + queue_timeout + queue_depth
    admitted = completed + upstream_error + client_cancelled + client_stalled + in_flight

(`shed` has reasons queue_full, no_upstream, shutting_down and client_gone — the caller
left while queued; `upstream_error` covers errors, timeouts and engine overload, detailed in
`kneegate_upstream_failures_total`). A request moved off an unreachable upstream
(`kneegate_upstream_reroutes_total`) is admitted once, under the upstream first chosen, and
finishes once, under the one that served it: the identities hold summed over upstreams.
Each counter moves in the same synchronous step as the state it counts, so the identities
hold exactly whenever the event loop can answer a scrape; with nothing queued or in flight
they are the bare identities of DESIGN.md.

Gauges that mirror live state (limit, in-flight, queue depth, knee estimate, the engines'
scraped figures, the scale-out signal) are read at scrape time, never pushed from the hot
path: gateway/observability/gauges.py.

Clients refused before their request reaches admission (its head too large or too slow, its
body too large or too slow, one connection too many, no API key the gateway knows: see
gateway/http/wire.py and the proxy's 400s, 401 and 413) are counted in
`kneegate_client_rejections_total{reason}`, outside the identities above: such a request
was never received.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kneegate.admission.demand import DemandEstimate
from kneegate.controllers.base import Outcome
from kneegate.gateway.observability.gauges import LiveCollector, LiveUpstream
from kneegate.gateway.types import Clock

try:  # the single-process value class the fast children write to (prometheus_client 0.2x)
    from prometheus_client.values import MutexValue
except ImportError:  # moved or renamed: every child stays prometheus' own (`_plain`)
    MutexValue = None  # type: ignore[assignment,misc]

__all__ = ["CLIENT_REJECTIONS", "FINISHED", "GatewayMetrics"]

# The `reason` label of kneegate_client_rejections_total (each series exists from the start).
CLIENT_REJECTIONS = (
    "malformed_request",  # 400: the HTTP parser refused it (e.g. a malformed Content-Length)
    "upgrade",  # 400: Connection: upgrade (WebSocket, h2c): never proxied
    "header_bytes",  # 431: request line plus headers over limits.max_header_bytes
    "header_count",  # 431: more than limits.max_headers header fields
    "header_timeout",  # 408 (or a silent close) after limits.header_timeout
    "body_timeout",  # 408: no body bytes for limits.body_timeout
    "body_deadline",  # 408: the body not whole within limits.body_deadline of its first read
    "body_too_large",  # 413: over max_body_bytes, by Content-Length or as it arrived
    "invalid_header",  # 400: two Authorization headers, an X-Request-Id too long, or an
    # x-kneegate-ttft-ms that is not a decimal number of ms in (0, 3600000]
    "invalid_path",  # 400 / 404: a path that had to be normalised and is refused (app.py)
    "not_found",  # 404: neither a proxied path nor one of the gateway's own
    "method_not_allowed",  # 405: a method the path does not take
    "invalid_body",  # 400: a generation request whose body is not a JSON object
    "context_length",  # 400: surely longer than the engine's context (max_model_len)
    "model_not_found",  # 404: a model no engine serves (admission/pools.py)
    "model_required",  # 400: no model named, and the engines serve several
    "connection_limit",  # 503: a request on a connection over limits.max_connections
    "client_connection_limit",  # 503: over limits.max_connections_per_client from one address
    "invalid_api_key",  # 401: require_api_key, and no configured key (gateway/api_keys.py)
)

# Outcome -> the `outcome` label of kneegate_requests_finished_total.
FINISHED = {
    Outcome.OK: "completed",
    Outcome.UPSTREAM_ERROR: "upstream_error",
    Outcome.TIMEOUT: "upstream_error",
    Outcome.UPSTREAM_OVERLOADED: "upstream_error",
    Outcome.CLIENT_CANCELLED: "client_cancelled",
    Outcome.CLIENT_STALLED: "client_stalled",
}
_FAILURE_KIND = {
    Outcome.UPSTREAM_ERROR: "error",
    Outcome.TIMEOUT: "timeout",
    Outcome.UPSTREAM_OVERLOADED: "overloaded",
}

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """All of the gateway's series. One instance per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.received = Counter(
            "kneegate_requests_received", "Requests offered to admission", ["class"], registry=r)
        self.admitted = Counter(
            "kneegate_requests_admitted", "Requests given a slot", ["upstream", "class"],
            registry=r)
        self.shed = Counter(
            "kneegate_requests_shed", "Requests refused without a slot", ["class", "reason"],
            registry=r)
        self.queue_timeout = Counter(
            "kneegate_requests_queue_timeout", "Requests that waited past their class timeout",
            ["class"], registry=r)
        self.finished = Counter(
            "kneegate_requests_finished", "Admitted requests by how they ended",
            ["upstream", "outcome"], registry=r)
        self.requeued = Counter(
            "kneegate_requests_requeued", "Admitted requests an engine refused unstarted "
            "(vLLM's own valve), put back at the head of their queue", ["class"],
            registry=r)
        self.failures = Counter(
            "kneegate_upstream_failures", "Upstream errors by kind", ["upstream", "kind"],
            registry=r)
        self.reroutes = Counter(
            "kneegate_upstream_reroutes", "Requests moved to another upstream because this one "
            "could not be reached (connect refused or timed out)", ["upstream"], registry=r)
        self.queue_wait = Histogram(
            "kneegate_queue_wait_seconds", "Time from arrival to a slot", ["class"],
            buckets=_WAIT_BUCKETS, registry=r)
        self.ttft = Histogram(
            "kneegate_ttft_seconds", "Dispatch to first streamed event", ["upstream"],
            buckets=_TTFT_BUCKETS, registry=r)
        self.user_ttft = Histogram(
            "kneegate_request_ttft_seconds", "Arrival at the gateway to the first streamed "
            "event: the user's time to first token", ["class"], buckets=_TTFT_BUCKETS,
            registry=r)
        self.ttft_objective = Gauge(
            "kneegate_ttft_objective_seconds", "Each class's TTFT objective, seconds from "
            "arrival (+Inf: none); alerts compare kneegate_request_ttft_seconds with it",
            ["class"], registry=r)
        self.goodput_tokens = Counter(
            "kneegate_goodput_tokens", "Output tokens of requests whose first token met "
            "their objective (from arrival)", ["class"], registry=r)
        self.tpot = Histogram(
            "kneegate_tpot_seconds", "Time per output token after the first", ["upstream"],
            buckets=_TPOT_BUCKETS, registry=r)
        self.output_tokens = Counter(
            "kneegate_output_tokens", "Output tokens relayed", ["upstream"], registry=r)
        self.scrapes = Counter(
            "kneegate_engine_scrapes", "Engine /metrics scrapes by outcome (ok, timeout, error, "
            "http_error, unparsable)", ["upstream", "outcome"], registry=r)
        self.controller_errors = Counter(
            "kneegate_controller_errors", "Exceptions a controller raised (its update is "
            "skipped; the request is unaffected)", ["upstream", "hook"], registry=r)
        self.reloads = Counter(
            "kneegate_config_reloads", "Config reloads by result (ok, error)", ["result"],
            registry=r)
        self.client_rejections = Counter(
            "kneegate_client_rejections", "Clients refused before admission, by reason",
            ["reason"], registry=r)
        for reason in CLIENT_REJECTIONS:
            self.client_rejections.labels(reason)
        # tenants (gateway/tenants.py names them: configured names, hashed keys, `other`)
        self.tenant_admitted = Counter(
            "kneegate_tenant_admitted", "Requests given a slot, by tenant",
            ["tenant", "class"], registry=r)
        self.tenant_rejected = Counter(
            "kneegate_tenant_rejected", "Requests refused or timed out in the queue, by "
            "tenant (the reasons of kneegate_requests_shed, and queue_timeout)",
            ["tenant", "class", "reason"], registry=r)
        self.tenant_output_tokens = Counter(
            "kneegate_tenant_output_tokens", "Output tokens relayed, by tenant",
            ["tenant", "class"], registry=r)
        self.fairness = Gauge(
            "kneegate_fairness_jain", "Jain's index over the service (weighted tokens) the "
            "tenants backlogged in a class got in the last second: 1 equal, 1/n one took "
            "all; 1 while fewer than two tenants wait", ["class"], registry=r)
        for result in ("ok", "error"):  # from 0: increase() sees the first failed reload
            self.reloads.labels(result)
        self._live: LiveCollector | None = None
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # (upstream, outcome's value) -> what `count_finished` moves, resolved once
        self._finish: dict[tuple[str, str], _Finish] = {}
        self._user: dict[str, tuple[Any, Any]] = {}  # class -> (user_ttft, goodput_tokens)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: the hot path skips prometheus' label checks
        (and, where it can, its per-call checks and bucket loop: `_fast`)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = _fast(metric.labels(*labels))
        return c

    def bind_live(
        self,
        upstreams: Callable[[], Iterable[LiveUpstream]],
        queue_depths: Callable[[], Sequence[tuple[str, int]]],
        clock: Clock = time.monotonic,
        demand: Callable[[float], list[tuple[str, DemandEstimate | None]]] | None = None,
    ) -> None:
        """Register the scrape-time reader of limit, in-flight, queue depth, knee, the
        engine figures (aged on `clock`) and the pool's `demand` at that time."""
        if self._live is not None:
            self.registry.unregister(self._live)
        self._live = LiveCollector(upstreams, queue_depths, clock, demand)
        self.registry.register(self._live)

    def set_objectives(self, objectives: dict[str, float]) -> None:
        """The classes' TTFT objectives (at start and at each reload: removed classes go)."""
        self.ttft_objective.clear()
        for cls, seconds in objectives.items():
            self.ttft_objective.labels(cls).set(seconds)

    def count_client_rejection(self, reason: str) -> None:
        """One client refused before admission; `reason` is one of CLIENT_REJECTIONS."""
        self.child(self.client_rejections, reason).inc()

    def count_scrape(self, upstream: str, outcome: str) -> None:
        self.child(self.scrapes, upstream, outcome).inc()

    def count_finished(
        self, upstream: str, outcome: Outcome, ttft: float | None, tpot: float | None,
        output_tokens: int,
    ) -> None:
        # keyed by the outcome's value: a str hashes in C, an Enum member in Python
        f = self._finish.get((upstream, outcome._value_))
        if f is None:
            f = self._finish[upstream, outcome._value_] = self._finished_children(upstream,
                                                                                  outcome)
        finished, failure, ttft_child, tpot_child, tokens = f
        finished.inc()
        if failure is not None:
            failure.inc()
        if ttft is not None:
            ttft_child.observe(ttft)
        if tpot is not None:
            tpot_child.observe(tpot)
        if output_tokens:
            tokens.inc(output_tokens)

    def _finished_children(self, upstream: str, outcome: Outcome) -> _Finish:
        kind = _FAILURE_KIND.get(outcome)
        child = self.child
        return (child(self.finished, upstream, FINISHED[outcome]),
                None if kind is None else child(self.failures, upstream, kind),
                child(self.ttft, upstream), child(self.tpot, upstream),
                child(self.output_tokens, upstream))

    def count_user_ttft(self, cls: str, ttft: float, output_tokens: int, met: bool) -> None:
        """One answer's first token `ttft` s after arrival; its tokens are goodput if `met`."""
        c = self._user.get(cls)
        if c is None:
            c = self._user[cls] = (self.child(self.user_ttft, cls),
                                   self.child(self.goodput_tokens, cls))
        c[0].observe(ttft)
        if met and output_tokens:
            c[1].inc(output_tokens)


_Finish = tuple[Any, Any, Any, Any, Any]  # finished, failure (or None), ttft, tpot, tokens


class _FastCounter:
    """A counter child's `inc`, adding to prometheus' own value without its lock (see
    `_fast`) and without the checks a child never fails."""

    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value._value += amount


class _FastHistogram:
    """A histogram child's `observe`: a binary search instead of prometheus' loop over the
    buckets, adding to its values without their locks (see `_fast`)."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, bounds: list[float], buckets: list[Any], total: Any) -> None:
        self._bounds, self._buckets, self._sum = bounds, buckets, total

    def observe(self, amount: float) -> None:
        self._sum._value += amount
        if amount <= math.inf:  # NaN counts in the sum only, as in prometheus
            self._buckets[bisect_left(self._bounds, amount)]._value += 1


def _plain(value: object) -> bool:
    # prometheus' single-process value: a float under a lock (the multiprocess one is not)
    return (MutexValue is not None and type(value) is MutexValue
            and isinstance(getattr(value, "_value", None), float))


def _fast(child: Any) -> Any:
    """`child` with a cheaper `inc` / `observe` writing the same values, or `child` itself
    when its inside is not what this was written against (prometheus_client 0.2x;
    tests/gateway/observability/test_metrics.py pins both to the same samples).

    Why no lock: every `kneegate_*` counter and histogram moves on the event loop's thread
    only (the hot path, the tick, the scrapes), and the lock's `with` costs more than the
    addition: about half of what a counter's `inc` costs, per request ~13 of them. The
    exposition still reads each value under its lock; with one writer it reads a whole
    float either way.
    """
    if isinstance(child, Histogram):
        bounds = getattr(child, "_upper_bounds", None)
        buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
        if (isinstance(bounds, list) and isinstance(buckets, list)
                and len(buckets) == len(bounds) and bounds and bounds[-1] == math.inf
                and _plain(total) and all(_plain(v) for v in buckets)):
            return _FastHistogram(bounds, buckets, total)
        return child
    value = getattr(child, "_value", None)
    if isinstance(child, Counter) and _plain(value):
        return _FastCounter(value)
    return child
