"""``kvplug serve --data-path native`` end to end: the compiled lane (kvplug._lane) with
kvplug's control plane (kvplug/frontend/native_glue.py) in front of stub engines, over real
HTTP. What the lane serves must look to clients, traces, ``/metrics`` and the router as the
Python path's answers do; what it hands off is the Python path's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
import time

import pytest

pytest.importorskip("kvplug._lane")

from test_frontend_harness import MODEL, eventually, prompt, serving  # noqa: E402
from test_frontend_lane import completion, exchange, post  # noqa: E402

from kvplug.frontend.app import ServeSettings  # noqa: E402

pytestmark = pytest.mark.timeout(60)

NATIVE = ServeSettings(health_interval=0.2, health_timeout=5.0, data_path="native")


def native(**changes) -> ServeSettings:
    return dataclasses.replace(NATIVE, **changes)


def _served(h) -> int:
    return h.frontend.native_lane.stats()["served"]


async def test_token_id_completions_are_served_by_the_lane_as_by_python():
    async with serving(2, settings=native()) as h:
        for stream in (False, True):
            rid = f"lane-{stream}"
            before = _served(h)
            resp, raw = await h.complete(
                prompt(4, 1),
                stream=stream,
                headers={"X-Request-Id": rid},
                stream_options={"include_usage": True},
            )
            assert resp.status == 200 and _served(h) == before + 1
            worker = resp.headers["x-kvplug-worker"]
            assert raw == h.engines[worker].sent[rid]  # the engine's bytes, unchanged
            # one X-Request-Id, kvplug's (the engine's echo of it is not repeated)
            assert resp.headers.getall("X-Request-Id") == [rid]
            # a stream is not to be cached on the way, as the Python path's relay says
            assert resp.headers.getall("Cache-Control", []) == (["no-cache"] if stream else [])
            # the API's trace (not fetched here: a GET hands this keep-alive connection off)
            trace = h.frontend.decisions.get(resp.headers["x-kvplug-decision-id"]).to_json()
            assert trace["outcome"] == "ok" and trace["status"] == 200
            assert trace["output_tokens"] == 4 and trace["timings"]["ttft_s"] > 0
            assert trace["tokens"]["source"] == "request" and trace["worker_id"] == worker
            h.assert_idle()
        text = h.frontend.metrics.render().decode()
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
        assert "kvplug_time_to_first_token_seconds_count 1.0" in text


async def test_what_the_glue_declines_is_the_python_paths():
    async with serving(1, settings=native(api_key="key")) as h:
        auth = {"Authorization": "Bearer key"}
        resp, raw = await h.complete("a text prompt", headers=auth)
        assert resp.status == 200 and h.frontend.native_lane.stats()["handed_off"] == 1
        resp, raw = await h.complete(prompt(2, 2), headers={"Authorization": "Bearer nope"})
        assert resp.status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        resp, raw = await h.complete(prompt(2, 2), headers=auth)
        assert resp.status == 200
        assert h.engines["w0"].requests[-1]["headers"].get("Authorization") is None
        resp, raw = await h.post("/v1/completions", {"model": MODEL, "prompt": [-1]}, auth)
        assert resp.status == 400 and json.loads(raw)["error"]["code"] == "invalid_prompt"
        h.assert_idle()


async def test_a_dead_engine_is_retried_on_the_other_then_a_502():
    async with serving(2, settings=native()) as h:
        h.engines["w0"].fail = "reset"
        for seed in range(4):  # some land on w0 first: retried on w1
            resp, raw = await h.complete(prompt(2, 10 + seed))
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1"
            h.assert_idle()
        stats = h.frontend.native_lane.stats()
        assert stats["served"] == 4 and stats["retried"] >= 1 and stats["handed_off"] == 0
        h.engines["w1"].fail = "reset"
        h.frontend.fleet.mark_healthy("w0", source="request")
        h.frontend.fleet.mark_healthy("w1", source="request")
        resp, raw = await h.complete(prompt(2, 20))
        assert resp.status == 502 and _served(h) == 5
        error = json.loads(raw)["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "upstream_error"
        assert "(retried once on another worker)" in error["message"]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["outcome"] == "unavailable" and len(trace["related_decisions"]) == 1
        h.assert_idle()


async def test_a_client_hanging_up_mid_stream_releases_the_load():
    async with serving(1, settings=native(), stub_options={"token_delay": 0.05}) as h:
        async with h.session.post(
            h.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt(2, 6), "stream": True, "max_tokens": 200},
        ) as resp:
            assert resp.status == 200
            await resp.content.readany()
            decision = resp.headers["x-kvplug-decision-id"]
            assert _served(h) == 1
        await eventually(lambda: h.frontend.decisions.get(decision).outcome != "in_flight")
        assert h.frontend.decisions.get(decision).outcome == "client_disconnected"
        h.assert_idle()
        await eventually(lambda: h.engines["w0"].cancelled == 1, what="the engine aborted")
        await asyncio.sleep(0)


async def test_dynamo_hint_headers_steer_as_on_the_python_path():
    # the lane hands off every hint header hints.py reads; the Python path then pins
    async with serving(2, settings=native()) as h:  # client routing hints trusted
        for seed in range(6):
            resp, _ = await h.complete(prompt(2, 30 + seed), headers={"x-worker-instance-id": "w1"})
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1"
        h.assert_idle()


async def test_text_and_chat_with_a_local_tokenizer_are_served_by_the_lane(tmp_path):
    from test_frontend_units import make_tokenizer_dir

    from kvplug.frontend.tokens import LocalTokenizer

    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    async with serving(1, settings=native(), tokenizer=tok) as h:
        resp, raw = await h.complete("hello world", headers={"X-Request-Id": "t"})
        assert resp.status == 200 and raw == h.engines["w0"].sent["t"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp, raw = await h.post("/v1/chat/completions", chat, {"X-Request-Id": "c"})
        assert resp.status == 200 and raw == h.engines["w0"].sent["c"]
        assert _served(h) == 2 and h.frontend.native_lane.stats()["handed_off"] == 0
        trace = h.frontend.decisions.get(resp.headers["x-kvplug-decision-id"]).to_json()
        assert trace["tokens"] == {"source": "tokenizer", "count": 6, "note": None}
        assert trace["path"] == "/v1/chat/completions" and trace["outcome"] == "ok"
        h.assert_idle()


async def test_the_engine_gets_the_clients_other_fields_as_from_the_python_path():
    # a head with fields beyond those the lane reads itself reaches the glue with them, which
    # forwards them by Frontend.hop_headers' rules (hop-by-hop ones dropped)
    sent = {
        "X-Request-Id": "fields-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "X-Client-Tag": "kept",
        "Keep-Alive": "timeout=5",
        "Authorization": "Bearer client",
    }
    seen = {}
    for data_path in ("python", "native"):
        async with serving(1, settings=native(data_path=data_path)) as h:
            resp, _ = await h.complete(prompt(2, 40), headers=sent)
            assert resp.status == 200
            assert (h.frontend.native_lane is not None) == (data_path == "native")
            if data_path == "native":
                assert _served(h) == 1
            headers = h.engines["w0"].requests[-1]["headers"]
            # each run's engine listens on a port of its own: its Host differs
            seen[data_path] = {k.lower(): v for k, v in headers.items() if k.lower() != "host"}
            h.assert_idle()
    assert seen["native"] == seen["python"]
    assert seen["native"]["traceparent"] == sent["traceparent"]
    assert seen["native"]["x-client-tag"] == "kept"
    assert seen["native"]["authorization"] == "Bearer client"
    assert "keep-alive" not in seen["native"]


def _trace_of(h, resp) -> dict:
    """The trace of an answer's decision, from the store (a GET would hand the kept-alive
    connection to the Python path)."""
    return h.frontend.decisions.get(resp.headers["x-kvplug-decision-id"]).to_json()


async def _on_both_paths(settings_changes: dict, stub: dict, ask, fail: str | None = None):
    """``ask(h)`` on the Python path and on the lane, each with one stub engine (failing as
    ``fail`` says); the lane's run must be served by the lane. {data path: what ask returned}."""
    seen = {}
    for data_path in ("python", "native"):
        s = native(data_path=data_path, **settings_changes)
        async with serving(1, settings=s, stub_options=stub) as h:
            h.engines["w0"].fail = fail
            seen[data_path] = await ask(h)
            if data_path == "native":
                stats = h.frontend.native_lane.stats()
                assert stats["served"] >= 1 and stats["handed_off"] == 0, stats
            await eventually(lambda: h.frontend.fleet.workers["w0"].inflight == 0)
            h.assert_idle()
    return seen


