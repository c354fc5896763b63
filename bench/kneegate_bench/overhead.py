"""The gateway's own cost: the same load direct, through kneegate, and through nginx, in one run.

The upstream (`kneegate_bench.rawhttp` SSE server) and the closed-loop client are lean raw-asyncio
programs pinned to one core; the proxy under test is pinned to the other (`taskset`), so the
figure is the proxy's. Each cell runs every target back to back and reports ratios to direct;
with `--repeat N` the medians of N rounds.

    python -m kneegate_bench.overhead                      # the full matrix (~5 minutes)
    python -m kneegate_bench.overhead --quick              # 256 realistic only

Load shapes: `short` = 16 events, no delay; `realistic` = 64 events at 20 ms; `burst` = the
realistic stream, but every worker starts at once and they stay in waves (a batch job
starting, or clients whose Retry-After ran out in the same second): its TTFT columns are
what a burst of that many new streams waits for its first byte. The fixed limit is
set far above the offered concurrency, so admission never queues: this measures the relay.
The workers' first requests are spread over one stream's duration (1.28 s for realistic), so
completions arrive at an even rate; `--lockstep` starts them together, as before 2026-11-30:
then 1024 requests arrive within milliseconds every 1.3 s and req/s counts whole waves.

CPU columns: `cpu` is the proxy process's CPU over the measured window as a fraction of one
core; `us/req` and `us/ev` divide that CPU by the requests and by the SSE events relayed in
the window (issue 16's goals: <= 60 us per request in the short shape, <= 15 us per event).
CPU time hardly depends on how busy the machine is, unlike the latency columns, so
`--shapes short --concurrency 256 --seconds 4` is a fair quick check of a change.

`--granian` adds kneegate's own app under granian (a Rust HTTP server for Python apps), the
ASGI server issue 16 asked to measure against uvicorn's request cycle: `kg-granian` rows.
`--floor` adds uvicorn with nothing behind it (`kneegate_bench.asgi_floor`: a plain ASGI app
answering the same stream itself, no upstream): `uvicorn-floor` rows, the least any app
under uvicorn can cost per request (with `--granian` too, `granian-floor`). Their "x direct"
compares a server with a relay, so read their `us/req`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["main"]

SHAPES = {"short": (16, 0.0), "realistic": (64, 0.02), "burst": (64, 0.02)}
BURSTS = {"burst"}  # shapes whose streams all start together, in waves (issue 16)
CLIENT_CORE, PROXY_CORES = "0", "1"


@dataclass
class Cell:
    target: str
    shape: str
    concurrency: int
    rps: float
    eps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    proxy_cpu: float  # fraction of one core, nan for direct
    cpu_us_req: float  # the proxy's CPU per request relayed, microseconds (nan for direct)
    cpu_us_event: float  # ... per SSE event relayed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(cores: str) -> list[str]:
    ncpu = os.cpu_count() or 1
    return ["taskset", "-c", cores] if shutil.which("taskset") and ncpu > 1 else []


def _wait_http(url: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=1).read()
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {seconds}s")


def _wait_port(port: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open within {seconds}s")


@contextlib.contextmanager
def _process(cmd: list[str], ready: str | int, env: dict[str, str] | None = None,
             start_s: float = 20.0) -> Iterator[subprocess.Popen[bytes]]:
    # never read: a pipe would fill and block the child (a gateway logs a line per request)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        if isinstance(ready, int):
            _wait_port(ready, start_s)
        else:
            _wait_http(ready, start_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _upstream(shape: str) -> Iterator[int]:
    events, interval = SHAPES[shape]
    port = _free_port()
    cmd = [*_pin(CLIENT_CORE), sys.executable, "-m", "kneegate_bench.rawhttp", "serve",
           "--port", str(port), "--events", str(events), "--interval", str(interval)]
    with _process(cmd, port):
        yield port


@contextlib.contextmanager
def _gateway(up_port: int, workers: int) -> Iterator[tuple[int, int]]:
    port = _free_port()
    cores = PROXY_CORES if workers == 1 else f"0-{(os.cpu_count() or 1) - 1}"
    cmd = [*_pin(cores), sys.executable, "-m", "kneegate", "serve",
           "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(port),
           "--controller", "fixed", "--limit", "100000", "--workers", str(workers),
           "--no-access-log"]  # like nginx's `access_log off` below
    with _process(cmd, f"http://127.0.0.1:{port}/health") as proc:
        yield port, proc.pid


_NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;  # the default 1000 would close each client connection after
                                 # 1000 requests, ending a fast worker of the closed loop
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  upstream up {{ server 127.0.0.1:{up}; keepalive 2048; keepalive_requests 100000000; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


_GRANIAN_FLAGS = ("--interface", "asgi", "--loop", "uvloop", "--workers", "1", "--runtime-mode",
                  "st", "--no-ws", "--http", "1", "--host", "127.0.0.1", "--log-level", "warning")


@contextlib.contextmanager
def _granian(up_port: int) -> Iterator[tuple[int, int]]:
    """kneegate's app (`kneegate_bench.asgi_app`) under granian, one worker on the proxy's core;
    yields its port and its worker's pid (granian's main process only supervises)."""
    port = _free_port()
    cmd = [*_pin(PROXY_CORES), sys.executable, "-m", "granian", *_GRANIAN_FLAGS,
           "--port", str(port), "kneegate_bench.asgi_app:app"]
    env = {**os.environ, "KNEEGATE_BENCH_UPSTREAM": f"http://127.0.0.1:{up_port}"}
    with _process(cmd, f"http://127.0.0.1:{port}/health", env) as proc:
        workers = _children(proc.pid)
        yield port, (workers[-1] if workers else proc.pid)


@contextlib.contextmanager
def _floor(shape: str, server: str = "uvicorn") -> Iterator[tuple[int, int]]:
    """An ASGI server alone (`kneegate_bench.asgi_floor`) answering the shape's stream itself, on
    the proxy's core, run as kneegate's uvicorn (or `_granian`) is; yields its port and the
    pid that does the work."""
    events, interval = SHAPES[shape]
    port = _free_port()
    app = "kneegate_bench.asgi_floor:app"
    if server == "uvicorn":
        cmd = [*_pin(PROXY_CORES), sys.executable, "-m", "uvicorn", "--loop", "uvloop",
               "--http", "httptools", "--no-access-log", "--log-level", "warning",
               "--host", "127.0.0.1", "--port", str(port), app]
    else:
        cmd = [*_pin(PROXY_CORES), sys.executable, "-m", "granian", *_GRANIAN_FLAGS,
               "--port", str(port), app]
    env = {**os.environ, "KNEEGATE_FLOOR_EVENTS": str(events),
           "KNEEGATE_FLOOR_INTERVAL": str(interval)}
    with _process(cmd, f"http://127.0.0.1:{port}/health", env) as proc:
        workers = _children(proc.pid) if server == "granian" else []
        yield port, (workers[-1] if workers else proc.pid)


@contextlib.contextmanager
def _nginx(up_port: int) -> Iterator[tuple[int, int]]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(_NGINX_CONF.format(tmp=tmp, up=up_port, port=port))
        cmd = [*_pin(PROXY_CORES), "nginx", "-c", str(conf), "-p", tmp]
        with _process(cmd, port) as proc:
            yield port, proc.pid


def _cell(target: str, shape: str, conc: int, port: int, seconds: float,
          pid: int | None, lockstep: bool = False) -> Cell:
    """One closed-loop run in its own pinned client process; CPU of `pid` meanwhile.

    The workers' first requests are spread over one stream's duration (see
    `rawhttp.run_load`), unless `lockstep`: then all start at once and stay in waves.
    The client reads `pid`'s CPU when its window opens and closes, so the CPU per request
    and per event divide the same span's CPU by that span's counts.
    """
    events, interval = SHAPES[shape]
    stagger = 0.0 if lockstep or shape in BURSTS else events * interval
    cmd = [*_pin(CLIENT_CORE), sys.executable, "-m", "kneegate_bench.rawhttp", "load",
           "--url", f"http://127.0.0.1:{port}/v1/completions",
           "--concurrency", str(conc), "--seconds", str(seconds),
           "--warmup", f"{1 + 1.5 * stagger:g}", "--stagger", f"{stagger:g}"]
    if pid:
        cmd += ["--cpu-pid", str(pid)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
    d = json.loads(out.stdout)
    cpu = d["cpu_s"] / seconds if d.get("cpu_s") is not None else float("nan")
    return Cell(target, shape, conc, d["rps"], d["eps"], d["ttft_p50"] * 1000,
                d["ttft_p99"] * 1000, cpu, d["cpu_us_per_request"], d["cpu_us_per_event"])


def run_matrix(shapes: list[str], concs: list[int], seconds: float, repeat: int,
               workers_at: int | None, lockstep: bool = False, granian: bool = False,
               floor: bool = False) -> list[Cell]:
    cells: list[Cell] = []
    have_nginx = shutil.which("nginx") is not None
    floors = ([] if not floor else ["uvicorn", "granian"] if granian else ["uvicorn"])
    for shape in shapes:
        for conc in concs:
            for _ in range(repeat):
                with _upstream(shape) as up:
                    cells.append(_cell("direct", shape, conc, up, seconds, None, lockstep))
                    with _gateway(up, 1) as (gp, pid):
                        cells.append(_cell("kneegate", shape, conc, gp, seconds, pid, lockstep))
                    if workers_at == conc and shape == "realistic":
                        with _gateway(up, 2) as (gp, pid):
                            cells.append(_cell("kneegate-2w", shape, conc, gp, seconds, pid,
                                               lockstep))
                    if granian:
                        with _granian(up) as (gp, pid):
                            cells.append(_cell("kg-granian", shape, conc, gp, seconds, pid,
                                               lockstep))
                    for server in floors:
                        with _floor(shape, server) as (fp, pid):
                            cells.append(_cell(f"{server}-floor", shape, conc, fp, seconds,
                                               pid, lockstep))
                    if have_nginx:
                        with _nginx(up) as (np_, pid):
                            cells.append(_cell("nginx", shape, conc, np_, seconds, pid, lockstep))
                _report_progress(cells[-1])
    return cells


def _report_progress(c: Cell) -> None:
    if sys.stderr.isatty():
        print(f"  .. {c.shape} x{c.concurrency} done", file=sys.stderr)


def _median(cells: list[Cell], attr: str) -> float:
    vals = [getattr(c, attr) for c in cells]
    return statistics.median(vals) if vals else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")  # a target that served nothing has no ratio


def print_table(cells: list[Cell]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    keys = sorted({(c.shape, c.concurrency) for c in cells}, key=lambda k: (k[0], k[1]))
    hdr = (f"{'shape':<10}{'conc':>6} {'target':<14}{'req/s':>9}{'events/s':>10}"
           f"{'ttft p50':>10}{'ttft p99':>10}{'+p50 ms':>9}{'+p99 ms':>9}{'cpu':>6}"
           f"{'us/req':>8}{'us/ev':>7}{'x direct':>9}{'x nginx':>9}")
    print(hdr)
    for shape, conc in keys:
        group = [c for c in cells if (c.shape, c.concurrency) == (shape, conc)]
        targets = dict.fromkeys(c.target for c in group)
        by = {t: [c for c in group if c.target == t] for t in targets}
        d_rps, d50, d99 = (_median(by["direct"], a) for a in ("rps", "ttft_p50_ms", "ttft_p99_ms"))
        n_rps = _median(by.get("nginx", []), "rps")
        for target, cs in by.items():
            row: dict[str, object] = {}
            nums = {k: _median(cs, k)
                    for k in ("rps", "eps", "ttft_p50_ms", "ttft_p99_ms", "proxy_cpu",
                              "cpu_us_req", "cpu_us_event")}
            nums.update(ratio_direct=_ratio(nums["rps"], d_rps),
                        ratio_nginx=_ratio(nums["rps"], n_rps),
                        added_p50_ms=nums["ttft_p50_ms"] - d50,
                        added_p99_ms=nums["ttft_p99_ms"] - d99)
            row.update(nums, shape=shape, concurrency=conc, target=target, runs=len(cs))
            rows.append(row)
            print(f"{shape:<10}{conc:>6} {target:<14}{nums['rps']:>9.1f}{nums['eps']:>10.0f}"
                  f"{nums['ttft_p50_ms']:>10.1f}{nums['ttft_p99_ms']:>10.1f}"
                  f"{nums['added_p50_ms']:>9.1f}{nums['added_p99_ms']:>9.1f}"
                  f"{nums['proxy_cpu']:>6.2f}{nums['cpu_us_req']:>8.1f}"
                  f"{nums['cpu_us_event']:>7.2f}{nums['ratio_direct']:>9.2f}"
                  f"{nums['ratio_nginx']:>9.2f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kneegate_bench.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="short,realistic")
    p.add_argument("--concurrency", default="16,256,1024")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per cell")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the table shows medians")
    p.add_argument("--workers-at", type=int, default=1024,
                   help="also run 2 gateway workers at this realistic concurrency (0: never)")
    p.add_argument("--quick", action="store_true", help="realistic x256 only")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--granian", action="store_true",
                   help="also run kneegate's app under granian, another ASGI server "
                        "(`pip install granian`), beside uvicorn")
    p.add_argument("--floor", action="store_true",
                   help="also run uvicorn alone answering the stream itself (uvicorn-floor)")
    p.add_argument("--lockstep", action="store_true",
                   help="start every worker at once (waves; the method before 2026-11-30)")
    args = p.parse_args(argv)
    if args.granian and importlib.util.find_spec("granian") is None:
        p.error("--granian needs granian: pip install granian")
    shapes = ["realistic"] if args.quick else args.shapes.split(",")
    concs = [256] if args.quick else [int(c) for c in args.concurrency.split(",")]
    print(f"cpus={os.cpu_count()} client+upstream on core {CLIENT_CORE}, proxy on core "
          f"{PROXY_CORES}; {args.seconds:g}s per cell, {args.repeat} round(s), medians")
    cells = run_matrix(shapes, concs, args.seconds, args.repeat, args.workers_at or None,
                       args.lockstep, args.granian, args.floor)
    rows = print_table(cells)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
