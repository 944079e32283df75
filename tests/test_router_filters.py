"""Filters in order, each exclusion with its reason; error classes; fallback-on-empty."""

from __future__ import annotations

import pytest
from test_router_helpers import BS, FakeClock, core_backend, make_router, tokens

from kvplug.config import AttributeThreshold
from kvplug.errors import (
    AllWorkersOverloaded,
    NoCompatibleWorker,
    PinnedWorkerOverloaded,
    RoutingError,
    UnknownWorker,
)
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Worker

pytestmark = pytest.mark.usefixtures("core_backend")
# core_backend: imported fixture, parametrised over the core backends
assert core_backend


def excl(d):
    return {(e.worker_id, e.filter) for e in d.excluded}


def test_allow_list():
    r = make_router()
    d = r.route(
        RouteRequest("x", tokens(2), hints=RoutingHints(allowed_worker_ids=frozenset({"w3"})))
    )
    assert d.worker_id == "w3"
    assert excl(d) == {("w1", "allow-list"), ("w2", "allow-list")}
    assert "allowed" in d.excluded[0].reason
    with pytest.raises(NoCompatibleWorker):
        r.route(
            RouteRequest("y", tokens(2), hints=RoutingHints(allowed_worker_ids=frozenset({"zz"})))
        )


def test_pin_must_be_allowed_and_known():
    r = make_router()
    with pytest.raises(NoCompatibleWorker, match="not in the allowed set"):
        r.route(
            RouteRequest(
                "x",
                tokens(1),
                hints=RoutingHints(allowed_worker_ids=frozenset({"w1"}), pinned_worker_id="w2"),
            )
        )
    with pytest.raises(NoCompatibleWorker, match="not registered"):
        r.route(RouteRequest("x", tokens(1), hints=RoutingHints(pinned_worker_id="nope")))


def test_exact_pin_with_dp_rank_and_bounds():
    r = make_router(workers=(Worker("a", dp_start=2, dp_size=2), Worker("b", dp_size=4)))
    d = r.route(
        RouteRequest("x", tokens(2), hints=RoutingHints(pinned_worker_id="a", pinned_dp_rank=3))
    )
    assert (d.worker_id, d.dp_rank) == ("a", 3)
    assert ("b", "pin") in excl(d) and ("a", "dp-rank") in excl(d)
    with pytest.raises(NoCompatibleWorker, match=r"outside \[2, 4\)"):
        r.route(
            RouteRequest("y", tokens(2), hints=RoutingHints(pinned_worker_id="a", pinned_dp_rank=0))
        )
    # a rank pin alone keeps the endpoints with that rank (a has no rank 0 -> b/0)
    d = r.route(RouteRequest("z", tokens(2), hints=RoutingHints(pinned_dp_rank=0)))
    assert (d.worker_id, d.dp_rank) == ("b", 0)


def test_required_taints():
    r = make_router(
        workers=(
            Worker("a", taints=frozenset({"gpu-h200", "rdma"})),
            Worker("b", taints=frozenset({"gpu-h200"})),
        )
    )
    d = r.route(
        RouteRequest(
            "x", tokens(1), hints=RoutingHints(required_taints=frozenset({"gpu-h200", "rdma"}))
        )
    )
    assert d.worker_id == "a"
    assert d.excluded[0].filter == "required-taints" and "rdma" in d.excluded[0].reason
    with pytest.raises(NoCompatibleWorker):
        r.route(RouteRequest("y", tokens(1), hints=RoutingHints(required_taints=frozenset({"x"}))))


def test_exclude_workers_for_retries():
    r = make_router()
    d = r.route(RouteRequest("x", tokens(1), exclude_workers=frozenset({"w1", "w2"})))
    assert d.worker_id == "w3"


def busy_router(**cfg):
    ws = [
        Worker("a", kv_capacity_blocks=100, max_batched_tokens=1000),
        Worker("b", kv_capacity_blocks=100, max_batched_tokens=1000),
    ]
    return make_router(workers=ws, **cfg)


def test_busy_decode_blocks_threshold():
    r = busy_router(active_decode_blocks_threshold=0.5)
    r.route(RouteRequest("big", tokens(60), hints=RoutingHints(pinned_worker_id="a")))
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b"
    (e,) = d.excluded
    assert e.filter == "busy" and "active decode blocks 60 > 0.5 x capacity 100" in e.reason


