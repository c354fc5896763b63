"""What a prefix-cache hit saves an engine's prefill: vLLM's CPU build beside the emulator.

    python -m kneegate_bench.prefix_saving                   # the emulator (cpu-tiny)
    python -m kneegate_bench.prefix_saving --start-vllm      # the real-vLLM tier's vLLM
    python -m kneegate_bench.prefix_saving --url http://127.0.0.1:8000 --model tiny

One request at a time, nothing else running, so a first token's time is the prefill alone.
For each prompt of P tokens (`--prompts`) and share of it cached (`--shares`): a first
request sends its first C = share x P tokens with one answer token (so they are cached), then
the measured one sends all P, streamed, and its time to the first token is taken. Every
prompt is fresh token ids (drawn from the tiny model's vocabulary), so nothing else is
cached. Each (P, share) is measured `--repeat` times, interleaved; the medians are printed:
the TTFT, its ratio to the same P with nothing cached (the saving, as the engine's clock
shows it), and the hit tokens the engine's own counter (`vllm:prefix_cache_hits`) grew by.

The emulator charges a cached block nothing (`engine.core`: a hit skips that block's
prefill); on real vLLM the new tokens still attend to the cached ones, and a request has
costs no cache saves. The ratio is what the emulator's prefix cache is calibrated by.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kneegate_bench.arms import engine_command
from kneegate_bench.openloop import fetch_metrics, metric_totals
from kneegate_bench.overhead import _free_port, _process

__all__ = ["main", "measure", "saving_table"]

VOCAB = 4096  # the real-vLLM tier's tiny model (tests/real_vllm/make_model.py)


def _post(url: str, body: dict[str, Any], stream: bool) -> float:
    """Send one completion; seconds to its first streamed token (to the whole answer when
    not streamed)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": stream})
                                 .encode(), {"content-type": "application/json"})
    sent = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            resp.read()
            return time.monotonic() - sent
        for line in resp:
            if line.startswith(b"data: {") and b'"text"' in line:
                first = time.monotonic() - sent
                resp.read()
                return first
    raise RuntimeError("the stream ended with no token")


def _hits(url: str) -> float:
    return metric_totals(fetch_metrics(url)).get("vllm:prefix_cache_hits_total", 0.0)


def measure(url: str, model: str, prompts: list[int], shares: list[float], repeat: int,
            seed: int = 1) -> list[dict[str, Any]]:
    """Every (prompt, share, round) measured once: its TTFT (s) and the hit tokens."""
    rng = random.Random(seed)
    rows = []
    for rnd in range(repeat):
        for p in prompts:
            for share in shares:
                ids = [rng.randrange(10, VOCAB) for _ in range(p)]
                cached = int(share * p)
                body = {"model": model, "max_tokens": 1, "ignore_eos": True}
                if cached:
                    _post(url, {**body, "prompt": ids[:cached]}, stream=False)
                before = _hits(url)
                ttft = _post(url, {**body, "prompt": ids}, stream=True)
                rows.append({"prompt": p, "share": share, "round": rnd, "ttft_s": ttft,
                             "hits": _hits(url) - before})
    return rows


def saving_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (prompt, share): median TTFT, its ratio to the same prompt uncached (share 0,
    None without one), median hit tokens."""
    out = []
    keys = sorted({(r["prompt"], r["share"]) for r in rows})
    med = {k: statistics.median(r["ttft_s"] for r in rows if (r["prompt"], r["share"]) == k)
           for k in keys}
    for p, share in keys:
        cold = med.get((p, 0.0))
        out.append({"prompt": p, "share": share, "ttft_ms": med[(p, share)] * 1000,
                    "over_uncached": med[(p, share)] / cold if cold else None,
                    "hits": statistics.median(r["hits"] for r in rows
                                              if (r["prompt"], r["share"]) == (p, share))})
    return out


@contextlib.contextmanager
def _engine(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(URL, model name) of the engine measured: given, the tier's vLLM, or an emulator."""
    if args.url:
        yield args.url, args.model or "tiny"
    elif args.start_vllm:
        from kneegate_bench.calibrate_vllm import _started_vllm

        with _started_vllm() as url:
            yield url, "tiny"
    else:
        port = _free_port()
        with _process(engine_command(args.profile, port, ["--enable-prefix-caching"]), port):
            yield f"http://127.0.0.1:{port}", args.model or args.profile


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.prefix_saving",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running engine (vLLM or the emulator)")
    ap.add_argument("--model", help="the model name it serves (default: tiny, or the profile)")
    ap.add_argument("--start-vllm", action="store_true",
                    help="start the real-vLLM tier's vLLM (tests/real_vllm/vllm_server.py)")
    ap.add_argument("--profile", default="cpu-tiny", help="the emulator's profile otherwise")
    ap.add_argument("--prompts", default="256,512,960",
                    help="prompt tokens (the tier's vLLM serves 1,024 in all)")
    ap.add_argument("--shares", default="0,0.5,0.9", help="shares of each prompt cached")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write every measurement here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    prompts = [int(x) for x in args.prompts.split(",")]
    shares = sorted({0.0, *(float(x) for x in args.shares.split(","))})
    with _engine(args) as (url, model):
        rows = measure(url, model, prompts, shares, args.repeat)
    print(f"{'prompt':>6} {'cached':>6} {'TTFT ms':>8} {'/uncached':>9} {'hit tokens':>10}")
    for r in saving_table(rows):
        ratio = "-" if r["over_uncached"] is None else f"{r['over_uncached']:.2f}"
        print(f"{r['prompt']:>6} {r['share']:>6.2f} {r['ttft_ms']:>8.1f} {ratio:>9} "
              f"{r['hits']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
