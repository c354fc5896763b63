"""The live page in a real browser (issue 14): opt-in, `pytest -m browser tests/deploy`.

The emulator (`python -m kneegate.emulator --profile cpu-tiny`, at a quarter of real
time so
the event rate stays low on a small machine) behind the gateway (`python -m kneegate serve`,
the `knee` controller, an admin token), under a closed loop of clients bounded in requests
and in time that honour Retry-After. Headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium) opens `/kneegate/`; the test waits until the knee
marker and the limit line are drawn, and checks they carry the values `/kneegate/status`
reports and sit where the axis puts those values. Then it saves docs/live-page.png, the
README's picture. With one pool (one model) the pools table stays hidden; with two emulators
serving different models behind one gateway, the page shows one row per pool: its model,
upstreams, limits, in flight, queue and demand ratio, as `/kneegate/status` reports them.

Skips (never fails) when selenium, chromium or chromedriver is missing:
    apt-get install -y chromium chromium-driver && pip install -e '.[browser]'
About a minute of wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kneegate_bench.arms import _child
from kneegate_bench.overhead import _free_port

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "live-page.png"
TOKEN = "live-page-token-7"
CLIENTS = 48
MAX_REQUESTS = 20_000  # the load's request cap; its time cap is MAX_SECONDS
MAX_SECONDS = 240.0
DRAWN_WITHIN = 120.0  # the knee needs a few controller windows under load
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,960",
]
# short windows so a knee is learnt within a minute; objectives loose enough that
# throughput, not a breach, shapes the curve
CONFIG = """\
tick_interval: 0.1
admin_token: {token}
classes:
  default: {{ttft_objective: 30.0}}
upstreams:
  - name: emulator
    url: http://127.0.0.1:{port}
    controller: knee
    scrape: true
    scrape_interval: 0.25
    params: {{initial: 4, max_limit: 128, window: 2.0, min_samples: 4, max_window: 6.0,
              tpot_objective: 0.5, ttft_objective: 30.0}}
"""
# Everything the test reads off the page, in one script call: the page redraws once a
# second, and reading element by element could straddle a redraw.
READ_PAGE = """
const art = document.querySelector('article.upstream[data-upstream="emulator"]');
if (!art) return null;
const svg = art.querySelector('svg.curve');
const knee = art.querySelector('g.knee-marker');
const limit = art.querySelector('line.limit-line');
const num = (el, k) => el ? Number(el.getAttribute(k)) : null;
return {
  renders: Number(document.getElementById('updated').dataset.renders),
  knee: num(knee, 'data-knee'), knee_x: num(knee, 'data-x'),
  limit: num(limit, 'data-limit'), limit_x: num(limit, 'data-x'),
  domain: svg ? svg.getAttribute('data-x-domain') : null,
  range: svg ? svg.getAttribute('data-x-range') : null,
  regions: Array.from(art.querySelectorAll('rect.region')).map(r => r.dataset.region),
  points: art.querySelectorAll('circle.point').length,
  pools: Array.from(document.querySelectorAll('#pools tr.pool')).map(r => ({...r.dataset})),
  pools_shown: !(document.getElementById('pools') || {hidden: true}).hidden,
  series: Array.from(document.querySelectorAll('path.series'))
    .filter(p => p.dataset.latest !== '').map(p => p.dataset.series),
  login: !document.getElementById('login').hidden,
};
"""


def _browser_parts() -> tuple[Any, str, str]:
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="needs selenium: pip install -e '.[browser]'")
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver: "
                    "apt-get install -y chromium chromium-driver")
    return webdriver, chromium, driver


@dataclass
class Stack:
    gw: str

    def status(self) -> dict[str, Any]:
        req = urllib.request.Request(self.gw + "/kneegate/status",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            body: dict[str, Any] = json.load(r)
        return body


class Load:
    """`clients` streaming clients (CLIENTS) in a closed loop on a thread of its own, each
    asking for one of `models` in turn; a refused one waits its Retry-After (at most 1 s).
    At most MAX_REQUESTS requests and MAX_SECONDS seconds."""

    def __init__(self, url: str, models: tuple[str, ...] = ("cpu-tiny",),
                 clients: int = CLIENTS) -> None:
        self.url, self.sent, self.ok, self.stopping = url, 0, 0, False
        self.models, self.clients = models, clients
        self.deadline = time.monotonic() + MAX_SECONDS
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.clients + 4)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(self._one(client, self.models[i % len(self.models)])
                                   for i in range(self.clients)), return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, model: str) -> None:
        body = {"model": model, "prompt": "p " * 64, "max_tokens": 32, "stream": True}
        while (not self.stopping and self.sent < MAX_REQUESTS
               and time.monotonic() < self.deadline):
            self.sent += 1
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
            self.ok += r.status_code == 200
            if r.status_code in (429, 503):
                await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", 1))))

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(40)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    _browser_parts()  # skip before starting anything
    ep, gp = _free_port(), _free_port()
    cfg = tmp_path_factory.mktemp("live") / "kneegate.yaml"
    cfg.write_text(CONFIG.format(token=TOKEN, port=ep))
    engine = [sys.executable, "-m", "kneegate.emulator", "--profile", "cpu-tiny",
              "--speed", "0.25", "--port", str(ep)]
    gateway = [sys.executable, "-m", "kneegate", "serve", "--config", str(cfg),
               "--port", str(gp)]
    with _child(engine, ep), _child(gateway, f"http://127.0.0.1:{gp}/health"):
        load = Load(f"http://127.0.0.1:{gp}")
        try:
            yield Stack(f"http://127.0.0.1:{gp}")
        finally:
            load.stop()
        assert load.ok > 0, f"no request of {load.sent} was served"


@pytest.fixture
def browser() -> Iterator[Any]:
    webdriver, chromium, driver_path = _browser_parts()
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="kneegate-chromium-") as profile:
        opts.add_argument(f"--user-data-dir={profile}")  # fresh: no token kept from before
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
        try:
            yield driver
        finally:
            driver.quit()


def _pixel(page: dict[str, Any], value: float) -> float:
    """Where the curve's x axis puts `value` (the scale the page wrote on the chart)."""
    lo, hi = (float(v) for v in page["range"].split(","))
    _, top = (float(v) for v in page["domain"].split(","))
    return lo + (hi - lo) * value / top


