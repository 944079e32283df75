"""One ``kvplug serve`` in front of a mixed fleet: a vLLM-speaking, an SGLang-speaking and a
TensorRT-LLM-speaking simulated engine at once, added through the admin API, each with its own
event source (vLLM: ZMQ with replay, found via ``/kv_event_sources``; SGLang: ZMQ found via
``/server_info``; TRT-LLM: the draining ``POST /kv_cache_events`` poller), routed by one index.
The same with a real vLLM engine: ``tests/test_vllm_plugin_real.py``."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from mixed_engines import SglangSim, TrtllmSim
from test_frontend_harness import eventually
from vllm_helpers import wait_joined, wait_subscribed

from kvplug.config import RouterConfig
from kvplug.frontend.app import ServeSettings
from kvplug.frontend.server import start_frontend
from kvplug.router import Router
from kvplug.sim.server import FleetOptions, SimServer
from kvplug.testing import free_ports

pytestmark = pytest.mark.timeout(60)
BS = 16
MODEL = "mixed-model"
TOKEN = "mixed-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def doc(seed: int, blocks: int = 6) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BS)]


async def test_one_index_routes_a_mixed_fleet():
    router = Router(RouterConfig(kv_block_size=BS), rng=random.Random(0))
    running = await start_frontend(
        router,
        [],
        ServeSettings(health_interval=0.5, client_routing_hints="trust"),  # pins steer
        admin_token=TOKEN,
        admin_port=0,
    )
    port, events, replay = free_ports(3)
    vllm = SimServer(
        0,
        FleetOptions(
            engines=1,
            base_port=port,
            events_base_port=events,
            replay_base_port=replay,
            block_size=BS,
            speed=50.0,
            model=MODEL,
        ),
    )
    sglang, trtllm = SglangSim(MODEL, BS), TrtllmSim(MODEL, BS)
    await vllm.start()
    await sglang.start()
    await trtllm.start()
    engines = {
        "vllm-0": ("vllm", f"http://127.0.0.1:{port}"),
        "sglang-0": ("sglang", sglang.url),
        "trtllm-0": ("trtllm", trtllm.url),
    }
    try:
        async with aiohttp.ClientSession() as s:
            for wid, (kind, url) in engines.items():
                entry = {"id": wid, "engine": kind, "url": url}
                async with s.post(
                    running.admin_url + "/admin/workers", json=entry, headers=AUTH
                ) as r:
                    assert r.status == 201, await r.text()
            # each event source hears its engine before anything is published: a batch sent
            # before the ZMQ join is lost and nothing re-sends it (probes are dropped as
            # malformed, counted)
            adapters = running.frontend.fleet.adapters
            await asyncio.to_thread(wait_subscribed, adapters["vllm"].subscriber, [vllm.publisher])
            sglang_adapter = adapters["sglang"]
            await eventually(
                lambda: (
                    sglang_adapter._subscriber is not None
                    and sglang_adapter._subscriber.has_worker("sglang-0")
                )
            )
            await asyncio.to_thread(
                wait_joined,
                [lambda: sglang.pub.send_multipart([sglang.topic.encode()])],
                lambda: sglang_adapter._subscriber.stats()["malformed_frames"],
            )

            async def complete(prompt, pin=None):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                if pin:
                    body["nvext"] = {"backend_instance_id": pin}
                async with s.post(running.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    return r.headers["x-kvplug-worker"], r.headers["x-kvplug-decision-id"]

            async def index_blocks() -> float:
                async with s.get(running.url + "/metrics") as r:
                    text = await r.text()
                key = 'kvplug_router_stat{stat="index.blocks"} '
                return float(text.split(key)[1].split()[0]) if key in text else 0.0

            # each engine caches its own document (pinned), announced on its own event source
            for seed, wid in enumerate(engines, start=1):
                assert (await complete(doc(seed), pin=wid))[0] == wid
                deadline = time.monotonic() + 15
                while await index_blocks() < 6 * seed:
                    assert time.monotonic() < deadline, f"no events from {wid}"
                    await asyncio.sleep(0.05)
            # then one index sends each follow-up to the engine holding its prefix
            for seed, wid in enumerate(engines, start=1):
                worker, decision = await complete(doc(seed) + [7, 7, 7])
                assert worker == wid, (seed, wid, worker)
                async with s.get(f"{running.url}/kvplug/decisions/{decision}") as r:
                    assert (await r.json())["router"]["overlap_blocks"] == 6
            assert {sglang.requests, trtllm.requests} == {2}
    finally:
        await running.close()
        for e in (vllm, sglang, trtllm):
            await e.stop()
