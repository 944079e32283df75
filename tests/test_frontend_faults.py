"""Sick engines behind ``kvplug serve`` (stub engines over real HTTP on loopback): timeouts
(connect / per-try / idle / request / stream, in Envoy's vocabulary), client hang-ups, outlier
ejection, and bounded engine tokenization. Each test pins one defect of issue 9, section 4."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from test_frontend_harness import MODEL, prompt, serving

from kvplug.frontend.app import ServeSettings
from kvplug.frontend.outliers import OutlierSettings

pytestmark = pytest.mark.timeout(60)


def _settings(**kw) -> ServeSettings:
    # health_timeout: a probe answered late on a loaded machine must not take a worker out
    return ServeSettings(**{"health_interval": 0.2, "health_timeout": 5.0, **kw})


async def _until(check, timeout: float = 15.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        await asyncio.sleep(interval)
    return check()


async def _metrics(h) -> str:
    async with h.session.get(h.url + "/metrics") as r:
        return await r.text()


# -- 1. timeouts ---------------------------------------------------------------------------
async def test_a_trickling_engine_meets_the_total_request_timeout():
    """A byte every 50 ms keeps every per-read timeout happy; the total deadline still ends
    the request with a 504, closes the engine's request and frees the load."""
    async with serving(1, settings=_settings(request_timeout=0.8)) as h:
        h.engines["w0"].fail = "trickle"
        t0 = time.monotonic()
        resp, raw = await asyncio.wait_for(h.complete(prompt(2, 1)), 30)
        took = time.monotonic() - t0
        assert resp.status == 504, raw
        err = json.loads(raw)["error"]
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"]
        assert 0.7 < took < 10.0, took  # the trickle never ends: only the deadline ends it
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["outcome"] == "timeout" and trace["status"] == 504
        assert await _until(lambda: h.engines["w0"].cancelled == 1)  # the engine was told
        h.assert_idle()
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="504"} 1.0' in (
            await _metrics(h)
        )


async def test_a_batched_completion_meets_the_total_request_timeout():
    async with serving(2, settings=_settings(request_timeout=0.8)) as h:
        h.engines["w1"].fail = "trickle"
        batch = [prompt(1, 7), prompt(1, 8), prompt(1, 9)]
        resp, raw = await asyncio.wait_for(h.complete(batch), 10)
        assert resp.status == 504 and json.loads(raw)["error"]["code"] == "request_timeout"
        assert await _until(lambda: h.engines["w1"].cancelled >= 1)
        h.assert_idle()


async def test_a_streams_deadline_ends_at_its_first_byte_then_max_stream_duration():
    # a 1.5 s stream between the 1 s request timeout and the 4 s stream limit: seconds of
    # slack on either side, so a slow machine cannot push it over (0.4 s in 0.6 s could)
    settings = _settings(request_timeout=1.0, max_stream_duration=4.0)
    async with serving(1, settings=settings, stub_options={"token_delay": 0.05}) as h:
        # a stream that runs past the request timeout is fine: its first byte came in time
        resp, raw = await h.complete(prompt(2, 2), stream=True, max_tokens=30)
        assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n")
        # ... but not past --max-stream-duration (1000 tokens: 50 s): an error event ends it
        resp, raw = await asyncio.wait_for(
            h.complete(prompt(2, 3), stream=True, max_tokens=1000), 30
        )
        assert resp.status == 200
        last = [e for e in raw.split(b"\n\n") if e][-1]
        err = json.loads(last[len(b"data: ") :])["error"]
        assert err["code"] == 504 and "--max-stream-duration" in err["message"]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["outcome"] == "stream_timeout"
        assert await _until(lambda: h.engines["w0"].cancelled == 1)
        h.assert_idle()
        # a stream whose engine never sends its first byte: 504 at the request timeout
        h.engines["w0"].fail = "hang"
        resp, raw = await asyncio.wait_for(h.complete(prompt(2, 4), stream=True), 30)
        assert resp.status == 504 and json.loads(raw)["error"]["code"] == "request_timeout"
        assert await _until(lambda: h.engines["w0"].cancelled == 2)
        h.assert_idle()