def test_busy_prefill_tokens_absolute_and_frac_are_ored():
    r = busy_router(
        active_prefill_tokens_threshold=10_000, active_prefill_tokens_threshold_frac=0.5
    )
    r.route(RouteRequest("p", tokens(40), hints=RoutingHints(pinned_worker_id="a")))  # 640 tokens
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b"
    assert "0.5 x max_batched_tokens 1000" in d.excluded[0].reason
    r.on_first_token("p")  # prefill done -> not busy any more
    d = r.route(RouteRequest("y", tokens(1), hints=RoutingHints(pinned_worker_id="a")))
    assert d.worker_id == "a" and not d.excluded[1:]


def test_all_overloaded_and_pinned_overloaded():
    r = busy_router(active_prefill_tokens_threshold=100)
    for w in ("a", "b"):
        r.route(RouteRequest(f"p{w}", tokens(10), hints=RoutingHints(pinned_worker_id=w)))
    with pytest.raises(AllWorkersOverloaded) as ei:
        r.route(RouteRequest("x", tokens(1)))
    assert "160 > 100" in str(ei.value)
    with pytest.raises(PinnedWorkerOverloaded, match="pinned worker a"):
        r.route(RouteRequest("y", tokens(1), hints=RoutingHints(pinned_worker_id="a")))
    assert issubclass(PinnedWorkerOverloaded, RoutingError)
    s = r.stats()
    assert (s["all_workers_overloaded"], s["pinned_worker_overloaded"]) == (1, 1)
    assert r.stats()["active_requests"] == 2  # failed routings hold no load


def test_busy_fallback_keeps_least_busy():
    r = busy_router(active_prefill_tokens_threshold=100, busy_threshold_fallback=True)
    r.route(RouteRequest("pa", tokens(20), hints=RoutingHints(pinned_worker_id="a")))
    r.route(RouteRequest("pb", tokens(10), hints=RoutingHints(pinned_worker_id="b")))
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b" and d.fallback and d.fallback_filters == ["busy"]
    assert [(e.worker_id, e.filter) for e in d.excluded] == [("a", "busy")]


def test_runtime_busy_threshold_update():
    r = busy_router()
    r.route(RouteRequest("pa", tokens(20), hints=RoutingHints(pinned_worker_id="a")))
    r.set_busy_thresholds(prefill_tokens=100)
    assert r.route(RouteRequest("x", tokens(1))).worker_id == "b"
    r.set_busy_thresholds()
    assert r.busy_thresholds.active is False


def test_label_selector_from_config_and_hints():
    ws = [
        Worker("a", labels={"llm-d.ai/model-family": "qwen", "tier": "large"}),
        Worker("b", labels={"llm-d.ai/model-family": "qwen", "tier": "small"}),
        Worker("c", labels={"llm-d.ai/model-family": "llama"}),
    ]
    r = make_router(workers=ws, router_label_selector="llm-d.ai/model-family=qwen")
    d = r.route(RouteRequest("x", tokens(1), hints=RoutingHints(labels={"tier": "small"})))
    assert d.worker_id == "b"
    assert {e.worker_id for e in d.excluded} == {"a", "c"}
    assert all(e.filter == "label-selector" for e in d.excluded)
    with pytest.raises(NoCompatibleWorker, match="label selector"):
        r.route(RouteRequest("y", tokens(1), hints=RoutingHints(labels={"tier": "none"})))


def test_label_mismatch_is_not_overload():
    """Busy workers that match + idle ones that don't: overloaded, not 'no compatible'."""
    ws = [
        Worker("a", labels={"role": "x"}, max_batched_tokens=100),
        Worker("b", labels={"role": "y"}, max_batched_tokens=100),
    ]
    r = make_router(workers=ws, active_prefill_tokens_threshold_frac=0.5)
    r.route(RouteRequest("p", tokens(10), hints=RoutingHints(pinned_worker_id="a")))
    with pytest.raises(AllWorkersOverloaded):
        r.route(RouteRequest("x", tokens(1), hints=RoutingHints(labels={"role": "x"})))


def gpu_router(clock, on_missing="exclude", fallback=True):
    th = AttributeThreshold("gpu_utilization", "<=", 0.9, on_missing, fallback)
    return make_router(workers=("a", "b", "c"), clock=clock, router_attribute_thresholds=[th])


def test_attribute_threshold_filter():
    clock = FakeClock()
    r = gpu_router(clock)
    r.set_attributes("a", {"gpu_utilization": 0.95})
    r.set_attributes("b", {"gpu_utilization": 0.5})
    r.set_attributes("c", {"gpu_utilization": 0.92})
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b" and not d.fallback
    assert {e.worker_id: e.reason for e in d.excluded}["a"] == "gpu_utilization=0.95 fails <= 0.9"
    assert d.attribute_ages["b"]["gpu_utilization"] == 0


