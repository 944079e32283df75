"""The sglang adapter end to end on loopback: /server_info discovery, ZMQ events through the
shared subscriber, /v1/loads (or Prometheus) load attributes, page-size refusal."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web
from kvplug.integrations.sglang.adapter import SglangAdapter
from kvplug.integrations.sglang.metrics import (
    attributes_from_loads,
    attributes_from_prometheus,
    kv_events_from_server_info,
    page_size_from_server_info,
)

from kvplug.adapters import PDContext
from kvplug.errors import ConfigError
from kvplug.events import BlockStored
from kvplug.workers import Role, Worker

DATA = Path(__file__).parent / "data" / "sglang"
_spec = importlib.util.spec_from_file_location("sglang_zmq_publisher", DATA / "zmq_publisher.py")
_PUB = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_PUB)
SglangPublisher, _free_base, golden = _PUB.SglangPublisher, _PUB._free_base, _PUB.golden
LOADS = json.loads((DATA / "v1_loads.json").read_text())
PROM = (DATA / "metrics_prometheus.txt").read_text()
INFO = json.loads((DATA / "server_info_0_5_23.json").read_text())


def test_loads_and_prometheus_give_the_same_attributes():
    a = attributes_from_loads(LOADS)
    assert a == {
        "running_requests": 8.0,
        "queue_depth": 1.0,
        "waiting_uncached_tokens": 512.0,
        "kv_used_tokens": 12288.0,
        "kv_total_tokens": 32768.0,
        "kv_usage": 0.5,
        "prefix_cache_hit_rate": pytest.approx(0.6),
    }
    b = attributes_from_prometheus(PROM)
    assert b == {
        "running_requests": 8.0,
        "queue_depth": 1.0,
        "kv_usage": 0.5,
        "prefix_cache_hit_rate": pytest.approx(0.6),
    }
    for bad in ({}, {"loads": []}, {"loads": [{"dp_rank": 0}]}, [1], {"loads": ["x"]}):
        with pytest.raises(ValueError):
            attributes_from_loads(bad)
    with pytest.raises(ValueError):
        attributes_from_prometheus("# nothing here\nother_metric 1\n")


# the label names SGLang 0.5.23's SchedulerMetricsCollector.init_new gives every gauge, with
# priority scheduling on and a DP engine
COLLECTOR_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "priority")


def sglang_collector_text(
    per_rank: dict[int | None, dict[str, Any]], *, pp_size: int, tp_per_rank: int
) -> str:
    """``/metrics`` as SGLang's scheduler collectors write it (prometheus_client, as SGLang):
    every scheduler of a DP rank emits (each pipeline stage; each TP rank with
    --enable-metrics-for-all-schedulers), labelled tp/pp/moe_ep rank, ``dp_rank`` on a DP
    engine; queue counts as ``_log_gauge_queue_count`` writes them: the total under
    ``priority=""``, then ``priority="<n>"`` per priority. A later pipeline stage's figures
    are made to differ (stage + 1) so that counting one is visible."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    dp = next(iter(per_rank)) is not None
    names = COLLECTOR_LABELS + (("dp_rank",) if dp else ())
    gauges = {
        name: Gauge(name, "doc", names, registry=registry)
        for name in (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:num_used_tokens",
            "sglang:cache_hit_rate",
        )
    }
    for dp_rank, figures in per_rank.items():
        for pp_rank in range(pp_size):
            for tp in range(tp_per_rank):
                tp_rank = (dp_rank or 0) * tp_per_rank + tp
                labels = {
                    "model_name": "qwen",
                    "engine_type": "unified",
                    "tp_rank": str(tp_rank),
                    "pp_rank": str(pp_rank),
                    "moe_ep_rank": str(tp_rank),
                    "priority": "",
                }
                if dp:
                    labels["dp_rank"] = str(dp_rank)
                for name, value in figures.items():
                    if isinstance(value, dict):  # a QueueCount: by priority
                        gauges[name].labels(**labels).set(sum(value.values()) + pp_rank)
                        for priority, count in value.items():
                            gauges[name].labels(**{**labels, "priority": str(priority)}).set(count)
                    else:
                        gauges[name].labels(**labels).set(value + pp_rank)
    return generate_latest(registry).decode()


