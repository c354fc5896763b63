"""vLLM's /metrics, on a private registry: same names, `model_name` and `engine` labels.

Gauges and token counters are read from the core at scrape time (a Collector); request
outcomes and latency histograms are observed by the real-time driver as tokens go out.
Buckets are vLLM's (vllm/v1/metrics/loggers.py). `vllm:cache_config_info` carries the KV
cache's size in its labels (num_gpu_blocks, block_size), as vLLM's does.

`vllm:admission_rejections_total{model_name, reason}` counts requests refused by the admission
caps (reason: "max_num_queued_reqs" or "max_num_queued_tokens", both series present from the
start at 0). vLLM 0.32 lists it as a counter, "Number of admission attempts rejected"
(docs/usage/metrics.md); vllm-project/vllm#55812 gives it a `reason` label and no `engine`
label. The label values are not in any source we could read: the emulator uses the names of
the two settings, which is what the PR says the label tells apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kneegate.emulator.core import ADMISSION_REASONS, CoreStats

__all__ = ["EngineMetrics"]

_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_REQUEST_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
FINISH_REASONS = ("stop", "length", "abort")


class _CoreCollector:
    """Reads the core's counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], CoreStats], labels: dict[str, str]) -> None:
        self._stats, self._labels = stats, labels

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                s.running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_cache_usage,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.num_preemptions_total,
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens_total,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits,
            ),
        ):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            yield c
        c = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected.",
            labels=["model_name", "reason"],
        )
        for reason in ADMISSION_REASONS:
            c.add_metric(
                [self._labels["model_name"], reason], s.admission_rejections.get(reason, 0)
            )
        yield c


class EngineMetrics:
    """Every vllm:* series the emulator exports, bound to `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], CoreStats],
        model_name: str,
        cache: dict[str, str] | None = None,
    ) -> None:
        labels = {"model_name": model_name, "engine": "0"}
        registry.register(_CoreCollector(stats, labels))
        if cache is not None:
            # vLLM's info gauge: the CacheConfig's fields as labels, value 1
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["engine", *cache],
                registry=registry,
            )
            info.labels(engine="0", **cache).set(1)
        names = list(labels)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = self._hist(
            registry,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
            labels,
        )
        self.itl = self._hist(
            registry,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
            labels,
        )
        self.e2e = self._hist(
            registry,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
            labels,
        )
        self.queue = self._hist(
            registry,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_BUCKETS,
            labels,
        )

    @staticmethod
    def _hist(
        registry: CollectorRegistry,
        name: str,
        doc: str,
        buckets: list[float],
        labels: dict[str, str],
    ) -> Histogram:
        h = Histogram(name, doc, list(labels), buckets=buckets, registry=registry)
        child: Histogram = h.labels(**labels)
        return child
