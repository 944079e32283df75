"""The admin API over HTTP: bearer auth, add / drain / undrain / remove / list, loopback."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest
from test_frontend_harness import MODEL, eventually, prompt, serving

from kvplug.frontend.stub_engine import StubEngine, publish

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def admin(h, method: str, path: str, body=None, headers=AUTH):
    async with h.session.request(method, h.admin_url + path, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_admin_needs_the_bearer_token():
    async with serving(1, admin_token=TOKEN) as h:
        assert urlsplit(h.admin_url).hostname == "127.0.0.1"  # loopback by default
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path in (
                ("GET", "/admin/workers"),
                ("POST", "/admin/workers"),
                ("POST", "/admin/workers/w0/drain"),
                ("DELETE", "/admin/workers/w0"),
            ):
                status, body = await admin(h, method, path, {"url": "http://x:1"}, headers)
                assert status == 401 and body["error"]["code"] == "unauthorized"
        assert list(h.frontend.fleet.workers) == ["w0"]  # nothing changed
        status, body = await admin(h, "GET", "/admin/workers")
        assert status == 200 and [w["id"] for w in body["workers"]] == ["w0"]


async def test_admin_is_off_without_a_token():
    async with serving(1) as h:
        assert h.admin_url is None


async def test_admin_add_drain_undrain_remove():
    async with serving(1, admin_token=TOKEN) as h:
        extra = StubEngine("w9", block_size=16, model=MODEL)
        await extra.start()
        publish(extra)
        try:
            status, body = await admin(
                h,
                "POST",
                "/admin/workers",
                {"id": "w9", "url": extra.url, "engine": "stub", "labels": {"zone": "b"}},
            )
            assert status == 201 and body["id"] == "w9" and body["healthy"] is True
            assert body["labels"] == {"zone": "b"} and body["events_ready"] is True
            status, body = await admin(
                h, "POST", "/admin/workers", {"id": "w9", "url": extra.url, "engine": "stub"}
            )
            assert status == 409
            status, body = await admin(h, "POST", "/admin/workers", {"url": 5})
            assert status == 400 and body["error"]["code"] == "invalid_worker"
            status, body = await admin(
                h, "POST", "/admin/workers", {"url": "h:1", "engine": "warp-drive"}
            )
            assert status == 400 and "unknown engine kind" in body["error"]["message"]

            # the new worker takes requests, and its events reach the index
            resp, _ = await h.complete(prompt(4, 1), headers={"x-kvplug-worker": "w9"})
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "w9"
            resp, _ = await h.complete(prompt(4, 1))
            assert resp.headers["x-kvplug-worker"] == "w9"  # its prefix
            await h.complete(prompt(4, 2), headers={"x-kvplug-worker": "w9"})

            status, body = await admin(h, "POST", "/admin/workers/w9/drain")
            assert status == 200 and body["draining"] is True
            resp, _ = await h.complete(prompt(4, 1))
            assert resp.headers["x-kvplug-worker"] == "w0"  # draining: no new requests
            async with h.session.get(h.url + "/metrics") as r:
                assert 'kvplug_worker_draining{worker="w9"} 1.0' in await r.text()
            status, body = await admin(h, "POST", "/admin/workers/w9/undrain")
            assert status == 200 and body["draining"] is False
            resp, _ = await h.complete(prompt(4, 2))
            assert resp.headers["x-kvplug-worker"] == "w9"

            status, body = await admin(h, "DELETE", "/admin/workers/w9")
            assert status == 200 and body["id"] == "w9"
            assert "w9" not in h.router.workers and not extra.listeners
            status, body = await admin(h, "GET", "/admin/workers")
            assert [w["id"] for w in body["workers"]] == ["w0"]
            for method, path in (
                ("DELETE", "/admin/workers/w9"),
                ("POST", "/admin/workers/w9/drain"),
            ):
                status, body = await admin(h, method, path)
                assert status == 404 and body["error"]["code"] == "unknown_worker"
            resp, raw = await h.complete(prompt(4, 1), headers={"x-kvplug-worker": "w9"})
            assert resp.status == 400 and json.loads(raw)["error"]["code"] == "unknown_worker"
            h.assert_idle()
        finally:
            await extra.stop()


async def test_admin_add_of_an_unreachable_worker_marks_it_unhealthy():
    async with serving(1, admin_token=TOKEN) as h:
        status, body = await admin(
            h,
            "POST",
            "/admin/workers",
            {"id": "dead", "url": "http://127.0.0.1:1", "engine": "stub"},
        )
        assert status == 201 and body["healthy"] is False
        for _ in range(3):
            resp, _ = await h.complete(prompt(2, 2))
            assert resp.headers["x-kvplug-worker"] == "w0"
        h.assert_idle()


async def test_an_adapter_that_fails_to_start_leaves_nothing_behind():
    from kvplug.adapters import EngineAdapter, register_adapter, unregister_adapter
    from kvplug.errors import ConfigError

    class Broken(EngineAdapter):
        kind = "broken"

        async def start_worker(self, worker, sink):
            raise RuntimeError("no event source")

    register_adapter("broken", Broken)
    try:
        async with serving(1, admin_token=TOKEN) as h:
            status, body = await admin(
                h,
                "POST",
                "/admin/workers",
                {"id": "b", "url": "http://127.0.0.1:9", "engine": "broken"},
            )
            assert status == 400 and "no event source" in body["error"]["message"]
            assert "b" not in h.router.workers and "b" not in h.frontend.fleet.workers
        with pytest.raises(ConfigError, match="no event source"):
            async with serving(
                [{"id": "ok"}, {"id": "bad", "url": "http://127.0.0.1:9", "engine": "broken"}]
            ):
                pass
    finally:
        unregister_adapter("broken")


async def test_busy_threshold_at_run_time():
    workers = [{"id": "w0", "kv_capacity_blocks": 100}, {"id": "w1", "kv_capacity_blocks": 100}]
    async with serving(workers, admin_token=TOKEN) as h:
        status, body = await admin(h, "GET", "/admin/busy_threshold")
        assert status == 200 and body["active_decode_blocks_threshold"] is None
        for bad in (
            {"active_decode_blocks_threshold": "high"},
            {"nope": 1},
            {"active_prefill_tokens_threshold": -5},
            [1],
        ):
            status, body = await admin(h, "POST", "/admin/busy_threshold", bad)
            assert status == 400, bad
        # w0 busy: a request held at the engine's gate (a 1 s stream could end before the
        # checks below on a slow machine) holds 20 of its 100 blocks, over a 10% threshold
        h.engines["w0"].gate = asyncio.Event()
        task = asyncio.create_task(
            h.complete(prompt(20, 1), stream=True, max_tokens=20, headers={"x-kvplug-worker": "w0"})
        )
        await eventually(lambda: h.router.active_load("w0")[0]["inflight"] == 1)
        status, body = await admin(
            h, "POST", "/admin/busy_threshold", {"active_decode_blocks_threshold": 0.1}
        )
        assert status == 200 and body["active_decode_blocks_threshold"] == 0.1
        resp, _ = await h.complete(prompt(20, 1))  # its prefix is on w0, but w0 is busy
        assert resp.headers["x-kvplug-worker"] == "w1"
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert any(e["worker_id"] == "w0" for e in trace["router"]["excluded"])
        assert not task.done()
        h.engines["w0"].gate.set()
        resp, _ = await task
        assert resp.status == 200
        h.assert_idle()


async def test_engine_reported_capacity_reaches_the_router():
    import threading

    from kvplug.adapters import register_adapter, unregister_adapter
    from kvplug.frontend.stub_engine import StubAdapter

    sinks = {}

    class Sized(StubAdapter):
        kind = "sized"

        async def start_worker(self, worker, sink):
            await super().start_worker(worker, sink)
            sinks[worker.worker_id] = sink

    register_adapter("sized", Sized)
    try:
        workers = [{"id": "w0"}, {"id": "w1", "kv_capacity_blocks": 7}]
        async with serving(workers, engine_kind="sized", admin_token=TOKEN) as h:
            await h.complete(prompt(4, 3), headers={"x-kvplug-worker": "w0"})
            blocks_before = h.router.stats()["index"]["blocks"]
            await admin(h, "POST", "/admin/workers/w0/drain")
            # a scraper thread reports the engine's sizes
            t = threading.Thread(target=sinks["w0"].update_capacity, args=(1000, 8192))
            t.start()
            t.join()
            sinks["w1"].update_capacity(2000, 4096)  # from the loop thread
            await asyncio.sleep(0.05)
            w0, w1 = h.router.workers["w0"], h.router.workers["w1"]
            assert (w0.kv_capacity_blocks, w0.max_batched_tokens) == (1000, 8192)
            assert (w1.kv_capacity_blocks, w1.max_batched_tokens) == (7, 4096)  # config wins
            assert h.router.stats()["index"]["blocks"] == blocks_before  # index kept
            assert h.router.stats()["index_presized_blocks"] == 1007  # pre-sized for both
            resp, _ = await h.complete(prompt(4, 3))  # w0 is still draining
            assert resp.headers["x-kvplug-worker"] == "w1"
            h.assert_idle()
    finally:
        unregister_adapter("sized")
