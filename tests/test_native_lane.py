"""The compiled HTTP data path (kvplug._lane, csrc/lane.c) on real sockets: what it serves, what
it hands back, how it relays an engine's answer and how it reports failures and timeouts.

The lane runs on the test's event loop as ``kvplug serve --data-path native`` runs it; its
decider here is a small real one (round-robin over the upstreams, the request forwarded as is),
so these tests pin the lane, not kvplug's routing (tests/test_native_glue.py does that, and the
CLI test at the end runs both)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import socket
import struct
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("kvplug._lane")

from kvplug._lane import (  # noqa: E402
    COUNT_BODY_TIMEOUT,
    COUNT_CLIENT_GONE,
    COUNT_HEAD_TIMEOUT,
    Lane,
    head_qualifies,
)
from kvplug.frontend.hints import HINT_HEADERS  # noqa: E402
from kvplug.frontend.lane import _parse_head  # noqa: E402
from kvplug.frontend.native_lane import Prefixed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from instant_engine import InstantEngine, answers  # noqa: E402

pytestmark = pytest.mark.timeout(60)

COMPLETIONS, CHAT = 0, 1
OK, CLIENT_GONE, UNAVAILABLE, FAILED, TIMED_OUT, DEADLINE = range(6)
PATHS = {COMPLETIONS: b"/v1/completions", CHAT: b"/v1/chat/completions"}


def post(path: bytes, body: bytes, extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST %s %s\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
        % (path, version, extra, len(body))
        + body
    )


def body_of(stream: bool = False, prompt=(1, 2, 3)) -> bytes:
    return json.dumps({"model": "stub-model", "prompt": list(prompt), "stream": stream}).encode()


def engine_head(kind: int, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n" % PATHS[
        kind
    ] + b"Content-Length: %d\r\n\r\n" % len(body)


class Recorder(asyncio.Protocol):
    """The Python side of a hand-off: keeps every byte, answers 299 once a head is whole."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.data = b""
        self.answered = False
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.log.append(self)

    def data_received(self, data: bytes) -> None:
        self.data += data
        if not self.answered and b"\r\n\r\n" in self.data:
            self.answered = True
            self.transport.write(
                b"HTTP/1.1 299 Handed\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )


class Harness:
    """A lane on a listening socket, upstreams, a decider (round-robin unless told) and the
    callbacks' record."""

    def __init__(self, **lane_kwargs) -> None:
        self.lane_kwargs = lane_kwargs
        self.finished: list[tuple] = []
        self.first_bytes: list = []
        self.handed: list[Recorder] = []
        self.decided: list[tuple] = []
        self.fields: list[bytes | None] = []  # what decide got of each head's header lines
        self.counted: list[tuple] = []  # (event, kind, seconds) of each count
        self.upstreams: list[int] = []
        self.turn = 0
        self.decide_with = None  # (kind, body, rid, auth) -> decision, overrides round-robin
        self.on_finish = None  # (token, status, outcome, tail) -> a decision or None
        self.servers: list[asyncio.AbstractServer] = []

    async def __aenter__(self) -> Harness:
        self.loop = asyncio.get_running_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        kwargs = dict(
            max_body=1 << 20,
            head_timeout=10,
            keepalive_timeout=10,
            body_timeout=10,
            engine_idle_timeout=10,
            handoff_headers=HINT_HEADERS,
            count=self.count,
        )
        kwargs.update(self.lane_kwargs)
        self.lane = Lane(
            [self.sock.fileno()], self.decide, self.first_byte, self.finish, self.handoff, **kwargs
        )
        self.loop.add_reader(self.lane.fileno(), self.lane.poll)
        return self

    async def __aexit__(self, *exc) -> None:
        self.loop.remove_reader(self.lane.fileno())
        self.lane.close()
        self.sock.close()
        for server in self.servers:
            server.close()

    async def instant_engine(self, tokens: int = 8) -> int:
        wire = answers(tokens)
        server = await self.loop.create_server(lambda: InstantEngine(wire), "127.0.0.1", 0)
        self.servers.append(server)
        return self.add_upstream(server.sockets[0].getsockname()[1])

    async def scripted_engine(self, handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        self.servers.append(server)
        return self.add_upstream(server.sockets[0].getsockname()[1])

    def add_upstream(self, port: int) -> int:
        upstream = len(self.upstreams) + 1
        self.lane.set_upstream(upstream, "127.0.0.1", port)
        self.upstreams.append(upstream)
        return upstream

    # -- the callbacks ---------------------------------------------------------------------
    def decide(self, kind, body, request_id, authorization, fields=None):
        self.decided.append((kind, body, request_id, authorization))
        self.fields.append(fields)
        if self.decide_with is not None:
            return self.decide_with(kind, body, request_id, authorization)
        upstream = self.upstreams[self.turn % len(self.upstreams)]
        self.turn += 1
        token = {"n": len(self.decided), "upstream": upstream}
        return (upstream, engine_head(kind, body), None, b"X-Lane-Test: yes\r\n", token)

    def first_byte(self, token) -> None:
        self.first_bytes.append(token)

    def count(self, event: int, kind: int, seconds: float) -> None:
        self.counted.append((event, kind, seconds))

    def finish(self, token, status, outcome, tail):
        self.finished.append((token, status, outcome, tail))
        if self.on_finish is not None:
            return self.on_finish(token, status, outcome, tail)
        return None

    def handoff(self, fd: int, data: bytes) -> None:
        sock = socket.socket(fileno=fd)
        log = self.handed
        self.loop.create_task(
            self.loop.connect_accepted_socket(lambda: Prefixed(Recorder(log), data), sock)
        )

    async def connect(self):
        return await asyncio.open_connection("127.0.0.1", self.port)


async def silent_engine(reader, writer) -> None:
    """An engine that takes the request and never answers."""
    await reader.read()


async def read_chunked(reader, timeout: float = 10) -> bytes:
    """A chunked body as framed on the wire, up to and with its last chunk."""
    body = b""
    while True:
        line = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
        body += line
        size = int(line.split(b";")[0], 16)
        body += await asyncio.wait_for(reader.readexactly(size + 2), timeout)
        if size == 0:
            return body


async def read_answer(reader) -> tuple[bytes, bytes]:
    """(head, body as framed on the wire) of one HTTP answer."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return head, await read_chunked(reader)
    if b"content-length:" in lower:
        n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        return head, await asyncio.wait_for(reader.readexactly(n), 10)
    return head, await asyncio.wait_for(reader.read(), 10)


DATE_LINE = re.compile(
    rb"\r\nDate: (Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d "
    rb"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} \d\d:\d\d:\d\d GMT\r\n"
)


def without_date(head: bytes) -> bytes:
    """The head without its one Date field (the lane's own, an IMF-fixdate of about now)."""
    found = DATE_LINE.findall(head)
    assert len(found) == 1, head
    stamp = re.search(rb"Date: ([^\r]+)", head).group(1).decode()
    assert abs(email.utils.parsedate_to_datetime(stamp).timestamp() - time.time()) < 5
    return DATE_LINE.sub(b"\r\n", head, count=1)


def dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while True:
        line, rest = rest.split(b"\r\n", 1)
        size = int(line, 16)
        if size == 0:
            return out
        out, rest = out + rest[:size], rest[size + 2 :]


async def direct(port: int, request: bytes) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        return await read_answer(reader)
    finally:
        writer.close()


def headers_of(head: bytes) -> dict[bytes, bytes]:
    lines = head.split(b"\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines if ln)}


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# -- serving ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_answer_is_the_engines_byte_for_byte(kind, stream):
    async with Harness() as h:
        await h.instant_engine()
        engine_port = h.servers[0].sockets[0].getsockname()[1]
        body = body_of(stream)
        want_head, want_body = await direct(engine_port, engine_head(kind, body) + body)
        reader, writer = await h.connect()
        writer.write(post(PATHS[kind], body, b"X-Request-Id: r-1\r\nAuthorization: Bearer k\r\n"))
        head, got = await read_answer(reader)
        writer.close()
        head = without_date(
            head
        )  # the lane's own Date (the Python server's field), not the engine's
        assert got == want_body  # chunked framing copied as is, or the Content-Length body
        assert head.split(b"\r\n")[0] == want_head.split(b"\r\n")[0]
        want = headers_of(want_head)
        assert {k: v for k, v in headers_of(head).items() if k != b"x-lane-test"} == want
        assert headers_of(head)[b"x-lane-test"] == b"yes"
        assert h.decided[0][0] == kind and h.decided[0][1] == body
        assert h.decided[0][2:] == (b"r-1", b"Bearer k")
        await until(lambda: h.finished)
        token, status, outcome, tail = h.finished[0]
        assert (token["n"], status, outcome) == (1, 200, OK)
        plain = dechunk(want_body) if stream else want_body
        assert tail == plain[-4096:]
        assert len(h.first_bytes) == (1 if stream else 0)
        assert h.lane.stats()["served"] == 1


async def test_keep_alive_is_reused_on_both_sides():
    async with Harness() as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        for i in range(5):
            writer.write(post(b"/v1/completions", body_of(stream=i % 2 == 1)))
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200")
        stats = h.lane.stats()
        assert stats["served"] == 5 and stats["open_connections"] == 1
        assert stats["engine_connections"] == 1 and stats["idle_engine_connections"] == 1
        assert [f[2] for f in h.finished] == [OK] * 5
        writer.close()
        await until(lambda: h.lane.stats()["open_connections"] == 0)


async def test_pipelined_requests_are_answered_in_order():
    async with Harness() as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        bodies = [body_of(prompt=[i, i + 1]) for i in range(3)]
        writer.write(b"".join(post(b"/v1/completions", b) for b in bodies))
        for _ in bodies:
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200")
        assert [d[1] for d in h.decided] == bodies
        writer.close()


async def test_many_pipelined_requests_answered_directly_come_back_in_order():
    # each direct answer is written at the end of the poll, and its flush starts the next
    # pipelined request there (before, the answers nested; the lane stopped after a few)
    async with Harness() as h:
        h.decide_with = lambda kind, body, rid, auth: (429, b"", body)
        reader, writer = await h.connect()
        bodies = [b'{"n":%d}' % i for i in range(300)]
        writer.write(b"".join(post(b"/v1/completions", b) for b in bodies))
        got = [(await read_answer(reader))[1] for _ in bodies]
        assert got == bodies
        writer.close()


async def test_requests_sent_while_one_is_served_wait_their_turn():
    release = asyncio.Event()

    async def engine(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = await reader.readexactly(n)
            await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + body)

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        bodies = [body_of(prompt=[i]) for i in range(3)]
        writer.write(post(b"/v1/completions", bodies[0]))
        await until(lambda: h.decided)
        writer.write(post(b"/v1/completions", bodies[1]) + post(b"/v1/completions", bodies[2]))
        await asyncio.sleep(0.1)  # read by the lane while the first is served
        assert len(h.decided) == 1
        release.set()
        assert [(await read_answer(reader))[1] for _ in bodies] == bodies
        writer.close()


class HandEngine:
    """An engine on plain non-blocking sockets, run by hand between the test's own polls of
    the lane (so what reached it, and when, is the kernel's word, not an event loop's)."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self) -> None:
        self.listening = socket.socket()
        self.listening.bind(("127.0.0.1", 0))
        self.listening.listen(16)
        self.listening.setblocking(False)
        self.port = self.listening.getsockname()[1]
        self.conns: list[socket.socket] = []

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.listening.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            self.conns.append(conn)

    def _read(self, conn: socket.socket, flags: int = 0) -> bytes:
        """What waits on a connection; b"" if nothing, and a connection the lane closed (or
        reset) is dropped."""
        try:
            data = conn.recv(1 << 16, flags)
        except BlockingIOError:
            return b""
        except ConnectionResetError:
            data = b""
        if not data:
            self.conns.remove(conn)
            conn.close()
        return data

    def pending(self) -> int:
        """Bytes of requests that reached the engine and are not read yet."""
        self.accept()
        return sum(len(self._read(conn, socket.MSG_PEEK)) for conn in list(self.conns))

    def answer(self) -> int:
        """One answer a connection with a whole request waiting (each of ours is one whole
        segment); how many."""
        self.accept()
        answered = 0
        for conn in list(self.conns):
            if self._read(conn):
                conn.sendall(self.ANSWER)
                answered += 1
        return answered

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listening.close()


def waiting(sock: socket.socket) -> int:
    """Bytes the kernel holds for a client socket (0 if none)."""
    try:
        return len(sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


def poll_until(h: Harness, engine: HandEngine, predicate, answer: bool = False) -> None:
    for _ in range(1000):
        h.lane.poll()
        if answer:
            engine.answer()
        if predicate():
            return
        time.sleep(0.002)
    raise AssertionError("condition not met")


async def test_a_polls_requests_and_answers_are_written_together_after_its_callbacks():
    # The lane writes the requests it decided in one poll to their engines, and the answers it
    # finished to their clients, at the end of that poll, back to back: each write wakes the
    # reader's process, and one wake then serves the batch. Here the lane is polled by hand:
    # while it decides (finishes) the second of two requests read in one poll, the first is
    # not at its engine (client) yet; once the poll returns both are.
    engine = HandEngine()
    clients: list[socket.socket] = []
    try:
        async with Harness() as h:
            h.loop.remove_reader(h.lane.fileno())  # polled by hand below
            upstream = h.add_upstream(engine.port)
            clients = [socket.create_connection(("127.0.0.1", h.port)) for _ in range(2)]
            for c in clients:  # a first request each: two engine connections, then pooled
                c.sendall(post(b"/v1/completions", body_of()))
            poll_until(h, engine, lambda: len(h.decided) == 2)
            poll_until(h, engine, lambda: all(waiting(c) for c in clients), answer=True)
            for c in clients:
                c.recv(1 << 16)
            assert h.lane.stats()["idle_engine_connections"] == 2

            at_decide: list[int] = []  # request bytes at the engine when each was decided
            at_finish: list[int] = []  # answer bytes at the clients when each was finished

            def decide(kind, body, rid, auth):
                at_decide.append(engine.pending())
                return (upstream, engine_head(kind, body), None, b"", {"n": len(h.decided)})

            def on_finish(token, status, outcome, tail):
                at_finish.append(sum(waiting(c) for c in clients))

            h.decide_with = decide
            h.on_finish = on_finish
            for c in clients:
                c.sendall(post(b"/v1/completions", body_of(prompt=[7])))
            h.lane.poll()
            assert len(h.decided) == 4  # both read and decided in that one poll
            assert at_decide == [0, 0]  # the first was not written before the second's decide
            assert engine.pending() > 0
            assert engine.answer() == 2
            h.lane.poll()  # both answers read and finished in this poll
            assert at_finish == [0, 0]
            assert all(waiting(c) for c in clients)
            assert [f[2] for f in h.finished] == [OK] * 4
    finally:
        for c in clients:
            c.close()
        engine.close()


async def test_a_client_resetting_while_its_answer_waits_for_the_polls_end_is_finished_once():
    # the engine's answer and the client's reset read in one poll, in either order: the answer
    # queued for the poll's end is dropped with the connection (finished once), the lane goes on
    engine = HandEngine()
    try:
        async with Harness() as h:
            h.loop.remove_reader(h.lane.fileno())  # polled by hand below
            h.add_upstream(engine.port)
            for n in range(1, 4):
                client = socket.create_connection(("127.0.0.1", h.port))
                client.sendall(post(b"/v1/completions", body_of()))
                poll_until(h, engine, lambda: engine.pending() > 0)  # decided and written
                assert engine.answer() == 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset, now in the kernel beside the engine's answer
                poll_until(h, engine, lambda: h.lane.stats()["open_connections"] == 0)
                assert len(h.finished) == n and h.finished[-1][2] in (OK, CLIENT_GONE)
            client = socket.create_connection(("127.0.0.1", h.port))  # and the lane goes on
            client.sendall(post(b"/v1/completions", body_of()))
            poll_until(h, engine, lambda: waiting(client) > 0, answer=True)
            assert client.recv(1 << 16).startswith(b"HTTP/1.1 200")
            client.close()
    finally:
        engine.close()


async def test_connection_close_is_honoured():
    async with Harness() as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of(), b"Connection: close\r\n"))
        head, _ = await read_answer(reader)
        assert b"Connection: close" in head
        assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_a_decided_answer_is_sent_as_given():
    async with Harness() as h:
        h.decide_with = lambda *a: (503, b"Content-Type: application/json\r\n", b'{"e":1}')
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert headers_of(head)[b"content-type"] == b"application/json" and body == b'{"e":1}'
        writer.write(post(b"/v1/completions", body_of()))  # the connection goes on
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 503")
        assert h.finished == []  # nothing was forwarded
        writer.close()


async def test_a_replacement_body_is_sent_instead_of_the_clients():
    seen = []

    async def engine(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        seen.append(await reader.readexactly(n))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with Harness() as h:
        up = await h.scripted_engine(engine)
        new = b'{"prompt":[9]}'
        h.decide_with = lambda kind, body, rid, auth: (up, engine_head(kind, new), new, b"", "t")
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert body == b"ok" and seen == [new]
        writer.close()


async def test_an_until_close_answer_is_chunked_to_the_client():
    payload = b"x" * 70000 + b"END"

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        for i in range(0, len(payload), 30000):
            writer.write(payload[i : i + 30000])
            await writer.drain()
        writer.close()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert b"Transfer-Encoding: chunked" in head and dechunk(body) == payload
        await until(lambda: h.finished)
        assert h.finished[0][1:3] == (200, OK) and h.finished[0][3] == payload[-4096:]
        writer.write(post(b"/v1/completions", body_of()))  # the client's connection goes on
        head, body = await read_answer(reader)
        assert dechunk(body) == payload
        writer.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_large_answer_to_a_slow_reader_arrives_whole(stream):
    """An event stream is relayed as it comes, the engine paused while the client is backed
    up; a whole answer (any other type) is held until whole, as the Python path reads it."""
    payload = bytes(range(256)) * 4096 * 24  # 24 MiB: more than the sockets' buffers hold
    ctype = b"text/event-stream" if stream else b"application/json"

    async def engine(reader, writer):
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            await reader.readexactly(len(body_of()))
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                % (ctype, len(payload))
            )
            writer.write(payload)
            await writer.drain()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        await asyncio.sleep(0.3)  # the client reads nothing: the lane holds, then pauses
        if stream:  # chunked to the client, as the Python path relays a stream
            got = dechunk(await read_chunked(reader, 20))
        else:
            got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
        assert got == payload and head.startswith(b"HTTP/1.1 200")
        await until(lambda: h.finished)
        assert h.finished[0][2] == OK
        assert (h.lane.stats()["engine_pauses"] >= 1) == stream
        writer.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_finish_gets_the_last_4096_bytes_of_a_longer_answer_read_in_pieces(chunked):
    # the lane keeps the answer's last bytes in a ring; pieces of uneven sizes wrap it at
    # positions other than its start (the usage object is in the last bytes: the glue reads it)
    pieces = [
        bytes((i * 7 + k) % 251 for k in range(n))
        for i, n in enumerate((1500, 999, 2100, 1333, 700))
    ]

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(body_of()))
        if chunked:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        else:
            total = sum(map(len, pieces))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            await asyncio.sleep(0.02)  # read by the lane piece by piece
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Harness() as h:
        await h.scripted_engine(engine)
        head, body = await direct(h.port, post(b"/v1/completions", body_of()))
        assert (dechunk(body) if chunked else body) == b"".join(pieces)
        await until(lambda: h.finished)
        assert h.finished[0][2] == OK
        assert h.finished[0][3] == b"".join(pieces)[-4096:]


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
async def test_stream_bytes_hands_over_a_whole_stream_4096_at_a_time(framing):
    """With stream_bytes, an event stream's body (de-chunked) reaches the caller whole: 4096
    bytes at a time as it passes, finish getting the rest; a whole answer keeps the tail ring."""
    pieces = [
        bytes((i * 7 + k) % 251 for k in range(n))
        for i, n in enumerate((1500, 999, 2100, 1333, 700, 5000, 4096))
    ]
    whole = b"".join(pieces)

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(body_of()))
        framed = {
            "chunked": b"Transfer-Encoding: chunked\r\n",
            "length": b"Content-Length: %d\r\n" % len(whole),
            "close": b"Connection: close\r\n",
        }[framing]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%s\r\n" % framed)
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
            await writer.drain()
            await asyncio.sleep(0.02)  # read by the lane piece by piece
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        if framing == "close":
            writer.close()

    handed: list[tuple] = []
    async with Harness(stream_bytes=lambda token, data: handed.append((token, data))) as h:
        await h.scripted_engine(engine)
        head, body = await direct(h.port, post(b"/v1/completions", body_of()))
        assert b"transfer-encoding: chunked" in head.lower()  # a stream, whatever the engine's
        assert dechunk(body) == whole
        await until(lambda: h.finished)
        token, status, outcome, tail = h.finished[0]
        assert outcome == OK and status == 200
        assert all(t is token and len(d) == 4096 for t, d in handed)
        assert b"".join(d for _, d in handed) + tail == whole and len(tail) < 4096
        assert len(handed) == len(whole) // 4096 and h.first_bytes == [token]


async def test_an_upstream_set_to_a_new_address_is_not_served_by_old_connections():
    def engine_saying(word: bytes):
        async def engine(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(n)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + word)

        return engine

    async with Harness() as h:
        await h.scripted_engine(engine_saying(b"A"))
        b = await asyncio.start_server(engine_saying(b"B"), "127.0.0.1", 0)
        h.servers.append(b)
        h.decide_with = lambda kind, body, rid, auth: (1, engine_head(kind, body), None, b"", 0)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        assert (await read_answer(reader))[1] == b"A"
        h.lane.set_upstream(1, "127.0.0.1", b.sockets[0].getsockname()[1])
        writer.write(post(b"/v1/completions", body_of()))
        assert (await read_answer(reader))[1] == b"B"
        assert h.lane.drop_upstream(1) and not h.lane.drop_upstream(1)
        writer.write(post(b"/v1/completions", body_of()))  # dropped: unavailable
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502") and h.finished[-1][2] == UNAVAILABLE
        writer.close()


# -- hand-offs -------------------------------------------------------------------------------

HAND_OFFS = {
    "another path": post(b"/v1/models", b"{}"),
    "a query string": post(b"/v1/completions?x=1", body_of()),
    "GET": b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP/1.0": post(b"/v1/completions", body_of(), version=b"HTTP/1.0"),
    "chunked body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
    b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "Expect": post(b"/v1/completions", body_of(), b"Expect: 100-continue\r\n"),
    "a hint header": post(b"/v1/completions", body_of(), b"X-Kvplug-Worker: w1\r\n"),
    "a Dynamo hint header": post(b"/v1/completions", body_of(), b"X-Dynamo-Dp-Rank: 3\r\n"),
    "a pin header": post(b"/v1/completions", body_of(), b"x-worker-instance-id: e0\r\n"),
    "Content-Encoding": post(b"/v1/completions", body_of(), b"Content-Encoding: gzip\r\n"),
    "Upgrade": post(b"/v1/completions", body_of(), b"Upgrade: h2c\r\n"),
    "two lengths": post(b"/v1/completions", body_of(), b"Content-Length: 3\r\n"),
    "no length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    "a bare LF": post(b"/v1/completions", body_of(), b"X-A: 1\nX-B: 2\r\n"),
    "a folded line": post(b"/v1/completions", body_of(), b"X-A: 1\r\n  more\r\n"),
    "non-ASCII": post(b"/v1/completions", body_of(), "X-A: \u00e9\r\n".encode()),
    "oversize head": post(b"/v1/completions", body_of(), b"X-Big: " + b"a" * 9000 + b"\r\n"),
    "oversize body": post(b"/v1/completions", b"x" * 2000),
    "Connection: upgrade": post(b"/v1/completions", body_of(), b"Connection: upgrade\r\n"),
}


@pytest.mark.parametrize("case", sorted(HAND_OFFS))
async def test_anything_not_plain_is_handed_off_with_its_bytes(case):
    request = HAND_OFFS[case]
    async with Harness(max_body=1000) as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 299")
        await until(lambda: h.handed and h.handed[0].data == request)
        assert h.decided == [] and h.lane.stats()["handed_off"] == 1
        assert h.lane.stats()["open_connections"] == 0
        writer.close()


async def test_a_head_arriving_in_pieces_is_handed_off_whole():
    async with Harness() as h:
        reader, writer = await h.connect()
        request = HAND_OFFS["another path"]
        for i in range(0, len(request), 7):
            writer.write(request[i : i + 7])
            await asyncio.sleep(0.002)
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await until(lambda: h.handed and h.handed[0].data == request)


async def test_a_decider_none_hands_off_the_whole_request():
    async with Harness() as h:
        h.decide_with = lambda *a: None
        request = post(b"/v1/completions", body_of())
        reader, writer = await h.connect()
        writer.write(request)
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await until(lambda: h.handed and h.handed[0].data == request)
        assert len(h.decided) == 1 and h.finished == []


async def test_a_later_request_on_a_kept_alive_connection_is_handed_off():
    async with Harness() as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        await read_answer(reader)
        later = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        writer.write(later)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 299")
        await until(lambda: h.handed and h.handed[0].data == later)


async def test_a_decider_that_raises_hands_off(caplog):
    async with Harness() as h:

        def broken(*a):
            raise RuntimeError("decider bug")

        h.decide_with = broken
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 299")
    assert "decider bug" in caplog.text and "handed off" in caplog.text


# -- failures --------------------------------------------------------------------------------


async def test_engine_refused_is_retried_through_finish():
    async with Harness() as h:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        refused = h.add_upstream(dead.getsockname()[1])
        good = await h.instant_engine()

        def retry(token, status, outcome, tail):
            if outcome == UNAVAILABLE:
                body = h.decided[-1][1]
                return (good, engine_head(COMPLETIONS, body), None, b"", {"retry": True})
            return None

        h.on_finish = retry
        h.decide_with = lambda kind, body, rid, auth: (
            refused,
            engine_head(kind, body),
            None,
            b"",
            {"first": True},
        )
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        await until(lambda: len(h.finished) == 2)
        assert [(f[0], f[1], f[2]) for f in h.finished] == [
            ({"first": True}, 0, UNAVAILABLE),
            ({"retry": True}, 200, OK),
        ]
        stats = h.lane.stats()
        assert stats["retried"] == 1 and stats["engine_failed"] == 1
        dead.close()
        writer.close()


async def test_engine_refused_with_no_retry_answers_what_finish_says_or_502():
    async with Harness() as h:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        h.add_upstream(dead.getsockname()[1])
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502") and json.loads(body)["error"]
        h.on_finish = lambda *a: (503, b"X-Why: spent\r\n", b"no engine")
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 503") and b"X-Why: spent" in head
        assert body == b"no engine"
        dead.close()
        writer.close()


async def test_an_unknown_upstream_is_unavailable():
    async with Harness() as h:
        h.decide_with = lambda kind, body, rid, auth: (99, engine_head(kind, body), None, b"", 1)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502") and h.finished[0][2] == UNAVAILABLE


async def test_a_decider_retrying_without_end_is_cut_short():
    async with Harness() as h:
        forever = (99, engine_head(COMPLETIONS, body_of()), None, b"", "again")  # unknown
        h.decide_with = lambda *a: forever
        h.on_finish = lambda *a: forever
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502")
        assert 2 < len(h.finished) < 40 and h.finished[-1][2] == CLIENT_GONE  # released
        writer.close()


async def test_an_upstream_without_an_address_is_unavailable_and_names_are_refused():
    async with Harness() as h:
        with pytest.raises(ValueError, match="numeric"):
            h.lane.set_upstream(1, "localhost", 80)  # resolving would block the loop
        h.lane.set_upstream(1, "", 0)  # known, address pending
        h.upstreams.append(1)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502") and h.finished[0][2] == UNAVAILABLE
        writer.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_engine_dying_mid_answer_is_outcome_3(stream):
    """A stream's client has its first bytes and sees the connection end; a whole answer's
    client, sent nothing yet, gets the 502 finish chooses (here the lane's own)."""
    ctype = b"text/event-stream" if stream else b"application/json"

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: 100\r\n\r\n0123456789" % ctype
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        if stream:  # re-chunked; no last event to end it with here: closed
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            rest = await asyncio.wait_for(reader.read(), 5)  # closed before the 100 bytes
            assert rest == b"a\r\n0123456789\r\n"
        else:
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 502")
            assert json.loads(body)["error"]["code"] == "upstream_failed"
        await until(lambda: h.finished)
        assert h.finished[0][1:] == (200, FAILED, b"0123456789")


async def test_engine_closing_before_its_head_is_unavailable():
    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502")
        assert h.finished[0][2] == UNAVAILABLE


async def test_a_garbled_answer_head_is_an_engine_failure():
    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502")
        assert h.finished[0][2] == FAILED


async def test_a_stale_pooled_connection_is_retried_fresh_without_a_failure():
    async def engine(reader, writer):  # answers one request per connection, then closes
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(body_of()))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        for _ in range(3):
            writer.write(post(b"/v1/completions", body_of()))
            head, body = await read_answer(reader)
            assert body == b"ok"
            await asyncio.sleep(0.1)
        assert [f[2] for f in h.finished] == [OK] * 3
        assert h.lane.stats()["engine_failed"] == 0


async def test_client_hanging_up_mid_answer_closes_the_engine_connection():
    engine_saw_close = asyncio.Event()

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        )
        await writer.drain()
        await reader.read()  # until the lane closes this connection
        engine_saw_close.set()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of(stream=True)))
        await asyncio.wait_for(reader.readuntil(b"hello\r\n"), 5)
        writer.close()
        await asyncio.wait_for(engine_saw_close.wait(), 5)
        await until(lambda: h.finished)
        assert h.finished[0][1:] == (200, CLIENT_GONE, b"hello")
        assert len(h.first_bytes) == 1
        stats = h.lane.stats()
        assert stats["client_gone"] == 1 and stats["engine_connections"] == 0


async def test_client_hanging_up_while_the_engine_thinks():
    engine_saw_close = asyncio.Event()

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()
        engine_saw_close.set()

    async with Harness() as h:
        await h.scripted_engine(engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        await until(lambda: h.decided)
        writer.close()
        await asyncio.wait_for(engine_saw_close.wait(), 5)
        await until(lambda: h.finished)
        assert h.finished[0][1:3] == (0, CLIENT_GONE)


async def test_client_hanging_up_mid_body_is_forgotten_undecided():
    async with Harness() as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        request = post(b"/v1/completions", body_of())
        writer.write(request[:-5])
        await until(lambda: h.lane.stats()["open_connections"] == 1)
        writer.close()
        await until(lambda: h.lane.stats()["open_connections"] == 0)
        assert h.decided == [] and h.finished == []
        assert [c[:2] for c in h.counted] == [(COUNT_CLIENT_GONE, COMPLETIONS)]


async def test_what_the_lane_closes_unfinished_is_counted_and_nothing_else():
    answer = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    timeouts = dict(head_timeout=0.3, keepalive_timeout=0.3, body_timeout=10)
    async with Harness(head_timeout_answer=answer, body_timeout_answer=answer, **timeouts) as h:
        await h.instant_engine()
        reader, writer = await h.connect()  # served, then idle past the keep-alive: no count
        writer.write(post(b"/v1/completions", body_of()))
        await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await h.connect()  # gone mid-head: no request yet, no count
        writer.write(b"POST /v1/comp")
        await until(lambda: h.lane.stats()["open_connections"] == 1)
        writer.close()
        await until(lambda: h.lane.stats()["open_connections"] == 0)
        assert h.counted == []
        reader, writer = await h.connect()  # a late first head
        writer.write(b"POST /v1/comp")
        assert await asyncio.wait_for(reader.read(), 5) == answer
        assert h.counted == [(COUNT_HEAD_TIMEOUT, -1, 0.0)]
        reader, writer = await h.connect()  # gone mid-body with a reset
        writer.write(post(b"/v1/completions", body_of())[:-3])
        await until(lambda: h.lane.stats()["open_connections"] == 1)
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        await until(lambda: len(h.counted) == 2)
        event, kind, seconds = h.counted[-1]
        assert (event, kind) == (COUNT_CLIENT_GONE, COMPLETIONS) and 0 < seconds < 10, seconds
        assert h.decided == [(COMPLETIONS, body_of(), None, None)] and len(h.finished) == 1
    async with Harness(body_timeout=0.3, body_timeout_answer=answer) as h:
        reader, writer = await h.connect()  # a late body: its age from the whole head
        writer.write(post(b"/v1/chat/completions", body_of())[:-3])
        assert await asyncio.wait_for(reader.read(), 5) == answer
        seconds = h.counted[-1][2]
        assert h.counted == [(COUNT_BODY_TIMEOUT, CHAT, seconds)] and 0.3 <= seconds < 3, seconds


async def test_without_a_count_the_lane_closes_unfinished_requests_the_same():
    async with Harness(count=None, body_timeout=0.2) as h:
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of())[:-3])
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no answer given: closed
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of())[:-3])
        await until(lambda: h.lane.stats()["open_connections"] == 1)
        writer.close()
        await until(lambda: h.lane.stats()["open_connections"] == 0)
        assert h.counted == [] and h.lane.stats()["timeouts"] == 1


