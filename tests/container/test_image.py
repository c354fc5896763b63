"""The container image: built from the Dockerfile, configured by the environment alone, it
serves a streamed answer from the emulator on this machine, its health check follows the
configured port, and it carries neither the emulator, the simulator nor the load tools.

Opt-in: `pytest -m container` (root, buildah and debootstrap: `apt-get install -y debootstrap
buildah`; ~2 min the first time, for the Debian base `base_image.sh` makes where no registry
answers, then ~15 s a build). buildah runs the image with chroot isolation (this kernel's
cgroups refuse crun's): the container shares this machine's network, so the gateway's port is
a port here and the emulator's port is one there, as `docker run --network host` would have it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kneegate_bench.overhead import _free_port, _process

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/kneegate:test"


def _buildah(*args: str, timeout: float = 60, check: bool = True
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0 or not (shutil.which("buildah") and shutil.which("debootstrap")):
        pytest.skip("needs root, buildah and debootstrap (apt-get install -y debootstrap buildah)")
    base = subprocess.run([str(ROOT / "tests/container/base_image.sh")], capture_output=True,
                          text=True, timeout=900, check=True).stdout.strip()
    _buildah("bud", "--isolation", "chroot", "--format", "docker", "--build-arg",
             f"BASE={base}", "-t", IMAGE, str(ROOT), timeout=900)
    return IMAGE


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = _buildah("from", image).stdout.strip()
    try:
        yield name
    finally:
        _buildah("rm", name, check=False)


def _config(image: str) -> dict[str, object]:
    """The image's Docker config: entrypoint, cmd, environment, health check."""
    out = _buildah("inspect", "--type", "image", image)
    config: dict[str, object] = json.loads(out.stdout)["Docker"]["config"]
    return config


def _run(container: str, *cmd: str, env: dict[str, str] | None = None) -> list[str]:
    """`buildah run` of `cmd` in `container` (the image's user, its environment and `env`)."""
    flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return ["buildah", "run", "--isolation", "chroot", *flags, container, "--", *cmd]


@contextlib.contextmanager
def _serving(container: str, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """The image's own command (entrypoint and cmd) run with `env`, until it answers /health."""
    config = _config(IMAGE)
    command = [*config["Entrypoint"], *config["Cmd"]]  # type: ignore[misc]
    url = f"http://127.0.0.1:{env['KNEEGATE_PORT']}/health"
    with subprocess.Popen(_run(container, *command, env=env), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, "the image's gateway never answered /health"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                time.sleep(0.1)  # another process starting: no event to wait on
            yield proc
        finally:
            proc.terminate()  # buildah ends what it runs
            proc.wait(20)


def test_the_image_serves_a_stream_configured_by_the_environment(container: str) -> None:
    engine_port, port = _free_port(), _free_port()
    engine = [sys.executable, "-m", "kneegate.emulator", "--port", str(engine_port),
              "--model-name", "tiny"]
    env = {"KNEEGATE_UPSTREAM": f"http://127.0.0.1:{engine_port}", "KNEEGATE_PORT": str(port)}
    with _process(engine, engine_port), _serving(container, env):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=10) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 5 and events[-1] == "data: [DONE]"  # 4 tokens, then the end
        status = httpx.get(f"http://127.0.0.1:{port}/kneegate/status", timeout=5).json()
        assert [u["url"] for u in status["upstreams"]] == [env["KNEEGATE_UPSTREAM"]]
        # the image's health check, run as docker would: it reads the port it is given
        check = _config(IMAGE)["Healthcheck"]["Test"]  # type: ignore[index]
        assert check[0] == "CMD"
        ok = subprocess.run(_run(container, *check[1:], env=env), capture_output=True,
                            timeout=30)
        assert ok.returncode == 0, ok.stderr
        elsewhere = {"KNEEGATE_PORT": str(_free_port())}  # nothing listens there
        bad = subprocess.run(_run(container, *check[1:], env=elsewhere), capture_output=True,
                             timeout=30)
        assert bad.returncode != 0


def test_the_image_runs_as_its_user_and_carries_no_load_tools(container: str) -> None:
    code = ("import importlib.util as u, os; print(os.getuid(), [m for m in ('kneegate.gateway', "
            "'kneegate.emulator', 'kneegate.sim', 'kneegate_bench', 'aiohttp', 'numpy', "
            "'matplotlib') if u.find_spec(m)])")
    out = subprocess.run(_run(container, "python3", "-c", code), capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout.strip() == "10001 ['kneegate.gateway']"


def test_the_image_without_an_upstream_says_so_in_one_line(container: str) -> None:
    out = subprocess.run(_run(container, "kneegate", "serve"), capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0
    assert ("none named, and the built-in emulator is not installed here (an install without "
            "it, as the container image): give one with --upstream URL or "
            "KNEEGATE_UPSTREAM") in out.stderr
