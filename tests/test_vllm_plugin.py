"""kvplug's vLLM plugin (``vllm.general_plugins`` entry point) without a real engine: a real
``kvplug serve`` frontend with its admin API, and a simulated vLLM engine (``kvplug.sim``: vLLM's
``/kv_event_sources``, ``/metrics`` and KV-event wire) standing in for the API server the
plugin runs in. The real-engine test is ``tests/test_vllm_plugin_real.py``.

Checks: nothing happens without ``KVPLUG_ROUTER_URL``; only the first process acts (children,
forked or spawned, inherit the marker); the registration carries what the engine reports (real
event endpoints, capacity, models, role from ``--kv-transfer-config``) and the worker routes;
kvplug unreachable at first → retried in the background; a refusal (block size, wrong URL or
token) is logged, not retried; a stale worker of the same id is replaced; a restarted kvplug
gets the worker again; shutdown drains, then removes; an engine whose API closes is taken out
at once; the command line parsed from a namespace or argv.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from kvplug.integrations.vllm import plugin
from kvplug.integrations.vllm.plugin import (
    OWNER_ENV,
    ROUTER_URL_ENV,
    WORKER_ID_ENV,
    EngineView,
    Registrar,
    ServeArgs,
    args_from_argv,
    args_from_namespace,
    worker_entry,
)
from test_etcd_discovery import etcd_url  # noqa: F401 - fixture
from vllm_helpers import wait_subscribed

from kvplug.config import RouterConfig
from kvplug.frontend.app import ServeSettings
from kvplug.frontend.server import start_frontend
from kvplug.router import Router
from kvplug.sim.server import FleetOptions, SimServer
from kvplug.testing import free_port, free_ports

pytestmark = pytest.mark.timeout(60)
TOKEN = "plugin-test-token"
BS = 16
ROOT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def kvplug_serve(admin_port: int | None = 0, block_size: int = BS) -> AsyncIterator:
    router = Router(RouterConfig(kv_block_size=block_size), rng=random.Random(0))
    running = await start_frontend(
        router,
        [],
        ServeSettings(health_interval=0.2, health_timeout=5.0),
        admin_token=TOKEN,
        admin_port=admin_port,
    )
    try:
        yield running
    finally:
        await running.close()


@asynccontextmanager
async def sim_engine(block_size: int = BS) -> AsyncIterator[SimServer]:
    port, events, replay = free_ports(3)
    opts = FleetOptions(
        engines=1,
        base_port=port,
        events_base_port=events,
        replay_base_port=replay,
        block_size=block_size,
        capacity_blocks=512,
        speed=50.0,
        model="sim-model",
    )
    server = SimServer(0, opts)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def admin_workers(running) -> dict[str, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(
            running.admin_url + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            return {w["id"]: w for w in (await r.json())["workers"]}


async def until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def is_set(event: threading.Event) -> bool:
    return event.is_set()


def engine_args(sim: SimServer, **kw) -> ServeArgs:
    return ServeArgs(host="127.0.0.1", port=sim.port, **kw)


# -- which process acts -------------------------------------------------------------------------


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin's process-wide state as in a new process; restored afterwards."""
    monkeypatch.setattr(plugin, "_registrar", None)
    # register() marks os.environ itself; set-then-delete makes monkeypatch remove that mark
    # afterwards (a bare delenv of an absent variable restores nothing), or every engine the
    # suite starts later would inherit it and think another process registers
    monkeypatch.setenv(OWNER_ENV, "")
    monkeypatch.delenv(OWNER_ENV)
    yield plugin
    if plugin._registrar is not None:
        plugin._registrar.stopping.set()
        assert plugin._registrar.done.wait(5)


def test_without_the_variable_nothing_happens(fresh_plugin, monkeypatch):
    monkeypatch.delenv(ROUTER_URL_ENV, raising=False)
    threads = threading.active_count()
    fresh_plugin.register()
    assert fresh_plugin._registrar is None and OWNER_ENV not in os.environ
    assert threading.active_count() == threads


