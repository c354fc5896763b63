"""Tenants against a client that mints a fresh API key per request (issue 44), in the simulator.

    python -m kneegate_bench.minting --scenario tenants-minting --seeds 7,1,2
    python -m kneegate_bench.minting --scenario tenants-minting --seeds 7 --newcomers 0.5

Each seed runs the scenario twice on the same arrivals: as written (its `mint: true` tenants
send each request under a key of its own) and with every tenant keeping one key. Per
tenant, over [warmup, duration): its arrivals, the share of them served (`served`: answered,
the rest refused or timed out), the share served within the objectives (`good`), and its
goodput (tok/s). `--newcomers R` adds a tenant `new` at R x a light tenant's rate whose every
request is an honest new user's first (a fresh unlisted key), with the heavy client keeping
its key: how long a new user's first request waits in the queue (p50, p90, max of those
served) when nobody mints; with `--while-minting`, while the heavy client mints (a new key
is then one of the pool's, as likely served as a minted one).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kneegate.sim.cli import Result, Scenario, Tenant, load_scenario, run, user_ttft

__all__ = ["Served", "compare", "main", "newcomers", "served"]


@dataclass(frozen=True)
class Served:
    """One tenant's requests in one run, over the measured span."""

    arrived: int
    served: float  # share of its arrivals answered
    good: float  # share of its arrivals answered within the objectives
    goodput: float  # tok/s of those
    waits: tuple[float, ...]  # queue waits of those served, sorted


def served(res: Result, sc: Scenario, tenant: str) -> Served:
    """`tenant`'s requests arrived in [warmup, duration) of `res`."""
    a, b = sc.warmup, sc.duration
    mine = [r for r in res.requests if r.tenant == tenant and a <= r.arrived < b]
    done = [r for r in mine if r.fate == "done"]
    obj = {c.name: (c.ttft or sc.ttft, c.tpot or sc.tpot) for c in sc.classes}
    good = [r for r in done if user_ttft(r) <= obj[r.cls][0]
            and (r.done - r.first) / max(r.tokens - 1, 1) <= obj[r.cls][1]]
    n = max(len(mine), 1)
    return Served(len(mine), len(done) / n, len(good) / n,
                  sum(r.tokens for r in good) / (b - a),
                  tuple(sorted(r.dispatched - r.arrived for r in done)))


def one_key(sc: Scenario) -> Scenario:
    """`sc` with every tenant keeping one key."""
    return sc.model_copy(update={"tenants": [
        t.model_copy(update={"mint": False}) for t in sc.tenants]})


def compare(sc: Scenario, controller: str, seed: int) -> dict[str, tuple[Served, Served]]:
    """Per tenant, (one key each, as written): the same arrivals both times."""
    plain, minted = run(one_key(sc), controller, seed), run(sc, controller, seed)
    return {t.name: (served(plain, sc, t.name), served(minted, sc, t.name)) for t in sc.tenants}


def newcomers(sc: Scenario, rate: float, minting: bool = False) -> Scenario:
    """`one_key(sc)` (`minting`: `sc`) and a tenant `new` at `rate` x the least share, each
    of its requests a new key."""
    share = rate * min(t.share for t in sc.tenants)
    new = Tenant(name="new", share=share, listed=False, mint=True)
    base = sc if minting else one_key(sc)
    return base.model_copy(update={"tenants": [*base.tenants, new]})


def _q(xs: tuple[float, ...], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.minting",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="tenants-minting")
    ap.add_argument("--controller", default="knee")
    ap.add_argument("--seeds", default="7", help="comma-separated")
    ap.add_argument("--newcomers", type=float, default=None,
                    help="x a light tenant's rate: new users' first waits, nobody minting")
    ap.add_argument("--while-minting", action="store_true",
                    help="with --newcomers: the scenario's tenants mint as written")
    args = ap.parse_args(argv)
    sc = load_scenario(args.scenario)
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.newcomers is not None:
            with_new = newcomers(sc, args.newcomers, args.while_minting)
            s = served(run(with_new, args.controller, seed), sc, "new")
            print(f"seed {seed}: new users {s.arrived}, served {s.served:.3f}, good "
                  f"{s.good:.3f}, first wait p50 {_q(s.waits, 0.5):.2f} s p90 "
                  f"{_q(s.waits, 0.9):.2f} s max {_q(s.waits, 1.0):.2f} s")
            continue
        print(f"# seed {seed}: {'tenant':<8} {'arrived':>7} | one key: {'served':>6} "
              f"{'good':>6} {'tok/s':>6} | minting: {'served':>6} {'good':>6} {'tok/s':>6} "
              f"| good x")
        for name, (p, m) in compare(sc, args.controller, seed).items():
            print(f"# seed {seed}: {name:<8} {p.arrived:>7} |          {p.served:>6.3f} "
                  f"{p.good:>6.3f} {p.goodput:>6.1f} |          {m.served:>6.3f} "
                  f"{m.good:>6.3f} {m.goodput:>6.1f} | {m.good / max(p.good, 1e-9):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
