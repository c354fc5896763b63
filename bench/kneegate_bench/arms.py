"""The overload benchmark's arms and the processes each cell runs.


An `Arm` is what stands in front of the users: the engine alone, the engine with vLLM's
valve, kneegate (as `--arms` names it, `parse_arms`), or a peer gateway; `_serving` starts
a fresh engine (and gateway) for one cell, or waits for a shared engine to go idle.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kneegate_bench.openloop import fetch_metrics, metric_totals
from kneegate_bench.overhead import _free_port, _process
from kneegate_bench.peers import Peer, parse_peer
from kneegate_bench.peers import serving as peer_serving

__all__ = ["ARMS", "TINY_VOCAB", "Arm", "engine_command", "engine_holds", "gateway_command",
           "parse_arms", "valve_sizes", "vllm_if_asked"]

TINY_VOCAB = 4096  # the real-vLLM tier's tiny model's vocabulary (tests/real_vllm/make_model.py)


ARMS = ("direct", "valve", "kneegate", "kneegate-w2", "kneegate-fixed")


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    engine_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] | None = None  # None: the client talks to the engine
    peer: Peer | None = None  # another gateway in front of the engine (kneegate_bench.peers)


def valve_sizes(objective: float, capacity_rps: float, prompt_tokens: int) -> list[int]:
    """objective x the queue's drain rate (capacity x prompt) x 0.25, 0.5, 1, in whole prompts.

    The valve counts the prompts of requests without a first token; at saturation they leave
    that state at the engine's completion rate, so this many tokens wait about objective x f.
    """
    base = objective * capacity_rps
    return sorted({max(1, round(base * f)) * prompt_tokens for f in (0.25, 0.5, 1.0)})


def parse_arms(text: str, valves: list[int], fixed_limit: int | None) -> list[Arm]:
    """The arms named in `--arms`; `valve` expands to one arm per size in `valves`."""
    arms: list[Arm] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name == "direct":
            arms.append(Arm(name))
        elif name == "valve":
            arms += [Arm(f"valve-{n}", ("--max-num-queued-tokens", str(n))) for n in valves]
        elif name.startswith("valve-") and name[6:].isdigit() and int(name[6:]) > 0:
            arms.append(Arm(name, ("--max-num-queued-tokens", name[6:])))
        elif name == "kneegate":
            arms.append(Arm(name, gateway_flags=()))
        elif name == "kneegate-w2":
            arms.append(Arm(name, gateway_flags=("--workers", "2")))
        elif name == "kneegate-fixed":
            if fixed_limit is None:
                raise ValueError("kneegate-fixed needs a limit (--fixed-limit or the sweep)")
            arms.append(Arm(name, gateway_flags=("--controller", "fixed", "--limit",
                                                 str(fixed_limit))))
        elif (peer := parse_peer(name)) is not None:
            arms.append(Arm(name, peer=peer))
        else:
            raise ValueError(f"unknown arm {name!r}: one of {', '.join(ARMS)}, valve-N, "
                             "litellm[-N] or vllm-router[-N]")
    return arms


def _arm_names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def engine_command(profile: str, port: int, flags: Sequence[str] = ()) -> list[str]:
    """An emulator of `profile` on `port`, with vLLM's `flags`: its command line."""
    return [sys.executable, "-m", "kneegate.emulator", "--profile", profile,
            "--port", str(port), *flags]


def gateway_command(upstreams: Sequence[str], port: int, flags: Sequence[str] = ()) -> list[str]:
    """`kneegate serve` in front of `upstreams` on `port`, with `flags`: its command line."""
    ups = [a for url in upstreams for a in ("--upstream", url)]
    return [sys.executable, "-m", "kneegate", "serve", *ups, "--port", str(port), *flags]


@contextlib.contextmanager
def _child(cmd: list[str], ready: str | int) -> Iterator[None]:
    """overhead._process (its output dropped: a gateway logs a line per request)."""
    with _process(cmd, ready):
        yield


