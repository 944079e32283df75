"""Virtual-time replay against the real Router: kv beats round-robin on hit rate, seeded runs
are deterministic, hash and token modes agree, and the router's load returns to zero."""

import pytest

from kvplug.sim.bench import BenchSpec, fleet_lru_hit_rate, format_table, run_bench
from kvplug.sim.policies import parse_policy
from kvplug.sim.traces import load_trace, oracle_hit_rate
from kvplug.sim.virtual import ReplayConfig, replay, summarize


def _run(records, policy, n=8, seed=0, mode="hashes"):
    from kvplug.sim.engine import EngineConfig

    pol = parse_policy(policy)
    cfg = ReplayConfig(
        n_engines=n,
        seed=seed,
        feed_events=pol.feed_events,
        mode=mode,
        engine=EngineConfig(events_with_tokens=mode == "tokens"),
    )
    return replay(records, pol.router_config(512), cfg, policy=policy)


@pytest.fixture(scope="module")
def first_800():
    return load_trace(limit=800)


def test_kv_beats_round_robin_on_hit_rate(first_800):
    """800 requests (~4 min) on 8 engines. The fleet's 8 x 1640 blocks hold the whole window,
    so one shared LRU would reach the oracle (19.8 %). Round-robin lands a follow-up turn on the
    engine holding its prefix about 1 time in 8, so it keeps little more than the prefix blocks
    every engine shares (measured ~6 %); kv routing sends turns to their prefix and must get at
    least twice round-robin's rate and 60 % of the bound (measured ~16 %)."""
    bound = fleet_lru_hit_rate(first_800, 8 * 1640)
    assert bound == pytest.approx(oracle_hit_rate(first_800)["full_block_hit_rate"])
    kv = summarize(_run(first_800, "kv"))
    rr = summarize(_run(first_800, "round-robin"))
    assert kv["hit_rate"] >= 2 * rr["hit_rate"]
    assert kv["hit_rate"] >= rr["hit_rate"] + 0.06
    assert kv["hit_rate"] >= 0.6 * bound
    assert kv["prefill_tokens"] < rr["prefill_tokens"]  # hits are real saved work
    assert kv["ttft_p50_s"] < rr["ttft_p50_s"]


def test_seeded_replays_are_deterministic(first_800):
    recs = first_800[:300]
    a = _run(recs, "random", seed=7)
    b = _run(recs, "random", seed=7)
    c = _run(recs, "random", seed=8)
    wa = [r.worker_id for r in a.requests]
    assert wa == [r.worker_id for r in b.requests]
    assert [r.first_token for r in a.requests] == [r.first_token for r in b.requests]
    assert wa != [r.worker_id for r in c.requests]
    k1 = _run(recs, "kv:temperature=0.5", seed=3)
    k2 = _run(recs, "kv:temperature=0.5", seed=3)
    assert [r.worker_id for r in k1.requests] == [r.worker_id for r in k2.requests]


def test_router_load_drains_to_zero(first_800):
    from kvplug.request import RouteRequest  # noqa: F401  (the Router must be importable)

    res = _run(first_800[:200], "kv")
    assert all(not e.has_work() for e in res.engines)
    assert sum(r.output_len for r in res.requests) == sum(
        e.stats["generated_tokens"] for e in res.engines
    )


def test_token_mode_matches_hash_mode(first_800):
    """Expanding each 512-token block id to tokens (the router and index hash them) must give
    the same prefix structure, hence the same decisions, as precomputed block hashes."""
    recs = first_800[:120]
    h = _run(recs, "kv", n=4, mode="hashes")
    t = _run(recs, "kv", n=4, mode="tokens")
    assert [r.worker_id for r in h.requests] == [r.worker_id for r in t.requests]
    assert summarize(h)["hit_rate"] == summarize(t)["hit_rate"] > 0


