"""The two-model benchmark's figures (kneegate_bench.two_models): each model's row by the
user's clock and the gateways' gauges, the unknown model's, the medians over the runs and the
lines printed."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from typing import Any

from kneegate_bench.figures import _ms, _pct, summarize
from kneegate_bench.openloop import Record

__all__ = ["COLS", "gauges", "median_lines", "medians", "model_row", "row", "unknown_line",
           "unknown_row", "wrong_and_right"]


def wrong_and_right(users: list[Record], model: str) -> tuple[int, int]:
    """(wrong, right): users answered by an engine not serving `model` (a 200 naming another
    model, or a 404), and by one serving it (a 200 naming it)."""
    wrong = sum(1 for r in users
                if r.status == 404 or (r.status == 200 and r.model not in ("", model)))
    return wrong, sum(1 for r in users if r.status == 200 and r.model == model)


def gauges(into: dict[tuple[str, str], list[float]], owners: dict[str, str],
           model: str) -> dict[str, float | None]:
    """The model's limit (its upstreams' summed), demand ratio and suggested replicas: the
    last reading of the window and the median over it."""
    ups = [u for u, m in owners.items() if model in m.split(",")]
    limits = [into.get(("kneegate_limit", u), []) for u in ups]
    limit = [sum(v) for v in zip(*limits, strict=False)] if limits else []
    ratio = into.get(("kneegate_demand_ratio", model), [])
    replicas = into.get(("kneegate_suggested_replicas", model), [])

    def end(v: list[float]) -> float | None:
        return v[-1] if v else None

    def p50(v: list[float]) -> float | None:
        return statistics.median(v) if v else None

    return {"limit_end": end(limit), "limit_p50": p50(limit), "ratio_end": end(ratio),
            "ratio_p50": p50(ratio), "replicas_end": end(replicas)}


def model_row(users: list[Record], model: str, capacity: float, args: argparse.Namespace,
              read: dict[str, float | None]) -> dict[str, Any]:
    """One model's figures in one arm: wrong and right over every user, the user's-clock
    figures (kneegate_bench.figures.summarize) over the measured ones, the gauges `read`."""
    wrong, right = wrong_and_right(users, model)
    s = summarize(users, args.duration, capacity, args.objective)
    return {"sent": len(users), "right": right, "wrong": wrong, **s, **read}


def unknown_row(users: list[Record], by_gateway: float) -> dict[str, Any]:
    """The unknown model's measured users: answered 404 or not, and the 404s' time from send
    to the status line; `by_gateway`, the gateway's own count of model_not_found."""
    measured = [r for r in users if r.measured]
    answers = [r.answer for r in measured if r.status == 404 and r.answer is not None]
    return {"measured": len(measured), "answered_404": len(answers),
            "other": len(measured) - len(answers), "by_gateway": int(by_gateway),
            "p50_ms": _ms(_pct(answers, 50)), "p99_ms": _ms(_pct(answers, 99)),
            "max_ms": _ms(max(answers, default=None))}


def medians(runs: list[dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Per model and arm, each figure's median over the runs; `wrong` summed over them."""
    def med(values: list[Any]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    out: dict[str, Any] = {}
    for m in models:
        out[m] = {"wrong": sum(run[a]["models"][m]["wrong"] for run in runs
                               for a in ("pooled", "alone"))}
        for arm in ("pooled", "alone"):
            cells = [run[arm]["models"][m] for run in runs]
            out[m][arm] = {k: med([c.get(k) for c in cells]) for k in _MEDIAN_KEYS}
    unknown = [run["pooled"]["unknown"] for run in runs]
    out["unknown"] = {k: med([u[k] for u in unknown]) for k in ("p50_ms", "p99_ms")}
    out["unknown"]["other"] = sum(u["other"] for u in unknown)
    return out


_MEDIAN_KEYS = ("goodput_tok_s", "goodput_over_capacity", "over_alone", "ttft_p50_ms",
                "ttft_p99_ms", "limit_end", "limit_p50", "ratio_end", "replicas_end")


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLS = (f"  {'model':<10}{'arm':<8}{'sent':>6}{'right':>7}{'wrong':>6}{'goodput':>9}"
         f"{'/cap':>6}{'/alone':>7}{'TTFT p50':>9}{'p99':>7}{'limit end (p50)':>17}"
         f"{'ratio end (p50)':>17}{'replicas':>9}")


def row(model: str, arm: str, r: dict[str, Any]) -> str:
    limit = f"{_f(r['limit_end'], '.0f')} ({_f(r['limit_p50'], '.0f')})"
    ratio = f"{_f(r['ratio_end'], '.2f')} ({_f(r['ratio_p50'], '.2f')})"
    return (f"  {model:<10}{arm:<8}{r['sent']:>6}{r['right']:>7}{r['wrong']:>6}"
            f"{r['goodput_tok_s']:>9.0f}{_f(r['goodput_over_capacity'], '.2f'):>6}"
            f"{_f(r.get('over_alone'), '.2f'):>7}{_f(r['ttft_p50_ms'], '.0f'):>9}"
            f"{_f(r['ttft_p99_ms'], '.0f'):>7}{limit:>17}{ratio:>17}"
            f"{_f(r['replicas_end'], '.0f'):>9}")


def unknown_line(model: str, u: dict[str, Any]) -> str:
    return (f"  unknown model {model!r}: {u['measured']} measured, {u['answered_404']} answered "
            f"404 (the gateway counted {u['by_gateway']} model_not_found, warm-up included), "
            f"{u['other']} otherwise; from send p50 {_f(u['p50_ms'], '.2f')} ms, p99 "
            f"{_f(u['p99_ms'], '.2f')} ms (goal <= 5 ms)")


def median_lines(med: dict[str, Any]) -> Iterator[str]:
    for model, m in med.items():
        if model == "unknown":
            continue
        p, a = m["pooled"], m["alone"]
        yield (f"  {model}: wrong {m['wrong']}; goodput {_f(p['goodput_tok_s'], '.0f')} "
               f"pooled, {_f(a['goodput_tok_s'], '.0f')} alone tok/s (pooled/alone "
               f"{_f(p['over_alone'], '.2f')}); limit at the end {_f(p['limit_end'], '.0f')} "
               f"pooled, {_f(a['limit_end'], '.0f')} alone; demand ratio "
               f"{_f(p['ratio_end'], '.2f')} pooled, {_f(a['ratio_end'], '.2f')} alone; "
               f"TTFT p99 {_f(p['ttft_p99_ms'], '.0f')} / {_f(a['ttft_p99_ms'], '.0f')} ms")
    u = med["unknown"]
    yield (f"  unknown model 404 from send: p50 {_f(u['p50_ms'], '.2f')} ms, p99 "
           f"{_f(u['p99_ms'], '.2f')} ms (goal <= 5 ms); answered other than 404: {u['other']}")
