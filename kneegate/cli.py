"""`kneegate`: serve, check-config, the emulator, the simulator and the load tools.

    kneegate serve [--config FILE] [--upstream URL ...] [--host H] [--port P]
                   [--admin-port P] [--controller NAME] [--limit N] [--workers N]
                   [--ttft-objective S] [--log-format text|json] [--no-access-log]
    kneegate check-config FILE        # exit 0, or 1 naming the field path and the reason
    kneegate engine|simulate …        # the emulator, the simulator (loaded only when asked)
    kneegate demo|sweep …             # load tools: kneegate-bench, pip install -e ./bench

Flags override the environment (`KNEEGATE_CONFIG`, `KNEEGATE_UPSTREAM`, `KNEEGATE_HOST`,
`KNEEGATE_PORT`, `KNEEGATE_ADMIN_PORT`: what the container image is configured by), which
overrides the file. `--limit N` sets every upstream's controller `initial` (and lifts
its `max_limit` to at least N); with `--workers W` each worker gets its share of it.
Untuned, an upstream runs `knee` and its /metrics is scraped when it shows vLLM series;
`--controller fixed --limit N` pins the limit by hand. `--ttft-objective S` sets the
default class's objective: seconds from a request's arrival to its first token.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kneegate.controllers.knee import KneeConfig
from kneegate.controllers.registry import CONTROLLERS
from kneegate.gateway.config.gateway import (
    GatewayConfig,
    load_config,
    parse_config,
    read_admin_token,
)
from kneegate.gateway.config.upstream import public_url
from kneegate.gateway.errors import CannotListen, ConfigError
from kneegate.gateway.observability.logs import configure as configure_logging

__all__ = ["BENCH_MODULES", "ENVIRONMENT", "EXTRA_MODULES", "LEFT_OUT", "apply_flags",
           "from_environment", "main", "missing_extra", "version"]

log = logging.getLogger("kneegate")


SERVE_HELP = """Flags override the environment, which overrides the config file; a default
below holds where none sets it."""

# `serve`'s settings an environment variable may give (a flag overrides it): what a container
# is configured by (`docker run -e KNEEGATE_UPSTREAM=http://vllm:8000 ...`)
ENVIRONMENT = {
    "config": "KNEEGATE_CONFIG",
    "upstream": "KNEEGATE_UPSTREAM",  # one URL, or several separated by commas
    "host": "KNEEGATE_HOST",
    "port": "KNEEGATE_PORT",
    "admin_port": "KNEEGATE_ADMIN_PORT",
}
SERVE_EPILOG = ("environment (a flag overrides it; it overrides the file): "
                + ", ".join(f"{var} (--{key.replace('_', '-')})"
                            for key, var in ENVIRONMENT.items())
                + "; KNEEGATE_UPSTREAM takes several URLs separated by commas")


def _serve_parser(p: argparse.ArgumentParser) -> None:
    defaults = GatewayConfig()
    srv, objective = defaults.server, defaults.classes[defaults.default_class].ttft_objective
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file (see examples/kneegate.yaml; default: none, every "
                   "setting at its default; env KNEEGATE_CONFIG)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="engine base URL; repeat for several (replaces the file's list; "
                   "default: none, the built-in emulator; env KNEEGATE_UPSTREAM)")
    p.add_argument("--host", help=f"bind address (default: {srv.host}; 0.0.0.0 in a container; "
                   "env KNEEGATE_HOST)")
    p.add_argument("--port", type=int, help=f"listen port (default: {srv.port}; 0 picks one; "
                   "env KNEEGATE_PORT)")
    p.add_argument("--admin-port", type=int, metavar="PORT",
                   help="serve /metrics, /kneegate/*, /health and /ready on this port too; "
                   "the API port then answers the admin paths 404 (default: none; "
                   "env KNEEGATE_ADMIN_PORT)")
    p.add_argument("--controller", choices=sorted(CONTROLLERS),
                   help="controller for every upstream: knee learns the limit, fixed pins it "
                   "(with --limit) (default: knee)")
    p.add_argument("--limit", type=int,
                   help="initial concurrency limit per upstream; with fixed, the limit "
                   f"(default: the controller's own; knee's {KneeConfig().initial})")
    p.add_argument("--workers", type=int,
                   help=f"processes sharing the port (default: {srv.workers})")
    p.add_argument("--ttft-objective", type=float, metavar="SECONDS",
                   help="the default class's time from arrival to first token "
                   f"(default: {objective:g})")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object per line "
                   f"(default: {srv.log_format})")
    p.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                   help="no log line per request (default: one per request)")


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


def from_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill each of `ENVIRONMENT`'s settings that no flag gave from `environ` (an empty
    variable counts as unset); a value that is no port number raises ConfigError naming it."""
    for key, var in ENVIRONMENT.items():
        text = environ.get(var, "").strip()
        if not text or getattr(args, key, None) is not None:
            continue
        if key == "upstream":
            value: Any = [u.strip() for u in text.split(",") if u.strip()]
        elif key.endswith("port"):
            if not text.isdigit() or int(text) > 65535:
                raise ConfigError("environment", var, f"{text!r} is not a port number")
            value = int(text)
        else:
            value = text
        setattr(args, key, value)


