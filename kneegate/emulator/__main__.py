"""`python -m kneegate.emulator --profile NAME --port P` (also `kneegate engine ...`)."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import sys
from typing import TYPE_CHECKING

from kneegate.emulator.profiles import list_profiles

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["count", "main", "make_app", "parse_args"]

_SUFFIX = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def count(text: str) -> int:
    """A count >= 0 as vLLM's CLI reads one: `2560`, `32k` (32 000), `2.5k`, `1K` (1024).

    Lower-case suffixes are decimal and take a fraction that lands on an integer; upper-case
    ones are binary and take whole numbers only (vllm.utils.argparse_utils.human_readable_int).
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if m is None or (m[2].isupper() and "." in m[1]) or (not m[2] and "." in m[1]):
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 2560, 32k, 1K)")
    value = float(m[1]) * _SUFFIX.get(m[2], 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of `kneegate engine`."""
    ap = argparse.ArgumentParser(prog="kneegate engine", description="GPU-free vLLM emulator")
    ap.add_argument(
        "--profile", default="cpu-tiny", help=f"one of: relay, {', '.join(list_profiles())}"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="time scale: 0.1 runs ten times slower than real time",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-name", default=None, help="served model id (default: the profile)")
    ap.add_argument(
        "--relay-interval", type=float, default=0.0, help="relay profile: seconds between chunks"
    )
    ap.add_argument(
        "--max-num-queued-reqs",
        type=count,
        default=None,
        metavar="N",
        help="vLLM >= 0.32: answer 503 while N requests are in the engine (waiting + running); "
        "default: no cap",
    )
    ap.add_argument(
        "--max-num-queued-tokens",
        type=count,
        default=None,
        metavar="N",
        help="vLLM >= 0.32: answer 503 while the prompts of requests without a first token "
        "sum to N or more (e.g. 2560, 32k); default: no cap",
    )
    ap.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's automatic prefix caching (on by default in vLLM; the emulator's profiles "
        "leave it off): a prompt's blocks seen before skip their prefill",
    )
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def make_app(args: argparse.Namespace) -> Starlette:
    """The emulator the parsed command line asks for."""
    from kneegate.emulator.server import build_app

    return build_app(
        args.profile,
        speed=args.speed,
        seed=args.seed,
        model_name=args.model_name,
        relay_interval=args.relay_interval,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def main(argv: list[str] | None = None) -> None:
    """Serve the emulator until interrupted; once it accepts, one line on stderr says where.
    A port it cannot bind raises CannotListen (`kneegate engine` prints it as one line)."""
    import uvicorn

    from kneegate.gateway.server.serving import bind, listening_url

    args = parse_args(argv)
    app = make_app(args)
    logging.basicConfig(level=args.log_level.upper())
    sock = bind(args.host, args.port)
    line = (f"kneegate engine: the {args.profile} emulator listening on {listening_url(sock)} "
            "(an OpenAI-compatible API, as vLLM serves it; Ctrl-C stops it)")

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(line, file=sys.stderr, flush=True)

    server = Announcing(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                       loop="auto", http="auto"))
    server.run(sockets=[sock])
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the app failed to start (its log says why)


if __name__ == "__main__":
    from kneegate.gateway.errors import CannotListen

    try:
        main()
    except CannotListen as exc:  # as `kneegate engine` says it: one line, a usage error
        print(f"kneegate engine: {exc}", file=sys.stderr)
        sys.exit(2)
