"""The prefix-saving calibration tool: what it sends, what it reads, how it sums up."""

from __future__ import annotations

import pytest
from helpers.uvicorn_thread import serve

from kneegate.emulator.server import build_app
from kneegate_bench.prefix_saving import measure, saving_table


def test_the_cached_share_of_each_prompt_is_what_the_engine_counts_as_hits() -> None:
    """The warm request caches share x P tokens and the measured one hits them, to the
    block (16 tokens); the uncached prompt hits nothing: fresh ids every time."""
    app = build_app("cpu-tiny", speed=1.0, enable_prefix_caching=True)
    with serve(app) as url:
        rows = measure(url, "cpu-tiny", [256], [0.0, 0.5, 0.9], repeat=2)
    assert len(rows) == 6
    for r in rows:
        cached = int(r["share"] * 256)
        assert cached - 16 < r["hits"] <= cached
        assert r["ttft_s"] > 0


def test_the_table_gives_medians_and_each_shares_ratio_to_the_uncached_prompt() -> None:
    rows = [{"prompt": 100, "share": s, "round": k, "ttft_s": t, "hits": h}
            for s, k, t, h in [(0.0, 0, 0.2, 0), (0.0, 1, 0.4, 0), (0.0, 2, 0.3, 0),
                               (0.5, 0, 0.1, 48), (0.5, 1, 0.15, 48), (0.5, 2, 0.9, 32)]]
    rows.append({"prompt": 200, "share": 0.5, "round": 0, "ttft_s": 0.5, "hits": 96})
    table = {(r["prompt"], r["share"]): r for r in saving_table(rows)}
    assert table[(100, 0.0)]["ttft_ms"] == pytest.approx(300)
    assert table[(100, 0.5)]["over_uncached"] == pytest.approx(0.15 / 0.3)
    assert table[(100, 0.5)]["hits"] == 48
    assert table[(200, 0.5)]["over_uncached"] is None  # no uncached run of that prompt