def test_prometheus_counts_each_dp_rank_once():
    text = sglang_collector_text(
        {
            0: {
                "sglang:num_running_reqs": {0: 1, 5: 2},
                "sglang:num_queue_reqs": {0: 0, 5: 1},  # a known priority with none waiting
                "sglang:token_usage": 0.25,
                "sglang:num_used_tokens": 1000,
                "sglang:cache_hit_rate": 0.5,
            },
            1: {
                "sglang:num_running_reqs": {0: 5, 5: 0},
                "sglang:num_queue_reqs": {0: 0, 5: 0},
                "sglang:token_usage": 0.5,
                "sglang:num_used_tokens": 2000,
                "sglang:cache_hit_rate": 0.7,
            },
        },
        pp_size=2,
        tp_per_rank=2,
    )
    assert 'priority="5"' in text and 'pp_rank="1"' in text and 'dp_rank="1"' in text
    assert attributes_from_prometheus(text) == {
        "running_requests": 8.0,
        "queue_depth": 1.0,
        "kv_usage": 0.5,
        "kv_used_tokens": 3000.0,
        "prefix_cache_hit_rate": pytest.approx(0.6),
    }
    # no DP: one rank, its pipeline stages and TP ranks counted once
    single = sglang_collector_text(
        {None: {"sglang:num_running_reqs": {0: 3, 1: 4}, "sglang:num_queue_reqs": {0: 2}}},
        pp_size=3,
        tp_per_rank=4,
    )
    assert attributes_from_prometheus(single) == {"running_requests": 7.0, "queue_depth": 2.0}
    # a breakdown without its total (not what SGLang writes): the priorities summed
    no_total = 'sglang:num_running_reqs{priority="0"} 2\nsglang:num_running_reqs{priority="1"} 3\n'
    assert attributes_from_prometheus(no_total) == {"running_requests": 5.0}


def test_server_info_discovery():
    kv = kv_events_from_server_info(INFO, "http://10.0.0.7:30000")
    assert (kv.host, kv.port_base, kv.dp_size, kv.block_size, kv.topic) == (
        "10.0.0.7",
        5557,
        2,
        16,
        "kv",
    )
    assert (
        kv.endpoint(1) == "tcp://10.0.0.7:5558" and kv.replay_endpoint(1) == "tcp://10.0.0.7:5568"
    )
    concrete = {"kv_events": {**INFO["kv_events"], "endpoint_host": "::1"}}
    assert kv_events_from_server_info(concrete, "http://x:1").endpoint(0) == "tcp://[::1]:5557"
    assert kv_events_from_server_info({"page_size": 16}, "http://x:1") is None  # < 0.5.20
    assert page_size_from_server_info({"page_size": 16}) == 16
    with pytest.raises(ConfigError):
        kv_events_from_server_info({"kv_events": {"endpoint_port_base": "x"}}, "http://x:1")
    with pytest.raises(ConfigError):
        kv_events_from_server_info(
            {"kv_events": {"endpoint_port_base": 5557, "block_size": 0}}, "http://x:1"
        )


