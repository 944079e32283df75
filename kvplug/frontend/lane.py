"""kvplug's own HTTP/1.1 front for the two routed endpoints; aiohttp serves everything else.

aiohttp's server costs about 60 us of CPU per request (its request, URL and header objects, the
application router, the middleware wrapper, the keep-alive bookkeeping) against about 15 us for
the HTTP work itself: measured with the same engine hop behind both, that is more than kvplug's
routing. So a connection starts in this lane. A request head that is plainly
``POST /v1/completions`` or ``POST /v1/chat/completions`` over HTTP/1.1, with one
``Content-Length`` within ``--max-body-bytes`` and nothing that changes how the body is framed
or read (no ``Transfer-Encoding``, ``Expect``, ``Upgrade``, ``Content-Encoding``, no bare LF,
folded, empty-named or non-ASCII header lines), is served here: through the same middlewares and
handlers aiohttp would call, answered with aiohttp's own response classes and writer.

Anything else (another path or method, a query string, HTTP/1.0, an unusual or malformed head)
hands the connection, with every byte read so far, to aiohttp's handler for the rest of its
life. The lane never frames a request aiohttp would frame differently: it takes a request only
when the framing is unambiguous, and after a hand-off it parses nothing more.

Kept from aiohttp's behaviour (tests/test_frontend_lane.py, and the frontend suites, which run
through this lane): the first head's deadline (408, as ``HeadDeadline``), the keep-alive idle
timeout (later heads), the body timeout and a client that hangs up mid-body or mid-answer
(its handler is cancelled, as ``handler_cancellation=True``), ``Connection: close`` either way,
pipelined requests answered in order, and flow control while a request is being served.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.http_writer import StreamWriter
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict, CIMultiDictProxy

from kvplug.frontend.errors import ApiError
from kvplug.frontend.listener import HeadDeadline, head_timeout_answer

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[web.StreamResponse]]

MAX_HEAD = 8190  # aiohttp's default line and field limits: a longer head goes to aiohttp
# headers whose presence changes the body's framing or reading: aiohttp handles those
_HAND_OFF_HEADERS = frozenset(
    {"transfer-encoding", "expect", "upgrade", "content-encoding", "http2-settings"}
)
_PAUSE_AT = 4 * 1024 * 1024  # pipelined bytes held while a request is served, before pausing


class LaneBody:
    """The request body as ``kvplug.frontend.bodies`` reads it: whole at once, or awaited."""

    __slots__ = ("data", "waiter")

    def __init__(self, data: bytes | None) -> None:
        self.data = data
        self.waiter: asyncio.Future[None] | None = None

    def is_eof(self) -> bool:
        return self.data is not None

    def read_nowait(self) -> bytes:
        return self.data or b""

    async def read(self) -> bytes:
        if self.data is None:
            if self.waiter is None:
                self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.data or b""

    def arrived(self, data: bytes) -> None:
        self.data = data
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class LaneRequest:
    """What kvplug's handlers and aiohttp's response classes read of a request."""

    __slots__ = (
        "path",
        "headers",
        "content_length",
        "content",
        "transport",
        "keep_alive",
        "_protocol",
        "_writer",
    )
    method = "POST"
    version = HttpVersion11
    task = None  # aiohttp's StreamResponse.task reads it

    def __init__(
        self,
        path: str,
        headers: CIMultiDictProxy[str],
        length: int,
        content: LaneBody,
        transport: asyncio.Transport,
        keep_alive: bool,
        protocol: BaseProtocol,
    ) -> None:
        self.path = path
        self.headers = headers
        self.content_length = length
        self.content = content
        self.transport = transport
        self.keep_alive = keep_alive
        self._protocol = protocol
        self._writer: StreamWriter | None = None

    @property
    def _payload_writer(self) -> StreamWriter:
        """aiohttp's writer, for the answers it writes (streams): made when first asked for."""
        if self._writer is None:
            self._writer = StreamWriter(self._protocol, asyncio.get_running_loop())
        return self._writer

    async def read(self) -> bytes:
        return await self.content.read()

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        return None


class Lane:
    """What every lane connection shares: the handlers by path and the server's limits."""

    def __init__(
        self,
        handlers: dict[bytes, Handler],
        aiohttp_protocol: Callable[[], asyncio.Protocol],
        max_body_bytes: int,
        head_timeout: float,
        on_head_timeout: Callable[[], None],
    ) -> None:
        self.handlers = handlers
        self.aiohttp_protocol = aiohttp_protocol
        self.max_body_bytes = max_body_bytes
        self.head_timeout = head_timeout
        self.on_head_timeout = on_head_timeout
        self.served = 0  # requests this lane answered itself
        self.handed_off = 0  # connections it gave to aiohttp
        self.workers = 0  # connections' tasks running now (one per lane connection)
        self.connections: set[LaneConnection] = set()  # open and not handed off
        self.closing = False

    async def shutdown(self, timeout: float) -> None:
        """As aiohttp's server shuts down: idle connections close now, a request being served
        gets up to ``timeout`` seconds to finish (its connection closes after the answer), then
        whatever is left is closed (its handler cancelled)."""
        self.closing = True
        for conn in list(self.connections):
            if conn.current is None:
                conn._close()
        deadline = asyncio.get_running_loop().time() + timeout
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn._close()

    def __call__(self) -> asyncio.Protocol:
        return LaneConnection(self)


