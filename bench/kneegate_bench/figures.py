"""The overload table's figures: a cell's users summed up by the user's clock.

`summarize` gives one row's figures (goodput, rejections, TTFT and TPOT percentiles),
`per_key` the same per API key, `gateway_medians` what was read from a gateway's /metrics,
`round_medians` each arm's medians over `--rounds`; `_row` and `_median_row` print them.
`family_ratios` reads a row against the sized arms (`fixed-N`, `valve-N`) of its round.
"""

from __future__ import annotations

import collections
import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from kneegate_bench.openloop import Record

__all__ = ["family_ratios", "gateway_medians", "per_key", "round_medians", "summarize"]


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(users: list[Record], seconds: float, capacity_tok_s: float,
              objective: float, tpot_objective: float | None = None) -> dict[str, Any]:
    """One table row's figures: token rates by the clock, the rest over the measured users.

    With `tpot_objective`, also the goodput of users who met both objectives: first token
    within `objective` and their answer streamed at most `tpot_objective` s a token (so far,
    for an answer still streaming; a one-token answer has no TPOT to miss). That is
    DistServe's goodput, and `vllm bench serve --goodput ttft:MS tpot:MS`'s, in tokens.
    """
    on_time = [r for r in users if r.ttft is not None and r.ttft <= objective]
    good = sum(r.window_tokens for r in on_time)
    slo_good = (None if tpot_objective is None else
                sum(r.window_tokens for r in on_time
                    if (t := r.tpot) is None or t <= tpot_objective) / seconds)
    recs = [r for r in users if r.measured]
    first = [r for r in recs if r.ttft is not None]
    rejected = [r for r in recs if r.status is not None and r.status != 200 and not r.gave_up]
    statuses: dict[str, int] = collections.Counter(str(r.status) for r in rejected)
    tpots = [t for r in recs if r.done and (t := r.tpot) is not None]
    goodput = good / seconds
    return {
        "users": len(recs),
        "goodput_tok_s": goodput,
        "goodput_over_capacity": goodput / capacity_tok_s if capacity_tok_s > 0 else None,
        "slo_goodput_tok_s": slo_good,  # first token and TPOT both within their objectives
        "completed_tok_s": sum(r.window_tokens for r in users if r.done) / seconds,
        "completed": sum(r.done for r in recs),
        "rejected": len(rejected),
        "rejected_by_status": dict(sorted(statuses.items())),
        "rejection_p99_ms": _ms(_pct([r.answer for r in rejected if r.answer is not None], 99)),
        "ttft_p50_ms": _ms(_pct([r.ttft for r in first if r.ttft is not None], 50)),
        "ttft_p99_ms": _ms(_pct([r.ttft for r in first if r.ttft is not None], 99)),
        # the answers' streaming speed, which goodput (judged by the first token) leaves out
        "tpot_p50_ms": _ms(_pct(tpots, 50)),
        "tpot_p99_ms": _ms(_pct(tpots, 99)),
        "gave_up": sum(r.gave_up for r in recs),
        "errors": sum(r.error is not None for r in recs),
    }


def gateway_medians(watched: dict[str, list[float]]) -> dict[str, float | None]:
    """The medians of what `_watch_gateway` read: limit_p50, in_flight_p50, knee_p50 and
    prefill_cap_p50 (0: no cap on the engine's prefill backlog)."""
    def med(name: str) -> float | None:
        values = watched.get(name)
        return statistics.median(values) if values else None

    return {"limit_p50": med("kneegate_limit"), "in_flight_p50": med("kneegate_in_flight"),
            "knee_p50": med("kneegate_knee_estimate"),
            "prefill_cap_p50": med("kneegate_prefill_cap")}


