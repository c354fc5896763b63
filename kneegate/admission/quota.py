"""Tenants' tokens-a-minute quotas: a bucket each. Pure, like the queue that charges them
(`admission.queue`): no clock, times come in as `now`.

The queue refuses a tenant at one of its own caps (`TenantPolicy.max_inflight`,
`tokens_per_minute`) 429 `tenant_quota` before anything else; with several pools, one set of
buckets serves them all (`admission.pools`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kneegate.admission.types import TenantPolicy

__all__ = ["TokenBuckets"]


@dataclass
class TokenBuckets:
    """Tenants' `tokens_per_minute` quotas: a bucket each, refilled continuously, that
    prompt estimates (at dispatch) and output tokens (as they stream) drain. A request is
    refused while its tenant's bucket is empty; a request in flight may overdraw it (its
    output is not known in advance), and the tenant then waits the overdraft out."""

    _level: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (level, at)

    def wait(self, policy: TenantPolicy, now: float) -> float:
        """Seconds until `policy`'s bucket has tokens again (0: it has some now)."""
        if policy.tokens_per_minute is None:
            return 0.0
        level = self._refill(policy, now)
        return 0.0 if level > 0 else max(1e-3, -level / (policy.tokens_per_minute / 60))

    def take(self, policy: TenantPolicy, tokens: int, now: float) -> None:
        if policy.tokens_per_minute is None or tokens <= 0:
            return
        self._level[policy.name] = (self._refill(policy, now) - tokens, now)

    def _refill(self, policy: TenantPolicy, now: float) -> float:
        cap = policy.tokens_per_minute
        assert cap is not None
        level, at = self._level.get(policy.name, (cap, now))
        return min(cap, level + (now - at) * cap / 60)
