"""The tap: what the relay notices about a response while it passes, at near-zero cost.

Per chunk it does three cheap things: note the time of the first `data:` event (the
first token of a stream), count `data:` occurrences with `bytes.count` (a C loop), and
keep references to the last two chunks. Nothing is JSON-parsed on the hot path. At the
end it looks for `usage` once, in those tail bytes: the final usage chunk of a stream
(`stream_options.include_usage`) or the body of a non-streamed JSON response.

Output tokens: `usage.completion_tokens` when present, else the number of content events
(every `data:` event minus `[DONE]`, a trailing usage-only event and a chat stream's
opening role-only event, `"delta": {"role": "assistant", "content": ""}`, looked for once,
in the first chunk): vLLM emits about one event per decoded token, so this is an
estimate, good enough for TPOT.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kneegate.gateway.types import Clock

__all__ = ["Tap"]


def _count(key: bytes) -> tuple[bytes, re.Pattern[bytes]]:
    """A usage field's JSON key and the pattern of `"key": N` (matched where the key is)."""
    quoted = b'"%s"' % key
    return quoted, re.compile(re.escape(quoted) + rb"\s*:\s*(\d+)")


_COMPLETION = _count(b"completion_tokens")
_PROMPT = _count(b"prompt_tokens")
_TAIL = 16384
# A chat stream opens with a role-only event per choice (vLLM, OpenAI): no token. Looked for
# in the first chunk's head only; keys may be followed by empty or null fields.
_ROLE_ONLY = re.compile(
    rb'"delta"\s*:\s*\{\s*"role"\s*:\s*"[^"\\]*"'
    rb'(?:\s*,\s*"\w+"\s*:\s*(?:""|null|\[\]))*\s*\}')
_ROLE_SCAN = 8192
# A stream's usage is in its last events: a usage-only event before `[DONE]`
# (`include_usage`), or every chunk's own (`continuous_usage_stats`). Looking only there
# spares the two searches the rest of the tail: in most streams, which carry no usage,
# they scanned all of it (~5% of a short request's instructions).
_LAST_EVENTS = 3


class Tap:
    """Watches one response body go by. `streaming` is decided from the content type."""

    __slots__ = ("_clock", "_last", "_on_first", "_prev", "events", "first_at", "streaming")

    def __init__(self, clock: Clock, streaming: bool,
                 on_first: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self.streaming = streaming
        self._on_first = on_first  # called once, when the first event goes by
        self.first_at: float | None = None
        self.events = 0
        self._prev = b""
        self._last = b""

    def feed(self, chunk: bytes) -> None:
        if self.streaming:
            n = chunk.count(b"data:")
            if n and self.first_at is None:
                self.first_at = self._clock()
                n -= len(_ROLE_ONLY.findall(chunk, 0, _ROLE_SCAN))  # no token in them
                if self._on_first is not None:
                    self._on_first()
            self.events += n
        self._prev = self._last
        self._last = chunk

    def _tail(self) -> bytes:
        return self._prev[-_TAIL:] + self._last[-_TAIL:]

    def usage(self) -> tuple[int, int]:
        """(prompt_tokens, output_tokens); 0 prompt tokens when the body did not say."""
        tail = self._tail()
        start = _last_events(tail) if self.streaming else 0
        done = _last_count(tail, _COMPLETION, start)
        prompt = _last_count(tail, _PROMPT, start)
        prompt_tokens = prompt or 0
        if done is not None:
            return prompt_tokens, done
        if not self.streaming:
            return prompt_tokens, 0
        events = self.events - (1 if tail.rfind(b"[DONE]", start) >= 0 else 0)  # not `in`
        if prompt is not None:  # a trailing usage-only event carries no token
            events -= 1
        return prompt_tokens, max(0, events)


def _last_events(tail: bytes) -> int:
    """Where the last `_LAST_EVENTS` `data:` events of `tail` start (0: it has no more)."""
    i = len(tail)
    for _ in range(_LAST_EVENTS):
        j = tail.rfind(b"data:", 0, i)
        if j < 0:
            return 0
        i = j
    return i


def _last_count(tail: bytes, field: tuple[bytes, re.Pattern[bytes]], start: int = 0
                ) -> int | None:
    """The last `"key": N` in `tail[start:]` (a final usage chunk follows any per-chunk
    usage).

    `rfind` first: most bodies carry no usage at all, and a search for a literal skips
    through them several times faster than the regex scans them.
    """
    key, pattern = field
    i = tail.rfind(key, start)
    if i < 0:
        return None
    m = pattern.match(tail, i)
    if m is not None:
        return int(m.group(1))
    found = pattern.findall(tail, start, i)  # the last one is not a number: an earlier one
    return int(found[-1]) if found else None
