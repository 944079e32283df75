"""kv mode: the routing seed's cost end to end, tiers, stages, selection, approximate mode."""

from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import pytest
from test_router_helpers import (
    BS,
    FakeClock,
    core_backend,
    current_backend,
    make_router,
    store_prefix,
    tokens,
)

from kvplug import core
from kvplug.events import Tier
from kvplug.pickers import softmax_cost_probs
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Role, Stage, Worker

pytestmark = pytest.mark.usefixtures("core_backend")
# core_backend: imported fixture, parametrised over the core backends
assert core_backend


def seed_example_router(**cfg):
    """The routing seed's worked example: a 10-block prompt; device overlaps 2, 5, 8; decode
    loads (active + incoming) 10, 5, 9; no active prefill."""
    r = make_router(**cfg)
    toks = tokens(10)
    for w, n in (("w1", 2), ("w2", 5), ("w3", 8)):
        store_prefix(r, w, toks, n)
    # active decode blocks such that active + incoming (10 - overlap) = 10, 5, 9
    for w, n in (("w1", 2), ("w3", 7)):
        r.route(
            RouteRequest(
                f"pre-{w}", tokens(n, start=50_000), hints=RoutingHints(pinned_worker_id=w)
            )
        )
        r.on_first_token(f"pre-{w}")  # prefill done: only the decode blocks stay
    return r, toks


def test_seed_formula_on_the_core():
    p = core.CostParams()
    c = core.costs(
        [10.0, 10.0, 10.0], [2.0, 5.0, 8.0], [0.0] * 3, [0.0] * 3, [0.0] * 3, [10.0, 5.0, 9.0], p
    )
    assert list(np.asarray(c, dtype=float)) == [18.0, 10.0, 11.0]


def test_seed_worked_example_end_to_end():
    r, toks = seed_example_router()
    d = r.route(RouteRequest("x", toks))
    assert d.worker_id == "w2"
    assert d.scores == {"w1": 18.0, "w2": 10.0, "w3": 11.0}
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["w1"]["device"] == 2 and rows["w1"]["decode_blocks"] == 10
    assert rows["w3"]["prefill_blocks"] == 10 and rows["w3"]["decode_blocks"] == 9
    assert d.overlap_blocks == 5 and d.cached_tokens == 5 * BS
    assert d.explain() == "kv: w2 <- cost(w2)=10.0 = 1.0*5 + 5 (device 5/10; prefill 10 - 1.0*5)"
    doc = json.loads(d.to_json())
    assert doc["worker_id"] == "w2" and len(doc["candidates"]) == 3
    assert doc["candidates"][1]["chosen"] is True
    assert doc["elapsed_us"] > 0


def test_debug_log_line(caplog):
    r, toks = seed_example_router()
    with caplog.at_level(logging.DEBUG, logger="kvplug.router"):
        r.route(RouteRequest("x", toks))
    assert "cost(w2)=10.0 = 1.0*5 + 5 (device 5/10" in caplog.text


def test_tier_credits_and_shared():
    r = make_router(workers=("a", "b", "c", "d"))
    toks = tokens(8)
    store_prefix(r, "a", toks, 4, tier=Tier.DEVICE)
    store_prefix(r, "b", toks, 4, tier=Tier.HOST)
    store_prefix(r, "c", toks, 4, tier=Tier.DISK)
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert (rows["a"]["device"], rows["b"]["host"], rows["c"]["disk"]) == (4, 4, 4)
    # prefill 8 - credit; decode = incoming blocks not resident on device
    assert rows["a"]["cost"] == pytest.approx((8 - 4) + 4)
    assert rows["b"]["cost"] == pytest.approx((8 - 0.75 * 4) + 8)
    assert rows["c"]["cost"] == pytest.approx((8 - 0.25 * 4) + 8)
    assert rows["d"]["cost"] == pytest.approx(8 + 8)
    assert d.worker_id == "a"
    assert "host 4" in d._formula(1)


