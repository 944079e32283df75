"""The compiled lane's Python callbacks (``kvplug/frontend/native_glue.py``) on a real Frontend
with real stub engines, no C lane: ``LaneDouble`` below does what the lane does with
``decide``'s answer (sends the head and body to the engine over a real socket, reads the answer,
reports first bytes and the end), and each result is compared with what the Python path records
and answers for the same request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any

import httptools
import pytest
from multidict import CIMultiDict
from test_frontend_harness import MODEL, prompt, serving

from kvplug.frontend.app import ServeSettings
from kvplug.frontend.native_glue import (
    CLIENT_GONE,
    DEADLINE,
    FAILED_MID_ANSWER,
    KIND_CHAT,
    KIND_COMPLETIONS,
    OK,
    TAIL_BYTES,
    TIMED_OUT,
    UNAVAILABLE,
    GlueRequest,
    NativeGlue,
    answer_tokens,
    stream_tokens,
)
from kvplug.frontend.parsing import COMPLETIONS
from kvplug.frontend.streaming import sse_error

pytestmark = pytest.mark.timeout(60)


class _Answer:
    """An engine's answer as llhttp reads it (httptools callbacks)."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.done = True


@dataclasses.dataclass
class Served:
    status: int  # what the client got
    headers: dict[str, str]  # kvplug's answer headers (or the error answer's)
    body: bytes
    tokens: list[GlueRequest]
    sent_heads: list[bytes]


class LaneDouble:
    """The lane's side of the callbacks, in Python: what csrc/lane.c does with them."""

    def __init__(self, glue: NativeGlue) -> None:
        self.glue = glue
        self.upstreams: dict[int, tuple[str, int]] = {}
        glue.register_upstream = self._register

    def _register(self, upstream_id: int, host: str, port: int) -> None:
        assert upstream_id not in self.upstreams
        self.upstreams[upstream_id] = (host, port)

    async def serve(
        self,
        body: dict | bytes,
        *,
        request_id: bytes | None = None,
        authorization: bytes | None = None,
        kind: int = KIND_COMPLETIONS,
        outcome: int | None = None,  # report this instead of what happened (after the head)
        hang_up_after_first: bool = False,
        timeout: float | None = None,
        timer: int = TIMED_OUT,  # the lane's timer that `timeout` stands for
    ) -> Served | None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        decided = self.glue.decide(kind, raw, request_id, authorization)
        if decided is None:
            return None
        tokens: list[GlueRequest] = []
        heads: list[bytes] = []
        while len(decided) == 5:
            upstream_id, head, new_body, answer_headers, token = decided
            tokens.append(token)
            heads.append(head)
            host, port = self.upstreams[upstream_id]
            status, tail, result = await self._exchange(
                host,
                port,
                head + (raw if new_body is None else new_body),
                token,
                hang_up_after_first,
                timeout,
                timer,
            )
            if outcome is not None and result != UNAVAILABLE:
                result = outcome
            decided = self.glue.finish(token, status, result, tail)
            if decided is None:
                return Served(status, _lines(answer_headers), tail, tokens, heads)
        status, headers, error_body = decided
        return Served(status, _lines(headers), error_body, tokens, heads)

    async def _exchange(self, host, port, data, token, hang_up_after_first, timeout, timer):
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            return 0, f"{type(exc).__name__}: {exc}".encode(), UNAVAILABLE
        answer = _Answer()
        parser = httptools.HttpResponseParser(answer)
        body = b""
        try:
            writer.write(data)
            while not answer.done:
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), timeout)
                except asyncio.TimeoutError:
                    return parser_status(parser), body[-TAIL_BYTES:], timer
                if not chunk:
                    if not answer.headers:
                        return 0, b"", UNAVAILABLE
                    return parser.get_status_code(), body[-TAIL_BYTES:], FAILED_MID_ANSWER
                before = len(answer.chunks)
                parser.feed_data(chunk)
                fresh = b"".join(answer.chunks[before:])
                streamed = answer.headers.get("content-type", "").startswith("text/event-stream")
                if fresh and streamed and not body:
                    self.glue.first_byte(token)
                    if hang_up_after_first:
                        return parser.get_status_code(), b"", CLIENT_GONE
                body += fresh
        except ConnectionResetError:
            if not answer.headers:
                return 0, b"", UNAVAILABLE
            return parser.get_status_code(), body[-TAIL_BYTES:], FAILED_MID_ANSWER
        finally:
            writer.close()
        return parser.get_status_code(), body[-TAIL_BYTES:], OK


