"""kvplug.admission: the transport-agnostic admission queue against a real Router's load."""

from __future__ import annotations

import random

import pytest

from kvplug.admission import (
    UNKNOWN_MAX_BATCHED_TOKENS,
    AdmissionQueue,
    QueueFull,
    Scope,
    best_cached_tokens,
    eligible_endpoints,
    order_key,
)
from kvplug.config import RouterConfig
from kvplug.events import BlockStored
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.workers import Stage, Worker

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_router(clock: Clock, budgets=(64, 64), **workers_extra) -> Router:
    r = Router(RouterConfig(kv_block_size=BS), clock=clock, rng=random.Random(0))
    for i, mb in enumerate(budgets):
        r.add_worker(Worker(f"w{i}", max_batched_tokens=mb, **workers_extra))
    return r


def toks(n_blocks: int, seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_blocks * BS)]


def load(router: Router, rid: str, n_blocks: int, worker: str, seed: int = 0) -> None:
    """Route a request pinned to ``worker``: its prompt counts as active prefill tokens."""
    from kvplug.request import RoutingHints

    router.route(
        RouteRequest(
            rid,
            toks(n_blocks, seed or hash(rid) % 1000 + 1),
            hints=RoutingHints(pinned_worker_id=worker),
        )  # fmt: skip
    )


def test_busy_only_when_every_eligible_worker_is_over_threshold():
    clock = Clock()
    r = make_router(clock)
    q = AdmissionQueue(0.5, clock=clock)  # busy above 32 prefill tokens of 64
    assert not q.fleet_busy(r)
    load(r, "a", 2, "w0")  # 32 tokens: not over (strictly greater is busy)
    assert not q.fleet_busy(r)
    load(r, "b", 1, "w0")  # 48 > 32
    assert not q.fleet_busy(r)  # w1 is idle
    assert q.fleet_busy(r, Scope(pinned_worker="w0"))
    assert q.fleet_busy(r, Scope(allowed=frozenset({"w0"})))
    assert not q.fleet_busy(r, Scope(allowed=frozenset({"w0", "w1"})))
    load(r, "c", 3, "w1")
    assert q.fleet_busy(r) and q.should_queue(r)
    r.on_first_token("c")  # prompt-side load of c released
    assert not q.fleet_busy(r)
    # a draining or excluded idle worker does not count as capacity
    r.drain_worker("w1")
    assert q.fleet_busy(r)
    r.undrain_worker("w1")
    assert q.fleet_busy(r, Scope(exclude=frozenset({"w1"})))
    # no eligible worker at all: not busy (routing raises its own error)
    assert not q.fleet_busy(r, Scope(allowed=frozenset({"nope"})))


def test_off_by_default_and_unknown_budget_counts_as_ten_million():
    clock = Clock()
    r = make_router(clock, budgets=(0,))
    off = AdmissionQueue(None, clock=clock)
    load(r, "a", 8, "w0")
    assert not off.enabled and not off.should_queue(r)
    assert not AdmissionQueue(0.5, clock=clock).fleet_busy(r)  # 128 tokens <= 5M
    assert AdmissionQueue(1e-6, clock=clock).fleet_busy(r)  # 128 > 10M x 1e-6 = 10
    assert RouterConfig().router_queue_threshold is None
    assert UNKNOWN_MAX_BATCHED_TOKENS == 10_000_000


def test_threshold_zero_busy_with_any_prefill_on_known_budget():
    clock = Clock()
    r = make_router(clock, budgets=(64,))
    q = AdmissionQueue(0.0, clock=clock)
    assert not q.fleet_busy(r)
    load(r, "a", 1, "w0")
    assert q.fleet_busy(r)


def test_dp_ranks_are_endpoints_and_a_pinned_rank_is_its_own_scope():
    clock = Clock()
    r = Router(RouterConfig(kv_block_size=BS), clock=clock, rng=random.Random(0))
    r.add_worker(Worker("w0", dp_size=2, max_batched_tokens=32))
    q = AdmissionQueue(1.0, clock=clock)
    from kvplug.request import RoutingHints

    r.route(
        RouteRequest("a", toks(3, 1), hints=RoutingHints(pinned_worker_id="w0", pinned_dp_rank=0))
    )
    assert len(eligible_endpoints(r, Scope())) == 2
    assert not q.fleet_busy(r)
    assert q.fleet_busy(r, Scope(pinned_worker="w0", pinned_rank=0))
    assert not q.fleet_busy(r, Scope(pinned_worker="w0", pinned_rank=1))
    assert q.fleet_busy(r, Scope(pinned_rank=0))  # a rank pin alone bounds the ranks too
    assert eligible_endpoints(r, Scope(pinned_rank=1)) == [r.index.endpoint_id("w0", 1)]