def _child_registers(queue) -> None:  # runs in a child process (spawn or fork)
    from kvplug.integrations.vllm import plugin as child_plugin

    child_plugin.register()
    queue.put(child_plugin._registrar is not None and child_plugin._registrar._pid == os.getpid())


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_only_the_first_process_registers(fresh_plugin, monkeypatch, method):
    """vLLM loads general plugins in the API server, engine core and worker processes: the
    first one acts, the children it starts (as vLLM starts them) stay out."""
    monkeypatch.setenv(ROUTER_URL_ENV, f"http://127.0.0.1:{free_port()}")
    fresh_plugin.register()
    first = fresh_plugin._registrar
    assert first is not None and os.environ[OWNER_ENV] == str(os.getpid())
    fresh_plugin.register()  # again in the same process (vLLM guards this too)
    assert fresh_plugin._registrar is first
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_registers, args=(queue,))
    proc.start()
    try:
        assert queue.get(timeout=30) is False
    finally:
        proc.join(10)
    if method == "spawn":  # (a forked child also inherits the registrar itself)
        # the marker is what keeps a spawned child out: without it, it would register
        monkeypatch.delenv(OWNER_ENV)
        proc = ctx.Process(target=_child_registers, args=(queue,))
        proc.start()
        try:
            assert queue.get(timeout=30) is True
        finally:
            proc.join(10)


def test_plugin_failure_never_raises_into_vllm(fresh_plugin, monkeypatch, caplog):
    monkeypatch.setenv(ROUTER_URL_ENV, "http://127.0.0.1:1")

    def boom(*a, **kw):
        raise RuntimeError("broken")

    monkeypatch.setattr(plugin.Registrar, "start", boom)
    fresh_plugin.register()  # logs, does not raise
    assert "could not start" in caplog.text and fresh_plugin._registrar is None


# -- registration against a real kvplug serve ---------------------------------------------------


