"""The gateways a vLLM user would put in front of an engine instead of kneegate, as arms of
`kneegate_bench.overload` (docs/compare.md): LiteLLM's proxy and vllm-router.

Neither is a dependency of kneegate: each is installed only when asked, best in a virtual
environment of its own (`INSTALL`), named to the benchmark with `--peer-bin DIR` (else the
PATH). An arm whose program is missing stops the run before anything starts, saying what to
install.

Arms:
  litellm           `litellm --config FILE`: one model whose `api_base` is the engine
                    (`hosted_vllm/`), its defaults otherwise; a master key left unset on
                    purpose (loopback only), `HF_HUB_OFFLINE=1` (else it may hang on a
                    tokenizer download) and its local model cost map (no fetch at start)
  litellm-N         the same with `max_parallel_requests: N` on the model
  vllm-router       `vllm-router --worker-urls ENGINE`, its defaults (32,768 concurrent
                    requests, a queue of 100)
  vllm-router-N     the same with `--max-concurrent-requests N --queue-size 2N`

LiteLLM takes no token ids as a prompt: a run with a `litellm` arm sends every arm the same
prompt as text (4 bytes a token, as the emulator counts text; `overload --text-prompt`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kneegate_bench.overhead import _free_port, _process

__all__ = ["INSTALL", "PEERS", "Peer", "find", "parse_peer", "serving", "started"]

# what each arm needs, exactly as checked (docs/compare.md): LiteLLM's `proxy` extra names
# packages the package index lacks (litellm-proxy, litellm-proxy-extras at its pinned
# versions), so the proxy's own imports are installed by name
INSTALL = {
    "litellm": ("litellm==1.110.2 backoff apscheduler python-multipart fastapi-sso pyjwt "
                "cryptography 'websockets<16' uvloop gunicorn rq 'rich<14' semver tomlkit "
                "pynacl expression mcp soundfile"),
    "vllm-router": "vllm-router==0.1.17",
}
PEERS = tuple(INSTALL)
START_S = 90.0  # LiteLLM's proxy takes ~10 s to start on 2 cores, more beside a busy engine


@dataclass(frozen=True, slots=True)
class Peer:
    program: str  # "litellm" or "vllm-router"
    concurrency: int | None = None  # litellm-N, vllm-router-N


def parse_peer(name: str) -> Peer | None:
    """`litellm`, `litellm-32`, `vllm-router`, `vllm-router-32` -> a Peer; None otherwise."""
    for program in PEERS:
        if name == program:
            return Peer(program)
        rest = name.removeprefix(program + "-")
        if rest != name and rest.isdigit() and int(rest) > 0:
            return Peer(program, int(rest))
    return None


def find(program: str, bin_dir: Path | None) -> str:
    """The program's path, in `bin_dir` when given, else on the PATH; SystemExit saying
    what to install where it is missing."""
    found = shutil.which(program, path=str(bin_dir) if bin_dir else None)
    if found is None:
        where = f"in {bin_dir}" if bin_dir else "on the PATH"
        raise SystemExit(
            f"arm {program}: no {program} {where}. Install it apart from kneegate, e.g.\n"
            f"    python3 -m venv .venv-compare && .venv-compare/bin/pip install "
            f"{INSTALL[program]}\nand name it with --peer-bin .venv-compare/bin")
    return found


def _litellm_config(upstream: str, model: str, concurrency: int | None) -> str:
    params = (f"      model: hosted_vllm/{model}\n      api_base: {upstream}/v1\n"
              "      api_key: none\n")
    if concurrency is not None:
        params += f"      max_parallel_requests: {concurrency}\n"
    return (f"model_list:\n  - model_name: {model}\n    litellm_params:\n{params}"
            "general_settings:\n  dangerously_permit_weak_or_unset_master_key: true\n")


def command(peer: Peer, path: str, upstream: str, port: int, model: str,
            folder: Path) -> tuple[list[str], str]:
    """(the command line, the URL that answers once it serves)."""
    if peer.program == "litellm":
        config = folder / "litellm.yaml"
        config.write_text(_litellm_config(upstream, model, peer.concurrency))
        return ([path, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                f"http://127.0.0.1:{port}/health/liveliness")
    limits = ([] if peer.concurrency is None else
              ["--max-concurrent-requests", str(peer.concurrency),
               "--queue-size", str(2 * peer.concurrency)])
    return ([path, "--worker-urls", upstream, "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning", *limits], f"http://127.0.0.1:{port}/health")


@contextlib.contextmanager
def started(peer: Peer, upstream: str, model: str, bin_dir: Path | None,
            prefix: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """The peer gateway in front of `upstream`, its command run under `prefix` (a `taskset`
    pinning it), until the block ends; yields its URL and its process id."""
    path = find(peer.program, bin_dir)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_LOG": "ERROR"}
    with tempfile.TemporaryDirectory(prefix="kneegate-peer-") as tmp:
        cmd, ready = command(peer, path, upstream, port, model, Path(tmp))
        with _process([*prefix, *cmd], ready, env, start_s=START_S) as proc:
            yield f"http://127.0.0.1:{port}", proc.pid


@contextlib.contextmanager
def serving(peer: Peer, upstream: str, model: str, bin_dir: Path | None) -> Iterator[str]:
    """The peer gateway in front of `upstream`, until the block ends; yields its URL."""
    with started(peer, upstream, model, bin_dir) as (url, _):
        yield url
