"""Prefix affinity: send a prompt back to the engine that last served its beginning.

vLLM keeps the KV of prompts it has computed (automatic prefix caching): a conversation's
next turn, which repeats every earlier turn, is prefilled only from where it diverges, on
the engine that served the last turn. So within a pool the queue prefers that engine.

A request carries its prefix keys (`Ticket.prefix`), computed by the gateway from the
prompt: one key per chat message (each hashing the message with every message before it),
or per fixed run of a text or token prompt, so that equal keys mean equal prefixes. The map
remembers, for the *whole* prompt of each dispatched request (its last key), the upstream
it went to; a later request looks its keys up from the longest down, and the first found
names the engine holding its longest known prefix. A conversation's turn k+1 begins with
turn k's whole prompt, so one entry per request finds it; a system prompt shared by every
user is not an entry of its own, and so never draws everyone to one engine.

Bounded: at most `capacity` entries, the least recently used dropped first (an engine's own
cache forgets too). Bounded load: the preferred engine is taken only while it has room under
its own limit and is no fuller than the least full engine by more than half its limit
(`least_full`'s `prefer`, `AFFINITY_SLACK`); otherwise the request goes where there is
most room, as without affinity, and its prefix is remembered there. The room under the
limit alone does not bound it: a prompt that begins like many others would draw them all to
one replica while its limit has room
(docs/experiments/2026-12-07-pool-replay.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["PrefixMap", "prompt_keys"]

TEXT_RUN = 512  # characters of a text prompt a key covers (~128 tokens)
TOKEN_RUN = 128  # token ids of a token prompt a key covers


def prompt_keys(body: dict[str, Any]) -> tuple[int, ...]:
    """A request's prefix keys: one per chat message (its role and content hashed with the
    key before it), or one per full run of `TEXT_RUN` characters or `TOKEN_RUN` token ids
    of a completion's prompt. Empty for anything else (a batch of prompts, no prompt)."""
    keys: list[int] = []
    key = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                return ()
            key = hash((key, str(m.get("role")), str(m.get("content"))))
            keys.append(key)
        return tuple(keys)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        for end in range(TEXT_RUN, len(prompt) + 1, TEXT_RUN):
            key = hash((key, prompt[end - TEXT_RUN : end]))
            keys.append(key)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        for end in range(TOKEN_RUN, len(prompt) + 1, TOKEN_RUN):
            key = hash((key, tuple(prompt[end - TOKEN_RUN : end])))
            keys.append(key)
    return tuple(keys)


class PrefixMap:
    """Prompt prefix key -> the upstream (name) that last served a prompt ending there."""

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int = 16384) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[int]) -> str | None:
        """The upstream holding the longest of `keys` known (None: none is)."""
        entries = self._entries
        for i in range(len(keys) - 1, -1, -1):
            name = entries.get(keys[i])
            if name is not None:
                entries.move_to_end(keys[i])
                return name
        return None

    def record(self, keys: Sequence[int], upstream: str) -> None:
        """A prompt with `keys` went to `upstream`: remember its whole prompt there."""
        if not keys:
            return
        entries = self._entries
        entries[keys[-1]] = upstream
        entries.move_to_end(keys[-1])
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, upstream: str) -> None:
        """Drop every entry naming `upstream` (it left the pool, or its engine restarted)."""
        for key in [k for k, name in self._entries.items() if name == upstream]:
            del self._entries[key]
