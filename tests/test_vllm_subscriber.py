"""The real subscriber against a vLLM-compatible publisher on loopback ZMQ sockets.

Streams with gaps (replayed, both reply framings), lost batches beyond the replay buffer,
duplicates, engine restarts, garbage frames, unknown engines and stale replay replies; every
test checks that what the subscriber delivered leaves a consumer holding exactly what the
engine holds (or a safe subset after unrecoverable loss), never crashing.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest
import zmq
from kvplug.integrations.vllm.publisher import VllmEventPublisher
from kvplug.integrations.vllm.subscriber import (
    EventSource,
    VllmSubscriber,
    connect_address,
    engine_binds,
    offset_endpoint,
    sources_for_engine,
)
from vllm_helpers import Mirror, free_port, free_port_runs, wait_for, wait_subscribed

from kvplug.errors import ConfigError
from kvplug.events import AllCleared, BlockRemoved, BlockStored

BS = 32


def stored(worker, hashes, parent=None, rank=0):
    return BlockStored(
        worker_id=worker,
        dp_rank=rank,
        engine_hashes=hashes,
        parent_engine_hash=parent,
        token_ids=list(range(BS * len(hashes))),
        block_size=BS,
    )


def removed(worker, hashes, rank=0):
    return BlockRemoved(worker_id=worker, dp_rank=rank, engine_hashes=hashes)


class Engine:
    """A publisher plus the truth: the hashes the engine holds."""

    def __init__(
        self,
        worker,
        *,
        version="0.32.0",
        bind=True,
        replay=True,
        topic="",
        sub_port=None,
        buffer_steps=10_000,
        publisher_ids=False,
    ):
        self.worker = worker
        self.port = sub_port or free_port()
        self.rport = free_port() if replay else None
        self.endpoint = f"tcp://*:{self.port}" if bind else f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://*:{self.rport}" if replay else None
        self.pub = VllmEventPublisher(
            self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=topic,
            version=version,
            buffer_steps=buffer_steps,
            publisher_ids=publisher_ids,
        )
        self.topic = topic
        self.truth: set[int] = set()

    def store(self, hashes, send=True):
        self.truth |= set(hashes)
        return self.pub.publish([stored(self.worker, hashes)], send=send)

    def remove(self, hashes, send=True):
        self.truth -= set(hashes)
        return self.pub.publish([removed(self.worker, hashes)], send=send)

    def sources(self, sink):
        return sources_for_engine(
            self.worker,
            self.endpoint,
            sink,
            replay_endpoint=self.replay_endpoint,
            topic=self.topic,
            engine_url="http://127.0.0.1:8000",
        )

    def pump(self):
        self.pub.serve_replay(5)


@pytest.fixture
def sub():
    # a replay answer is pumped by the test thread: on a loaded machine it can be late by far
    # more than a second, and no test here wants a replay to time out
    s = VllmSubscriber(replay_timeout=10.0).start()
    yield s
    s.stop()


def joined(sub, *pubs):
    """Until ``sub`` hears every one of ``pubs`` (ZMQ slow joiner): vllm_helpers.wait_joined."""
    wait_subscribed(sub, pubs)


def attach(sub, eng, mirror):
    for src in eng.sources(mirror):
        sub.add(src)
    joined(sub, eng.pub)


def settle(eng, mirror, expect=None, timeout=20.0):
    expect = eng.truth if expect is None else expect
    return wait_for(lambda: mirror.hashes(eng.worker) == expect, timeout, eng.pump)


def holding_block_1(sub, **engine_kw):
    """Engine e1 attached to ``sub`` and its first stored block (1) in the mirror."""
    eng = Engine("e1", **engine_kw)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    assert settle(eng, m)
    return eng, m


def answer_replay(eng, first):
    """Answer the engine's next replay request from the test (``auto_serve`` off): ``first(ident,
    start)`` sends whatever the test injects, then the buffered batches from ``start`` on and
    the end marker, as the engine would."""
    assert wait_for(lambda: eng.pub.replay.poll(10) != 0, 10)
    ident, _, start_b = eng.pub.replay.recv_multipart()
    start = int.from_bytes(start_b, "big")
    first(ident, start)
    for seq, payload in list(eng.pub.buffer):
        if seq >= start:
            eng.pub.send_reply(ident, seq, payload)
    eng.pub.send_end(ident)


def connect_unstarted(sub, *pairs):
    """Add each (engine, sink) to a subscriber not started yet and wait until its SUB socket
    hears the engine (not started, so no probe is counted: read the socket itself), then drop
    the probes in flight: none may reach the sinks' batches."""
    for eng, sink in pairs:
        for src in eng.sources(sink):
            sub.add(src)  # not started: the SUB socket connects now
    for sock, (eng, _) in zip(sub._by_socket, pairs, strict=True):
        end = time.monotonic() + 20
        while not sock.poll(20):
            assert time.monotonic() < end, "a SUB socket heard no probe"
            eng.pub.send_raw([b"probe"])
        while sock.poll(200):
            sock.recv_multipart()


