"""The gateway's configuration: one YAML file, validated once, frozen.

Every field has a default, a range and a one-line meaning. `load_config(path)` either
returns a `GatewayConfig` or raises `ConfigError` naming the field path (for example
`upstreams.0.params.initial`) and the reason, which is what `kneegate check-config`
prints and what a failed reload logs.

An empty `upstreams` list means "no engine configured": `kneegate serve` then starts the
built-in emulator on a loopback port and fills in one upstream pointing at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controllers.registry import CONTROLLERS
from gateway.errors import ConfigError

__all__ = [
    "ClassConfig",
    "GatewayConfig",
    "ServerConfig",
    "TimeoutConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
    "split_for_worker",
    "worker_share",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UpstreamConfig(_Frozen):
    """One OpenAI-compatible engine and the controller that sets its limit."""

    name: str = Field(min_length=1, description="label in metrics and status")
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000 (no path)")
    controller: str = Field("fixed", description="controller name from controllers.registry")
    params: dict[str, Any] = Field(default_factory=dict, description="the controller's config")
    health_path: str = Field("/health", description="probed while the upstream is unusable")
    scrape: bool | None = Field(
        None, description="scrape the engine's /metrics; unset: scrape when metrics_url is given")
    metrics_url: str | None = Field(
        None, description="engine /metrics to scrape; default url + '/metrics' when scrape is on")
    scrape_interval: float = Field(
        1.0, gt=0, le=60, description="seconds between engine scrapes (knee is tuned for 1 s)")
    stale_after: float | None = Field(
        None, gt=0, le=600,
        description="engine figures older than this are not used (also the scrape timeout); "
        "default 3 x scrape_interval")
    stall_after: float = Field(
        10.0, gt=0, le=3600,
        description="running requests and no new tokens for this long: the upstream is unusable")

    @model_validator(mode="before")
    @classmethod
    def _default_metrics_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("scrape") and not data.get("metrics_url"):
            url = data.get("url")
            if isinstance(url, str):
                return {**data, "metrics_url": url.rstrip("/") + "/metrics"}
        return data

    @field_validator("url")
    @classmethod
    def _url_is_http_origin(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"need an http(s) URL with a host, got {v!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"give the engine's origin only (no path or query), got {v!r}")
        return v.rstrip("/")

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url_is_http(cls, v: str | None) -> str | None:
        parts = urlsplit(v or "http://x")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"need an http(s) URL with a host, got {v!r}")
        return v

    @model_validator(mode="after")
    def _fresh_between_scrapes(self) -> UpstreamConfig:
        if self.stale_after is not None and self.stale_after <= self.scrape_interval:
            raise ValueError(
                f"stale_after: {self.stale_after:g}s would make every figure stale before the "
                f"next scrape; give more than scrape_interval ({self.scrape_interval:g}s)")
        return self

    @property
    def stale_bound(self) -> float:
        """Seconds after which scraped figures are stale: stale_after, or 3 scrape intervals."""
        return self.stale_after if self.stale_after is not None else 3 * self.scrape_interval

    @property
    def scrape_url(self) -> str | None:
        """The /metrics URL to scrape, or None when this upstream is not scraped."""
        return None if self.scrape is False else self.metrics_url

    @field_validator("controller")
    @classmethod
    def _controller_is_known(cls, v: str) -> str:
        if v not in CONTROLLERS:
            raise ValueError(f"unknown controller {v!r}; choose one of {sorted(CONTROLLERS)}")
        return v

    @field_validator("params")
    @classmethod
    def _params_fit_controller(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        name = info.data.get("controller")
        if name in CONTROLLERS:
            try:
                CONTROLLERS[name][0](**v)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{where}: {err['msg']}") from None
        return v


class ClassConfig(_Frozen):
    """One priority class."""

    priority: int = Field(0, description="higher classes are dispatched first")
    max_wait: float = Field(30.0, gt=0, description="seconds in the queue before a 503")
    queue_share: float = Field(1.0, gt=0, le=1, description="fraction of max_queue it may fill")


class TimeoutConfig(_Frozen):
    """Upstream timeouts, seconds. None defaults to a client library's 5 s on purpose."""

    connect: float = Field(10.0, gt=0, description="TCP connect to the engine")
    first_byte: float = Field(600.0, gt=0, description="dispatch to first body byte (prefill)")
    idle: float = Field(120.0, gt=0, description="longest silence between two body chunks")