# -- timeouts --------------------------------------------------------------------------------


async def test_a_slow_first_head_gets_the_408_given():
    answer = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    async with Harness(head_timeout=0.2, head_timeout_answer=answer) as h:
        reader, writer = await h.connect()
        writer.write(b"POST /v1/comp")
        got = await asyncio.wait_for(reader.read(), 5)
        assert got == answer and h.lane.stats()["timeouts"] == 1


async def test_a_slow_body_gets_the_408_given():
    answer = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 1\r\n\r\nb"
    async with Harness(body_timeout=0.2, body_timeout_answer=answer) as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of())[:-3])
        got = await asyncio.wait_for(reader.read(), 5)
        assert got == answer and h.decided == []


async def test_a_body_timeout_after_a_stall_counts_the_heads_whole_age():
    """A stall of the loop gives the body's deadline its time back; the count of the request
    closed unfinished still says how long ago its head came (not shortened by what was given
    back)."""
    async with Harness(body_timeout=0.3) as h:
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of())[:-3])
        await until(lambda: h.lane.stats()["open_connections"] == 1)
        await asyncio.sleep(0.05)  # the head is read: the body's deadline runs
        start = time.monotonic()
        time.sleep(1.0)  # the loop stalls past it: 0.3 s more is given back
        await until(lambda: h.counted)
        waited = time.monotonic() - start
        assert waited >= 1.25  # the stall, then the time given back
        [(event, kind, seconds)] = h.counted
        assert event == COUNT_BODY_TIMEOUT and kind == COMPLETIONS
        assert seconds >= waited, (seconds, waited)
        writer.close()


