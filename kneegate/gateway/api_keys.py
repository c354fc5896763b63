"""Which bearer keys may reach the engines: `require_api_key`'s check, before admission.

    keys = ApiKeys.from_config(cfg)        # once per config; None when no key is required
    keys.admits(method, path, auth)        # per request: one keyed hash, one set lookup

The keys are those the config names, `api_keys` and every `tenants.<name>.keys`: the same
keys the engine checks (`vllm serve --api-key`), so a request the engine would refuse 401
is refused by the gateway first and never queues, holds a slot or counts as demand. The
paths are the engine's guarded ones: `/v1/*`, `/tokenize` and `/detokenize`; `/version`
stays open and OPTIONS (a CORS preflight, which carries no credentials) passes, as in vLLM.

A key is kept only as a BLAKE2b digest keyed with a secret drawn per process, and a
request's key is judged by whether its digest is in that set. The lookup's time depends
on the digest alone, which no client can steer towards a configured key's without the
secret: the check tells nothing of the keys by its timing (what vLLM gets by comparing
SHA-256 digests with `secrets.compare_digest` against every key), at one hash per request
whatever the number of keys.
"""

from __future__ import annotations

import hashlib
import os

from kneegate.gateway.config.gateway import GatewayConfig

__all__ = ["OPEN_PATHS", "ApiKeys"]

OPEN_PATHS = frozenset({b"/version"})  # proxied, but open without a key (vLLM's list)


class ApiKeys:
    """The configured keys, as keyed digests."""

    __slots__ = ("_digests", "_secret")

    def __init__(self, keys: list[str]) -> None:
        self._secret = os.urandom(32)
        self._digests = frozenset(self._digest(k.encode()) for k in keys)

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> ApiKeys | None:
        """The keys `cfg` requires, or None when it requires none (`require_api_key` off)."""
        if not cfg.require_api_key:
            return None
        return cls([*cfg.api_keys, *(k for t in cfg.tenants.values() for k in t.keys)])

    def _digest(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=32, key=self._secret).digest()

    def admits(self, method: str, path: bytes, auth: bytes | None) -> bool:
        """Whether a request with this `Authorization` value may pass to `path`."""
        if method == "OPTIONS" or path in OPEN_PATHS:
            return True
        if auth is None or auth[:7].lower() != b"bearer ":
            return False
        key = auth[7:].strip()
        return bool(key) and self._digest(key) in self._digests
