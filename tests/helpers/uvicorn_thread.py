"""An ASGI app on a real uvicorn server (127.0.0.1, port 0) in a thread, for sync tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve(app) -> Iterator[str]:
    """Yield the base URL of a live uvicorn server running `app`; stop it after."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:  # wait for the event we mean, bounded
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        assert thread.is_alive(), "uvicorn thread died during start-up"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
