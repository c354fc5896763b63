"""Logging for `kneegate serve`: one handler for every record, kneegate's and uvicorn's.

    configure("text")   # 2026-12-01 10:00:00,000 INFO Started server process [42]
    configure("json")   # {"time": "2026-12-01T10:00:00.000Z", "level": "INFO", ...}

uvicorn is started with `log_config=None` (gateway/server/serving.py), so it installs no handler of
its own: its records propagate to the root handler set here and come out in the same
format, once. A record that carries `fields` (the access log, gateway/access.py) has them
as keys of its JSON object, and its `event` as the message.

The embedded emulator serves from the gateway's own process and event loop, through the
same uvicorn loggers: it runs with `EMBEDDED` set, and the handler drops its records below
WARNING (its "Started server process" was the second copy of every start-up line).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["EMBEDDED", "JsonFormatter", "configure"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(message)s"
EMBEDDED: contextvars.ContextVar[bool] = contextvars.ContextVar("kneegate_embedded", default=False)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC), level, logger, message, the record's
    `fields`, and the traceback as `exc_info` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # the fields say it all; `event` names the line
            out["message"] = getattr(record, "event", record.name)
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + (
        f".{int(created % 1 * 1000):03d}Z")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure` installs (so a second call knows which one to replace)."""


def _not_embedded(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not EMBEDDED.get()


def configure(
    fmt: Literal["text", "json"] = "text", level: int = logging.INFO,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Route every record to one stream handler in `fmt`; returns that handler. A second
    call replaces the handler the first one installed (never a second copy)."""
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_not_embedded)
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)  # in case something configured uvicorn's own handlers
        lg.handlers.clear()
        lg.propagate = True
    return handler