def test_prefill_load_scale_and_credit_flags():
    r, toks = seed_example_router(router_prefill_load_scale=2.0, router_kv_overlap_score_credit=0.5)
    d = r.route(RouteRequest("x", toks))
    # cost = 2*(10 - 0.5*overlap) + decode
    assert d.scores == {"w1": 2 * 9 + 10, "w2": 2 * 7.5 + 5, "w3": 2 * 6 + 9}
    assert d.worker_id == "w2"


def test_active_prefill_load_counts_until_first_token():
    r = make_router(workers=("a", "b"))
    r.route(RouteRequest("big", tokens(20, 1000), hints=RoutingHints(pinned_worker_id="a")))
    d = r.route(RouteRequest("x", tokens(4)))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["a"]["prefill_blocks"] == 20 + 4 and rows["b"]["prefill_blocks"] == 4
    assert d.worker_id == "b"
    r.on_first_token("big")
    assert r.active_load("a")[0]["prefill_tokens"] == 0
    assert r.active_load("a")[0]["decode_blocks"] == 20


def test_prefill_stage_and_decode_stage_semantics():
    ws = [
        Worker("p1", role=Role.PREFILL),
        Worker("p2", role=Role.PREFILL),
        Worker("d1", role=Role.DECODE),
        Worker("both", role=Role.BOTH),
    ]
    r = make_router(workers=ws)
    toks = tokens(10)
    store_prefix(r, "p1", toks, 6)
    store_prefix(r, "d1", toks, 6)
    d = r.route(RouteRequest("x", toks, stage=Stage.PREFILL))
    assert {c["worker_id"] for c in d.candidates} == {"p1", "p2", "both"}
    ((e),) = d.excluded
    assert (e.worker_id, e.filter, e.reason) == (
        "d1",
        "role",
        "role decode does not serve the prefill stage",
    )
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["p1"]["decode_blocks"] == 0  # no decode-side load in the prefill stage
    assert rows["p1"]["cost"] == 10 - 6  # credit 1.0
    assert d.worker_id == "p1"
    assert r.active_load("p1")[0]["decode_blocks"] == 0
    assert r.active_load("p1")[0]["prefill_tokens"] == 4 * BS
    d2 = r.route(RouteRequest("x-dec", toks, stage=Stage.DECODE))
    assert {c["worker_id"] for c in d2.candidates} == {"d1", "both"}
    rows = {c["worker_id"]: c for c in d2.candidates}
    # no prefill tokens, credit 0, no reuse: cost = active decode + all 10 blocks
    assert rows["d1"]["prefill_blocks"] == 0 and rows["d1"]["cost"] == 10
    assert r.active_load(d2.worker_id)[d2.dp_rank]["prefill_tokens"] == 0
    assert r.active_load(d2.worker_id)[d2.dp_rank]["decode_blocks"] == 10


def test_dp_ranks_are_separate_endpoints():
    r = make_router(workers=(Worker("w", dp_size=2), Worker("v")))
    toks = tokens(6)
    store_prefix(r, "w", toks, 6, dp_rank=1)
    d = r.route(RouteRequest("x", toks))
    assert (d.worker_id, d.dp_rank) == ("w", 1)
    assert {(c["worker_id"], c["dp_rank"]) for c in d.candidates} == {("w", 0), ("w", 1), ("v", 0)}
    assert "cost(w/1)" in d.explain()


def test_argmin_ties_are_seeded_and_vary():
    picks = set()
    for seed in range(12):
        r = make_router(workers=("a", "b", "c"), seed=seed)
        picks.add(r.route(RouteRequest("x", tokens(3))).worker_id)
    assert picks == {"a", "b", "c"}