async def test_registers_what_the_engine_reports_and_routes(caplog):
    caplog.set_level(logging.INFO)
    async with kvplug_serve() as running, sim_engine() as sim:
        reg = Registrar(
            running.admin_url,
            TOKEN,
            engine_args(
                sim,
                kv_role="kv_both",
                max_num_batched_tokens=4096,
                long_prefill_token_threshold=1024,
                long_prefill_token_threshold_adaptive=True,
            ),
            poll=0.05,
        ).start()
        try:
            await until(lambda: is_set(reg.registered))
            workers = await admin_workers(running)
            assert list(workers) == [f"127.0.0.1:{sim.port}"]
            w = workers[f"127.0.0.1:{sim.port}"]
            assert w["url"] == f"http://127.0.0.1:{sim.port}"
            assert (
                w["event_endpoint"] == sim.endpoint and w["replay_endpoint"] == sim.replay_endpoint
            )
            # vLLM's default topic is "": a label only when the engine publishes on another one
            assert w["labels"] == ({"kv_events_topic": sim.topic} if sim.topic else {})
            assert (w["dp_start"], w["dp_size"], w["role"]) == (0, 1, "both")
            assert w["kv_capacity_blocks"] == 512 and w["max_batched_tokens"] == 4096
            # vLLM's --long-prefill-token-threshold: the default routing predicts with it
            assert w["long_prefill_token_threshold"] == 1024
            assert w["long_prefill_token_threshold_adaptive"] is True
            assert w["models"] == ["sim-model"] and w["events_ready"] is True
            # it takes requests, and its KV events reach kvplug's index (once kvplug's SUB
            # hears the engine: a batch published before the ZMQ join is lost for good)
            subscriber = running.frontend.fleet.adapters["vllm"].subscriber
            await asyncio.to_thread(wait_subscribed, subscriber, [sim.publisher])
            prompt = list(range(1, 4 * BS + 1))
            async with aiohttp.ClientSession() as s:
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
                async with s.post(running.url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-kvplug-worker"] == w["id"]
                    await r.read()
            await until(lambda: _has_events(running, w["id"]))
            # shutdown: drained first, then removed
            await asyncio.to_thread(reg.shutdown)
            assert await admin_workers(running) == {}
        finally:
            reg.stopping.set()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kvplug")]
    drained = next(i for i, m in enumerate(messages) if "draining" in m)
    removed = next(i for i, m in enumerate(messages) if m.endswith("removed"))
    assert drained < removed


async def _has_events(running, worker_id: str) -> bool:
    return (await admin_workers(running))[worker_id]["events"] > 0


async def test_kvplug_unreachable_at_first_is_retried(caplog):
    admin_port = free_port()
    async with sim_engine() as sim:
        reg = Registrar(  # host:port without a scheme is taken as http
            f"127.0.0.1:{admin_port}", TOKEN, engine_args(sim), poll=0.05, max_backoff=0.3
        ).start()
        try:
            await until(lambda: _async_true("unreachable" in caplog.text))  # refused attempts ...
            await asyncio.sleep(0.6)  # ... that go on
            assert not reg.registered.is_set() and not reg.done.is_set()
            async with kvplug_serve(admin_port=admin_port) as running:
                await until(lambda: is_set(reg.registered))
                assert list(await admin_workers(running)) == [f"127.0.0.1:{sim.port}"]
                await asyncio.to_thread(reg.shutdown)
                assert await admin_workers(running) == {}
        finally:
            reg.stopping.set()


async def test_a_restarted_kvplug_gets_the_worker_again(caplog):
    (admin_port,) = free_ports(1)
    async with sim_engine() as sim:
        reg = Registrar(
            f"http://127.0.0.1:{admin_port}", TOKEN, engine_args(sim), poll=0.05, recheck=0.2
        ).start()
        try:
            async with kvplug_serve(admin_port=admin_port) as running:
                await until(lambda: is_set(reg.registered))
                assert list(await admin_workers(running)) == [f"127.0.0.1:{sim.port}"]
            async with kvplug_serve(admin_port=admin_port) as running:  # a new kvplug serve

                async def back() -> bool:
                    return list(await admin_workers(running)) == [f"127.0.0.1:{sim.port}"]

                await until(back)
                assert "no longer has worker" in caplog.text
        finally:
            reg.stopping.set()


async def test_a_refusal_is_logged_and_not_retried(caplog):
    async with kvplug_serve(block_size=32) as running, sim_engine(block_size=BS) as sim:
        reg = Registrar(running.admin_url, TOKEN, engine_args(sim), poll=0.05).start()
        try:
            await until(lambda: is_set(reg.done))
            assert not reg.registered.is_set()
            assert "refused the registration" in caplog.text and "block size 16" in caplog.text
            assert await admin_workers(running) == {}
        finally:
            reg.stopping.set()


async def test_a_wrong_url_or_token_says_which(caplog):
    async with kvplug_serve() as running, sim_engine() as sim:
        for url, token, hint in (
            (running.url, TOKEN, "KVPLUG_ROUTER_URL kvplug serve's admin API"),  # the OpenAI port
            (running.admin_url, "wrong", "KVPLUG_ADMIN_TOKEN kvplug serve's --admin-token"),
        ):
            reg = Registrar(url, token, engine_args(sim), poll=0.05).start()
            try:
                await until(lambda r=reg: is_set(r.done))
                assert not reg.registered.is_set() and hint in caplog.text
            finally:
                reg.stopping.set()
        assert await admin_workers(running) == {}


@pytest.mark.parametrize("named", [True, False])
async def test_a_stale_worker_of_the_same_id_is_replaced(monkeypatch, named):
    """A restarted engine finds its old entry (same KVPLUG_WORKER_ID, or the same host:port)."""
    async with kvplug_serve() as running, sim_engine() as old, sim_engine() as sim:
        if named:
            monkeypatch.setenv(WORKER_ID_ENV, "engine-a")
        stale = "engine-a" if named else f"127.0.0.1:{sim.port}"
        async with aiohttp.ClientSession() as s:
            async with s.post(
                running.admin_url + "/admin/workers",
                json={"id": stale, "url": f"http://127.0.0.1:{old.port}"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as r:
                assert r.status == 201
        reg = Registrar(running.admin_url, TOKEN, engine_args(sim), poll=0.05).start()
        try:
            await until(lambda: is_set(reg.registered))
            workers = await admin_workers(running)
            assert list(workers) == [stale]
            assert workers[stale]["url"] == f"http://127.0.0.1:{sim.port}"
        finally:
            reg.stopping.set()


async def test_an_engine_whose_api_closes_is_taken_out():
    async with kvplug_serve() as running, sim_engine() as sim:
        reg = Registrar(running.admin_url, TOKEN, engine_args(sim), poll=0.05).start()
        try:
            await until(lambda: is_set(reg.registered))
            assert sim.runner is not None
            await sim.runner.cleanup()  # the HTTP server closes, as at vLLM's shutdown
            sim.runner = None

            async def gone() -> bool:
                return await admin_workers(running) == {}

            await until(gone)
        finally:
            reg.stopping.set()


# -- the command line ---------------------------------------------------------------------------


def test_args_from_vllm_namespace_and_argv():
    class TransferConfig:  # vLLM hands parsed config objects, not dicts
        kv_role = "kv_producer"

        @property
        def broken(self):
            raise AssertionError("only the fields the plugin needs are read")

    ns = SimpleNamespace(
        host="0.0.0.0",
        port=8123,
        uds=None,
        ssl_keyfile=None,
        kv_transfer_config=TransferConfig(),
        kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',
        data_parallel_size=2,
        data_parallel_rank=None,
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=1024,
        long_prefill_token_threshold_adaptive=True,
    )
    a = args_from_namespace(ns)
    assert (a.host, a.port, a.kv_role, a.data_parallel_size) == ("0.0.0.0", 8123, "kv_producer", 2)
    assert a.events_config == {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}
    assert a.max_num_batched_tokens == 2048 and a.long_prefill_token_threshold == 1024
    assert a.long_prefill_token_threshold_adaptive
    argv = [
        "serve",
        "model",
        "--port=9001",
        "--host",
        "10.1.2.3",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}',
        "--max_num_batched_tokens",
        "512",
        "--long-prefill-token-threshold=256",
        "--long-prefill-token-threshold-adaptive",
        "--enforce-eager",
    ]
    b = args_from_argv(argv)
    assert (b.host, b.port, b.kv_role, b.max_num_batched_tokens) == (
        "10.1.2.3",
        9001,
        "kv_consumer",
        512,
    )
    assert b.long_prefill_token_threshold == 256
    assert b.long_prefill_token_threshold_adaptive
    assert not args_from_argv(
        ["--no-long-prefill-token-threshold-adaptive"]
    ).long_prefill_token_threshold_adaptive
    assert not args_from_argv(argv[:-2]).long_prefill_token_threshold_adaptive
    assert args_from_argv([]).port == 8000
    assert args_from_argv([]).long_prefill_token_threshold is None
    assert args_from_namespace(SimpleNamespace(port=1, host=None, headless=True)).headless


def test_a_headless_engine_does_not_register():
    reg = Registrar("http://127.0.0.1:1", TOKEN, ServeArgs(port=free_port(), headless=True))
    reg.start()
    assert reg.done.wait(15) and not reg.registered.is_set()


def test_worker_entry_roles_ranks_and_labels():
    from kvplug.integrations.vllm.discovery import RankSource

    view = EngineView(
        sources=[
            RankSource(1, "tcp://*:41002", None, "kv"),
            RankSource(0, "tcp://*:41001", "tcp://*:41003", "kv"),
        ],
        block_size=16,
        num_gpu_blocks=1000,
        models=["m"],
    )
    for role, want in (("kv_producer", "prefill"), ("kv_consumer", "decode"), (None, "both")):
        e = worker_entry("w", "http://h:1", ServeArgs(kv_role=role), view, {"zone": "a"})
        assert e["role"] == want
    assert e["event_endpoint"] == "tcp://*:41001" and e["replay_endpoint"] == "tcp://*:41003"
    assert (e["dp_start"], e["dp_size"]) == (0, 2)
    assert e["labels"] == {"zone": "a", "kv_events_topic": "kv"}
    assert e["kv_capacity_blocks"] == 1000 and e["models"] == ["m"] and e["id"] == "w"


def test_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'kvplug = "kvplug.integrations.vllm.plugin:register"' in text
    assert callable(plugin.register) and sys.modules["kvplug.integrations.vllm.plugin"]


async def test_etcd_mode_registers_for_replicas_and_drains_before_leaving(etcd_url, caplog):  # noqa: F811
    # KVPLUG_ETCD_URL: the engine's entry goes into etcd under a lease; a kvplug serve started
    # with --discovery etcd://... picks it up; shutdown drains it there, then revokes the lease
    from kvplug.integrations.vllm.plugin import EtcdRegistrar

    from kvplug.discovery.etcd import EtcdDiscovery

    caplog.set_level(logging.INFO)
    async with kvplug_serve() as running, sim_engine() as sim:
        fleet = running.frontend.fleet
        discovery = EtcdDiscovery(fleet, etcd_url, namespace="plug")
        for _ in range(60):  # etcd takes a moment to serve after its process starts
            try:
                await discovery.start()
                break
            except ConnectionError:
                await asyncio.sleep(0.2)
        reg = EtcdRegistrar(etcd_url, "plug", engine_args(sim), poll=0.05, ttl=5).start()
        wid = f"127.0.0.1:{sim.port}"
        try:
            await until(lambda: is_set(reg.registered))
            await until(lambda: _async_true(wid in fleet.workers))
            entry = fleet.workers[wid]
            assert entry.spec.event_endpoint == sim.endpoint and not entry.draining
            async with aiohttp.ClientSession() as s:
                body = {"model": "sim-model", "prompt": list(range(1, 40)), "max_tokens": 2}
                async with s.post(running.url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-kvplug-worker"] == wid
            shutdown = asyncio.create_task(asyncio.to_thread(reg.shutdown))
            await until(lambda: _async_true(wid in fleet.workers and fleet.workers[wid].draining))
            await shutdown
            await until(lambda: _async_true(wid not in fleet.workers))
            assert discovery.stats.drained == 1 and discovery.stats.removed == 1
        finally:
            reg.stopping.set()
            await discovery.close()


async def _async_true(value: bool) -> bool:
    return value


# vLLM 0.34.0's own cases (tests/v1/kv_connector/unit/test_multi_connector.py,
# test_multi_connector_role_follows_children): MultiConnector's children decide whether the
# engine loads KV (consumer) and saves it (producer); kvplug's role is the pair of the two
@pytest.mark.parametrize(
    ("top_role", "child_roles", "consumer", "producer"),
    [
        ("kv_producer", ["kv_producer", "kv_both"], True, True),
        ("kv_producer", ["kv_producer", "kv_producer"], False, True),
        ("kv_consumer", ["kv_consumer", "kv_both"], True, True),
        ("kv_both", ["kv_producer"], False, True),
    ],
    ids=["loading-child", "pure-producers", "saving-child", "no-loading-child"],
)
def test_multiconnector_role_follows_its_children(top_role, child_roles, consumer, producer):
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": top_role,
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "ExampleConnector", "kv_role": r} for r in child_roles]
        },
    }
    want = {(True, True): "both", (False, True): "prefill", (True, False): "decode"}
    role = want[(consumer, producer)]

    class TransferConfig:  # as vLLM hands it: an object with these fields
        kv_role = config["kv_role"]
        kv_connector = config["kv_connector"]
        kv_connector_extra_config = config["kv_connector_extra_config"]

    from_ns = args_from_namespace(SimpleNamespace(port=1, kv_transfer_config=TransferConfig()))
    from_argv = args_from_argv(["serve", "m", "--kv-transfer-config", json.dumps(config)])
    view = EngineView()
    for args in (from_ns, from_argv):
        assert worker_entry("w", "http://h:1", args, view, {})["role"] == role
    # without child roles (vLLM before 0.34 passed the top-level role down) the top one counts
    bare = {**config, "kv_connector_extra_config": {"connectors": [{"kv_connector": "X"}]}}
    assert args_from_argv(["--kv-transfer-config", json.dumps(bare)]).kv_role == top_role
