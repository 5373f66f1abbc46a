"""GET /ui: the live session page (static files shipped in the package; no build step, no CDN).

The page only calls the public API (/v1/sessions, flash, query, events), so it needs no route
of its own beyond serving these three files. They carry no data, so they are served without
the API key; the page asks for the key and sends it with every API call.
"""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter()
# name -> media type; nothing else under /ui is served (no directory walking)
FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}


def _file(name: str) -> Response:
    body = resources.files("streamkv.server").joinpath("ui", name).read_bytes()
    return Response(body, media_type=FILES[name], headers={"Cache-Control": "no-cache"})


@router.get("/ui", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/ui/app.js", include_in_schema=False)
async def script() -> Response:
    return _file("app.js")


@router.get("/ui/style.css", include_in_schema=False)
async def style() -> Response:
    return _file("style.css")