def test_role_scope():
    clock = Clock()
    r = Router(RouterConfig(kv_block_size=BS), clock=clock)
    r.add_worker(Worker("p", role="prefill", max_batched_tokens=16))
    r.add_worker(Worker("d", role="decode", max_batched_tokens=16))
    assert [r.ep_worker[e] for e in eligible_endpoints(r, Scope(stage=Stage.PREFILL))] == ["p"]
    assert [r.ep_worker[e] for e in eligible_endpoints(r, Scope(stage=Stage.DECODE))] == ["d"]


def fill(q: AdmissionQueue, clock: Clock, sizes: list[int], jumps=None) -> list:
    out = []
    for i, n in enumerate(sizes):
        out.append(q.enqueue(i, prompt_tokens=n, priority_jump=(jumps or [0.0] * len(sizes))[i]))
        clock.t += 1.0
    return out


@pytest.mark.parametrize(
    ("policy", "sizes", "jumps", "expected"),
    [
        ("fcfs", [300, 100, 200], None, [0, 1, 2]),
        ("lcfs", [300, 100, 200], None, [2, 1, 0]),
        ("wspt", [300, 100, 200], None, [1, 2, 0]),
        # a 5 s latency-sensitivity bump beats arrival order by up to 5 s (Dynamo's fcfs key)
        ("fcfs", [100, 100, 100], [0.0, 0.0, 5.0], [2, 0, 1]),
        # wspt: weight (1 + jump) / new tokens
        ("wspt", [100, 300], [0.0, 3.0], [1, 0]),
        ("wspt", [100, 300], [0.0, 1.0], [0, 1]),
        # equal keys leave in arrival order
        ("wspt", [100, 100, 100], None, [0, 1, 2]),
    ],
)
def test_release_order(policy, sizes, jumps, expected):
    clock = Clock()
    r = make_router(clock, budgets=(64,))
    q = AdmissionQueue(0.5, policy, clock=clock)
    load(r, "hog", 4, "w0")  # 64 > 32: busy
    fill(q, clock, sizes, jumps)
    assert q.depth == len(sizes)
    assert q.pop_ready(r) is None  # still busy
    r.on_first_token("hog")
    order = []
    while (t := q.pop_ready(r)) is not None:
        assert q.pop_ready(r) is None  # one in transit at a time
        order.append(t.payload)
        q.done(t)
    assert order == expected
    assert q.depth == 0 and q.counters["released"] == len(sizes)


def test_wspt_discounts_cached_prefix():
    assert order_key("wspt", 0.0, 1024, 960, 0.0) == pytest.approx(1 / 64)
    assert order_key("wspt", 0.0, 512, 2048, 0.0) == 1.0  # fully cached clamps to 1 token
    clock = Clock()
    r = make_router(clock)
    prompt = toks(4, 7)
    # w1 holds the first 3 blocks on device
    r.apply_event(
        BlockStored(
            worker_id="w1", engine_hashes=[1, 2, 3], token_ids=prompt[: 3 * BS], block_size=BS
        )  # fmt: skip
    )
    assert best_cached_tokens(r, prompt, Scope()) == 3 * BS
    assert best_cached_tokens(r, prompt, Scope(pinned_worker="w0")) == 0
    assert best_cached_tokens(r, [], Scope()) == 0


