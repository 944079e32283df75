"""Workers joining and leaving through a real etcd server (kvplug.discovery.etcd), seen by a
running frontend: registration with a lease, watch, lease expiry, deregistration, bad values."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest
from test_frontend_harness import MODEL, prompt, serving

from kvplug.discovery.etcd import (
    EtcdDiscovery,
    EtcdRegistration,
    parse_etcd_url,
    workers_prefix,
)
from kvplug.errors import ConfigError
from kvplug.frontend.stub_engine import StubEngine, publish
from kvplug.testing import free_ports, wait_listening

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def etcd_url(tmp_path):
    binary = shutil.which("etcd")
    if binary is None:  # CI installs it (.ci/run); a skip there fails the run
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    client, peer = free_ports(2)
    proc = subprocess.Popen(
        [
            binary,
            "--data-dir",
            str(tmp_path / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(client, proc)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(10)


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _started(obj, attempts: int = 60) -> None:
    for _ in range(attempts):  # etcd takes a moment to serve after its process starts
        try:
            return await obj.start()
        except ConnectionError:
            await asyncio.sleep(0.2)
    await obj.start()


async def test_workers_join_and_leave_through_etcd(etcd_url):
    async with serving(1) as h:  # w0 is static: discovery must never touch it
        engine = StubEngine("e1", block_size=16, model=MODEL)
        await engine.start()
        publish(engine)
        discovery = EtcdDiscovery(h.frontend.fleet, etcd_url, namespace="t", default_engine="stub")
        # ttl 4 (keep-alive every 1.3 s): a keep-alive late by a second on a loaded machine
        # must not let the lease lapse before the engine is meant to die
        reg = EtcdRegistration(
            etcd_url, {"id": "e1", "url": engine.url, "engine": "stub"}, namespace="t", ttl=4
        )
        try:
            await _started(reg)  # registered before the router starts: found by the first read
            await _started(discovery)
            assert "e1" in h.frontend.fleet.workers and discovery.stats.added == 1
            resp, _ = await h.complete(prompt(2, 1), headers={"x-kvplug-worker": "e1"})
            assert resp.status == 200 and resp.headers["x-kvplug-worker"] == "e1"
            # the engine dies: no more keep-alives, the lease expires, the worker leaves
            await reg.close(revoke=False)
            await _until(lambda: "e1" not in h.frontend.fleet.workers)
            assert discovery.stats.removed == 1 and "w0" in h.frontend.fleet.workers
            # it comes back (registered while the router watches), then deregisters cleanly
            reg = EtcdRegistration(
                etcd_url, {"id": "e1", "url": engine.url, "engine": "stub"}, namespace="t"
            )
            await reg.start()
            await _until(lambda: "e1" in h.frontend.fleet.workers)
            await reg.close()
            await _until(lambda: "e1" not in h.frontend.fleet.workers)
            assert discovery.stats.added == 2 and discovery.stats.removed == 2
            h.assert_idle()
        finally:
            await reg.close()
            await discovery.close()
            await engine.stop()


async def test_bad_entries_are_counted_and_static_workers_kept(etcd_url):
    import aetcd

    async with serving(1) as h:
        discovery = EtcdDiscovery(h.frontend.fleet, etcd_url, namespace="t", default_engine="stub")
        await _started(discovery)
        host, port = parse_etcd_url(etcd_url)
        client = aetcd.Client(host=host, port=port)
        await client.connect()
        try:
            prefix = workers_prefix("t")
            bad = {
                "junk": b"\xff not json",
                "list": b"[1, 2]",
                "nourl": json.dumps({"engine": "stub"}).encode(),
                "wrongid": json.dumps({"id": "other", "url": "http://127.0.0.1:1"}).encode(),
                "w0": json.dumps({"url": "http://127.0.0.1:1", "engine": "stub"}).encode(),
            }
            for name, value in bad.items():
                await client.put((prefix + name).encode(), value)
            await _until(lambda: discovery.stats.invalid == len(bad))
            assert set(h.frontend.fleet.workers) == {"w0"}  # static w0 untouched
            await client.delete((prefix + "w0").encode())
            # a later bad entry, counted, shows the watch got past the delete (not a sleep)
            await client.put((prefix + "after").encode(), b"[]")
            await _until(lambda: discovery.stats.invalid == len(bad) + 1)
            assert "w0" in h.frontend.fleet.workers
            resp, _ = await h.complete(prompt(1, 2))
            assert resp.status == 200
        finally:
            await client.close()
            await discovery.close()


async def test_registration_comes_back_after_its_lease_is_lost(etcd_url):
    """A lease lost while the engine lives (etcd away or this process stalled past the TTL;
    here revoked from outside, which is the same to etcd): etcd deletes the entry and answers
    the next keep-alive with TTL 0, not an error. The registration puts the entry again under a
    new lease and a watching router sees the worker leave and come back."""
    import aetcd

    async with serving(0) as h:
        discovery = EtcdDiscovery(h.frontend.fleet, etcd_url, namespace="t", default_engine="stub")
        await _started(discovery)
        spec = {"id": "w9", "url": "http://127.0.0.1:1", "engine": "stub"}
        reg = EtcdRegistration(etcd_url, spec, namespace="t", ttl=3)
        await _started(reg)
        host, port = parse_etcd_url(etcd_url)
        client = aetcd.Client(host=host, port=port)
        await client.connect()
        key = (workers_prefix("t") + "w9").encode()
        try:
            await _until(lambda: "w9" in h.frontend.fleet.workers)
            lost = reg._lease.id
            await client.revoke_lease(lost)
            assert await client.get(key) is None  # gone from etcd
            deadline = asyncio.get_running_loop().time() + 10  # > ttl / 3 and a put
            while (value := await client.get(key)) is None:
                assert asyncio.get_running_loop().time() < deadline, "the entry never came back"
                await asyncio.sleep(0.1)
            assert json.loads(value.value) == spec
            assert reg._lease.id != lost and reg.reregistrations == 1
            await _until(lambda: discovery.mirror.stats.removed >= 1, timeout=10)
            await _until(lambda: "w9" in h.frontend.fleet.workers, timeout=10)
        finally:
            await client.close()
            await reg.close()
            await discovery.close()


def test_discovery_urls():
    assert parse_etcd_url("etcd://10.0.0.1:2379") == ("10.0.0.1", 2379)
    assert parse_etcd_url("etcd://etcd") == ("etcd", 2379)
    for bad in ("nats://x:1", "etcd://", "etcd://h:99999"):
        with pytest.raises(ConfigError):
            parse_etcd_url(bad)