def test_endpoint_rules():
    assert engine_binds("tcp://*:5557") and engine_binds("tcp://[::]:5557")
    assert engine_binds("ipc:///tmp/x") and not engine_binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert connect_address("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    srcs = sources_for_engine(
        "e",
        "tcp://*:6000",
        print,
        replay_endpoint="tcp://*:6100",
        dp_start=0,
        dp_size=3,
        engine_url="http://h:8000",
    )
    assert [(s.address, s.replay_address, s.dp_rank) for s in srcs] == [
        ("tcp://h:6000", "tcp://h:6100", 0),
        ("tcp://h:6001", "tcp://h:6101", 1),
        ("tcp://h:6002", "tcp://h:6102", 2),
    ]


@pytest.mark.parametrize("version", ["0.20.0", "0.32.0"])  # old and new replay framings
def test_gap_replayed_in_order(sub, version):
    eng = Engine("e1", version=version)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2])
    assert settle(eng, m)
    eng.store([3], send=False)  # lost in transit
    eng.remove([3], send=False)  # lost too: would be an unknown remove out of order
    eng.store([4])
    assert settle(eng, m)
    st = sub.stats()["streams"]["e1/0"]
    assert st["gaps"] == 1 and st["replays"] >= 1 and st["replay_failures"] == 0
    assert m.unknown_removes == 0
    assert 1 in eng.pub.replay_requests


def test_unrecoverable_gap_clears_rank(sub):
    eng = Engine("e1", buffer_steps=2)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    assert settle(eng, m)
    for h in (10, 11, 12, 13):
        eng.store([h], send=False)  # only the last 2 stay in the replay buffer
    eng.store([14])
    # the replay buffer holds only seqs 4, 5 (13, 14): 1..3 are gone, so the rank is cleared
    # (stale removals may be among the lost) and rebuilt from what is left
    assert settle(eng, m, expect={13, 14})
    st = sub.stats()["streams"]["e1/0"]
    assert st["replay_failures"] == 1 and st["missed_batches"] == 3


def test_gap_without_replay_endpoint_clears(sub):
    eng = Engine("e1", replay=False)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    assert settle(eng, m)
    eng.store([2], send=False)
    eng.store([3])
    assert settle(eng, m, expect={3})


def test_restart_clears_and_rebuilds(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2, 3])
    eng.store([4])
    assert settle(eng, m)
    eng.pub.restart()
    eng.truth = set()
    eng.store([7])
    assert settle(eng, m)
    assert sub.stats()["streams"]["e1/0"]["restarts"] == 1


