"""What a request asks of the engine, read from its content (pure: no I/O).

Admission weighs a request by its prompt, in tokens, and must not be moved by anything a
client can pad, repeat or leave out. So the size is read from the fields the engine reads,
never from the body's bytes:

    /v1/completions        `prompt`: a string, token ids, or a batch of either (summed)
    /v1/chat/completions   `messages`: each message's text + 4 (role and separators),
                           + 3 for the assistant turn; `tools`, as their JSON text
    /v1/embeddings         `input`, as `prompt`
    /v1/responses          `input`: a string, or the JSON text of its items

Text counts ceil(UTF-8 bytes / 4) tokens (about 4 bytes a token for English BPE; the
controllers learn the engine's true tokens per estimate from finished requests); token ids
count one each. JSON whitespace, unknown fields and nested keys count nothing.

These POSTs, and any other POST but `LIGHT` (`/v1/score`, `/v1/rerank`, audio, ...: work
for the engine whose fields are not read here, sized by their JSON text, whitespace aside, or
else their bytes / 4), are *generation*: admitted, and the evidence about the engine's
prompts, load and demand. The rest (`GET /v1/models`, `/tokenize`, `/detokenize`, `DELETE`,
...) is forwarded and counted, but tells admission nothing (`RequestSize.generation` False).

`stream` is read as vLLM's pydantic model reads it (lax bool: true, 1, "yes", ... stream),
from the top-level key only.

`floor` is a lower bound on the prompt's true token count, for refusing a request that
cannot fit the engine's context (`over_context`) without a tokenizer: exact for token ids;
for text, bytes / `MAX_BYTES_PER_TOKEN` (ordinary text runs 3-5 bytes a token on Llama 3's
and GPT-4's tokenizers, so the floor counts at most about half of a real prompt's tokens;
a prompt padded with long runs of whitespace can tokenize sparser and is the exception).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kneegate.admission.affinity import prompt_keys

__all__ = ["GENERATION", "LIGHT", "MAX_BYTES_PER_TOKEN", "NOT_GENERATION", "RequestSize",
           "over_context", "read_request"]

MAX_BYTES_PER_TOKEN = 8
_MESSAGE_OVERHEAD = 4  # role and separators per chat message (ChatML-like templates)
_ASSISTANT_PRIMING = 3  # the assistant turn the template opens

# path -> (the prompt's field, the answer cap's fields in the order the engine reads them)
GENERATION: dict[bytes, tuple[str, tuple[str, ...]]] = {
    b"/v1/completions": ("prompt", ("max_tokens",)),
    b"/v1/chat/completions": ("messages", ("max_completion_tokens", "max_tokens")),
    b"/v1/embeddings": ("input", ()),
    b"/v1/responses": ("input", ("max_output_tokens",)),
}

# POSTs that ask the engine for no generation: tokenizing is its API server's work only
LIGHT = frozenset({b"/tokenize", b"/detokenize"})

_LAX_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


@dataclass(frozen=True, slots=True)
class RequestSize:
    """What one request asks: its prompt in tokens (estimated, and a floor), the answer's
    cap as asked (None: not said), whether the answer streams, and the model named."""

    generation: bool
    prompt: int = 0
    floor: int = 0
    max_tokens: int | None = None
    stream: bool = False
    model: str | None = None
    prefix: tuple[int, ...] = ()  # the prompt's prefix keys, when asked (admission/affinity.py)


NOT_GENERATION = RequestSize(generation=False)


class BadBody(ValueError):
    """A generation request whose body is not a JSON object: the engine would answer 400."""


def read_request(method: str, path: bytes, body: bytes, keys: bool = False) -> RequestSize:
    """The size of a request to `path`; raises BadBody for a generation request whose body
    is not a JSON object. `keys`: with its prompt's prefix keys too."""
    if method != "POST" or path in LIGHT:
        return NOT_GENERATION
    fields = GENERATION.get(path)
    if fields is None:
        return _other(body)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadBody(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadBody("the request body must be a JSON object")
    key, caps = fields
    if key == "messages":
        prompt, floor = _chat(doc.get("messages"), doc.get("tools"))
    else:
        prompt, floor = _prompt(doc.get(key))
    model = doc.get("model")
    return RequestSize(
        generation=True, prompt=prompt, floor=floor, max_tokens=_cap(doc, caps),
        stream=_stream(doc.get("stream")), model=model if isinstance(model, str) else None,
        prefix=prompt_keys(doc) if keys else ())


def _other(body: bytes) -> RequestSize:
    """A POST whose fields are not read here: sized by its JSON text with whitespace
    normalised (a body that is not JSON, such as an audio upload: its bytes / 4); no floor,
    so never refused for the context."""
    try:
        text = json.dumps(json.loads(body), separators=(",", ":"))
    except (ValueError, UnicodeDecodeError):
        return RequestSize(generation=True, prompt=len(body) // 4)
    return RequestSize(generation=True, prompt=_text(text)[0])


def over_context(size: RequestSize, context: int) -> str | None:
    """Why `size` cannot fit a context of `context` tokens, in vLLM's words; None when it
    may. Judged on the floor: the gateway refuses only what the engine surely would."""
    asked = size.floor + (size.max_tokens or 1)
    if not size.generation or asked <= context:
        return None
    return (f"This model's maximum context length is {context} tokens. However, you "
            f"requested at least {asked} tokens ({size.floor} in the prompt, "
            f"{size.max_tokens or 1} in the completion). Please reduce the length of the "
            "prompt or completion.")


def _text(s: str) -> tuple[int, int]:
    n = len(s.encode())
    return math.ceil(n / 4), math.ceil(n / MAX_BYTES_PER_TOKEN)


def _prompt(value: Any) -> tuple[int, int]:
    """A completion's prompt (or an embedding's input): (estimate, floor). A batch sums
    for the estimate (each prompt takes its own KV) and takes its longest for the floor
    (each must fit the context alone)."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list) and value:
        if all(type(t) is int for t in value):
            return len(value), len(value)
        if all(isinstance(p, str | list) for p in value):
            parts = [_prompt(p) for p in value]
            return sum(p for p, _ in parts), max(f for _, f in parts)
        return _text(json.dumps(value))[0], 0  # items (a response's input): their JSON
    return 0, 0


def _chat(messages: Any, tools: Any) -> tuple[int, int]:
    if not isinstance(messages, list):
        return 0, 0
    prompt = floor = _ASSISTANT_PRIMING
    for m in messages:
        p, f = _text(_content(m.get("content"))) if isinstance(m, dict) else (0, 0)
        prompt += p + _MESSAGE_OVERHEAD
        floor += f
    if tools:
        prompt += _text(json.dumps(tools))[0]
    return prompt, floor


def _content(content: Any) -> str:
    """A message's text: a string, or the text of its parts (images count nothing here)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _cap(doc: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = doc.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _stream(value: Any) -> bool:
    if value is None or value is False:
        return False
    try:
        return _LAX_BOOL.validate_python(value)
    except ValidationError:
        return False  # the engine answers 400: nothing streams
