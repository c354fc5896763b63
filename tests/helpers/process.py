"""`kneegate serve` as a real process: a free port for it, and waiting until it answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess

import anyio
import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until_up(client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait (20 s at most) until the gateway at `url` answers /health; fail with its output
    if `proc` exits first."""
    with anyio.fail_after(20):
        while True:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode() if proc.stdout else "exited")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
