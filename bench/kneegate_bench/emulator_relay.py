"""How many SSE events/s the emulator serves in relay mode (zero compute), on one process.

    python -m kneegate_bench.emulator_relay [--streams 32] [--tokens 2000] [--seconds 10]

Starts `python -m kneegate.emulator --profile relay` as a subprocess (one process,
one event
loop: one core at most), streams from it with aiohttp, and prints events/s by wall clock and
per CPU-second of the server process (from /proc), which is the figure that must be >= 20k.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import aiohttp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(url: str, session: aiohttp.ClientSession) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            await asyncio.sleep(0.1)
    raise RuntimeError("relay server did not start within 20 s")


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int, stop: float) -> int:
    events = 0
    body = {"model": "relay", "prompt": "x", "max_tokens": tokens, "stream": True}
    while time.monotonic() < stop:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            async for chunk in r.content.iter_any():
                events += chunk.count(b"data: ")
    return events


async def _run(url: str, pid: int, streams: int, tokens: int, seconds: float) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _wait_ready(url, session)
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        counts = await asyncio.gather(
            *(_stream(session, url, tokens, t0 + seconds) for _ in range(streams))
        )
        wall, cpu = time.monotonic() - t0, _cpu_seconds(pid) - cpu0
    events = sum(counts)
    print(f"relay: {streams} streams x {tokens} tokens, {wall:.1f} s")
    print(
        f"events: {events}, {events / wall:,.0f} events/s wall, server CPU {cpu:.1f} s "
        f"({cpu / wall:.0%} of one core), {events / max(cpu, 1e-9):,.0f} events per CPU-second"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    port = _free_port()
    cmd = [sys.executable, "-m", "kneegate.emulator", "--profile", "relay",
           "--port", str(port)]
    server = subprocess.Popen(cmd)
    try:
        asyncio.run(
            _run(f"http://127.0.0.1:{port}", server.pid, args.streams, args.tokens, args.seconds)
        )
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
