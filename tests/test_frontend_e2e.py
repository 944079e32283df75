"""``kvplug serve`` end to end over real HTTP on loopback: stub engines that speak the OpenAI
API and publish KV events through the real Router.apply_event path."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from test_frontend_harness import MODEL, eventually, prompt, serving

from kvplug.frontend.app import ServeSettings

pytestmark = pytest.mark.timeout(60)


async def test_routes_by_prefix_and_explains():
    async with serving(3) as h:
        a, b = prompt(8, 1), prompt(8, 2)
        # seed the caches: A on w0, B on w2 (explicit pins), events flow back to the index
        for p, w in ((a, "w0"), (b, "w2")):
            resp, _ = await h.complete(p, headers={"x-kvplug-worker": w})
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == w
        h.assert_idle()
        # unpinned requests that share those prefixes follow their cache
        for p, w in ((a + prompt(2, 9), "w0"), (b + prompt(3, 8), "w2"), (a[:64], "w0")):
            resp, _ = await h.complete(p)
            assert resp.status == 200
            assert resp.headers["x-kvplug-worker"] == w
            trace = await h.trace(resp.headers["x-kvplug-decision-id"])
            assert trace["worker_id"] == w and trace["tokens"]["source"] == "request"
            assert trace["router"]["overlap_blocks"] >= 4
            assert trace["outcome"] == "ok" and trace["status"] == 200
            chosen = [c for c in trace["router"]["candidates"] if c["chosen"]]
            assert chosen and chosen[0]["worker_id"] == w
            h.assert_idle()
        assert h.router.stats()["index"]["blocks"] > 0


async def test_streaming_is_passed_through_byte_for_byte_and_incrementally():
    # 0.2 s between tokens: a client stalled for a moment on a loaded machine still reads
    # them as separate chunks, spread over more than a second
    opts = {"token_delay": 0.2}
    async with serving(1, stub_options=opts) as h:
        engine = h.engines["w0"]
        for path, body in (
            ("/v1/completions", {"prompt": prompt(2, 3)}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]}),
        ):
            payload = {
                "model": MODEL,
                "stream": True,
                "max_tokens": 6,
                "stream_options": {"include_usage": True},
                **body,
            }
            rid = f"req-{path}"
            t0 = time.perf_counter()
            async with h.session.post(
                h.url + path, json=payload, headers={"X-Request-Id": rid}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                chunks, arrivals = [], []
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
                    arrivals.append(time.perf_counter() - t0)
            received = b"".join(chunks)
            assert received == bytes(engine.sent[rid])  # byte for byte
            assert received.endswith(b"data: [DONE]\n\n")
            # chunk by chunk: the first event reached the client long before the last
            assert len(chunks) >= 3 and arrivals[-1] - arrivals[0] >= 0.6, arrivals
            h.assert_idle()
        # non-streamed answers are the engine's bytes too
        resp, raw = await h.complete(prompt(2, 4), headers={"X-Request-Id": "plain"})
        assert raw == engine.sent["plain"]
        assert resp.headers["X-Request-Id"] == "plain"
        h.assert_idle()


async def test_lifecycle_is_exact_during_and_after_a_stream():
    async with serving(
        2, stub_options={"token_delay": 0.04}, router_config={"router_track_output_blocks": True}
    ) as h:
        p = prompt(4, 5)
        during: list[tuple[dict, dict]] = []

        class Watching(_RecordingRouter):
            def on_output_progress(self, rid, n):
                super().on_output_progress(rid, n)
                if not during:  # generation passed its first output block (16 tokens)
                    loads = (h.router.active_load("w1")[0], h.router.active_load("w0")[0])
                    during.append((dict(loads[0]), dict(loads[1])))

        # the router's view of w1 while the stream runs, taken at that moment (polling for it
        # from the test could miss the stream on a slow machine)
        h.frontend.router = Watching(h.router)
        resp, raw = await h.complete(
            p, stream=True, max_tokens=40, headers={"x-kvplug-worker": "w1"}
        )
        load, other = during[0]
        assert load["inflight"] == 1
        assert load["prefill_tokens"] == 0  # released at the first token
        assert load["decode_blocks"] >= 4 + 1  # prompt blocks + at least one output block
        assert other["inflight"] == 0
        assert resp.status == 200 and raw.endswith(b"[DONE]\n\n")
        h.assert_idle()
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["output_tokens"] == 40 and trace["timings"]["ttft_s"] > 0


async def test_client_disconnect_mid_stream_releases_the_load():
    async with serving(1, stub_options={"token_delay": 0.05}) as h:
        async with h.session.post(
            h.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt(2, 6), "stream": True, "max_tokens": 200},
        ) as resp:
            assert resp.status == 200
            await resp.content.readany()
        # the client is gone; the frontend notices on its next write (the stream has 10 s left)
        await eventually(lambda: h.router.stats()["active_requests"] == 0)
        h.assert_idle()


async def test_retry_once_on_a_dead_engine_then_reprobe():
    async with serving(2) as h:
        a = prompt(6, 7)
        resp, _ = await h.complete(a, headers={"x-kvplug-worker": "w0"})
        assert resp.headers["x-kvplug-worker"] == "w0"
        await h.engines["w0"].stop()  # connection refused from now on
        resp, raw = await h.complete(a + prompt(1, 1), stream=True)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "w1"
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["attempt"] == 1 and len(trace["related_decisions"]) == 1
        first = await h.trace(trace["related_decisions"][0])
        assert first["worker_id"] == "w0" and first["outcome"] == "unavailable"
        assert "w0" in h.frontend.fleet.unhealthy
        h.assert_idle()
        # unhealthy workers are not routed to, even for their own prefix
        resp, _ = await h.complete(a)
        assert resp.headers["x-kvplug-worker"] == "w1"
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["attempt"] == 0
        # and the trace says why: unhealthy, not "excluded by the caller (retry)"
        why = {e["worker_id"]: e["reason"] for e in trace["router"]["excluded"]}
        assert why["w0"].startswith("unhealthy: "), why
        h.assert_idle()


async def test_reset_before_first_byte_is_retried_and_health_recovers():
    async with serving(2) as h:
        a = prompt(6, 8)
        await h.complete(a, headers={"x-kvplug-worker": "w0"})  # w0 holds the prefix
        h.engines["w0"].fail = "reset"
        resp, raw = await h.complete(a)
        assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1", raw
        assert len(h.engines["w0"].requests) == 2  # it was tried first, and reset
        # the retry saw w0 marked down by the reset. Not read from the fleet now: the failure
        # pokes the prober, whose passing probe 0.2 s later may already have cleared it
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["unhealthy_workers"]["w0"]["down_by"] == ["request"], trace
        h.assert_idle()
        # its /health still answers: the background probe makes it routable again
        h.engines["w0"].fail = None
        await eventually(lambda: not h.frontend.fleet.unhealthy)
        resp, _ = await h.complete(a)
        assert resp.headers["x-kvplug-worker"] == "w0"
        h.assert_idle()


async def test_all_workers_dead_is_a_clean_502():
    async with serving(2) as h:
        for e in h.engines.values():
            await e.stop()
        resp, raw = await h.complete(prompt(2, 9))
        assert resp.status == 502
        err = json.loads(raw)["error"]
        assert err["code"] == "engine_unavailable" and "retried once" in err["message"]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])  # why it went where
        assert trace["outcome"] == "unavailable" and trace["attempt"] == 1
        h.assert_idle()
        resp, raw = await h.complete(prompt(2, 9))  # both unhealthy now: nothing to route to
        assert resp.status == 503 and json.loads(raw)["error"]["code"] == "no_compatible_worker"
        h.assert_idle()


async def test_error_after_first_byte_reaches_the_client_cleanly():
    async with serving(1) as h:
        h.engines["w0"].fail = "midstream"
        resp, raw = await h.complete(prompt(2, 10), stream=True, max_tokens=10)
        assert resp.status == 200
        events = [e for e in raw.split(b"\n\n") if e]
        assert len(events) == 3  # two tokens, then kvplug's error event
        error = json.loads(events[-1][len(b"data: ") :])["error"]
        assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
        assert b"[DONE]" not in raw
        h.assert_idle()
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["outcome"] == "upstream_failed_mid_stream"
        assert "w0" not in h.frontend.fleet.unhealthy  # it answered; not a dead engine
        # non-streamed: the body breaks half-way -> a clean 502 with an OpenAI error body
        resp, raw = await h.complete(prompt(2, 10), max_tokens=10)
        assert resp.status == 502 and json.loads(raw)["error"]["code"] == "engine_failed"
        h.assert_idle()


async def test_engine_http_errors_pass_through():
    async with serving(1) as h:
        h.engines["w0"].fail = "http500"
        resp, raw = await h.complete(prompt(2, 11))
        assert resp.status == 500 and json.loads(raw)["error"]["message"] == "stub engine failure"
        h.assert_idle()


@pytest.mark.parametrize(
    "path, raw, headers, status, code",
    [
        ("/v1/completions", b"{bad json", {}, 400, "invalid_json"),
        ("/v1/completions", b'"a string"', {}, 400, "invalid_json"),
        ("/v1/completions", json.dumps({"prompt": "x"}).encode(), {}, 400, "missing_field"),
        ("/v1/completions", json.dumps({"model": MODEL}).encode(), {}, 400, "missing_field"),
        ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), {}, 400, "missing_field"),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": [1, -2]}).encode(),
            {},
            400,
            "invalid_prompt",
        ),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": list(range(65))}).encode(),
            {},
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(),
            {},
            413,
            "body_too_large",
        ),
        (
            "/v1/completions",
            json.dumps({"model": "nope", "prompt": [1]}).encode(),
            {},
            404,
            "model_not_found",
        ),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": [1]}).encode(),
            {"x-kvplug-worker": "ghost"},
            400,
            "unknown_worker",
        ),
        (
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": [1]}).encode(),
            {"x-dynamo-dp-rank": "minus one"},
            400,
            "invalid_request",
        ),
        (
            "/v1/completions",
            json.dumps(
                {"model": MODEL, "prompt": [1], "nvext": {"agent_hints": {"osl": -5}}}
            ).encode(),
            {},
            400,
            "invalid_request",
        ),
    ],
)
async def test_bad_input_is_a_4xx_and_changes_nothing(path, raw, headers, status, code):
    settings = ServeSettings(
        max_prompt_tokens=64, max_body_bytes=4096, health_interval=0.2, served_model_names=[MODEL]
    )
    async with serving(2, settings=settings) as h:
        before = h.router.stats()
        resp, body = await h.post(path, None, headers, raw=raw)
        assert resp.status == status, body
        assert resp.headers["Content-Type"].startswith("application/json")
        err = json.loads(body)["error"]
        assert err["code"] == code and err["message"] and err["type"]
        assert h.router.stats() == before
        assert not any(e.requests for e in h.engines.values())
        assert len(h.frontend.decisions) == 0
        h.assert_idle()


async def test_models_health_ready_metrics():
    async with serving(2) as h:
        async with h.session.get(h.url + "/v1/models") as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        async with h.session.get(h.url + "/health") as r:
            assert r.status == 200
        async with h.session.get(h.url + "/ready") as r:
            body = await r.json()
            assert r.status == 200 and body["routable_workers"] == ["w0", "w1"]
        await h.complete(prompt(2, 12), stream=True)
        await h.post("/v1/completions", None, raw=b"nope")
        async with h.session.get(h.url + "/metrics") as r:
            text = await r.text()
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
        assert 'kvplug_rejected_requests_total{reason="invalid_json"} 1.0' in text
        assert 'kvplug_worker_healthy{worker="w0"} 1.0' in text
        assert 'kvplug_worker_active_decode_blocks{worker="w0"} 0.0' in text
        assert 'kvplug_token_source_total{source="request"} 1.0' in text
        assert "kvplug_route_duration_seconds_bucket" in text
        async with h.session.get(h.url + "/kvplug/decisions/999999") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "decision_not_found"
        for e in h.engines.values():
            e.fail = "unhealthy"
        await eventually(lambda: len(h.frontend.fleet.unhealthy) == 2)
        async with h.session.get(h.url + "/ready") as r:
            assert r.status == 503


async def test_no_workers_is_not_ready():
    async with serving([]) as h:
        async with h.session.get(h.url + "/ready") as r:
            assert r.status == 503
        resp, raw = await h.complete([1, 2, 3])
        assert resp.status == 503


async def test_hints_reach_the_router():
    workers = [{"id": "w0"}, {"id": "w1", "dp_size": 2}, {"id": "w2"}]
    async with serving(workers) as h:
        resp, _ = await h.complete(prompt(2, 13), nvext={"backend_instance_id": "w2"})
        assert resp.headers["x-kvplug-worker"] == "w2"
        resp, _ = await h.complete(
            prompt(2, 13), headers={"x-dynamo-dp-rank": "1"}, nvext={"allowed_worker_ids": ["w1"]}
        )
        assert resp.headers["x-kvplug-worker"] == "w1" and resp.headers["x-kvplug-dp-rank"] == "1"
        # the engine never sees nvext
        assert "nvext" not in h.engines["w1"].requests[-1]["body"]
        resp, _ = await h.complete(
            prompt(2, 14),
            nvext={"agent_hints": {"osl": 64}},
            headers={"x-kvplug-allowed-workers": "w0,w2"},
        )
        assert resp.headers["x-kvplug-worker"] in ("w0", "w2")
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        excluded = {e["worker_id"] for e in trace["router"]["excluded"]}
        assert "w1" in excluded
        h.assert_idle()


async def test_token_sources_engine_and_local_tokenizer(tmp_path):
    async with serving(1) as h:
        resp, _ = await h.complete("some text prompt")
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["tokens"] == {"source": "engine", "count": 16, "note": None}
        resp, _ = await h.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert resp.status == 200
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["tokens"]["source"] == "engine"
        assert trace["tokens"]["count"] == len("user: hi\nassistant: ")

    from test_frontend_units import make_tokenizer_dir

    from kvplug.frontend.tokens import LocalTokenizer

    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    async with serving(1, tokenizer=tok) as h:
        resp, _ = await h.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}]},
        )
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["tokens"] == {"source": "tokenizer", "count": 7, "note": None}


async def test_adapter_liveness_verdicts_reach_the_fleet():
    import threading

    from kvplug.adapters import register_adapter, unregister_adapter
    from kvplug.frontend.stub_engine import StubAdapter

    listeners = []

    class Watched(StubAdapter):
        kind = "watched"

        def add_liveness_listener(self, fn):
            listeners.append(fn)

    register_adapter("watched", Watched)
    try:
        async with serving(
            2, engine_kind="watched", settings=ServeSettings(health_interval=0.05)
        ) as h:
            assert len(listeners) == 1
            t = threading.Thread(target=listeners[0], args=("w0", False))  # a scraper thread
            t.start()
            t.join()
            await eventually(lambda: "w0" in h.frontend.fleet.unhealthy)
            assert h.frontend.fleet.unhealthy == {"w0"}
            resp, _ = await h.complete(prompt(2, 15), headers={})
            assert resp.headers["x-kvplug-worker"] == "w1"
            await asyncio.sleep(0.3)  # health probes pass meanwhile: the adapter's word stands
            assert h.frontend.fleet.unhealthy == {"w0"}
            listeners[0]("w0", True)
            await asyncio.sleep(0.05)
            assert not h.frontend.fleet.unhealthy
    finally:
        unregister_adapter("watched")


async def test_no_token_source_routes_on_load_only():
    settings = ServeSettings(engine_tokenize=False, health_interval=0)
    async with serving(2, settings=settings) as h:
        resp, raw = await h.complete("text without a tokenizer", stream=True)
        assert resp.status == 200, raw
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["tokens"]["source"] == "none" and trace["tokens"]["count"] is None
        assert trace["router"]["prompt_tokens"] == 0
        h.assert_idle()


class _RecordingRouter:
    """The real router, with its lifecycle calls recorded."""

    def __init__(self, router):
        self._router = router
        self.calls = []
        self.measured = []  # per first token: whether it came as it came (not a whole answer)

    def __getattr__(self, name):
        return getattr(self._router, name)

    def on_first_token(self, rid, measured=True):
        self.calls.append(("first", rid))
        self.measured.append(measured)
        self._router.on_first_token(rid, measured)

    def on_output_progress(self, rid, n):
        self.calls.append(("progress", n))
        self._router.on_output_progress(rid, n)

    def on_finish(self, rid):
        self.calls.append(("finish", rid))
        self._router.on_finish(rid)


def _boundary_reports_ok(progress: list[int], prompt: int, total: int, bs: int = 16) -> None:
    """Each report crosses a block boundary of the whole sequence, and the last covers all."""
    prev = 0
    for v in progress:
        assert (prompt + v) // bs > (prompt + prev) // bs, progress
        prev = v
    assert (prompt + prev) // bs == (prompt + total) // bs, progress


async def test_block_boundaries_are_those_of_the_whole_sequence():
    """The Python path's relay reads a stream as it passes and reports each output block it
    crosses (the native lane reports the total at the end: the next test)."""
    settings = ServeSettings(data_path="python")
    async with serving(1, settings=settings, stub_options={"token_delay": 0.01}) as h:
        rec = _RecordingRouter(h.router)
        h.frontend.router = rec
        # 20 prompt tokens, block 16: the sequence crosses boundaries at outputs 12, 28, 44
        resp, raw = await h.complete(list(range(20)), stream=True, max_tokens=50)
        assert resp.status == 200
        progress = [c[1] for c in rec.calls if c[0] == "progress"]
        _boundary_reports_ok(progress, 20, 50)
        assert 12 <= progress[0] < 16  # not 16: the prompt's partial block fills first
        assert rec.calls[0][0] == "first" and rec.calls[-1][0] == "finish"
        assert rec.measured == [True]  # a stream's first event: its time is the prefill's
        # chunks of 3 tokens (token_ids): a boundary is reported at the chunk that crosses it
        rec.calls.clear()
        h.engines["w0"].tokens_per_chunk = 3
        resp, raw = await h.complete(list(range(20)), stream=True, max_tokens=30)
        progress = [c[1] for c in rec.calls if c[0] == "progress"]
        _boundary_reports_ok(progress, 20, 30)
        assert 12 <= progress[0] < 16 and all(v % 3 == 0 for v in progress)
        h.assert_idle()


async def test_the_native_path_reports_a_streams_output_4_kib_apart():
    """The native lane hands a stream's body over 4 KiB at a time: the router hears the
    output's block boundaries at those points and the whole count at the end, which the trace
    shows as the Python path's relay counts it (streams of ~10 KiB and of one event)."""
    async with serving(1, stub_options={"token_delay": 0.002}) as h:
        assert h.running.native is not None and not h.router.hears_output_progress()
        rec = _RecordingRouter(h.router)
        h.frontend.router = rec
        resp, raw = await h.complete(list(range(20)), stream=True, max_tokens=50)
        assert resp.status == 200 and raw.rstrip().endswith(b"data: [DONE]") and len(raw) > 8192
        progress = [c[1] for c in rec.calls if c[0] == "progress"]
        _boundary_reports_ok(progress, 20, 50)
        assert len(progress) >= 2 and progress[-1] == 50  # during the stream, then at its end
        assert rec.calls[0][0] == "first" and rec.calls[-1][0] == "finish"
        assert rec.measured == [True]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["output_tokens"] == 50
        assert h.running.native.lane.stats()["served"] == 1  # (the trace's GET: handed off)
        rec.calls.clear()
        resp, raw = await h.complete(list(range(20)), stream=True, max_tokens=1)
        assert [c[0] for c in rec.calls] == ["first", "finish"]  # 21 tokens: one block
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["output_tokens"] == 1
        h.assert_idle()