IDLE_WAIT_S = 60.0  # how long a shared engine may take to drop the last cell's requests


def _wait_idle(url: str, limit: float = IDLE_WAIT_S) -> float:
    """Wait until a shared engine runs and queues nothing (vLLM's series on its /metrics);
    the seconds waited. A cell's users end, but the engine drops what they left only
    as it notices them gone: vLLM still held 233 of direct's requests at 3x a second after
    its cell ended, and the kneegate cell after it read their TTFT as its own (its first
    window: engine in-flight 56 where it held 14). No such series: no wait."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not engine_holds(url):
            return time.monotonic() - t0
        time.sleep(0.25)  # another process's state, read over HTTP: no event to wait on
    raise RuntimeError(f"{url} still busy {limit:g} s after the last cell")


def engine_holds(url: str) -> float | None:
    """The requests an engine runs and queues, by vLLM's series on its /metrics; None when
    it does not answer with them."""
    try:
        totals = metric_totals(fetch_metrics(url))
    except OSError:
        return None
    series = [totals.get(f"vllm:num_requests_{s}") for s in ("running", "waiting")]
    return None if None in series else sum(x or 0.0 for x in series)


@contextlib.contextmanager
def vllm_if_asked(args: Any) -> Iterator[None]:
    """With `--start-vllm` (`args.start_vllm`), the real-vLLM tier's vLLM (CPU build, tiny
    model, tests/real_vllm/vllm_server.py) for the block: `args.upstream` is set to it and
    `args.model` to its served name unless given. Without it, nothing. Both `--start-vllm`
    and `--upstream` exit (2) before anything starts."""
    if not getattr(args, "start_vllm", False):
        yield
        return
    if args.upstream:
        raise SystemExit("--upstream or --start-vllm, not both")
    from kneegate_bench.calibrate_vllm import _started_vllm

    with _started_vllm() as url:
        args.upstream, args.model = url, args.model or "tiny"
        yield


@contextlib.contextmanager
def _serving(arm: Arm, profile: str, upstream: str | None = None,
             start_vllm: bool = False, model: str | None = None,
             peer_bin: Path | None = None) -> Iterator[str]:
    """A fresh engine (and gateway) for one cell; yields the URL the users talk to.
    With `upstream`, that running engine instead of a fresh emulator; with `start_vllm` as
    well, an arm with engine flags (the valve) gets a vLLM of its own started with them.
    A peer arm puts that gateway (from `peer_bin`) in front of the engine."""
    if arm.peer is not None:
        with _serving(Arm("direct"), profile, upstream, start_vllm) as engine_url, \
                peer_serving(arm.peer, engine_url, model or profile, peer_bin) as url:
            yield url
        return
    if upstream is not None:
        if not arm.engine_flags:
            _wait_idle(upstream)
        if arm.engine_flags and start_vllm:
            from kneegate_bench.calibrate_vllm import _started_vllm

            with _started_vllm(*arm.engine_flags) as own:
                yield own
            return
        if arm.engine_flags:
            raise ValueError(f"arm {arm.name} sets engine flags: it needs the emulator")
        if arm.gateway_flags is None:
            yield upstream
            return
        gp = _free_port()
        gateway = gateway_command([upstream], gp, arm.gateway_flags)
        with _child(gateway, f"http://127.0.0.1:{gp}/health"):
            yield f"http://127.0.0.1:{gp}"
        return
    ep = _free_port()
    with _child(engine_command(profile, ep, arm.engine_flags), ep):
        if arm.gateway_flags is None:
            yield f"http://127.0.0.1:{ep}"
            return
        gp = _free_port()
        gateway = gateway_command([f"http://127.0.0.1:{ep}"], gp, arm.gateway_flags)
        with _child(gateway, f"http://127.0.0.1:{gp}/health"):
            yield f"http://127.0.0.1:{gp}"

