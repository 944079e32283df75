"""The engine hop of ``kvplug serve``: HTTP/1.1 keep-alive connections on asyncio protocols.

aiohttp's client costs more CPU per request than the rest of the request path together
(request and response objects, header multidicts, URL objects, a cookie jar, a timer per read,
the request head and body in separate sends). This client does what a proxy needs and nothing
else: one ``POST`` per connection at a time, head and body written in one send, the answer
parsed by llhttp (``httptools``), its body bytes handed on as they arrive (an SSE stream relays
unchanged; chunked framing is removed, as aiohttp does).

Behaviour kept from the aiohttp session it replaces on this path (``kvplug/frontend/upstream.py``):

* idle connections close after ``keepalive`` seconds (4 s, before uvicorn's 5 s keep-alive in
  vLLM and SGLang), so a request never goes out on a socket the engine is closing;
* ``connect_timeout`` bounds the TCP connect; ``read_timeout`` (``--idle-timeout``) the silence
  between two reads, the wait for the answer's head included (a stall of this loop is given
  back, as ``within`` does: it is not the engine's silence);
* errors are aiohttp's exception types (``ServerDisconnectedError`` before a whole answer head,
  ``ClientPayloadError`` for a body cut short or a malformed answer, ``ServerTimeoutError`` for
  silence), so every ``except aiohttp.ClientError`` on the path still means "the engine failed"
  and never "the client hung up" (``ConnectionResetError``);
* ``close()`` on an answer not read to its end closes the connection: the engine sees the
  client gone and aborts the request.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httptools

from kvplug.frontend.timeouts import within
from kvplug.stalls import given_back

# a slow client lets an engine's stream pile up here: stop reading the engine past this many
# buffered bytes (TCP then holds the engine back), resume once the relay drained them
_HIGH_WATER = 256 * 1024
_URL_CACHE_SIZE = 1024


class ResponseHeaders(dict):
    """An answer's headers: lower-case names, case-insensitive ``get`` and ``in`` (the last
    value of a repeated header)."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class EngineResponse:
    """One engine answer, shaped like the part of ``aiohttp.ClientResponse`` the request path
    uses: ``status``, ``headers``, ``content.readany()`` / ``read()`` / ``at_eof()``,
    ``release()`` (connection back to the pool when the answer was read whole) and ``close()``."""

    __slots__ = (
        "status",
        "headers",
        "_conn",
        "_parser",
        "_raw_headers",
        "_chunks",
        "_size",
        "_eof",
        "_exc",
        "_waiter",
        "_timer",
        "_graces",
        "_keep_alive",
        "_until_close",
        "_done",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: ResponseHeaders = ResponseHeaders()
        self._conn: _Connection | None = conn
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False  # the whole answer arrived
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # --idle-timeout, while a read waits
        self._graces = 0  # stalls given back to this answer's reads (given_back)
        self._keep_alive = False
        self._until_close = False  # no length, not chunked: the body ends with the connection
        self._done = False  # released or closed

    @property
    def content(self) -> EngineResponse:
        """aiohttp's shape: ``resp.content.readany()`` (a property, not an attribute holding
        ``self``: that would be a reference cycle)."""
        return self

    # -- llhttp callbacks (inside data_received) ----------------------------------------------
    def on_message_begin(self) -> None:
        if self._eof:  # bytes past the answer's end: never reuse this connection
            self._keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        # bytes past the answer's end (see on_message_complete), or an answer released
        if self._eof or parser is None:
            return
        self.status = parser.get_status_code()
        headers = self.headers
        length = chunked = False
        for name, value in self._raw_headers:
            key = name.decode("latin-1").lower()
            headers[key] = value.decode("latin-1")
            if key == "content-length":
                length = True
            elif key == "transfer-encoding":
                chunked = True
        self._until_close = not length and not chunked and self.status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._eof:
            return
        self._chunks.append(body)
        self._size += len(body)
        if self._size > _HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def on_message_complete(self) -> None:
        if self._eof:  # a second answer to one request: the connection is out of step
            self._keep_alive = False
            return
        self._eof = True
        parser = self._parser
        self._keep_alive = parser is not None and parser.should_keep_alive()
        self._wake()

    # -- from the connection ------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # released or closed: nothing reads this answer any more
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(aiohttp.ClientPayloadError("the engine switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"invalid HTTP answer from the engine: {exc}"))

    def _lost(self, exc: BaseException | None) -> None:
        if self._eof or self._exc is not None:
            return
        if self.status and self._until_close and exc is None:
            self._eof = True  # a body delimited by the connection's end
            self._wake()
        elif self.status:
            self._fail(aiohttp.ClientPayloadError("Response payload is not completed"))
        else:
            self._fail(aiohttp.ServerDisconnectedError())

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._eof:
            self._exc = exc
        conn = self._conn
        if conn is not None:
            conn.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        conn = self._conn
        assert conn is not None
        loop = conn.loop
        waiter = self._waiter = loop.create_future()
        if conn.read_timeout:
            self._timer = loop.call_later(conn.read_timeout, self._silent)
        try:
            await waiter
        finally:
            self._waiter = None
            timer = self._timer
            if timer is not None:  # emptied: self -> handle -> self._silent is a cycle
                self._timer = None
                timer.cancel()

    def _silent(self) -> None:
        conn, timer, waiter = self._conn, self._timer, self._waiter
        if waiter is not None and waiter.done():
            return  # bytes came in this loop iteration (asyncio reads before its timers)
        if conn is not None and timer is not None:
            again = given_back(conn.loop.time() - timer.when(), self._graces, conn.read_timeout)
            if again:
                # this loop was blocked past the deadline, not the engine silent: what it sent
                # meanwhile is read in this iteration (uvloop polls after its timers), so the
                # blocked time is given back, as kvplug.frontend.timeouts.within does
                self._graces += 1
                self._timer = conn.loop.call_later(again, self._silent)
                return
        self._fail(aiohttp.ServerTimeoutError("Timeout on reading data from socket"))

    # -- the caller's side --------------------------------------------------------------------
    async def wait_first(self) -> None:
        """Wait for the answer's head and its first body bytes (or its end: an empty body);
        ``readany()`` then returns at once."""
        while not self._chunks and not self._eof:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def readany(self) -> bytes:
        """The body bytes buffered now, waiting for some if none; b"" at the end."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._size > _HIGH_WATER and self._conn is not None:
                    self._conn.resume()
                self._size = 0
                return data
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._wait()

    async def read(self) -> bytes:
        """The rest of the body."""
        parts: list[bytes] = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def release(self) -> None:
        """Done with a whole answer: its connection goes back to the pool (or closes)."""
        if self._done:
            return
        if not self._eof or self._exc is not None or not self._keep_alive:
            self.close()
            return
        self._done = True
        self._parser = None  # see close()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.idle()

    def close(self) -> None:
        """Done before the end: close the connection (the engine aborts the request)."""
        if self._done:
            return
        self._done = True
        # the parser holds this response's callbacks (bound methods): a reference cycle the
        # collector would have to find, ~12 objects per answer; dropped here, the answer is
        # freed by its reference count alone
        self._parser = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; one answer at a time."""

    __slots__ = (
        "pool",
        "key",
        "loop",
        "read_timeout",
        "transport",
        "response",
        "closed",
        "idle_since",
    )

    def __init__(self, pool: EnginePool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.read_timeout = pool.read_timeout
        self.transport: asyncio.Transport | None = None
        self.response: EngineResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        resp._feed(data)

    def eof_received(self) -> bool:
        self.closed = True  # the engine is done with this connection: never reuse it
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None:
            resp._lost(exc)
        else:
            self.pool._forget(self)

    def send(self, response: EngineResponse, data: bytes) -> None:
        self.response = response
        assert self.transport is not None
        self.transport.write(data)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def idle(self) -> None:
        self.response = None
        if self.closed:
            return
        self.pool._put(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool._forget(self)


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value`` lines, each ending in CRLF; ValueError for a line break inside one."""
    lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError("a header name or value holds a line break")
    return lines.encode("utf-8", "surrogateescape")


def request_target(url: str) -> tuple[tuple[str, str, int], bytes]:
    """(scheme, host, port) of ``POST url`` and its head's request line and Host header;
    ``aiohttp.InvalidUrlClientError`` for a URL that is not http(s) with a host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise aiohttp.InvalidUrlClientError(url)
    port = parts.port or (443 if scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    host = parts.hostname
    host_header = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        host_header += f":{parts.port}"
    head = f"POST {target} HTTP/1.1\r\nHost: {host_header}\r\n".encode("utf-8", "strict")
    return (scheme, host, port), head


class EnginePool:
    """Keep-alive connections per engine address; ``post`` sends one request on one of them."""

    def __init__(
        self, connect_timeout: float = 5.0, read_timeout: float = 600.0, keepalive: float = 4.0
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout if read_timeout and read_timeout > 0 else 0.0
        self.keepalive = keepalive
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._urls: dict[str, tuple[tuple[str, str, int], bytes]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections made (tests: keep-alive reuse)

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes]:
        """(scheme, host, port) and the head's request line and Host header, per URL."""
        hit = self._urls.get(url)
        if hit is not None:
            return hit
        if len(self._urls) >= _URL_CACHE_SIZE:
            self._urls.clear()
        hit = self._urls[url] = request_target(url)
        return hit

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> EngineResponse:
        """Send ``POST url`` (head and body in one write) and return the answer once its head
        and first body bytes arrived. ``headers`` must not carry Host or Content-Length."""
        key, request_line = self._target(url)
        data = b"%sContent-Length: %d\r\n%s\r\n%s" % (
            request_line,
            len(body),
            header_lines(headers),
            body,
        )
        conn = self._take(key) or await self._connect(key)
        resp = EngineResponse(conn)
        try:
            conn.send(resp, data)
            await resp.wait_first()
        except BaseException:
            resp.close()
            raise
        return resp

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()  # the most recently used: the warmest
            if conn.closed:
                continue
            if now - conn.idle_since >= self.keepalive:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        conn = _Connection(self, key)
        kwargs: dict[str, Any] = {}
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            kwargs = {"ssl": self._ssl, "server_hostname": host}
        make = self.loop.create_connection(lambda: conn, host, port, **kwargs)
        try:
            if self.connect_timeout and self.connect_timeout > 0:
                await within(make, self.connect_timeout)
            else:
                await make
        except asyncio.TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to host {host}:{port} ({self.connect_timeout:g} s)"
            ) from None
        self.opened += 1
        return conn

    def _put(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep(self) -> None:
        """Close connections idle for ``keepalive`` seconds; again later while some stay."""
        self._sweeper = None
        now = self.loop.time()
        left = False
        for idle in self._idle.values():
            for conn in [c for c in idle if now - c.idle_since >= self.keepalive]:
                conn.close()
            left = left or bool(idle)
        if left:
            self._sweeper = self.loop.call_later(self.keepalive / 2, self._sweep)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()