def test_duplicate_message_ignored_and_duplicate_stores_refcounted(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    seq = eng.store([1])
    payload = eng.pub.buffer[-1][1]
    eng.pub.send_raw([b"", seq.to_bytes(8, "big"), payload])  # the same message again
    # vLLM can store the same hash twice (two physical blocks), then remove one copy
    for _ in range(2):
        eng.pub.publish([stored(eng.worker, [2], parent=1)])
    eng.remove([2])
    eng.truth = {1, 2}  # one physical copy still holds it
    assert settle(eng, m)
    assert sub.stats()["streams"]["e1/0"]["duplicates"] == 1
    # a store from the root of a held block re-announces it (kv_cache_report_mode "full"):
    # one removal takes it out
    eng.store([1])
    eng.remove([1])
    assert settle(eng, m) and eng.truth == {2}


def test_garbage_and_unknown_engine_dropped_index_intact(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2])
    assert settle(eng, m)  # the join's probes were counted before this batch was handled
    probes = sub.stats()["malformed_frames"]
    seq = eng.pub.seq
    garbage = [
        [b"", b"\x00" * 3, b"x"],  # bad seq frame
        [b"only one frame"],
        [b"", seq.to_bytes(8, "big"), b"\xc1\xc1"],  # undecodable payload
    ]
    for g in garbage:
        eng.pub.send_raw(g)
    eng.pub.seq += 1  # the bad payload consumed a seq
    eng.store([3])
    assert settle(eng, m)
    stats = sub.stats()
    assert stats["malformed_frames"] - probes == 2
    assert stats["streams"]["e1/0"]["malformed"] == 1


def test_bound_sub_fans_in_engines_by_topic(sub):
    port = free_port()
    m = Mirror()
    e1 = Engine("e1", bind=False, replay=False, topic="e1", sub_port=port)
    e2 = Engine("e2", bind=False, replay=False, topic="e2", sub_port=port)
    for e in (e1, e2):
        for src in e.sources(m):
            sub.add(src)
    # "e1-stray" passes the "e1" prefix filter but names no known engine
    stray = VllmEventPublisher(f"tcp://127.0.0.1:{port}", topic="e1-stray")
    joined(sub, e1.pub, e2.pub, stray)
    e1.store([1, 2])
    e2.store([5])
    stray.publish([stored("x", [9])])
    assert settle(e1, m) and settle(e2, m)
    assert wait_for(lambda: sub.stats()["unknown_source"] >= 1, 15)
    stray.close()
    with pytest.raises(ConfigError):
        sub.add(EventSource("e3", f"tcp://127.0.0.1:{port}", m, topic="e1"))


