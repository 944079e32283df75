"""The frontend with the real vLLM adapter (integrations/vllm: discovery, ZMQ KV events,
metrics, P/D bodies) in front of ``kvplug sim`` engines, which look like ``vllm serve``: events
in vLLM's wire format, ``/kv_event_sources``, vLLM metrics, and NIXL-shaped
``kv_transfer_params`` answers to a prefill request."""

from __future__ import annotations

import asyncio
import random
import struct
import time

import aiohttp
import pytest
from test_frontend_harness import eventually
from vllm_helpers import wait_subscribed

from kvplug.config import RouterConfig
from kvplug.frontend.app import ServeSettings
from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.server import start_frontend
from kvplug.router import Router
from kvplug.testing import free_port_runs

sim_server = pytest.importorskip("kvplug.sim.server")
pytestmark = pytest.mark.timeout(90)


async def _fleet(roles: list[str]):
    n = len(roles)
    http, events, replay = free_port_runs(n, 3)
    opts = sim_server.FleetOptions(
        engines=n,
        base_port=http,
        events_base_port=events,
        replay_base_port=replay,
        speed=20.0,
    )
    servers = await sim_server.start_fleet(opts)
    specs = [
        spec_from_mapping(
            {
                "id": f"{role[0]}{i}",
                "url": f"http://127.0.0.1:{s.port}",
                "engine": "vllm",
                "role": role,
            },
            "sim",
        )
        for i, (s, role) in enumerate(zip(servers, roles, strict=True))
    ]
    router = Router(RouterConfig(kv_block_size=opts.block_size), rng=random.Random(0))
    running = await start_frontend(router, specs, ServeSettings(health_interval=1.0))
    # the frontend's SUB sockets hear every engine before a test sends anything: a batch
    # published before the join is lost (ZMQ slow joiner), and nothing may follow it
    subscriber = running.frontend.fleet.adapters["vllm"].subscriber
    await asyncio.to_thread(wait_subscribed, subscriber, [s.publisher for s in servers])
    return servers, router, running, opts.model


async def _stop(servers, running):
    await running.close()
    for s in servers:
        await s.stop()


async def test_vllm_adapter_events_route_follow_ups():
    servers, router, running, model = await _fleet(["both", "both"])
    try:
        async with aiohttp.ClientSession() as http:
            doc = "A shared document about KV caches and routing. " * 30
            url = running.url + "/v1/completions"
            async with http.post(
                url, json={"model": model, "prompt": doc + "Q0", "max_tokens": 2}
            ) as r:
                assert r.status == 200
                home = r.headers["x-kvplug-worker"]
            await eventually(lambda: router.stats()["index"]["blocks"] > 0)  # via the SUB thread
            for i in range(1, 4):
                async with http.post(
                    url,
                    json={"model": model, "prompt": doc + f"Q{i}", "max_tokens": 2, "stream": True},
                ) as r:
                    assert r.status == 200 and r.headers["x-kvplug-worker"] == home
                    trace_id = r.headers["x-kvplug-decision-id"]
                    await r.read()
            async with http.get(f"{running.url}/kvplug/decisions/{trace_id}") as r:
                trace = await r.json()
            assert trace["tokens"]["source"] == "engine"  # no local tokenizer: /tokenize
            assert trace["router"]["overlap_blocks"] >= 80
            async with http.get(running.url + "/ready") as r:
                assert r.status == 200
        assert router.stats()["active_requests"] == 0
    finally:
        await _stop(servers, running)


async def test_vllm_adapter_two_stage_prefill_decode():
    servers, router, running, model = await _fleet(["prefill", "decode"])
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": model,
                "prompt": "Disaggregate me. " * 20,
                "max_tokens": 4,
                "stream": True,
            }
            async with http.post(
                running.url + "/v1/completions", json=body, headers={"X-Request-Id": "pd-sim-1"}
            ) as r:
                assert r.status == 200
                raw = await r.read()
                assert r.headers["x-kvplug-prefill-worker"] == "p0"
                assert r.headers["x-kvplug-worker"] == "d1"
                decision = r.headers["x-kvplug-decision-id"]
            assert raw.endswith(b"data: [DONE]\n\n")
            async with http.get(f"{running.url}/kvplug/decisions/{decision}") as r:
                trace = await r.json()
            assert trace["stage"] == "decode" and trace["fallback_reason"] is None
            assert trace["request_id"] == "pd-sim-1"
        assert router.stats()["active_requests"] == 0
    finally:
        await _stop(servers, running)


async def test_rejected_event_batches_are_counted_in_metrics():
    """Issue 9: drop and reject counters of the subscribers are in /metrics, not only in logs;
    a rejected batch costs only itself (its seq is consumed: no gap, no clear)."""
    servers, router, running, model = await _fleet(["both"])
    # issue 9's reproducer: [1.0, [[[...]]]] nested 2000 deep
    deep = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\x91" * 2000 + b"\xc0"
    try:
        async with aiohttp.ClientSession() as http:

            async def metrics() -> str:
                async with http.get(running.url + "/metrics") as r:
                    return await r.text()

            assert 'kvplug_worker_events_ready{worker="b0"} 1.0' in await metrics()
            pub = servers[0].publisher
            pub.publish_payload(deep)
            pub.publish_payload(b"\xc1")
            want = 'kvplug_event_drops_total{engine="vllm",reason="rejected_batches",worker="b0"}'
            deadline = time.monotonic() + 20
            while want + " 2.0" not in (text := await metrics()):
                assert time.monotonic() < deadline, text
                await asyncio.sleep(0.05)
            assert 'reason="decode.malformed_batches",worker="b0"} 2.0' in text
            assert 'reason="gaps",worker="b0"} 0.0' in text
            assert 'kvplug_worker_events_ready{worker="b0"} 1.0' in text
    finally:
        await _stop(servers, running)