def test_bench_reports_every_policy(first_800, tmp_path):
    spec = BenchSpec(policies=["kv", "round-robin", "least-loaded"], n_engines=4, limit=150)
    report = run_bench(spec, jobs=1, progress=False)
    names = [r["policy"] for r in report["results"]]
    assert names == ["kv", "round-robin", "least-loaded"]
    for r in report["results"]:
        assert 0 <= r["hit_rate"] <= report["trace"]["oracle_hit_rate"]
        assert r["completed"] == 150
        assert r["vs_round_robin"]["hit_rate_x"] is not None
    table = format_table(report)
    assert "round-robin" in table and "oracle" in table
    from kvplug.sim.plots import plot_report

    paths = plot_report(report, tmp_path)
    assert all(p.stat().st_size > 10_000 for p in paths) and len(paths) == 4
    assert paths[-1].name == "sim_frontier.png"


def test_a_one_report_frontier_zooms_on_the_policies_near_the_bound(tmp_path):
    """The policies within 10 % of the bound and of the lowest TTFT p99 among those get a second,
    zoomed panel; a policy near the bound but slower, or far from it, is left to the full view;
    with fewer than two such policies there is no zoom panel. Of several reports each is a row
    (its full view, then its zoom) when any has a zoom, else they share a grid of two columns."""
    from matplotlib.image import imread

    from kvplug.sim.plots import _near_the_bound, plot_frontier

    def row(policy: str, hit: float, p99: float) -> dict:
        return {"policy": policy, "hit_rate": hit, "ttft_p99_s": p99}

    rows = [
        row("default", 0.249, 4.95),
        row("before", 0.246, 4.94),
        row("slower", 0.248, 7.2),  # near the bound, 1.46x the lowest p99
        row("kv", 0.21, 4.96),  # far from the bound
        row("round-robin", 0.078, 7.4),
    ]
    report = {"results": rows, "trace": {"fleet_lru_hit_rate": 0.2576}}
    assert [r["policy"] for r in _near_the_bound(rows, 0.2576)] == ["default", "before"]
    unzoomed = {**report, "results": rows[2:]}  # only "slower" near the bound
    size = {}
    for name, panels in {
        "zoomed": [("one", report)],
        "alone": [("one", unzoomed)],
        "two zoomed": [("one", report), ("two", report)],
        "one of two zoomed": [("one", unzoomed), ("two", report)],
        "two unzoomed": [("one", unzoomed), ("two", unzoomed)],
    }.items():
        size[name] = imread(plot_frontier(panels, tmp_path / f"{name}.png")).shape[:2]
    (h, w) = size["alone"]
    assert size["zoomed"] == size["two unzoomed"] == (h, 2 * w)
    assert size["two zoomed"] == size["one of two zoomed"] == (2 * h, 2 * w)


def test_the_load_plot_shows_the_default_routing_first():
    from kvplug.sim.plots import _load_panels
    from kvplug.sim.policies import DEMO_POLICIES

    def row(policy: str, load: list) -> dict:
        return {"policy": policy, "series": {"load": load}}

    names = ["kv", "affinity-balance", "random", "round-robin", "affinity-fitted"]
    rows = [row(n, [[1, 0]]) for n in names]
    assert [r["policy"] for r in _load_panels(rows)] == list(DEMO_POLICIES)
    from kvplug.config import RouterConfig

    assert DEMO_POLICIES[0] == RouterConfig().router_affinity  # kvplug serve's default routing
    # none of the demo's: the first three that have a series
    rows = [row(n, [[1]] if n != "b" else []) for n in "abcde"]
    assert [r["policy"] for r in _load_panels(rows)] == ["a", "c", "d"]


def test_the_plots_name_a_router_view_other_than_the_ideal_one():
    from dataclasses import asdict, replace

    from kvplug.sim.plots import _router_view
    from kvplug.sim.transport import PRESETS

    assert _router_view(None) == "ideal"  # reports written before the view was recorded
    assert _router_view(asdict(PRESETS["ideal"])) == "ideal"
    assert _router_view(asdict(PRESETS["realistic"])) == "realistic"
    assert _router_view(asdict(replace(PRESETS["realistic"], event_loss=0.05))) == "custom"


def test_bad_policy_is_rejected_before_running():
    with pytest.raises(ValueError, match="not kv"):
        parse_policy("fastest")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_policy("kv:nonsense=1")
    p = parse_policy("kv:credit=0.5,temperature=0.1")
    cfg = p.router_config(512)
    assert cfg.router_kv_overlap_score_credit == 0.5 and cfg.router_temperature == 0.1
    assert not parse_policy("approx").feed_events and parse_policy("kv").feed_events


