"""Router replicas sharing in-flight load over a real nats-server (kvplug.replica_sync)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import time
import urllib.request

import pytest

from kvplug.config import RouterConfig
from kvplug.replica_sync import LoadSync
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.testing import free_port, wait_listening
from kvplug.workers import Worker

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _nats_server(*extra: str):
    binary = shutil.which("nats-server")
    if binary is None:  # CI installs it (.ci/run); a skip there fails the run
        pytest.skip("nats-server is not installed (apt-get install nats-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, proc)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def nats_url():
    with _nats_server() as url:
        yield url


def _router(seed: int = 0, workers: int = 3) -> Router:
    r = Router(RouterConfig(kv_block_size=16), rng=random.Random(seed))
    for w in range(workers):
        r.add_worker(Worker(f"w{w}"))
    return r


async def _replicas(nats_url: str, routers: list[Router], **kw) -> list[LoadSync]:
    syncs = []
    for i, r in enumerate(routers):
        s = LoadSync(r, nats_url, namespace="t", replica_id=f"r{i}", **kw)
        await s.start()  # the fixture waited until nats-server listens
        syncs.append(s)
    return syncs


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _inflight(r: Router) -> dict[str, int]:
    return {w: int(r.load.inflight[r.endpoint_of(w, 0)]) for w in r.workers}


async def test_a_peers_requests_count_as_load_until_they_finish(nats_url):
    a, b = _router(), _router()
    syncs = await _replicas(nats_url, [a, b])
    try:
        d = a.route(RouteRequest("q1", list(range(100))))
        ep_b = b.endpoint_of(d.worker_id, 0)
        await _until(lambda: b.load.inflight[ep_b] == 1)
        assert b.load.prefill_tokens[ep_b] == 100  # nothing cached: all of it is prefill
        assert b.load.decode_blocks[ep_b] == 7  # 6 full blocks + the partial one
        a.on_first_token("q1")
        await _until(lambda: b.load.prefill_tokens[ep_b] == 0)
        assert b.load.inflight[ep_b] == 1
        a.on_finish("q1")
        await _until(lambda: b.load.inflight[ep_b] == 0)
        assert b.load.decode_blocks[ep_b] == 0 and not b.load.requests
        assert syncs[1].stats.applied_events == 3 and syncs[1].stats.dropped_malformed == 0
    finally:
        for s in syncs:
            await s.close()


@pytest.mark.parametrize("sync", [False, True])
async def test_replicas_herd_without_sync_and_spread_with_it(nats_url, sync):
    # identical replicas (same state, same random stream) see the same idle fleet
    routers = [_router(seed=0) for _ in range(3)]
    syncs = await _replicas(nats_url, routers) if sync else []
    try:
        picks = []
        for i, r in enumerate(routers):
            picks.append(r.route(RouteRequest(f"q{i}", list(range(64)))).worker_id)
            if sync:  # the next request comes after the previous decision reached the peers
                await _until(lambda n=i + 1: all(sum(_inflight(o).values()) == n for o in routers))
        if sync:
            assert sorted(picks) == ["w0", "w1", "w2"], picks
        else:
            assert len(set(picks)) == 1, picks  # all three on one worker: herding
    finally:
        for s in syncs:
            await s.close()


async def _peer_with_three_requests(nats_url: str, **kw) -> tuple[Router, list[LoadSync]]:
    """Two synced replicas; the first has routed 3 requests and the second holds them as
    load. Returns the second's router and both syncs."""
    a, b = _router(), _router()
    syncs = await _replicas(nats_url, [a, b], heartbeat_s=0.2, **kw)
    for i in range(3):
        a.route(RouteRequest(f"q{i}", list(range(40))))
    await _until(lambda: len(b.load.requests) == 3)
    return b, syncs


async def test_a_replica_that_dies_has_its_load_released(nats_url):
    # expiry 15 heartbeats: a live peer is never expired by an event loop late by a second
    # or two on a loaded machine (expired_peers == 1 below counts the dead one only)
    b, syncs = await _peer_with_three_requests(nats_url, expiry_s=3.0)
    try:
        await syncs[0].close(say_bye=False)  # killed: no goodbye, heartbeats stop
        await _until(lambda: not b.load.requests)
        assert syncs[1].stats.expired_peers == 1
        assert sum(_inflight(b).values()) == 0
    finally:
        await syncs[1].close()