@pytest.mark.parametrize("data_path", ["python", "native"])
async def test_a_whole_answers_first_token_is_not_a_measured_one(data_path):
    """A non-streamed answer arrives after its decode: the router hears its first token
    (the prefill load goes) but not as a time a policy may learn the prefill from; a stream's
    first event on the same server is one."""
    settings = ServeSettings(data_path=data_path)
    async with serving(1, settings=settings, stub_options={"token_delay": 0.002}) as h:
        rec = _RecordingRouter(h.router)
        h.frontend.router = rec
        resp, _ = await h.complete(list(range(20)), stream=False, max_tokens=20)
        assert resp.status == 200
        assert [c[0] for c in rec.calls][0] == "first" and rec.measured == [False]
        resp, _ = await h.complete(list(range(20)), stream=True, max_tokens=20)
        assert resp.status == 200 and rec.measured == [False, True]
        h.assert_idle()


async def test_expected_osl_reaches_the_router():
    """With output-block tracking on, nvext.agent_hints.osl weights the placeholder blocks."""
    seen: dict = {}
    for osl in (None, 40):
        async with serving(
            1,
            stub_options={"token_delay": 0.05},
            router_config={"router_track_output_blocks": True},
        ) as h:

            class Watching(_RecordingRouter):
                def on_output_progress(self, rid, n, osl=osl):
                    super().on_output_progress(rid, n)
                    if osl not in seen:  # the first output block was crossed (at 16 tokens)
                        seen[osl] = h.router.active_load("w0")[0]["decode_blocks"]

            # read at that moment: a test polling for it could miss the window on a slow machine
            h.frontend.router = Watching(h.router)
            nvext = {"agent_hints": {"osl": osl}} if osl else None
            extra = {"nvext": nvext} if nvext else {}
            resp, _ = await h.complete(prompt(4, 16), stream=True, max_tokens=24, **extra)
            assert resp.status == 200
            h.assert_idle()
    assert seen[None] == pytest.approx(5.0)  # 4 prompt blocks + 1 full-weight output block
    assert 4.0 < seen[40] < 5.0  # the same block, weighted by 1 - 16/40