class ServerConfig(_Frozen):
    """Where the gateway listens. Changing these needs a restart, not a reload."""

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 in a container")
    port: int = Field(8080, ge=0, le=65535, description="0 picks a free port")
    workers: int = Field(1, ge=1, le=64, description="processes sharing the port")
    shutdown_grace: float = Field(
        30.0, ge=0, le=3600,
        description="on SIGTERM/SIGINT, seconds streams in flight may run on before they are "
        "cut (queued requests get 503 at once); keep it under the orchestrator's kill timeout")


class GatewayConfig(_Frozen):
    """The whole file."""

    upstreams: list[UpstreamConfig] = Field(default_factory=list)
    classes: dict[str, ClassConfig] = Field(
        default_factory=lambda: {"default": ClassConfig()},
        description="priority classes by name",
    )
    default_class: str = Field("default", description="class when nothing else names one")
    class_header: str = Field("x-kneegate-class", description="request header naming a class")
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="bearer API key -> class (wins over the header)"
    )
    max_queue: int = Field(256, ge=0, description="queued requests, all classes together")
    max_body_bytes: int = Field(8 << 20, ge=1, description="larger request bodies get 413")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    retry_after_min: int = Field(1, ge=0, description="Retry-After floor, seconds")
    retry_after_max: int = Field(60, ge=1, description="Retry-After ceiling, seconds")
    tick_interval: float = Field(0.1, gt=0, le=5, description="controller tick and sweep period")
    admin_token: str | None = Field(None, description="bearer token for /kneegate/reload")
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        if not self.classes:
            raise ValueError("classes: at least one priority class is needed")
        if self.default_class not in self.classes:
            raise ValueError(
                f"default_class: {self.default_class!r} is not one of {sorted(self.classes)}"
            )
        for key, cls in self.api_keys.items():
            if cls not in self.classes:
                raise ValueError(f"api_keys: key {key[:4]}... maps to unknown class {cls!r}")
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstreams: names must be unique, got {names}")
        if self.retry_after_min > self.retry_after_max:
            raise ValueError("retry_after_min: must not exceed retry_after_max")
        return self


def parse_config(data: Any, source: str = "<config>") -> GatewayConfig:
    """Validate a parsed YAML document; raise ConfigError with the first field path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"the top level must be a mapping, got {type(data).__name__}")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not where and ": " in msg:  # model-level checks name their field first
            where, msg = msg.split(": ", 1)
        raise ConfigError(source, where, msg) from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(str(p), "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), "", f"not valid YAML: {exc}") from None
    return parse_config(data, str(p))


def worker_share(total: int, index: int, count: int) -> int:
    """This worker's part of `total` split over `count` workers: parts differ by at most 1."""
    return total // count + (1 if index < total % count else 0)


def split_for_worker(cfg: GatewayConfig, index: int, count: int) -> GatewayConfig:
    """The config one of `count` worker processes runs with.

    Each worker admits on its own, so every upstream's `initial` and `max_limit` and the
    `max_queue` are split between workers (worker i gets total // count, plus one for the
    first total % count workers): with a `fixed` controller the workers together send the
    engine exactly the configured limit. `min_limit` is lowered to fit when needed; a share
    is never below 1. Adaptive controllers then move each worker's limit on its own.
    """
    if count <= 1:
        return cfg
    ups = []
    for u in cfg.upstreams:
        ctl_cfg = CONTROLLERS[u.controller][0](**u.params)
        initial = max(1, worker_share(ctl_cfg.initial, index, count))
        top = max(initial, worker_share(ctl_cfg.max_limit, index, count))
        params = {**u.params, "initial": initial, "max_limit": top,
                  "min_limit": min(ctl_cfg.min_limit, initial)}
        ups.append(u.model_copy(update={"params": params}))
    queue = worker_share(cfg.max_queue, index, count)
    return cfg.model_copy(update={"upstreams": ups, "max_queue": queue})