def test_seeded_runs_are_deterministic():
    def run(seed):
        r = make_router(workers=[f"w{i}" for i in range(6)], seed=seed, router_temperature=0.5)
        out = []
        for i in range(60):
            d = r.route(RouteRequest(f"r{i}", tokens(1 + i % 5, start=(i % 7) * 1000)))
            out.append(d.worker_id)
            if i % 3 == 0:
                r.on_finish(f"r{i - 1}")
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_softmax_frequencies_match_probabilities():
    """Chi-square goodness of fit, df=3, alpha=0.001 (critical value 16.27): a correct sampler
    fails this seeded check with probability 0.1%; with 20k draws a sampler off by 5 % points
    fails it surely."""
    r = make_router(
        workers=("a", "b", "c", "d"),
        router_temperature=0.4,
        router_track_prefill_tokens=False,
        router_track_active_blocks=False,
    )
    toks = tokens(10)
    for w, n in (("a", 2), ("b", 5), ("c", 8)):
        store_prefix(r, w, toks, n)
    # fewer draws on the pure-Python reference (slow hashing); the bound holds for any n
    n_draws = 2_000 if current_backend() == "reference" else 20_000
    counts: dict[str, int] = {}
    probs = None
    for i in range(n_draws):
        d = r.route(RouteRequest(f"r{i}", toks))
        counts[d.worker_id] = counts.get(d.worker_id, 0) + 1
        if probs is None:
            probs = {c["worker_id"]: c["probability"] for c in d.candidates}
            costs = np.array([c["cost"] for c in d.candidates])
            want = softmax_cost_probs(costs, 0.4)
            assert [probs[c["worker_id"]] for c in d.candidates] == pytest.approx(list(want))
        r.on_finish(f"r{i}")
    chi2 = sum((counts.get(w, 0) - n_draws * p) ** 2 / (n_draws * p) for w, p in probs.items())
    assert chi2 < 16.27, (counts, probs, chi2)
    # the cheapest gets the largest share
    assert max(counts, key=counts.get) == "c"


def test_approximate_mode_learns_from_routing_and_expires():
    clock = FakeClock()
    r = make_router(
        workers=("a", "b"),
        clock=clock,
        router_kv_events=False,
        router_ttl_secs=120,
        router_track_prefill_tokens=False,
        router_track_active_blocks=False,
        seed=3,
    )
    toks = tokens(8)
    first = r.route(RouteRequest("x1", toks)).worker_id
    d = r.route(RouteRequest("x2", toks))
    assert d.worker_id == first and d.overlap_blocks == 8
    clock.advance(121)
    d3 = r.route(RouteRequest("x3", tokens(8, start=9000)))  # triggers expiry
    assert r.stats()["approx"]["expired"] >= 1
    rows = {c["worker_id"]: c for c in r.route(RouteRequest("x4", toks)).candidates}
    assert rows[first]["device"] == 0
    del d3


