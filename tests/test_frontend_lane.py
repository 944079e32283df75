"""kvplug's own HTTP lane (kvplug/frontend/lane.py): which requests it serves, which connections
it hands to aiohttp, and that both answer the same bytes. It serves what the native data path
hands over (the default) and everything with ``--data-path python``, as here: these pin the
lane's own decisions (the native lane's: tests/test_native_glue_lane.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from test_frontend_harness import MODEL, eventually, serving

from kvplug.frontend.app import ServeSettings

pytestmark = pytest.mark.timeout(60)

SETTINGS = ServeSettings(health_interval=0.2, health_timeout=5.0, data_path="python")


def lane_of(h):
    lane = h.running._listeners[0].lane
    assert lane is not None
    return lane


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def completion(prompt: str = "hello lane", stream: bool = False, **extra) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream, **extra}
    ).encode()


async def exchange(url: str, data: bytes, answers: int = 1, parts: list[bytes] | None = None):
    """Send ``data`` (then each of ``parts`` after a pause) on one connection; read until
    ``answers`` whole HTTP answers arrived or the server closed. Returns (answers, closed)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    for part in parts or ():
        await asyncio.sleep(0.05)
        writer.write(part)
    got: list[tuple[int, dict, bytes]] = []
    closed = False
    try:
        while len(got) < answers:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode().split("\r\n")
            status = int(lines[0].split()[1])
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:  # chunked
                body = b""
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    body += chunk[:-2]
            got.append((status, headers, body))
        closed = await asyncio.wait_for(reader.read(1), 2) == b""
    except (asyncio.TimeoutError, asyncio.IncompleteReadError):
        closed = reader.at_eof()
    finally:
        writer.close()
    return got, closed


async def test_routed_requests_are_served_by_the_lane_with_the_same_answer():
    async with serving(2, settings=SETTINGS) as h:
        lane = lane_of(h)
        (answer,), closed = await exchange(h.url, post("/v1/completions", completion()))
        status, headers, body = answer
        assert status == 200 and not closed
        assert headers["x-kvplug-worker"] in ("w0", "w1") and "x-kvplug-decision-id" in headers
        assert json.loads(body)["choices"][0]["text"]
        chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        (answer,), _ = await exchange(h.url, post("/v1/chat/completions", chat.encode()))
        assert answer[0] == 200 and json.loads(answer[2])["choices"][0]["message"]
        assert (lane.served, lane.handed_off) == (2, 0)
        async with h.session.get(h.url + "/metrics") as resp:  # a GET: handed off
            text = await resp.text()
        assert 'kvplug_router_stat{stat="http_lane.served"} 2.0' in text
        assert 'kvplug_router_stat{stat="http_lane.handed_off"} 1.0' in text
        # the same request through aiohttp (a header the lane leaves to it) answers alike
        (via_aiohttp,), _ = await exchange(
            h.url, post("/v1/completions", completion(), b"Expect: x-nothing\r\n")
        )
        assert lane.handed_off == 2
        assert via_aiohttp[0] == 417 or json.loads(via_aiohttp[2]).keys() == json.loads(body).keys()
        h.assert_idle()


async def test_a_streamed_answer_is_relayed_byte_for_byte_through_the_lane():
    async with serving(1, settings=SETTINGS) as h:
        engine = h.engines["w0"]
        direct = await h.session.post(
            engine.url + "/v1/completions", data=completion(stream=True, seed=3)
        )
        expected = await direct.read()
        (answer,), _ = await exchange(h.url, post("/v1/completions", completion(stream=True)))
        status, headers, body = answer
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers.get("transfer-encoding") == "chunked"
        assert body.count(b"data: ") == expected.count(b"data: ") and body.endswith(
            b"data: [DONE]\n\n"
        )
        assert lane_of(h).served == 1
        h.assert_idle()


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (post("/v1/completions?x=1", completion()), 200),  # a query string
        (post("/v1/completions", completion()).replace(b"HTTP/1.1", b"HTTP/1.0"), 200),
        (post("/v1/completions", completion(), b"Content-Length: 3\r\n"), 400),  # two lengths
        (post("/v1/completions", completion(), b"Content-Encoding: br2\r\n"), 415),
        (post("/v1/completions", completion()).replace(b"\r\n", b"\n", 2), 400),  # bare LF
        (post("/v1/completions", completion(), b"X-Caf\xc3\xa9: 1\r\n"), 400),  # non-ASCII
        (post("/v1/completions", completion(), b" folded\r\n"), 400),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(completion())
            + completion()
            + b"\r\n0\r\n\r\n",
            200,
        ),
    ],
)
async def test_anything_the_lane_does_not_plainly_take_is_handed_to_aiohttp(request_bytes, status):
    async with serving(1, settings=SETTINGS) as h:
        lane = lane_of(h)
        (answer,), _ = await exchange(h.url, request_bytes)
        assert answer[0] == status, answer
        assert (lane.served, lane.handed_off) == (0, 1)
        h.assert_idle()


