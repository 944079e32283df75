"""Three `kvplug serve` replicas over real etcd and NATS in front of `kvplug sim` engines.

The engines register in etcd (as the vLLM plugin beside a real engine would); every replica
discovers them there, subscribes to every engine's KV events itself and shares in-flight load
over NATS. Checked: each replica finds every engine; a conversation whose turns go to different
replicas stays on the engine holding its prefix (the replicas' indexes converge); a replica
SIGKILLed mid-run loses no request for a client that retries on another replica, and the others
release the dead replica's load when its heartbeats stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_etcd_discovery import etcd_url  # noqa: F401 - fixture
from test_replica_sync import nats_url  # noqa: F401 - fixture

from kvplug.discovery.etcd import EtcdRegistration
from kvplug.testing import free_port, free_port_runs, serve_command, stop_process, wait_ready

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
MODEL = "sim-llama-3-8b"
ENGINES = 4


def _post(url: str, body: dict, timeout: float = 30) -> tuple[dict, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())


def _ready(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=3) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except OSError:
        return {}


def _stat(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    key = f'kvplug_router_stat{{stat="{name}"}} '
    return float(text.split(key)[1].split()[0]) if key in text else 0.0


def _until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def _register(etcd: str, base: int) -> list[EtcdRegistration]:
    regs = []
    for i in range(ENGINES):
        reg = EtcdRegistration(
            etcd, {"id": f"e{i}", "url": f"http://127.0.0.1:{base + i}"}, namespace="e2e", ttl=15
        )
        for _ in range(60):
            try:
                await reg.start()
                break
            except ConnectionError:
                await asyncio.sleep(0.2)
        regs.append(reg)
    return regs


def test_three_replicas_share_engines_indexes_and_load(etcd_url, nats_url, tmp_path):  # noqa: F811
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    base, ev, rp = free_port_runs(ENGINES, 3)
    procs: list[subprocess.Popen] = []
    loop = asyncio.new_event_loop()  # the registrations' keep-alives run on it in a thread
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    regs: list[EtcdRegistration] = []
    try:
        sim_log = (tmp_path / "sim.log").open("wb")
        sim = subprocess.Popen(
            [sys.executable, "-m", "kvplug.cli", "sim", "--engines", str(ENGINES),
             "--base-port", str(base), "--events-base-port", str(ev),
             "--replay-base-port", str(rp), "--speed", "20"],
            stdout=sim_log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        procs.append(sim)
        for i in range(ENGINES):
            wait_ready(f"http://127.0.0.1:{base + i}/health", proc=sim, timeout=30)
        regs = run(_register(etcd_url, base))
        fronts = []
        for r in range(3):
            port = free_port()
            log = (tmp_path / f"serve{r}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    serve_command(
                        port,
                        "--kv-block-size",
                        "16",
                        "--log-level",
                        "info",
                        "--discovery",
                        etcd_url,
                        "--replica-sync",
                        nats_url,
                        "--fleet-namespace",
                        "e2e",
                        "--replica-id",
                        f"replica{r}",
                    ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            )
            fronts.append(f"http://127.0.0.1:{port}")
        for r, front in enumerate(fronts):
            wait_ready(front + "/health", proc=procs[1 + r], timeout=60)
            # every replica found every engine in etcd and hears each one's events
            _until(lambda f=front: _ready(f).get("workers") == ENGINES, 90, f"{front} sees engines")
        warm = 0
        for front in fronts:  # engines publish on requests: make every replica hear every one
            while not all(
                (v or {}).get("events") for v in _ready(front).get("events", {}).values()
            ):
                for i in range(ENGINES):
                    warm += 1
                    body = {"model": MODEL, "prompt": f"warm-up {warm} " * 8, "max_tokens": 1}
                    _post(f"http://127.0.0.1:{base + i}/v1/completions", body)
                time.sleep(0.3)

        # conversations: turn k goes to replica k % 3; all turns must stay on one engine
        docs = {c: f"Conversation {c} is about topic number {c * 7919}. " * 40 for c in range(6)}
        home: dict[int, str] = {}
        for c, doc in docs.items():
            h, _ = _post(fronts[0] + "/v1/completions", {"model": MODEL, "prompt": doc + "T0",
                                                          "max_tokens": 2})  # fmt: skip
            home[c] = h["x-kvplug-worker"]
        blocks = sum(len(d.encode()) // 16 for d in docs.values())
        for front in fronts:  # every replica indexed the engines' events on its own
            _until(lambda f=front: _stat(f, "index.blocks") >= blocks, 60, f"{front} indexes")
        for turn in range(1, 4):
            for c, doc in docs.items():
                req = {"model": MODEL, "prompt": doc + f"T{turn}", "max_tokens": 2}
                h, body = _post(fronts[turn % 3] + "/v1/completions", req)
                assert h["x-kvplug-worker"] == home[c], (c, turn, fronts[turn % 3])
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(doc) - 32
        assert len(set(home.values())) >= 2  # the conversations were spread, not herded

        # replica 2 dies mid-run (SIGKILL: no goodbye); a client retries elsewhere, loses nothing
        procs[3].send_signal(signal.SIGKILL)
        procs[3].wait(10)
        answered = 0
        for n in range(12):
            for attempt in (fronts[n % 3], fronts[(n + 1) % 3]):
                try:
                    _post(attempt + "/v1/completions",
                          {"model": MODEL, "prompt": f"after the crash {n} " * 10, "max_tokens": 2},
                          timeout=10)  # fmt: skip
                    answered += 1
                    break
                except (urllib.error.URLError, ConnectionError):
                    continue
        assert answered == 12
        for front in fronts[:2]:  # the dead replica's heartbeats stopped: its load is released
            _until(lambda f=front: _stat(f, "replica_sync.expired_peers") >= 1, 45, "expiry")
            assert _stat(front, "replica_sync.remote_inflight") == 0
            assert _stat(front, "replica_sync.dropped_malformed") == 0
    finally:
        for reg in regs:
            run(reg.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        for p in reversed(procs):
            stop_process(p, timeout=5, sig=signal.SIGTERM)