def test_stale_replay_reply_dropped(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    assert settle(eng, m)
    eng.pub.auto_serve = False  # this test answers the replay request itself
    eng.store([2], send=False)
    eng.store([3])
    # answer the replay request with an extra stale batch (seq 0 again) before the real ones
    answer_replay(eng, lambda ident, _start: eng.pub.send_reply(ident, 0, eng.pub.buffer[0][1]))
    assert settle(eng, m)
    assert sub.stats()["stale_replies"] >= 1


def test_dp_ranks_on_offset_ports(sub):
    port, rport = free_port_runs(2, 2)
    m = Mirror()
    pubs = [
        VllmEventPublisher(f"tcp://*:{port + r}", replay_endpoint=f"tcp://*:{rport + r}", dp_rank=r)
        for r in range(2)
    ]
    for src in sources_for_engine(
        "e",
        f"tcp://*:{port}",
        m,
        replay_endpoint=f"tcp://*:{rport}",
        dp_size=2,
        engine_url="http://127.0.0.1:1",
    ):
        sub.add(src)
    joined(sub, *pubs)
    pubs[0].publish([stored("e", [1])])
    pubs[1].publish([stored("e", [2], rank=1)])
    assert wait_for(lambda: m.hashes("e", 0) == {1} and m.hashes("e", 1) == {2}, 15)
    for p in pubs:
        p.close()


def test_remove_worker_stops_delivery(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    assert settle(eng, m)
    assert sub.last_message_at("e1") is not None
    sub.remove("e1")
    assert not sub.has_worker("e1")
    eng.store([2])
    time.sleep(0.3)
    assert m.hashes("e1") == {1}


def test_zmq_context_shared_cleanly():
    ctx = zmq.Context()
    s = VllmSubscriber(context=ctx).start()
    s.stop()
    ctx.term()


def test_configured_engine_address_is_dialled_when_not_bindable(sub):
    """A worker config naming the engine's own bound address (tcp://host:port) cannot be bound
    by kvplug (in use here; another host's elsewhere), so kvplug connects to it."""
    eng = Engine("e1")
    m = Mirror()
    src = EventSource(
        "e1", f"tcp://127.0.0.1:{eng.port}", m, replay_endpoint=f"tcp://127.0.0.1:{eng.rport}"
    )
    assert src.kvplug_binds
    sub.add(src)
    assert not src.kvplug_binds  # decided in the thread before add() returned
    joined(sub, eng.pub)
    eng.store([1, 2])
    assert settle(eng, m)


def test_joining_a_running_engine_catches_up_from_its_buffer(sub):
    eng = Engine("e1", buffer_steps=3)
    for h in range(1, 7):  # published before kvplug subscribed
        eng.store([h])
    m = Mirror()
    attach(sub, eng, m)
    eng.store([7])
    # the engine still buffers seqs 4..6 (hashes 5, 6, 7): kvplug recovers those; 1..4 were
    # announced before it joined and are out of reach (a safe subset: never a false hit)
    assert settle(eng, m, expect={5, 6, 7})
    st = sub.stats()["streams"]["e1/0"]
    assert st["replay_failures"] == 0 and 0 in eng.pub.replay_requests


def test_resync_after_restart_the_sequence_numbers_did_not_show(sub):
    """The old engine published only seq 0; the new one's seq 0 was missed and its seq 1 looks
    like the next batch. A resync (process start time changed) clears and replays from 0."""
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2])
    assert settle(eng, m)
    seen = sub.restarts("e1")
    eng.pub.restart()
    eng.truth = set()
    eng.store([5], send=False)  # missed
    eng.store([6])
    assert wait_for(lambda: 6 in m.hashes("e1"), 15, eng.pump)
    assert m.hashes("e1") == {1, 2, 6}  # stale 1, 2; missing 5: seq numbers cannot tell
    sub.resync("e1", if_restarts_at=seen)
    assert settle(eng, m)  # exactly the new engine's {5, 6}


def test_publisher_id_shows_a_restart_the_sequence_numbers_do_not(sub):
    """The scenario above with a snapshot-enabled publisher (its id after each seq): the new
    process's id alone makes the subscriber clear and replay from 0, with no resync."""
    eng = Engine("e1", publisher_ids=True)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2])
    assert settle(eng, m)
    eng.pub.restart()
    eng.truth = set()
    eng.store([5], send=False)  # missed
    eng.store([6])  # seq 1 after seq 0: the next batch, by its number
    assert settle(eng, m)  # exactly the new engine's {5, 6}
    st = sub.stats()["streams"]["e1/0"]
    assert st["restarts"] == 1 and st["gaps"] == 0 and 0 in eng.pub.replay_requests


def test_publisher_ids_gaps_replayed_and_a_replaced_lifetimes_reply_stale(sub):
    eng, m = holding_block_1(sub, publisher_ids=True)
    old_id = eng.pub.publisher_id
    eng.pub.restart()
    eng.truth = set()
    eng.store([5])
    eng.pub.publish([])  # an idle publisher's heartbeat: consumes a seq, changes nothing
    assert settle(eng, m)
    eng.pub.auto_serve = False  # this test answers the replay request itself
    eng.store([2], send=False)
    eng.store([3])
    other = eng.pub.encode([stored(eng.worker, [99])])  # what the old process stored there

    def from_the_old_lifetime(ident: bytes, start: int) -> None:
        mine, eng.pub.publisher_id = eng.pub.publisher_id, old_id
        eng.pub.send_reply(ident, start, other)
        eng.pub.publisher_id = mine

    answer_replay(eng, from_the_old_lifetime)
    assert settle(eng, m)
    st = sub.stats()["streams"]["e1/0"]
    assert st["gaps"] == 1 and st["stale_replies"] == 1 and st["restarts"] == 1