async def test_per_try_timeout_retries_a_hung_engine_elsewhere():
    # per-try 1 s (w1 must answer within it too, slow machine or not); the whole request
    # must take the per-try timeout and far less than the 30 s request timeout
    settings = _settings(per_try_timeout=1.0, request_timeout=30.0)
    async with serving(2, settings=settings) as h:
        a = prompt(6, 5)
        await h.complete(a, headers={"x-kvplug-worker": "w0"})  # w0 holds the prefix
        h.engines["w0"].fail = "hang"  # /health still answers
        t0 = time.monotonic()
        resp, raw = await h.complete(a)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "w1"
        assert 0.95 < time.monotonic() - t0 < 15.0
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        first = await h.trace(trace["related_decisions"][0])
        assert first["worker_id"] == "w0" and first["outcome"] == "unavailable"
        assert "per-try timeout" in first["error"]
        assert await _until(lambda: h.engines["w0"].cancelled == 1)
        h.assert_idle()


# -- 2. client hang-ups --------------------------------------------------------------------
async def test_clients_that_hang_up_on_silent_engines_release_everything():
    """16 clients give up on two hung engines: every engine request is closed and the
    router's load is back to zero at once, not after --request-timeout."""
    async with serving(2, settings=_settings(request_timeout=600.0)) as h:
        for e in h.engines.values():
            e.fail = "hang"
        clients = [aiohttp.ClientSession() for _ in range(16)]
        try:
            tasks = [
                asyncio.create_task(
                    c.post(
                        h.url + "/v1/completions",
                        json={"model": MODEL, "prompt": prompt(1, 10 + i), "stream": i % 2 == 0},
                    )
                )
                for i, c in enumerate(clients)
            ]
            assert await _until(lambda: sum(len(e.requests) for e in h.engines.values()) == 16)
            assert h.router.stats()["active_requests"] == 16
            for t in tasks:
                t.cancel()
            for c in clients:
                await c.close()
        finally:
            for c in clients:
                await c.close()
        # at once, not after the 600 s --request-timeout
        assert await _until(lambda: h.router.stats()["active_requests"] == 0, timeout=15.0)
        assert await _until(lambda: sum(e.cancelled for e in h.engines.values()) == 16)
        h.assert_idle()
        text = await _metrics(h)
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="499"} 16.0' in text
        assert "kvplug_inflight_requests 0.0" in text
        assert not h.frontend.fleet.unhealthy  # a client leaving says nothing of the engine


# -- 3. outlier detection ------------------------------------------------------------------
async def test_an_engine_that_fails_requests_but_answers_health_is_ejected_and_returns():
    # 3 s: the requests after the ejection must all see it; a 0.6 s ejection could end
    # under them on a slow machine (and a passing probe would bring w0 back)
    outliers = OutlierSettings(consecutive_failures=3, base_ejection_time=3.0)
    async with serving(2, settings=_settings(outliers=outliers)) as h:
        a = prompt(6, 20)
        await h.complete(a, headers={"x-kvplug-worker": "w0"})  # w0 holds the prefix
        h.engines["w0"].fail = "http500"
        workers = []
        for i in range(6):
            resp, _ = await h.complete(a + prompt(1, 30 + i))
            workers.append((resp.headers["x-kvplug-worker"], resp.status))
        # three 500s pass through, then w0 is out of rotation although /health answers
        assert workers[:3] == [("w0", 500)] * 3 and workers[3:] == [("w1", 200)] * 3
        assert h.frontend.fleet.workers["w0"].down_by == {"outlier"}
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        ejected = trace["unhealthy_workers"]["w0"]
        assert ejected["down_by"] == ["outlier"] and "3 consecutive failures" in ejected["reason"]
        text = await _metrics(h)
        assert 'kvplug_outlier_ejections_total{worker="w0"} 1.0' in text
        assert 'kvplug_worker_ejected{worker="w0"} 1.0' in text
        h.assert_idle()
        # the engine recovers; after the ejection time a passing probe brings it back
        h.engines["w0"].fail = None
        assert await _until(lambda: not h.frontend.fleet.unhealthy)
        resp, _ = await h.complete(a)
        assert resp.status == 200
        assert (await h.trace(resp.headers["x-kvplug-decision-id"]))["unhealthy_workers"] == {}
        # it fails again: the second ejection lasts twice as long (back-off)
        h.engines["w0"].fail = "http500"
        for i in range(3):
            await h.complete(a + prompt(1, 40 + i), headers={"x-kvplug-worker": "w0"})
        state = h.frontend.outliers.describe("w0")
        assert state["ejected"] and state["ejections"] == 2
        assert 3.0 < state["ejected_for_s"] <= 6.0  # 2 x 3 s, less the time since
        h.assert_idle()


