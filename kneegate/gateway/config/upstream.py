"""The engines' sections of the config file: `upstreams` (one `UpstreamConfig` each: where
the engine is, the controller that sets its limit and its params, how its metrics are
scraped and when it counts as stalled) and `timeouts` (to every engine).

An error names the field and the reason; a URL in it is shown without its password or
query (`_shown`), either of which may be a secret. A key that is none of a controller's
`params` is named with the nearest parameter when it looks like a misspelling of one.
"""

from __future__ import annotations

import base64
import difflib
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from kneegate.controllers.registry import CONTROLLERS
from kneegate.gateway.config.sections import Frozen

__all__ = ["TimeoutConfig", "UpstreamConfig", "basic_auth", "public_url", "shown_url"]


def public_url(url: str) -> str:
    """`url` without its userinfo (`user:password@`): what a log line or the status page
    may show of an engine's URL."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url
    return scheme + sep + netloc.rpartition("@")[2] + slash + path


def basic_auth(url: str) -> bytes | None:
    """The `Authorization: Basic` value for the userinfo of `url` (None: it has none).
    Credentials in an engine's URL are its HTTP basic auth, as curl and httpx read them."""
    parts = urlsplit(url)
    if parts.username is None:
        return None
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return b"Basic " + base64.b64encode(pair.encode())


def _shown(url: str) -> str:
    """A URL as an error message may show it: no password, no query (either may be a secret)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    return parts._replace(query="***").geturl() if parts.query else parts.geturl()


def shown_url(url: str) -> str:
    """`url` as a message that names an upstream shows it: no userinfo, no query."""
    return _shown(public_url(url))


def _unknown_param(key: str, controller: str, model: type[BaseModel]) -> str:
    """`<key>: why`, for a key that is none of `controller`'s parameters. Shown when it
    looks like a misspelt one; any other may be a secret pasted one level too deep."""
    fields = sorted(model.model_fields)
    near = difflib.get_close_matches(key, fields, n=1, cutoff=0.7)
    if near:
        return f"{key}: not a parameter of controller {controller!r} (did you mean {near[0]!r}?)"
    listed = ", ".join(fields) if len(fields) <= _LISTED else (
        f"{len(fields)} of them, each explained in {model.__module__.replace('.', '/')}.py")
    return (f"<unknown key>: not a parameter of controller {controller!r} (the key is not "
            f"shown: it may be a secret); its parameters: {listed}")


_LISTED = 12  # a controller with more parameters than this is not listed in an error


class UpstreamConfig(Frozen):
    """One OpenAI-compatible engine and the controller that sets its limit."""

    name: str = Field(min_length=1, description="label in metrics and status")
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000 (no path); a "
                     "user:password@ in it is sent as basic auth, never as Host nor logged")
    controller: str = Field(
        "knee", description="controller name from controllers.registry; `fixed` to hand-tune")
    params: dict[str, Any] = Field(default_factory=dict, description="the controller's config")
    health_path: str = Field("/health", description="probed while the upstream is unusable")
    models: list[str] | None = Field(
        None, min_length=1, description="the models it serves (ids a request names); unset: "
        "what its /v1/models lists, read at first contact and on recovery")
    scrape: bool | None = Field(
        None, description="scrape the engine's /metrics: true always, false never; unset: "
        "always when metrics_url is given, else when url + '/metrics' shows vLLM series")
    metrics_url: str | None = Field(
        None, description="engine /metrics to scrape; default url + '/metrics'")
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
            raise ValueError(f"need an http(s) URL with a host, got {_shown(v)!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(
                f"give the engine's origin only (no path or query), got {_shown(v)!r}")
        return v.rstrip("/")

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url_is_http(cls, v: str | None) -> str | None:
        parts = urlsplit(v or "http://x")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"need an http(s) URL with a host, got {_shown(v or '')!r}")
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
        """The engine's /metrics URL (metrics_url, or url + '/metrics'); None with scrape: false.
        Whether it is scraped from the start or only once detected: `scrape_detect`."""
        if self.scrape is False:
            return None
        return self.metrics_url or self.url + "/metrics"

    @property
    def scrape_detect(self) -> bool:
        """Scraped only if scrape_url shows vLLM series (neither scrape nor metrics_url set)."""
        return self.scrape is None and self.metrics_url is None

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
            model = CONTROLLERS[name][0]
            try:
                model(**v)
            except ValidationError as exc:
                err = exc.errors()[0]
                if err["type"] == "extra_forbidden":
                    raise ValueError(_unknown_param(str(err["loc"][-1]), name, model)) from None
                where = ".".join(str(p) for p in err["loc"])
                msg = str(err["msg"]).removeprefix("Value error, ")
                raise ValueError(f"{where}: {msg}" if where else msg) from None
        return v


class TimeoutConfig(Frozen):
    """Upstream timeouts, seconds. None defaults to a client library's 5 s on purpose."""

    connect: float = Field(10.0, gt=0, description="TCP connect to the engine")
    first_byte: float = Field(600.0, gt=0, description="dispatch to first body byte (prefill)")
    idle: float = Field(120.0, gt=0, description="longest silence between two body chunks")

