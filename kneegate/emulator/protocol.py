"""OpenAI/vLLM wire format: request parsing, token counting, pre-encoded SSE chunks.

Prompt token counting (cheap and deterministic, not a tokenizer):
- text: ceil(UTF-8 bytes / 4), at least 1 (about 4 bytes per token for English BPE);
- a list of token ids: its length;
- chat: the sum over messages of ceil(content bytes / 4) + 4 per message (role and
  separators), + 3 for the assistant turn the template opens.
Prefix-cache keys (only when the server caches prefixes): the prompt as the emulator's token
stream — a token-id list as is; text as its UTF-8 bytes, 4 to a token; chat as its messages
rendered one after another (each a 16-byte role header, then its content padded with NULs to a
multiple of 4 bytes), then 12 bytes opening the assistant turn, so that the stream's length is
the count above — cut into blocks of `block_size` tokens; each full block's key hashes the
block with the key before it, so equal keys mean equal prefixes (vLLM's block hash chain).
`POST /tokenize` (vLLM's, `tokenize`) answers the same stream as token ids, one per token
(a 31-bit CRC of its 4 bytes; a token-id prompt as is): as many as the count above, the same
in every emulator, and a conversation's next turn begins with its last turn's ids up to the
assistant turn's opening, as a chat template's do. A router that matches prefixes by token
ids (vllm-router's cache-aware policy asks every engine for them) sees what vLLM would show.
Output text is filler: token i (1-based) is " tok{i}", one token each, so a client that
counts words counts tokens.

Errors are `ApiError`s rendered as vLLM does: {"error": {"message", "type", "param", "code"}}.
An admission refusal (`queue_full`) is vLLM's GracefulHTTPError as its OpenAI server renders it
(vllm/exceptions.py QueueOverflowError / MaxQueuedTokensError, mapped by
vllm/entrypoints/serve/utils/error_response.py): status 503, type "Service Unavailable" (the
status phrase), param null, code 503, vLLM's message, and no Retry-After header.
"""

from __future__ import annotations

import json
import math
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ApiError",
    "ParsedRequest",
    "SseEncoder",
    "chat_prompt_tokens",
    "error_body",
    "parse_request",
    "prefix_block_keys",
    "queue_full",
    "text_prompt_tokens",
    "token_text",
    "tokenize",
]

_MESSAGE_OVERHEAD = 4  # role + separators per chat message (ChatML-like templates)
_ASSISTANT_PRIMING = 3  # "<|start|>assistant<|message|>" opened by the template


class ApiError(Exception):
    """An error the server answers with vLLM's JSON error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def error_body(err: ApiError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}
    }


# vLLM's messages, by the cap that refused (the reasons of emulator.core)
_QUEUE_FULL_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}


def queue_full(reason: str) -> ApiError:
    """vLLM's 503 for a request an admission cap (`reason`) refused."""
    return ApiError(503, _QUEUE_FULL_MESSAGES[reason], "Service Unavailable")


def text_prompt_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4))


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    total = _ASSISTANT_PRIMING
    for m in messages:
        total += _MESSAGE_OVERHEAD + math.ceil(len(_content_text(m).encode()) / 4)
    return total


def token_text(index: int) -> str:
    """The filler text of output token `index` (1-based)."""
    return f" tok{index}"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    block_keys: tuple[int, ...] = ()  # the prompt's prefix-cache keys (when asked for)


def parse_request(
    raw: bytes, *, chat: bool, served_model: str, max_model_len: int,
    block_size: int | None = None,
) -> ParsedRequest:
    """Validate a /v1/completions or /v1/chat/completions body; raise ApiError if bad.
    With a `block_size`, the request carries its prompt's prefix-cache keys."""
    body = _json_object(raw)
    model = body.get("model") or served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    prompt = _chat_prompt(body) if chat else _completion_prompt(body)
    max_tokens = _max_tokens(body, chat, max_model_len - prompt)
    if prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.",
            "max_tokens" if prompt < max_model_len else "prompt",
        )
    if body.get("n", 1) != 1:
        raise bad_request("the emulator serves n=1 only", "n")
    options = body.get("stream_options") or {}
    return ParsedRequest(
        chat=chat,
        model=model,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        ignore_eos=bool(body.get("ignore_eos", False)),
        block_keys=prefix_block_keys(body, chat, block_size) if block_size else (),
    )