async def test_hung_engine_is_ejected_by_consecutive_per_try_timeouts():
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_time=30.0)
    settings = _settings(per_try_timeout=1.0, outliers=outliers)
    async with serving(2, settings=settings) as h:
        a = prompt(6, 21)
        await h.complete(a, headers={"x-kvplug-worker": "w0"})
        h.engines["w0"].fail = "hang"
        for i in range(2):
            resp, _ = await h.complete(a + prompt(1, 50 + i))
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1"
            # the passing probe clears a one-off request failure, not an ejection
            await _until(lambda: "request" not in h.frontend.fleet.workers["w0"].down_by)
        assert "outlier" in h.frontend.fleet.workers["w0"].down_by
        await asyncio.sleep(0.5)  # probes keep passing; w0 stays out
        tried = len(h.engines["w0"].requests)
        resp, _ = await h.complete(a)
        assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1"
        # straight to w1: w0 (holding the prefix) was not tried first and timed out
        assert len(h.engines["w0"].requests) == tried
        assert (await h.trace(resp.headers["x-kvplug-decision-id"]))["attempt"] == 0
        h.assert_idle()


async def test_an_ejected_engine_that_went_down_and_came_back_returns_at_once():
    """A crash ejects (its broken streams and refused connections are consecutive failures);
    the restarted process, seen down and then up by the probes, starts with a clean record."""
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_time=30.0)
    async with serving(2, settings=_settings(outliers=outliers)) as h:
        w0 = h.engines["w0"]
        w0.fail = "http500"
        for i in range(2):
            await h.complete(prompt(1, 70 + i), headers={"x-kvplug-worker": "w0"})
        entry = h.frontend.fleet.workers["w0"]
        assert entry.down_by == {"outlier"}
        w0.fail = "unhealthy"  # down: its health path fails too
        assert await _until(lambda: "probe" in entry.down_by)
        w0.fail = None  # back up, as a new process
        assert await _until(lambda: entry.healthy)  # within 15 s: not after the 30 s ejection
        h.assert_idle()


async def test_a_prefill_engine_that_answers_5xx_is_ejected():
    """Each 5xx prefill falls back to decode-only (the request still works, slower); after
    two in a row the sick prefill engine is out and requests get two stages again."""
    pd = [
        {"id": "p0", "role": "prefill"},
        {"id": "p1", "role": "prefill"},
        {"id": "d0", "role": "decode"},
        {"id": "d1", "role": "decode"},
    ]
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_time=30.0)
    async with serving(pd, settings=_settings(outliers=outliers)) as h:
        h.engines["p0"].fail = "http500"
        prefill = []
        for i in range(10):
            resp, _ = await h.complete(prompt(2, 80 + i))
            assert resp.status == 200
            prefill.append(resp.headers.get("x-kvplug-prefill-worker"))
        assert h.frontend.fleet.workers["p0"].down_by == {"outlier"}
        assert prefill[-4:] == ["p1"] * 4
        assert prefill.count(None) == 2  # the two fallbacks that ejected p0
        h.assert_idle()


async def test_5xx_answers_to_batched_prompts_count_toward_ejection():
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_time=30.0)
    async with serving(2, settings=_settings(outliers=outliers)) as h:
        h.engines["w1"].fail = "http500"
        for i in range(2):
            batch = [prompt(1, 90 + i), prompt(1, 95 + i)]
            resp, _ = await h.complete(batch, headers={"x-kvplug-worker": "w1"})
            assert resp.status == 500
        assert h.frontend.fleet.workers["w1"].down_by == {"outlier"}
        h.assert_idle()


