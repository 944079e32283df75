"""The listening sockets of ``kvplug serve``, with a deadline on request heads (slow-loris).

aiohttp bounds neither how long a client may take to send its first request head nor (before
3.14) how long a connection may stay open without sending one. kvplug does:

* the head of a connection's first request (request line and headers, up to the blank line)
  must arrive within ``--client-header-timeout`` seconds of the connect, else kvplug answers
  408 and closes the connection;
* later heads on a kept-alive connection: aiohttp's keep-alive timeout, set to the same value,
  closes a connection that has not sent a whole head that long after its previous answer;
* bodies: ``--client-body-timeout`` (kvplug/frontend/bodies.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvplug.frontend.errors import error_body

log = logging.getLogger(__name__)

_END_OF_HEAD = (b"\r\n\r\n", b"\n\n")  # aiohttp's parser accepts bare LF line ends too


def head_timeout_answer(timeout: float) -> bytes:
    """The 408 of a request head that came too slowly (--client-header-timeout)."""
    return timeout_answer(
        f"the request head did not arrive within {timeout:g} s (--client-header-timeout)",
        "header_timeout",
    )


def timeout_answer(message: str, code: str) -> bytes:
    """A whole 408 answer that closes the connection."""
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


class ClientFaultFilter(logging.Filter):
    """aiohttp logs, with a traceback at ERROR, every request a client got wrong at the HTTP
    level (a malformed head, a body not in its Content-Encoding, a connection dropped
    mid-body) - after kvplug has answered it with a 4xx or the client has gone. A hostile
    client could fill the log that way: those records are counted and dropped instead."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, _CLIENT_FAULTS):
            self.dropped += 1
            return False
        return True


_CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError, ConnectionError)
CLIENT_FAULTS = ClientFaultFilter()


def quiet_client_faults() -> None:
    """Install ``CLIENT_FAULTS`` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if CLIENT_FAULTS not in logger.filters:
        logger.addFilter(CLIENT_FAULTS)


class HeadDeadline(asyncio.Protocol):
    """aiohttp's per-connection protocol, plus a deadline on the first request head."""

    def __init__(self, inner: Any, timeout: float, on_expire: Callable[[], None]) -> None:
        self._inner = inner
        self._timeout = timeout
        self._on_expire = on_expire
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        # armed first, so it fires before aiohttp's own idle timer of the same length (3.14+),
        # which would close the connection without a word
        self._timer = asyncio.get_running_loop().call_later(self._timeout, self._expire)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if any(end in seen for end in _END_OF_HEAD):
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._on_expire()
        try:
            transport.write(head_timeout_answer(self._timeout))
        finally:
            transport.close()


class Listeners:
    """The sockets of one aiohttp runner; counts the connections closed for a late head."""

    def __init__(self, runner: Any, head_timeout: float) -> None:
        self.runner = runner
        self.head_timeout = head_timeout
        self.servers: list[asyncio.Server] = []
        self.head_timeouts = 0
        self.lane: Any = None  # kvplug.frontend.lane.Lane, when the lane serves
        self.factory: Callable[[], asyncio.Protocol] | None = None  # per accepted connection

    def count_head_timeout(self) -> None:
        """A connection closed with a 408 for a late first head (also the native lane's)."""
        self.head_timeouts += 1

    async def listen(
        self,
        host: str,
        port: int,
        backlog: int = 1024,
        reuse_port: bool = False,
        lane: dict[bytes, Any] | None = None,
        max_body_bytes: int = 0,
        start_serving: bool = True,
    ) -> None:
        """``lane``: the handlers kvplug's own HTTP lane serves (kvplug/frontend/lane.py);
        every other request, and every connection the lane hands off, is aiohttp's.
        ``start_serving=False``: the socket listens but asyncio does not accept on it (the
        native data path does, kvplug/frontend/native_lane.py, and adopts with ``factory``)."""
        protocol = self.runner.server  # aiohttp's protocol factory (one handler per connection)
        if lane:
            from kvplug.frontend.lane import Lane

            self.lane = Lane(
                lane, protocol, max_body_bytes, self.head_timeout, self.count_head_timeout
            )
            factory: Callable[[], asyncio.Protocol] = self.lane
        elif self.head_timeout > 0:
            timeout = self.head_timeout

            def factory() -> asyncio.Protocol:
                return HeadDeadline(protocol(), timeout, self.count_head_timeout)
        else:
            factory = protocol
        self.factory = factory
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            factory,
            host or None,
            port,
            reuse_address=True,
            backlog=backlog,
            reuse_port=reuse_port or None,  # kvplug serve --processes: one port, N processes
            start_serving=start_serving,
        )
        self.servers.append(server)

    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every bound socket, as the kernel reports it."""
        out = []
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                out.append((host, port))
        return out

    def close(self) -> None:
        for server in self.servers:
            server.close()

    async def shutdown_lane(self) -> None:
        """The lane's connections, as aiohttp's runner shuts down its own (before it does)."""
        if self.lane is not None:
            await self.lane.shutdown(getattr(self.runner, "_shutdown_timeout", 60.0))


def url_of(host: str, port: int) -> str:
    return f"http://{fmt_host(host)}:{port}"


def fmt_host(host: str) -> str:
    try:
        socket.inet_pton(socket.AF_INET6, host)
        return f"[{host}]"
    except OSError:
        return host


def is_loopback(host: str) -> bool:
    """Whether a bound address only takes connections from this machine."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"
