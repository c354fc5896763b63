"""Gateway tests run their async code on uvloop, the loop `kneegate serve` runs on; `relay`
runs a test through both relays of kneegate's server (tests/helpers/relay.py)."""

from helpers.relay import anyio_backend, relay

__all__ = ["anyio_backend", "relay"]
