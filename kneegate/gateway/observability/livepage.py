"""The live page: static HTML, CSS and JavaScript shipped in the package (static/ beside it).

    GET /kneegate/            index.html
    GET /kneegate/live.js     the page's script: draws from /kneegate/status and /kneegate/history
    GET /kneegate/live.css

No build step, no CDN, nothing fetched from anywhere but this gateway: it works offline. The
files hold no data and no secret, so they are served to anyone; the data comes from the two
admin endpoints, which `admin_token` guards. The page never puts the token in a URL: it
reads it from the address's fragment (`/kneegate/#token=...`, which browsers never send to
the server, so it lands in no log) or asks for it, keeps it in the tab's sessionStorage and
sends it as `Authorization: Bearer` on its fetches. The files are read once, when the app is
built. A Content-Security-Policy keeps the page to its own origin.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

__all__ = ["live_page_routes"]

_FILES = {
    "/kneegate/": ("index.html", "text/html; charset=utf-8"),
    "/kneegate/live.js": ("live.js", "text/javascript; charset=utf-8"),
    "/kneegate/live.css": ("live.css", "text/css; charset=utf-8"),
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


Endpoint = Callable[[Request], Awaitable[Response]]


def _endpoint(body: bytes, media_type: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        return Response(body, headers=_HEADERS, media_type=media_type)

    return endpoint


def live_page_routes() -> list[BaseRoute]:
    """One route per file of the page, its bytes read now."""
    static = files("kneegate.gateway.observability") / "static"
    return [Route(path, _endpoint(static.joinpath(name).read_bytes(), media))
            for path, (name, media) in _FILES.items()]
