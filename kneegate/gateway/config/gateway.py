"""The gateway's configuration: one YAML file, validated once, frozen.

Every field has a default, a range and a one-line meaning. `load_config(path)` either
returns a `GatewayConfig` or raises `ConfigError` naming the field path (for example
`upstreams[vllm].params.initial`: an upstream by its name, else its URL) and the reason,
which is what `kneegate check-config` prints and what a failed reload logs.

An empty `upstreams` list means "no engine configured": `kneegate serve` then starts the
built-in emulator on a loopback port and fills in one upstream pointing at it.

A file is refused before validation when it cannot be a config (`gateway.config.read`:
too large, not UTF-8, empty, broken or too deep YAML). Secrets are never echoed:
validation errors never show an API key or the admin token.

`parse_reload` adds the reload's rule: a key the new file leaves out keeps the
running `admin_token` (or `admin_token_file`), `api_keys` and `require_api_key` (removing
them takes `admin_token: null`, `api_keys: {}`, `require_api_key: false`), so a
half-written file cannot open the admin endpoints or the engines. `read_admin_token` gives
the token itself, from the file when it is in a Secret.

The file's sections are modelled in `gateway.config.upstream` (`upstreams`, `timeouts`)
and `gateway.config.sections` (`classes`, `limits`, `server`, `scale`); `GatewayConfig`,
the whole file, is here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from kneegate.controllers.registry import CONTROLLERS
from kneegate.gateway.config.read import read_config
from kneegate.gateway.config.sections import (
    ClassConfig,
    Frozen,
    LimitsConfig,
    RoutingConfig,
    ScaleConfig,
    ServerConfig,
    TenantConfig,
)
from kneegate.gateway.config.upstream import TimeoutConfig, UpstreamConfig, shown_url
from kneegate.gateway.errors import ConfigError

__all__ = [
    "GatewayConfig",
    "Prepare",
    "load_config",
    "parse_config",
    "parse_reload",
    "read_admin_token",
    "split_for_worker",
    "worker_share",
]


class GatewayConfig(Frozen):
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
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="named tenants by name: keys, weight, class, caps")
    tenant_header: str | None = Field(
        None, description="request header naming a tenant when no configured key does")
    tenant_key_salt: str | None = Field(
        None, min_length=16, description="secret mixed into the hashes that name unlisted "
        "keys' tenants (key-...); set it alike on every gateway of a deployment so that they "
        "name a key alike. Unset: a random one per process")
    max_queue: int = Field(256, ge=0, description="queued requests, all classes together")
    max_body_bytes: int = Field(8 << 20, ge=1, description="larger request bodies get 413")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    retry_after_min: int = Field(1, ge=0, description="Retry-After floor, seconds")
    retry_after_max: int = Field(60, ge=1, description="Retry-After ceiling, seconds")
    tick_interval: float = Field(0.1, gt=0, le=5, description="controller tick and sweep period")
    require_api_key: bool = Field(
        False, description="refuse 401 invalid_api_key, before admission, every request to "
        "/v1/*, /tokenize or /detokenize (OPTIONS aside) whose bearer key is not one of "
        "api_keys or tenants.<name>.keys: the same keys as the engine's own check")
    admin_token: str | None = Field(
        None, min_length=1, description="bearer token for /kneegate/status, history and "
        "reload, and /metrics on the API port")
    admin_token_file: str | None = Field(
        None, min_length=1, description="a file holding the admin token (a mounted Secret; "
        "surrounding whitespace ignored), read at start and at each reload")
    server: ServerConfig = Field(default_factory=ServerConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)

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
        owner: dict[str, str] = {}
        for name, t in self.tenants.items():
            if t.class_ is not None and t.class_ not in self.classes:
                raise ValueError(f"tenants.{name}.class: {t.class_!r} is not one of "
                                 f"{sorted(self.classes)}")
            for i, key in enumerate(t.keys):  # the key is a secret: name its place, not it
                if key in owner:
                    raise ValueError(f"tenants.{name}.keys: entry {i + 1} is also a key of "
                                     f"tenant {owner[key]!r}")
                owner[key] = name
        if self.require_api_key and not self.api_keys and not owner:
            raise ValueError("require_api_key: no key is configured (api_keys, or a tenant's "
                             "keys): every request would be refused")
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ValueError("admin_token_file: give the token or a file holding it, not both")
        port, admin = self.server.port, self.server.admin_port
        if admin is not None and admin == port != 0:
            raise ValueError(f"server.admin_port: {admin} is also the API port; give the admin "
                             "endpoints a port of their own")
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstreams: names must be unique, got {names}")
        if self.retry_after_min > self.retry_after_max:
            raise ValueError("retry_after_min: must not exceed retry_after_max")
        return self


# turns a loaded file into the config a process runs (the CLI's flags, a worker's share, the
# embedded upstream): given to the gateway and the server, applied again at each reload
Prepare = Callable[[GatewayConfig], GatewayConfig]


_FIELD_NAMES = sorted({name.rstrip("_") for m in (
    GatewayConfig, UpstreamConfig, ClassConfig, TimeoutConfig, ServerConfig, ScaleConfig,
    LimitsConfig, TenantConfig) for name in m.model_fields})


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
        where = _field_path(err["loc"], data)
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            where, msg = _unknown_key(err["loc"], msg, data)
        # a check of a whole section (or a controller's params) names its field first
        head, sep, rest = msg.partition(": ")
        if sep and (not where or (err["type"] == "value_error" and _SUBPATH.fullmatch(head))):
            where, msg = ".".join(p for p in (where, head) if p), rest
        raise ConfigError(source, where, msg) from None


_SUBPATH = re.compile(r"[A-Za-z_][\w.]*|<unknown key>")


def _field_path(loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    # An API key is a mapping key, so pydantic puts it in the error's location: name the
    # field only. (Messages never carry the input; the input itself is never shown.)
    if loc and loc[0] == "api_keys" and len(loc) > 1:
        return "api_keys.<key>"
    parts = [str(p) for p in loc]
    if len(loc) > 1 and loc[0] == "upstreams" and isinstance(loc[1], int):
        label = _upstream_label(data, loc[1])
        if label is not None:  # an upstream by its name, not its place in the list
            parts[:2] = [f"upstreams[{label}]"]
    return ".".join(parts)


def _upstream_label(data: dict[str, Any], index: int) -> str | None:
    """How an error names the `index`th upstream: its `name`, else its URL (no userinfo,
    no query); None when it has neither."""
    ups = data.get("upstreams")
    up = ups[index] if isinstance(ups, list) and index < len(ups) else None
    if not isinstance(up, dict):
        return None
    name, url = up.get("name"), up.get("url")
    if isinstance(name, str) and name:
        return name
    return shown_url(url) if isinstance(url, str) and url else None


def _unknown_key(loc: tuple[int | str, ...], msg: str, data: dict[str, Any]) -> tuple[str, str]:
    # An unknown key is shown when it looks like a misspelt field; any other may be an API
    # key indented one level too little, so it is not shown.
    key = str(loc[-1])
    near = difflib.get_close_matches(key, _FIELD_NAMES, n=1, cutoff=0.7)
    if near:
        return _field_path(loc, data), f"{msg} (did you mean {near[0]!r}?)"
    where = ".".join([_field_path(loc[:-1], data), "<unknown key>"]).lstrip(".")
    return where, f"{msg} (the key is not shown: it may be a secret, e.g. an API key)"


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file."""
    return parse_config(read_config(path), str(path))


