"""The TRT-LLM poller and adapter against fake aiohttp workers with drain semantics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvplug.integrations.trtllm.adapter import TrtllmAdapter
from kvplug.integrations.trtllm.events import TrtllmDecoder
from kvplug.integrations.trtllm.poller import TrtllmPoller

from kvplug.errors import ConfigError
from kvplug.events import AllCleared, BlockRemoved, BlockStored
from kvplug.workers import Worker

DATA = Path(__file__).parent / "data" / "trtllm"


async def _until(cond, timeout: float = 15.0) -> None:
    """Poll until ``cond()`` holds (generous: milliseconds here, seconds on a loaded runner)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class FakeTrtllmWorker:
    """``trtllm-serve``'s event and metrics endpoints: every ``POST /kv_cache_events`` and
    ``GET /metrics`` drains its queue. Faults: answer ``fail_next`` with a 500 after draining,
    ``garbage_next`` with a broken body; ``hold`` delays answers (an idle 1.x poll)."""

    def __init__(self, *, prometheus: str | None = None) -> None:
        self.events: list = []
        self.iter_stats: list = []
        self.prometheus = prometheus
        self.fail_next = False
        self.garbage_next = False
        self.raw_answers: list[bytes] = []  # served verbatim, one per poll, before events
        self.hold = 0.0
        self.on_poll: Callable[[], None] | None = None  # called as each poll arrives
        self.inflight = 0
        self.max_inflight = 0
        self.polls = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def kv_cache_events(self, request: web.Request) -> web.Response:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            self.polls += 1
            if self.on_poll is not None:
                self.on_poll()
            if self.hold:
                await asyncio.sleep(self.hold)
            if self.raw_answers:
                return web.Response(body=self.raw_answers.pop(0), content_type="application/json")
            drained, self.events = self.events, []
            if self.fail_next:
                self.fail_next = False
                return web.Response(status=500, text="internal error")
            if self.garbage_next:
                self.garbage_next = False
                return web.Response(
                    body=b'[{"event_id": 3, "data": ', content_type="application/json"
                )
            return web.Response(
                body=json.dumps(drained, separators=(",", ":")).encode(),
                content_type="application/json",
            )
        finally:
            self.inflight -= 1

    async def metrics(self, request: web.Request) -> web.Response:
        drained, self.iter_stats = self.iter_stats, []
        return web.json_response(drained)

    async def prometheus_metrics(self, request: web.Request) -> web.Response:
        if self.prometheus is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.prometheus, content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def start(self) -> FakeTrtllmWorker:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self.kv_cache_events)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/prometheus/metrics", self.prometheus_metrics)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class RecordingSink:
    def __init__(self, worker_id: str, block_size: int, index=None) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.events: list = []
        self.attributes: list[dict] = []
        self.index = index
        self.capacity: list[int] = []  # update_capacity's kv_capacity_blocks, in call order

    def update_capacity(self, kv_capacity_blocks=None, max_batched_tokens=None) -> None:
        self.capacity.append(kv_capacity_blocks)

    def apply(self, event) -> None:
        self.apply_many([event])

    def apply_many(self, events) -> None:
        events = list(events)
        self.events.extend(events)
        if self.index is not None:
            self.index.apply_many(events)

    def apply_threadsafe(self, events) -> None:
        self.apply_many(events)

    def set_attributes(self, values, ts=None) -> None:
        self.attributes.append(dict(values))


def _drains():
    return json.loads((DATA / "gap_restart_drains.json").read_bytes())


@pytest.fixture
async def fake():
    worker = await FakeTrtllmWorker(
        prometheus=(DATA / "prometheus_metrics.txt").read_text()
    ).start()
    yield worker
    await worker.stop()


async def test_poller_follows_drains_gaps_and_restarts(fake):
    got: list = []
    async with aiohttp.ClientSession() as session:
        poller = TrtllmPoller(fake.url, TrtllmDecoder("t", 4), got.extend, session=session)
        drains = _drains()
        fake.events = drains[0]
        assert await poller.poll_once() == 3
        assert fake.events == []  # drained
        assert await poller.poll_once() == 0  # nothing new: no events, no clears
        fake.events = drains[1]  # ids 3-4 never reached the queue
        await poller.poll_once()
        fake.events = drains[3]  # engine restart: created at id 0
        await poller.poll_once()
        fake.events = drains[4]
        await poller.poll_once()
    kinds = [type(e).__name__ for e in got]
    assert kinds == [
        "AllCleared",
        "BlockStored",
        "BlockStored",  # start-up
        "AllCleared",
        "BlockStored",
        "BlockStored",  # gap: clear, resync
        "AllCleared",
        "BlockStored",  # restart
        "BlockRemoved",
    ]
    assert poller.counts["empty_polls"] == 1 and poller.decoder.counts["gaps"] == 1


