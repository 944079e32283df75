"""End to end over real sockets: `kvplug sim` engines behind `kvplug serve`. The frontend
discovers each simulated engine as a vLLM one (/kv_event_sources, cache_config_info), consumes
its ZMQ KV events, and routes follow-up prompts to the engine that cached their prefix."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvplug.testing import free_port, free_port_runs, serve_command, stop_process, wait_ready

MODEL = "sim-llama-3-8b"  # kvplug sim's default served model name


def _wait_for_event_streams(front: str, engines: dict[str, int], timeout: float = 60.0) -> None:
    """Until kvplug has received events from every engine. A PUB drops what it sends before a
    new subscriber's subscription reaches it (ZMQ), so the first batch after start-up may be
    lost; the next batch shows the sequence gap and kvplug replays. Warm-up requests sent
    straight to the engines produce those batches."""
    end = time.monotonic() + timeout
    n = 0
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(front + "/ready", timeout=2) as r:
                body = r.read()
        except urllib.error.HTTPError as exc:  # 503 while not ready; the body still says why
            body = exc.read()
        events = json.loads(body).get("events", {})
        missing = [w for w in engines if not (events.get(w) or {}).get("events")]
        if not missing:
            return
        for w in missing:
            n += 1
            _post(
                f"http://127.0.0.1:{engines[w]}/v1/completions",
                {"model": MODEL, "prompt": f"warm-up {n} " * 8, "max_tokens": 1},
            )
        time.sleep(0.3)
    raise AssertionError("kvplug received no KV events from the simulated engines")


def _wait_index_blocks(front: str, at_least: int, timeout: float = 60.0) -> None:
    key = 'kvplug_router_stat{stat="index.blocks"} '
    end = time.monotonic() + timeout
    blocks = 0.0
    while time.monotonic() < end:
        with urllib.request.urlopen(front + "/metrics", timeout=5) as r:
            text = r.read().decode()
        blocks = float(text.split(key)[1].split()[0]) if key in text else 0.0
        if blocks >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"router indexed {blocks} blocks, expected at least {at_least}")


def _post(url: str, body: dict) -> tuple[dict, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())


@pytest.fixture(params=["engines-bind", "router-binds"])
def fleet_and_frontend(request, tmp_path):
    base, ev, rp = free_port_runs(2, 3)  # engine i uses port + i
    front = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    extra = []
    if request.param == "router-binds":  # one SUB bound by kvplug, engines told apart by topic
        extra = ["--events-connect", f"tcp://127.0.0.1:{free_port()}"]
    # output to files, not unread pipes (a full pipe would stall the process): quoted on failure
    sim_log, serve_log = tmp_path / "sim.log", tmp_path / "serve.log"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvplug.cli",
            "sim",
            "--engines",
            "2",
            "--base-port",
            str(base),
            "--events-base-port",
            str(ev),
            "--replay-base-port",
            str(rp),
            "--speed",
            "10",
            *extra,
        ],
        stdout=sim_log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    serve = None
    try:
        for port in (base, base + 1):
            wait_ready(f"http://127.0.0.1:{port}/health", proc=sim, interval=0.1, log=sim_log)
        serve = subprocess.Popen(
            serve_command(
                front,
                "--kv-block-size",
                "16",
                "--log-level",
                "warning",
                "--worker",
                f"a=http://127.0.0.1:{base}",
                "--worker",
                f"b=http://127.0.0.1:{base + 1}",
            ),
            stdout=serve_log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        wait_ready(f"http://127.0.0.1:{front}/v1/models", proc=serve, interval=0.1, log=serve_log)
        _wait_for_event_streams(f"http://127.0.0.1:{front}", {"a": base, "b": base + 1})
        yield f"http://127.0.0.1:{front}"
    finally:
        for p in (serve, sim):
            stop_process(p, timeout=5, sig=signal.SIGTERM)


def test_follow_ups_go_to_the_engine_holding_their_prefix(fleet_and_frontend):
    url = fleet_and_frontend + "/v1/completions"
    docs = {
        "x": "Document X about prefix caches and paged attention. " * 50,
        "y": "Document Y is a different text on load balancing and queues. " * 45,
    }
    home = {}
    for name, doc in docs.items():
        headers, body = _post(url, {"model": MODEL, "prompt": doc + " Q0?", "max_tokens": 4})
        home[name] = headers["x-kvplug-worker"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the engines' KV events reach the router asynchronously: wait until it indexes both documents
    _wait_index_blocks(fleet_and_frontend, sum(len(doc.encode()) // 16 for doc in docs.values()))
    for i in range(1, 5):
        for name, doc in docs.items():
            headers, body = _post(url, {"model": MODEL, "prompt": doc + f" Q{i}?", "max_tokens": 4})
            assert headers["x-kvplug-worker"] == home[name], (name, i)
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(doc.encode()) - 32  # all full blocks of the shared document
