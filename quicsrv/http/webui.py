"""The chat page (``GET /``): static files shipped in the package, served as they are.

No build step, no CDN, no external font: the page, its script, style and icon come from this
package and nothing else is allowed to load (``content-security-policy: default-src 'self'``).
The page needs no API key; what it asks of the API does (it sends the key the user typed).
"""

from __future__ import annotations

import functools
from importlib import resources

from .messages import FullResponse

__all__ = ["PAGES", "page"]

#: Path → (file in ``web/``, content type).
PAGES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}

_HEADERS = (
    (b"content-security-policy", b"default-src 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    # Revalidated on every load: a restarted server may ship another version of the page.
    (b"cache-control", b"no-cache"),
)


def page(path: str) -> FullResponse:
    """The answer to ``GET path`` for a path of :data:`PAGES`."""
    name, content_type = PAGES[path]
    return FullResponse(status=200, body=_read(name), content_type=content_type, headers=_HEADERS)


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()