async def test_the_answer_headers_are_the_python_paths():
    async def ask(h):
        names = {}
        for stream in (False, True):
            resp, _ = await h.complete(prompt(2, 50 + stream), stream=stream)
            assert resp.status == 200
            names[stream] = sorted(k.lower() for k in resp.headers)
        return names

    seen = await _on_both_paths({}, {}, ask)
    # the Python server's own Server field (aiohttp's, not the engine's) the lane does not write;
    # every other field is the same (a Date of its own, not the engine's, on both)
    own = {"server"}
    assert seen["native"] == {k: [n for n in v if n not in own] for k, v in seen["python"].items()}
    assert "content-type" in seen["native"][False] and "cache-control" in seen["native"][True]


async def test_request_timeout_is_the_python_paths_504_on_the_lane():
    async def ask(h):
        got = []
        for stream in (False, True):
            started = time.monotonic()
            resp, raw = await h.complete(prompt(2, 60 + stream), stream=stream)
            in_time = time.monotonic() - started < 3.0  # the 0.3 s, not another timer
            trace = _trace_of(h, resp)
            got.append((resp.status, json.loads(raw), trace["outcome"], trace["status"], in_time))
        return got

    seen = await _on_both_paths(
        {"request_timeout": 0.3, "idle_timeout": 30.0}, {}, ask, fail="hang"
    )
    assert seen["native"] == seen["python"]
    assert all(answer[4] for answer in seen["native"])
    assert seen["native"][0][:1] == (504,) and seen["native"][0][1]["error"]["code"] == (
        "request_timeout"
    )


