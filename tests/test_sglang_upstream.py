"""SGLang's own code as the fixture: events built with the ``kv_events.py`` classes of the
sglang 0.5.23 wheel, encoded the way its ``ZmqEventPublisher`` encodes them, decoded by
kvplug; and the real publisher (PUB + replay ROUTER) feeding kvplug's subscriber.

sglang 0.5.23 has no snapshot protocol (its replay ROUTER only resends buffered batches, which
``test_sglang_subscriber.py`` covers): a kvplug that starts late gets the last
``buffer_steps`` batches by replay from sequence 0 and nothing older."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from event_helpers import plain
from hypothesis import given, settings
from hypothesis import strategies as st
from kvplug.integrations.common import int64_hash
from kvplug.integrations.sglang.metrics import KvEventsInfo
from kvplug.integrations.sglang.subscriber import SglangSubscriber, filtered_sink, sources_from_info
from kvplug.integrations.sglang.wire import MASK64, SglangDecoder, encode_batch, recorder_queue
from sglang_upstream import load_event_recorder, load_kv_events

from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier
from kvplug.index import KvIndex

DATA = Path(__file__).parent / "data" / "sglang"
H1, H2, H3 = -8070450532247928832, 1234567890123456789, -5  # signed int64, as SGLang hashes


def _free_base(n: int) -> int:
    spec = importlib.util.spec_from_file_location("sglang_zmq_publisher", DATA / "zmq_publisher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._free_base(n)


@pytest.fixture(scope="module")
def kv():
    return load_kv_events()


def _batch(kv, ts: float, rank: int | None):
    return kv.KVEventBatch(
        ts=ts,
        events=[
            kv.BlockStored(
                block_hashes=[H1, H2],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium=kv.StorageMedium.GPU.value,
            ),
            kv.BlockStored(
                block_hashes=[H3],
                parent_block_hash=H2,
                token_ids=[9, 10, 11, 12],
                block_size=4,
                lora_id=None,
                medium=kv.StorageMedium.CPU.value,
                cache_salt="tenant-a",
                lora_name="sql-lora",
            ),
            kv.BlockRemoved(block_hashes=[H3], medium=kv.StorageMedium.CPU.value),
            kv.AllBlocksCleared(),
        ],
        attn_dp_rank=rank,
    )


EXPECTED = [
    BlockStored(
        worker_id="sg",
        dp_rank=1,
        tier=Tier.DEVICE,
        engine_hashes=[H1 & MASK64, H2],
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_size=4,
    ),
    BlockStored(
        worker_id="sg",
        dp_rank=1,
        tier=Tier.HOST,
        parent_engine_hash=H2,
        engine_hashes=[H3 & MASK64],
        token_ids=[9, 10, 11, 12],
        block_size=4,
        cache_salt="tenant-a",
        lora_name="sql-lora",
    ),
    BlockRemoved(worker_id="sg", dp_rank=1, tier=Tier.HOST, engine_hashes=[H3 & MASK64]),
    AllCleared(worker_id="sg", dp_rank=1),
]


def test_sglang_classes_encode_byte_for_byte_what_kvplug_decodes_and_encodes(kv):
    # ZmqEventPublisher._publisher_thread: msgspec.msgpack.Encoder().encode(event_batch)
    payload = msgspec.msgpack.Encoder().encode(_batch(kv, 1.5, 1))
    dec = SglangDecoder("sg", page_size=4)
    assert plain(dec.decode(payload, dp_rank=0, seq=0)) == EXPECTED  # the batch's rank wins
    assert not dec.drops
    # kvplug's SGLang encoder (simulated engines, fixtures) writes the same bytes
    assert encode_batch(EXPECTED, "0.5.23", ts=1.5, attn_dp_rank=1) == payload


def test_fields_kvplug_does_not_use_are_ignored(kv):
    # session_id (attribution only) and a nil rank (the socket's rank)
    batch = kv.KVEventBatch(
        ts=0.0,
        events=[
            kv.BlockStored(
                block_hashes=[7],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                lora_id=3,
                medium=None,
                session_id="s-1",
            )
        ],
    )
    payload = msgspec.msgpack.Encoder().encode(batch)
    got = plain(SglangDecoder("sg", page_size=4).decode(payload, dp_rank=2, seq=0))
    assert got == [
        BlockStored(
            worker_id="sg", dp_rank=2, engine_hashes=[7], token_ids=[1, 2, 3, 4], block_size=4
        )
    ]


def test_sglangs_zmq_publisher_feeds_kvplugs_index(kv):
    """The real publisher (bound PUB + replay ROUTER, topic frame): kvplug connects, recovers
    what it missed by replay from sequence 0, and the blocks land in the index."""
    base, replay = _free_base(1), _free_base(1)
    index = KvIndex(block_size=4)
    index.add_endpoint("sg", 0)
    got: list = []
    lock = threading.Lock()

    def deliver(events):
        with lock:
            index.apply_many(events)
            got.extend(events)

    ctx = zmq.Context()
    pub = kv.ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{base}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        topic="kv",
        bind=True,
    )
    info = KvEventsInfo(
        host="127.0.0.1",
        port_base=base,
        dp_size=1,
        block_size=4,
        topic="kv",
        replay_port_base=replay,
    )
    sub = SglangSubscriber(replay_timeout=10.0, context=ctx).start()  # no replay may time out
    try:
        stored = _batch(kv, 1.0, None)
        stored.events = stored.events[:2]  # keep the stores
        pub.publish(stored)  # before kvplug listens: recovered by replay
        time.sleep(0.2)
        for src in sources_from_info("sg", info, filtered_sink(deliver)):
            sub.add(src)
        deadline = time.monotonic() + 20
        n = 0
        while time.monotonic() < deadline:
            with lock:
                if len(got) >= 3:
                    break
            # later batches: the first one kvplug sees has seq > 0, so it replays from 0
            pub.publish(kv.KVEventBatch(ts=2.0, events=[kv.BlockRemoved(block_hashes=[99 + n])]))
            n += 1
            time.sleep(0.1)
        with lock:
            events = list(got)
        assert plain(events[:2]) == [
            BlockStored(
                worker_id="sg",
                tier=Tier.DEVICE,
                engine_hashes=[H1 & MASK64, H2],
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
            ),
            BlockStored(
                worker_id="sg",
                tier=Tier.HOST,
                parent_engine_hash=H2,
                engine_hashes=[H3 & MASK64],
                token_ids=[9, 10, 11, 12],
                block_size=4,
                cache_salt="tenant-a",
                lora_name="sql-lora",
            ),
        ]
        assert all(isinstance(e, BlockRemoved) for e in events[2:])
        ep = index.endpoint_id("sg", 0)
        assert index.query(index.request_hashes([1, 2, 3, 4, 5, 6, 7, 8])).device[ep] == 2
        salted = index.request_hashes(
            list(range(1, 13)), lora_name="sql-lora", cache_salt="tenant-a"
        )
        assert index.query(salted).local[ep] == 0  # another namespace than the first store
        assert sub.stats()["streams"]["sg/0"]["replays"] >= 1  # the missed store came back
    finally:
        sub.stop()
        pub.shutdown()
        ctx.destroy(linger=0)


def _recorder_events(kv, events):
    """What SGLang's radix cache hands its recorder for ``events``: a store per page, chained
    on the page before it (``record_store``), a removal per evicted node (``record_remove``)."""
    media = kv.StorageMedium  # the wheel's names: GPU, CPU (CPU_PINNED), DISK, EXTERNAL
    medium = {Tier.DEVICE: media.GPU, Tier.HOST: media.CPU, Tier.DISK: media.DISK}
    out = []
    for e in events:
        m = (media.EXTERNAL if e.shared else medium[e.tier or Tier.DEVICE]).value
        if isinstance(e, BlockRemoved):
            out.append(
                kv.BlockRemoved(block_hashes=[int64_hash(h) for h in e.engine_hashes], medium=m)
            )
            continue
        parent = None if e.parent_engine_hash is None else int64_hash(e.parent_engine_hash)
        for i, h in enumerate(e.engine_hashes):
            tokens = list(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            out.append(
                kv.BlockStored(
                    block_hashes=[int64_hash(h)], parent_block_hash=parent, token_ids=tokens,
                    block_size=e.block_size, lora_id=None, medium=m, cache_salt=e.cache_salt,
                    lora_name=e.lora_name,
                )
            )  # fmt: skip
            parent = int64_hash(h)
    return out


@pytest.fixture(scope="module")
def recorder_class(kv):
    return load_event_recorder()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_recorder_queue_groups_events_as_sglangs_own_recorder(kv, recorder_class, data):
    """``recorder_queue`` (the benchmarks' SGLang payloads) against the wheel's
    ``KVCacheEventRecorder.enqueue``: the same events, encoded to the same bytes."""
    hashes = st.integers(0, 6)
    events = []
    chain_end = None
    for _ in range(data.draw(st.integers(0, 12))):
        tier = data.draw(st.sampled_from([Tier.DEVICE, Tier.DEVICE, Tier.HOST]))
        if data.draw(st.booleans()):
            removed = data.draw(st.lists(hashes, min_size=1, max_size=3))
            events.append(BlockRemoved(worker_id="sg", tier=tier, engine_hashes=removed))
            continue
        n = data.draw(st.integers(1, 3))
        stored = data.draw(st.lists(hashes, min_size=n, max_size=n))
        parent = data.draw(st.sampled_from([None, chain_end, 6]))  # often the last chain's end
        events.append(
            BlockStored(
                worker_id="sg", tier=tier, parent_engine_hash=parent, engine_hashes=stored,
                token_ids=[1] * (2 * n), block_size=2,
                cache_salt=data.draw(st.sampled_from([None, None, "t"])),
            )
        )  # fmt: skip
        chain_end = stored[-1]
    recorder = recorder_class(enabled=True, page_size=2)
    for event in _recorder_events(kv, events):
        recorder.enqueue(event)
    theirs = msgspec.msgpack.Encoder().encode(
        kv.KVEventBatch(ts=0.0, events=recorder.take(), attn_dp_rank=0)
    )
    assert encode_batch(recorder_queue(events), "0.5.23", ts=0.0, attn_dp_rank=0) == theirs
