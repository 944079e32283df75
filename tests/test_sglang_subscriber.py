"""SGLang events over real loopback ZMQ: golden payloads, gaps + replay (both SGLang reply
framings), a restart, garbage; the subscriber is the vLLM integration's, the decoder SGLang's."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from event_helpers import plain
from kvplug.integrations.common import coalesce_removes
from kvplug.integrations.sglang.metrics import KvEventsInfo
from kvplug.integrations.sglang.subscriber import SglangSubscriber, filtered_sink, sources_from_info
from kvplug.integrations.sglang.wire import MASK64

from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier

DATA = Path(__file__).parent / "data" / "sglang"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PUB = _load("sglang_zmq_publisher", DATA / "zmq_publisher.py")
SglangPublisher, _free_base, golden = _PUB.SglangPublisher, _PUB._free_base, _PUB.golden


class Collector:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def __call__(self, events):
        with self.lock:
            self.events.extend(events)

    def wait_for(self, pred, timeout=20.0, nudge=None):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if pred(self.events):
                    return list(self.events)
            if nudge is not None:
                nudge()
            time.sleep(0.05)
        with self.lock:
            raise AssertionError(f"timed out; got {self.events}")


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # never hangs on a socket left open by a failed test


def _u(v: int) -> int:
    return v & MASK64


def test_two_ranks_gap_replay_restart_and_garbage(zmq_ctx):
    base = _free_base(4)
    pubs = [
        SglangPublisher(zmq_ctx, base, base + 2, topic_in_replies=False),  # rank 0: <= 0.5.20
        SglangPublisher(zmq_ctx, base + 1, base + 3, topic_in_replies=True),  # rank 1: 0.5.23
    ]
    got = Collector()
    sink = filtered_sink(got)
    info = KvEventsInfo(
        host="127.0.0.1", port_base=base, dp_size=2, block_size=4, replay_port_base=base + 2
    )
    # replays are answered by the publisher's thread: never late by 10 s, even on a loaded
    # machine (this test wants no replay to time out)
    sub = SglangSubscriber(replay_timeout=10.0, context=zmq_ctx).start()
    try:
        for src in sources_from_info("sg", info, sink):
            sub.add(src)
        g15, g23 = golden("v0_5_15"), golden("v0_5_23")
        # rank 0: stores (+ a partial page); garbage; a batch the subscriber loses
        # (removal of the leaf incl. the partial page); then one more removal
        pubs[0].publish(g15[0], lose=True)  # sent before anyone listened: replayed on catch-up
        pubs[0].publish(b"\xc1 not msgpack")
        pubs[0].publish(g15[1], lose=True)
        pubs[0].publish(
            msgspec.msgpack.encode(
                [2.0, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}], 0]
            )
        )
        # rank 1: its batch says attn_dp_rank 1
        pubs[1].publish(g23[0], lose=True)
        pubs[1].publish(g23[1])
        ev = got.wait_for(
            # removed hashes, not events: removes delivered together are gathered into one
            lambda e: sum(len(x.engine_hashes) for x in e if isinstance(x, BlockRemoved)) >= 4,
            nudge=lambda: [p.resend_last() for p in pubs],
        )
        r0 = [e for e in ev if e.dp_rank == 0]
        r1 = [e for e in ev if e.dp_rank == 1]
        # whether the two removes came in one delivery (gathered into one event) is timing
        assert coalesce_removes(plain(r0)) == coalesce_removes([
            BlockStored(
                worker_id="sg",
                tier=Tier.DEVICE,
                engine_hashes=[_u(-8070450532247928832), 1234567890123456789],
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
            ),
            BlockStored(
                worker_id="sg",
                parent_engine_hash=1234567890123456789,
                engine_hashes=[_u(-5)],
                token_ids=[9, 10, 11, 12],
                block_size=4,
            ),
            BlockStored(
                worker_id="sg",
                tier=Tier.HOST,
                engine_hashes=[_u(-8070450532247928832), 1234567890123456789],
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
            ),
            BlockRemoved(worker_id="sg", tier=Tier.DEVICE, engine_hashes=[_u(-5)]),
            BlockRemoved(worker_id="sg", tier=Tier.DEVICE, engine_hashes=[7]),
        ])  # fmt: skip
        assert [type(e) for e in r1] == [
            BlockStored,
            BlockStored,
            BlockStored,
            BlockStored,
            BlockRemoved,
            BlockRemoved,
        ]
        assert 0 in pubs[0].requests and 0 in pubs[1].requests  # catch-up replays from seq 0
        stats = sub.stats()
        assert stats["streams"]["sg/0"]["malformed"] == 1  # the garbage, counted and dropped
        # ... and in the counters /metrics exports (kvplug_event_drops_total)
        drops = sub.drop_counts()["sg"]
        assert drops["rejected_batches"] == 1  # the batch, once
        assert drops["decode.bad_msgpack"] == 2  # decoded live and again when replayed
        assert drops["missed_batches"] == 0 and drops["replay_failures"] == 0
        assert sink.partial_filter.partial.get(0) == set()  # the partial page was swallowed

        # a restart of rank 0: seq back to 0 -> AllCleared for rank 0, then the new stream
        pubs[0].restart()
        n = len(got.events)
        pubs[0].publish(g15[2])  # H4 stored, then AllBlocksCleared
        ev = got.wait_for(lambda e: len(e) >= n + 3)
        time.sleep(0.1)
        ev = list(got.events)
        assert ev[n] == AllCleared(worker_id="sg", dp_rank=0)  # resends were ignored
        assert len(ev) == n + 3
        assert isinstance(ev[n + 1], BlockStored) and ev[n + 2] == AllCleared(worker_id="sg")
        assert sub.stats()["streams"]["sg/0"]["restarts"] == 1
    finally:
        sub.stop()
        for p in pubs:
            p.close()


def test_events_land_in_the_index(zmq_ctx):
    index_mod = pytest.importorskip("kvplug.index")
    base = _free_base(2)
    # DP rank 1 of a 2-rank engine: its batches say attn_dp_rank 1 on port base + 1
    pub = SglangPublisher(zmq_ctx, base + 1, _free_base(1), topic_in_replies=True)
    index = index_mod.KvIndex(block_size=4)
    index.add_endpoint("sg", 0)
    index.add_endpoint("sg", 1)
    got = Collector()

    def deliver(events):
        index.apply_many(events)
        got(events)

    info = KvEventsInfo(host="127.0.0.1", port_base=base, dp_size=2, block_size=4)
    sub = SglangSubscriber(context=zmq_ctx).start()
    try:
        for src in sources_from_info("sg", info, filtered_sink(deliver)):
            sub.add(src)
        g23 = golden("v0_5_23")
        deadline = time.monotonic() + 20
        while not got.events and time.monotonic() < deadline:  # slow joiner: resend seq 0
            pub.restart()
            pub.publish(g23[0])
            time.sleep(0.05)
        got.wait_for(lambda e: len(e) >= 2)
        ep = index.endpoint_id("sg", 1)
        hashes = index.request_hashes(
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], lora_name="sql-lora", cache_salt="tenant-a"
        )
        overlaps = index.query(hashes)
        assert overlaps.local[ep] == 3 and overlaps.device[ep] == 3
        plain = index.query(index.request_hashes([1, 2, 3, 4, 5, 6, 7, 8]))
        assert plain.local[ep] == 0  # another namespace (no salt, no LoRA) does not match
    finally:
        sub.stop()
        pub.close()


def test_engines_connecting_to_one_kvplug_bound_socket_are_told_apart_by_topic(zmq_ctx):
    # SGLang engines whose --kv-events-config endpoint is a concrete address connect to it:
    # kvplug binds one SUB there and attributes each message by its topic frame
    from kvplug.integrations.vllm.subscriber import sources_for_engine

    port = _free_base(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    got_a, got_b = Collector(), Collector()
    sub = SglangSubscriber(context=zmq_ctx).start()
    pubs = []
    try:
        for wid, topic, got in (("sg-a", "a", got_a), ("sg-b", "b", got_b)):
            for src in sources_for_engine(
                wid, endpoint, filtered_sink(got), topic=topic, block_size=4
            ):
                sub.add(src)
        for topic in (b"a", b"b"):
            pub = zmq_ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(endpoint)
            pubs.append((topic, pub))
        g15, g18 = golden("v0_5_15"), golden("v0_5_18")

        def send():
            pubs[0][1].send_multipart([b"a", (0).to_bytes(8, "big"), g15[0]])
            pubs[1][1].send_multipart([b"b", (0).to_bytes(8, "big"), g18[0]])

        got_a.wait_for(lambda e: len(e) >= 2, nudge=send)
        got_b.wait_for(lambda e: len(e) >= 4, nudge=send)
        time.sleep(0.1)
        # each engine's events, once (repeats of seq 0 are ignored), under its own worker id
        assert [e.worker_id for e in got_a.events] == ["sg-a", "sg-a"]
        assert [e.worker_id for e in got_b.events] == ["sg-b"] * 4
        assert got_a.events[1].engine_hashes == [_u(-5)]
        assert got_b.events[0].cache_salt == "tenant-b"
    finally:
        sub.stop()
        for _, p in pubs:
            p.close(0)


def test_the_sink_gathers_consecutive_removes_and_keeps_the_order_that_matters():
    """SGLang sends one BlockRemoved per evicted radix node; the sink hands the index as few as
    the order allows (each is a call), after the partial-page filter has had its say."""
    got: list = []
    sink = filtered_sink(got.extend)

    def rm(*hashes, rank=0):
        return BlockRemoved(worker_id="sg", dp_rank=rank, tier=Tier.DEVICE, engine_hashes=[*hashes])

    def stored(h, parent=None):
        return BlockStored(
            worker_id="sg", parent_engine_hash=parent, engine_hashes=[h], token_ids=[1] * 4,
            block_size=4,
        )  # fmt: skip

    sink([rm(1), stored(10), rm(2, 3), rm(4, rank=1), rm(5)])
    assert [(type(e).__name__, e.dp_rank, e.engine_hashes) for e in got] == [
        ("BlockRemoved", 0, [1, 2, 3]),  # moved past a store that touches none of them
        ("BlockStored", 0, [10]),
        ("BlockRemoved", 1, [4]),
        ("BlockRemoved", 0, [5]),  # only the previous remove is joined
    ]
    got.clear()
    sink([rm(1), stored(10, parent=2), rm(2), AllCleared(worker_id="sg"), rm(6)])
    assert [(type(e).__name__, e.engine_hashes if hasattr(e, "engine_hashes") else None)
            for e in got] == [
        ("BlockRemoved", [1]),
        ("BlockStored", [10]),
        ("BlockRemoved", [2]),  # the store chains onto 2: it must stay after the store
        ("AllCleared", None),
        ("BlockRemoved", [6]),
    ]  # fmt: skip
