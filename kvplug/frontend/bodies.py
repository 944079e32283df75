"""Reading a client's request body: its size, its time, its content coding.

aiohttp decodes ``Content-Encoding: gzip | deflate`` (and ``br`` / ``zstd`` when their
libraries are installed) before a handler reads the body, so what kvplug reads, routes on and
forwards is always the decoded JSON (``hop_headers`` drops the client's ``Content-Encoding``).
A coding aiohttp does not decode is refused (415), a body that does not decode is a 400, a body
over the limit a 413, a body that takes longer than the body timeout a 408 and a client that
hangs up mid-body a 499 (counted, never sent): never a 5xx.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvplug.frontend.errors import ApiError
from kvplug.frontend.timeouts import within

# what aiohttp's request parser decodes (the exact, lower-cased header value)
DECODED_CODINGS = frozenset({"gzip", "deflate", "br", "zstd"})


def _coding(request: web.Request) -> str:
    return request.headers.get("Content-Encoding", "").strip().lower()


def check_content_encoding(request: web.Request) -> None:
    """415 for a content coding the body would reach kvplug still encoded in."""
    coding = _coding(request)
    if coding and coding != "identity" and coding not in DECODED_CODINGS:
        raise ApiError(
            415,
            f"unsupported Content-Encoding {coding[:100]!r}: send the body as is, or "
            "gzip- or deflate-compressed",
            "invalid_request_error",
            "unsupported_content_encoding",
        )


async def read_body(request: web.Request, limit: int, timeout: float | None) -> bytes:
    """The whole (decoded) body, or an ``ApiError`` (400, 408, 413, 415)."""
    try:
        return await _read(request, limit, timeout)
    except ApiError as exc:
        exc.close_connection = True  # what is left of the body must not be read as a request
        raise


async def _read(request: web.Request, limit: int, timeout: float | None) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(f"request body of {request.content_length} bytes is over", limit)
    check_content_encoding(request)
    try:
        content = request.content
        if content.is_eof():  # the whole body came with the head: no wait, no timer
            data = content.read_nowait()
            if len(data) > limit:
                raise web.HTTPRequestEntityTooLarge(limit, len(data))
            return data
        if timeout:
            return await within(request.read(), timeout)
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large("request body is over", limit) from None
    except asyncio.TimeoutError:
        raise ApiError(
            408, body_timeout_message(timeout or 0), "invalid_request_error", "body_timeout"
        ) from None
    except ConnectionError:  # nobody reads this answer; 499 as nginx counts it
        raise ApiError(
            499,
            "the client closed the connection before sending its whole body",
            "client_closed_request",
            "client_closed",
        ) from None
    except RequestPayloadError as exc:  # truncated, or not in the coding it claims
        coding = _coding(request)
        detail = f" (Content-Encoding: {coding[:100]})" if coding else ""
        raise ApiError(
            400,
            f"the request body could not be read{detail}: {str(exc).strip()[:200]}",
            "invalid_request_error",
            "invalid_body",
        ) from None


def body_timeout_message(timeout: float) -> str:
    """Why a 408 ``body_timeout`` (the Python path's and the native lane's)."""
    return f"the request body did not arrive within {timeout:g} s (--client-body-timeout)"


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"{what} the {limit}-byte limit (--max-body-bytes)",
        "invalid_request_error",
        "body_too_large",
    )
