"""`GET /v1/models` where the engines behind the gateway serve different models.

Each engine lists only what it serves, so with several pools (admission/pools.py) a client
asking one engine would see part of what the gateway routes. The gateway answers instead:
every model any pool serves, in the OpenAI list shape vLLM uses (`max_model_len` where an
engine listed one). With one pool the request is forwarded as any other, so the engine's own
answer, every field of it, reaches the client.
"""

from __future__ import annotations

import json
import time

from kneegate.admission.pools import Pools
from kneegate.gateway.types import Scope, Send

__all__ = ["answer_models"]

_PATH = b"/v1/models"


async def answer_models(scope: Scope, send: Send, pools: Pools, rid: bytes) -> bool:
    """Answer a `GET /v1/models` with the union of the pools' models; False (nothing sent)
    for any other request, or where one pool serves everything."""
    if (scope["method"] != "GET" or len(pools.pools) < 2
            or (scope.get("raw_path") or scope["path"].encode()) != _PATH):
        return False
    created = int(time.time())
    cards = []
    for pool in pools.pools:
        for model in pool.models:
            lengths = [n for u in pool.upstreams if (n := (u.models or {}).get(model))]
            cards.append({"id": model, "object": "model", "created": created,
                          "owned_by": "vllm", "root": model, "parent": None,
                          "max_model_len": max(lengths, default=None), "permission": []})
    body = json.dumps({"object": "list", "data": cards}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid)]})
    await send({"type": "http.response.body", "body": body})
    return True
