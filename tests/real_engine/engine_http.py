"""Plain HTTP helpers shared by the real-engine tests (urllib: no extra dependency)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    """(status, body); an HTTP error status is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(
    url: str, body: dict, context: Callable[[], str] | None = None, timeout: float = 120
) -> tuple[dict, bytes]:
    """(lower-cased headers, body) of a JSON POST; an HTTP error fails the test with the
    answer's start and ``context()`` (e.g. the tail of a server log)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        extra = f"\n{context()}" if context is not None else ""
        raise AssertionError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}{extra}") from None