def test_late_message_of_a_replaced_lifetime_is_stale_not_another_restart(sub):
    eng, m = holding_block_1(sub, publisher_ids=True)
    old_id, old_payload = eng.pub.publisher_id, eng.pub.buffer[-1][1]
    eng.pub.restart()
    eng.truth = set()
    eng.store([5])
    assert settle(eng, m)
    late = (7).to_bytes(8, "big") + old_id  # queued from the old process, delivered late
    eng.pub.send_raw([b"", late, old_payload])
    eng.store([6])
    assert settle(eng, m)  # {5, 6}: the old process's block did not come back
    st = sub.stats()["streams"]["e1/0"]
    assert st["restarts"] == 1 and st["stale_messages"] == 1


def test_new_process_answering_a_replay_is_the_restart(sub):
    eng, m = holding_block_1(sub, publisher_ids=True)
    eng.pub.auto_serve = False  # this test answers the replay request itself
    eng.store([2], send=False)
    eng.store([3])  # a gap: the subscriber asks for seq 1 on
    eng.pub.restart()  # ... and the engine restarts before answering
    eng.truth = set()
    eng.store([7], send=False)  # the new process's seq 0
    answer_replay(eng, lambda ident, _start: eng.pub.send_reply(ident, 0, eng.pub.buffer[0][1]))
    # the reply's id alone shows the restart: the rank is the new process's before any live
    # message of it arrives (else the old process's seq 2 would be applied after a lost gap)
    assert settle(eng, m)  # {7}
    eng.pub.auto_serve = True
    eng.store([8])
    assert settle(eng, m)  # {7, 8}
    assert sub.stats()["streams"]["e1/0"]["restarts"] == 1


def test_resync_then_the_new_publisher_id_is_not_a_second_restart(sub):
    eng, m = holding_block_1(sub, publisher_ids=True)
    seen = sub.restarts("e1")
    eng.pub.restart()
    eng.truth = set()
    sub.resync("e1", if_restarts_at=seen)  # the process start time showed it first
    assert settle(eng, m)
    eng.store([4])
    eng.store([5])
    assert settle(eng, m)
    assert sub.restarts("e1") == seen + 1


def test_resync_is_a_no_op_when_the_restart_was_already_seen(sub):
    eng = Engine("e1")
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1])
    eng.store([2])
    assert settle(eng, m)
    seen = sub.restarts("e1")
    eng.pub.restart()
    eng.truth = set()
    eng.store([7])  # seq 0 after seq 1: the subscriber sees the restart itself
    assert settle(eng, m)
    assert sub.restarts("e1") == seen + 1
    sub.resync("e1", if_restarts_at=seen)
    time.sleep(0.3)
    assert m.hashes("e1") == {7}  # not cleared a second time


