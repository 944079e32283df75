"""``kvplug serve --data-path native``: the compiled HTTP data path (kvplug._lane, csrc/lane.c).

The lane accepts on the API's listening sockets (asyncio listens on them but does not accept),
serves the plain routed request in C and calls the control plane (kvplug/frontend/native_glue.py)
only to decide where a request goes and to hear how it ended. Every other connection (another
path, HTTP/1.0, a chunked body, a hint header, a request the glue declines) is handed back with
the bytes read so far and adopted here by the same protocol asyncio would have given it
(kvplug's Python lane, or aiohttp's handler), so the Python path serves it exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from kvplug.frontend.bodies import body_timeout_message
from kvplug.frontend.hints import HINT_HEADERS
from kvplug.frontend.listener import Listeners, head_timeout_answer, timeout_answer
from kvplug.frontend.parsing import CHAT, COMPLETIONS

log = logging.getLogger(__name__)

_ENDPOINTS = (COMPLETIONS, CHAT)  # by the lane's request kind (LANE_KIND_*)


class Prefixed(asyncio.Protocol):
    """An adopted connection's protocol, fed first the bytes the lane had read."""

    def __init__(self, inner: asyncio.Protocol, data: bytes) -> None:
        self._inner = inner
        self._data = data

    def connection_made(self, transport: Any) -> None:
        self._inner.connection_made(transport)
        data, self._data = self._data, b""
        if data and not transport.is_closing():
            self._inner.data_received(data)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def available() -> bool:
    """Whether kvplug._lane was built (Linux only)."""
    try:
        import kvplug._lane  # noqa: F401
    except ImportError:
        return False
    return True


class NativeDataPath:
    """The lane of one serving process: started on ``listeners`` (made with
    ``start_serving=False``), decisions by ``glue`` (``decide``, ``first_byte``, ``finish``,
    ``register_upstream``, ``upstream_of``)."""

    def __init__(self, frontend: Any, listeners: Listeners, glue: Any) -> None:
        self.frontend = frontend
        self.listeners = listeners
        self.glue = glue
        self.lane: Any = None
        self.adopting: set[asyncio.Task[Any]] = set()
        self.resolving: set[asyncio.Task[None]] = set()  # upstream names being resolved
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        from kvplug._lane import Lane

        s = self.frontend.settings
        head = s.client_header_timeout
        body = s.client_body_timeout
        fds = [sock.fileno() for server in self.listeners.servers for sock in server.sockets]
        for fd in fds:  # asyncio listens only once it serves (start_serving=False): here
            listening = socket.socket(fileno=fd)
            try:
                listening.listen(1024)  # _serve_app's backlog
            finally:
                listening.detach()  # still asyncio's socket
        self.lane = Lane(
            fds,
            self.glue.decide,
            self.glue.first_byte,
            self.glue.finish,
            self._adopt,
            max_body=s.max_body_bytes,
            head_timeout=head,
            keepalive_timeout=head,  # as the Python path: aiohttp's keep-alive timeout
            body_timeout=body,
            connect_timeout=s.connect_timeout,
            try_timeout=s.per_try_timeout,
            engine_idle_timeout=s.idle_timeout,
            request_timeout=s.request_timeout,
            max_stream_duration=s.max_stream_duration,
            head_timeout_answer=head_timeout_answer(head) if head > 0 else b"",
            body_timeout_answer=(
                timeout_answer(body_timeout_message(body), "body_timeout") if body > 0 else b""
            ),
            handoff_headers=HINT_HEADERS,  # the Python path reads (or refuses) the hints
            count=self._count_unfinished,
            stream_bytes=self.glue.stream_bytes,
        )
        self._loop = asyncio.get_running_loop()
        self.glue.register_upstream = self._register
        for worker_id in list(self.frontend.fleet.workers):
            self.glue.upstream_of(worker_id)  # registers it with the lane now, not mid-request
        if self.resolving:  # the fleet's names, resolved before the first request
            await asyncio.gather(*self.resolving, return_exceptions=True)
        self._loop.add_reader(self.lane.fileno(), self.lane.poll)

    def _count_unfinished(self, event: int, kind: int, seconds: float) -> None:
        """A request the lane closed before it was whole, counted as the Python path counts it:
        a late first head in ``Listeners.head_timeouts`` (``HeadDeadline``); a late body as
        ``read_body``'s 408 ``body_timeout`` and a client gone mid-body as the cancelled handler's
        499, as ``Frontend._handle`` counts them. Called by the lane on those paths only."""
        from kvplug._lane import COUNT_BODY_TIMEOUT, COUNT_HEAD_TIMEOUT

        if event == COUNT_HEAD_TIMEOUT:
            self.listeners.count_head_timeout()
            return
        fe = self.frontend
        fe.request_started()
        if event == COUNT_BODY_TIMEOUT:
            fe.metrics.rejected.labels("body_timeout").inc()
            status = 408
        else:  # aiohttp cancels the Python path's handler: a 499 and no rejection
            status = 499
        fe.count_request(_ENDPOINTS[kind], status, False, time.perf_counter() - seconds)

    def _register(self, upstream_id: int, host: str, port: int) -> None:
        """An upstream for the lane: a numeric address at once; a name is resolved off the
        loop (``loop.getaddrinfo``: a thread), its tries unavailable until then."""
        try:
            self.lane.set_upstream(upstream_id, host, port)
            return
        except ValueError:
            self.lane.set_upstream(upstream_id, "", port)
        assert self._loop is not None
        task = self._loop.create_task(self._resolve(upstream_id, host, port))
        self.resolving.add(task)
        task.add_done_callback(self.resolving.discard)

    async def _resolve(self, upstream_id: int, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("native lane: cannot resolve %s (%s); its requests fail over", host, exc)
            return
        if self.lane is not None and not self.lane.closed and infos:
            self.lane.set_upstream(upstream_id, infos[0][4][0], port)

    def _adopt(self, fd: int, data: bytes) -> None:
        """A connection the lane handed back: the Python server's from here on."""
        sock = socket.socket(fileno=fd)
        factory = self.listeners.factory
        assert factory is not None and self._loop is not None
        task = self._loop.create_task(
            self._loop.connect_accepted_socket(lambda: Prefixed(factory(), data), sock)
        )
        self.adopting.add(task)
        task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task[Any]) -> None:
        self.adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not adopt a connection from the native lane: %s", task.exception())

    def stats(self) -> dict[str, int]:
        return self.lane.stats() if self.lane is not None and not self.lane.closed else {}

    def stop_accepting(self) -> None:
        """Before the listening sockets close: no more accepts, idle connections closed."""
        if self.lane is not None and not self.lane.closed:
            self.lane.shutdown()

    async def close(self, timeout: float) -> None:
        """Requests in flight get up to ``timeout`` seconds to finish, then the lane closes."""
        lane = self.lane
        if lane is None or lane.closed:
            return
        lane.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while lane.stats()["open_connections"] and loop.time() < deadline:
            await asyncio.sleep(0.05)
        loop.remove_reader(lane.fileno())
        lane.close()
        if self.adopting:
            await asyncio.gather(*self.adopting, return_exceptions=True)
