"""``_core.seed_load_costs`` (the default cost terms in one compiled call) against SeedCost's
numpy path: the same prefill terms, decode terms and costs, bit for bit, and so the same
decisions."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import Router, RouterConfig, RouteRequest, Worker
from kvplug.core import load_backend
from kvplug.errors import InvalidArgument

core = load_backend("c")


def seed_cost(router: Router, fused: bool):
    cost = router._policy.cost
    if not fused:
        cost.fused = None
    return cost


@st.composite
def contexts(draw):
    n_eps = draw(st.integers(1, 40))
    cands = np.array(
        sorted(draw(st.sets(st.integers(0, n_eps - 1), min_size=1, max_size=n_eps))), np.intp
    )
    k = len(cands)
    counts = st.integers(0, 5000).map(float)
    reals = st.floats(0, 1e6, allow_nan=False)
    arr = lambda n, el: np.array(draw(st.lists(el, min_size=n, max_size=n)), np.float64)  # noqa: E731
    is_range = bool(np.array_equal(cands, np.arange(k)))
    return SimpleNamespace(
        cands=cands,
        sel=slice(0, k) if is_range else cands,
        prefill_tokens=arr(n_eps, reals),
        decode_blocks=arr(n_eps, st.one_of(counts, reals)),
        device=arr(k, counts),
        host=arr(k, counts),
        disk=arr(k, counts),
        shared=arr(k, counts),
        active_depth=draw(st.one_of(st.none(), st.just(arr(k, counts)))),
        n_tokens=draw(st.integers(0, 200_000)),
        block_size=draw(st.sampled_from([1, 16, 32, 64, 512])),
    )


@pytest.fixture(scope="module")
def routers():
    made = {}
    for fused in (True, False):
        router = Router(RouterConfig())
        router.add_worker(Worker(worker_id="w0"))
        made[fused] = router
    return made


@settings(max_examples=400, deadline=None)
@given(contexts())
def test_the_compiled_terms_are_the_numpy_terms_bit_for_bit(routers, c):
    out = {}
    for fused, router in routers.items():
        cost = seed_cost(router, fused)
        cost.block_size = c.block_size
        rules = router._candidates(RouteRequest(request_id="x", token_ids=[1])).rules
        ctx = SimpleNamespace(**vars(c), full_blocks=-(-c.n_tokens // c.block_size), rules=rules)
        inputs: dict = {}
        values = cost(ctx, inputs)
        out[fused] = (values, inputs)
    (fv, fi), (nv, ni) = out[True], out[False]
    assert fv.tobytes() == nv.tobytes()
    assert sorted(fi) == sorted(ni)
    for key in fi:
        assert np.asarray(fi[key]).tobytes() == np.asarray(ni[key]).tobytes(), key


def test_decisions_are_the_same_with_and_without_the_compiled_call():
    rng = np.random.default_rng(7)
    made = {}
    for fused in (True, False):
        # a fixed clock: the default routing's TTFT guard reads elapsed times, which a wall
        # clock makes differ between the two runs once its latency tail is in use
        router = Router(RouterConfig(), rng=random.Random(3), clock=lambda: 1000.0)
        for i in range(6):
            router.add_worker(Worker(worker_id=f"w{i}"))
        seed_cost(router, fused)
        rng = np.random.default_rng(7)
        prefixes = [rng.integers(0, 30_000, 1024, dtype=np.uint32) for _ in range(4)]
        picks = []
        for i in range(300):
            toks = np.concatenate([prefixes[i % 4], rng.integers(0, 30_000, 200, dtype=np.uint32)])
            d = router.route(RouteRequest(request_id=f"r{i}", token_ids=toks))
            picks.append((d.worker_id, d.dp_rank))
            if i % 3 == 0 and i >= 2:
                router.on_finish(f"r{i - 2}")
        made[fused] = picks
    assert made[True] == made[False]
    assert len(set(made[True])) > 1  # load spread them: the decode and prefill terms mattered


def test_bad_candidates_are_refused():
    rules_params = core.CostParams()
    z = np.zeros(2)
    with pytest.raises(InvalidArgument):
        core.seed_load_costs(z, z, np.array([0, 5]), z, z, z, z, None, 10, 1, 16, rules_params)