async def test_max_stream_duration_ends_a_lane_stream_as_the_python_path_does():
    async def ask(h):
        resp, raw = await h.complete(prompt(2, 70), stream=True, max_tokens=200)
        assert resp.status == 200
        trace = _trace_of(h, resp)
        events = raw.split(b"\n\n")
        return events[-2], trace["outcome"], trace["error"]

    seen = await _on_both_paths(
        {"max_stream_duration": 0.4, "request_timeout": 0.2}, {"token_delay": 0.02}, ask
    )
    assert seen["native"] == seen["python"]
    last, outcome, _ = seen["native"]
    assert outcome == "stream_timeout"
    assert json.loads(last.removeprefix(b"data: "))["error"]["type"] == "timeout_error"


async def test_a_stream_broken_mid_answer_ends_with_the_python_paths_error_event():
    async def ask(h):
        resp, raw = await h.complete(prompt(2, 80), stream=True, max_tokens=20)
        assert resp.status == 200
        error = json.loads(raw.split(b"\n\n")[-2].removeprefix(b"data: "))["error"]
        return (
            error["type"],
            error["code"],
            error["message"].split(": ")[0],
            _trace_of(h, resp)["outcome"],
        )

    seen = await _on_both_paths({}, {}, ask, fail="midstream")
    # the reason after "the engine failed mid-stream: " is each engine client's own words
    assert seen["native"] == seen["python"]
    assert seen["native"] == (
        "upstream_error",
        502,
        "the engine failed mid-stream",
        "upstream_failed_mid_stream",
    )


async def test_an_empty_5xx_is_retried_on_the_other_worker_as_on_the_python_path():
    seen = {}
    for data_path in ("python", "native"):
        async with serving(2, settings=native(data_path=data_path)) as h:
            h.engines["w0"].fail = "empty503"
            got = []
            for seed in range(4):  # some land on w0 first: retried on w1
                resp, raw = await h.complete(prompt(2, 90 + seed))
                trace = _trace_of(h, resp)
                related = [
                    h.frontend.decisions.get(d).to_json() for d in trace["related_decisions"]
                ]
                got.append(
                    (
                        resp.status,
                        resp.headers["x-kvplug-worker"],
                        [(r["worker_id"], r["outcome"], r["error"]) for r in related],
                    )
                )
            if data_path == "native":
                assert _served(h) == 4 and h.frontend.native_lane.stats()["retried"] >= 1
            h.assert_idle()
            seen[data_path] = got
    assert seen["native"] == seen["python"]
    assert all(status == 200 and worker == "w1" for status, worker, _ in seen["native"])
    assert any(related for _, _, related in seen["native"])


# -- a client that fails before its request is whole: closed by the lane, counted by Python ------

