"""A config file that changes on disk is reloaded like SIGHUP: Kubernetes' ConfigMap symlink
swap over a real served gateway, a bad file refused and counted once, the old config kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gateway import FakeEngine, scrape, serve, total

from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import load_config
from kneegate.gateway.config.watch import ConfigWatcher, identify

POLL = 0.02


class ConfigMapVolume:
    """A directory laid out the way the kubelet writes a ConfigMap volume, updated the way
    it does it: a new timestamped directory, then `..data` replaced by an atomic rename."""

    def __init__(self, root: Path, name: str = "kneegate.yaml") -> None:
        self.root, self.name, self.version = root, name, 0
        self.path = root / name

    def publish(self, text: str) -> None:
        self.version += 1
        stamped = self.root / f"..2026_12_01_10_00_{self.version:02d}.{os.getpid()}"
        stamped.mkdir()
        (stamped / self.name).write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(stamped.name)
        os.replace(tmp, self.root / "..data")  # the atomic swap
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{self.name}")


def test_watcher_fires_once_per_change_after_it_held_still(tmp_path: Path) -> None:
    vol = ConfigMapVolume(tmp_path)
    vol.publish("{}")
    w = ConfigWatcher(str(vol.path))
    assert not w.poll()
    vol.publish("{}\n")
    assert not w.poll(), "a change is read only once it held for one interval"
    assert w.poll()
    w.loading()  # the reload it asked for
    assert not w.poll() and not w.poll()


def test_identity_follows_the_links_and_sees_a_missing_file(tmp_path: Path) -> None:
    vol = ConfigMapVolume(tmp_path)
    vol.publish("a: 1\n")
    first = identify(str(vol.path))
    vol.publish("a: 1\n")  # same bytes, same size: another file all the same
    assert first is not None and identify(str(vol.path)) not in (None, first)
    (tmp_path / "..data").unlink()
    assert identify(str(vol.path)) is None


def _doc(up: str, **extra: Any) -> str:
    return json.dumps({
        "tick_interval": 0.02, "server": {"config_poll_interval": POLL},
        "upstreams": [{"name": "e0", "url": up, "controller": "fixed",
                       "params": {"initial": 2}}], **extra})


@contextlib.asynccontextmanager
async def _watched(tmp_path: Path) -> AsyncIterator[tuple[ConfigMapVolume, KneegateApp, str,
                                                          httpx.AsyncClient]]:
    vol = ConfigMapVolume(tmp_path)
    async with serve(FakeEngine()) as up, httpx.AsyncClient(timeout=10) as client:
        vol.publish(_doc(up))
        app = build_app(load_config(vol.path), config_path=str(vol.path))
        async with serve(app) as gw:
            yield vol, app, gw, client


async def _reloads(client: httpx.AsyncClient, gw: str, result: str) -> float:
    m = scrape((await client.get(gw + "/metrics")).text)
    return total(m, "kneegate_config_reloads_total", result=result)


async def _until(check: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(POLL / 2)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


@pytest.mark.anyio
async def test_a_configmap_swap_is_reloaded_and_a_bad_one_refused(tmp_path: Path) -> None:
    async with _watched(tmp_path) as (vol, app, gw, client):
        up = app.gateway.config.upstreams[0].url
        vol.publish(_doc(up, max_queue=7, classes={"default": {}, "batch": {"header": True}}))

        async def live() -> bool:
            status = (await client.get(gw + "/kneegate/status")).json()
            return "batch" in status["queue"]

        await _until(live, "the new classes in /kneegate/status")
        assert app.gateway.config.max_queue == 7
        assert await _reloads(client, gw, "ok") == 1

        vol.publish("upstreams: [}\n")  # broken YAML

        async def refused() -> bool:
            return await _reloads(client, gw, "error") == 1

        await _until(refused, 'kneegate_config_reloads_total{result="error"} == 1')
        for _ in range(5):  # refused once, not at every poll
            await asyncio.sleep(POLL)
        assert await _reloads(client, gw, "error") == 1
        assert app.gateway.config.max_queue == 7, "the running config stays"
        r = await client.post(gw + "/v1/completions", json={"max_tokens": 2},
                              headers={"x-kneegate-class": "batch"})
        assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_a_manual_reload_is_not_repeated_by_the_watcher(tmp_path: Path) -> None:
    async with _watched(tmp_path) as (vol, app, gw, client):
        up = app.gateway.config.upstreams[0].url
        vol.publish(_doc(up, max_queue=9))
        r = await client.post(gw + "/kneegate/reload")
        assert r.status_code == 200, r.text
        for _ in range(5):
            await asyncio.sleep(POLL)
        assert await _reloads(client, gw, "ok") == 1
        assert app.gateway.config.max_queue == 9


@pytest.mark.anyio
async def test_zero_interval_turns_the_watch_off(tmp_path: Path) -> None:
    vol = ConfigMapVolume(tmp_path)
    async with serve(FakeEngine()) as up:
        vol.publish(_doc(up).replace(f'"config_poll_interval": {POLL}',
                                     '"config_poll_interval": 0'))
        app = build_app(load_config(vol.path), config_path=str(vol.path))
        async with serve(app):
            assert app.gateway._watching is None