async def test_max_ejection_percent_keeps_the_fleet_serving():
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_time=30.0)
    async with serving(2, settings=_settings(outliers=outliers)) as h:
        for e in h.engines.values():
            e.fail = "http500"
        for i in range(8):
            await h.complete(prompt(1, 60 + i))
        # 10 %: one worker may be ejected, never the whole fleet
        assert len(h.frontend.fleet.unhealthy) == 1
        h.assert_idle()


# -- 4. engine tokenization ----------------------------------------------------------------
async def test_a_huge_text_prompt_is_refused_before_an_engines_tokenize():
    async with serving(2) as h:
        big = "x" * 2_000_000  # over the default --max-tokenize-chars (1,000,000)
        small = [h.complete(f"small prompt {i}") for i in range(40)]
        results = await asyncio.gather(h.complete(big), *small)
        resp, raw = results[0]
        assert resp.status == 413, raw[:200]
        err = json.loads(raw)["error"]
        assert err["code"] == "prompt_too_large" and "--max-tokenize-chars" in err["message"]
        assert [r.status for r, _ in results[1:]] == [200] * 40
        assert not h.frontend.fleet.unhealthy
        assert sum(e.tokenize_calls for e in h.engines.values()) == 40  # the big one: never
        h.assert_idle()
        text = await _metrics(h)
        assert 'kvplug_rejected_requests_total{reason="prompt_too_large"} 1.0' in text


async def test_engine_tokenization_is_bounded_in_concurrency():
    # one call (1.5 s) fits in a wait for the slot (2.5 s) with a second of slack; two in a
    # row (3 s) never do
    settings = _settings(tokenize_concurrency=1, tokenize_timeout=2.5)
    async with serving(1, settings=settings) as h:
        engine = h.engines["w0"]
        engine.tokenize_delay = 1.5  # two calls in a row outlast one wait for a slot
        results = await asyncio.gather(*(h.complete(f"text {i}") for i in range(3)))
        assert [r.status for r, _ in results] == [200] * 3  # routed on load if not tokenized
        assert engine.tokenize_peak == 1
        sources = [(await h.trace(r.headers["x-kvplug-decision-id"]))["tokens"] for r, _ in results]
        # one after the other through the single slot; the third waited longer than
        # --tokenize-timeout for it, was routed on load, and its trace says why
        assert sorted(s["source"] for s in sources) == ["engine", "engine", "none"]
        assert sum("--tokenize-concurrency" in (s["note"] or "") for s in sources) == 1
        assert not h.frontend.fleet.unhealthy  # slow tokenization is not a dead engine
        h.assert_idle()


async def test_engine_tokenization_avoids_an_engine_that_is_slow_to_answer():
    """Least outstanding calls first: once a slow (or hung) engine holds a call, the next
    requests are tokenized elsewhere instead of queueing behind it."""
    async with serving(2, settings=_settings(tokenize_timeout=6.0)) as h:
        slow, fast = h.engines["w0"], h.engines["w1"]
        # /health still answers; it holds its call for longer than the arrivals can take on a
        # slow machine (after it answers it is no longer "outstanding" and could be picked)
        slow.tokenize_delay = 3.0
        tasks = []
        for i in range(12):  # arrivals over 0.6 s
            tasks.append(asyncio.create_task(h.complete(f"text {i}")))
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks)
        assert [r.status for r, _ in results] == [200] * 12
        assert slow.tokenize_calls <= 1 and fast.tokenize_calls >= 11
        h.assert_idle()


async def test_one_failed_health_probe_does_not_take_a_worker_out():
    settings = _settings(health_interval=0)  # probes only when this test asks
    async with serving(1, settings=settings) as h:
        entry = h.frontend.fleet.workers["w0"]
        h.engines["w0"].fail = "unhealthy"
        await h.frontend.prober.probe(entry)
        assert entry.healthy  # one slow or failed answer: still in rotation
        await h.frontend.prober.probe(entry)
        assert not entry.healthy and entry.down_by == {"probe"}  # two in a row: out
        h.engines["w0"].fail = None
        await h.frontend.prober.probe(entry)
        assert entry.healthy