async def test_lost_or_garbled_answers_clear_every_rank(fake):
    got: list = []
    async with aiohttp.ClientSession() as session:
        poller = TrtllmPoller(fake.url, TrtllmDecoder("t", 4), got.extend, session=session)
        fake.events = _drains()[0]
        await poller.poll_once()
        n = len(got)
        fake.events = [{"event_id": 3, "data": {"type": "removed", "block_hashes": [13]}}]
        fake.fail_next = True  # drained, then the answer is lost
        assert await poller.poll_once() == 0
        assert got[n:] == [AllCleared(worker_id="t", dp_rank=0)]
        assert fake.events == []
        fake.garbage_next = True
        await poller.poll_once()
        assert got[n + 1 :] == [AllCleared(worker_id="t", dp_rank=0)]
        assert poller.counts["lost_answers"] == 2
        # the stream continues: after a lost answer the next ids are accepted without a gap
        fake.events = [
            {
                "event_id": 9,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [
                        {"block_hash": 77, "tokens": [{"token_id": t} for t in (1, 2, 3, 4)]}
                    ],
                },
            }
        ]
        await poller.poll_once()
        assert got[-1] == BlockStored(
            worker_id="t", engine_hashes=[77], token_ids=[1, 2, 3, 4], block_size=4
        )


async def test_refused_connection_clears_nothing():
    got: list = []
    async with aiohttp.ClientSession() as session:
        poller = TrtllmPoller(
            "http://127.0.0.1:9", TrtllmDecoder("t", 4), got.extend, session=session, timeout=2
        )
        assert await poller.poll_once() == 0
    assert got == [] and poller.counts["connect_errors"] == 1 and not poller.connected


async def test_adapter_is_the_sole_consumer_and_fills_the_index(fake):
    index_mod = pytest.importorskip("kvplug.index")
    index = index_mod.KvIndex(block_size=4)
    index.add_endpoint("trt-a", 0)
    sink = RecordingSink("trt-a", 4, index)
    # the fixture engine reports tokens_per_block 32: a router hashing 4-token blocks is refused
    adapter = TrtllmAdapter(load_period=0.05, poll_max_interval=0.02)
    with pytest.raises(ConfigError, match="tokens_per_block 32"):
        await adapter.start_worker(Worker("trt-a", url=fake.url, engine="trtllm"), sink)
    fake.prometheus = fake.prometheus.replace(
        'tokens_per_block{model_name="llama",engine_type="trtllm"} 32.0',
        'tokens_per_block{model_name="llama",engine_type="trtllm"} 4.0',
    )
    fake.hold = 0.01
    fake.events = json.loads((DATA / "v1_events.json").read_bytes())
    try:
        await adapter.start_worker(Worker("trt-a", url=fake.url, engine="trtllm"), sink)
        with pytest.raises(ConfigError, match="one consumer"):
            await adapter.start_worker(Worker("trt-a", url=fake.url, engine="trtllm"), sink)
        await _until(lambda: len(sink.events) >= 6 and sink.attributes)
        assert adapter.events_ready("trt-a")
        assert [type(e).__name__ for e in sink.events] == [
            "AllCleared",
            "BlockStored",
            "BlockStored",
            "BlockMoved",
            "BlockRemoved",
            "BlockStored",
        ]
        assert sink.attributes[-1] == {
            "running_requests": 5.0,
            "queue_depth": 2.0,
            "kv_usage": 0.25,
            "prefix_cache_hit_rate": 0.75,
            "kv_max_blocks": 1000.0,
        }
        assert sink.capacity == [1000]  # trtllm_kv_cache_max_blocks, once
        # the index holds what the engine holds: [1..4] moved to host, [5..8] on device,
        # [9..12] (BIG2) removed, the partial block never stored
        ep = index.endpoint_id("trt-a", 0)
        ov = index.query(index.request_hashes(list(range(1, 13))))
        assert (int(ov.local[ep]), int(ov.device[ep]), int(ov.host[ep])) == (2, 1, 1)
        await asyncio.sleep(0.1)
        assert fake.max_inflight == 1  # never two drains at once
    finally:
        await adapter.close()