async def test_load_returns_to_zero_under_concurrent_mixed_traffic():
    """100 concurrent requests: streamed and not, chat and completions, clients that hang up,
    an engine that breaks mid-stream, one that resets: afterwards the router holds nothing."""
    import random

    async with serving(3, stub_options={"token_delay": 0.005}) as h:
        h.engines["w1"].fail = "midstream"
        rng = random.Random(7)

        async def one(i: int) -> None:
            stream = rng.random() < 0.7
            if rng.random() < 0.3:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"q{i % 5}"}],
                    "stream": stream,
                    "max_tokens": rng.randint(1, 30),
                }
                path = "/v1/chat/completions"
            else:
                body = {
                    "model": MODEL,
                    "prompt": prompt(rng.randint(1, 6), i % 5),
                    "stream": stream,
                    "max_tokens": rng.randint(1, 30),
                }
                path = "/v1/completions"
            hang_up = stream and rng.random() < 0.2
            async with h.session.post(h.url + path, json=body) as r:
                if hang_up:
                    await r.content.readany()
                    r.close()
                    return
                await r.read()
                assert r.status in (200, 502), r.status

        async def flip_reset() -> None:
            await asyncio.sleep(0.05)
            h.engines["w2"].fail = "reset"
            await asyncio.sleep(0.1)
            h.engines["w2"].fail = None

        await asyncio.gather(flip_reset(), *(one(i) for i in range(100)))
        await eventually(lambda: h.router.stats()["active_requests"] == 0)
        h.assert_idle()
        stats = h.router.stats()
        assert (
            stats["load_unknown_request_updates"] == 0 and stats["load_duplicate_request_ids"] == 0
        )


