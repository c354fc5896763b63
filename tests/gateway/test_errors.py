"""One wire format for every error: OpenAI-style body, Retry-After and a reason header."""

from __future__ import annotations

import json

from kneegate.gateway.errors import BodyTooLarge, QueueFull, QueueTimeout, UpstreamTimeout, render


def test_rejection_carries_retry_after_and_reason() -> None:
    status, headers, body = render(QueueFull("queue for 'batch' is full; retry after 3s", 3))
    h = dict(headers)
    assert status == 429
    assert h[b"retry-after"] == b"3"
    assert h[b"x-kneegate-reject-reason"] == b"queue_full"
    assert h[b"content-length"] == str(len(body)).encode()
    err = json.loads(body)["error"]
    assert err == {"message": "queue for 'batch' is full; retry after 3s",
                   "type": "rate_limit_error", "param": None, "code": "queue_full"}


def test_statuses_of_the_tree() -> None:
    assert render(QueueTimeout("m", 1))[0] == 503
    assert render(UpstreamTimeout("m"))[0] == 504
    status, headers, _ = render(BodyTooLarge("m"))
    assert status == 413 and b"retry-after" not in dict(headers)