def prefix_block_keys(body: dict[str, Any], chat: bool, block_size: int) -> tuple[int, ...]:
    """The prefix-cache key of every full block of a validated request's prompt."""
    stream, width = _token_stream(body, chat)
    step = block_size * width
    keys: list[int] = []
    key = 0
    for start in range(0, len(stream) - step + 1, step):
        chunk = stream[start : start + step]
        key = hash((key, chunk if isinstance(chunk, bytes) else tuple(chunk)))
        keys.append(key)
    return tuple(keys)


def tokenize(raw: bytes, *, served_model: str, max_model_len: int) -> dict[str, Any]:
    """vLLM's `POST /tokenize` (its TokenizeCompletionRequest, `prompt`, or TokenizeChatRequest,
    `messages`, with `add_generation_prompt` true unless set false): the body of its
    TokenizeResponse, `{"count", "max_model_len", "tokens", "token_strs"}`; raise ApiError as
    the completion routes would (404 for another model, 400 for a body without a prompt)."""
    body = _json_object(raw)
    model = body.get("model") or served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    chat = "messages" in body
    if chat:  # validates the prompt as parse_request does
        _chat_prompt(body)
    else:
        _completion_prompt(body)
    opening = body.get("add_generation_prompt", True) is not False
    stream, _ = _token_stream(body, chat, opening)
    if isinstance(stream, list):
        ids = stream
    else:
        ids = [zlib.crc32(stream[i : i + 4]) & 0x7FFF_FFFF for i in range(0, len(stream), 4)]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": None}


def _token_stream(body: dict[str, Any], chat: bool,
                  generation_prompt: bool = True) -> tuple[bytes | list[int], int]:
    """A validated request's prompt as the emulator's token stream and its width (bytes per
    token: 4 for text and chat, 1 for a list of token ids, one item each)."""
    if chat:
        opening = b"\0" * (4 * _ASSISTANT_PRIMING) if generation_prompt else b""
        return b"".join(_rendered(m) for m in body["messages"]) + opening, 4
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode(), 4
    return list(prompt), 1


def _rendered(message: dict[str, Any]) -> bytes:
    content = _content_text(message).encode()
    header = str(message["role"]).encode()[:16].ljust(16, b"\0")
    return header + content + b"\0" * (-len(content) % 4)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _completion_prompt(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return text_prompt_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if prompt is None:
        raise bad_request("Field required: prompt", "prompt")
    raise bad_request(
        "prompt must be a non-empty string or list of token ids (one prompt per request)",
        "prompt",
    )


def _chat_prompt(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("Field required: messages (a non-empty list)", "messages")
    if not all(isinstance(m, dict) and "role" in m for m in messages):
        raise bad_request("each message needs a role and content", "messages")
    return chat_prompt_tokens(messages)


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _max_tokens(body: dict[str, Any], chat: bool, room: int) -> int:
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    value = body.get(key)
    if value is None:
        return max(1, room) if chat else 16  # vLLM: chat fills the context, completions 16
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    if value < 1:
        raise bad_request(f"{key} must be at least 1, got {value}.", key)
    return value


class SseEncoder:
    """Chunks of one response, with the constant parts encoded once."""

    __slots__ = ("_head", "_tails", "chat", "created", "id", "model")

    def __init__(self, *, chat: bool, model: str, created: int) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = created
        obj = "chat.completion.chunk" if chat else "text_completion"
        field = '"delta":{"content":' if chat else '"text":'
        self._head = (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{created},'
            f'"model":{json.dumps(model)},"choices":[{{"index":0,{field}"'
        ).encode()
        close = '"}' if chat else '"'
        self._tails = {
            reason: (
                f'{close},"logprobs":null,"finish_reason":{json.dumps(reason)},'
                '"stop_reason":null}]}\n\n'
            ).encode()
            for reason in (None, "length", "stop", "abort")
        }

    def token(self, index: int, finish: str | None = None) -> bytes:
        """The SSE chunk of output token `index`; the last one carries its finish reason."""
        return self._head + token_text(index).encode() + self._tails[finish]

    def role(self) -> bytes:
        """vLLM's first chat chunk: the assistant role with empty content."""
        return self._event(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )

    def usage(self, prompt: int, completion: int) -> bytes:
        return self._event({"choices": [], "usage": _usage(prompt, completion)})

    def full(self, prompt: int, completion: int, finish: str) -> dict[str, Any]:
        """The non-streaming response body."""
        text = "".join(token_text(i) for i in range(1, completion + 1))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
            choice["prompt_logprobs"] = None
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(prompt, completion),
        }

    def _event(self, fields: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return b"data: " + json.dumps({**head, **fields}, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