def parser_status(parser) -> int:
    try:
        return parser.get_status_code()
    except Exception:
        return 0


def _lines(block: bytes) -> dict[str, str]:
    out = {}
    for line in block.decode().split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            out[name] = value
    return out


def _head_fields(head: bytes) -> tuple[str, dict[str, str]]:
    assert head.endswith(b"\r\n\r\n") and head.count(b"\r\n\r\n") == 1
    first, _, rest = head[:-4].decode().partition("\r\n")
    return first, {k.lower(): v for k, v in _lines(rest.encode()).items()}


def _body(p: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": p, "max_tokens": 4, **extra}


def _counter(fe, name: str, labels: dict[str, str]) -> float:
    text = fe.metrics.render().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _requests(fe, status: int) -> float:
    return _counter(fe, "kvplug_requests_total", {"endpoint": COMPLETIONS, "status": str(status)})


async def test_a_token_id_completion_is_decided_sent_and_recorded():
    async with serving(2) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        before = _requests(fe, 200)
        served = await lane.serve(_body(prompt(4, 1)), request_id=b"req-1")
        assert served is not None and served.status == 200
        # the engine's answer, as the Python path relays it
        assert served.body == h.engines[served.headers["x-kvplug-worker"]].sent["req-1"]
        (token,) = served.tokens
        routed = token.routed
        assert served.headers == fe.answer_headers(token.ctx, routed)
        assert served.headers["X-Request-Id"] == "req-1"
        # the head: the worker's path, its Host, the body's length, the Python path's headers
        line, fields = _head_fields(served.sent_heads[0])
        assert line == "POST /v1/completions HTTP/1.1"
        engine = h.engines[routed.decision.worker_id]
        assert fields["host"] == engine.url.removeprefix("http://")
        assert fields["content-length"] == str(len(json.dumps(_body(prompt(4, 1)))))
        client = CIMultiDict({"X-Request-Id": "req-1"})
        python_hop = {k.lower(): v for k, v in fe.hop_headers(client, "req-1").items()}
        assert {k: v for k, v in fields.items() if k not in ("host", "content-length")} == (
            python_hop
        )
        seen = engine.requests[-1]["headers"]
        assert seen["X-Request-Id"] == "req-1" and seen["Content-Type"] == "application/json"
        # the trace, through the API
        trace = await h.trace(served.headers["x-kvplug-decision-id"])
        assert trace["outcome"] == "ok" and trace["status"] == 200
        assert trace["request_id"] == "req-1" and trace["tokens"]["source"] == "request"
        assert trace["output_tokens"] == 4  # the answer's usage
        assert trace["timings"]["ttft_s"] > 0 and trace["attempt"] == 0
        h.assert_idle()
        assert _requests(fe, 200) == before + 1
        assert _counter(fe, "kvplug_inflight_requests", {}) == 0


async def test_kvplug_makes_the_request_id_when_the_client_sends_none():
    async with serving(1) as h:
        lane = LaneDouble(NativeGlue(h.frontend))
        for given in (None, b""):
            served = await lane.serve(_body(prompt(2, 2)), request_id=given)
            rid = served.headers["X-Request-Id"]
            assert re.fullmatch(r"kvplug-[0-9a-f]{12}-\d+", rid), rid
            assert h.engines["w0"].requests[-1]["headers"]["X-Request-Id"] == rid
        h.assert_idle()


async def test_the_engine_gets_the_authorization_the_python_path_sends():
    cases = [
        ({}, b"Bearer client", "Bearer client"),  # no keys: the client's goes on
        ({"api_key": "k"}, b"Bearer k", None),  # kvplug's own key stays here
        ({"engine_api_key": "e"}, b"Bearer client", "Bearer e"),
        ({"api_key": "k", "engine_api_key": "e"}, b"Bearer k", "Bearer e"),
    ]
    for settings, sent, expected in cases:
        base = ServeSettings(health_interval=0.2, health_timeout=5.0, **settings)
        async with serving(1, settings=base) as h:
            lane = LaneDouble(NativeGlue(h.frontend))
            served = await lane.serve(_body(prompt(1, 3)), authorization=sent)
            assert served is not None and served.status == 200, settings
            _, fields = _head_fields(served.sent_heads[0])
            assert fields.get("authorization") == expected, settings
            python = h.frontend.hop_headers(CIMultiDict({"Authorization": sent.decode()}), "r")
            assert python.get("Authorization") == expected, settings
            h.assert_idle()


async def test_a_stream_reports_its_first_token_and_output_tokens():
    async with serving(1, stub_options={"output_tokens": 7}) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        ttft_before = _counter(fe, "kvplug_time_to_first_token_seconds_count", {})
        for usage in (True, False):  # a short stream: the tail is all of it, counted either way
            extra = {"stream": True, "stream_options": {"include_usage": usage}}
            served = await lane.serve(_body(prompt(2, 4), **extra), request_id=b"s%d" % usage)
            assert served.status == 200 and served.body.endswith(b"data: [DONE]\n\n")
            trace = await h.trace(served.headers["x-kvplug-decision-id"])
            assert trace["outcome"] == "ok" and trace["output_tokens"] == 4
            lc = served.tokens[0].routed.lifecycle
            assert lc.first_at is not None and trace["timings"]["ttft_s"] == pytest.approx(
                lc.first_at - lc.started
            )
            h.assert_idle()
        assert _counter(fe, "kvplug_time_to_first_token_seconds_count", {}) == ttft_before + 2


def test_output_tokens_from_a_tail_that_is_not_the_whole_answer():
    text = "x" * 6000
    body = json.dumps(
        {
            "choices": [{"text": text + ' \\"usage\\": {\\"completion_tokens\\": 1}'}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 321, "total_tokens": 330},
        }
    ).encode()
    assert answer_tokens(body[-TAIL_BYTES:]) == 321
    assert answer_tokens(body[: TAIL_BYTES // 2]) is None  # cut before anything: unknown
    assert answer_tokens(json.dumps({"usage": {"completion_tokens": 5}}).encode()) == 5

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    chunks = [event({"choices": [{"text": "abcdefgh" * 8}], "usage": None}) for _ in range(100)]
    stream = b"".join(chunks) + b"data: [DONE]\n\n"
    with_usage = b"".join(chunks) + event({"choices": [], "usage": {"completion_tokens": 100}})
    assert stream_tokens(with_usage[-TAIL_BYTES:]) == (100, None)
    assert stream_tokens(stream[-TAIL_BYTES:]) == (None, None)  # not known: not a guess
    assert stream_tokens(stream[:3000]) == (len(stream[:3000].split(b"\n\n")) - 1, None)
    error = event({"error": {"message": "boom", "code": 500}})
    assert stream_tokens((stream + error)[-TAIL_BYTES:])[1] == {"message": "boom", "code": 500}


async def test_what_the_glue_leaves_to_the_python_path_changes_nothing():
    async with serving(2, routing_hints="trust") as h:
        fe = h.frontend
        glue = NativeGlue(fe)
        ok = json.dumps(_body(prompt(2, 5))).encode()
        text = json.dumps({"model": MODEL, "prompt": "hello there"}).encode()
        nvext = json.dumps({**_body(prompt(2, 5)), "nvext": {"backend_instance_id": "w1"}})
        fe.settings.max_prompt_tokens = 32
        cases = [
            (KIND_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode()),
            (KIND_COMPLETIONS, text),  # text needs a tokenizer
            (KIND_COMPLETIONS, nvext.encode()),  # hints
            (KIND_COMPLETIONS, b"{not json"),
            (KIND_COMPLETIONS, b""),
            (KIND_COMPLETIONS, json.dumps(_body([[1, 2], [3, 4]])).encode()),  # a batch
            (KIND_COMPLETIONS, json.dumps(_body([-1, 2])).encode()),
            (KIND_COMPLETIONS, json.dumps({**_body(prompt(2, 5)), "model": "other"}).encode()),
            (KIND_COMPLETIONS, json.dumps(_body(prompt(2, 5) + [7])).encode()),  # > 32 tokens
        ]
        metrics = fe.metrics.render()
        for kind, body in cases:
            assert glue.decide(kind, body, None, None) is None, body[:80]
        assert glue.decide(KIND_COMPLETIONS, ok, "é".encode(), None) is None  # non-ASCII id
        fe.settings.max_body_bytes = len(ok) - 1
        assert glue.decide(KIND_COMPLETIONS, ok, None, None) is None
        fe.settings.max_body_bytes = 1 << 20
        fe.settings.api_key = "key"
        for auth in (None, b"Bearer nope", b"bearer key"):
            assert glue.decide(KIND_COMPLETIONS, ok, None, auth) is None
        fe.settings.api_key = None
        assert fe.metrics.render() == metrics  # nothing counted
        assert len(fe.decisions) == 0
        h.assert_idle()
        # ... and each of those is still served by the Python path as before
        resp, raw = await h.post("/v1/completions", None, raw=text)
        assert resp.status == 200
        # the same body is served here once the limits allow it
        decided = glue.decide(KIND_COMPLETIONS, ok, None, None)
        assert decided is not None and len(decided) == 5
        glue.finish(decided[4], 0, CLIENT_GONE, b"")
        h.assert_idle()


async def test_fleets_and_engines_the_lane_does_not_serve():
    async with serving([{"id": "p", "role": "prefill"}, {"id": "d", "role": "decode"}]) as h:
        glue = NativeGlue(h.frontend)
        assert (
            glue.decide(KIND_COMPLETIONS, json.dumps(_body(prompt(2, 6))).encode(), None, None)
            is None
        )
    settings = None
    async with serving(1, settings=settings, router_config={"router_queue_threshold": 0.5}) as h:
        glue = NativeGlue(h.frontend)
        assert h.frontend.queue is not None
        assert (
            glue.decide(KIND_COMPLETIONS, json.dumps(_body(prompt(2, 6))).encode(), None, None)
            is None
        )
    async with serving(2) as h:
        glue = NativeGlue(h.frontend)
        body = json.dumps(_body(prompt(2, 6))).encode()
        h.frontend.fleet.workers["w1"].url_base = "https://127.0.0.1:1"
        h.frontend.fleet.configured_models = {MODEL}  # a fleet change: the glue looks again
        assert glue.decide(KIND_COMPLETIONS, body, None, None) is None
        assert glue.upstream_of("w1") is None and glue.upstream_of("nope") is None
        assert glue.upstream_of("w0") is not None
        h.assert_idle()
        assert len(h.frontend.decisions) == 0


async def test_streams_stay_with_the_python_path_when_output_blocks_are_load():
    """With --router-track-output-blocks each output block a stream crosses is decode load the
    router must hear as it happens, which the lane does not report: such streams are declined
    (nothing counted), a non-streamed request is still decided."""
    async with serving(1, router_config={"router_track_output_blocks": True}) as h:
        fe = h.frontend
        glue = NativeGlue(fe)
        metrics = fe.metrics.render()
        stream = json.dumps(_body(prompt(2, 5), stream=True)).encode()
        assert glue.decide(KIND_COMPLETIONS, stream, None, None) is None
        assert fe.metrics.render() == metrics and len(fe.decisions) == 0
        decided = glue.decide(
            KIND_COMPLETIONS, json.dumps(_body(prompt(2, 5))).encode(), None, None
        )
        assert decided is not None and len(decided) == 5
        glue.finish(decided[4], 0, CLIENT_GONE, b"")
        h.assert_idle()
    # affinity settings, the one that sums the outputs in flight into each engine's context
    # (read_ms) too: 4 KiB-apart reports suffice for it, so the lane takes their streams
    soonest = {"router_mode": "affinity", "router_affinity": "affinity-soonest"}
    plain = {"router_mode": "affinity", "router_affinity": "affinity"}
    for config in (None, plain, soonest):  # without output-block tracking the lane takes it
        async with serving(1, router_config=config) as h:
            assert not h.frontend.router.hears_output_progress()
            glue = NativeGlue(h.frontend)
            decided = glue.decide(KIND_COMPLETIONS, stream, None, None)
            assert decided is not None and len(decided) == 5
            glue.finish(decided[4], 0, CLIENT_GONE, b"")
            h.assert_idle()


async def test_upstream_ids_are_small_stable_and_announced_before_use():
    async with serving(3) as h:
        glue = NativeGlue(h.frontend)
        lane = LaneDouble(glue)
        ids = {w: glue.upstream_of(w) for w in ("w0", "w1", "w2")}
        assert sorted(i for i, _, _ in ids.values()) == [0, 1, 2]
        assert lane.upstreams == {i: (host, port) for i, host, port in ids.values()}
        for seed in range(6):
            served = await lane.serve(_body(prompt(2, 10 + seed)))
            assert served.status == 200
        assert {w: glue.upstream_of(w) for w in ids} == ids
        h.assert_idle()


async def test_an_engine_down_before_answering_is_retried_elsewhere_then_a_502():
    async with serving(2) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        for engine in h.engines.values():
            engine.fail = "reset"
        retries_before = _counter(fe, "kvplug_retries_total", {"stage": "aggregated"})
        served = await lane.serve(_body(prompt(2, 7)), request_id=b"dead")
        assert served.status == 502
        first, second = served.tokens[0], served.tokens[-1]
        assert first is second and len(served.sent_heads) == 2  # one retry (--retries 1)
        tried = [rec.worker_id for rec in first.ctx.records]
        assert sorted(tried) == ["w0", "w1"]  # the failed worker was excluded
        for rec in first.ctx.records:
            assert rec.outcome == "unavailable"
        assert _counter(fe, "kvplug_retries_total", {"stage": "aggregated"}) == retries_before + 1
        assert fe.fleet.unhealthy == {"w0", "w1"}
        h.assert_idle()
        # the Python path's 502 for the same request: same status, headers, error fields
        for engine in h.engines.values():
            engine.fail = "reset"
        for w in ("w0", "w1"):
            fe.fleet.mark_healthy(w, source="request")
        resp, raw = await h.complete(prompt(2, 7), headers={"X-Request-Id": "dead2"})
        assert resp.status == 502
        python = json.loads(raw)["error"]
        ours = json.loads(served.body)["error"]
        assert {k: v for k, v in ours.items() if k != "message"} == {
            k: v for k, v in python.items() if k != "message"
        }
        assert ours["message"].startswith(
            "the engine failed before answering (retried once on another worker): worker w"
        )
        assert resp.headers["Content-Type"] == served.headers["Content-Type"]
        for name in ("x-kvplug-decision-id", "x-kvplug-worker"):
            assert name in resp.headers and name in served.headers
        assert served.headers["x-kvplug-decision-id"] == first.ctx.records[-1].decision_id
        h.assert_idle()


async def test_a_retry_that_finds_a_healthy_worker_succeeds():
    async with serving(2) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        h.engines["w0"].fail = "reset"
        served = await lane.serve(
            _body(prompt(2, 8)),
            request_id=b"r",
        )
        if len(served.tokens[0].ctx.records) == 1:  # routed to w1 first: nothing to retry
            served = await lane.serve(_body(prompt(3, 8)), request_id=b"r2")
        records = served.tokens[0].ctx.records
        assert served.status == 200
        trace = await h.trace(served.headers["x-kvplug-decision-id"])
        assert trace["worker_id"] == "w1" and trace["attempt"] == records[-1].attempt
        assert records[-1].decision_id in [r.decision_id for r in records]
        h.assert_idle()


async def test_retries_stop_at_the_limit_and_a_lone_worker_leaves_a_503():
    settings = ServeSettings(health_interval=0.2, health_timeout=5.0, retries=0)
    async with serving(2, settings=settings) as h:
        lane = LaneDouble(NativeGlue(h.frontend))
        for engine in h.engines.values():
            engine.fail = "reset"
        served = await lane.serve(_body(prompt(2, 9)))
        assert served.status == 502 and len(served.sent_heads) == 1
        assert "(retried" not in json.loads(served.body)["error"]["message"]
        h.assert_idle()
    async with serving(1) as h:  # the retry has no other worker: the Python path's 503
        lane = LaneDouble(NativeGlue(h.frontend))
        h.engines["w0"].fail = "reset"
        served = await lane.serve(_body(prompt(2, 9)))
        assert served.status == 503 and len(served.sent_heads) == 1
        assert json.loads(served.body)["error"]["code"] == "no_compatible_worker"
        h.assert_idle()


async def test_the_load_is_gone_after_every_outcome():
    async with serving(1, stub_options={"token_delay": 0.05, "output_tokens": 40}) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        engine = h.engines["w0"]
        stream = {"stream": True}
        # the client hangs up mid-stream
        served = await lane.serve(_body(prompt(2, 11), **stream), hang_up_after_first=True)
        rec = served.tokens[0].ctx.records[-1]
        assert (rec.outcome, rec.status) == ("client_disconnected", 499)
        h.assert_idle()
        # the engine breaks off mid-answer: streamed, then whole
        engine.fail = "midstream"
        served = await lane.serve(_body(prompt(2, 12), **stream))
        rec = served.tokens[0].ctx.records[-1]
        assert rec.outcome == "upstream_failed_mid_stream" and served.status == 200
        h.assert_idle()
        served = await lane.serve(_body(prompt(2, 13)))
        assert served.status == 502
        assert json.loads(served.body)["error"]["code"] == "engine_failed"
        assert served.tokens[0].ctx.records[-1].outcome == "upstream_failed_mid_stream"
        h.assert_idle()
        # the engine hangs: --request-timeout (the lane's timer) ends it with a 504
        engine.fail = "hang"
        fe.outliers.success("w0")
        served = await lane.serve(_body(prompt(2, 14)), timeout=0.3, timer=DEADLINE)
        assert served.status == 504
        python = fe._timed_out(None)
        assert json.loads(served.body) == python.body()
        assert served.tokens[0].ctx.records[-1].outcome == "timeout"
        assert _requests(fe, 504) == 1
        h.assert_idle()
        # a stream whose engine falls silent (the lane's --idle-timeout) after its first bytes
        engine.fail = None
        served = await lane.serve(_body(prompt(2, 15), **stream), outcome=TIMED_OUT)
        rec = served.tokens[0].ctx.records[-1]
        assert rec.outcome == "upstream_failed_mid_stream" and "--idle-timeout" in rec.error
        h.assert_idle()
        assert _counter(fe, "kvplug_inflight_requests", {}) == 0
        # --max-stream-duration (the lane's timer after a stream's first bytes): the stream
        # ends with the Python path's timeout event, traced as it traces it
        fe.settings.max_stream_duration = 0.1
        served = await lane.serve(_body(prompt(2, 15), **stream), outcome=DEADLINE)
        rec = served.tokens[0].ctx.records[-1]
        assert rec.outcome == "stream_timeout" and "--max-stream-duration (0.1 s)" in rec.error
        assert served.body == sse_error(rec.error, 504, "timeout_error")
        h.assert_idle()


async def test_an_idle_timeout_shorter_than_the_request_timeout_is_retried():
    settings = ServeSettings(health_interval=0.2, health_timeout=5.0, idle_timeout=0.3)
    async with serving(2, settings=settings) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        for engine in h.engines.values():
            engine.fail = "hang"
        served = await lane.serve(_body(prompt(2, 19)), timeout=0.3)
        assert served.status == 502 and len(served.sent_heads) == 2  # retried, as Python does
        records = served.tokens[0].ctx.records
        assert [r.outcome for r in records] == ["unavailable", "unavailable"]
        assert "--idle-timeout (0.3 s)" in records[0].error
        h.assert_idle()


async def test_an_engine_error_answer_is_traced_and_counted_as_the_python_path_does():
    async with serving(1) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        h.engines["w0"].fail = "http500"
        served = await lane.serve(_body(prompt(2, 16)))
        assert served.status == 500
        rec = served.tokens[0].ctx.records[-1]
        assert (rec.outcome, rec.status) == ("engine_error", 500)
        assert fe.outliers._states["w0"].consecutive == 1
        assert _requests(fe, 500) == 1
        h.engines["w0"].fail = None
        served = await lane.serve(_body(prompt(2, 17)))
        assert served.status == 200 and fe.outliers._states["w0"].consecutive == 0
        h.assert_idle()


async def test_finish_twice_is_refused_without_touching_the_load():
    async with serving(1) as h:
        glue = NativeGlue(h.frontend)
        decided = glue.decide(
            KIND_COMPLETIONS, json.dumps(_body(prompt(2, 18))).encode(), None, None
        )
        token = decided[4]
        assert glue.finish(token, 0, CLIENT_GONE, b"") is None
        h.assert_idle()
        assert glue.finish(token, 200, OK, b"{}") is None
        h.assert_idle()
        assert token.routed.record.outcome == "client_disconnected"


async def test_a_retry_to_a_worker_the_lane_cannot_reach_ends_in_the_502():
    async with serving(2) as h:
        fe = h.frontend
        glue = NativeGlue(fe)
        body = json.dumps(_body(prompt(2, 21))).encode()
        decided = glue.decide(KIND_COMPLETIONS, body, None, None)
        token = decided[4]
        first = token.routed.decision.worker_id
        other = "w1" if first == "w0" else "w0"
        fe.fleet.workers[other].url_base = "https://127.0.0.1:1"  # changed since decide
        answer = glue.finish(token, 0, UNAVAILABLE, b"")
        assert len(answer) == 3 and answer[0] == 502
        assert "native lane can reach" in json.loads(answer[2])["error"]["message"]
        assert [r.outcome for r in token.ctx.records] == ["unavailable", "unavailable"]
        assert fe.fleet.unhealthy == {first}  # the unreachable one is not marked down
        h.assert_idle()


async def test_text_and_chat_with_a_local_tokenizer_are_served(tmp_path):
    from test_frontend_units import make_tokenizer_dir

    from kvplug.frontend.tokens import LocalTokenizer

    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    async with serving(1, tokenizer=tok) as h:
        fe = h.frontend
        lane = LaneDouble(NativeGlue(fe))
        served = await lane.serve({"model": MODEL, "prompt": "hello world hello", "max_tokens": 2})
        assert served.status == 200
        ctx = served.tokens[0].ctx
        assert (ctx.token_source, list(ctx.tokens)) == ("tokenizer", [3, 4, 3])
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        served = await lane.serve(chat, kind=KIND_CHAT)
        assert served.status == 200
        line, _ = _head_fields(served.sent_heads[0])
        assert line == "POST /v1/chat/completions HTTP/1.1"
        assert h.engines["w0"].requests[-1]["path"] == "/v1/chat/completions"
        trace = served.tokens[0].ctx.records[-1].to_json()
        assert trace["tokens"] == {"source": "tokenizer", "count": 6, "note": None}
        assert _counter(fe, "kvplug_token_source_total", {"source": "tokenizer"}) == 2
        h.assert_idle()
        glue = lane.glue
        # what the Python path tokenizes elsewhere, or reports: not taken here
        long_text = json.dumps({"model": MODEL, "prompt": "hello " * 6000}).encode()
        assert glue.decide(KIND_COMPLETIONS, long_text, None, None) is None  # a thread's job
        nvext = {**chat, "nvext": {"agent_hints": {"osl": 4}}}
        assert glue.decide(KIND_CHAT, json.dumps(nvext).encode(), None, None) is None
        batch = json.dumps({"model": MODEL, "prompt": ["hello", "world"]}).encode()
        assert glue.decide(KIND_COMPLETIONS, batch, None, None) is None
        bad = json.dumps({"model": MODEL, "messages": []}).encode()
        assert glue.decide(KIND_CHAT, bad, None, None) is None
    no_template = LocalTokenizer(make_tokenizer_dir(tmp_path / "..", with_template=False))
    async with serving(1, tokenizer=no_template) as h:
        glue = NativeGlue(h.frontend)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert glue.decide(KIND_CHAT, json.dumps(chat).encode(), None, None) is None
        h.assert_idle()
