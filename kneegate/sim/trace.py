"""Production traces: read one, cap its lengths to an engine, and space its arrivals for a load.

    TRACES            the traces shipped in `kneegate/sim/traces` (CC-BY 4.0, attribution
                      in its README): `conv` (Azure 2023 conversation: decode-heavy) and
                      `code` (Azure 2023 code completion: prefill-heavy, short answers)
    load(name|path)   the rows, in arrival order: (seconds from the first arrival, prompt
                      tokens, output tokens)
    cap(rows, context)  each request fitted to an engine's context (prompt + output <=
                      context): the answer keeps at most half of it, the prompt the rest,
                      so that every request is one the engine can serve
    schedule(rows, rate, seconds, start)  a slice of the trace whose recorded spacing is
                      scaled so that it offers `rate` requests/s on average for `seconds`

Pure and deterministic: no clock, no I/O but reading the file. The wall-clock replay
(`kneegate_bench.replay`) and the simulator (`kneegate.sim`) both replay through it.
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["TRACES", "Request", "cap", "load", "schedule"]

_DATA = Path(__file__).resolve().with_name("traces")
TRACES = {
    "conv": _DATA / "AzureLLMInferenceTrace_conv.csv",
    "code": _DATA / "AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True, slots=True)
class Request:
    """One recorded request: `at` seconds after the trace's (or a schedule's) first arrival."""

    at: float
    prompt: int
    output: int


def load(name: str) -> list[Request]:
    """The rows of a shipped trace (`conv`, `code`) or of a CSV file in the Azure format
    (`TIMESTAMP,ContextTokens,GeneratedTokens`), in arrival order, `at` from the first.
    Rows with a non-positive length are skipped (none in the shipped traces)."""
    path = TRACES.get(name, Path(name))
    stamps: list[tuple[datetime, int, int]] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            if prompt > 0 and output > 0:
                stamps.append((datetime.fromisoformat(row["TIMESTAMP"][:26]), prompt, output))
    if not stamps:
        raise ValueError(f"{path}: no requests")
    stamps.sort(key=lambda s: s[0])
    t0 = stamps[0][0]
    return [Request((t - t0).total_seconds(), p, o) for t, p, o in stamps]


def cap(rows: list[Request], context: int) -> list[Request]:
    """Each request fitted within `context` tokens: output <= context // 2, then prompt <=
    context - output. An engine smaller than the traced one (the emulator's cpu-tiny serves
    2,048 tokens) then serves every request of the trace, the longest at its whole context,
    and no arm is judged on requests that no engine could serve."""
    out = []
    for r in rows:
        output = min(r.output, context // 2)
        out.append(Request(r.at, max(1, min(r.prompt, context - output)), output))
    return out


def schedule(rows: list[Request], rate: float, seconds: float, start: int = 0) -> list[Request]:
    """The rows from `start` on that arrive within `seconds` once the trace's spacing is
    scaled by one factor so that its mean rate over the slice is `rate` requests/s; `at`
    from the first of them. Bursts and lulls keep their shape; only the time axis moves.
    The slice wraps around the trace's end when it needs more rows than are left."""
    if rate <= 0 or seconds <= 0:
        raise ValueError("rate and seconds must be positive")
    n = max(1, round(rate * seconds))
    picked = [rows[(start + i) % len(rows)] for i in range(n + 1)]
    gaps = [max(0.0, b.at - a.at) for a, b in itertools.pairwise(picked)]
    recorded = sum(gaps) or 1.0  # seconds the n gaps span in the trace
    scale = (n / rate) / recorded
    out, t = [], 0.0
    for r, gap in zip(picked[:n], [0.0, *gaps[:-1]], strict=True):
        t += gap * scale
        if t >= seconds:
            break
        out.append(Request(t, r.prompt, r.output))
    return out