_CLIENT_COUNTS = (
    "kvplug_requests_total{",
    "kvplug_rejected_requests_total{",
    "kvplug_request_duration_seconds_count{",
    "kvplug_inflight_requests ",
)


def _client_counts(h) -> list[str]:
    """The ``/metrics`` lines a client's failure moves (of its duration, the count)."""
    text = h.frontend.metrics.render().decode()
    return sorted(line for line in text.splitlines() if line.startswith(_CLIENT_COUNTS))


async def _send(h, data: bytes, then: str = "read") -> bytes:
    """Send ``data`` on a new connection, then ``read`` until the server closes (what was read)
    or hang up: ``close`` (a FIN) or ``reset`` (a RST)."""
    host, port = h.url.split("//")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    if then != "read":
        if then == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        return b""
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


CHAT = "/v1/chat/completions"


def _series(name: str, endpoint: str, label: str) -> str:
    """A ``/metrics`` series' name and labels, as rendered."""
    return f'kvplug_{name}{{endpoint="{endpoint}",{label}}}'


def _head(path: bytes, length: int) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )


async def test_a_late_first_head_is_counted_as_on_the_python_path():
    async with serving(1, settings=native(client_header_timeout=0.3)) as h:
        answer = await _send(h, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert answer.startswith(b"HTTP/1.1 408") and b'"header_timeout"' in answer
        assert h.running.head_timeouts == 1  # as HeadDeadline counts it
        assert h.frontend.native_lane.stats()["timeouts"] == 1  # closed by the lane itself


async def test_a_late_body_is_counted_as_on_the_python_path():
    seen = {}
    for data_path in ("python", "native"):
        async with serving(1, settings=native(data_path=data_path, client_body_timeout=0.3)) as h:
            answer = await _send(h, _head(b"/v1/chat/completions", 300) + b'{"model": ')
            assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer
            await eventually(lambda: 'status="408"' in "".join(_client_counts(h)), what="408")
            seen[data_path] = _client_counts(h)
            text = h.frontend.metrics.render().decode()
            duration = _series("request_duration_seconds_sum", CHAT, 'stream="false"')
            seconds = float(text.split(duration + " ")[1].split()[0])
            assert 0.3 <= seconds < 5, seconds  # from the whole head, as the handler's
            if data_path == "native":
                assert h.frontend.native_lane.stats()["timeouts"] == 1
            h.assert_idle()
    assert seen["native"] == seen["python"]
    assert _series("requests_total", CHAT, 'status="408"') + " 1.0" in seen["native"]
    assert 'kvplug_rejected_requests_total{reason="body_timeout"} 1.0' in seen["native"]


async def test_a_client_gone_mid_body_is_counted_as_on_the_python_path():
    seen = {}
    for data_path in ("python", "native"):
        async with serving(1, settings=native(data_path=data_path)) as h:
            partial = _head(b"/v1/completions", 500) + b'{"model": "' + MODEL.encode()
            await _send(h, partial, then="close")
            await _send(h, _head(b"/v1/chat/completions", 500) + b"{", then="reset")
            await eventually(lambda: "".join(_client_counts(h)).count("499") == 2, what="499s")
            seen[data_path] = _client_counts(h)
            if data_path == "native":
                assert h.frontend.native_lane.stats()["handed_off"] == 0  # the lane's own
            h.assert_idle()
    assert seen["native"] == seen["python"]
    for endpoint in ("/v1/completions", CHAT):
        assert _series("requests_total", endpoint, 'status="499"') + " 1.0" in seen["native"]
    assert "kvplug_inflight_requests 0.0" in seen["native"]


async def test_slow_heads_and_bodies_get_the_same_408s_from_the_lane():
    """tests/test_frontend_lane.py's test of kvplug's Python lane, on the compiled one."""
    async with serving(1, settings=native(client_header_timeout=0.5, client_body_timeout=0.5)) as h:
        got, closed = await exchange(h.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert got[0][0] == 408 and json.loads(got[0][2])["error"]["code"] == "header_timeout"
        body = completion()
        got, closed = await exchange(h.url, post("/v1/completions", body)[: -len(body) // 2])
        assert got[0][0] == 408 and closed
        assert json.loads(got[0][2])["error"]["code"] == "body_timeout"
        stats = h.frontend.native_lane.stats()
        assert h.running.head_timeouts == 1 and (stats["timeouts"], stats["handed_off"]) == (2, 0)
        h.assert_idle()
