"""`python -m benchmarks.engine --profile NAME --port P` (also `kneegate engine ...`)."""

from __future__ import annotations

import argparse
import logging

from benchmarks.engine.profiles import list_profiles

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Serve the emulator until interrupted."""
    import uvicorn

    from benchmarks.engine.server import build_app

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
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    app = build_app(
        args.profile,
        speed=args.speed,
        seed=args.seed,
        model_name=args.model_name,
        relay_interval=args.relay_interval,
    )
    logging.basicConfig(level=args.log_level.upper())
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        loop="auto",
        http="auto",
    )


if __name__ == "__main__":
    main()