def _load(args: argparse.Namespace) -> GatewayConfig:
    base = load_config(args.config) if args.config else GatewayConfig()
    return apply_flags(base, args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kneegate.embedded import emulator_app, emulator_installed
    from kneegate.gateway.server.workers import run

    from_environment(args, os.environ)
    cfg = _load(args)
    read_admin_token(cfg, args.config or "command line")  # an unreadable token file stops here
    if not cfg.upstreams and not emulator_installed():
        raise ConfigError("command line", "upstreams", "none named, and the built-in emulator "
                          "is not installed here (an install without it, as the "
                          "container image): give one with --upstream URL or KNEEGATE_UPSTREAM")
    configure_logging(cfg.server.log_format)
    return run(cfg, prepare=lambda c: apply_flags(c, args), config_path=args.config,
               engine=emulator_app if emulator_installed() else None)


def cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    names = ", ".join(f"{u.name}={public_url(u.url)} ({u.controller})" for u in cfg.upstreams)
    none = "none (serve starts the embedded emulator; a reload needs one unless it runs)"
    print(f"{args.file}: ok; upstreams: {names or none}")
    try:  # the file may be a Secret mounted where the gateway runs, not here
        read_admin_token(cfg, args.file)
    except ConfigError as exc:
        print(f"note: {exc.reason}; `kneegate serve` refuses to start without it")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kneegate_bench.demo import run_demo  # the load tools (kneegate-bench): asked for only

    configure_logging("text")
    return int(run_demo(load=args.load, seconds=args.seconds, profile=args.profile,
                        plot=Path(args.plot) if args.plot else None))


def _lazy(module: str, func: str = "main") -> Callable[[list[str]], int]:
    def call(argv: list[str]) -> int:
        import importlib

        mod = importlib.import_module(module)
        return int(getattr(mod, func)(argv) or 0)

    return call


PASSTHROUGH = {
    "engine": _lazy("kneegate.emulator.__main__"),
    "sweep": _lazy("kneegate_bench.sweep"),
    "simulate": _lazy("kneegate.sim.cli"),
}
PASSTHROUGH_HELP = {
    "engine": "the vLLM emulator, an OpenAI-compatible engine on a port",
    "sweep": "step concurrency, find the knee, back off (kneegate-bench)",
    "simulate": "controllers against the emulator's core in virtual time",
}


def version() -> str:
    """The installed distribution's version ("unknown" when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("kneegate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kneegate", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"kneegate {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway", description=SERVE_HELP,
                           epilog=SERVE_EPILOG)
    _serve_parser(serve)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser("demo", help="the same overload sent direct and through kneegate "
                          "(kneegate-bench)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--load", type=float, default=3.0, help="x the engine's capacity")
    demo.add_argument("--seconds", type=float, default=20.0, help="measured, per arm")
    demo.add_argument("--profile", default="cpu-tiny", help="the emulator's engine profile")
    demo.add_argument("--plot", default="kneegate-demo.png", metavar="FILE",
                      help="where to draw the learned curve, its knee and the limit (with "
                      "matplotlib: the plots extra); '' draws nothing")
    demo.set_defaults(func=cmd_demo)
    for name in PASSTHROUGH:
        sub.add_parser(name, help=f"{PASSTHROUGH_HELP[name]} (its own --help)", add_help=False)
    return p


# what the optional extras install (pyproject.toml), by import name: a command that needs one
# of them says how to install it instead of a traceback. `plots`: the pictures the sweep and
# the simulator write (and the demo, when it can)
EXTRA_MODULES = {"matplotlib": "plots"}
# the parts of kneegate an install may leave out (the container image does), by package
LEFT_OUT = {"kneegate.emulator": "the emulator", "kneegate.sim": "the simulator"}
# the load tools (`kneegate demo`, `kneegate sweep`): the kneegate-bench distribution, bench/
# in a clone, with its own dependency, aiohttp
BENCH_MODULES = ("kneegate_bench", "aiohttp")


def missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """The one line that tells how to install what `command` misses; None when `exc` is
    about neither an extra, a part left out nor the load tools."""
    name = exc.name or ""
    module = name.partition(".")[0]
    if module in BENCH_MODULES:
        return (f"kneegate {command} needs the load tools, the kneegate-bench distribution "
                f"({module} is not installed): in a clone of kneegate, pip install -e ./bench")
    for package, part in LEFT_OUT.items():
        if name == package or name.startswith(f"{package}."):
            return (f"kneegate {command} needs {part}, which this install leaves out (the "
                    "container image does): run it from a clone or a pip install of kneegate")
    extra = EXTRA_MODULES.get(module)
    if extra is None:
        return None
    return (f"kneegate {command} needs the {extra} extra ({module} is not installed): "
            f"pip install 'kneegate[{extra}]' (in a clone: pip install -e '.[{extra}]')")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    try:
        if command in PASSTHROUGH:
            return PASSTHROUGH[command](argv[1:])
        args = _parser().parse_args(argv)
        return _run(args)
    except CannotListen as exc:
        print(f"kneegate: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        hint = missing_extra(exc, command)
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kneegate: invalid config: {exc}", file=sys.stderr)
        return 2 if args.command != "check-config" else 1
