"""The relay's cost beside the gateways users would pick instead: direct, kneegate, peers.

    python -m kneegate_bench.overhead_peers --peer-bin .venv-compare/bin
    python -m kneegate_bench.overhead_peers --shapes short --peers vllm-router

`kneegate_bench.overhead`'s method, cell for cell: its raw SSE upstream and closed-loop client
pinned to one core, the proxy under test pinned to the other, its CPU read over the measured
window; kneegate runs with a fixed limit far above the offered concurrency (admission never
queues), and each peer (`kneegate_bench.peers`: LiteLLM's proxy, vllm-router; installed apart, as
docs/compare.md says) with its defaults. Each peer's process is the one measured (LiteLLM's
single worker; vllm-router's one process).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kneegate_bench import peers
from kneegate_bench.overhead import (
    PROXY_CORES,
    Cell,
    _cell,
    _gateway,
    _pin,
    _upstream,
    print_table,
)

__all__ = ["main"]

MODEL = "bench"  # what kneegate_bench.rawhttp's client names


def run(shapes: list[str], concs: list[int], seconds: float, names: list[str],
        bin_dir: Path | None) -> list[Cell]:
    arms = []
    for name in names:
        peer = peers.parse_peer(name)
        if peer is None:
            raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(peers.PEERS)}")
        peers.find(peer.program, bin_dir)  # a missing one says what to install, before any run
        arms.append((name, peer))
    cells: list[Cell] = []
    for shape in shapes:
        for conc in concs:
            with _upstream(shape) as up:
                cells.append(_cell("direct", shape, conc, up, seconds, None))
                with _gateway(up, 1) as (gp, pid):
                    cells.append(_cell("kneegate", shape, conc, gp, seconds, pid))
                for name, peer in arms:
                    url = f"http://127.0.0.1:{up}"
                    with peers.started(peer, url, MODEL, bin_dir, _pin(PROXY_CORES)) as (
                            peer_url, pid):
                        port = int(peer_url.rsplit(":", 1)[1])
                        cells.append(_cell(name, shape, conc, port, seconds, pid))
    return cells


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kneegate_bench.overhead_peers",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="short,realistic")
    p.add_argument("--concurrency", default="256")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per cell")
    p.add_argument("--peers", default="vllm-router,litellm")
    p.add_argument("--peer-bin", type=Path, default=None,
                   help="where the peers' programs are (default: the PATH)")
    args = p.parse_args(argv)
    cells = run(args.shapes.split(","), [int(c) for c in args.concurrency.split(",")],
                args.seconds, [n for n in args.peers.split(",") if n], args.peer_bin)
    print_table(cells)


if __name__ == "__main__":
    main()