async def test_an_idle_kept_alive_connection_is_closed():
    async with Harness(keepalive_timeout=0.2) as h:
        await h.instant_engine()
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a word


async def test_per_try_timeout_is_unavailable_and_retried():
    async with Harness(try_timeout=0.2) as h:
        slow = await h.scripted_engine(silent_engine)
        good = await h.instant_engine()
        h.turn = 0  # the first try goes to the silent engine

        def retry(token, status, outcome, tail):
            if outcome == UNAVAILABLE:
                return (good, engine_head(COMPLETIONS, h.decided[-1][1]), None, b"", "again")
            return None

        h.on_finish = retry
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert [f[2] for f in h.finished] == [UNAVAILABLE, OK]
        assert h.finished[0][0]["upstream"] == slow
        assert h.lane.stats()["timeouts"] == 1


async def test_an_answer_that_arrived_while_the_loop_was_stalled_is_not_timed_out():
    """The lane runs on the event loop. When the loop stalls past a try's deadline (a blocking
    call, a GC pause, a starved CPU), the engine's answer that arrived meanwhile waits in the
    lane's epoll batch with the timer tick, and the tick, ready since the stall began, comes
    first: judging deadlines before reading the batch's sockets cancelled a delivered answer."""
    import threading

    wire = answers(8)["completions"]
    got_request = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def engine() -> None:  # on its own thread: it answers while the loop is blocked
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            got_request.set()
            time.sleep(0.5)  # past the 0.3 s try deadline, inside the loop's stall
            conn.sendall(wire)
            conn.recv(1)  # until the lane closes or reuses the connection

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        async with Harness(try_timeout=0.3) as h:
            h.add_upstream(listener.getsockname()[1])
            reader, writer = await h.connect()
            writer.write(post(b"/v1/completions", body_of()))
            await until(got_request.is_set)
            time.sleep(1.0)  # the router's loop stalls; the engine answers at 0.5 s
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert [f[2] for f in h.finished] == [OK]
            assert h.lane.stats()["timeouts"] == 0
            writer.close()
    finally:
        listener.close()
        thread.join(5)