def test_approximate_side_index_never_touches_event_index():
    r = make_router(
        workers=("a", "b"),
        router_predicted_ttl_secs=5.0,
        router_track_prefill_tokens=False,
        router_track_active_blocks=False,
    )
    toks = tokens(6)
    store_prefix(r, "b", toks, 3)
    before = r.index.stats()
    r.route(RouteRequest("x1", toks))
    assert r.index.stats().get("blocks") == before.get("blocks")
    d = r.route(RouteRequest("x2", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["b"]["device"] == 6  # max(events 3, predicted 6)


def test_approximate_size_cap():
    r = make_router(workers=("a",), router_kv_events=False, router_max_tree_size=10)
    for i in range(5):
        r.route(RouteRequest(f"x{i}", tokens(4, start=i * 1000)))
    assert r.stats()["approx"]["blocks"] <= 10
    assert r.stats()["approx"]["capped"] >= 1


def test_oversized_prompt_is_invalid_request():
    from kvplug.errors import InvalidRequest

    r = make_router(router_max_prompt_tokens=100)
    with pytest.raises(InvalidRequest, match="exceeds"):
        r.route(RouteRequest("x", tokens(10)))


def test_precomputed_block_hashes_skip_hashing():
    r, toks = seed_example_router()
    h = r.index.request_hashes(np.asarray(toks, dtype=np.uint32))
    d = r.route(RouteRequest("x", toks, block_hashes=np.asarray(h)))
    assert d.worker_id == "w2"
    d2 = r.route(RouteRequest("y", [], block_hashes=np.asarray(h)))
    assert d2.prompt_tokens == 10 * BS


def test_probabilities_formula_matches_reference():
    from kvplug import _reference

    c = np.array([18.0, 10.0, 11.0])
    assert list(softmax_cost_probs(c, 0.7)) == pytest.approx(_reference.softmax_probs(c, 0.7))
    assert math.isclose(sum(softmax_cost_probs(c, 0.1)), 1.0)
    rng = random.Random(1)
    assert all(0 <= core.select(list(c), 0.7, rng.random()) < 3 for _ in range(10))


def test_shared_tier_credit_beyond_local_prefix():
    r = make_router(workers=("a", "b"))
    toks = tokens(10)
    store_prefix(r, "a", toks, 10, shared=True)  # the whole prompt in the shared pool
    store_prefix(r, "b", toks, 4, engine_base=100)  # b holds the first 4 locally
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["b"]["device"] == 4 and rows["b"]["shared_beyond"] == 6
    assert rows["a"]["device"] == 0 and rows["a"]["shared_beyond"] == 10
    # b: 10 - 4 - 0.5*6 = 3, + decode 6; a: 10 - 0.5*10 = 5, + decode 10
    assert rows["b"]["cost"] == pytest.approx(3 + 6)
    assert rows["a"]["cost"] == pytest.approx(5 + 10)
    assert "shared_beyond 6" in d.explain()


def test_cleared_and_invalid_events():
    from kvplug.events import AllCleared, BlockStored

    r = make_router(workers=("a", "b"))
    toks = tokens(4)
    store_prefix(r, "a", toks, 4)
    r.apply_event(BlockStored(worker_id="a", engine_hashes=[1, 2], block_hashes=[5]))
    assert r.stats()["events_dropped_invalid"] == 1
    rows = {c["worker_id"]: c for c in r.route(RouteRequest("x", toks)).candidates}
    assert rows["a"]["device"] == 4  # the bad event lost nothing already indexed
    r.apply_event(AllCleared(worker_id="a"))
    rows = {c["worker_id"]: c for c in r.route(RouteRequest("y", toks)).candidates}
    assert rows["a"]["device"] == 0


def test_remove_and_re_add_reuses_nothing_stale():
    r = make_router(workers=("a", "b"))
    toks = tokens(4)
    store_prefix(r, "a", toks, 4)
    r.route(RouteRequest("x", tokens(3, 500), hints=RoutingHints(pinned_worker_id="a")))
    r.remove_worker("a")
    r.add_worker(Worker("c"))  # may take a's freed endpoint id
    assert r.active_load("c")[0] == {"prefill_tokens": 0, "decode_blocks": 0, "inflight": 0}
    d = r.route(RouteRequest("y", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["c"]["device"] == 0 and rows["c"]["decode_blocks"] == 4
    assert rows["c"]["prefill_blocks"] == 4  # x's load went with a


def test_stage_without_capable_workers():
    from kvplug.errors import NoCompatibleWorker

    r = make_router(workers=(Worker("p", role=Role.PREFILL),))
    with pytest.raises(NoCompatibleWorker, match="decode"):
        r.route(RouteRequest("x", tokens(2), stage=Stage.DECODE))


def test_every_mode_serialises():
    for mode in ("random", "round-robin", "least-loaded", "power-of-two", "device-aware-weighted"):
        r = make_router(router_mode=mode)
        doc = json.loads(r.route(RouteRequest("x", tokens(2))).to_json())
        assert doc["mode"] == mode and len(doc["candidates"]) == 3
        assert doc["candidates"][0]["formula"].startswith("load(")


def test_decision_stage_is_the_plain_value():
    r = make_router(workers=(Worker("p", role=Role.PREFILL),))
    d = r.route(RouteRequest("x", tokens(2), stage=Stage.PREFILL))
    assert d.stage == "prefill" and f"{d.stage}" == "prefill"
    assert json.loads(d.to_json())["stage"] == "prefill"


def test_credit_decay_and_active_request_weight():
    r = make_router(workers=("a", "b"), router_kv_overlap_score_credit_decay=1.0)
    toks = tokens(8)
    store_prefix(r, "a", toks, 8)
    # a carries 16 blocks of unfinished prefill (2x this request's size) -> credit / (1 + 2)
    r.route(RouteRequest("busy", tokens(16, 7000), hints=RoutingHints(pinned_worker_id="a")))
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["a"]["credit_factor"] == pytest.approx(1 / 3)
    assert rows["b"]["credit_factor"] == 1.0
    # a: prefill 24 - 8/3 = 21.33, decode 16 + 0; b: 8 + 8
    assert rows["a"]["cost"] == pytest.approx(24 - 8 / 3 + 16)
    assert rows["b"]["cost"] == pytest.approx(16) and d.worker_id == "b"
    assert "0.3333*8" in d._formula(0)
    r2 = make_router(
        workers=("a", "b"),
        router_decode_active_request_weight=5.0,
        router_track_prefill_tokens=False,
    )
    r2.route(RouteRequest("p", tokens(1, 7000), hints=RoutingHints(pinned_worker_id="a")))
    rows = {c["worker_id"]: c for c in r2.route(RouteRequest("x", tokens(2))).candidates}
    assert rows["a"]["decode_blocks"] == 1 + 2 + 5 and rows["b"]["decode_blocks"] == 2


def test_approximate_records_go_straight_to_the_core_as_the_event_path_would():
    """ApproxIndex stores and drops its records in a KvIndex's core directly; an index kind
    without one goes through events. Both hold the same blocks after every step."""
    import numpy as np

    from kvplug.approx import ApproxIndex
    from kvplug.index import KvIndex

    class EventsOnly:  # a KvIndex seen through its event API alone
        def __init__(self, block_size: int, max_entries: int) -> None:
            self._index = KvIndex(block_size, max_entries=max_entries)

        def __getattr__(self, name: str):
            if name in ("core", "endpoint_id"):
                raise AttributeError(name)
            return getattr(self._index, name)

    direct = ApproxIndex(lambda bs, max_entries: KvIndex(bs, max_entries=max_entries), 16, 5.0, 40)
    events = ApproxIndex(lambda bs, max_entries: EventsOnly(bs, max_entries), 16, 5.0, 40)
    assert direct._core is not None and events._core is None
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 2**63, size=n, dtype=np.uint64) for n in (6, 9, 12, 20)]
    for side in (direct, events):
        for w in ("a", "b"):
            side.add_endpoint(w, 0)
    for t, h in enumerate(prompts):
        for side in (direct, events):
            side.expire(float(t))
            side.record("ab"[t % 2], 0, h, float(t))  # the 40-block cap drops the oldest
        for probe in prompts:
            assert (direct.query(probe).local == events.query(probe).local).all()
    for side in (direct, events):
        side.expire(100.0)  # every record past its TTL
        assert side.stats()["blocks"] == 0
        assert not any(side.query(p).local.any() for p in prompts)


def test_approximate_mode_survives_a_prefix_routed_more_often_than_a_count_holds():
    """Every routed prompt adds a reference to its blocks in the side index, and the core counts
    them in 16 bits: a prefix sent to one engine 65,535 times within the TTL (a shared system
    prompt at ~550 requests a second) made the next route raise. The side index now keeps at
    most RECORDS_PER_ENDPOINT live records per engine, dropping the oldest."""
    from kvplug.approx import RECORDS_PER_ENDPOINT

    clock = FakeClock()
    r = make_router(
        workers=("a",),
        clock=clock,
        router_kv_events=False,
        router_ttl_secs=120,
        router_track_prefill_tokens=False,
        router_track_active_blocks=False,
    )
    toks = tokens(2)
    n = 65_536 + 10
    for i in range(n):
        d = r.route(RouteRequest(f"x{i}", toks))
    assert d.overlap_blocks == 2  # still predicted on its engine
    approx = r.stats()["approx"]
    assert approx["records"] == RECORDS_PER_ENDPOINT
    assert approx["capped_endpoint"] == n - RECORDS_PER_ENDPOINT