class FakeSglang:
    """An SGLang HTTP server's discovery and load endpoints (``new``: ≥ 0.5.20 shapes; else a
    0.5.5-era server: ``/get_server_info`` without ``kv_events``, Prometheus only)."""

    def __init__(
        self,
        port_base: int,
        *,
        new: bool = True,
        page_size: int = 4,
        dp_size: int = 1,
        api_key: str | None = None,
    ) -> None:
        self.api_key = api_key  # as SGLang's --api-key: every route wants the bearer
        self.refused = 0
        self.port_base = port_base
        self.new = new
        self.page_size = page_size
        self.dp_size = dp_size
        self.runner = None
        self.url = ""
        self.loads_hits = 0
        self.load_port_base: int | None = None

    async def server_info(self, request):
        if not self.new:
            raise web.HTTPNotFound()
        info = dict(INFO, page_size=self.page_size)
        info["kv_events"] = dict(
            INFO["kv_events"],
            endpoint_port_base=self.port_base,
            block_size=self.page_size,
            dp_size=self.dp_size,
            topic="kv",
        )
        info["kv_events"].pop("replay_endpoint_port_base")
        if self.load_port_base is not None:
            info["kv_events"].update(load_endpoint_port_base=self.load_port_base, load_topic="load")
        return web.json_response(info)

    async def get_server_info(self, request):
        return web.json_response({"page_size": self.page_size, "version": "0.5.5"})

    async def loads(self, request):
        self.loads_hits += 1
        if not self.new:
            raise web.HTTPNotFound()
        assert request.query.get("include") == "core"
        return web.json_response(LOADS)

    async def metrics(self, request):
        return web.Response(text=PROM, content_type="text/plain")

    @web.middleware
    async def check_key(self, request, handler):
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.refused += 1
            raise web.HTTPUnauthorized()
        return await handler(request)

    async def start(self):
        app = web.Application(middlewares=[self.check_key])
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.get_server_info)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self):
        await self.runner.cleanup()


class Sink:
    def __init__(self, worker_id, block_size):
        self.worker_id = worker_id
        self.block_size = block_size
        self.events = []
        self.attributes = []
        self.capacity = []  # update_capacity's kv_capacity_blocks, in call order

    def update_capacity(self, kv_capacity_blocks=None, max_batched_tokens=None):
        self.capacity.append(kv_capacity_blocks)

    def apply(self, e):
        self.events.append(e)

    def apply_many(self, events):
        self.events.extend(events)

    def apply_threadsafe(self, events):
        self.events.extend(events)  # list.extend is atomic under the GIL

    def set_attributes(self, values, ts=None):
        self.attributes.append(values)


