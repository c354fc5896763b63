"""`kneegate`: serve, check-config, demo, and the benchmark tools.

    kneegate serve [--config FILE] [--upstream URL ...] [--host H] [--port P]
                   [--admin-port P] [--controller NAME] [--limit N] [--workers N]
                   [--ttft-objective S] [--log-format text|json] [--no-access-log]
    kneegate check-config FILE        # exit 0, or 1 naming the field path and the reason
    kneegate demo                     # the same overload direct and through kneegate
    kneegate engine|sweep|simulate …  # the tools in benchmarks/ (loaded only when asked)

Flags override the file. `--limit N` sets every upstream's controller `initial` (and lifts
its `max_limit` to at least N); with `--workers W` each worker gets its share of it.
Untuned, an upstream runs `knee` and its /metrics is scraped when it shows vLLM series;
`--controller fixed --limit N` pins the limit by hand. `--ttft-objective S` sets the
default class's objective: seconds from a request's arrival to its first token.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kneegate.gateway.config import (
    GatewayConfig,
    load_config,
    parse_config,
    read_admin_token,
)
from kneegate.gateway.errors import ConfigError
from kneegate.gateway.logs import configure as configure_logging

__all__ = ["apply_flags", "main"]

log = logging.getLogger("kneegate")


def _serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see examples/kneegate.yaml)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="engine base URL; repeat for several (replaces the file's list)")
    p.add_argument("--host", help="bind address")
    p.add_argument("--port", type=int, help="listen port")
    p.add_argument("--admin-port", type=int, metavar="PORT",
                   help="serve /metrics, /kneegate/*, /health and /ready on this port too; "
                   "the API port then answers the admin paths 404")
    p.add_argument("--controller",
                   help="controller for every upstream (default knee; fixed to hand-tune, ...)")
    p.add_argument("--limit", type=int,
                   help="initial concurrency limit per upstream (fixed: the limit)")
    p.add_argument("--workers", type=int, help="processes sharing the port")
    p.add_argument("--ttft-objective", type=float, metavar="SECONDS",
                   help="the default class's time from arrival to first token (default 2)")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object per line (default: the file's, text)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                   help="no log line per request")


def apply_flags(cfg: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """The file's config with command-line flags laid over it, validated again."""
    data: dict[str, Any] = cfg.model_dump()
    if args.upstream:
        data["upstreams"] = [
            {"name": f"upstream{i}", "url": url} for i, url in enumerate(args.upstream)
        ]
    for up in data["upstreams"]:
        if args.controller:
            if up.get("controller") != args.controller:
                up["params"] = {}
            up["controller"] = args.controller
        if args.limit is not None:
            params = up.setdefault("params", {})
            params["initial"] = args.limit
            params["max_limit"] = max(args.limit, params.get("max_limit", 1024))
            params["min_limit"] = min(args.limit, params.get("min_limit", 1))
    # getattr: a caller's own Namespace may predate the flag
    objective = getattr(args, "ttft_objective", None)
    if objective is not None:
        data["classes"][data["default_class"]]["ttft_objective"] = objective
    server = data["server"]
    for key in ("host", "port", "admin_port", "workers", "log_format", "access_log"):
        if getattr(args, key, None) is not None:
            server[key] = getattr(args, key)
    return parse_config(data, "command line")


def _load(args: argparse.Namespace) -> GatewayConfig:
    base = load_config(args.config) if args.config else GatewayConfig()
    return apply_flags(base, args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kneegate.embedded import emulator_app
    from kneegate.gateway.server import run

    cfg = _load(args)
    read_admin_token(cfg, args.config or "command line")  # an unreadable token file stops here
    configure_logging(cfg.server.log_format)
    return run(cfg, prepare=lambda c: apply_flags(c, args), config_path=args.config,
               engine=emulator_app)


def cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    names = ", ".join(f"{u.name}={u.url} ({u.controller})" for u in cfg.upstreams)
    none = "none (serve starts the embedded emulator; a reload needs one unless it runs)"
    print(f"{args.file}: ok; upstreams: {names or none}")
    try:  # the file may be a Secret mounted where the gateway runs, not here
        read_admin_token(cfg, args.file)
    except ConfigError as exc:
        print(f"note: {exc.reason}; `kneegate serve` refuses to start without it")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kneegate.benchmarks.demo import run_demo  # the load tools and the emulator: asked for only

    configure_logging("text")
    return int(run_demo(load=args.load, seconds=args.seconds, profile=args.profile))


def _lazy(module: str, func: str = "main") -> Callable[[list[str]], int]:
    def call(argv: list[str]) -> int:
        import importlib

        mod = importlib.import_module(module)
        return int(getattr(mod, func)(argv) or 0)

    return call


PASSTHROUGH = {
    "engine": _lazy("kneegate.benchmarks.engine.__main__"),
    "sweep": _lazy("kneegate.benchmarks.sweep"),
    "simulate": _lazy("kneegate.benchmarks.simulate"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kneegate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    _serve_parser(serve)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser("demo", help="the same overload sent direct and through kneegate")
    demo.add_argument("--load", type=float, default=3.0, help="x the engine's capacity")
    demo.add_argument("--seconds", type=float, default=20.0, help="measured, per arm")
    demo.add_argument("--profile", default="cpu-tiny", help="the emulator's engine profile")
    demo.set_defaults(func=cmd_demo)
    for name in PASSTHROUGH:
        sub.add_parser(name, help=f"benchmarks: {name} (its own --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kneegate: invalid config: {exc}", file=sys.stderr)
        return 2 if args.command != "check-config" else 1
    except KeyboardInterrupt:
        return 0