async def test_load_falls_back_to_drained_iteration_stats():
    fake = await FakeTrtllmWorker(prometheus=None).start()
    sink = RecordingSink("trt-b", 32)
    adapter = TrtllmAdapter(load_period=0.02)
    try:
        await adapter.start_worker(Worker("trt-b", url=fake.url, engine="trtllm"), sink)
        await asyncio.sleep(0.1)
        assert sink.attributes == []  # empty drains: no new iteration, not zero load
        fake.iter_stats = json.loads((DATA / "iteration_stats.json").read_bytes())
        await _until(lambda: sink.attributes)
        assert sink.attributes[0] == {
            "running_requests": 5.0,
            "queue_depth": 2.0,
            "kv_used_blocks": 250.0,
            "kv_max_blocks": 1000.0,
            "kv_usage": 0.25,
            "prefix_cache_hit_rate": 0.75,
        }
        assert len(sink.attributes) == 1
        assert sink.capacity == [1000]  # the newest iteration's maxNumBlocks
    finally:
        await adapter.close()
        await fake.stop()


def test_removed_events_reach_the_index_as_any_tier_removals():
    # the decoder leaves the tier open (TRT-LLM does not say which tier a removal left)
    ev = TrtllmDecoder("t", 1).decode(
        [{"event_id": 0, "data": {"type": "removed", "block_hashes": [5]}}]
    )
    assert ev == [BlockRemoved(worker_id="t", engine_hashes=[5])] and ev[0].tier is None


def _stored_envelope(event_id: int, block_hash: int) -> dict:
    return {
        "event_id": event_id,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": block_hash, "tokens": [{"token_id": t} for t in range(4)]}],
        },
    }


# answers no worker should send; each must cost at most itself (issue 9: the first one killed
# the poller task for good while /ready stayed green)
HOSTILE_ANSWERS = [
    b"[" * 5000 + b"]" * 5000,
    b'[{"event_id": 0, "data": ' + b"[" * 5000 + b"]" * 5000 + b"}]",
    b'{"a": 1}',
    b"[" + b'{"event_id": 1, "data": {"type": "stored", "blocks": [{"block_hash": 7, '
    b'"tokens": [], "cache_salt": ' + b"[" * 900 + b"]" * 900 + b"}]}}]",
    b"\xff\xfe",
]


async def test_poller_survives_any_answer(fake):
    got: list = []
    async with aiohttp.ClientSession() as session:
        poller = TrtllmPoller(
            fake.url,
            TrtllmDecoder("t", 4),
            got.extend,
            session=session,
            min_interval=0.001,
            max_interval=0.005,
        )
        task = asyncio.create_task(poller.run())
        try:
            fake.raw_answers = list(HOSTILE_ANSWERS)
            fake.events = [_stored_envelope(0, 41)]
            await _until(lambda: any(isinstance(e, BlockStored) for e in got))
            assert not task.done() and poller.running
            assert got[-1] == BlockStored(
                worker_id="t", engine_hashes=[41], token_ids=[0, 1, 2, 3], block_size=4
            )
            assert poller.counts["lost_answers"] == 4  # unparsable or not a list: cleared
            # a decoder bug costs its answer (handled as lost), and a failing consumer one round
            real = poller.decoder.decode
            poller.decoder.decode = lambda envelopes: 1 / 0
            fake.events = [_stored_envelope(1, 42)]
            await _until(lambda: poller.counts["decoder_errors"] > 0)
            poller.decoder.decode = real
            poller.deliver = lambda events: 1 / 0
            fake.events = [_stored_envelope(2, 43)]
            await _until(lambda: poller.counts["internal_errors"] > 0)
            poller.deliver = got.extend
            fake.events = [_stored_envelope(3, 44)]
            await _until(lambda: any(getattr(e, "engine_hashes", None) == [44] for e in got))
            assert poller.running and not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert not poller.running


