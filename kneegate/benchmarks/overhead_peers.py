"""The relay's cost beside the gateways users would pick instead: direct, kneegate, peers.

    python -m kneegate.benchmarks.overhead_peers --peer-bin .venv-compare/bin
    python -m kneegate.benchmarks.overhead_peers --shapes short --peers vllm-router

`benchmarks.overhead`'s method, cell for cell: its raw SSE upstream and closed-loop client
pinned to one core, the proxy under test pinned to the other, its CPU read over the measured
window; kneegate runs with a fixed limit far above the offered concurrency (admission never
queues), and each peer (`benchmarks.peers`: LiteLLM's proxy, vllm-router; installed apart, as
docs/compare.md says) with its defaults. Each peer's process is the one measured (LiteLLM's
single worker; vllm-router's one process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kneegate.benchmarks import peers
from kneegate.benchmarks.overhead import (
    PROXY_CORES,
    Cell,
    _cell,
    _free_port,
    _gateway,
    _pin,
    _process,
    _upstream,
    print_table,
)

__all__ = ["main"]

MODEL = "bench"  # what benchmarks.rawhttp's client names


@contextlib.contextmanager
def _peer(peer: peers.Peer, up_port: int, bin_dir: Path | None) -> Iterator[tuple[int, int]]:
    """The peer in front of the raw upstream, pinned to the proxy's core: (port, pid)."""
    path = peers.find(peer.program, bin_dir)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_LOG": "ERROR"}
    with tempfile.TemporaryDirectory(prefix="kneegate-peer-") as tmp:
        cmd, ready = peers.command(peer, path, f"http://127.0.0.1:{up_port}", port, MODEL,
                                   Path(tmp))
        with _process([*_pin(PROXY_CORES), *cmd], ready, env, start_s=peers.START_S) as proc:
            yield port, proc.pid


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
                    with _peer(peer, up, bin_dir) as (pp, pid):
                        cells.append(_cell(name, shape, conc, pp, seconds, pid))
    return cells


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kneegate.benchmarks.overhead_peers",
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