class LaneConnection(BaseProtocol):
    """One client connection: served here request by request, or handed to aiohttp."""

    def __init__(self, lane: Lane) -> None:
        super().__init__(asyncio.get_running_loop())
        self.lane = lane
        self.buf = b""
        self.inner: asyncio.Protocol | None = None  # aiohttp's handler, once handed off
        self.current: LaneRequest | None = None  # the request being served
        self.worker: asyncio.Task[None] | None = None  # serves the requests, one by one
        self.waiter: asyncio.Future[None] | None = None  # the worker waits here for a request
        self.pending: LaneBody | None = None  # the body still arriving for ``current``
        self.pending_length = 0
        self.timer: asyncio.TimerHandle | None = None
        self.first_head = True
        self.reading_paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # TCP_NODELAY, as aiohttp's handler sets it
        tcp_keepalive(transport)  # type: ignore[arg-type]
        self.lane.connections.add(self)
        self._arm(self._head_expired)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        self.buf = self.buf + data if self.buf else data
        if self.pending is not None:
            self._feed_body()
        elif self.current is None:
            self._next()
        elif len(self.buf) > _PAUSE_AT:
            self._pause()  # resumed when the current answer is out

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            return self.inner.eof_received()
        return None  # the transport closes; connection_lost cancels a running handler

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self.lane.connections.discard(self)
        if self.inner is not None:
            self.inner.connection_lost(exc if isinstance(exc, Exception) else None)
        else:
            worker = self.worker
            if worker is not None and not worker.done():
                worker.cancel()  # as aiohttp's handler_cancellation: nobody reads the answer
        super().connection_lost(exc)
        self.transport = None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
        else:
            super().pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
        else:
            super().resume_writing()

    # -- requests ----------------------------------------------------------------------------
    def _next(self) -> None:
        """Start the next whole head in the buffer, or hand the connection off."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD or (b"\n" in buf and not _crlf_only(buf)):
                self._hand_off()
            return
        if end > MAX_HEAD:
            self._hand_off()
            return
        parsed = _parse_head(buf[:end], self.lane)
        if parsed is None:
            self._hand_off()
            return
        path, headers, length, keep_alive = parsed
        self._disarm()  # a whole head: the head and keep-alive deadlines are met
        self.first_head = False
        start = end + 4
        body = LaneBody(None)
        if len(buf) - start >= length:
            body.data = buf[start : start + length]
            self.buf = buf[start + length :]
        else:
            self.pending = body
            self.pending_length = length
            self.buf = buf[start:]
        assert self.transport is not None
        self.current = LaneRequest(path, headers, length, body, self.transport, keep_alive, self)
        self.lane.served += 1
        if not self._wake_worker() and self.worker is None:
            self.worker = self._loop.create_task(self._serve_all())

    def _wake_worker(self) -> bool:
        """Whether a worker was waiting for this connection's next request (it goes on now)."""
        waiter, self.waiter = self.waiter, None
        if waiter is None:
            return False
        if not waiter.done():
            waiter.set_result(None)
        return True

    def _feed_body(self) -> None:
        body = self.pending
        assert body is not None
        if len(self.buf) >= self.pending_length:
            n = self.pending_length
            data, self.buf = self.buf[:n], self.buf[n:]
            self.pending = None
            body.arrived(data)

    async def _serve_all(self) -> None:
        """This connection's requests, in order: one task per connection, not per request.
        It ends with the connection, or when the connection is handed to aiohttp."""
        self.lane.workers += 1
        try:
            while self.inner is None:
                req = self.current
                if req is None:
                    self.waiter = self._loop.create_future()
                    await self.waiter
                elif not await self._serve(req, self.lane.handlers[req.path.encode()]):
                    return
        except asyncio.CancelledError:
            return  # the client hung up: connection_lost cancelled the handler with us
        finally:
            self.lane.workers -= 1

    async def _serve(self, req: LaneRequest, handler: Handler) -> bool:
        """Answer one request; whether the connection goes on with the lane."""
        try:
            resp = await handler(req)
        except Exception:  # the handlers answer their own errors; this is a bug
            log.exception("request to %s failed", req.path)
            resp = ApiError(500, "internal error", "server_error", "internal_error").response()
        if self.lane.closing:
            req.keep_alive = False  # the answer says so (Connection: close)
        try:
            if not resp.prepared:
                answer = _plain_answer(resp, req.keep_alive)
                if answer is not None:
                    req.transport.write(answer)
                else:
                    await resp.prepare(req)  # type: ignore[arg-type]
                    await resp.write_eof()
        except ConnectionError:
            self._close()
            return False
        self.current = None
        if self.pending is not None or not req.keep_alive or resp.keep_alive is False:
            # a body the handler did not read to its end cannot be told from the next request
            self._close()
            return False
        if self.transport is None or self.transport.is_closing():
            return False
        self._resume()
        self._arm(self._idle_expired)
        if self.buf:
            self._next()
        return self.inner is None

    def _hand_off(self) -> None:
        """aiohttp serves this connection from here on, starting with what was read."""
        self._disarm()
        inner = self.lane.aiohttp_protocol()
        if self.first_head and self.lane.head_timeout > 0:
            inner = HeadDeadline(inner, self.lane.head_timeout, self.lane.on_head_timeout)
        self.inner = inner
        self.lane.handed_off += 1
        self.lane.connections.discard(self)  # aiohttp's server shuts it down from here on
        self._wake_worker()  # a worker waiting for this connection's next request ends
        inner.connection_made(self.transport)  # type: ignore[arg-type]
        if self._paused:
            inner.pause_writing()
        data, self.buf = self.buf, b""
        if data:
            inner.data_received(data)

    # -- timers ------------------------------------------------------------------------------
    def _arm(self, callback: Callable[[], None]) -> None:
        self._disarm()
        if self.lane.head_timeout > 0:
            self.timer = self._loop.call_later(self.lane.head_timeout, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_expired(self) -> None:
        """No whole first head in time (slow loris): 408, as ``HeadDeadline`` answers."""
        self.timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self.inner is not None:
            return
        self.lane.on_head_timeout()
        try:
            transport.write(head_timeout_answer(self.lane.head_timeout))
        finally:
            transport.close()

    def _idle_expired(self) -> None:
        """A kept-alive connection sent no whole head in time: closed, as aiohttp does."""
        self.timer = None
        if self.current is None and self.inner is None:
            self._close()

    def _pause(self) -> None:
        if self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self.transport is not None and self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _plain_answer(resp: web.StreamResponse, keep_alive: bool) -> bytes | None:
    """A whole ``web.Response`` with a bytes body as the bytes aiohttp's writer would send
    (status line, its headers, Content-Type, Content-Length, Date, Server): one string built
    here instead of aiohttp's prepare, header and writer objects. None for anything else
    (streams, payload bodies, compression, cookies, bodiless statuses): aiohttp writes those."""
    if type(resp) is not web.Response:
        return None
    body = resp.body
    status = resp.status
    if (
        type(body) is not bytes
        or status < 200
        or status in (204, 304)
        or resp.compression
        or resp.chunked
        or resp.cookies
    ):
        return None
    headers = resp.headers
    lines = [f"HTTP/1.1 {status} {resp.reason}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in _SET_HERE]
    if "Content-Type" not in headers:
        lines.append("Content-Type: application/octet-stream\r\n")
    lines.append(f"Content-Length: {len(body)}\r\nDate: {rfc822_formatted_time()}\r\n")
    lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
    if not keep_alive or resp.keep_alive is False:
        lines.append("Connection: close\r\n")
    head = "".join(lines)
    bare = head.replace("\r\n", "")
    if "\n" in bare or "\r" in bare:
        return None  # a header value with a line break: aiohttp refuses it (ValueError)
    return head.encode() + b"\r\n" + body


_SET_HERE = frozenset({"content-length", "date", "server", "connection"})


def _crlf_only(buf: bytes) -> bool:
    """Every LF in ``buf`` ends a CRLF (a bare LF is a line end aiohttp accepts: its call)."""
    return buf.count(b"\n") == buf.count(b"\r\n")


# one header line as the lane takes it: a token name, a colon, printable ASCII or tabs
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_HEADER_BLOCK = re.compile(rf"(?:{_TOKEN}:[\x20-\x7e\t]*\r\n)*")
_HEADER_LINE = re.compile(rf"({_TOKEN}):[ \t]*([\x20-\x7e\t]*?)[ \t]*\r\n")


def _parse_head(head: bytes, lane: Lane) -> tuple[str, CIMultiDictProxy[str], int, bool] | None:
    """(path, headers, Content-Length, keep-alive) of a head the lane takes, else None."""
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return None
    request_line = head[:line_end].split(b" ")
    if (
        len(request_line) != 3
        or request_line[0] != b"POST"
        or request_line[2] != b"HTTP/1.1"
        or request_line[1] not in lane.handlers
    ):
        return None
    try:
        block = head[line_end + 2 :].decode("ascii") + "\r\n"
    except UnicodeDecodeError:
        return None  # aiohttp's decoding rules for non-ASCII header bytes: its call
    if _HEADER_BLOCK.fullmatch(block) is None:
        return None  # a bare CR or LF, a folded line, no colon, a non-token name
    pairs = _HEADER_LINE.findall(block)
    length = -1
    keep_alive = True
    for name, value in pairs:
        key = name.lower()
        if key in _HAND_OFF_HEADERS:
            return None
        if key == "content-length":
            if length >= 0 or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif key == "connection":
            token = value.lower()
            if token == "close":
                keep_alive = False
            elif token != "keep-alive":
                return None
    if length < 0 or length > lane.max_body_bytes:
        return None  # no length, or over the limit (aiohttp's 413)
    return request_line[1].decode(), CIMultiDictProxy(CIMultiDict(pairs)), length, keep_alive