def test_the_knee_and_the_limit_are_drawn_as_status_reports(
        stack: Stack, browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def drawn_as_status_says(driver: Any) -> dict[str, Any] | None:
        # The page draws from its own fetch of /kneegate/status, at most a second old; the
        # status fetched right after reading the page agrees with it unless a controller
        # window closed in between (every 2 s here). So: wait until they agree, to the
        # number (the page writes the JSON's values as they came); a page that drew other
        # values than it was sent would never agree, and the wait would time out.
        page = driver.execute_script(READ_PAGE)
        if not page or page["knee"] is None or page["limit"] is None:
            return None
        up = stack.status()["upstreams"][0]
        seen.append((page, {"knee": up["controller"]["knee_estimate"], "limit": up["limit"]}))
        same = page["limit"] == up["limit"] and page["knee"] == up["controller"]["knee_estimate"]
        return page if same else None

    browser.get(stack.gw + f"/kneegate/#token={TOKEN}")
    try:
        page = WebDriverWait(browser, DRAWN_WITHIN, poll_frequency=0.5).until(
            drawn_as_status_says)
    except Exception as exc:  # selenium's TimeoutException: say what was seen
        pytest.fail(f"knee and limit not drawn as /kneegate/status reports within "
                    f"{DRAWN_WITHIN:g} s: {exc!r}; last (page, status) pairs {seen[-3:]}")
    assert TOKEN not in browser.current_url  # read from the fragment, then wiped
    assert not page["login"]
    assert page["pools"] == [] and not page["pools_shown"]  # one model: the page as it was
    assert page["knee"] > 0 and page["limit"] >= 1
    assert page["points"] > 0  # the learned curve's levels are drawn
    assert {"linear", "plateau"} <= set(page["regions"])  # a knee splits linear from plateau
    # drawn where the axis puts those values, not just labelled with them
    assert page["knee_x"] == pytest.approx(_pixel(page, page["knee"]), abs=0.5)
    assert page["limit_x"] == pytest.approx(_pixel(page, page["limit"]), abs=0.5)
    # the history charts have data: limit, in flight, engine figures, queue, TTFT
    assert {"limit", "in flight", "running", "waiting", "default"} <= set(page["series"])
    assert "default p50" in page["series"] and "default p99" in page["series"]
    # a few more seconds of history in the picture, then the README's screenshot
    renders = page["renders"]
    WebDriverWait(browser, 30, poll_frequency=0.5).until(
        lambda d: d.execute_script(READ_PAGE)["renders"] >= renders + 20)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT))