async def test_a_stopped_poller_shows_in_ready_and_metrics(fake):
    """If the poller ever stops, /ready fails and /metrics says which worker and why."""
    from kvplug.config import RouterConfig
    from kvplug.frontend.app import ServeSettings
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.server import start_frontend
    from kvplug.router import Router

    fake.prometheus = None
    router = Router(RouterConfig(kv_block_size=32))
    spec = spec_from_mapping({"id": "trt", "url": fake.url, "engine": "trtllm"}, "worker trt")
    running = await start_frontend(
        router, [spec], ServeSettings(health_interval=0.2, health_timeout=5.0)
    )
    adapter = running.frontend.fleet.adapters["trtllm"]
    try:
        async with aiohttp.ClientSession() as http:

            async def ready_and_metrics():
                async with http.get(running.url + "/ready") as r:
                    status = r.status
                async with http.get(running.url + "/metrics") as r:
                    return status, await r.text()

            deadline = asyncio.get_running_loop().time() + 15
            while (status := (await ready_and_metrics())[0]) != 200:
                assert asyncio.get_running_loop().time() < deadline, "never ready"
                await asyncio.sleep(0.01)
            status, text = await ready_and_metrics()
            assert status == 200
            assert 'kvplug_worker_events_ready{worker="trt"} 1.0' in text
            fake.raw_answers = [b"[" * 5000 + b"]" * 5000]
            lost = 'kvplug_event_drops_total{engine="trtllm",reason="lost_answers",worker="trt"}'
            deadline = asyncio.get_running_loop().time() + 15
            while lost + " 1.0" not in (text := (await ready_and_metrics())[1]):
                assert asyncio.get_running_loop().time() < deadline, text
                await asyncio.sleep(0.01)
            status, text = await ready_and_metrics()
            assert lost + " 1.0" in text and status == 200
            task = adapter._runs["trt"].tasks[0]
            task.cancel()  # however it stops
            await asyncio.gather(task, return_exceptions=True)
            status, text = await ready_and_metrics()
            assert status == 503
            assert 'kvplug_worker_events_ready{worker="trt"} 0.0' in text
            assert 'reason="poller_stopped",worker="trt"} 1.0' in text
    finally:
        await running.close()


async def test_a_timed_out_poll_clears_every_rank(fake):
    """An answer later than the poll's timeout may have drained events: cleared, counted."""
    got: list = []
    async with aiohttp.ClientSession() as session:
        poller = TrtllmPoller(
            fake.url, TrtllmDecoder("t", 4), got.extend, session=session, timeout=0.2
        )
        fake.events = _drains()[0]
        assert await poller.poll_once() > 0  # rank 0 seen: it has blocks to clear
        n = len(got)
        fake.hold = 1.0
        assert await poller.poll_once() == 0
        assert got[n:] == [AllCleared(worker_id="t", dp_rank=0)]
        assert poller.counts["lost_answers"] == 1


async def test_a_stall_of_this_loop_does_not_lose_an_answer_that_came_meanwhile():
    """The engine answers at once, but this event loop is blocked past the poll's timeout (a GC
    pause, a long decode of another worker's drain). The answer waited in the socket: it is
    read, not cancelled and counted as lost (which clears the worker's blocks: TRT-LLM cannot
    replay them). The fake engine runs on a loop of its own, in another thread."""
    import threading

    engine_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=engine_loop.run_forever, daemon=True)
    thread.start()
    worker = asyncio.run_coroutine_threadsafe(FakeTrtllmWorker().start(), engine_loop).result(10)
    try:
        worker.events = _drains()[0]
        got: list = []
        async with aiohttp.ClientSession() as session:
            poller = TrtllmPoller(
                worker.url, TrtllmDecoder("t", 4), got.extend, session=session, timeout=0.3
            )
            # the poll arrives: this loop blocks for 0.8 s while the engine answers at once
            here = asyncio.get_running_loop()
            worker.on_poll = lambda: here.call_soon_threadsafe(time.sleep, 0.8)
            assert await poller.poll_once() > 0
        # exactly what the drain decodes to (its own first event is a clear: the engine's
        # start), and no clear for a lost answer after it
        assert got == TrtllmDecoder("t", 4).decode(_drains()[0])
        assert poller.counts["lost_answers"] == 0
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), engine_loop).result(10)
        engine_loop.call_soon_threadsafe(engine_loop.stop)
        thread.join(10)
        engine_loop.close()


def test_capacity_is_one_attention_dp_ranks_pool_reported_once():
    from kvplug.integrations.trtllm.adapter import _Run

    sink = RecordingSink("trt-dp", 32)
    run = _Run(Worker("trt-dp", engine="trtllm", dp_size=2), sink, poller=None)  # type: ignore[arg-type]
    # maxNumBlocks is one rank's KV pool (rank 0's, in every rank's row): not divided by dp_size
    for max_blocks in (2000.0, 2000.0, None, 0.0, 3000.0):
        TrtllmAdapter._report_capacity(run, max_blocks)
    assert sink.capacity == [2000, 3000]  # a change is reported, a repeat or a gap is not
