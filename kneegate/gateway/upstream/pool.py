"""The pool of engines: one `Upstream` each, with its controller, health and engine stats.

Each is an `Upstream` (gateway/upstream/state.py: admission's `UpstreamState` plus what
the proxy and the status page need); the pool owns its state and moves it, as follows.

Health is `/health` AND progress. A connect failure (refused or timed out) marks an
upstream unhealthy at once (admission stops choosing it); the tick then probes
`health_path` with growing back-off (0.5 s doubling to 8 s) and a 2xx makes it healthy
again.

Health is *unknown* until first contact: an upstream is `confirmed` once a probe of its
`health_path` answered 2xx, a scrape answered, or a request got a response head. The
gateway probes every upstream at start-up (`first_contact`: the log says which answer,
and warns of each that does not yet, with why) and keeps probing an unconfirmed one with
back-off; admission still sends it traffic meanwhile (an unanswered probe is no verdict),
but `/ready` counts only upstreams both usable and confirmed.

Which upstreams are scraped: `scrape: true` or a `metrics_url` scrapes from the start,
`scrape: false` never. Unset (the default), the gateway *detects* it: its first scrape attempt
(the first tick once the upstream is healthy, right after the start-up probe) reads
`url + /metrics`, and the upstream is scraped from then on only when the answer is a 200
whose text holds vLLM series (a `vllm:` name). Any other answer below 500 (a 404, a 200
without them) means "not vLLM":
no more scrapes, not counted as one, logged once. A timeout, a connect error or a 5xx decides
nothing: counted like any failed scrape, and the next interval asks again. An upstream found
not to be vLLM is asked again when it comes back after a failure (a connect failure marked it
unhealthy and a probe answered again: the engine may have been replaced) and on a reload that
changes its URL or scrape settings; never on a timer. The status page says which
(`scrape`: on, detecting, not_vllm, off).

An upstream that is scraped is also judged on progress: when its scrapes show running
requests and a generation-token counter that has not advanced for `stall_after` seconds it
is *stalled* and unusable, whatever its /health says, and a later scrape that shows
progress (new tokens, or nothing running) makes it usable again.

A *frozen* engine (SIGSTOP, a wedged process: connects succeed, nothing answers) cannot be
judged by scrapes that never come back, so silence is the evidence. A scraped upstream is
frozen, and unusable, when both hold:
- its last 3 scrapes in a row timed out or failed (`_FROZEN_SCRAPES`), and
- it has requests in flight, and for `stall_after` seconds none of them received a byte:
  no response head, no body chunk, since the later of the last such byte and the last
  tick at which it had nothing in flight (tick granularity).
The next scrape that gets any HTTP answer makes it usable again. An upstream that is not
scraped, or not yet (detecting), is left to the first-byte and idle timeouts.

Telemetry: a healthy scraped upstream's /metrics is read every `scrape_interval`; a scrape
that does not answer within `stale_after` (default 3 intervals) is abandoned, and good
figures go to the controller (`on_engine_stats`). The probes and scrapes themselves, the
pool's only I/O, are gateway/upstream/probe.py's; this module keeps the state they report to.

Models: a healthy upstream's `/v1/models` is read at first contact and again after it
failed (a replaced engine may serve others), with the probes' back-off while it does not
answer; until read again, what it listed before still routes (admission/pools.py). An
upstream's `models` in the config names what it serves instead (its lengths still read).
`context(model)` is the longest `max_model_len` listed for a model, what the proxy
refuses a request against before queueing it (gateway/request_size.py). When what an
upstream serves changes, `on_models` is called (the runtime regroups the pools).

A reload that removes an upstream keeps it *draining*: its in-flight requests finish
against it and it leaves the pool when the last one does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kneegate.controllers.base import EngineStats, LimitController
from kneegate.controllers.registry import build_controller
from kneegate.gateway.config.upstream import UpstreamConfig, public_url
from kneegate.gateway.types import Clock
from kneegate.gateway.upstream.client import UpstreamClient
from kneegate.gateway.upstream.probe import probe, scrape
from kneegate.gateway.upstream.state import BACKOFF_MAX, BACKOFF_MIN, Upstream
from kneegate.gateway.upstream.telemetry import Progress

__all__ = ["UpstreamPool"]

log = logging.getLogger("kneegate.upstreams")

_FROZEN_SCRAPES = 3  # failed scrapes in a row, with silent requests: frozen

# (upstream name, outcome) -> counted; outcomes: ok, timeout, error, http_error, unparsable
ScrapeCounter = Callable[[str, str], None]
EngineFeed = Callable[[Upstream, EngineStats], None]  # a scrape, to the controller


def _scraping(cfg: UpstreamConfig) -> bool | None:
    """Scraped from the start (True), never (False) or once detected (None)."""
    if cfg.scrape_url is None:
        return False
    return None if cfg.scrape_detect else True


def _progress(cfg: UpstreamConfig) -> Progress:
    return Progress(stall_after=cfg.stall_after, stale_after=cfg.stale_bound)


def _telemetry_key(cfg: UpstreamConfig | None) -> tuple[Any, ...] | None:
    if cfg is None:
        return None
    return (cfg.scrape_url, cfg.scrape_detect, cfg.stall_after, cfg.stale_bound)


def _build(cfg: UpstreamConfig) -> Upstream:
    ctl: LimitController = build_controller(cfg.controller, cfg.params)
    scraping = _scraping(cfg)
    up = Upstream(name=cfg.name, controller=ctl, url=cfg.url, config=cfg, scraping=scraping,
                  progress=_progress(cfg) if scraping else None)
    _name_models(up, cfg)
    return up


def _name_models(up: Upstream, cfg: UpstreamConfig) -> None:
    """The models `cfg` names, known at once; their lengths are read at the next probe."""
    if cfg.models is not None:
        up.models = {m: (up.models or {}).get(m) for m in cfg.models}
        up.models_stale = True


def _named(cfg: UpstreamConfig, listed: dict[str, int | None]) -> dict[str, int | None]:
    """What an upstream serves: the config's names where it gives them (with the lengths its
    engine lists), else what its engine lists."""
    if cfg.models is None:
        return listed
    return {m: listed.get(m) for m in cfg.models}


class UpstreamPool:
    """The configured upstreams plus the ones a reload removed that still have requests."""

    def __init__(
        self,
        configs: list[UpstreamConfig],
        *,
        clock: Clock = time.monotonic,
        count_scrape: ScrapeCounter | None = None,
        feed_engine: EngineFeed | None = None,
    ) -> None:
        self.active: list[Upstream] = [_build(c) for c in configs]
        self.draining: list[Upstream] = []
        self._by_model: dict[str, int] = {}  # model -> its longest context (`context`)
        self._single: int | None = None
        self.clock = clock
        self.count_scrape: ScrapeCounter = count_scrape or (lambda name, outcome: None)
        # the admission queue's `engine_stats` (guarded, as every controller call); direct
        # where the pool runs alone
        self.feed_engine: EngineFeed = feed_engine or (
            lambda up, stats: up.controller.on_engine_stats(stats))
        self.on_models: Callable[[], None] = lambda: None  # what an upstream serves changed

    def all(self) -> list[Upstream]:
        self.draining = [u for u in self.draining if u.inflight > 0]
        return self.active + self.draining

    def reload(self, configs: list[UpstreamConfig]) -> list[Upstream]:
        """Apply a new upstream list; keep controller state where name and controller match."""
        old = {u.name: u for u in self.active}
        new: list[Upstream] = []
        for cfg in configs:
            up = old.pop(cfg.name, None)
            if up is None:
                new.append(_build(cfg))
                continue
            prev = up.config
            if prev is None or (prev.controller, prev.params) != (cfg.controller, cfg.params):
                up.controller = build_controller(cfg.controller, cfg.params)
            if _telemetry_key(prev) != _telemetry_key(cfg):
                up.scraping = _scraping(cfg)
                up.progress = _progress(cfg) if up.scraping else None
                up.stalled = False
                up.refresh_usable()
            if prev is None or prev.models != cfg.models:
                _name_models(up, cfg)
            up.url, up.config = cfg.url, cfg
            new.append(up)
        self.draining.extend(u for u in old.values() if u.inflight > 0)
        self.active = new
        self._contexts()
        return new

    def context(self, model: str | None) -> int | None:
        """The longest context (`max_model_len`) any upstream lists for `model` (None
        naming none: the only model, where all list one); None when unknown."""
        if model is None:
            return self._single
        return self._by_model.get(model)

    def _contexts(self) -> None:
        by_model: dict[str, int] = {}
        for u in self.active:
            for model, length in (u.models or {}).items():
                if length is not None:
                    by_model[model] = max(length, by_model.get(model, 0))
        self._by_model = by_model
        lengths = set(by_model.values())
        self._single = lengths.pop() if len(lengths) == 1 else None

    def mark_failed(self, up: Upstream, now: float, why: str = "connect failed") -> None:
        """A connect to `up` failed (refused or timed out): unusable until a probe answers
        (which reads its models again: a replaced engine may serve others)."""
        up.models_stale = True
        if up.healthy:
            log.warning("upstream %s unusable: %s; probing %s", up.name, why,
                        public_url(up.url))
            up.backoff = BACKOFF_MIN
        up.healthy = False
        up.refresh_usable()
        up.next_probe_at = now + up.backoff

    def background(self, client: UpstreamClient, now: float) -> list[asyncio.Task[None]]:
        """Start due health probes and engine scrapes (called from the tick)."""
        tasks = []
        for up in self.active:
            self._judge_silence(up, now)
            if up.busy or up.config is None:
                continue
            if (not up.healthy or not up.confirmed or up.models is None or up.models_stale
                    ) and now >= up.next_probe_at:
                up.busy = True
                tasks.append(asyncio.create_task(probe(self, client, up, now)))
            elif up.healthy and up.scraping is not False and now >= up.next_scrape_at:
                up.busy = True
                up.next_scrape_at = now + up.config.scrape_interval
                tasks.append(asyncio.create_task(scrape(self, client, up, now)))
        return tasks

    async def first_contact(self, client: UpstreamClient) -> None:
        """Probe every upstream once, together (start-up: bounded by the probe timeout).
        A 2xx confirms it; anything else leaves it unconfirmed and still usable."""
        now = self.clock()
        probes = []
        for up in self.active:
            if up.config is not None and not up.busy:
                up.busy = True
                probes.append(probe(self, client, up, now))
        await asyncio.gather(*probes)
        for up in self.active:
            if up.config is not None and not up.confirmed:
                log.warning("upstream %s (%s) does not answer yet (%s): kneegate serves, but "
                            "/ready answers 503 until an upstream does; probing it with "
                            "back-off", up.name, public_url(up.url),
                            up.probe_error or "no answer")

    def _judge_silence(self, up: Upstream, now: float) -> None:
        """Frozen: failing scrapes and in-flight requests silent for stall_after."""
        if up.inflight == 0:
            up.idle_at = now
        if (up.frozen or up.config is None or not up.scraping
                or up.scrape_failures < _FROZEN_SCRAPES):
            return  # (failed detections do not count: an engine not yet known to be scraped)
        silent = now - max(up.idle_at, up.answered_at)
        if silent >= up.config.stall_after:
            log.warning("upstream %s unusable: %d scrapes failed and %d requests got nothing "
                        "for %.1fs; frozen?", up.name, up.scrape_failures, up.inflight, silent)
            up.frozen = True
            up.refresh_usable()

    def probed(self, up: Upstream, ok: bool, now: float,
               models: dict[str, int | None] | None = None, why: str = "") -> None:
        """A health probe's verdict: a 2xx (`ok`) makes `up` healthy, else it backs off
        (`why`: what failed); and, when they were asked for, the models it serves (None:
        ask again, backing off)."""
        assert up.config is not None
        up.probe_error = "" if ok else why
        if ok and not up.confirmed and up.healthy:  # (an unhealthy one says "healthy again")
            log.info("upstream %s (%s) answers %s", up.name, public_url(up.url),
                     up.config.health_path)
        if models is not None:
            models = _named(up.config, models)
            changed, up.models, up.models_stale = models != up.models, models, False
            self._contexts()
            if changed:
                self.on_models()
        elif ok and (up.models is None or up.models_stale):
            up.next_probe_at = now + up.backoff
            up.backoff = min(BACKOFF_MAX, up.backoff * 2)
        if ok:
            if not up.healthy:
                log.warning("upstream %s healthy again%s", up.name,
                            "; still stalled" if up.stalled else "")
                if up.scraping is False and up.config.scrape_detect:
                    up.scraping = None  # it may be another engine now: look at /metrics again
            up.healthy = up.confirmed = True
            up.refresh_usable()
        else:
            up.backoff = min(BACKOFF_MAX, up.backoff * 2)
            up.next_probe_at = now + up.backoff

    @staticmethod
    def scrape_answered(up: Upstream, answered: bool) -> None:
        """A scrape got an HTTP answer (any), or timed out or failed: judges `frozen`."""
        if not answered:
            up.scrape_failures += 1
            return
        up.scrape_failures = 0
        up.confirmed = True
        if up.frozen:
            log.warning("upstream %s answers again", up.name)
            up.frozen = False
            up.refresh_usable()

    @staticmethod
    def detected(up: Upstream, cfg: UpstreamConfig) -> None:
        """A detecting scrape found vLLM series: scraped from now on."""
        log.info("upstream %s: %s shows vLLM series; scraping it every %gs", up.name,
                 public_url(cfg.scrape_url or ""), cfg.scrape_interval)
        up.scraping, up.progress = True, _progress(cfg)

    @staticmethod
    def not_vllm(up: Upstream, url: str, status: int) -> None:
        """A detecting scrape found no vLLM series: not scraped (see the module docstring)."""
        what = "no vLLM series" if status == 200 else f"HTTP {status}"
        log.info("upstream %s: %s answers %s; not scraped (asked again when the upstream comes "
                 "back after a failure; `scrape: true` forces it)", up.name, public_url(url), what)
        up.scraping = False

    def note_engine(self, up: Upstream, stats: EngineStats, now: float) -> None:
        """Take one good scrape: keep it, feed the controller, judge progress."""
        if up.progress is None or up.config is None:
            return  # a reload turned scraping off while this scrape ran
        up.progress.note(stats)
        self.feed_engine(up, stats)
        stalled = up.progress.stuck(now)
        if stalled != up.stalled:
            if stalled:
                log.warning("upstream %s unusable: %g running and no new tokens for %gs",
                            up.name, stats.running, up.config.stall_after)
            else:
                log.warning("upstream %s makes progress again", up.name)
            up.stalled = stalled
            up.refresh_usable()
