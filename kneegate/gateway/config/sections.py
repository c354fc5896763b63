"""The config file's small sections, one frozen model each: `classes.<name>`, `limits`,
`server`, `scale`, and the base every config model shares (`Frozen`: immutable, unknown keys
refused). The engines' sections are in `gateway.config.upstream`; the whole file,
`GatewayConfig`, and how it is read and validated are in `gateway.config`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClassConfig", "Frozen", "LimitsConfig", "ScaleConfig", "ServerConfig", "TenantConfig"]


class Frozen(BaseModel):
    """Every config model's base: immutable once validated; a key it does not know is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ClassConfig(Frozen):
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
        "predicted to wait in the queue while arrivals outnumber completions (by over 1.2); "
        "beyond it, 429 over_objective at once (with no such excess: the whole objective)")



class TenantConfig(Frozen):
    """One named tenant (`tenants.<name>`): fair shares within a class are kept between
    tenants, counted in tokens; a request's tenant is its API key's."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    keys: list[str] = Field(
        default_factory=list, description="bearer API keys whose requests are this tenant's")
    weight: float = Field(
        1.0, gt=0, le=1000, description="its share relative to other tenants' (2: twice)")
    class_: str | None = Field(
        None, alias="class", description="the class its requests go to (api_keys win)")
    max_inflight: int | None = Field(
        None, ge=1, description="its requests queued or in flight, at most; more: 429")
    tokens_per_minute: float | None = Field(
        None, gt=0, description="prompt and output tokens a minute, at most; more: 429")
    by_header: bool = Field(
        False, description="the `tenant_header` may name it (else only its keys do: any "
        "client can send a header)")


class LimitsConfig(Frozen):
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
    body_deadline: float = Field(
        300.0, gt=0, le=3600,
        description="a request body must arrive whole within this from its first read (Envoy's "
        "request_timeout in its edge settings); else 408 and close")
    keepalive_timeout: float = Field(
        60.0, gt=0, le=3600,
        description="an idle keep-alive client connection is closed after this")
    max_connections: int = Field(
        10000, ge=1, le=1_000_000,
        description="open client connections per worker; a request on one more gets 503 and close")
    max_connections_per_client: int | None = Field(
        None, ge=1, le=1_000_000,
        description="open connections per worker from one client address (nginx's "
        "limit_conn); a request on one more gets 503 and close; null: a quarter of "
        "max_connections (2,500 of 10,000: one address never takes them all). Behind a "
        "proxy every connection has its address: set it to max_connections there")

    @property
    def per_client_connections(self) -> int:
        """`max_connections_per_client`, or its default: a quarter of max_connections."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 4)
    max_upstream_header_bytes: int = Field(
        65536, ge=1024, le=16 << 20,
        description="status line plus headers of one engine response, bytes; more: 502")


class ServerConfig(Frozen):
    """Where the gateway listens. Changing these needs a restart, not a reload."""

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 in a container")
    port: int = Field(8080, ge=0, le=65535, description="0 picks a free port")
    admin_port: int | None = Field(
        None, ge=0, le=65535,
        description="a second port for /metrics, /kneegate/* (status, history, reload, the "
        "live page), /health and /ready; the API port then answers the admin paths 404. "
        "Unset: they share the API port (/metrics behind admin_token when one is set)")
    admin_host: str | None = Field(
        None, description="the admin port's bind address (127.0.0.1: this machine only); "
        "unset: `host`")
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


class ScaleConfig(Frozen):
    """The scale-out signal: kneegate_demand_ratio and kneegate_suggested_replicas
    (admission/demand.py). Reloadable."""

    target: float = Field(
        0.9, gt=0, le=1, description="utilisation of the engines' knee capacity that "
        "kneegate_suggested_replicas aims at")
    half_life: float = Field(
        15.0, gt=0, le=3600, description="seconds: offered load and capacity are averaged "
        "with this half-life")



class RoutingConfig(Frozen):
    """How a request picks its engine within a pool of engines serving its model
    (admission/pools.py, admission/affinity.py). Reloadable."""

    affinity: bool = Field(
        True, description="prefix affinity: a prompt goes back to the engine that served its "
        "longest known beginning (a conversation's earlier turns) while that engine has room "
        "under its limit; off: always the least full engine")
    affinity_entries: int = Field(
        16384, ge=1, le=10_000_000, description="prompts remembered per pool (least recently "
        "used dropped first)")
    without_affinity: list[str] = Field(
        default_factory=list, description="models whose pool routes by room alone, "
        "affinity on or not")