def test_attribute_fallback_on_empty_keeps_least_bad():
    clock = FakeClock()
    r = gpu_router(clock)
    r.set_attributes("a", {"gpu_utilization": 0.99})
    r.set_attributes("b", {"gpu_utilization": 0.93})
    r.set_attributes("c", {"gpu_utilization": 0.97})
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b" and d.fallback and d.fallback_filters == ["attribute:gpu_utilization"]
    r2 = gpu_router(clock, fallback=False)
    for w in "abc":
        r2.set_attributes(w, {"gpu_utilization": 0.99})
    with pytest.raises(AllWorkersOverloaded, match="gpu_utilization"):
        r2.route(RouteRequest("x", tokens(1)))


def test_stale_attribute_is_missing_and_never_idle():
    clock = FakeClock()
    r = gpu_router(clock)  # on_missing = exclude, max age 2 s
    r.set_attributes("a", {"gpu_utilization": 0.1}, ts=clock.t - 5)  # stale, looks idle
    r.set_attributes("b", {"gpu_utilization": 0.8})
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.worker_id == "b"
    reasons = {e.worker_id: e.reason for e in d.excluded}
    assert reasons["a"].startswith("gpu_utilization stale (5s > 2s)")
    assert reasons["c"] == "gpu_utilization missing"
    assert d.attribute_ages["a"]["gpu_utilization"] == 5


def test_missing_policy_worst_ranks_last_in_fallback():
    clock = FakeClock()
    r = gpu_router(clock, on_missing="worst")
    r.set_attributes("a", {"gpu_utilization": 0.99})
    d = r.route(RouteRequest("x", tokens(1)))  # b, c missing = worst; a over but least bad
    assert d.worker_id == "a" and d.fallback
    r.set_attributes("a", {"gpu_utilization": 0.5})
    assert r.route(RouteRequest("y", tokens(1))).worker_id == "a"


def test_missing_policy_penalise_keeps_but_costs_more():
    clock = FakeClock()
    r = gpu_router(clock, on_missing="penalise")
    r.set_attributes("a", {"gpu_utilization": 0.5})
    d = r.route(RouteRequest("x", tokens(4)))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["b"]["missing_attribute_penalty"] is True
    assert rows["b"]["cost"] == pytest.approx(rows["a"]["cost"] * 1.5)
    assert d.worker_id == "a"
    assert "missing attribute" in d._formula(1)


def test_all_missing_with_exclude_raises_overloaded():
    r = gpu_router(FakeClock())
    with pytest.raises(AllWorkersOverloaded):
        r.route(RouteRequest("x", tokens(1)))


def test_drained_worker_gets_nothing_new_but_finishes():
    r = make_router(workers=("a", "b"))
    r.route(RouteRequest("old", tokens(3), hints=RoutingHints(pinned_worker_id="a")))
    r.drain_worker("a")
    for i in range(5):
        d = r.route(RouteRequest(f"n{i}", tokens(1, start=i * 100)))
        assert d.worker_id == "b"
    assert [(e.worker_id, e.dp_rank, e.filter) for e in d.excluded] == [("a", None, "drain")]
    with pytest.raises(NoCompatibleWorker, match="draining"):
        r.route(RouteRequest("p", tokens(1), hints=RoutingHints(pinned_worker_id="a")))
    assert r.active_load("a")[0]["inflight"] == 1
    r.on_finish("old")
    assert r.active_load("a")[0] == {"prefill_tokens": 0, "decode_blocks": 0, "inflight": 0}
    r.undrain_worker("a")
    r.drain_worker("b")
    assert r.route(RouteRequest("z", tokens(1))).worker_id == "a"


def test_remove_worker_and_unknown_worker():
    r = make_router(workers=("a", "b"))
    r.route(RouteRequest("x", tokens(2), hints=RoutingHints(pinned_worker_id="a")))
    r.remove_worker("a")
    assert r.route(RouteRequest("y", tokens(2))).worker_id == "b"
    r.on_finish("x")  # the removed worker's request: a counted no-op, never a crash
    with pytest.raises(UnknownWorker):
        r.remove_worker("a")
    with pytest.raises(UnknownWorker):
        r.set_attributes("a", {"q": 1})
    r.remove_worker("b")
    with pytest.raises(NoCompatibleWorker):
        r.route(RouteRequest("z", tokens(2)))


