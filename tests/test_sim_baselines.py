"""The baseline policies behave as their originals' source defines them."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier
from kvplug.request import RouteRequest
from kvplug.sim.baselines import (
    BaselineConfig,
    FixedPlacement,
    SglangCacheAware,
    SmgCacheAware,
    SmgStringTree,
    VllmKvAware,
)
from kvplug.sim.bench import BenchSpec, run_bench
from kvplug.sim.policies import parse_policy
from kvplug.workers import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, blocks, tokens: int | None = None) -> RouteRequest:
    n = len(blocks) * 512 if tokens is None else tokens
    return RouteRequest(rid, token_ids=[0] * n, block_hashes=np.asarray(blocks, np.uint64))


def _router(cls, n=2, **params):
    clock = Clock()
    r = cls(BaselineConfig(cls.__name__, 512, params), clock, random.Random(0))
    for i in range(n):
        r.add_worker(Worker(worker_id=f"w{i}", engine="sim"))
    return r, clock


def test_cache_aware_follows_the_match_above_the_threshold_and_the_least_loaded_below():
    r, _ = _router(SglangCacheAware)
    assert r.route(_req("a", [1, 2, 3])).worker_id == "w0"  # nothing matched, both idle: first
    assert r.route(_req("b", [1, 2, 3, 4])).worker_id == "w0"  # 3/4 matched > 0.3
    assert r.route(_req("c", [9, 10, 11])).worker_id == "w1"  # no match: w1 has 0 in flight
    # 1 of 4 blocks matched (0.25 <= 0.3): the least loaded (w1: 1, w0: 2), although w0 holds
    # block 1 (0.3.2's rule; earlier sources took the tenant with the smallest tree)
    assert r.route(_req("d", [1, 20, 21, 22])).worker_id == "w1"
    assert r.counters == {"cache_routed": 1, "least_loaded": 3, "balanced": 0, "evictions": 0}


def test_cache_aware_answers_a_nodes_creator_while_it_holds_the_node():
    r, clock = _router(SglangCacheAware, n=3)
    r._insert([1, 2, 3], "w1", 0.0)
    r._insert([1, 2, 3], "w0", 1.0)
    r._insert([1, 2, 3], "w2", 2.0)
    assert r._match([1, 2, 3], 3.0) == (3, "w1")  # created by w1, whoever came later
    node = r.root.children[1].children[2].children[3]
    del node.tenants["w1"]  # evicted there: another holder is cached from then on
    depth, tenant = r._match([1, 2, 3], 4.0)
    assert depth == 3 and tenant in ("w0", "w2") and node.last_tenant == tenant
    assert r._match([1, 2, 3], 5.0) == (3, tenant)


def test_cache_aware_balances_on_in_flight_counts_past_both_thresholds():
    r, _ = _router(SglangCacheAware, balance_abs_threshold=2, balance_rel_threshold=1.5)
    for i in range(3):
        r.route(_req(f"p{i}", [1, 2, 3]))  # all follow the prefix to w0: loads 3 / 0
    assert r.load == {"w0": 3, "w1": 0}
    assert r.route(_req("x", [1, 2, 3])).worker_id == "w1"  # 3 - 0 > 2 and 3 > 1.5 * 0
    assert r.counters["balanced"] == 1
    for rid in ("p0", "p1", "p2"):
        r.on_finish(rid)
    assert r.load == {"w0": 0, "w1": 1}


def test_cache_aware_evicts_least_recently_used_leaves_to_the_size_limit():
    # 2 blocks of 512 tokens at 4 chars per token = 4096 characters
    r, clock = _router(SglangCacheAware, max_tree_size=4096, eviction_interval=10)
    r.route(_req("old", [1, 2, 3]))
    clock.now = 5.0
    r.route(_req("new", [1, 2, 3, 4, 5]))  # same worker (match 3/5); path refreshed
    assert r.size["w0"] == 5
    clock.now = 11.0
    r.route(_req("tick", [70]))  # the eviction cycle runs first
    assert r.size["w0"] == 2
    assert r._match([1, 2, 3], clock.now)[0] == 2  # the deepest, least recent blocks went


def _gauges(running: int, waiting: int, kv: float) -> dict:
    return {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage": kv}


def _put(tree: SmgStringTree, blocks, tenant: str) -> None:
    tree.insert(blocks, tree.match(blocks), tenant)


def test_smg_cache_aware_follows_the_holders_above_the_threshold_of_the_prompt():
    r, _ = _router(SmgCacheAware, n=3)
    a = r.route(_req("a", [1, 2, 3])).worker_id  # a miss on an idle fleet: drawn
    # 3 of 4 blocks matched (> 0.3): a's worker, though it has one in flight and the others none
    assert r.route(_req("b", [1, 2, 3, 4])).worker_id == a
    # 1 of 4 (0.25): a miss, to the fewest in flight (no load report yet)
    c = r.route(_req("c", [1, 20, 21, 22])).worker_id
    assert c != a
    # the rate is over the prompt's tokens, not its whole blocks: 512 of 2,148 (0.24) is a miss
    # although 1 of its 2 blocks matched
    d = r.route(_req("d", [1, 30], tokens=2148)).worker_id
    assert d not in (a, c)
    assert r.counters["cache_hit"] == 1 and r.counters["miss"] == 3
    # strictly above the threshold: 2 of 4 at 0.5 is a miss
    r2, _ = _router(SmgCacheAware, cache_threshold=0.5)
    x = r2.route(_req("x", [1, 2])).worker_id
    assert r2.route(_req("y", [1, 2, 3, 4])).worker_id != x
    assert r2.counters["miss"] == 2 and r2.counters["cache_hit"] == 0


def test_smg_cache_aware_takes_the_least_loaded_holder_of_the_deepest_node():
    r, _ = _router(SmgCacheAware, n=3)
    _put(r.tree, [1, 2, 3], "w0")
    _put(r.tree, [1, 2, 3], "w1")
    _put(r.tree, [1], "w2")  # a shorter prefix: not a holder of the deepest matched node
    for rid, wid in (("x0", "w0"), ("x1", "w0"), ("x2", "w1")):
        r._book(rid, wid)
    # holders w0 (2 in flight) and w1 (1); w2 is idle but not a candidate
    assert r.route(_req("a", [1, 2, 3, 4])).worker_id == "w1"
    picks = set()
    for i in range(40):  # w0 and w1 at 2 in flight each: a tie, drawn; never w2
        picks.add(r.route(_req(f"r{i}", [1, 2, 3, 100 + i])).worker_id)
        r.on_finish(f"r{i}")
    assert picks == {"w0", "w1"}


def test_smg_cache_aware_spill_gate_needs_both_margins_and_the_margin_follows_the_mean():
    r0, _ = _router(SmgCacheAware)
    # ceil(2 sqrt(mean)), at least 4, at most balance_abs_threshold (64)
    assert [r0.absolute_margin(m) for m in (0, 16, 100, 10_000)] == [4, 8, 20, 64]
    r, _ = _router(SmgCacheAware, n=3)
    picks = [r.route(_req(f"p{i}", [1, 2, 3])).worker_id for i in range(9)]
    home = picks[0]
    # the holder at 6 in flight (mean 2): 6 > 1.5 * 2 but not > 2 + 4; at 7 (mean 2.33) both
    assert picks[:7] == [home] * 7 and picks[7] != home
    # the spill target now holds the prefix too: the next one goes there, not to the idle third
    assert picks[8] == picks[7]
    assert r.counters["spill"] == 1 and r.counters["cache_hit"] == 7
    # balance_abs_threshold caps the margin: at 2, the holder spills at 4 in flight (4 > 1.33 + 2)
    r2, _ = _router(SmgCacheAware, n=3, balance_abs_threshold=2)
    picks = [r2.route(_req(f"p{i}", [1, 2, 3])).worker_id for i in range(5)]
    assert picks[:4] == [picks[0]] * 4 and picks[4] != picks[0]


def test_smg_cache_aware_expected_wait_from_the_polled_gauges():
    r, clock = _router(SmgCacheAware)
    r.set_attributes("w0", _gauges(1, 0, 0.0))
    r.set_attributes("w1", _gauges(0, 0, 0.75))
    # w0: 1 running * 1,024 tokens / 2,000 tok/s; w1: the KV barrier 0.15 * 0.75 / 0.25
    assert r.expected_wait("w0") == pytest.approx(0.512)
    assert r.expected_wait("w1") == pytest.approx(0.45)
    assert r.route(_req("a", [1])).worker_id == "w1"
    # each dispatch is credited one mean prefill until the next report: w1 0.962 > w0 0.512
    assert r.route(_req("b", [2])).worker_id == "w0"
    assert r.expected_wait("w0") == pytest.approx(1.024)
    clock.now = 5.0
    r.set_attributes("w0", _gauges(0, 0, 0.0))  # between two polls (every 10 s): not taken
    assert r.reports["w0"] == (1.0, 0.0, 0.0) and r.counters["polls"] == 1
    clock.now = 10.0
    r.set_attributes("w0", _gauges(0, 0, 0.0))
    r.set_attributes("w1", _gauges(0, 0, 0.0))
    # the credit is released; the request the report does not show counts one mean prefill
    assert r.expected_wait("w0") == pytest.approx(0.512) == r.expected_wait("w1")
    assert r.counters["polls"] == 2


def test_smg_cache_aware_leaves_out_overloaded_workers_and_falls_back_when_all_are():
    r, clock = _router(SmgCacheAware, n=3)
    _put(r.tree, [1, 2, 3], "w0")
    r.set_attributes("w0", _gauges(0, 8, 0.1))  # 8 waiting: at the threshold
    r.set_attributes("w1", _gauges(0, 0, 0.8))  # KV usage at 0.8
    r.set_attributes("w2", _gauges(0, 0, 0.79))
    assert r.overloaded == {"w0": True, "w1": True, "w2": False}
    assert r.route(_req("a", [1, 2, 3, 4])).worker_id == "w2"  # the holder is left out
    assert r.counters["miss"] == 1
    clock.now = 10.0
    r.set_attributes("w2", _gauges(0, 9, 0.0))  # now all three: the fewest in flight
    epoch, size = r.tree.epoch, r.tree.total
    assert r.route(_req("b", [1, 2, 3])).worker_id in ("w0", "w1")
    assert (r.tree.epoch, r.tree.total) == (epoch, size)  # the policy was not asked
    assert r.counters["all_overloaded"] == 1
    off, _ = _router(SmgCacheAware, n=3, worker_overload_protection=False)
    _put(off.tree, [1, 2, 3], "w0")
    off.set_attributes("w0", _gauges(0, 8, 0.1))
    assert off.route(_req("a", [1, 2, 3, 4])).worker_id == "w0"


def test_smg_tree_stamps_the_end_node_only_and_attaches_at_epoch_zero():
    t = SmgStringTree({"a": 0.1, "b": 0.2})
    t.add_tenant("a")  # epoch 0
    t.add_tenant("b")  # 1
    _put(t, [1, 2, 3], "a")  # match 2, the new node 3
    _put(t, [1, 2, 3, 4], "b")  # match 4; b joins [1, 2, 3] at 0, [4] at 5
    node = t.root.children[1]
    assert node.key == [1, 2, 3] and node.tenants == {"a": 3, "b": 0}
    _put(t, [1, 2, 3, 4, 5], "a")  # match 6; a joins [4] at 0, [5] at 7
    assert node.tenants["a"] == 3  # not refreshed: the prompt went past it
    # match 8, a multiple of 8: the node the match ends in stamps its cached tenant (a, its
    # creator); the split prefix inherits the stamps, then b's prompt ends there (9)
    _put(t, [1, 2], "b")
    head = t.root.children[1]
    assert head.key == [1, 2] and head.tenants == {"a": 8, "b": 9}
    assert head.children[3].key == [3] and head.children[3].tenants == {"a": 8, "b": 0}
    assert t.size == {"a": 5, "b": 4} and t.total == 9
    m = t.match([1, 2, 3, 4, 9])
    assert m.depth == 4 and sorted(m.holders) == ["a", "b"]


def test_smg_cache_aware_evicts_the_oldest_leaves_to_one_budget_for_all_workers():
    # 4 blocks of 512 tokens at 4 chars per token = 8,192 characters for the whole tree
    r, clock = _router(SmgCacheAware, max_tree_size=4 * 2048, eviction_interval_secs=10)
    _put(r.tree, [1, 2, 3], "w0")
    _put(r.tree, [7, 8], "w1")
    assert r.tree.size == {"w0": 3, "w1": 2}  # each under the budget, 5 together
    clock.now = 11.0
    r.route(_req("tick", [70]))  # the eviction cycle runs first
    # the oldest leaf goes, as one node: 3 blocks for 1 over (sglang-router evicts nothing here)
    assert r.tree.evicted == 3 and r.tree.total == 2 + 1  # w1's two, and the tick's block
    assert r.tree.match([1, 2, 3]).depth == 0 and r.tree.match([7, 8]).depth == 2


def test_smg_cache_aware_draws_among_equal_waits():
    r, _ = _router(SmgCacheAware)
    picks = []
    for i in range(200):  # idle workers, no reports: equal in-flight counts every time
        picks.append(r.route(_req(f"r{i}", [1000 + i])).worker_id)
        r.on_finish(f"r{i}")
    assert 60 < picks.count("w0") < 140  # sglang-router takes the first of the minima


def test_vllm_kv_aware_costs_uncached_tokens_times_in_flight_requests():
    r, _ = _router(VllmKvAware, n=3)
    r.apply_event(BlockStored(worker_id="w0", engine_hashes=[1, 2], block_hashes=[1, 2]))
    r.apply_event(BlockStored(worker_id="w1", engine_hashes=[1, 3], block_hashes=[1, 3]))
    prompt = [1, 2, 3]  # 1,536 tokens
    assert r.new_prefill_tokens(prompt, 1536) == {"w0": 512, "w1": 1024, "w2": 1536}
    assert r.route(_req("a", prompt)).worker_id == "w0"  # all idle: 512 < 1,024 < 1,536
    # w0 now has a's 512 tokens in prefill and one request: (512 + 512) * 2 > 1,024 * 1
    assert r.route(_req("b", prompt)).worker_id == "w1"
    assert r.active_prefill == {"w0": 512, "w1": 1024, "w2": 0}
    r.on_first_token("a")  # a's prefill is done; it stays in flight until it finishes
    assert r.active_prefill["w0"] == 0 and r.load["w0"] == 1
    r.on_finish("b")  # b never streamed: both its tokens and its slot go
    assert r.active_prefill["w1"] == 0 and r.load["w1"] == 0
    # w0: (512 + 0) * (1 + 1) = 1,024, w1: 1,024 * 1: a tie, to the first
    assert r.route(_req("c", prompt)).worker_id == "w0"
    r.apply_event(BlockRemoved(worker_id="w0", engine_hashes=[2]))
    r.apply_event(AllCleared(worker_id="w1"))
    assert r.new_prefill_tokens(prompt, 1536) == {"w0": 1024, "w1": 1536, "w2": 1536}


def test_vllm_kv_aware_ties_go_to_the_first_worker_and_the_last_block_is_never_credited():
    r, _ = _router(VllmKvAware, n=2)
    r.apply_event(BlockStored(worker_id="w1", engine_hashes=[1, 2], block_hashes=[1, 2]))
    # the whole 1,024-token prompt is cached on w1, but vLLM recomputes its last block
    assert r.new_prefill_tokens([1, 2], 1024) == {"w0": 1024, "w1": 512}
    assert r.new_prefill_tokens([1, 2], 1025) == {"w0": 1025, "w1": 1}
    assert r.route(_req("a", [7, 8])).worker_id == "w0"  # nothing cached: equal costs
    assert r.counters["cost_ties"] == 1


def test_vllm_kv_aware_credits_a_lower_tier_continuation():
    r, _ = _router(VllmKvAware, n=2)
    r.apply_event(BlockStored(worker_id="w0", engine_hashes=[1, 2, 3], block_hashes=[1, 2, 3]))
    r.apply_event(
        BlockMoved(worker_id="w0", engine_hashes=[2, 3], from_tier=Tier.DEVICE, to_tier=Tier.HOST)
    )
    # one device block, then two host blocks at 0.8: 2,048 - (1 + 1.6) * 512 = 716.8 -> 717
    assert r.new_prefill_tokens([1, 2, 3, 4], 2048)["w0"] == 717
    r.apply_event(BlockStored(worker_id="w0", tier=Tier.DISK, engine_hashes=[2, 3, 4]))
    # the longest continuation wins even at a lower credit (vllm-router's rule): the disk run's
    # 3 blocks at 0.3 over the host run's 2 at 0.8: 2,560 - (1 + 0.9) * 512 = 1,587.2 -> 1,588
    assert r.new_prefill_tokens([1, 2, 3, 4, 5], 2560)["w0"] == math.ceil(2560 - 1.9 * 512)
    r.apply_event(BlockRemoved(worker_id="w0", tier=Tier.DISK, engine_hashes=[2, 3, 4]))
    assert r.new_prefill_tokens([1, 2, 3, 4], 2048)["w0"] == 717
    r.apply_event(BlockRemoved(worker_id="w0", engine_hashes=[1, 2, 3]))  # any tier
    assert r.index == {}


def test_vllm_kv_aware_temperature_draws_from_the_softmax_of_costs():
    r, _ = _router(VllmKvAware, n=2, temperature=1e9)  # costs differ by far less than that
    r.apply_event(BlockStored(worker_id="w0", engine_hashes=[1], block_hashes=[1]))
    picks = [r.route(_req(f"r{i}", [1, 2])).worker_id for i in range(200)]
    assert 60 < picks.count("w0") < 140
    cold, _ = _router(VllmKvAware, n=2)
    cold.apply_event(BlockStored(worker_id="w0", engine_hashes=[1], block_hashes=[1]))
    assert {cold.route(_req(f"r{i}", [1, 2])).worker_id for i in range(3)} == {"w0", "w1"}


def test_baseline_policy_names_parse_and_typos_fail():
    p = parse_policy("sglang-cache-aware:cache_threshold=0.5")
    assert p.overrides == {"cache_threshold": 0.5} and not p.feed_events
    assert parse_policy("vllm-kv-aware").feed_events
    with pytest.raises(ValueError, match="cache_threshold"):
        parse_policy("sglang-cache-aware:cache_treshold=0.5")
    p = parse_policy("smg-cache-aware:cache_threshold=0.5,engine_loads=false")
    assert p.overrides == {"cache_threshold": 0.5, "engine_loads": False} and not p.feed_events
    with pytest.raises(ValueError, match="load_monitor_interval"):
        parse_policy("smg-cache-aware:eviction_interval=60")


def test_baselines_replay_in_the_bench():
    spec = BenchSpec(
        policies=["sglang-cache-aware", "vllm-kv-aware", "round-robin"], n_engines=4, limit=300
    )
    report = run_bench(spec, progress=False)
    by = {r["policy"]: r for r in report["results"]}
    assert all(r["completed"] == 300 for r in by.values())
    assert by["sglang-cache-aware"]["hit_rate"] > by["round-robin"]["hit_rate"]
    # every request shares the trace's first block; vllm-router's cost multiplies by the
    # in-flight count, so it spreads (its releases before 0.1.17 sent everything to one engine)
    assert by["vllm-kv-aware"]["imbalance_requests"] < 2.0
    assert by["vllm-kv-aware"]["hit_rate"] > by["round-robin"]["hit_rate"]


def test_smg_cache_aware_replays_in_the_bench():
    spec = BenchSpec(policies=["smg-cache-aware", "round-robin"], n_engines=4, limit=300)
    report = run_bench(spec, progress=False)
    by = {r["policy"]: r for r in report["results"]}
    assert all(r["completed"] == 300 for r in by.values())
    stats = by["smg-cache-aware"]["router_index"]
    assert stats["polls"] > 0 and stats["cache_hit"] > 0
    assert stats["cache_hit"] + stats["spill"] + stats["miss"] + stats["all_overloaded"] == 300
    assert by["smg-cache-aware"]["hit_rate"] > by["round-robin"]["hit_rate"]


def test_a_fixed_placement_goes_by_request_not_by_call_order():
    """FixedPlacement (a placement decided elsewhere, judged by this simulator) sends request
    ``r{i}`` to the fleet's ``placement[i]``-th engine whatever order the routes come in, keeps
    the in-flight count the others keep, and refuses a P/D hop (it places whole requests)."""
    clock = Clock()
    r = FixedPlacement(BaselineConfig("fixed", 512), clock, random.Random(0), [2, 0, 2])
    for i in range(3):
        r.add_worker(Worker(worker_id=f"w{i}", engine="sim"))
    assert r.route(_req("r2", [1])).worker_id == "w2"
    assert r.route(_req("r0", [1])).worker_id == "w2"
    assert r.route(_req("r1", [1])).worker_id == "w0"
    assert r.load == {"w0": 1, "w1": 0, "w2": 2}
    r.on_finish("r0")
    assert r.load["w2"] == 1
    with pytest.raises(ValueError, match="whole requests"):
        r.route(_req("r1:p", [1]))