async def test_a_request_the_loop_stalled_before_sending_gets_its_try_time_back():
    """The loop stalls right after a request is decided, before the lane has written it to the
    engine (the connect's completion waits for the next poll). Its try deadline passes in the
    stall; the time is given back, so the instant engine's answer is relayed, not a 502."""
    async with Harness(try_timeout=0.3) as h:
        await h.instant_engine()
        round_robin = h.decide

        def decide_then_stall(kind, body, rid, auth):
            h.loop.call_soon(time.sleep, 1.0)  # runs once this poll returns
            h.decide_with = None
            return round_robin(kind, body, rid, auth)

        h.decide_with = decide_then_stall
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert [f[2] for f in h.finished] == [OK] and h.lane.stats()["timeouts"] == 0
        writer.close()


async def test_a_silent_engine_still_times_out_on_a_loop_that_keeps_stalling():
    """What a stall gives back is bounded: a loop blocked for 0.5 s every 50 ms would give a
    silent engine's 0.3 s try deadline its time back forever; after three stalls it expires."""
    stalling = True

    def stall() -> None:
        time.sleep(0.5)
        if stalling:
            h.loop.call_later(0.05, stall)

    async with Harness(try_timeout=0.3) as h:
        await h.scripted_engine(silent_engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        await until(lambda: len(h.decided) == 1)
        h.loop.call_soon(stall)
        try:
            head, _ = await read_answer(reader)
        finally:
            stalling = False
        assert head.startswith(b"HTTP/1.1 502"), head
        assert [f[2] for f in h.finished] == [UNAVAILABLE] and h.lane.stats()["timeouts"] == 1
        writer.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_engine_idle_timeout_mid_answer_is_outcome_4(stream):
    ctype = b"text/event-stream" if stream else b"application/json"

    async def stalls(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: 10\r\n\r\nabc" % ctype
        )
        await writer.drain()
        await reader.read()

    async with Harness(engine_idle_timeout=0.2) as h:
        await h.scripted_engine(stalls)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        if stream:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert await asyncio.wait_for(reader.read(), 5) == b"3\r\nabc\r\n"
        else:  # held whole: the client gets a clean 504 instead
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 504")
        assert h.finished[0][1:] == (200, TIMED_OUT, b"abc")


async def test_engine_idle_timeout_before_the_head_answers_504():
    async with Harness(engine_idle_timeout=0.2) as h:
        await h.scripted_engine(silent_engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 504") and h.finished[0][2] == TIMED_OUT


def sse_engine(events: int, interval: float, then: bytes = b"0\r\n\r\n"):
    """An engine that streams ``events`` SSE events (one chunk each, ``interval`` apart) to
    every request on a connection, then writes ``then`` (the chunked end, or bytes it breaks
    off after: it closes the connection when ``then`` is not the end)."""

    async def engine(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(headers_of(head)[b"content-length"]))
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for i in range(events):
                    event = b"data: %d\n\n" % i
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(interval)
                writer.write(then)
                await writer.drain()
                if then != b"0\r\n\r\n":
                    writer.transport.abort()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    return engine


def last_event_on(outcomes: tuple[int, ...], event: bytes):
    """A finish that ends a stream broken with one of ``outcomes`` with ``event``."""
    return lambda token, status, outcome, tail: (504, b"", event) if outcome in outcomes else None


async def test_request_timeout_bounds_every_try_of_a_request_together():
    # the first try's per-try timeout (0.25 s) sends it elsewhere; the request's 0.4 s end it
    # before the second try's own (0.5 s) would: outcome 5 and what finish answers
    async with Harness(request_timeout=0.4, try_timeout=0.25, engine_idle_timeout=10) as h:
        upstream = await h.scripted_engine(silent_engine)

        def on_finish(token, status, outcome, tail):
            if outcome == UNAVAILABLE:
                return (upstream, engine_head(COMPLETIONS, body_of()), None, b"", {"n": 2})
            return (504, b"Content-Type: application/json\r\n", b'{"late": true}')

        h.on_finish = on_finish
        reader, writer = await h.connect()
        started = time.monotonic()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        elapsed = time.monotonic() - started
        assert head.startswith(b"HTTP/1.1 504") and body == b'{"late": true}'
        assert [f[2] for f in h.finished] == [UNAVAILABLE, DEADLINE]
        assert 0.38 <= elapsed < 0.5 + 2.0  # the request's limit, before the second try's
        await until(lambda: h.lane.stats()["engine_connections"] == 0)  # both tries closed


async def test_request_timeout_without_a_finish_answer_is_the_lanes_504():
    async with Harness(request_timeout=0.2, engine_idle_timeout=10) as h:
        await h.scripted_engine(silent_engine)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 504") and b"upstream_timeout" in body
        assert h.finished[0][1:3] == (0, DEADLINE) and h.lane.stats()["timeouts"] == 1


async def test_a_streams_request_timeout_ends_at_its_first_bytes_and_its_duration_cuts_it():
    # request_timeout (0.3 s) stops at the stream's first bytes; max_stream_duration (0.8 s)
    # then ends the stream with finish's last event, framed: the connection serves on
    async with Harness(request_timeout=0.3, max_stream_duration=0.8) as h:
        await h.scripted_engine(sse_engine(events=100, interval=0.05))
        h.on_finish = last_event_on((DEADLINE,), b"data: cut\n\n")
        reader, writer = await h.connect()
        started = time.monotonic()
        writer.write(post(b"/v1/completions", body_of(stream=True)))
        head, body = await read_answer(reader)
        elapsed = time.monotonic() - started
        assert head.startswith(b"HTTP/1.1 200") and elapsed >= 0.78
        events = dechunk(body)
        assert events.startswith(b"data: 0\n\ndata: 1\n\n") and events.endswith(b"data: cut\n\n")
        assert body.endswith(b"\r\n0\r\n\r\n")
        assert h.finished[0][1:3] == (200, DEADLINE) and len(h.first_bytes) == 1
        writer.write(post(b"/v1/completions", body_of()))  # the stream ended cleanly
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and dechunk(body).endswith(b"data: cut\n\n")


@pytest.mark.parametrize("then", [b"", b"1", b"14\r\ndata:"], ids=["at-a-chunk", "size", "data"])
async def test_a_stream_broken_after_its_first_bytes_ends_with_finishs_last_event(then):
    # the lane adds finish's event and the chunked end (as the Python path's relay ends such a
    # stream) wherever the engine broke off: it chunks a stream itself, a read at a time, so
    # the client is at a chunk's end even when the engine stopped inside one of its chunks (the
    # data it had sent is relayed first, as the Python path relays it)
    async with Harness() as h:
        await h.scripted_engine(sse_engine(events=2, interval=0.05, then=then))
        h.on_finish = last_event_on((FAILED,), b"data: broke\n\n")
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of(stream=True)))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        body = b""
        while not body.endswith(b"\r\n0\r\n\r\n"):
            data = await asyncio.wait_for(reader.read(1024), 5)
            if not data:
                break  # closed
            body += data
        relayed = b"data:" if then.endswith(b"data:") else b""  # the broken chunk's data
        assert dechunk(body) == b"data: 0\n\ndata: 1\n\n" + relayed + b"data: broke\n\n"
        writer.write(post(b"/v1/completions", body_of()))  # the connection serves on
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        await until(lambda: h.finished)
        assert h.finished[0][1:3] == (200, FAILED)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\n",
    ],
    ids=["length", "chunked", "until-close"],
)
async def test_an_empty_5xx_is_a_failed_try_that_is_retried(answer):
    # as the Python path's engine client: an empty 5xx is a dead or restarting engine
    async def empty(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with Harness() as h:
        dead = await h.scripted_engine(empty)
        alive = await h.instant_engine()
        h.decide_with = lambda kind, body, rid, auth: (
            dead,
            engine_head(kind, body),
            None,
            b"",
            {"n": 1},
        )
        h.on_finish = lambda token, status, outcome, tail: (
            (alive, engine_head(COMPLETIONS, body_of()), None, b"", {"n": 2})
            if outcome == UNAVAILABLE
            else None
        )
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        # the retry's answer framed as its own engine framed it, not as the failed try's was
        assert b"content-length" in head.lower() and json.loads(body)["choices"]
        await until(lambda: len(h.finished) == 2)
        assert h.finished[0][1:] == (0, UNAVAILABLE, b"empty HTTP 503 answer")
        assert h.finished[1][1:3] == (200, OK) and h.lane.stats()["retried"] == 1


@pytest.mark.parametrize("then", ["close", "garble", "size-line", "silence"])
async def test_a_try_ending_after_its_head_before_its_body_is_retried(then):
    # the head waits for the body's first bytes, as the Python path's engine client waits for
    # them: a try that ends before them failed before its answer (retried), not a cut answer;
    # a chunk's size line is not body bytes (first_byte is the retry's)
    async def head_only(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        if then in ("garble", "size-line"):
            await asyncio.sleep(0.05)  # a read of its own
            writer.write(b"zz\r\n" if then == "garble" else b"1a\r\n")
            await writer.drain()
        if then != "silence":
            await asyncio.sleep(0.1)
            writer.transport.abort()
            return
        await reader.read()

    async with Harness(engine_idle_timeout=0.3) as h:
        broken = await h.scripted_engine(head_only)
        alive = await h.instant_engine()
        h.decide_with = lambda kind, body, rid, auth: (
            broken,
            engine_head(kind, body),
            None,
            b"",
            {"n": 1},
        )
        retry = body_of(stream=True)
        h.on_finish = lambda token, status, outcome, tail: (
            (alive, engine_head(COMPLETIONS, retry), retry, b"", {"n": 2})
            if outcome in (UNAVAILABLE, TIMED_OUT)
            else None
        )
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of(stream=True)))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"[DONE]" in body
        assert [token["n"] for token in h.first_bytes] == [2]
        await until(lambda: len(h.finished) == 2)
        status, outcome, tail = h.finished[0][1:]
        if then == "silence":  # the idle timer, before the answer: finish says it is a try's
            assert (status, outcome, tail) == (0, TIMED_OUT, b"")
        else:
            assert (status, outcome) == (0, UNAVAILABLE) and b"before its body" in tail
        assert h.finished[1][1:3] == (200, OK) and h.lane.stats()["retried"] == 1