async def test_pipelined_requests_are_answered_in_order_then_handed_off():
    async with serving(2, settings=SETTINGS) as h:
        lane = lane_of(h)
        data = (
            post("/v1/completions", completion("first"))
            + post("/v1/completions", completion("second"), b"x-kvplug-worker-id: w1\r\n")
            + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        got, _ = await exchange(h.url, data, answers=3)
        assert [a[0] for a in got] == [200, 200, 200]
        assert got[1][1]["x-kvplug-worker"] == "w1"  # answers in request order
        assert json.loads(got[2][2])  # /health, served by aiohttp after the hand-off
        assert (lane.served, lane.handed_off) == (2, 1)
        h.assert_idle()


async def test_a_body_that_arrives_in_pieces_is_waited_for():
    async with serving(1, settings=SETTINGS) as h:
        whole = post("/v1/completions", completion("pieces"))
        head_end = whole.index(b"\r\n\r\n") + 4
        got, _ = await exchange(
            h.url,
            whole[: head_end - 3],
            parts=[whole[head_end - 3 : head_end + 5], whole[head_end + 5 :]],
        )
        assert got[0][0] == 200 and lane_of(h).served == 1


async def test_connection_close_and_the_keep_alive_timeout_close_the_connection():
    settings = dataclasses.replace(SETTINGS, client_header_timeout=0.5)
    async with serving(1, settings=settings) as h:
        got, closed = await exchange(
            h.url, post("/v1/completions", completion(), b"Connection: close\r\n")
        )
        assert got[0][0] == 200 and closed
        host, port = h.url.split("//")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", completion()))
        t0 = time.monotonic()
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data.startswith(b"HTTP/1.1 200")
        while data:  # idle after the answer: closed at the keep-alive (head) timeout
            data = await asyncio.wait_for(reader.read(65536), 10)
        assert time.monotonic() - t0 < 5
        writer.close()
        assert lane_of(h).served == 2


async def test_slow_heads_and_bodies_get_the_same_408s():
    settings = dataclasses.replace(SETTINGS, client_header_timeout=0.5, client_body_timeout=0.5)
    async with serving(1, settings=settings) as h:
        got, closed = await exchange(h.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert got[0][0] == 408 and json.loads(got[0][2])["error"]["code"] == "header_timeout"
        body = completion()
        got, closed = await exchange(h.url, post("/v1/completions", body)[: -len(body) // 2])
        assert got[0][0] == 408 and closed
        assert json.loads(got[0][2])["error"]["code"] == "body_timeout"
        assert h.running.head_timeouts == 1 and lane_of(h).served == 1
        h.assert_idle()


async def test_a_client_that_hangs_up_mid_request_releases_its_load():
    async with serving(1, settings=SETTINGS, stub_options={"token_delay": 0.2}) as h:
        host, port = h.url.split("//")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", completion(max_tokens=200)))
        await eventually(lambda: h.router.stats()["active_requests"] == 1, what="routed")
        writer.close()
        await eventually(lambda: h.router.stats()["active_requests"] == 0, what="released")
        await eventually(lambda: h.frontend.fleet.workers["w0"].inflight == 0, what="inflight")
        h.assert_idle()


async def test_the_api_key_is_checked_in_the_lane():
    settings = dataclasses.replace(SETTINGS, api_key="sekret")
    async with serving(1, settings=settings) as h:
        (answer,), _ = await exchange(h.url, post("/v1/completions", completion()))
        assert answer[0] == 401 and answer[1]["www-authenticate"] == "Bearer"
        (answer,), _ = await exchange(
            h.url, post("/v1/completions", completion(), b"Authorization: Bearer sekret\r\n")
        )
        assert answer[0] == 200
        assert (lane_of(h).served, lane_of(h).handed_off) == (2, 0)


async def test_the_lane_can_be_turned_off():
    async with serving(1, settings=dataclasses.replace(SETTINGS, http_lane=False)) as h:
        assert h.running._listeners[0].lane is None
        (answer,), _ = await exchange(h.url, post("/v1/completions", completion()))
        assert answer[0] == 200


async def test_the_lane_answers_with_the_status_and_headers_aiohttp_would_send():
    """The lane writes whole answers itself (``_plain_answer``): the same status line and header
    names as aiohttp's writer, for a success and for an error, kept alive or closed."""
    requests = [
        post("/v1/completions", completion()),
        post("/v1/completions", b'{"model": "nope", "prompt": "x"}'),
        post("/v1/completions", b"{not json"),
        post("/v1/completions", completion(), b"Connection: close\r\n"),
    ]
    answers = {}
    for lane_on in (True, False):
        settings = dataclasses.replace(SETTINGS, http_lane=lane_on)
        async with serving(1, settings=settings) as h:
            answers[lane_on] = [(await exchange(h.url, r))[0][0] for r in requests]
            assert (h.running._listeners[0].lane is not None) == lane_on
    for ours, theirs in zip(answers[True], answers[False], strict=True):
        assert ours[0] == theirs[0]
        assert sorted(ours[1]) == sorted(theirs[1]), (ours[1], theirs[1])
        for name in ("content-type", "content-length", "server", "connection"):
            if name != "content-length" or ours[0] != 200:  # ids differ in length
                assert ours[1].get(name) == theirs[1].get(name), name
        if ours[0] != 200:
            assert ours[2] == theirs[2]


def test_serve_has_a_switch_for_the_lane():
    import argparse

    from kvplug.frontend.cli import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert settings_from_args(parser.parse_args(["--worker", "w=http://x:1"])).http_lane
    args = parser.parse_args(["--worker", "w=http://x:1", "--no-http-lane"])
    assert settings_from_args(args).http_lane is False


async def test_a_connection_handed_off_between_requests_leaves_no_task_behind():
    """A kept-alive connection served by the lane, then sent a request the lane hands off:
    the connection's task, waiting for its next request, ends (a pending task left behind
    was destroyed by the garbage collector with an error logged, found by fuzz_http)."""
    async with serving(1, settings=SETTINGS) as h:
        lane = lane_of(h)
        host, port = h.url.split("//")[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", completion()))
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(
            b"HTTP/1.1 200"
        )
        await eventually(lambda: lane.workers == 1, what="the connection's task waits")
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await eventually(lambda: lane.handed_off == 1, what="handed off")
        await eventually(lambda: lane.workers == 0, what="its task ended")
        writer.close()
        # and a connection that simply closes while its task waits
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", completion()))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await eventually(lambda: lane.workers == 1, what="the second connection's task waits")
        writer.close()
        await eventually(lambda: lane.workers == 0, what="its task ended with the connection")


async def test_shutdown_closes_idle_connections_and_lets_a_request_finish():
    """As aiohttp's server shuts down: an idle kept-alive connection closes at once, a request
    being served finishes and gets its answer, then its connection closes."""
    async with serving(1, settings=SETTINGS, stub_options={"token_delay": 0.05}) as h:
        lane = lane_of(h)
        host, port = h.url.split("//")[1].rsplit(":", 1)
        idle_r, idle_w = await asyncio.open_connection(host, int(port))
        idle_w.write(post("/v1/completions", completion()))
        await asyncio.wait_for(idle_r.readuntil(b"\r\n\r\n"), 10)
        busy_r, busy_w = await asyncio.open_connection(host, int(port))
        busy_w.write(post("/v1/completions", completion(max_tokens=20)))
        await eventually(lambda: h.router.stats()["active_requests"] == 1, what="in flight")
        for listeners in h.running._listeners:
            listeners.close()
        shutdown = asyncio.ensure_future(h.running._listeners[0].shutdown_lane())
        answer = await asyncio.wait_for(busy_r.read(), 30)  # whole answer, then closed
        assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" in answer
        await asyncio.wait_for(idle_r.read(), 10)  # returns once the server closed it
        await asyncio.wait_for(shutdown, 30)
        assert not lane.connections and lane.workers == 0
        idle_w.close()
        busy_w.close()
