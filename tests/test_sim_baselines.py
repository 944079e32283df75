"""The baseline policies behave as their originals' source defines them."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier
from kvplug.request import RouteRequest
from kvplug.sim.baselines import BaselineConfig, SglangCacheAware, VllmKvAware
from kvplug.sim.bench import BenchSpec, run_bench
from kvplug.sim.policies import parse_policy
from kvplug.workers import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, blocks) -> RouteRequest:
    return RouteRequest(
        rid, token_ids=[0] * (len(blocks) * 512), block_hashes=np.asarray(blocks, np.uint64)
    )


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
