"""The admission queue (``--router-queue-threshold``) in ``kvplug serve`` over real HTTP: requests
are held while every eligible worker is over threshold and released, in policy order, as load
drops; full queue, waiting too long and hanging up while waiting."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from test_frontend_harness import MODEL, prompt, serving

pytestmark = pytest.mark.timeout(60)

# one worker with a 64-token budget; threshold 0.5: busy above 32 active prefill tokens
ONE_WORKER = [{"id": "w0", "max_batched_tokens": 64}]


def queue_config(policy: str = "fcfs", **extra) -> dict:
    return {"router_queue_threshold": 0.5, "router_queue_policy": policy, **extra}


async def until(predicate, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def hold_the_fleet(h, n_blocks: int = 4):
    """A request on the gated engine: its prompt stays active prefill load until the gate."""
    engine = h.engines["w0"]
    engine.gate = asyncio.Event()
    headers = {"X-Request-Id": "hog", "x-kvplug-worker": "w0"}
    hog = asyncio.create_task(h.complete(prompt(n_blocks, 99), headers=headers))
    await until(lambda: len(engine.requests) == 1)
    return engine, hog


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("fcfs", [5, 3, 4]),  # arrival order
        ("lcfs", [4, 3, 5]),  # newest first
        ("wspt", [3, 4, 5]),  # shortest (uncached) prompt first
    ],
)
async def test_held_while_over_threshold_then_released_in_policy_order(policy, expected):
    async with serving(ONE_WORKER, router_config=queue_config(policy)) as h:
        q = h.frontend.queue
        assert q is not None
        q.recheck_interval = 30.0  # releases must come from load events, not the periodic check
        engine, hog = await hold_the_fleet(h)
        assert h.router.active_load("w0")[0]["prefill_tokens"] == 64  # > 32: busy
        waiting = []
        for i, n_blocks in enumerate([5, 3, 4]):  # every one is over 32 tokens on its own
            waiting.append(
                asyncio.create_task(
                    h.complete(prompt(n_blocks, i + 1), headers={"X-Request-Id": f"b{n_blocks}"})
                )
            )
            await until(lambda i=i: q.core.depth == i + 1)
        await asyncio.sleep(0.2)
        assert len(engine.requests) == 1  # held in kvplug, not sent
        assert q.core.depth == 3 and not any(t.done() for t in waiting)
        async with h.session.get(h.url + "/metrics") as resp:
            text = await resp.text()
        assert metric(text, "kvplug_router_queue_depth") == 3
        # load drops: the hog's first token releases its prompt-side load
        engine.gate.set()
        results = await asyncio.gather(hog, *waiting)
        assert all(resp.status == 200 for resp, _ in results)
        order = [r["headers"]["X-Request-Id"] for r in engine.requests[1:]]
        assert order == [f"b{n}" for n in expected]
        # each was routed only after the one before it had left prefill: decisions in order
        traces = {}
        for resp, _ in results:
            traces[resp.headers["X-Request-Id"]] = await h.trace(
                resp.headers["x-kvplug-decision-id"]
            )
        ids = [traces[f"b{n}"]["router"]["decision_id"] for n in expected]
        assert ids == sorted(ids)
        assert traces["hog"]["timings"]["queue_wait_s"] is None  # routed at once
        waits = [traces[f"b{n}"]["timings"]["queue_wait_s"] for n in expected]
        assert all(w is not None and w >= 0.2 for w in waits), waits
        h.assert_idle()
        assert q.core.depth == 0 and q.core.in_transit is None
        async with h.session.get(h.url + "/metrics") as resp:
            text = await resp.text()
        assert 'kvplug_router_queue_requests_total{outcome="queued"} 3.0' in text
        assert 'kvplug_router_queue_requests_total{outcome="released"} 3.0' in text
        assert 'kvplug_router_queue_wait_seconds_count{outcome="released"} 3.0' in text
        assert metric(text, "kvplug_router_queue_depth") == 0


async def test_not_queued_below_threshold_or_with_an_idle_eligible_worker():
    workers = [{"id": "w0", "max_batched_tokens": 64}, {"id": "w1", "max_batched_tokens": 64}]
    async with serving(workers, router_config=queue_config()) as h:
        q = h.frontend.queue
        engine, hog = await hold_the_fleet(h)
        # w0 is busy, w1 idle: not every eligible worker is over threshold
        resp, _ = await h.complete(prompt(2, 5))
        assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w1"
        assert q.core.counters["queued"] == 0
        # pinned to the busy worker: its only eligible worker is busy, so it waits
        pinned = asyncio.create_task(h.complete(prompt(2, 6), headers={"x-kvplug-worker": "w0"}))
        await until(lambda: q.core.depth == 1)
        engine.gate.set()
        resp, _ = await pinned
        assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w0"
        await hog
        h.assert_idle()


async def test_full_queue_is_529_and_waiting_too_long_is_503():
    # 3 s: the second request must find the first still queued; a 0.4 s wait could run out
    # before it arrives on a slow machine (then it is queued, not refused)
    cfg = queue_config(router_queue_max_length=1, router_queue_max_wait=3.0)
    async with serving(ONE_WORKER, router_config=cfg) as h:
        q = h.frontend.queue
        engine, hog = await hold_the_fleet(h)
        waiter = asyncio.create_task(h.complete(prompt(3, 1)))
        await until(lambda: q.core.depth == 1)
        resp, raw = await h.complete(prompt(3, 2))
        assert resp.status == 529, raw
        err = json.loads(raw)["error"]
        assert err["code"] == "queue_full" and "max-length 1" in err["message"]
        resp, raw = await waiter
        assert resp.status == 503, raw
        assert b"queue_timeout" in raw and b"--router-queue-max-wait" in raw
        assert q.core.depth == 0
        assert q.core.counters["timeout"] == 1 and q.core.counters["rejected_full"] == 1
        assert len(engine.requests) == 1  # neither reached the engine
        engine.gate.set()
        await hog
        h.assert_idle()
        async with h.session.get(h.url + "/metrics") as resp:
            text = await resp.text()
        assert 'kvplug_router_queue_requests_total{outcome="timeout"} 1.0' in text
        assert 'kvplug_router_queue_requests_total{outcome="rejected_full"} 1.0' in text


async def test_client_hanging_up_while_queued_leaves_the_queue():
    async with serving(ONE_WORKER, router_config=queue_config()) as h:
        q = h.frontend.queue
        engine, hog = await hold_the_fleet(h)
        body = {"model": MODEL, "prompt": prompt(3, 1), "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            leaving = asyncio.create_task(s.post(h.url + "/v1/completions", json=body))
            await until(lambda: q.core.depth == 1)  # queued: now the client hangs up
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
        await until(lambda: q.core.counters["cancelled"] == 1)
        assert q.core.depth == 0
        stays = asyncio.create_task(h.complete(prompt(3, 2), headers={"X-Request-Id": "stays"}))
        await until(lambda: q.core.depth == 1)
        engine.gate.set()
        resp, _ = await stays
        assert resp.status == 200
        await hog
        # the one that hung up never reached the engine
        assert [r["headers"]["X-Request-Id"] for r in engine.requests] == ["hog", "stays"]
        h.assert_idle()


async def test_latency_sensitivity_moves_a_request_ahead():
    async with serving(ONE_WORKER, router_config=queue_config("fcfs")) as h:
        q = h.frontend.queue
        engine, hog = await hold_the_fleet(h)
        tasks = []
        for i, jump in enumerate([0.0, 0.0, 30.0]):
            extra = {"nvext": {"agent_hints": {"latency_sensitivity": jump}}}
            tasks.append(
                asyncio.create_task(
                    h.complete(prompt(3, i + 1), headers={"X-Request-Id": f"r{i}"}, **extra)
                )
            )
            await until(lambda i=i: q.core.depth == i + 1)
        engine.gate.set()
        await asyncio.gather(hog, *tasks)
        assert [r["headers"]["X-Request-Id"] for r in engine.requests[1:]] == ["r2", "r0", "r1"]
        resp, raw = await h.complete(
            prompt(1, 9), nvext={"agent_hints": {"latency_sensitivity": "soon"}}
        )
        assert resp.status == 400 and b"latency_sensitivity" in raw
        h.assert_idle()


async def test_queue_off_by_default():
    async with serving(ONE_WORKER) as h:
        assert h.frontend.queue is None
        engine, hog = await hold_the_fleet(h)
        other = asyncio.create_task(h.complete(prompt(3, 1)))
        await until(lambda: len(engine.requests) == 2)  # sent at once despite the busy fleet
        engine.gate.set()
        for resp, _ in await asyncio.gather(hog, other):
            assert resp.status == 200
        h.assert_idle()


async def test_disaggregated_fleet_waits_for_the_prefill_workers():
    pd = [
        {"id": "p0", "role": "prefill", "max_batched_tokens": 64},
        {"id": "d0", "role": "decode"},  # unknown budget: would never count as busy
    ]
    async with serving(pd, router_config=queue_config()) as h:
        q = h.frontend.queue
        q.recheck_interval = 30.0
        prefill = h.engines["p0"]
        prefill.gate = asyncio.Event()
        hog = asyncio.create_task(h.complete(prompt(4, 1), headers={"X-Request-Id": "hog"}))
        await until(lambda: len(prefill.requests) == 1)
        # the busy check looks at the prefill stage's workers only
        second = asyncio.create_task(h.complete(prompt(3, 2), headers={"X-Request-Id": "two"}))
        await until(lambda: q.core.depth == 1)
        await asyncio.sleep(0.1)
        assert len(prefill.requests) == 1 and not h.engines["d0"].requests
        prefill.gate.set()  # the hog's prefill answers: its load is released, "two" goes
        for resp, raw in await asyncio.gather(hog, second):
            assert resp.status == 200, raw
            assert resp.headers["x-kvplug-prefill-worker"] == "p0"
        trace = await h.trace(second.result()[0].headers["x-kvplug-prefill-decision-id"])
        assert trace["timings"]["queue_wait_s"] > 0
        h.assert_idle()
        assert q.core.depth == 0 and q.core.in_transit is None


async def test_many_concurrent_requests_drain_and_leave_no_load():
    workers = [{"id": "w0", "max_batched_tokens": 64}, {"id": "w1", "max_batched_tokens": 64}]
    cfg = queue_config("wspt")
    async with serving(workers, router_config=cfg, stub_options={"token_delay": 0.005}) as h:
        q = h.frontend.queue

        async def hang_up(i: int) -> None:
            body = {"model": MODEL, "prompt": prompt(3, 500 + i), "max_tokens": 4}
            timeout = aiohttp.ClientTimeout(total=0.05)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                try:
                    async with s.post(h.url + "/v1/completions", json=body) as resp:
                        await resp.read()
                except asyncio.TimeoutError:
                    pass

        tasks = [
            asyncio.create_task(
                h.complete(prompt(2 + i % 4, i + 1), stream=bool(i % 2), max_tokens=6)
            )
            for i in range(40)
        ]
        hangups = [asyncio.create_task(hang_up(i)) for i in range(5)]
        results = await asyncio.gather(*tasks)
        await asyncio.gather(*hangups)
        assert all(resp.status == 200 for resp, _ in results)
        assert q.core.counters["queued"] > 0  # the fleet was over threshold at times
        await until(lambda: q.core.depth == 0 and h.router.stats()["active_requests"] == 0)
        assert q.core.in_transit is None
        c = q.core.counters
        assert c["queued"] == c["released"] + c["cancelled"] + c["timeout"]
        h.assert_idle()