async def test_a_5xx_with_a_body_is_relayed_once_its_body_starts():
    async def error(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)  # the head alone first: the lane waits for a body byte
        writer.write(b"oops!")
        await writer.drain()
        await reader.read()

    async with Harness() as h:
        await h.scripted_engine(error)
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 500") and body == b"oops!"
        await until(lambda: h.finished)
        assert h.finished[0][1:] == (500, OK, b"oops!")


# -- shutdown --------------------------------------------------------------------------------


async def test_shutdown_closes_idle_connections_and_lets_answers_finish():
    release = asyncio.Event()

    async def slow(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with Harness() as h:
        await h.scripted_engine(slow)
        idle_reader, idle_writer = await h.connect()
        busy_reader, busy_writer = await h.connect()
        busy_writer.write(post(b"/v1/completions", body_of()))
        await until(lambda: h.decided)
        await until(lambda: h.lane.stats()["open_connections"] == 2)
        h.lane.shutdown()
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""
        release.set()
        head, body = await read_answer(busy_reader)
        assert body == b"ok" and b"Connection: close" in head
        assert await asyncio.wait_for(busy_reader.read(), 5) == b""
        await until(lambda: h.lane.stats()["open_connections"] == 0)


async def scripted_answer(answer: bytes):
    """An engine that reads one request head and writes ``answer`` (then keeps the line)."""

    async def engine(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        await reader.read()

    return engine


async def answering(answer: bytes):
    """An engine that writes ``answer`` to every request on a connection (and closes it after
    an answer that says ``Connection: close``)."""

    async def engine(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(headers_of(head)[b"content-length"]))
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    return engine


async def test_a_chunked_answer_with_a_content_length_loses_the_length():
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    async with Harness() as h:
        await h.scripted_engine(await scripted_answer(answer))
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert b"content-length" not in head.lower() and body == b"5\r\nhello\r\n0\r\n\r\n"


async def test_the_client_gets_the_engines_content_type_and_the_deciders_headers_only():
    # as the Python path (streaming.response_headers): the engine's Content-Type, the
    # decider's headers (its X-Request-Id, not the engine's echo) and the framing; the engine's
    # Date, Server and other fields stay behind
    answer = (
        b"HTTP/1.1 200 OK\r\nDate: Wed, 02 Dec 2026 16:00:00 GMT\r\nServer: uvicorn\r\n"
        b"X-Request-Id: engine-echo\r\nX-Engine: e1\r\nContent-Type: application/json\r\n"
        b"Cache-Control: private\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok"
    )
    async with Harness() as h:
        upstream = await h.scripted_engine(await scripted_answer(answer))
        h.decide_with = lambda kind, body, rid, auth: (
            upstream,
            engine_head(kind, body),
            None,
            b"x-request-id: kvplug-1\r\n",
            {"n": 1},
        )
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert without_date(head) == (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-request-id: kvplug-1\r\n"
            b"Content-Length: 2\r\n\r\n"
        )
        assert body == b"ok"


@pytest.mark.parametrize(
    "answer, framing",
    [
        (b"HTTP/1.1 200 OK\r\nServer: e\r\nContent-Length: 2\r\n\r\nok", b"Content-Length: 2"),
        (
            b"HTTP/1.1 200 OK\r\nServer: e\r\nConnection: close\r\n\r\nok",
            b"Transfer-Encoding: chunked",
        ),
        (
            b"HTTP/1.1 200 OK\r\nServer: e\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n",
            b"Transfer-Encoding: chunked",
        ),
    ],
)
async def test_an_answer_without_a_content_type_says_json_and_keeps_its_framing(answer, framing):
    async with Harness() as h:
        await h.scripted_engine(await answering(answer))
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, body = await read_answer(reader)
        assert without_date(head) == (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Lane-Test: yes\r\n%s\r\n\r\n"
            % framing
        )
        assert (dechunk(body) if b"chunked" in framing else body) == b"ok"
        writer.write(post(b"/v1/completions", body_of()))  # the connection still serves
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200 OK")


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\nhello",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
    ],
)
async def test_an_answer_head_the_lane_cannot_frame_is_a_502(answer):
    async with Harness() as h:
        await h.scripted_engine(await scripted_answer(answer))
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 502") and h.finished[0][2] == FAILED


