"""The gateway's configuration: one YAML file, validated once, frozen.

Every field has a default, a range and a one-line meaning. `load_config(path)` either
returns a `GatewayConfig` or raises `ConfigError` naming the field path (for example
`upstreams.0.params.initial`) and the reason, which is what `kneegate check-config`
prints and what a failed reload logs.

An empty `upstreams` list means "no engine configured": `kneegate serve` then starts the
built-in emulator on a loopback port and fills in one upstream pointing at it.

A file is refused before validation when it cannot be a config: unreadable, not UTF-8,
over `MAX_CONFIG_BYTES`, empty or only comments, broken YAML, nested deeper than
`MAX_DEPTH` or expanding (through aliases) past `MAX_NODES` values. Secrets are never
echoed: YAML errors give the problem, line and column but not the source line, and
validation errors never show an API key or the admin token.

`parse_reload` adds the reload's rule: a key the new file leaves out keeps the
running `admin_token` and `api_keys` (removing them takes `admin_token: null`,
`api_keys: {}`), so a half-written file cannot open the admin endpoints.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kneegate.controllers.registry import CONTROLLERS
from kneegate.gateway.errors import ConfigError

__all__ = [
    "ClassConfig",
    "GatewayConfig",
    "LimitsConfig",
    "ScaleConfig",
    "ServerConfig",
    "TimeoutConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
    "parse_reload",
    "read_config",
    "split_for_worker",
    "worker_share",
]


# libyaml's loader where PyYAML was built with it: ~10x faster (a reload runs on the event
# loop); errors carry the same problem and line, and it caps nesting at 1000 itself.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_CONFIG_BYTES = 1 << 20  # far above any real config (about 25,000 API keys)
MAX_DEPTH = 32  # a config nests ~5 deep; PyYAML's loader recurses once per level
MAX_NODES = 200_000  # values after alias expansion; a "billion laughs" file has 10**9


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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


class UpstreamConfig(_Frozen):
    """One OpenAI-compatible engine and the controller that sets its limit."""

    name: str = Field(min_length=1, description="label in metrics and status")
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000 (no path)")
    controller: str = Field(
        "knee", description="controller name from controllers.registry; `fixed` to hand-tune")
    params: dict[str, Any] = Field(default_factory=dict, description="the controller's config")
    health_path: str = Field("/health", description="probed while the upstream is unusable")
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
    header: bool = Field(
        False, description="a request may pick this class with class_header (API keys win)")
    ttft_objective: float = Field(
        2.0, gt=0, le=3600,
        description="seconds from arrival to the first token; a request that cannot make it is "
        "refused at once (429 over_objective), one queued past it is answered 503")
    queue_budget: float = Field(
        0.25, gt=0, le=1,
        description="the part of the objective (less the engine's TTFT) a request may be "
        "predicted to wait in the queue; beyond it, 429 over_objective at once")


class TimeoutConfig(_Frozen):
    """Upstream timeouts, seconds. None defaults to a client library's 5 s on purpose."""

    connect: float = Field(10.0, gt=0, description="TCP connect to the engine")
    first_byte: float = Field(600.0, gt=0, description="dispatch to first body byte (prefill)")
    idle: float = Field(120.0, gt=0, description="longest silence between two body chunks")


class LimitsConfig(_Frozen):
    """What one client may send and hold open (nginx/Envoy-like defaults). Read when the
    server starts: changing them needs a restart, like `server`."""

    max_header_bytes: int = Field(
        65536, ge=1024, le=16 << 20,
        description="request line plus headers of one request, bytes; more: 431 and close")
    max_headers: int = Field(
        100, ge=1, le=10000, description="header fields in one request; more: 431 and close")
    header_timeout: float = Field(
        60.0, gt=0, le=3600,
        description="the request head must arrive within this, from connect or its first "
        "byte; else 408 (silent close if nothing came) and close")
    body_timeout: float = Field(
        60.0, gt=0, le=3600,
        description="longest silence between two reads of a request body; else 408 and close")
    keepalive_timeout: float = Field(
        60.0, gt=0, le=3600,
        description="an idle keep-alive client connection is closed after this")
    max_connections: int = Field(
        10000, ge=1, le=1_000_000,
        description="open client connections per worker; a request on one more gets 503 and close")
    max_upstream_header_bytes: int = Field(
        65536, ge=1024, le=16 << 20,
        description="status line plus headers of one engine response, bytes; more: 502")