async def test_a_stall_of_this_event_loop_does_not_expire_live_peers(nats_url):
    """The loop blocks for longer than the expiry while the peer lives: the peer's heartbeats
    of the meantime wait unread in the socket, so its silence is this replica's. The first
    heartbeat tick after the stall is late and expires nobody; the peer's requests stay."""
    b, syncs = await _peer_with_three_requests(nats_url, expiry_s=1.0)
    try:
        time.sleep(1.6)  # a blocking call on the loop: a GC pause, a long decode, CPU starved
        await asyncio.sleep(1.0)  # the ticks after it, the peer's heartbeats read meanwhile
        assert syncs[1].stats.expired_peers == 0 and len(b.load.requests) == 3
        assert syncs[1].stats.late_heartbeats >= 1
    finally:
        for s in syncs:
            await s.close()


async def test_a_replica_that_stops_cleanly_releases_at_once(nats_url, caplog):
    a, b = _router(), _router()
    syncs = await _replicas(nats_url, [a, b], expiry_s=60)
    try:
        a.route(RouteRequest("q", list(range(40))))
        await _until(lambda: len(b.load.requests) == 1)
        await syncs[0].close()  # says bye
        await _until(lambda: not b.load.requests, timeout=15)  # well before the 60 s expiry
        assert syncs[1].stats.expired_peers == 0
        # a deliberate close is not a lost connection (nats-py reports both as disconnected)
        assert "reconnecting" not in caplog.text
    finally:
        await syncs[1].close()


async def test_bad_messages_are_counted_never_raised(nats_url):
    import nats

    a, b = _router(), _router(workers=2)  # b does not know w2
    syncs = await _replicas(nats_url, [a, b])
    nc = await nats.connect(nats_url)
    try:
        for junk in (
            b"",
            b"[",
            b'{"replica": 5}',
            b'{"replica": "x", "events": [["a", 1]]}',
            b'{"replica": "x", "events": [["?", "id"]]}',
            b"\xff" * 10,
        ):
            await nc.publish(syncs[1].subject, junk)
        await nc.flush()
        await _until(lambda: syncs[1].stats.dropped_malformed == 6)
        ep = a.endpoint_of("w2", 0)
        a.load.add(
            "q",
            ep,
            10,
            0,
            track_prefill=True,
            track_decode=True,
            decode_blocks=1.0,
            expected_osl=None,
            track_output=False,
            now=0.0,
        )
        await _until(lambda: syncs[1].stats.dropped_unknown_worker == 1)
        assert not b.load.requests
        b.route(RouteRequest("still-works", list(range(20))))
        stats = b.stats()["replica_sync"]  # what /metrics exports as kvplug_router_stat
        assert stats["dropped_malformed"] == 6 and stats["dropped_unknown_worker"] == 1
    finally:
        await nc.close()
        for s in syncs:
            await s.close()


async def test_a_started_replica_already_hears_its_peers():
    """start() returns once the server has the subscription: a peer's event published right
    after it reaches this replica. nats-py's subscribe() only queues the SUB; the first event
    of a peer could pass the server before it (CI, loaded: a replica missed a peer's request)."""
    monitor = free_port()
    with _nats_server("-m", str(monitor)) as url:
        a = LoadSync(_router(), url, namespace="t", replica_id="a")
        await a.start()
        b = LoadSync(_router(), url, namespace="t", replica_id="b")
        await b.start()
        try:
            # the event loop is held: nothing more leaves either client meanwhile
            deadline = time.monotonic() + 5
            while True:
                connz = f"http://127.0.0.1:{monitor}/connz?subs=1"
                with urllib.request.urlopen(connz, timeout=5) as r:
                    conns = json.loads(r.read())["connections"]
                subs = {c.get("name"): c.get("subscriptions_list", []) for c in conns}
                if b.subject in subs.get("kvplug-b", []) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert b.subject in subs.get("kvplug-b", []), f"the server has no SUB of b: {subs}"
        finally:
            await a.close()
            await b.close()


async def test_an_unreachable_nats_fails_fast_with_a_clear_error():
    sync = LoadSync(_router(), f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5)
    with pytest.raises(ConnectionError, match="no NATS server answered"):
        await sync.start()
