"""The pool's I/O: health probes of `health_path` and scrapes of `/metrics`.

The tick starts them (`UpstreamPool.background`, and `first_contact` at start-up), one at
a time per upstream (`Upstream.busy`); each reads its answer and hands the verdict to the
pool, which owns the upstream's state (gateway/upstream/pool.py says what the states mean).

A probe answers in `PROBE_TIMEOUT` or is a failure: a 2xx is healthy
(`UpstreamPool.probed`), anything else backs off (and says why, for the start-up log).

A scrape waits at most `stale_after` (figures that arrive later would not be used) and is
counted by outcome: ok, timeout, error, http_error, unparsable. While the upstream is
*detecting*, an answer below 500 that is not a 200 holding vLLM series (a `vllm:` name)
means "not vLLM" and is no scrape (`UpstreamPool.not_vllm`); a 200 with them turns
scraping on (`UpstreamPool.detected`). Good figures, stamped at the scrape's midpoint (the
engine rendered them somewhere between asking and answering), go to
`UpstreamPool.note_engine`.
"""

from __future__ import annotations

import json
from typing import Protocol

from kneegate.controllers.base import EngineStats
from kneegate.gateway.config.upstream import UpstreamConfig
from kneegate.gateway.errors import UpstreamError, UpstreamTimeout
from kneegate.gateway.types import Clock
from kneegate.gateway.upstream.client import UpstreamClient
from kneegate.gateway.upstream.state import Upstream
from kneegate.gateway.upstream.telemetry import parse_engine_metrics

__all__ = ["PROBE_TIMEOUT", "Verdicts", "probe", "read_models", "scrape"]

PROBE_TIMEOUT = 2.0


class Verdicts(Protocol):
    """What a probe or a scrape reports to: `UpstreamPool`, which imports this module
    (so this one names the pool by what it takes, never by import)."""

    @property
    def clock(self) -> Clock: ...

    def probed(self, up: Upstream, ok: bool, now: float,
               models: dict[str, int | None] | None = None, why: str = "") -> None: ...

    def scrape_answered(self, up: Upstream, answered: bool) -> None: ...

    def count_scrape(self, upstream: str, outcome: str) -> None: ...

    def detected(self, up: Upstream, cfg: UpstreamConfig) -> None: ...

    def not_vllm(self, up: Upstream, url: str, status: int) -> None: ...

    def note_engine(self, up: Upstream, stats: EngineStats, now: float) -> None: ...


async def probe(pool: Verdicts, client: UpstreamClient, up: Upstream, now: float) -> None:
    """Ask `up`'s `health_path` once, then, healthy and its models unknown, `/v1/models`;
    the pool takes the verdicts."""
    assert up.config is not None
    models: dict[str, int | None] | None = None
    why = ""
    try:
        status, _ = await client.get_text(up.url + up.config.health_path, PROBE_TIMEOUT)
        ok = 200 <= status < 300
        if not ok:
            why = f"{up.config.health_path} answered HTTP {status}"
        elif up.models is None or up.models_stale:
            models = await read_models(client, up.url)
    except UpstreamError as exc:
        ok, why = False, exc.message
    finally:
        up.busy = False
    pool.probed(up, ok, now, models, why)


async def read_models(client: UpstreamClient, url: str) -> dict[str, int | None] | None:
    """What `url`'s `/v1/models` lists: each model's id and `max_model_len` (vLLM lists
    it; None where absent). {} for an answer that lists nothing readable (not an OpenAI
    server, or one that wants a key); None when it failed (timeout, 5xx): ask again."""
    try:
        status, text = await client.get_text(url + "/v1/models", PROBE_TIMEOUT, 1 << 20)
    except UpstreamError:
        return None
    if status >= 500:
        return None
    try:
        data = json.loads(text)["data"] if status == 200 else []
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        return {}
    return {c["id"]: c.get("max_model_len") if type(c.get("max_model_len")) is int else None
            for c in cards}


async def scrape(pool: Verdicts, client: UpstreamClient, up: Upstream, started: float
                 ) -> None:
    """Read `up`'s /metrics once; count it and tell the pool whether it answered."""
    try:
        outcome = await _fetch(pool, client, up, started)
    finally:
        up.busy = False
    pool.scrape_answered(up, outcome not in ("timeout", "error"))
    if outcome is not None:
        pool.count_scrape(up.name, outcome)


async def _fetch(pool: Verdicts, client: UpstreamClient, up: Upstream, started: float
                 ) -> str | None:
    """One scrape's outcome; None when it was a detection that found no vLLM series
    (or that a reload overtook): not a scrape."""
    cfg, detecting = up.config, up.scraping is None
    assert cfg is not None and cfg.scrape_url is not None
    try:
        # figures that arrive after stale_after would not be used: stop waiting then
        status, text = await client.get_text(cfg.scrape_url, cfg.stale_bound)
    except UpstreamTimeout:
        return "timeout"
    except UpstreamError:
        return "error"
    done = pool.clock()
    if detecting:
        if up.config is not cfg or up.scraping is not None:
            return None  # a reload changed what to detect while this one ran
        if status < 500 and not (status == 200 and "vllm:" in text):
            pool.not_vllm(up, cfg.scrape_url, status)
            return None
        if status == 200:
            pool.detected(up, cfg)
    if status != 200:
        return "http_error"
    try:
        # the engine rendered its figures somewhere between asking and answering
        stats = parse_engine_metrics(text, (started + done) / 2)
    except ValueError:
        stats = None
    if stats is None:
        return "unparsable"
    pool.note_engine(up, stats, done)
    return "ok"
