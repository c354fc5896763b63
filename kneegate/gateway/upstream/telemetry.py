"""Engine telemetry: read an engine's Prometheus /metrics into `EngineStats`, and judge progress.

vLLM names (current first, older fallbacks after), each summed over the `engine` label and
any other labels (one vLLM process may serve several engine cores):

    running       vllm:num_requests_running
    waiting       vllm:num_requests_waiting
    kv usage      vllm:kv_cache_usage_perc      <- vllm:gpu_cache_usage_perc (before V1)
    preemptions   vllm:num_preemptions_total    <- vllm:num_preemptions
    generated     vllm:generation_tokens_total
    queue time    vllm:request_queue_time_seconds (its _sum and _count)
    token gaps    vllm:inter_token_latency_seconds   <- vllm:time_per_output_token_seconds
                  (before 0.11; its _sum and _count)
    KV capacity   vllm:cache_config_info{num_gpu_blocks, block_size}: blocks x block size, in
                  tokens (an info gauge whose labels carry the engine's CacheConfig)

`gateway.upstream.pool` scrapes each upstream every `scrape_interval` (1 s by default: the `knee`
controller was tuned in the simulator on 1 s scrapes arriving 1.5 s late) and feeds the
figures to its controller unless they are older than `stale_after`; with `scrape` unset, only
once its /metrics has shown vLLM series, and never with `scrape: false`.

Scraped figures lag by a scrape interval or more: controllers combine them with the gateway's
own in-flight count (instant) and never rely on them alone. `Progress` turns successive
scrapes into a health verdict: an engine with running requests whose generation counter does
not advance for `stall_after` seconds is stuck, whatever its /health says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kneegate.controllers.base import EngineStats

__all__ = ["Progress", "Telemetry", "parse_engine_metrics"]

_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions_total": ("vllm:num_preemptions",),
    "generation_tokens_total": ("vllm:generation_tokens",),
}
# prometheus_client's parser strips `_total` from counter family names, so the counters above
# are listed by their family name; samples keep the suffix and are matched by family. A
# counter exposed without its TYPE line keeps the suffix in its family name: it is stripped
# here too. A family with no samples reads as 0 for the gauges (no engine core has work) and
# as unknown for the rest: a counter that reads 0 forever would look like a stalled engine.
_ZERO_WHEN_EMPTY = ("running", "waiting")
_CACHE_CONFIG = "vllm:cache_config_info"  # vLLM's TYPE line says gauge: the name stays whole
# histograms read by their _sum and _count, as EngineStats' field prefix: (current, older)
_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "queue_time": ("vllm:request_queue_time_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
_HISTOGRAM_OF = {name for names in _HISTOGRAMS.values() for name in names}


def parse_engine_metrics(text: str, at: float) -> EngineStats | None:
    """EngineStats from an exposition text; None when the text has no vLLM scheduler gauges."""
    sums: dict[str, float] = {}
    hists: dict[str, tuple[float, float]] = {}  # by name: (sum, count)
    capacity = math.nan
    for family in text_string_to_metric_families(text):
        if family.name == _CACHE_CONFIG:
            capacity = _kv_capacity(family.samples)
            continue
        if family.name in _HISTOGRAM_OF:
            hists[family.name] = (sum(_values(family.samples, family.name + "_sum")),
                                  sum(_values(family.samples, family.name + "_count")))
            continue
        name = family.name.removesuffix("_total")
        for field_name, names in _NAMES.items():
            if name in names and field_name not in sums:
                values = _values(family.samples, name)
                if not values and field_name not in _ZERO_WHEN_EMPTY:
                    continue
                # a fraction does not add up across engine cores: take the fullest
                sums[field_name] = max(values) if field_name == "kv_cache_usage" else sum(values)
    if "running" not in sums or "waiting" not in sums:
        return None
    for field_name, names in _HISTOGRAMS.items():  # the current name where both are exposed
        if (found := next((hists[n] for n in names if n in hists), None)) is not None:
            sums[field_name + "_sum"], sums[field_name + "_count"] = found
    return EngineStats(
        at=at,
        running=sums["running"],
        waiting=sums["waiting"],
        kv_cache_usage=sums.get("kv_cache_usage", math.nan),
        preemptions_total=sums.get("preemptions_total", math.nan),
        generation_tokens_total=sums.get("generation_tokens_total", math.nan),
        kv_capacity_tokens=capacity,
        queue_time_sum=sums.get("queue_time_sum", math.nan),
        queue_time_count=sums.get("queue_time_count", math.nan),
        itl_sum=sums.get("itl_sum", math.nan),
        itl_count=sums.get("itl_count", math.nan),
    )


def _kv_capacity(samples: list[Sample]) -> float:
    """Tokens the KV caches hold, summed over engine cores; NaN when a core's size is not
    known (vLLM labels num_gpu_blocks "None" until the cache is allocated)."""
    total = 0.0
    for s in samples:
        try:
            total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
        except (KeyError, ValueError):
            return math.nan
    return total if samples else math.nan


def _values(samples: list[Sample], family: str) -> list[float]:
    # counters expose `<family>_total` (and `_created`); gauges expose the family name itself
    wanted = (family, family + "_total")
    return [float(s.value) for s in samples if s.name in wanted]


@dataclass
class Progress:
    """Is the engine making progress? Fed one EngineStats per scrape."""

    stall_after: float = 10.0  # seconds with running > 0 and no new tokens before "stuck"
    stale_after: float = 5.0  # a scrape older than this is not evidence of anything
    _last_tokens: float = math.nan
    _advanced_at: float | None = None
    _last: EngineStats | None = None

    def note(self, stats: EngineStats) -> None:
        tokens = stats.generation_tokens_total
        # NaN never equals itself: an engine without the counter always counts as advancing
        if self._advanced_at is None or stats.running == 0 or tokens != self._last_tokens:
            self._advanced_at = stats.at  # idle engines and advancing counters both count
        self._last_tokens = tokens
        self._last = stats


    def view(self, now: float, stalled: bool) -> Telemetry:
        """What the status page and /metrics show for this engine at `now`."""
        last = self._last
        age = None if last is None else max(0.0, now - last.at)
        return Telemetry(last, age, age is None or age > self.stale_after, stalled)

    def stuck(self, now: float) -> bool:
        """True when the engine had running requests and produced nothing for stall_after."""
        if self._advanced_at is None or self._last is None:
            return False
        return self._last.running > 0 and now - self._advanced_at >= self.stall_after



@dataclass(frozen=True, slots=True)
class Telemetry:
    """One upstream's engine figures as shown on the status page and /metrics."""

    stats: EngineStats | None  # the last good scrape, None before the first
    age: float | None  # seconds since `stats` was taken
    stale: bool  # no figures, or older than stale_after: not evidence, not exported
    stalled: bool  # the upstream is unusable: running requests and no new tokens
