"""Who a replay's arm refused: by prompt size, and against what the engine alone served.

A refusal is a measured user answered other than 200 who did not give up first. `lost`
counts the refusals without evidence: the same request, sent at the same moment of the same
schedule to the engine alone (the direct arm), got its first token within the objective.
"""

from __future__ import annotations

from kneegate_bench.openloop import Record

__all__ = ["BUCKETS", "by_bucket", "lost", "refused"]

BUCKETS = (256, 1024, 2048)  # prompt-size buckets' upper bounds (tokens); the last is open


def refused(u: Record) -> bool:
    return u.status is not None and u.status != 200 and not u.gave_up


def lost(users: list[Record], direct: list[Record], objective: float) -> int:
    """Measured users of an arm refused though the direct arm's user at the same place of
    the same schedule got its first token within `objective`."""
    return sum(1 for u, d in zip(users, direct, strict=True)
               if u.measured and refused(u) and d.ttft is not None and d.ttft <= objective)


def _bucket(prompt: int) -> str:
    lo = 0
    for hi in BUCKETS:
        if prompt < hi:
            return f"{lo}-{hi}"
        lo = hi
    return f">={lo}"


def by_bucket(users: list[Record]) -> dict[str, tuple[int, int]]:
    """(refused, sent) of the measured users, by prompt-size bucket."""
    out: dict[str, list[int]] = {}
    for r in users:
        if r.measured:
            b = out.setdefault(_bucket(r.prompt), [0, 0])
            b[1] += 1
            b[0] += refused(r)
    return {k: (v[0], v[1]) for k, v in out.items()}