def per_key(users: list[Record], seconds: float, max_tokens: int,
            objective: float) -> dict[str, dict[str, Any]]:
    """Per API key, over its measured users: demand (output tokens/s asked for), the part of
    it completed with a first token within `objective`, rejections and their Retry-After."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({r.key for r in users if r.measured}):
        recs = [r for r in users if r.measured and r.key == key]
        asked = sum(r.asked or max_tokens for r in recs)
        served = sum(r.tokens for r in recs
                     if r.done and r.ttft is not None and r.ttft <= objective)
        rejected = [r for r in recs if r.status is not None and r.status != 200]
        reasons = Counter(r.reason or str(r.status) for r in rejected)
        out[key] = {"users": len(recs), "demand_tok_s": asked / seconds,
                    "served_within_objective": served / asked if asked else None,
                    "rejected": len(rejected),
                    "with_retry_after": sum(r.retry_after for r in rejected),
                    "reasons": dict(reasons.most_common())}
    return out


def _key_row(key: str, k: dict[str, Any]) -> str:
    served = k["served_within_objective"]
    return (f"    key {key}: {k['users']} users, demand {k['demand_tok_s']:.0f} tok/s, "
            f"{'-' if served is None else format(served, '.2f')} of it completed with a "
            f"first token within the objective; {k['rejected']} rejected, "
            f"{k['with_retry_after']} with Retry-After"
            + "".join(f"; {n} {why}" for why, n in k.get("reasons", {}).items()))


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


_COLS = (f"{'arm':<16}{'load':>5}{'offered':>9}{'goodput':>9}{'/cap':>6}{'/direct':>8}"
         f"{'SLO gp':>7}{'done tok/s':>11}"
         f"{'rejected':>9}{'rej p99 ms':>11}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}"
         f"{'gave up':>8}"
         f"{'errors':>7}{'limit':>7}{'in flight':>10}{'stall ms':>9}")


def _row(arm: str, load: float, offered: float, s: dict[str, Any]) -> str:
    return (f"{arm:<16}{load:>5g}{offered:>9.1f}{s['goodput_tok_s']:>9.0f}"
            f"{_fmt(s['goodput_over_capacity'], '.2f'):>6}"
            f"{_fmt(s.get('goodput_over_direct_done'), '.2f'):>8}"
            f"{_fmt(s.get('slo_goodput_tok_s'), '.0f'):>7}{s['completed_tok_s']:>11.0f}"
            f"{s['rejected']:>9d}{_fmt(s['rejection_p99_ms'], '.0f'):>11}"
            f"{_fmt(s['ttft_p50_ms'], '.0f'):>9}{_fmt(s['ttft_p99_ms'], '.0f'):>9}"
            f"{_fmt(s['tpot_p50_ms'], '.0f'):>9}{s['gave_up']:>8d}{s['errors']:>7d}"
            f"{_fmt(s.get('limit_p50'), '.0f'):>7}{_fmt(s.get('in_flight_p50'), '.0f'):>10}"
            f"{_fmt(s.get('client_stall_max_ms'), '.0f'):>9}")


def round_medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (arm, load)'s medians over its rounds. The ratios are taken within a round (its
    arms met the same arrivals, one after another on one machine), then their median: an
    engine whose speed drifts between rounds moves every arm of a round together.

    `over_best_valve`: goodput over the best valve arm's in the same round (None in a
    round without one; `family_ratios` sets it on each row), the ratio issue 12's real-vLLM
    goal is judged by."""
    family_ratios(rows)
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["arm"], r["load"]), []).append(r)

    def med(values: Iterable[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    out = []
    for (arm, load), rs in cells.items():
        goodputs = [r["goodput_tok_s"] for r in rs]
        ratios = [r["over_best_valve"] for r in rs]
        out.append({
            "arm": arm, "load": load, "rounds": len(rs), "goodput_tok_s": goodputs,
            "goodput_p50": med(goodputs),
            "goodput_over_capacity_p50": med([r["goodput_over_capacity"] for r in rs]),
            "over_direct_p50": med([r["goodput_over_direct_done"] for r in rs]),
            "over_best_valve": ratios,
            "over_best_valve_p50": med(ratios),
            "ttft_p99_ms_p50": med([r["ttft_p99_ms"] for r in rs]),
            "ttft_p99_ms_max": max(
                (r["ttft_p99_ms"] for r in rs if r["ttft_p99_ms"] is not None), default=None),
        })
    return out


_MEDIAN_COLS = (f"{'arm':<16}{'load':>5}{'goodput':>9}{'/cap':>6}{'/direct':>8}"
                f"{'/valve':>7}  {'TTFT p99 (worst)':<17}{'goodput, each round'}")


def _median_row(m: dict[str, Any]) -> str:
    each = " ".join(f"{g:.0f}" for g in m["goodput_tok_s"])
    tail = f"{_fmt(m['ttft_p99_ms_p50'], '.0f')} ({_fmt(m['ttft_p99_ms_max'], '.0f')})"
    return (f"{m['arm']:<16}{m['load']:>5g}{_fmt(m['goodput_p50'], '.0f'):>9}"
            f"{_fmt(m['goodput_over_capacity_p50'], '.2f'):>6}"
            f"{_fmt(m['over_direct_p50'], '.2f'):>8}"
            f"{_fmt(m['over_best_valve_p50'], '.2f'):>7}  {tail:<17}{each}")


def family_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[float, str]]:
    """Each row's goodput over the sized arms of its round (`arm`, `load`, `round`,
    `goodput_tok_s` read; None where the round has no such arm):

        over_best_valve   the best `valve-N` arm's in the round: a size picked per round,
                          in hindsight
        over_hand_valve   the hand-sized valve's in the round: the one `valve-N` whose
        over_hand_fixed   goodput has the best median over the rounds at that load (the
                          same for `fixed-N`), as an operator sizes a valve or a limit once

    The best of several sizes in each round is also the best of their noise: on a bursty
    trace one round's winner is often another round's loser, and no size an operator could
    set reads that maximum. Returns the hand-sized arm of each family (`valve`, `fixed`)
    per load."""
    by_arm: dict[tuple[str, float], list[float]] = {}
    cell: dict[tuple[str, float, int], float] = {}
    best_valve: dict[tuple[float, int], float] = {}  # per (load, round)
    for r in rows:
        key = (r["load"], r["round"])
        by_arm.setdefault((r["arm"], r["load"]), []).append(r["goodput_tok_s"])
        cell[r["arm"], *key] = r["goodput_tok_s"]
        if r["arm"].startswith("valve-"):
            best_valve[key] = max(best_valve.get(key, 0.0), r["goodput_tok_s"])
    hand: dict[str, dict[float, str]] = {"valve": {}, "fixed": {}}
    for family, sized in hand.items():
        for (arm, load), goodputs in sorted(by_arm.items()):
            best = sized.get(load)
            if arm.startswith(f"{family}-") and (best is None or statistics.median(goodputs)
                                                  > statistics.median(by_arm[best, load])):
                sized[load] = arm
    for r in rows:
        load, rnd = r["load"], r["round"]
        top = best_valve.get((load, rnd))
        r["over_best_valve"] = r["goodput_tok_s"] / top if top else None
        for family, sized in hand.items():
            ref = cell.get((sized[load], load, rnd)) if load in sized else None
            r[f"over_hand_{family}"] = r["goodput_tok_s"] / ref if ref else None
    return hand