def test_bad_attribute_values_are_counted_drops():
    r = make_router(workers=("a",))
    r.set_attributes("a", {"q": "nan", "ok": 3, "bad": object()})
    assert r.stats()["attributes_dropped"] == 2
    assert r.worker_state("a").attributes["ok"].value == 3.0


def test_events_for_unknown_workers_are_counted_drops():
    from kvplug.events import BlockStored

    r = make_router(workers=("a",))
    r.apply_event(BlockStored(worker_id="ghost", engine_hashes=[1], block_hashes=[1]))
    r.apply_event(BlockStored(worker_id="a", dp_rank=5, engine_hashes=[1], block_hashes=[1]))
    assert r.stats()["events_dropped_unknown_worker"] == 2
    assert BS == 16


def test_a_clear_of_an_unregistered_rank_is_not_a_drop_and_keeps_what_is_indexed():
    """An engine restarted with fewer DP ranks: the worker is registered again with one rank
    (the other's blocks go with it), then its subscriber clears every rank it consumed. The
    clear of the rank that went away has nothing to clear: counted apart, not as a drop; the
    rank that stays keeps its blocks; a clear of a worker never registered is the same."""
    from kvplug.events import AllCleared, BlockStored
    from kvplug.workers import Worker

    for batched in (False, True):
        r = make_router(workers=())
        r.add_worker(Worker("a", dp_size=2))
        for rank in (0, 1):
            r.apply_event(
                BlockStored(worker_id="a", dp_rank=rank, engine_hashes=[1], block_hashes=[7])
            )
        r.add_worker(Worker("a", dp_size=1))  # re-registered with rank 0 alone
        clears = [AllCleared(worker_id="a", dp_rank=1), AllCleared(worker_id="ghost")]
        if batched:
            assert r.apply_events(clears) == 0
        else:
            for ev in clears:
                r.apply_event(ev)
        stats = r.stats()
        assert stats["clears_of_unregistered"] == 2
        assert stats["events_dropped_unknown_worker"] == 0
        assert set(r.index.core.holdings(r.index.endpoint_id("a", 0))) == {7}


def test_event_batches_count_drops_like_single_events_and_keep_the_rest():
    from kvplug.events import BlockRemoved, BlockStored

    single, batched = make_router(workers=("a",)), make_router(workers=("a",))
    events = [
        BlockStored(worker_id="a", engine_hashes=[1, 2], block_hashes=[11, 12]),
        BlockStored(worker_id="ghost", engine_hashes=[3], block_hashes=[13]),
        BlockStored(worker_id="a", dp_rank=5, engine_hashes=[3], block_hashes=[13]),
        BlockStored(worker_id="a", engine_hashes=[4, 5], block_hashes=[14]),  # lengths differ
        BlockStored(worker_id="a", parent_engine_hash=2, engine_hashes=[6], block_hashes=[16]),
        BlockRemoved(worker_id="a", engine_hashes=[1]),
    ]
    for ev in events:
        single.apply_event(ev)
    assert batched.apply_events(iter(events)) == 3
    keys = ("events_applied", "events_dropped_unknown_worker", "events_dropped_invalid")
    assert [batched.stats()[k] for k in keys] == [3, 2, 1]
    assert [single.stats()[k] for k in keys] == [3, 2, 1]
    ep = batched.index.endpoint_id("a", 0)
    assert set(batched.index.core.holdings(ep)) == {12, 16}
    assert set(single.index.core.holdings(ep)) == {12, 16}


def test_re_add_worker_with_fewer_ranks_forgets_the_lost_rank():
    r = make_router(workers=(Worker("a", dp_size=2),))
    toks = tokens(4)
    from test_router_helpers import store_prefix

    store_prefix(r, "a", toks, 4, dp_rank=1)
    r.route(RouteRequest("x", tokens(2, 900), hints=RoutingHints(pinned_dp_rank=1)))
    r.drain_worker("a")
    r.add_worker(Worker("a", dp_size=1, labels={"v": "2"}))  # re-register: rank 1 gone
    assert set(r.active_load("a")) == {0}
    assert r.worker_state("a").worker.labels == {"v": "2"} and not r.worker_state("a").draining
    r.add_worker(Worker("a", dp_size=2))  # rank 1 back: empty cache, no load
    d = r.route(RouteRequest("y", toks, hints=RoutingHints(pinned_dp_rank=1)))
    assert d.overlap_blocks == 0 and r.active_load("a")[1]["inflight"] == 1