async def _until(pred, nudge=None, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if nudge:
            nudge()
        await asyncio.sleep(0.05)
    return pred()


@pytest.mark.parametrize("new", [True, False], ids=["0.5.23", "0.5.5"])
async def test_adapter_discovers_subscribes_and_scrapes(new):
    base = _free_base(1)
    ctx = zmq.Context()
    pub = SglangPublisher(
        ctx, base, _free_base(1), topic_in_replies=True, topic=b"kv" if new else b""
    )
    fake = await FakeSglang(base, new=new).start()
    adapter = SglangAdapter(load_period=0.05)
    sink = Sink("sg", 4)
    # old servers do not advertise the publisher: the worker config names it
    worker = Worker(
        "sg", url=fake.url, engine="sglang", event_endpoint=None if new else f"tcp://*:{base}"
    )
    try:
        with pytest.raises(ConfigError, match="page size 4"):
            await adapter.start_worker(worker, Sink("sg", 16))
        await adapter.stop_worker("sg")
        await adapter.start_worker(worker, sink)
        assert adapter.events_ready("sg")
        pub.publish(golden("v0_5_15")[0])
        assert await _until(
            lambda: len(sink.events) >= 2 and sink.attributes, nudge=pub.resend_last
        )
        assert all(isinstance(e, BlockStored) for e in sink.events)
        assert [e.engine_hashes for e in sink.events][1] == [(-5) & (2**64 - 1)]
        want = attributes_from_loads(LOADS) if new else attributes_from_prometheus(PROM)
        assert sink.attributes[-1] == want
        # /v1/loads gives each rank's max_total_num_tokens (16,384 the largest): in 4-token
        # pages, once; the Prometheus gauges of older builds carry no capacity
        assert sink.capacity == ([16384 // 4] if new else [])
        await adapter.stop_worker("sg")
        assert not adapter.events_ready("sg")
    finally:
        await adapter.close()
        await fake.stop()
        pub.close()
        ctx.destroy(linger=0)  # never hangs on a socket left open by a failed test


async def test_unreachable_worker_is_discovered_later():
    base = _free_base(1)
    ctx = zmq.Context()
    pub = SglangPublisher(ctx, base, _free_base(1), topic_in_replies=True, topic=b"kv")
    fake = FakeSglang(base)
    adapter = SglangAdapter(load_period=0.05, discovery_retry=0.05, http_timeout=1.0)
    sink = Sink("late", 4)
    # the port the fake will listen on is not known before it starts: start, read, stop
    await fake.start()
    url = fake.url
    await fake.stop()
    try:
        await adapter.start_worker(Worker("late", url=url, engine="sglang"), sink)
        assert not adapter.events_ready("late")
        port = int(url.rsplit(":", 1)[1])
        app_runner = None
        app = web.Application()
        app.router.add_get("/server_info", fake.server_info)
        app.router.add_get("/v1/loads", fake.loads)
        app_runner = web.AppRunner(app)
        await app_runner.setup()
        await web.TCPSite(app_runner, "127.0.0.1", port).start()
        assert await _until(lambda: adapter.events_ready("late"))
        pub.publish(golden("v0_5_15")[0])
        assert await _until(lambda: len(sink.events) >= 2, nudge=pub.resend_last)
        await app_runner.cleanup()
    finally:
        await adapter.close()
        pub.close()
        ctx.destroy(linger=0)  # never hangs on a socket left open by a failed test


class LoadStat(msgspec.Struct, array_like=True, gc=False, tag=True):
    """SGLang 0.5.23's pushed load gauge, restated from its documented wire shape."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int | None = None
    num_waiting_uncached_tokens: int = 0
    num_total_tokens: int = 0
    max_running_requests: int = 0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0


async def test_pushed_load_channel_replaces_polling():
    base, load_base = _free_base(1), _free_base(1)
    ctx = zmq.Context()
    load_pub = ctx.socket(zmq.PUB)
    load_pub.setsockopt(zmq.LINGER, 0)
    load_pub.bind(f"tcp://127.0.0.1:{load_base}")
    fake = FakeSglang(base)
    fake.load_port_base = load_base
    await fake.start()
    # 3 s of silence before polling resumes: the pushes below come every 0.05 s, and a loaded
    # machine must not stretch a gap between two of them past it
    adapter = SglangAdapter(load_period=0.05, push_silence=3.0)
    sink = Sink("pushed", 4)
    payload = msgspec.msgpack.encode(LoadStat(4, 2, 1000, 4000, 0, 128, 1200, 256, 9, 9))
    assert msgspec.msgpack.decode(payload)[:6] == ["LoadStat", 4, 2, 1000, 4000, 0]
    seq = iter(range(10**6))

    def push():
        load_pub.send_multipart([b"load", next(seq).to_bytes(8, "big"), payload])

    try:
        await adapter.start_worker(Worker("pushed", url=fake.url, engine="sglang"), sink)
        want = {
            "running_requests": 4.0,
            "queue_depth": 2.0,
            "waiting_uncached_tokens": 128.0,
            "kv_used_tokens": 1000.0,
            "kv_total_tokens": 4000.0,
            "kv_usage": 0.25,
        }
        assert await _until(lambda: want in sink.attributes, nudge=push)
        # the pushed max_total_num_tokens, in pages (after /v1/loads' 16,384 before the pushes)
        assert sink.capacity[-1] == 4000 // 4
        hits = fake.loads_hits
        for _ in range(6):  # pushes keep flowing: no HTTP polling meanwhile
            push()
            await asyncio.sleep(0.05)
        assert fake.loads_hits == hits
        load_pub.send_multipart([b"load", next(seq).to_bytes(8, "big"), b"\xc1junk"])
        assert await _until(lambda: adapter._runs["pushed"].bad_pushes == 1)
        # the channel goes silent: /v1/loads polling resumes
        assert await _until(lambda: fake.loads_hits > hits)
    finally:
        await adapter.close()
        await fake.stop()
        load_pub.close(0)
        ctx.destroy(linger=0)  # never hangs on a socket left open by a failed test


@pytest.mark.parametrize(("registered", "engine", "rank"), [(1, 2, 0), (2, 4, 1)])
async def test_dp_aware_rooms_follow_the_engines_ranks_when_registered_with_fewer(
    registered, engine, rank, caplog
):
    """A prefill worker registered with fewer DP ranks than its engine runs (configured so,
    or registered before its engine answered): the routed rank sent with dp_aware must still
    be ``bootstrap_room % <engine ranks>``, or SGLang fails the prefill
    (follow_bootstrap_room conflict)."""
    fake = await FakeSglang(_free_base(engine), dp_size=engine).start()
    adapter = SglangAdapter(load_period=60.0)
    worker = Worker("p0", url=fake.url, engine="sglang", role=Role.PREFILL, dp_size=registered)

    def ctx(dp_aware):
        options = {"dp_aware": True} if dp_aware else {}
        return PDContext("r", "/v1/completions", worker, rank, options)

    body = {"model": "m", "prompt": [1, 2, 3]}
    try:
        await adapter.start_worker(worker, Sink("p0", 4))
        for _ in range(50):
            hop = adapter.prefill_request(body, ctx(True))
            assert hop["routed_dp_rank"] == rank == hop["bootstrap_room"] % engine
            assert hop["bootstrap_room"] % registered == rank
        rooms = {adapter.prefill_request(body, ctx(False))["bootstrap_room"] for _ in range(50)}
        assert {r % registered for r in rooms} == {rank}
        if registered == 1:  # no routed rank sent: the room alone picks the engine's rank
            assert {r % engine for r in rooms} == set(range(engine))
        else:  # the frontend sends X-Data-Parallel-Rank (the rank) to a multi-rank worker
            assert {r % engine for r in rooms} == {rank}
        assert f"the engine runs {engine} DP rank(s)" in caplog.text  # and says what to set
    finally:
        await adapter.close()
        await fake.stop()


async def test_an_engine_started_with_an_api_key_is_discovered_and_polled_with_it():
    """SGLang's ``--api-key`` guards ``/server_info`` and ``/v1/loads`` too: the adapter's own
    calls carry ``engine_headers`` (kvplug serve's ``--engine-api-key``), or discovery fails."""
    base = _free_base(1)
    fake = await FakeSglang(base, api_key="k").start()
    worker = Worker("sg", url=fake.url, engine="sglang")
    without = SglangAdapter(load_period=0.05, discovery_retry=0.05)
    try:
        await without.start_worker(worker, Sink("sg", 4))
        assert not without.events_ready("sg") and fake.refused > 0
    finally:
        await without.close()
    adapter = SglangAdapter(load_period=0.05)
    adapter.engine_headers = {"Authorization": "Bearer k"}
    sink = Sink("sg", 4)
    try:
        refused = fake.refused
        await adapter.start_worker(worker, sink)
        assert adapter.events_ready("sg")
        assert await _until(lambda: sink.attributes)
        assert sink.attributes[-1] == attributes_from_loads(LOADS)
        assert fake.refused == refused
    finally:
        await adapter.close()
        await fake.stop()


async def test_kvplug_serve_gives_its_engine_key_to_the_adapters():
    from kvplug.config import RouterConfig
    from kvplug.frontend.app import Frontend, ServeSettings
    from kvplug.router import Router

    keyed = Frontend(Router(RouterConfig(kv_block_size=4)), ServeSettings(engine_api_key="k"))
    plain = Frontend(Router(RouterConfig(kv_block_size=4)), ServeSettings())
    for kind in ("sglang", "trtllm"):
        assert keyed.fleet.adapter_for(kind).engine_headers == {"Authorization": "Bearer k"}
        assert plain.fleet.adapter_for(kind).engine_headers == {}
    for fe in (keyed, plain):
        for adapter in fe.fleet.adapters.values():
            await adapter.close()