def parse_reload(
    data: dict[str, Any], running: GatewayConfig, source: str
) -> tuple[GatewayConfig, list[str]]:
    """Validate a reloaded file's document, keeping the running secrets where it is silent.

    A reload never drops a secret by omission: a file without `admin_token` (or
    `admin_token_file`) keeps the running token, one without `api_keys` keeps the running
    keys, one without `require_api_key` keeps requiring them (a half-written or wrong file
    must not open the admin endpoints or the engines, or move every keyed client to the
    default class). `admin_token: null`, `api_keys: {}` and `require_api_key: false` remove
    them, on purpose. Returns the
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
    if running.admin_token is not None or running.admin_token_file is not None:
        if "admin_token" not in data and "admin_token_file" not in data:
            for key in ("admin_token", "admin_token_file"):
                if getattr(running, key) is not None:
                    out[key] = getattr(running, key)
            notes.append("admin_token is not in the new file: the running token is kept "
                         "(write `admin_token: null` to remove it)")
        elif data.get("admin_token") is None and data.get("admin_token_file") is None:
            notes.append("admin_token: null in the new file: the token is removed, the admin "
                         "endpoints are open")
        elif data.get("admin_token") != running.admin_token:
            notes.append("admin_token changed")
    if running.require_api_key and "require_api_key" not in data:
        out["require_api_key"] = True
        notes.append("require_api_key is not in the new file: keys are still required "
                     "(write `require_api_key: false` to stop)")
    if running.api_keys:
        if "api_keys" not in data:
            out["api_keys"] = dict(running.api_keys)
            notes.append(f"api_keys is not in the new file: the running {len(running.api_keys)} "
                         "keys are kept (write `api_keys: {}` to remove them)")
        elif data["api_keys"] == {}:
            notes.append("api_keys: {} in the new file: every API key is removed")
    return out, notes


MAX_TOKEN_BYTES = 4096  # an admin token file holds one token, not a document


def read_admin_token(cfg: GatewayConfig, source: str = "<config>") -> str | None:
    """The admin token: `admin_token`, else what `admin_token_file` holds, surrounding
    whitespace stripped (a Secret written with `echo` ends in a newline). Raises ConfigError
    naming the file, never its contents, when it cannot be read or holds no token."""
    path = cfg.admin_token_file
    if path is None:
        return cfg.admin_token
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, "admin_token_file",
                          f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(source, "admin_token_file", f"{path} is not UTF-8 text") from None
    if len(raw) > MAX_TOKEN_BYTES or not token:
        why = "holds no token" if not token else f"is over {MAX_TOKEN_BYTES} bytes"
        raise ConfigError(source, "admin_token_file", f"{path} {why}")
    return token


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