def test_release_when_load_drops_one_at_a_time_against_fresh_load():
    clock = Clock()
    r = make_router(clock)  # two workers of 64, busy above 32
    q = AdmissionQueue(0.5, clock=clock)
    load(r, "a", 3, "w0")
    load(r, "b", 3, "w1")
    assert q.should_queue(r)
    tickets = fill(q, clock, [48, 48, 48])
    assert q.should_queue(r)  # backlog: later arrivals wait too, even if load dropped
    r.on_finish("a")  # w0 idle
    t = q.pop_ready(r)
    assert t is tickets[0] and q.in_transit is t
    assert q.should_queue(r)  # a released request not yet routed still holds the line
    # its owner routes it: w0 gets busy again, so the next head stays
    r.route(RouteRequest("t0", toks(3, 11)))
    q.done(t)
    assert q.pop_ready(r) is None
    r.on_first_token("b")
    assert q.pop_ready(r) is tickets[1]
    assert t.waited == pytest.approx(3.0) and t.outcome == "released"


def test_head_of_line_blocks_later_requests():
    clock = Clock()
    r = make_router(clock)
    q = AdmissionQueue(0.5, clock=clock)
    load(r, "a", 3, "w0")
    load(r, "b", 3, "w1")
    pinned = q.enqueue("pinned", Scope(pinned_worker="w0"))
    q.enqueue("free")
    r.on_finish("b")  # w1 free, w0 still busy: the pinned head cannot go, nor can "free"
    assert q.pop_ready(r) is None
    q.cancel(pinned)
    assert q.pop_ready(r).payload == "free"


def test_max_length_rejects_and_counts():
    clock = Clock()
    q = AdmissionQueue(0.5, max_length=2, clock=clock)
    a = q.enqueue("a")
    q.enqueue("b")
    with pytest.raises(QueueFull, match="max-length 2"):
        q.enqueue("c")
    assert q.counters["rejected_full"] == 1 and q.depth == 2
    q.cancel(a)
    q.enqueue("c")  # room again
    assert q.depth == 2


def test_max_wait_expires_oldest_first():
    clock = Clock()
    r = make_router(clock, budgets=(64,))
    q = AdmissionQueue(0.5, max_wait=10.0, clock=clock)
    load(r, "hog", 4, "w0")
    t0 = q.enqueue("a")
    clock.t += 4
    t1 = q.enqueue("b")
    assert q.next_deadline() == t0.enqueued_at + 10
    clock.t += 6
    assert q.expire() == [t0]
    assert t0.outcome == "timeout" and t0.waited == pytest.approx(10.0)
    assert q.next_deadline() == t1.enqueued_at + 10 and q.depth == 1
    clock.t += 3.9
    assert q.expire() == []
    clock.t += 0.1
    assert q.expire() == [t1]
    assert q.counters["timeout"] == 2 and q.depth == 0 and q.head() is None
    assert AdmissionQueue(0.5, clock=clock).expire() == []  # no limit


def test_cancel_removes_from_the_middle_and_is_idempotent():
    clock = Clock()
    r = make_router(clock, budgets=(64,))
    q = AdmissionQueue(0.5, clock=clock)
    load(r, "hog", 4, "w0")
    a, b, c = fill(q, clock, [16, 16, 16])
    assert q.cancel(b) and not q.cancel(b)
    assert [t.payload for t in q.waiting()] == [0, 2]
    r.on_finish("hog")
    assert q.pop_ready(r) is a
    assert not q.cancel(a)  # released already
    q.done(a)
    assert q.pop_ready(r) is c
    assert q.counters == {
        "queued": 3,
        "released": 2,
        "timeout": 0,
        "cancelled": 1,
        "rejected_full": 0,
    }


def test_many_cancellations_do_not_grow_the_heap():
    clock = Clock()
    q = AdmissionQueue(0.5, max_wait=100, clock=clock)
    keep = q.enqueue("keep")
    for i in range(1000):
        q.cancel(q.enqueue(i))
    assert q.depth == 1 and len(q._heap) < 200 and len(q._arrivals) < 200
    assert q.head() is keep


def test_bad_arguments():
    with pytest.raises(ValueError):
        AdmissionQueue(0.5, "sjf")
    with pytest.raises(ValueError):
        AdmissionQueue(-1.0)
    cfg = RouterConfig(router_queue_threshold=2.0, router_queue_policy="lcfs",
                       router_queue_max_length=5, router_queue_max_wait=3.0)  # fmt: skip
    q = AdmissionQueue.from_config(cfg)
    assert (q.threshold, q.policy, q.max_length, q.max_wait) == (2.0, "lcfs", 5, 3.0)
