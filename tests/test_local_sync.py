"""Load shared between the processes of one serve over Unix sockets (kvplug.local_sync), and
the merged /metrics of those processes (kvplug.frontend.peers). In one event loop: each
LocalLoadSync here stands for one process of ``kvplug serve --processes N``."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplug.config import RouterConfig
from kvplug.frontend.peers import merge_metrics
from kvplug.local_sync import LocalLoadSync, load_socket
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.workers import Worker

pytestmark = pytest.mark.timeout(60)


def _router(seed: int = 0, workers: int = 3) -> Router:
    r = Router(RouterConfig(kv_block_size=16), rng=random.Random(seed))
    for w in range(workers):
        r.add_worker(Worker(f"w{w}"))
    return r


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _group(directory: str, routers: list[Router], **kw) -> list[LocalLoadSync]:
    syncs = [
        LocalLoadSync(r, directory, i, len(routers), replica_id=f"p{i}", **kw)
        for i, r in enumerate(routers)
    ]
    for s in syncs:
        await s.start()
    await _until(lambda: all(len(s.connected_peers()) == len(routers) - 1 for s in syncs))
    return syncs


def _inflight(r: Router) -> dict[str, int]:
    return {w: int(r.load.inflight[r.endpoint_of(w, 0)]) for w in r.workers}


async def test_a_processes_requests_count_as_load_until_they_finish(tmp_path):
    a, b = _router(), _router()
    syncs = await _group(str(tmp_path), [a, b])
    try:
        d = a.route(RouteRequest("q1", list(range(100))))
        ep_b = b.endpoint_of(d.worker_id, 0)
        await _until(lambda: b.load.inflight[ep_b] == 1)
        assert b.load.prefill_tokens[ep_b] == 100
        a.on_first_token("q1")
        await _until(lambda: b.load.prefill_tokens[ep_b] == 0)
        a.on_finish("q1")
        await _until(lambda: b.load.inflight[ep_b] == 0)
        assert not b.load.requests
        assert syncs[1].stats.applied_events == 3 and syncs[1].stats.dropped_malformed == 0
    finally:
        for s in syncs:
            await s.close()


async def test_three_identical_processes_spread_instead_of_herding(tmp_path):
    routers = [_router(seed=0) for _ in range(3)]  # same state, same random stream
    syncs = await _group(str(tmp_path), routers)
    try:
        picks = []
        for i, r in enumerate(routers):
            picks.append(r.route(RouteRequest(f"q{i}", list(range(64)))).worker_id)
            await _until(lambda n=i + 1: all(sum(_inflight(o).values()) == n for o in routers))
        assert sorted(picks) == ["w0", "w1", "w2"], picks
    finally:
        for s in syncs:
            await s.close()


async def test_a_process_whose_connection_closes_has_its_load_released_at_once(tmp_path):
    a, b = _router(), _router()
    # expiry far away: the release must come from the closed connection, not from silence
    syncs = await _group(str(tmp_path), [a, b], expiry_s=600.0)
    try:
        for i in range(3):
            a.route(RouteRequest(f"q{i}", list(range(40))))
        await _until(lambda: len(b.load.requests) == 3)
        # what a killed process looks like: its sockets close, it says nothing
        syncs[0].detach()
        for task in syncs[0]._tasks:
            task.cancel()
        for transport in list(syncs[0]._out.values()):
            transport.abort()
        await _until(lambda: not b.load.requests)
        assert sum(_inflight(b).values()) == 0 and syncs[1].stats.expired_peers == 0
    finally:
        await syncs[0].close()
        await syncs[1].close()


async def test_a_restarted_process_reconnects_and_is_heard(tmp_path):
    a, b = _router(), _router()
    syncs = await _group(str(tmp_path), [a, b], reconnect_s=0.05)
    try:
        d = a.route(RouteRequest("before", list(range(100))))  # in flight across the restart
        a.on_first_token("before")
        await syncs[1].close()  # process 1 stops; 0 keeps trying to reach its socket
        b2 = _router()
        again = LocalLoadSync(b2, str(tmp_path), 1, 2, replica_id="p1-new", reconnect_s=0.05)
        await again.start()
        syncs[1] = again
        # on reconnecting, process 0 tells the newcomer what it has in flight
        await _until(lambda: len(b2.load.requests) == 1)
        ep = b2.endpoint_of(d.worker_id, 0)
        assert b2.load.inflight[ep] == 1 and b2.load.prefill_tokens[ep] == 0  # past first token
        a.route(RouteRequest("after", list(range(40))))
        await _until(lambda: len(b2.load.requests) == 2)
        a.on_finish("before")
        await _until(lambda: len(b2.load.requests) == 1)
    finally:
        for s in syncs:
            await s.close()


async def test_bad_batches_are_counted_never_raised(tmp_path):
    a = _router()
    (sync,) = [LocalLoadSync(a, str(tmp_path), 0, 2, replica_id="p0")]
    await sync.start()
    try:
        reader, writer = await asyncio.open_unix_connection(load_socket(str(tmp_path), 0))
        for junk in (b"[", b'{"replica": 5}', b'{"replica": "x", "events": [["?", "id"]]}'):
            writer.write(junk + b"\n")
        writer.write(b"\xff" * 10 + b"\n")
        await writer.drain()
        await _until(lambda: sync.stats.dropped_malformed == 4)
        writer.close()
        a.route(RouteRequest("still-works", list(range(20))))
        assert sync.stats_dict()["dropped_malformed"] == 4
    finally:
        await sync.close()


class _Tee:
    """Hears a router's lifecycle for two listeners: the process's sync and a reference that
    keeps every event (ReplicaLoad with ``send``)."""

    def __init__(self, *listeners) -> None:
        self.listeners = listeners

    def added(self, r) -> None:
        for x in self.listeners:
            x.added(r)

    def first_token(self, request_id: str) -> None:
        for x in self.listeners:
            x.first_token(request_id)

    def finished(self, request_id: str) -> None:
        for x in self.listeners:
            x.finished(request_id)


class _Capture:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    def is_closing(self) -> bool:
        return False


def _load_state(r: Router) -> tuple:
    load = r.load
    return (
        sorted(load.requests),
        load.inflight.tolist(),
        load.prefill_tokens.tolist(),
        load.decode_blocks.tolist(),
        load.prefill_tokens_at(7.5).tolist(),  # with the prefill model's head-of-line decay
        {ep: list(q) for ep, q in load._pending.items() if q},  # prefills queued per endpoint
        dict(load.counters),  # an event for a request it does not hold counts here
    )


@pytest.mark.parametrize("prefill_model", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_requests_that_end_within_one_batch_are_not_sent_and_peers_load_is_the_same(
    seed, prefill_model
):
    """The batch leaves without the requests added and finished before it, a first token rides
    in its request's "a" and a "t" followed by its "f" leaves as the "f" alone: a peer's load
    model after each batch is exactly what it would be had every event been sent. Random
    lifecycles and flush points, a retried id."""
    from kvplug.prefill_model import CalibratedPrefillModel
    from kvplug.replica_sync import ReplicaLoad

    def router(s: int) -> Router:
        predictor = CalibratedPrefillModel() if prefill_model else None
        r = Router(
            RouterConfig(kv_block_size=16), rng=random.Random(s), prefill_predictor=predictor
        )
        for w in range(3):
            r.add_worker(Worker(f"w{w}"))
        return r

    rng = random.Random(seed)
    sender, peer, reference = router(seed), router(1), router(1)
    sync = LocalLoadSync(sender, "/nonexistent", 0, 2, replica_id="p0", flush_s=0)
    sync._out[1] = out = _Capture()  # type: ignore[assignment]
    sent_all: list = []
    everything = ReplicaLoad(sender, "p0", send=sent_all.append)
    sender.load.listener = _Tee(sync, everything)
    folded = LocalLoadSync(peer, "/nonexistent", 1, 2, replica_id="p1", clock=lambda: 7.0)
    ref = ReplicaLoad(reference, "p1", clock=lambda: 7.0)
    everything.stats.published_events = 0  # counted here as they are folded
    live: list[str] = []
    started: set[str] = set()
    for step in range(400):
        roll = rng.random()
        if roll < 0.35 or not live:
            rid = f"q{step}" if rng.random() > 0.05 or not live else rng.choice(live)  # a retry
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 80))]
            sender.route(RouteRequest(rid, prompt))
            started.discard(rid)
            if rid not in live:
                live.append(rid)
        elif roll < 0.6:
            rid = rng.choice(live)
            sender.on_first_token(rid)
            started.add(rid)
        elif roll < 0.85:
            rid = live.pop(rng.randrange(len(live)))
            sender.on_finish(rid)
        else:  # a flush: the peer folds the batch; the reference folds every event
            sync._flush()
            for line in out.lines:
                folded.apply_line(line)
            out.lines.clear()
            ref.apply_events("p0", sent_all)
            everything.stats.published_events += len(sent_all)
            sent_all.clear()
            assert _load_state(peer) == _load_state(reference), f"step {step}"
    assert sync.unsent_requests > 0  # the test exercised what it is about
    assert sync.stats.published_events < everything.stats.published_events
    assert folded.stats.dropped_malformed == 0 and folded.stats.dropped_unknown_worker == 0


def test_merged_metrics_label_every_sample_with_its_process():
    text0 = (
        "# HELP kvplug_requests_total requests\n# TYPE kvplug_requests_total counter\n"
        'kvplug_requests_total{code="200"} 3.0\n'
        "# HELP kvplug_ttft_seconds ttft\n# TYPE kvplug_ttft_seconds histogram\n"
        'kvplug_ttft_seconds_bucket{le="0.1"} 1.0\nkvplug_ttft_seconds_bucket{le="+Inf"} 2.0\n'
        "kvplug_ttft_seconds_count 2.0\nkvplug_ttft_seconds_sum 0.5\n"
    )
    text1 = text0.replace(" 3.0", " 4.0")
    out = merge_metrics({0: text0, 1: text1, 2: None}).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(out)
        for s in fam.samples
    }
    assert samples[("kvplug_requests_total", (("code", "200"), ("process", "0")))] == 3.0
    assert samples[("kvplug_requests_total", (("code", "200"), ("process", "1")))] == 4.0
    assert samples[("kvplug_ttft_seconds_bucket", (("le", "+Inf"), ("process", "1")))] == 2.0
    assert samples[("kvplug_process_up", (("process", "2"),))] == 0.0
    assert samples[("kvplug_process_up", (("process", "0"),))] == 1.0
    assert out.count("# TYPE kvplug_requests_total counter") == 1  # one family, not one each