def test_internal_error_and_failing_sink_cost_one_message_not_the_thread(sub):
    eng = Engine("e1")
    calls = {"n": 0}
    m = Mirror()

    def flaky_sink(events):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sink blew up")
        m(events)

    for src in eng.sources(flaky_sink):
        sub.add(src)
    joined(sub, eng.pub)
    eng.store([1])
    assert wait_for(lambda: m.hashes("e1") == {1}, 15, eng.pump)
    eng.store([2])  # the sink raises on this one: counted, events lost for the consumer
    assert wait_for(lambda: sub.stats()["sink_errors"] == 1, 15, eng.pump)
    st = sub._streams[("e1", 0)]
    real_decode = st.decoder.decode
    st.decoder.decode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("decoder bug"))
    eng.store([3])
    assert wait_for(lambda: sub.stats()["streams"]["e1/0"]["decoder_errors"] == 1, 15, eng.pump)
    st.decoder.decode = real_decode
    # a decoder that raises rejects its batch like an unreadable one: seq 3 is consumed (no
    # gap, no replay), only its own blocks are missing
    eng.store([4])
    assert wait_for(lambda: 4 in m.hashes("e1"), 15, eng.pump)
    assert m.hashes("e1") == {1, 4}
    stats = sub.stats()["streams"]["e1/0"]
    assert (stats["gaps"], stats["replays"], stats["malformed"]) == (0, 0, 1)
    # a bug past the decoder costs one message, never the thread
    real_on_batch = sub._on_batch
    sub._on_batch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug"))
    eng.store([5])
    assert wait_for(lambda: sub.stats()["internal_errors"] == 1, 15, eng.pump)
    sub._on_batch = real_on_batch
    eng.store([6])
    assert wait_for(lambda: {5, 6} <= m.hashes("e1"), 15, eng.pump)  # 5 came back by replay


# issue 9: nested 2000 deep, past msgspec's recursion limit (it raised RecursionError)
DEEP_BATCH = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\x91" * 2000 + b"\xc0"


def test_rejected_batch_consumes_its_seq_and_costs_only_itself(sub):
    """Without a replay endpoint, a batch the subscriber took for missing would wipe the
    rank: an unreadable batch must consume its seq, so only its own events are lost."""
    eng = Engine("e1", replay=False)
    m = Mirror()
    attach(sub, eng, m)
    eng.store([1, 2])
    assert settle(eng, m)
    eng.pub.publish_payload(DEEP_BATCH)
    eng.pub.publish_payload(b"\xc1")  # not msgpack at all
    eng.store([3])
    assert settle(eng, m)  # {1, 2, 3}: nothing wiped
    st = sub.stats()["streams"]["e1/0"]
    assert (st["malformed"], st["gaps"], st["missed_batches"], st["decoder_errors"]) == (
        2,
        0,
        0,
        0,
    )
    assert st["decode"]["malformed_batches"] == 2  # each counted once
    assert not any(isinstance(e, AllCleared) for e in m.events)


def test_backlog_reaches_the_sink_in_bounded_ordered_batches():
    """Batches queued before the thread runs are drained in one round but handed to the sink
    every ``flush_every`` messages, in sequence order, none lost."""
    eng = Engine("e1", replay=False)
    m = Mirror()
    calls: list[int] = []

    def sink(events):
        calls.append(len(events))
        m(events)

    sub = VllmSubscriber(flush_every=8)
    try:
        connect_unstarted(sub, (eng, sink))
        for i in range(60):
            eng.store([1000 + i])
        time.sleep(0.3)  # all 60 wait in the SUB's queue
        sub.start()
        assert settle(eng, m)
    finally:
        sub.stop()
    stored_order = [int(e.engine_hashes[0]) for e in m.events if isinstance(e, BlockStored)]
    assert stored_order == [1000 + i for i in range(60)]
    assert len(calls) >= 60 // 8 and max(calls) <= 8
    assert sub.stats()["streams"]["e1/0"]["batches"] == 60


def test_events_ready_only_while_the_subscriber_thread_runs():
    """Issue 9: if the consumer thread ever stops, the worker's events are not ready (so
    /ready fails and kvplug_worker_events_ready says 0), whatever streams it still lists."""
    from kvplug.integrations.vllm.adapter import RouterSink, VllmAdapter

    from kvplug.workers import Worker

    class NoRouter:  # RouterSink's router: nothing here routes
        def apply_events(self, events):
            return len(events)

        def set_attributes(self, *args):
            pass

    eng = Engine("e1")
    adapter = VllmAdapter()
    worker = Worker(
        "e1", engine="vllm", event_endpoint=eng.endpoint, replay_endpoint=eng.replay_endpoint
    )
    try:
        adapter.start_worker_sync(worker, RouterSink(NoRouter(), "e1", BS))
        assert adapter.events_ready("e1") is True
        adapter.subscriber._running = False  # the thread ends, as if it had died
        adapter.subscriber._thread.join(2)
        assert adapter.subscriber.has_worker("e1")
        assert adapter.events_ready("e1") is False
    finally:
        adapter.subscriber.stop()
        eng.pub.close()