def test_the_page_asks_for_the_token_and_sends_it(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(stack.gw + "/kneegate/")
    WebDriverWait(browser, 15, poll_frequency=0.2).until(
        lambda d: d.execute_script(READ_PAGE) is None
        and d.find_element(By.ID, "login").is_displayed())
    assert "admin_token" in browser.find_element(By.ID, "login-why").text
    browser.find_element(By.ID, "token").send_keys("not-the-token")
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    WebDriverWait(browser, 15, poll_frequency=0.2).until(
        lambda d: "refused" in d.find_element(By.ID, "login-why").text)
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    page = WebDriverWait(browser, 15, poll_frequency=0.2).until(
        lambda d: d.execute_script(READ_PAGE))
    assert page["limit"] is not None and not page["login"]
    assert TOKEN not in browser.current_url


# --- two models: one row per pool -------------------------------------------------------

# fixed limits, so the page's limits can be compared to the number; 6 clients a model on
# limits of 2 and 3 keep both pools full and queueing
POOLS_CONFIG = """\
tick_interval: 0.1
admin_token: {token}
classes:
  default: {{ttft_objective: 30.0}}
upstreams:
  - name: chat-0
    url: http://127.0.0.1:{chat}
    controller: fixed
    params: {{initial: 2}}
  - name: small-0
    url: http://127.0.0.1:{small}
    controller: fixed
    params: {{initial: 3}}
"""
# what the pools test reads off the page, in one script call (as READ_PAGE)
POOLS_PAGE = """
const rows = Array.from(document.querySelectorAll('#pools tr.pool'));
return {
  shown: !(document.getElementById('pools') || {hidden: true}).hidden,
  pools: rows.map(r => ({...r.dataset})),
  articles: Object.fromEntries(Array.from(document.querySelectorAll('article.upstream'))
    .map(a => [a.dataset.upstream, a.dataset.model])),
  summary: document.getElementById('summary').textContent,
};
"""
POOL_MODELS = ("chat", "small")
PER_MODEL_CLIENTS = 6


@pytest.fixture(scope="module")
def pools_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    _browser_parts()
    ports = {m: _free_port() for m in POOL_MODELS}
    gp = _free_port()
    cfg = tmp_path_factory.mktemp("pools") / "kneegate.yaml"
    cfg.write_text(POOLS_CONFIG.format(token=TOKEN, **ports))
    with contextlib.ExitStack() as stack:
        for model, port in ports.items():
            stack.enter_context(_child(
                [sys.executable, "-m", "kneegate.emulator", "--profile", "cpu-tiny",
                 "--speed", "0.25", "--model-name", model, "--port", str(port)], port))
        stack.enter_context(_child(
            [sys.executable, "-m", "kneegate", "serve", "--config", str(cfg), "--port",
             str(gp)], f"http://127.0.0.1:{gp}/health"))
        load = Load(f"http://127.0.0.1:{gp}", POOL_MODELS, PER_MODEL_CLIENTS * 2)
        try:
            yield Stack(f"http://127.0.0.1:{gp}")
        finally:
            load.stop()
        assert load.ok > 0, f"no request of {load.sent} was served"


def _pool_rows_as_status_says(page: dict[str, Any], status: dict[str, Any]) -> bool:
    """Each row says what `status` says of its pool: models, upstreams and their limits
    exactly (fixed limits), a demand ratio near the status's (the page's is from its own
    fetch, up to a second older), and shows the pool full with requests queued."""
    limits = {u["name"]: u["limit"] for u in status["upstreams"]}
    rows = page["pools"]
    if len(rows) != len(status["pools"]):
        return False
    for row, pool in zip(rows, status["pools"], strict=True):
        want = [limits[n] for n in pool["upstreams"]]
        ratio = (pool["demand"] or {}).get("ratio")
        if (row["model"] != ",".join(pool["models"])
                or row["upstreams"] != ",".join(pool["upstreams"])
                or row["limits"] != ",".join(map(str, want))
                or int(row["limit"]) != sum(want)
                or row["ratio"] == "" or not ratio
                or abs(float(row["ratio"]) - ratio) > 0.5 * ratio
                or int(row["inFlight"]) < 1 or int(row["queue"]) < 1):
            return False
    return True


def test_each_pool_is_shown_by_model(pools_stack: Stack, browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def shown(driver: Any) -> dict[str, Any] | None:
        page = driver.execute_script(POOLS_PAGE)
        status = pools_stack.status()
        seen.append((page, status["pools"]))
        return page if page["shown"] and _pool_rows_as_status_says(page, status) else None

    browser.get(pools_stack.gw + f"/kneegate/#token={TOKEN}")
    try:
        page = WebDriverWait(browser, DRAWN_WITHIN, poll_frequency=0.5).until(shown)
    except Exception as exc:  # selenium's TimeoutException: say what was seen
        pytest.fail(f"the pools not shown as /kneegate/status reports within "
                    f"{DRAWN_WITHIN:g} s: {exc!r}; last (page, status pools) {seen[-2:]}")
    assert page is not None
    assert [r["model"] for r in page["pools"]] == list(POOL_MODELS)
    assert [r["upstreams"] for r in page["pools"]] == ["chat-0", "small-0"]
    assert [r["limits"] for r in page["pools"]] == ["2", "3"]
    # each upstream's own article names the model it serves
    assert page["articles"] == {"chat-0": "chat", "small-0": "small"}
    assert "2 pools by model" in page["summary"]

