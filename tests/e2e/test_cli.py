"""`kneegate serve` as a real process: flags, SIGHUP reload, workers, the embedded engine."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, serve
from helpers.process import free_port, until_up

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def kneegate(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    # `with` closes the output pipe; the gateway writes a few log lines, far below its buffer
    with subprocess.Popen([sys.executable, "-m", "kneegate", "serve", "--port", str(port),
                           *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        try:
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stopped(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM, then everything the gateway wrote (its log), once it has exited."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return out.decode()


async def limits(client: httpx.AsyncClient, url: str) -> list[int]:
    status = (await client.get(url + "/kneegate/status")).json()
    return [u["limit"] for u in status["upstreams"]]


def write(path: Path, up: str, limit: int) -> None:
    path.write_text(json.dumps({"upstreams": [
        {"name": "e0", "url": up, "controller": "fixed", "params": {"initial": limit}}]}))


@contextlib.asynccontextmanager
async def engine() -> AsyncIterator[str]:
    async with serve(FakeEngine()) as up:
        yield up


async def test_serve_flags_and_sighup_reload(tmp_path: Path) -> None:
    cfg = tmp_path / "kneegate.yaml"
    async with engine() as up, httpx.AsyncClient() as client:
        write(cfg, up, 3)
        with kneegate("--config", str(cfg)) as (proc, url):
            await until_up(client, url, proc)
            assert await limits(client, url) == [3]
            r = await client.post(url + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
            write(cfg, up, 5)
            proc.send_signal(signal.SIGHUP)
            with anyio.fail_after(5):
                while await limits(client, url) != [5]:
                    await asyncio.sleep(0.05)
            cfg.write_text("upstreams: [{name: e0, url: nope}]")
            proc.send_signal(signal.SIGHUP)
            with anyio.fail_after(5):
                while True:
                    m = (await client.get(url + "/metrics")).text
                    if 'kneegate_config_reloads_total{result="error"} 1.0' in m:
                        break
                    await asyncio.sleep(0.05)
            assert await limits(client, url) == [5]  # the bad file changed nothing
        write(cfg, up, 3)  # a flag beats the file
        with kneegate("--config", str(cfg), "--upstream", up, "--limit", "7") as (proc, url):
            await until_up(client, url, proc)
            assert await limits(client, url) == [7]


async def test_two_workers_split_a_fixed_limit() -> None:
    async with engine() as up, httpx.AsyncClient() as client:
        with kneegate("--upstream", up, "--controller", "fixed", "--limit", "9",
                      "--workers", "2") as (proc, url):
            await until_up(client, url, proc)
            seen: set[int] = set()
            with anyio.fail_after(10):
                while seen != {4, 5}:  # 9 = 5 + 4: each worker admits its share
                    # a fresh connection each time, so the kernel spreads them over workers
                    async with httpx.AsyncClient() as fresh:
                        seen.update(await limits(fresh, url))
            r = await client.post(url + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
        assert proc.returncode == 0


async def test_admin_port_flag_moves_the_admin_endpoints_in_every_worker() -> None:
    admin = f"http://127.0.0.1:{free_port()}"
    async with engine() as up, httpx.AsyncClient() as client:
        with kneegate("--upstream", up, "--workers", "2",
                      "--admin-port", admin.rsplit(":", 1)[1]) as (proc, url):
            await until_up(client, url, proc)
            r = await client.post(url + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
            for _ in range(4):  # fresh connections, so that both workers answer
                async with httpx.AsyncClient() as fresh:
                    assert (await fresh.get(url + "/metrics")).status_code == 404
                    assert (await fresh.get(url + "/kneegate/status")).status_code == 404
                    assert (await fresh.get(url + "/ready")).status_code == 200
                    m = await fresh.get(admin + "/metrics")
                    assert m.status_code == 200 and "kneegate_limit" in m.text
                    assert (await fresh.get(admin + "/kneegate/status")).status_code == 200
            log = stopped(proc)
        assert proc.returncode == 0
        assert "admin endpoints (/metrics, /kneegate/*) on http://127.0.0.1:" in log
        assert "open to every client of the API port" not in log


async def test_serve_warns_once_when_the_api_port_shows_the_admin_endpoints() -> None:
    async with engine() as up, httpx.AsyncClient() as client:
        with kneegate("--upstream", up, "--workers", "2") as (proc, url):
            await until_up(client, url, proc)
            log = stopped(proc)
        assert log.count("open to every client of the API port") == 1


async def test_serve_without_upstream_embeds_the_emulator() -> None:
    pytest.importorskip("kneegate.emulator.server")
    async with httpx.AsyncClient(timeout=10) as client:
        with kneegate() as (proc, url):
            await until_up(client, url, proc)
            status: dict[str, Any] = (await client.get(url + "/kneegate/status")).json()
            assert [u["name"] for u in status["upstreams"]] == ["embedded"]
            assert status["upstreams"][0]["controller"]["name"] == "knee"  # untuned: knee
            assert status["upstreams"][0]["scrape"] == "on"
            r = await client.post(url + "/v1/completions",
                                  json={"model": "cpu-tiny", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_python_dash_m_gateway_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kneegate", "--help"], capture_output=True,
                         text=True, check=True, env={**os.environ})
    assert "check-config" in out.stdout and "demo" in out.stdout


def test_the_gateway_floor_never_loads_the_load_tools() -> None:
    # every module of kneegate.gateway and the CLI, and what they import
    code = ("import importlib, pkgutil, sys, kneegate.gateway, kneegate.cli; "
            "[importlib.import_module(m.name) for m in "
            "pkgutil.walk_packages(kneegate.gateway.__path__, 'kneegate.gateway.')]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kneegate_bench', "
            "'aiohttp') or m.startswith(('kneegate.emulator', 'kneegate.sim'))), "
            "sorted(m for m in sys.modules if m.split('.')[0] in "
            "('gateway', 'controllers', 'admission', 'emulator', 'sim')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[] []"  # nor any module under a second, bare name


@pytest.mark.parametrize(("tool", "module"), [("engine", "kneegate.emulator.server"),
                                             ("sweep", "kneegate_bench.sweep"),
                                             ("simulate", "kneegate.sim.cli")])
def test_the_tools_are_reached_lazily(tool: str, module: str) -> None:
    pytest.importorskip(module)
    out = subprocess.run([sys.executable, "-m", "kneegate", tool, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout


# --- mistakes a newcomer makes: one line saying what to do, never a traceback --------------

def run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m kneegate ARGS` (or `code` run with `python -c`), to its end."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "kneegate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
def test_a_port_in_use_is_one_line_and_a_usage_error(flag: str) -> None:
    with taken_port() as port:
        # an upstream is named (unreachable, never asked): nothing but the bind can fail
        out = run_cli("serve", "--upstream", "http://127.0.0.1:9", "--port",
                      str(port if flag == "--port" else free_port()), *(
                          ["--admin-port", str(port)] if flag == "--admin-port" else []))
    assert out.returncode == 2
    assert one_line(out) == (f"kneegate: port {port} on 127.0.0.1 is in use; choose another "
                             f"with {flag}")


def test_a_config_file_that_is_not_there_is_one_line() -> None:
    out = run_cli("serve", "--config", "/nonexistent/kneegate.yaml")
    assert out.returncode == 2
    assert one_line(out) == ("kneegate: invalid config: /nonexistent/kneegate.yaml: cannot "
                             "read: No such file or directory")


@pytest.mark.parametrize(("missing", "argv"), [
    ("kneegate_bench", ["demo"]),
    ("kneegate_bench", ["sweep", "--url", "http://127.0.0.1:9", "--levels", "1"]),
    ("aiohttp", ["demo"]),  # kneegate-bench's own dependency
])
def test_a_load_tool_without_kneegate_bench_says_how_to_install_it(
    missing: str, argv: list[str]
) -> None:
    # made unimportable, as in an install of kneegate alone
    code = (f"import sys; sys.modules[{missing!r}] = None; from kneegate.cli import main; "
            f"sys.exit(main({argv!r}))")
    out = run_cli(code=code)
    assert out.returncode == 2
    assert one_line(out) == (
        f"kneegate {argv[0]} needs the load tools, the kneegate-bench distribution ({missing} "
        "is not installed): in a clone of kneegate, pip install -e ./bench")


def test_the_extra_modules_are_the_extras() -> None:
    from kneegate.cli import EXTRA_MODULES

    def extra(name: str) -> set[str]:
        marker = f'extra=="{name}"'
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]
                for r in importlib.metadata.requires("kneegate") or []
                if r.replace(" ", "").endswith(marker)}

    extras = set(importlib.metadata.metadata("kneegate").get_all("Provides-Extra") or [])
    assert set(EXTRA_MODULES.values()) <= extras
    assert "bench" not in extras  # the load tools are kneegate-bench, a distribution of its own
    assert extra("plots") == {m for m, e in EXTRA_MODULES.items() if e == "plots"}


def test_a_picture_without_the_plots_extra_says_how_to_install_it() -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; from kneegate.cli import main; "
            "sys.exit(main(['sweep', '--url', 'http://127.0.0.1:9', '--levels', '1']))")
    out = run_cli(code=code)
    assert out.returncode == 2
    assert one_line(out).startswith("kneegate sweep needs the plots extra (matplotlib is not "
                                    "installed): pip install 'kneegate[plots]'")


def test_without_the_load_tools_the_demo_and_an_unnamed_upstream_are_one_line() -> None:
    # as in the container image, which leaves the emulator, the simulator and the load tools out
    gone = ("import sys; sys.modules.update(dict.fromkeys(('kneegate_bench', 'kneegate.emulator', "
            "'kneegate.sim'))); from kneegate.cli import main; ")
    demo = run_cli(code=gone + "sys.exit(main(['demo']))")
    assert demo.returncode == 2
    assert one_line(demo).startswith("kneegate demo needs the load tools, the kneegate-bench "
                                     "distribution")
    for command, part in [("engine", "the emulator"), ("simulate", "the simulator")]:
        out = run_cli(code=gone + f"sys.exit(main([{command!r}, '--help']))")
        assert out.returncode == 2
        assert one_line(out) == (
            f"kneegate {command} needs {part}, which this install leaves out (the container "
            "image does): run it from a clone or a pip install of kneegate")
    serve = run_cli(code=gone + f"sys.exit(main(['serve', '--port', '{free_port()}']))")
    assert serve.returncode == 2
    assert one_line(serve) == (
        "kneegate: invalid config: command line: upstreams: none named, and the built-in "
        "emulator is not installed here (an install without it, as the container "
        "image): give one with --upstream URL or KNEEGATE_UPSTREAM")


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout == f"kneegate {importlib.metadata.version('kneegate')}\n"


def test_serve_help_shows_the_defaults_and_the_controllers() -> None:
    from kneegate.controllers.registry import CONTROLLERS
    from kneegate.gateway.config.gateway import GatewayConfig

    out = run_cli("serve", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())  # argparse wraps lines
    server = GatewayConfig().server
    for default in (f"(default: {server.port};", f"(default: {server.host};",
                    f"(default: {server.workers})", "(default: knee)", "(default: 2)",
                    "(default: text)"):
        assert default in text
    assert "{" + ",".join(sorted(CONTROLLERS)) + "}" in text
    assert "..." not in text


# --- the environment: what a container is configured by -----------------------------------

def test_the_environment_fills_what_no_flag_gives() -> None:
    from kneegate.cli import _parser, from_environment

    args = _parser().parse_args(["serve", "--port", "9000"])
    from_environment(args, {"KNEEGATE_UPSTREAM": "http://a:8000, http://b:8000",
                            "KNEEGATE_PORT": "8081", "KNEEGATE_HOST": "0.0.0.0",
                            "KNEEGATE_ADMIN_PORT": "", "KNEEGATE_CONFIG": "/etc/k.yaml"})
    assert args.upstream == ["http://a:8000", "http://b:8000"]
    assert args.port == 9000  # the flag wins
    assert args.host == "0.0.0.0" and args.config == "/etc/k.yaml"
    assert args.admin_port is None  # empty: unset


def test_a_port_in_the_environment_that_is_no_number_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "kneegate", "serve"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "KNEEGATE_PORT": "80a"})
    assert out.returncode == 2
    assert one_line(out) == ("kneegate: invalid config: environment: KNEEGATE_PORT: '80a' is "
                             "not a port number")


async def test_serve_configured_by_the_environment_alone() -> None:
    port = free_port()
    env = {**os.environ, "KNEEGATE_PORT": str(port), "KNEEGATE_HOST": "127.0.0.1"}
    async with engine() as up, httpx.AsyncClient() as client:
        env["KNEEGATE_UPSTREAM"] = up
        with subprocess.Popen([sys.executable, "-m", "kneegate", "serve"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
            url = f"http://127.0.0.1:{port}"
            try:
                await until_up(client, url, proc)
                status = (await client.get(url + "/kneegate/status")).json()
                assert [u["url"] for u in status["upstreams"]] == [up]
                r = await client.post(url + "/v1/completions", json={"max_tokens": 2})
                assert r.status_code == 200
            finally:
                stopped(proc)


def test_serve_help_names_the_environment() -> None:
    from kneegate.cli import ENVIRONMENT

    out = run_cli("serve", "--help")
    text = " ".join(out.stdout.split())
    for var in ENVIRONMENT.values():
        assert f"env {var})" in text or f"env {var};" in text, var
        assert var in text[text.index("environment (a flag overrides it"):]