@pytest.mark.parametrize("host_offload", ["evicted", "stored"])
def test_event_stream_keeps_the_index_exactly_in_sync_with_the_engines(first_800, host_offload):
    """Small caches with a host tier force evictions, offloads (or copies to the host),
    reloads and host drops: every event the engines emit must apply cleanly, and at the end the
    router's index must hold exactly what the engines hold (device + host, per engine)."""
    from kvplug.sim.engine import EngineConfig

    engine = EngineConfig(capacity_blocks=300, host_capacity_blocks=600, host_offload=host_offload)
    cfg = ReplayConfig(n_engines=4, engine=engine)
    res = replay(first_800, parse_policy("kv").router_config(512), cfg, policy="kv")
    st = res.router_stats
    for key in (
        "unknown_moves",
        "unknown_removes",
        "conflicting_stores",
        "orphan_stores",
        "duplicate_stores",
        "dropped_events",
    ):
        assert st[key] == 0, (key, st)
    assert st["removed_blocks"] > 0
    # a victim cache moves blocks between the tiers; an inclusive one only copies them
    assert (st["moved_blocks"] > 0) == (host_offload == "evicted")
    assert sum(e.cache.counters["reloaded"] for e in res.engines) > 0
    # one entry per block an engine holds, in either tier or both (an inclusive host's copies)
    held = sum(len(set(e.cache.device_blocks()) | set(e.cache.host_blocks())) for e in res.engines)
    assert st["entries"] == held
    s = summarize(res)
    assert s["hit_rate_host"] > 0


