"""The access log: one line per proxied request, written where its outcome is settled.

    request_id=9f0c… upstream=vllm-0 class=interactive tenant=acme outcome=ok status=200
    queue_wait=0.004 ttft=0.183 duration=2.412 prompt_tokens=412 output_tokens=128

Logger `kneegate.access`, level INFO. What it holds: the request id (the client's
X-Request-Id or the one the gateway made), the upstream's configured name, the class, the
tenant as metrics name it (gateway/tenants.py: a configured name, `key-` and a hash of an
API key, or `anonymous`), the outcome (`ok`, `client_error` — the engine answered 4xx,
429 aside: the request's own fault, counted `completed` in the metrics and no latency
sample —, `upstream_error`, `timeout`, `client_cancelled`, `upstream_overloaded`,
`client_stalled`, or the reason a request was refused: `queue_full`, `over_objective`,
`queue_timeout`, `no_upstream`, `shutting_down`, `tenant_quota`, `body_too_large`,
`invalid_header`, `invalid_api_key`), the status answered (499 when the client left before
any was), seconds in the queue, to the first token (from arrival, as the user waits) and in
all, and the tokens: `output_tokens` the engine's `usage` count when its answer carries
one, else the content events streamed; `prompt_tokens` the engine's count, else (a stream
without `include_usage`) the prompt as admission sized it from its content. Never a header,
a key, a prompt or a body; the request id, which the client chose, is cut to 128 characters
and quoted when it holds anything but plain characters.

Cost: nothing is formatted unless the logger is enabled for INFO and `server.access_log`
is on (`--no-access-log` turns it off). With `--log-format json` the fields are keys of the
record's JSON object (gateway/observability/logs.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from kneegate.controllers.base import Outcome
from kneegate.gateway.errors import HTTPError, Rejection
from kneegate.gateway.gate import Permit
from kneegate.gateway.tap import Tap
from kneegate.gateway.types import Clock

__all__ = ["CLIENT_ERROR", "AccessLog"]

CLIENT_ERROR = "client_error"  # the outcome of a request the engine answered 4xx (429 aside)

log = logging.getLogger("kneegate.access")
_PLAIN = re.compile(r"[A-Za-z0-9._:/@+-]*")
_RID_MAX = 128


class AccessLog:
    """Writes the access lines of one gateway process; `enabled` follows the config."""

    __slots__ = ("clock", "enabled")

    def __init__(self, clock: Clock, enabled: bool = True) -> None:
        self.clock, self.enabled = clock, enabled

    def on(self) -> bool:
        """Whether a line would be written: check before gathering what goes in it."""
        return self.enabled and log.isEnabledFor(logging.INFO)

    def finished(
        self, rid: bytes, permit: Permit, outcome: Outcome, status: int, tap: Tap | None,
    ) -> None:
        """An admitted request ended (its permit is finished)."""
        t = permit.ticket
        at = t.dispatched_at if t.dispatched_at is not None else t.arrived_at
        prompt = out = 0
        ttft = None
        if tap is not None:
            prompt, out = tap.usage()
            if tap.first_at is not None:
                ttft = tap.first_at - t.arrived_at
        # the engine did not say (a stream without `include_usage`): the prompt as
        # admission sized it, from its content (gateway/request_size.py)
        prompt = prompt or t.tokens
        # an engine's 4xx (429 aside: overloaded) is the request's own fault, not a success
        name = CLIENT_ERROR if outcome is Outcome.OK and status >= 400 else outcome.value
        self._write({
            "request_id": _rid(rid), "upstream": permit.upstream.name, "class": t.cls,
            "tenant": t.tenant.label, "outcome": name, "status": status,
            "queue_wait": round(at - t.arrived_at, 4),
            "ttft": None if ttft is None else round(ttft, 4),
            "duration": round(self.clock() - t.arrived_at, 4),
            "prompt_tokens": prompt, "output_tokens": out,
        })

    def refused(self, rid: bytes, cls: str, exc: HTTPError, tenant: str = "anonymous") -> None:
        """A request answered with an error before it reached an upstream."""
        if not self.on():
            return
        fields: dict[str, Any] = {
            "request_id": _rid(rid), "upstream": None, "class": cls, "tenant": tenant,
            "outcome": exc.reason if isinstance(exc, Rejection) else exc.code,
            "status": exc.status,
        }
        if isinstance(exc, Rejection):
            fields["retry_after"] = exc.retry_after
        self._write(fields)

    @staticmethod
    def _write(fields: dict[str, Any]) -> None:
        log.info(_Line(fields), extra={"fields": fields, "event": "access"})


class _Line:
    """The text form, made only by a text formatter (JSON writes the fields themselves)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{k}={_text(v)}" for k, v in self.fields.items())


def _rid(rid: bytes) -> str:
    return rid[:_RID_MAX].decode("latin-1")


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and not _PLAIN.fullmatch(value):
        return json.dumps(value)  # quoted, escaped: a client's text never forges a field
    return str(value)