async def test_chunked_body_over_the_limit_is_413():
    settings = ServeSettings(max_body_bytes=4096, health_interval=0)
    async with serving(1, settings=settings) as h:

        async def chunks():
            yield b'{"model": "stub-model", "prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        async with h.session.post(h.url + "/v1/completions", data=chunks()) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "body_too_large"
        assert not h.engines["w0"].requests
        h.assert_idle()


async def test_unknown_paths_and_methods_are_openai_errors():
    async with serving(1) as h:
        async with h.session.get(h.url + "/v1/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        async with h.session.post(h.url + "/v1/embeddings", json={}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_api_keys():
    settings = ServeSettings(api_key="front-key", engine_api_key="engine-key", health_interval=0)
    async with serving(1, settings=settings) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp, raw = await h.complete([1, 2, 3], headers=headers)
            assert resp.status == 401
            assert json.loads(raw)["error"]["code"] == "invalid_api_key"
        async with h.session.get(h.url + "/v1/models") as r:
            assert r.status == 401
        async with h.session.get(h.url + "/health") as r:
            assert r.status == 200  # probes need no key
        assert not h.engines["w0"].requests
        resp, _ = await h.complete([1, 2, 3], headers={"Authorization": "Bearer front-key"})
        assert resp.status == 200
        assert h.engines["w0"].requests[-1]["headers"]["Authorization"] == "Bearer engine-key"
        h.assert_idle()
    # without kvplug keys the client's header goes to the engine unchanged
    async with serving(1) as h:
        await h.complete([1, 2, 3], headers={"Authorization": "Bearer client"})
        assert h.engines["w0"].requests[-1]["headers"]["Authorization"] == "Bearer client"


async def test_approximate_mode_for_engines_without_events():
    """--no-router-kv-events with 'openai' engines (no event source): kvplug remembers what it
    routed where, so a follow-up sharing the prefix goes back to the same engine."""
    async with serving(3, engine_kind="openai", router_config={"router_kv_events": False}) as h:
        a, b = prompt(8, 21), prompt(8, 22)
        homes = {}
        for name, p in (("a", a), ("b", b)):
            resp, _ = await h.complete(p)
            homes[name] = resp.headers["x-kvplug-worker"]
        assert h.router.stats()["events_applied"] == 0  # nothing came from the engines
        for _ in range(3):
            for name, p in (("a", a), ("b", b)):
                resp, _ = await h.complete(p + prompt(1, 99))
                assert resp.headers["x-kvplug-worker"] == homes[name]
        h.assert_idle()


async def test_an_engine_without_tokenize_is_not_asked_again():
    async with serving(2, settings=ServeSettings(health_interval=0)) as h:
        for engine in h.engines.values():
            engine.has_tokenize = False
        for _ in range(4):
            resp, raw = await h.complete("a text prompt that needs token ids")
            assert resp.status == 200, raw
        # each engine answered 404 once; later text requests go straight to load routing
        assert [e.tokenize_calls for e in h.engines.values()] == [1, 1]
        h.assert_idle()


async def test_long_text_prompts_use_the_prefix_tokenization_cache(tmp_path):
    """Repeated long text is tokenized once; /metrics shows the cache's hits and that it is on,
    and the trace's token count is the whole text's."""
    from test_frontend_units import make_tokenizer_dir

    from kvplug.frontend.tokens import LocalTokenizer

    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    shared = " ".join(["hello world hi"] * 60)  # ~900 characters
    async with serving(1, tokenizer=tok) as h:
        for tail in ("hello", "world hi"):
            resp, _ = await h.complete(f"{shared} {tail}", headers={})
            assert resp.status == 200
            trace = await h.trace(resp.headers["x-kvplug-decision-id"])
            assert trace["tokens"]["count"] == len(tok._encode(f"{shared} {tail}", True))
        async with h.session.get(h.url + "/metrics") as r:
            text = await r.text()
    assert 'kvplug_router_stat{stat="tokenizer_cache.enabled"} 1.0' in text
    hits = next(ln for ln in text.splitlines() if 'stat="tokenizer_cache.chunk_hits"' in ln)
    assert float(hits.split()[-1]) > 0


@pytest.mark.parametrize("data_path", ["python", "native"])
async def test_a_multi_rank_worker_is_told_the_rank_kvplug_chose(data_path):
    """A worker whose URL serves several DP ranks (vLLM's internal or hybrid load balancing,
    SGLang with DP) gets ``X-Data-Parallel-Rank``: the rank's index behind that URL, which
    vLLM 0.32 and SGLang 0.5.23 serve the request on. One-rank workers get no such header."""
    settings = ServeSettings(health_interval=0.2, health_timeout=5.0, data_path=data_path)
    async with serving([{"id": "w1", "dp_start": 4, "dp_size": 2}], settings=settings) as h:
        ranks = set()
        for i in range(6):  # plain requests: the native lane forwards these itself
            resp, _ = await h.complete(prompt(3 + i, 13))
            assert resp.status == 200
            rank = int(resp.headers["x-kvplug-dp-rank"])
            ranks.add(rank)
            seen = h.engines["w1"].requests[-1]["headers"]
            assert seen.getall("X-Data-Parallel-Rank") == [str(rank - 4)]
        assert ranks == {4, 5}  # both ranks were chosen, and each named as such
        if data_path == "native":
            assert h.running.native.lane.stats()["served"] >= 6
        h.assert_idle()
    async with serving(1, settings=settings) as h:
        resp, _ = await h.complete(prompt(3, 14))
        assert "X-Data-Parallel-Rank" not in h.engines["w0"].requests[-1]["headers"]


async def test_kvplug_asks_an_engine_to_tokenize_with_the_engine_key():
    """``--engine-api-key`` goes with kvplug's own ``/tokenize`` calls as with the requests:
    an engine started with an API key (SGLang guards every route with it) answers them."""
    settings = ServeSettings(health_interval=0.2, health_timeout=5.0, engine_api_key="k")
    async with serving(1, settings=settings) as h:
        resp, _ = await h.complete("some text prompt")
        assert resp.status == 200
        assert h.engines["w0"].tokenize_auth == ["Bearer k"]
        assert h.engines["w0"].requests[-1]["headers"]["Authorization"] == "Bearer k"