def test_replay_answered_while_a_backlog_is_drained_is_not_timed_out():
    """Engine e1 has a gap; e2 a long backlog for a slow sink, drained in the same round right
    after e1's replay was asked for. e1 answers at once, but its replies wait in the socket
    while e2's backlog is drained past the replay's timeout: e1 was not silent, so no rank
    clear and nothing missed. (Before: the timeout fired right after the drain and e1's rank
    was cleared; the fault_subscriber hwm scenario failed that way on a loaded CI machine.)"""
    e1, e2 = Engine("e1"), Engine("e2", replay=False)
    m1, m2 = Mirror(), Mirror()

    def slow_sink(events):
        time.sleep(0.02)  # 25 flushes of 8 batches: e2's drain outlasts the timeout 5-fold
        m2(events)

    sub = VllmSubscriber(flush_every=8, replay_timeout=0.1)
    stop = threading.Event()

    def serve_replays():
        while not stop.is_set():
            e1.pub.serve_replay(5)

    server = threading.Thread(target=serve_replays)
    try:
        connect_unstarted(sub, (e1, m1), (e2, slow_sink))  # e1's socket first: drained first
        e1.pub.auto_serve = False  # from here only the server thread answers replays
        e1.store([1])
        e1.store([2], send=False)  # lost: the gap shows at the next batch
        e1.store([3])
        for i in range(200):
            e2.store([1000 + i])
        time.sleep(0.3)  # everything waits in the SUB queues
        server.start()
        sub.start()
        assert wait_for(lambda: m2.hashes("e2") == e2.truth, 20.0)
        assert wait_for(lambda: m1.hashes("e1") == e1.truth, 20.0)
    finally:
        stop.set()
        if server.is_alive():
            server.join(5)
        sub.stop()
    st = sub.stats()["streams"]["e1/0"]
    assert st["gaps"] == 1 and st["replays"] == 1
    assert (st["replay_failures"], st["missed_batches"]) == (0, 0)
    assert not any(isinstance(e, AllCleared) for e in m1.events)


def test_an_engine_added_during_a_long_drain_is_registered():
    """A round draining a long backlog (engines catching up at startup; here a slow sink) takes
    longer than 5 s: adding another engine meanwhile waits for the round while it makes
    progress, and the engine is consumed (before: add() gave up after 5 s and raised, the
    caller unregistered the worker, and the queued add still ran later as an orphan stream)."""
    e1, e2 = Engine("e1", replay=False), Engine("e2", replay=False)
    m1, m2 = Mirror(), Mirror()

    def slow_sink(events):
        time.sleep(0.1)  # 8 batches a call: e1's 500 take ~6 s
        m1(events)

    sub = VllmSubscriber(flush_every=8)
    sub.command_stall_s = 1.0
    try:
        connect_unstarted(sub, (e1, slow_sink))
        for i in range(500):
            e1.store([1000 + i])
        time.sleep(0.3)  # all of them wait in the SUB's queue
        sub.start()
        time.sleep(0.2)  # the thread is in the long round
        t0 = time.monotonic()
        for src in e2.sources(m2):
            sub.add(src)
        assert time.monotonic() - t0 > 1.0  # it waited for the round, past command_stall_s
        joined(sub, e2.pub)
        e2.store([7])
        assert settle(e2, m2) and settle(e1, m1)
    finally:
        sub.stop()
