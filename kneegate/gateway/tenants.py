"""Who a request is for: its tenant, from its API key or a header the operator names.

    tenants = Tenants.from_config(cfg, old)   # once per config (load, or reload: old kept)
    policy = tenants.resolve(auth, header)    # per request: a dict lookup, mostly

In order:
1. a bearer key listed under a configured tenant (`tenants.<name>.keys`): that tenant, with
   its weight, caps and class;
2. the header named by `tenant_header` (none by default), when the operator set one: the
   configured tenant of that name if it allows it (`by_header`; any client can send a
   header, so a tenant with keys is named by them alone), or a tenant of that name with
   weight 1 if none is configured so;
3. any other bearer key: a tenant of its own, named by a keyed hash of the key (`key-` and
   12 hex digits of BLAKE2b keyed with `tenant_key_salt`, or a random secret per process):
   the key itself is never kept, logged or exported, and its name tells nothing of it;
4. no key: one shared tenant, `anonymous`.

Tenants of 2 (not configured) and 3 are `unlisted`: any client can mint them, so the fair
queue pools them until they have been served (`admission.fairness`).

Metrics name a tenant by its `label`: a configured tenant's name, else its hashed name, for
the first `LABELS_MAX` such tenants a process sees, and `other` after that, so a flood of
random keys cannot grow the series a Prometheus server has to keep. The resolved tenants are
cached per `Authorization` value up to `CACHED_KEY_MAX` bytes (at most `CACHE_MAX` of them,
the cache cleared when full), so a request pays one dict lookup, not a hash; a longer value
is hashed each time and never kept, so what a tenant costs does not grow with its key.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from kneegate.admission.types import ANONYMOUS, TenantPolicy
from kneegate.gateway.config.gateway import GatewayConfig

__all__ = ["Tenants"]

# unlisted keys' tenants are named alike within a process when no salt is configured
_PROCESS_SALT = os.urandom(16)


def _bearer(auth: bytes | None) -> bytes | None:
    if auth is None or auth[:7].lower() != b"bearer ":
        return None
    key = auth[7:].strip()
    return key or None


@dataclass
class Tenants:
    """The tenants of one config, and those met since (hashed keys, header names)."""

    LABELS_MAX = 100  # tenants not configured that get a label of their own
    CACHE_MAX = 4096
    CACHED_KEY_MAX = 256  # bytes of an Authorization value that may be kept as a cache key
    HEADER_MAX = 64  # bytes of a tenant header's value that name the tenant

    by_key: dict[bytes, TenantPolicy] = field(default_factory=dict)
    by_name: dict[str, TenantPolicy] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)  # tenant name -> its class
    header: bytes | None = None
    salt: bytes = _PROCESS_SALT
    by_header: frozenset[str] = frozenset()  # configured tenants the header may name
    _cache: dict[bytes, TenantPolicy] = field(default_factory=dict)
    _labels: set[str] = field(default_factory=set)

    @classmethod
    def from_config(cls, cfg: GatewayConfig, previous: Tenants | None = None) -> Tenants:
        """The tenants of `cfg`; a reload passes the `previous` ones, whose labels it keeps
        (a reload must not reset the budget of labels a flood of keys may take)."""
        tenants = cls._build(cfg)
        if previous is not None:
            tenants._labels = previous._labels
        return tenants

    @classmethod
    def _build(cls, cfg: GatewayConfig) -> Tenants:
        by_name = {
            name: TenantPolicy(name, t.weight, t.max_inflight, t.tokens_per_minute, name)
            for name, t in cfg.tenants.items()
        }
        return cls(
            by_key={k.encode(): by_name[name]
                    for name, t in cfg.tenants.items() for k in t.keys},
            by_name=by_name,
            classes={name: t.class_ for name, t in cfg.tenants.items() if t.class_},
            header=cfg.tenant_header.lower().encode("latin-1") if cfg.tenant_header else None,
            salt=hashlib.sha256(cfg.tenant_key_salt.encode()).digest()[:16]
            if cfg.tenant_key_salt else _PROCESS_SALT,
            by_header=frozenset(name for name, t in cfg.tenants.items() if t.by_header),
        )

    def resolve(self, auth: bytes | None, header: bytes | None = None) -> TenantPolicy:
        """The tenant of a request with this `Authorization` value and tenant header."""
        key = _bearer(auth)
        if key is not None:
            policy = self.by_key.get(key)
            if policy is not None:
                return policy
        if header is not None and self.header is not None:
            name = header.strip()[: self.HEADER_MAX].decode("latin-1")
            if name and name not in self.by_name:
                return self._named(name)
            if name in self.by_header:
                return self.by_name[name]
        if key is None:
            return ANONYMOUS
        assert auth is not None
        if len(auth) > self.CACHED_KEY_MAX:  # hashed each time, never kept
            name = self._hashed(key)
            return self._cache.get(name.encode()) or self._remember(name.encode(), name)
        policy = self._cache.get(auth)
        if policy is None:
            policy = self._remember(auth, self._hashed(key))
        return policy

    def _hashed(self, key: bytes) -> str:
        return "key-" + hashlib.blake2b(key, digest_size=6, key=self.salt).hexdigest()

    def class_of(self, policy: TenantPolicy) -> str | None:
        """The class a configured tenant's requests go to, when its config names one."""
        return self.classes.get(policy.name)

    def _named(self, name: str) -> TenantPolicy:
        key = b"\0header:" + name.encode("latin-1")  # apart from Authorization values
        return self._cache.get(key) or self._remember(key, name)

    def _remember(self, key: bytes, name: str) -> TenantPolicy:
        """A tenant of its own named `name`, cached under `key` (the cache cleared when full)."""
        if len(self._cache) >= self.CACHE_MAX:
            self._cache.clear()
        policy = self._cache[key] = TenantPolicy(name, label=self._label(name), unlisted=True)
        return policy

    def _label(self, name: str) -> str:
        if name in self._labels or len(self._labels) < self.LABELS_MAX:
            self._labels.add(name)
            return name
        return "other"