async def test_a_garbled_chunk_ends_the_answer_as_a_failure():
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"
    async with Harness() as h:
        await h.scripted_engine(await scripted_answer(answer))
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head, _ = await read_answer(reader)  # nothing was sent yet: a clean 502
        assert head.startswith(b"HTTP/1.1 502") and h.finished[0][1:3] == (200, FAILED)


async def test_a_bodiless_answer_and_an_interim_100_are_relayed():
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nX-E: 1\r\n\r\n"
    async with Harness() as h:
        await h.scripted_engine(await scripted_answer(answer))
        reader, writer = await h.connect()
        writer.write(post(b"/v1/completions", body_of()))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\n")
        assert b"X-E" not in head
        await until(lambda: h.finished)
        assert h.finished[0][1:3] == (204, OK)


# -- kvplug serve --data-path native ---------------------------------------------------------


@pytest.mark.parametrize("data_path", [["--data-path", "native"], []])
def test_kvplug_serve_data_path_native_answers_through_the_cli(tmp_path, data_path):
    """``--data-path native``, and the default (``auto``) where the lane is built."""
    import subprocess
    import urllib.request

    from kvplug.testing import free_port, serve_command, stop_process, wait_ready

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    engine_port, port = free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, str(bench / "instant_engine.py"), str(engine_port), "--tokens", "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "serve.log"
    serve = None
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
        cmd = serve_command(
            port,
            *data_path,
            "--worker-engine",
            "openai",
            "--served-model-name",
            "stub-model",
            "--worker",
            f"e0=http://localhost:{engine_port}",  # a name: resolved off the loop at start
            "--kv-block-size",
            "16",
        )
        with log.open("w") as out:
            serve = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc=serve, log=log)  # a GET: handed to the Python path

        def exchange(target_port: int, request: bytes) -> tuple[bytes, bytes]:
            with socket.create_connection(("127.0.0.1", target_port), timeout=10) as sock:
                sock.sendall(request)
                data = b""
                while True:
                    head, _, body = data.partition(b"\r\n\r\n")
                    if _ and b"chunked" in head.lower() and body.endswith(b"0\r\n\r\n"):
                        return head, body
                    length = re.search(rb"(?i)content-length: *(\d+)", head)
                    if _ and length and len(body) >= int(length.group(1)):
                        return head, body
                    chunk = sock.recv(65536)
                    assert chunk, data
                    data += chunk

        for stream in (False, True):
            body = json.dumps(
                {
                    "model": "stub-model",
                    "prompt": list(range(40)),
                    "max_tokens": 3,
                    "stream": stream,
                }
            ).encode()
            head, got = exchange(port, post(b"/v1/completions", body))
            _, want = exchange(engine_port, post(b"/v1/completions", body))
            assert head.startswith(b"HTTP/1.1 200"), head
            assert got == want  # the engine's bytes (chunked framing and all)
            assert b"x-kvplug-decision-id" in head.lower()
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        served = re.search(r'kvplug_router_stat\{stat="native_lane\.served"\} (\S+)', metrics)
        assert served is not None and float(served.group(1)) >= 2, metrics[-2000:]
    finally:
        stop_process(serve, timeout=15)
        stop_process(engine, timeout=5)
    assert serve.returncode == 0, log.read_text()[-3000:]
    assert "(1 workers, native data path)" in log.read_text()


