"""Property tests: the router's kv decision is the seed's formula over what it tracks."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router_helpers import BS, FakeClock, make_router, store_prefix, tokens

from kvplug import _reference
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Worker

fleet = st.lists(
    st.tuples(
        st.integers(0, 12),  # cached prefix blocks of the probe prompt
        st.integers(0, 3),  # dp ranks - 1
        st.lists(st.tuples(st.integers(1, 30), st.booleans()), max_size=4),  # prior requests
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fleet=fleet,
    credit=st.sampled_from([0.0, 0.5, 1.0]),
    scale=st.sampled_from([0.5, 1.0, 2.0]),
    reuse=st.booleans(),
    seed=st.integers(0, 99),
)
def test_kv_decision_is_the_seed_formula_over_tracked_load(fleet, credit, scale, reuse, seed):
    workers = [Worker(f"w{i}", dp_size=ranks + 1) for i, (_, ranks, _) in enumerate(fleet)]
    r = make_router(
        workers=workers,
        seed=seed,
        clock=FakeClock(),
        router_kv_overlap_score_credit=credit,
        router_prefill_load_scale=scale,
        router_assume_kv_reuse=reuse,
    )
    probe = tokens(12)
    rid = 0
    for i, (cached, ranks, prior) in enumerate(fleet):
        if cached:
            store_prefix(r, f"w{i}", probe, cached, dp_rank=ranks)
        for n_blocks, first_token_seen in prior:
            rid += 1
            r.route(
                RouteRequest(
                    f"p{rid}",
                    tokens(n_blocks, start=10_000 * rid),
                    hints=RoutingHints(pinned_worker_id=f"w{i}", pinned_dp_rank=rid % (ranks + 1)),
                )
            )
            if first_token_seen:
                r.on_first_token(f"p{rid}")
    d = r.route(RouteRequest("probe", probe))
    # independent recomputation from the router's public state
    names, pre, dev, dec = [], [], [], []
    for i, (cached, ranks, _) in enumerate(fleet):
        load = r.active_load(f"w{i}")
        for rank in range(ranks + 1):
            overlap = cached if rank == ranks else 0
            names.append(f"w{i}" if rank == 0 else f"w{i}/{rank}")
            pre.append(load[rank]["prefill_tokens"] / BS + 12)
            dev.append(overlap)
            dec.append(load[rank]["decode_blocks"] + 12 - (overlap if reuse else 0))
    zeros = [0.0] * len(names)
    # the probe's own load is already in active_load: take it out again
    chosen = names.index(d.worker_id if d.dp_rank == 0 else f"{d.worker_id}/{d.dp_rank}")
    pre[chosen] -= (12 * BS - d.cached_tokens) / BS
    dec[chosen] -= 12  # tracked: the probe's 12 distinct blocks (it shares none in flight)
    want = _reference.costs(
        pre,
        dev,
        zeros,
        zeros,
        zeros,
        dec,
        _reference.CostParams(overlap_score_credit=credit, prefill_load_scale=scale),
    )
    got = d.scores
    assert np.allclose([got[n] for n in names], want, rtol=0, atol=1e-9)
    assert got[names[chosen]] == min(got.values())