def test_disaggregated_replay(first_800):
    """P/D: each request is prefilled on a prefill engine, its KV transferred, decoded on a
    decode engine; stages never cross roles, the index stays in sync, kv still beats
    round-robin on the prefill side."""
    from kvplug.sim.steptime import REFERENCE

    recs = first_800[:300]
    cfg = ReplayConfig(n_engines=6, n_prefill=4)
    res = replay(recs, parse_policy("kv").router_config(512), cfg, policy="kv")
    prefill_ids = {f"sim-{i}" for i in range(4)}
    assert all(p.worker_id in prefill_ids for p in res.prefill_requests)
    assert all(d.worker_id not in prefill_ids for d in res.requests)
    for p, d in zip(res.prefill_requests, res.requests, strict=True):
        assert not d.rejected and d.finished >= d.first_token
        # the decode hop starts after the prefill hop ended and the full blocks crossed over
        cacheable = min(d.prompt_blocks, (d.prompt_len - 1) // 512)
        assert d.first_token >= p.finished + REFERENCE.transfer_ms(cacheable * 512) / 1000
        assert d.remote_blocks + d.hit_device == cacheable
    st = res.router_stats
    assert st["unknown_removes"] == st["unknown_moves"] == st["dropped_events"] == 0
    kv = summarize(res)
    rr = summarize(replay(recs, parse_policy("round-robin").router_config(512), cfg))
    assert kv["transferred_blocks"] > 0 and kv["hit_rate"] > rr["hit_rate"]
    with pytest.raises(ValueError):
        ReplayConfig(n_engines=2, n_prefill=2)


def test_event_driven_replay_matches_the_scan_over_every_engine(first_800):
    """Only engines with output due before an arrival are stepped (decode runs lazily); the
    replay is the one the scan over all engines gives, up to floating-point rounding."""
    from kvplug.sim.engine import EngineConfig

    recs = first_800[:400]
    pol = parse_policy("kv")
    out = []
    for event_driven in (True, False):
        cfg = ReplayConfig(n_engines=16, engine=EngineConfig(), event_driven=event_driven)
        out.append(replay(recs, pol.router_config(512), cfg))
    ev, scan = out
    assert [r.worker_id for r in ev.requests] == [r.worker_id for r in scan.requests]
    for a, b in zip(ev.requests, scan.requests, strict=True):
        assert a.first_token == pytest.approx(b.first_token, rel=1e-9, abs=1e-9)
        assert a.finished == pytest.approx(b.finished, rel=1e-9, abs=1e-9)
    assert summarize(ev)["hit_rate"] == summarize(scan)["hit_rate"]


def test_next_output_start_is_when_a_decode_run_first_reports():
    from kvplug.sim.engine import EngineConfig, SimEngine, SimRequest

    e = SimEngine("e", EngineConfig(block_size=16, capacity_blocks=100))
    e.add_request(SimRequest("a", 0.0, 20, 30, [11], None, salt=1), 0.0)
    e.advance(1e-9)  # the prefill step (first token) runs
    e.outputs.clear()
    due = e.next_output_start()
    assert due > e.now  # 11 uneventful decode steps until the context fills block 2 (32)
    e.advance(due)  # steps starting before `due`: nothing to report yet
    assert not e.outputs
    e.advance(due + 1e-9)  # the eventful step starts at `due`
    assert sorted(k for k, _, _ in e.outputs) == ["kv", "progress"]  # block stored + reported


def test_observe_sees_every_decision_before_the_engine_does(first_800):
    """``replay(observe=...)`` is called once per routed request with the decision and the
    engines, before the request reaches its engine (its arrival not yet queued there)."""
    recs = first_800[:200]
    seen = []

    def observe(t, rreq, decision, router, engines):
        engine = engines[decision.worker_id]
        queued = any(q.request_id == rreq.request_id for q in engine.waiting)
        seen.append((rreq.request_id, decision.worker_id, t, queued))

    pol = parse_policy("kv")
    res = replay(recs, pol.router_config(512), ReplayConfig(n_engines=4), observe=observe)
    assert [s[0] for s in seen] == [r.request_id for r in res.requests]
    assert [s[1] for s in seen] == [r.worker_id for r in res.requests]
    assert [s[2] for s in seen] == [r.arrival for r in res.requests]
    assert not any(s[3] for s in seen)


def test_fleet_lru_hits_per_request_add_up_to_the_bound(first_800):
    from kvplug.sim.bench import fleet_lru_hits

    hits = fleet_lru_hits(first_800, 1640)
    total = sum(len(r.hash_ids[: r.input_length // 512]) for r in first_800)
    assert len(hits) == len(first_800)
    assert sum(hits) / total == fleet_lru_hit_rate(first_800, 1640)
    assert hits[0] == 0  # an empty cache
    # a repeated prompt right after itself hits every full block
    again = [first_800[5], first_800[5]]
    assert fleet_lru_hits(again, 1640) == [0, first_800[5].input_length // 512]


def test_a_mixed_fleet_runs_each_engine_at_its_own_speed_and_the_default_learns_them(first_800):
    """Every other engine at twice the step time (``ReplayConfig.slowdowns``): the same work
    keeps the slower engines busier, and the default routing learns which ones they are from
    their first tokens (its per-engine slowdowns, fit_speeds)."""
    from kvplug.sim.engine import EngineConfig
    from kvplug.sim.virtual import make_fleet

    cfg = ReplayConfig(n_engines=4, slowdowns=(1.0, 2.0))
    fleet = make_fleet(cfg)
    assert [e.model for e in fleet[::2]] == [EngineConfig().model] * 2
    assert [e.model for e in fleet[1::2]] == [EngineConfig().model.slowed(2.0)] * 2
    for bad in ((1.0, 0.0), (float("inf"),), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="slowdowns"):
            ReplayConfig(slowdowns=bad)

    pol = parse_policy("affinity-fitted")
    make_router = pol.router_factory()
    routers = []

    def keep(*args, **kwargs):  # the replay's router, kept to read its affinity state after
        routers.append(make_router(*args, **kwargs))
        return routers[-1]

    res = replay(
        load_trace(limit=2500),
        pol.router_config(512),
        ReplayConfig(n_engines=4, slowdowns=(1.0, 2.0)),
        policy="affinity-fitted",
        router_factory=keep,
    )
    busy = [e.stats["busy_s"] / max(e.stats["prefill_tokens"], 1) for e in res.engines]
    assert min(busy[1::2]) > 1.5 * max(busy[::2])  # busier per prefilled token
    aff = routers[0]._policy.affinity
    slow = [aff._slow(routers[0].endpoint_of(e.worker_id, 0)) for e in res.engines]
    assert aff.affinity_counters["engines_off_speed"] == 4
    assert min(slow[1::2]) / max(slow[::2]) > 1.5