class ServerConfig(_Frozen):
    """Where the gateway listens. Changing these needs a restart, not a reload."""

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 in a container")
    port: int = Field(8080, ge=0, le=65535, description="0 picks a free port")
    workers: int = Field(1, ge=1, le=64, description="processes sharing the port")
    shutdown_grace: float = Field(
        30.0, ge=0, le=3600,
        description="on SIGTERM/SIGINT, seconds streams in flight may run on before they are "
        "cut (queued requests get 503 at once); keep it under the orchestrator's kill timeout")
    config_poll_interval: float = Field(
        2.0, ge=0, le=3600,
        description="seconds between checks of the --config file; a changed file is reloaded "
        "like SIGHUP (a Kubernetes ConfigMap update too); 0: only on SIGHUP or POST reload")
    access_log: bool = Field(True, description="one log line per proxied request")
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or one JSON object per line (every record)")


class ScaleConfig(_Frozen):
    """The scale-out signal: kneegate_demand_ratio and kneegate_suggested_replicas
    (gateway/demand.py). Reloadable."""

    target: float = Field(
        0.9, gt=0, le=1, description="utilisation of the engines' knee capacity that "
        "kneegate_suggested_replicas aims at")
    half_life: float = Field(
        15.0, gt=0, le=3600, description="seconds: offered load and capacity are averaged "
        "with this half-life")


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
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    retry_after_min: int = Field(1, ge=0, description="Retry-After floor, seconds")
    retry_after_max: int = Field(60, ge=1, description="Retry-After ceiling, seconds")
    tick_interval: float = Field(0.1, gt=0, le=5, description="controller tick and sweep period")
    admin_token: str | None = Field(
        None, min_length=1, description="bearer token for /kneegate/status and /kneegate/reload")
    server: ServerConfig = Field(default_factory=ServerConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        if not self.classes:
            raise ValueError("classes: at least one priority class is needed")
        if self.default_class not in self.classes:
            raise ValueError(
                f"default_class: {self.default_class!r} is not one of {sorted(self.classes)}"
            )
        for i, cls in enumerate(self.api_keys.values()):
            if cls not in self.classes:  # the key is a secret: name its place, not it
                raise ValueError(f"api_keys: entry {i + 1} maps to unknown class {cls!r}")
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstreams: names must be unique, got {names}")
        if self.retry_after_min > self.retry_after_max:
            raise ValueError("retry_after_min: must not exceed retry_after_max")
        return self


_FIELD_NAMES = sorted({name for m in (GatewayConfig, UpstreamConfig, ClassConfig, TimeoutConfig,
                                       ServerConfig, ScaleConfig) for name in m.model_fields})


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
        where = _field_path(err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            where, msg = _unknown_key(err["loc"], msg)
        if not where and ": " in msg:  # model-level checks name their field first
            where, msg = msg.split(": ", 1)
        raise ConfigError(source, where, msg) from None


def _field_path(loc: tuple[int | str, ...]) -> str:
    # An API key is a mapping key, so pydantic puts it in the error's location: name the
    # field only. (Messages never carry the input; the input itself is never shown.)
    if loc and loc[0] == "api_keys" and len(loc) > 1:
        return "api_keys.<key>"
    return ".".join(str(p) for p in loc)


def _unknown_key(loc: tuple[int | str, ...], msg: str) -> tuple[str, str]:
    # An unknown key is shown when it looks like a misspelt field; any other may be an API
    # key indented one level too little, so it is not shown.
    key = str(loc[-1])
    near = difflib.get_close_matches(key, _FIELD_NAMES, n=1, cutoff=0.7)
    if near:
        return _field_path(loc), f"{msg} (did you mean {near[0]!r}?)"
    where = ".".join([*(str(p) for p in loc[:-1]), "<unknown key>"])
    return where, f"{msg} (the key is not shown: it may be a secret, e.g. an API key)"


def read_config(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping, or ConfigError saying why it cannot be a config."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(p), "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(p), "", f"larger than {MAX_CONFIG_BYTES} bytes: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(str(p), "", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                                      f"at line {line}); save the file as UTF-8") from None
    data = _parse_yaml(text, str(p))
    if data is None:
        raise ConfigError(str(p), "", "the config is empty (nothing but blanks or comments); "
                                      "write {} to mean every default")
    if not isinstance(data, dict):
        raise ConfigError(str(p), "", f"the top level must be a mapping, got {type(data).__name__}")
    if "admin_token" in data and data["admin_token"] is None and _written_empty(text):
        # `admin_token:` with nothing after it is also how a file cut short ends
        raise ConfigError(str(p), "admin_token", "no value; give the token, or write "
                                                 "`admin_token: null` to run without one")
    return data


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file."""
    return parse_config(read_config(path), str(path))


def _parse_yaml(text: str, source: str) -> Any:
    try:
        _check_shape(text, source)
        return yaml.load(text, Loader=_LOADER)  # a safe loader: plain data only
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {_yaml_problem(exc)}") from None
    except yaml.reader.ReaderError as exc:  # a control character, e.g. a NUL
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        line = text[:exc.position].count("\n") + 1
        raise ConfigError(source, "", f"not valid YAML: character #x{code:04x} is not allowed "
                                      f"(line {line})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {exc}") from None
    except ValueError as exc:  # Python refuses integers of over 4300 digits
        reason = str(exc).split(";")[0]
        raise ConfigError(source, "", f"a value cannot be converted: {reason}") from None


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    # PyYAML's own message quotes the source line around the error, which may hold the
    # admin token or an API key: give the problem and where it is, never the snippet.
    text = exc.problem or "syntax error"
    if exc.problem_mark is not None:
        text += f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
    if exc.context:
        text += f" ({exc.context}"
        if exc.context_mark is not None:
            text += f" from line {exc.context_mark.line + 1}"
        text += ")"
    return text


def _check_shape(text: str, source: str) -> None:
    """Refuse YAML that costs more to load than any config needs, before loading it.

    Nesting deeper than MAX_DEPTH (the loader recurses per level: 10,000 `[` raise a
    RecursionError) and more than MAX_NODES values once aliases are expanded (the loader
    shares aliased nodes, but validation walks every copy: a ten-line "billion laughs" file
    never finishes). Walks the parser's events, which recurses on nothing and builds nothing.
    """
    sizes: dict[str, int] = {}  # anchor -> values it expands to
    anchors: list[str | None] = []  # per open collection: its anchor,
    counts: list[int] = []  # and the values in it so far
    total = 0
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, yaml.CollectionEndEvent):
            anchor, n = anchors.pop(), counts.pop()
            if anchor is not None:
                sizes[anchor] = n
            if counts:
                counts[-1] += n
            continue
        if isinstance(ev, yaml.AliasEvent):
            n = sizes.get(ev.anchor or "", 1)  # an alias of an open collection: 1
        elif isinstance(ev, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            n = 1
        else:
            continue
        total += n
        line = ev.start_mark.line + 1 if ev.start_mark is not None else 0
        if total > MAX_NODES:
            raise ConfigError(source, "", f"expands to more than {MAX_NODES} values through "
                                          f"aliases (line {line})")
        if isinstance(ev, yaml.CollectionStartEvent):
            if len(counts) >= MAX_DEPTH:
                raise ConfigError(source, "", f"nested deeper than {MAX_DEPTH} levels "
                                              f"(line {line})")
            anchors.append(ev.anchor)
            counts.append(1)
            continue
        if isinstance(ev, yaml.ScalarEvent) and ev.anchor is not None:
            sizes[ev.anchor] = 1
        if counts:
            counts[-1] += n


def _written_empty(text: str) -> bool:
    """Whether the top-level `admin_token` is written with no value at all (not `null`)."""
    root = yaml.compose(text, Loader=_LOADER)
    empty = False
    for key, value in root.value if isinstance(root, yaml.MappingNode) else ():
        if isinstance(key, yaml.ScalarNode) and key.value == "admin_token":  # the last one wins
            empty = isinstance(value, yaml.ScalarNode) and value.value == "" and not value.style
    return empty


def parse_reload(
    data: dict[str, Any], running: GatewayConfig, source: str
) -> tuple[GatewayConfig, list[str]]:
    """Validate a reloaded file's document, keeping the running secrets where it is silent.

    A reload never drops a secret by omission: a file without `admin_token` keeps the
    running token, one without `api_keys` keeps the running keys (a half-written or wrong
    file must not open the admin endpoints or move every keyed client to the default
    class). `admin_token: null` and `api_keys: {}` remove them, on purpose. Returns the
    config and what happened to the secrets, for the log: names and counts, no values.
    """
    doc, notes = _keep_secrets(data, running)
    try:
        return parse_config(doc, source), notes
    except ConfigError as exc:
        if exc.field.startswith("api_keys") and "api_keys" not in data:
            raise ConfigError(source, exc.field, f"{exc.reason} (the running api_keys were "
                              "kept: the new file has none; write api_keys to replace "
                              "them)") from None
        raise


def _keep_secrets(
    data: dict[str, Any], running: GatewayConfig
) -> tuple[dict[str, Any], list[str]]:
    out = dict(data)
    notes: list[str] = []
    if running.admin_token is not None:
        if "admin_token" not in data:
            out["admin_token"] = running.admin_token
            notes.append("admin_token is not in the new file: the running token is kept "
                         "(write `admin_token: null` to remove it)")
        elif data["admin_token"] is None:
            notes.append("admin_token: null in the new file: the token is removed, the admin "
                         "endpoints are open")
        elif data["admin_token"] != running.admin_token:
            notes.append("admin_token changed")
    if running.api_keys:
        if "api_keys" not in data:
            out["api_keys"] = dict(running.api_keys)
            notes.append(f"api_keys is not in the new file: the running {len(running.api_keys)} "
                         "keys are kept (write `api_keys: {}` to remove them)")
        elif data["api_keys"] == {}:
            notes.append("api_keys: {} in the new file: every API key is removed")
    return out, notes


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