def test_data_path_auto_is_native_where_the_lane_is_built(monkeypatch, caplog):
    from kvplug.errors import ConfigError
    from kvplug.frontend import native_lane
    from kvplug.frontend.server import uses_native_path

    assert uses_native_path("auto") and uses_native_path("native")
    assert not uses_native_path("python")
    with pytest.raises(ConfigError, match="auto, native or python"):
        uses_native_path("fast")
    monkeypatch.setattr(native_lane, "available", lambda: False)  # as on a platform without it
    assert not uses_native_path("auto") and "not built here" in caplog.text
    assert uses_native_path("native")  # insists: _start_native's ConfigError says why


# -- the head rule, against the Python lane's ------------------------------------------------

_NAMES = st.sampled_from(
    [
        b"Host",
        b"Content-Length",
        b"content-length",
        b"Connection",
        b"X-Request-Id",
        b"Authorization",
        b"Transfer-Encoding",
        b"Expect",
        b"Upgrade",
        b"Content-Encoding",
        b"HTTP2-Settings",
        b"X-Kvplug-Worker",
        b"x-kvplug-dp-rank",
        b"X-Dynamo-Dp-Rank",
        b"x-worker-instance-id",
        b"X-Prefill-Instance-Id",
        b"Bad Name",
        b"",
        b"X\xc3\xa9",
    ]
    + [b"X-A", b"Host", b"Connection", b"X-Request-Id", b"Authorization"] * 4
)
_VALUES = st.one_of(
    st.sampled_from(
        [
            b"12",
            b" 12 ",
            b"012",
            b"1" * 16,
            b"-1",
            b"1e3",
            b"close",
            b"Close",
            b"keep-alive",
            b"upgrade",
            b"chunked",
            b"",
            b"\tx\t",
            b"a\rb",
            b"\xff",
        ]
    ),
    st.sampled_from([b"x", b"Bearer k", b"r-1", b" padded\t", b"keep-alive"]),
    st.binary(max_size=6),
)
_SEPS = st.sampled_from([b": "] * 8 + [b":", b" :", b""])
_LINES = st.lists(st.tuples(_NAMES, _SEPS, _VALUES), max_size=5)
_REQUEST_LINES = st.sampled_from(
    [b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1"] * 6
    + [
        b"POST /v1/completions HTTP/1.0",
        b"GET /v1/completions HTTP/1.1",
        b"POST /v1/completions?x HTTP/1.1",
        b"POST  /v1/completions HTTP/1.1",
        b"post /v1/completions HTTP/1.1",
        b"POST /v1/models HTTP/1.1",
    ]
)
_LENGTH = st.sampled_from(
    [
        b"Content-Length: 12",
        b"content-length:0",
        b"Content-Length: 1000",
        b"Content-Length: 1001",
        None,
    ]
)


class _Rule:
    handlers = {b"/v1/completions": None, b"/v1/chat/completions": None}
    max_body_bytes = 1000


@settings(max_examples=3000, deadline=None)
@given(
    _REQUEST_LINES,
    _LINES,
    _LENGTH,
    st.integers(0, 5),
    st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r"]),
)
def test_the_head_rule_is_the_python_lanes(request_line, lines, length, at, eol):
    parts = [n + sep + v for n, sep, v in lines]
    if length is not None:
        parts.insert(min(at, len(parts)), length)
    head = request_line + b"".join(b"\r\n" + part for part in parts)
    if eol != b"\r\n":
        head = head.replace(b"\r\n", eol)
    native = head_qualifies(head, _Rule.max_body_bytes, HINT_HEADERS)
    python = _parse_head(head, _Rule)
    hint = any(
        n.lower().startswith(b"x-kvplug-") or n.lower().decode(errors="replace") in HINT_HEADERS
        for n, sep, v in lines
        if sep
    )
    if native is None:
        assert python is None or hint, head  # the lane hands hints off; Python reads them
        return
    assert python is not None, head
    path, headers, length, keep_alive = python
    kind, c_length, c_keep_alive, rid, auth, fields = native
    assert (kind, c_length, c_keep_alive) == (
        [b"/v1/completions", b"/v1/chat/completions"].index(path.encode()),
        length,
        keep_alive,
    )
    assert rid == (headers["X-Request-Id"].encode() if "X-Request-Id" in headers else None)
    assert auth == (headers["Authorization"].encode() if "Authorization" in headers else None)
    # the fields come along exactly when the engine is to get one of them as the client sent it
    own = {"host", "content-length", "content-type", "connection", "x-request-id", "authorization"}
    forwarded = any(name.lower() not in own for name in headers)
    assert fields == (head.split(b"\r\n", 1)[1] if forwarded else None)
