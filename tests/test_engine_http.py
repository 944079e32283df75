"""The engine hop's keep-alive client (kvplug/frontend/engine_http.py) against raw loopback
servers that answer with exact bytes: framing, reuse, errors, timeouts, flow control."""

from __future__ import annotations

import asyncio
import gc
import time

import aiohttp
import pytest
from loop_factories import loop_factories

from kvplug.frontend.engine_http import EnginePool, EngineResponse

pytestmark = pytest.mark.timeout(60)

BODY = b'{"ok": true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


class RawServer:
    """Accepts connections; ``answer(request_bytes, writer)`` decides what to send back."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_peer = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if await self.answer(head + body, writer) is False:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer += 1
            writer.close()
        except asyncio.CancelledError:  # the test is over
            writer.close()


def _fixed(data: bytes, keep: bool = True):
    async def answer(_req, writer):
        writer.write(data)
        await writer.drain()
        return keep

    return answer


def _chunked(parts: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    out += b"Transfer-Encoding: chunked\r\n\r\n"
    for p in parts:
        out += b"%x\r\n%s\r\n" % (len(p), p)
    return out + b"0\r\n\r\n"


async def test_one_write_reuse_and_exact_request_bytes():
    async with RawServer(_fixed(OK)) as srv:
        pool = EnginePool(1.0, 5.0)
        try:
            for _ in range(3):
                resp = await pool.post(srv.url + "/v1/completions", b'{"a":1}', {"X-A": "b"})
                assert resp.status == 200
                assert resp.headers.get("content-type") == "application/json"
                assert resp.headers["Content-Type"] == "application/json"
                assert await resp.read() == BODY
                assert resp.at_eof()
                resp.release()
            assert srv.connections == 1 and pool.opened == 1  # kept alive
            assert srv.requests[0] == (
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Content-Length: 7\r\nX-A: b\r\n\r\n"
                b'{"a":1}' % srv.port
            )
        finally:
            pool.close()


async def test_a_chunked_stream_arrives_byte_for_byte_without_its_framing():
    events = [b'data: {"i": %d}\n\n' % i for i in range(20)] + [b"data: [DONE]\n\n"]
    async with RawServer(_fixed(_chunked(events))) as srv:
        pool = EnginePool(1.0, 5.0)
        try:
            resp = await pool.post(srv.url + "/x", b"{}", {})
            got = await resp.readany()
            assert got  # the first bytes are there once post returns
            got += await resp.read()
            assert got == b"".join(events)
            resp.release()
            resp = await pool.post(srv.url + "/x", b"{}", {})  # the same connection again
            assert await resp.read() == b"".join(events)
            resp.release()
            assert pool.opened == 1
        finally:
            pool.close()


async def test_connection_close_and_unread_answers_are_not_reused():
    async with RawServer(_fixed(OK.replace(b"OK\r\n", b"OK\r\nConnection: close\r\n"))) as srv:
        pool = EnginePool(1.0, 5.0)
        try:
            for _ in range(2):
                resp = await pool.post(srv.url + "/x", b"{}", {})
                assert await resp.read() == BODY
                resp.release()
            assert pool.opened == 2 and pool.idle_connections() == 0
        finally:
            pool.close()

    stream = _chunked([b"data: 1\n\n"])[:-5]  # never ends

    async def hold(_req, writer):
        writer.write(stream)
        await writer.drain()
        return True

    async with RawServer(hold) as srv:
        pool = EnginePool(1.0, 5.0)
        try:
            resp = await pool.post(srv.url + "/x", b"{}", {})
            assert await resp.readany() == b"data: 1\n\n" and not resp.at_eof()
            resp.release()  # not read to its end: closed, the engine sees the client go
            resp.close()  # idempotent
            deadline = time.monotonic() + 10
            while srv.closed_by_peer == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert srv.closed_by_peer == 1 and pool.idle_connections() == 0
        finally:
            pool.close()


async def test_engine_failures_are_aiohttp_client_errors():
    async def hang_up(_req, writer):
        return False

    async with RawServer(hang_up) as srv:
        pool = EnginePool(1.0, 5.0)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await pool.post(srv.url + "/x", b"{}", {})
        pool.close()

    half = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"
    async with RawServer(_fixed(half, keep=False)) as srv:
        pool = EnginePool(1.0, 5.0)
        resp = await pool.post(srv.url + "/x", b"{}", {})
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
        resp.close()
        pool.close()

    async with RawServer(_fixed(b"NOT HTTP AT ALL\r\n\r\n")) as srv:
        pool = EnginePool(1.0, 5.0)
        with pytest.raises(aiohttp.ClientPayloadError):
            await pool.post(srv.url + "/x", b"{}", {})
        pool.close()

    async def silent(_req, writer):
        await asyncio.sleep(30)

    async with RawServer(silent) as srv:
        pool = EnginePool(1.0, 0.3)
        with pytest.raises(asyncio.TimeoutError):  # aiohttp.ServerTimeoutError
            await pool.post(srv.url + "/x", b"{}", {})
        pool.close()

    pool = EnginePool(1.0, 5.0)
    with pytest.raises(OSError):  # nothing listens on port 1
        await pool.post("http://127.0.0.1:1/x", b"{}", {})
    with pytest.raises(ValueError):  # no header injection into the engine's request
        await pool.post("http://127.0.0.1:1/x", b"{}", {"X-A": "b\r\nX-Evil: 1"})
    pool.close()


async def test_a_body_until_close_and_a_slow_reader_get_every_byte():
    big = bytes(range(256)) * 4096  # 1 MiB, over the pause threshold

    async def until_close(_req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")
        for i in range(0, len(big), 65536):
            writer.write(big[i : i + 65536])
            await writer.drain()
        return False

    async with RawServer(until_close) as srv:
        pool = EnginePool(1.0, 5.0)
        try:
            resp = await pool.post(srv.url + "/x", b"{}", {})
            got = b""
            while True:
                await asyncio.sleep(0.001)  # a slow client: the engine is held back
                data = await resp.readany()
                if not data:
                    break
                got += data
            assert got == big and resp.at_eof()
            resp.release()
            assert pool.idle_connections() == 0  # ended by close: never reused
        finally:
            pool.close()


async def test_idle_connections_close_after_the_keepalive():
    async with RawServer(_fixed(OK)) as srv:
        pool = EnginePool(1.0, 5.0, keepalive=0.2)
        try:
            resp = await pool.post(srv.url + "/x", b"{}", {})
            await resp.read()
            resp.release()
            assert pool.idle_connections() == 1
            deadline = time.monotonic() + 10
            while pool.idle_connections() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert pool.idle_connections() == 0
            resp = await pool.post(srv.url + "/x", b"{}", {})  # a fresh connection
            await resp.read()
            resp.release()
            assert pool.opened == 2
        finally:
            pool.close()


# -- kvplug serve over engines whose answers arrive in one piece or in many ------------------
def _engine(events: list[bytes], pieces: int):
    """An OpenAI engine on raw sockets: a streamed completion's chunked answer in ``pieces``
    writes (1: the whole answer, end marker included, in one segment)."""
    wire = _chunked(events)

    async def answer(req: bytes, writer) -> bool:
        if not req.startswith(b"POST"):  # probes
            body = b'{"object": "list", "data": [{"id": "stub-model", "object": "model"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            return True
        step = -(-len(wire) // pieces)
        for i in range(0, len(wire), step):
            writer.write(wire[i : i + step])
            await writer.drain()
            if pieces > 1:
                await asyncio.sleep(0.01)
        return True

    return answer


@pytest.mark.parametrize("pieces", [1, 7])
async def test_kvplug_serve_relays_streams_byte_for_byte_however_they_arrive(pieces):
    from test_frontend_harness import BS, Harness

    from kvplug.config import RouterConfig
    from kvplug.frontend.app import ServeSettings
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.server import start_frontend
    from kvplug.router import Router

    events = [b'data: {"choices": [{"text": " t%d"}]}\n\n' % i for i in range(5)]
    events.append(b"data: [DONE]\n\n")
    async with RawServer(_engine(events, pieces)) as srv:
        router = Router(RouterConfig(kv_block_size=BS))
        spec = spec_from_mapping({"id": "w0", "url": srv.url, "engine": "openai"}, "w0")
        running = await start_frontend(router, [spec], ServeSettings(health_interval=60))
        try:
            async with aiohttp.ClientSession() as session:
                h = Harness(router, running, {}, session, None)  # type: ignore[arg-type]
                for _ in range(3):  # the engine connection is reused between streams
                    resp, raw = await h.complete(list(range(40)), stream=True)
                    assert resp.status == 200 and raw == b"".join(events)
                    trace = await h.trace(resp.headers["x-kvplug-decision-id"])
                    assert trace["outcome"] == "ok" and trace["output_tokens"] == 5
                    h.assert_idle()
                assert running.frontend.upstream.pool is not None
                assert running.frontend.upstream.pool.opened == 1
        finally:
            await running.close()


def _cyclic_garbage(kind: type) -> int:
    """Objects of ``kind`` the collector finds unreachable now (in reference cycles: anything
    else was freed by its reference count already)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sum(isinstance(o, kind) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("new_loop", loop_factories())
def test_a_stream_read_across_a_stall_of_the_loop_is_not_cut_as_silent(new_loop):
    """--idle-timeout 0.3 s; the engine (its own thread) sends a chunk every 0.4 s, and this
    loop blocks for 1 s after the first. The idle timer runs late, with the engine's bytes
    waiting to be read in the same iteration: the stall is given back and the stream arrives
    whole (before: ServerTimeoutError, the connection closed mid-stream)."""
    import socket
    import threading

    parts = [b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10]
    wire = _chunked(parts)
    head, _, framed = wire.partition(b"\r\n\r\n")
    pieces = [head + b"\r\n\r\n"] + [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]
    pieces[-1] += b"0\r\n\r\n"
    listener = socket.create_server(("127.0.0.1", 0))

    def engine() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(pieces[0] + pieces[1])
            for piece in pieces[2:]:
                time.sleep(0.4)
                conn.sendall(piece)
            conn.recv(1)

    async def scenario() -> bytes:
        pool = EnginePool(1.0, 0.3)
        port = listener.getsockname()[1]
        resp = await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
        asyncio.get_running_loop().call_soon(time.sleep, 1.0)
        got = b""
        while chunk := await resp.readany():
            got += chunk
        resp.close()
        return got

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            assert runner.run(scenario()) == b"".join(parts)
    finally:
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("new_loop", loop_factories())
def test_a_silent_engine_still_times_out_on_a_loop_that_keeps_stalling(new_loop):
    """What stalls give back is bounded (three times an answer): a loop blocked 0.5 s every 50 ms
    still fails a silent engine's read."""

    async def scenario() -> None:
        async def answer(_req, writer):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            return True

        async with RawServer(answer) as srv:
            pool = EnginePool(1.0, 0.3)
            resp = await pool.post(srv.url + "/v1/completions", b"{}", {})
            loop = asyncio.get_running_loop()
            stalling = True

            def stall() -> None:
                time.sleep(0.5)
                if stalling:
                    loop.call_later(0.05, stall)

            loop.call_soon(stall)
            try:
                assert await resp.readany() == b"abc"
                with pytest.raises(aiohttp.ServerTimeoutError):
                    await resp.readany()
            finally:
                stalling = False
                resp.close()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(scenario())


async def test_answers_are_freed_without_the_collector():
    """A released or closed answer leaves no reference cycle (its parser held its bound
    callbacks: ~12 objects a request for the collector, a fifth of kvplug serve's CPU)."""
    events = [b'data: {"i": %d}\n\n' % i for i in range(3)]
    stream = _chunked(events)[:-5]  # never ends: closed before its end

    async def answer(req, writer):
        writer.write(stream if b"/stream" in req else OK)
        await writer.drain()
        return True

    async with RawServer(answer) as srv:
        pool = EnginePool(1.0, 5.0)
        gc.collect()
        gc.disable()
        try:
            for _ in range(20):
                resp = await pool.post(srv.url + "/whole", b"{}", {})
                assert await resp.read() == BODY
                resp.release()
                resp = await pool.post(srv.url + "/stream", b"{}", {})
                assert await resp.readany()
                resp.close()
            del resp
            assert _cyclic_garbage(EngineResponse) == 0
        finally:
            gc.enable()
            pool.close()
