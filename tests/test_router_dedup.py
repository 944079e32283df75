"""--router-assume-kv-reuse: active prompt blocks deduplicated by block hash (Dynamo's
active-sequence tracker), per endpoint, refcounted, released exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router_helpers import BS, core_backend, make_router, tokens

from kvplug.active_blocks import ActiveBlocks
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Stage, Worker

pytestmark = pytest.mark.usefixtures("core_backend")
assert core_backend


def decode(r, w):
    return r.active_load(w)[0]["decode_blocks"]


def pinned(rid, toks, w, **kw):
    return RouteRequest(rid, toks, hints=RoutingHints(pinned_worker_id=w), **kw)


def test_shared_prefix_counted_once_and_released_exactly():
    r = make_router(workers=("a", "b"))
    prefix = tokens(10, 0)
    r1 = prefix + tokens(3, 10_000)  # 13 blocks
    r2 = prefix + tokens(5, 20_000)  # 15 blocks
    r.route(pinned("r1", r1, "a"))
    r.route(pinned("r2", r2, "a"))
    # 10 shared + 3 + 5 own, not 13 + 15
    assert decode(r, "a") == 18
    r.on_first_token("r1")
    r.on_first_token("r2")
    # third: the prefix, 2 own full blocks and a partial one (8 tokens)
    r3 = prefix + tokens(2, 30_000) + list(range(40_000, 40_008))
    d = r.route(RouteRequest("r3", r3))
    rows = {c["worker_id"]: c for c in d.candidates}
    # prefill = 200 tokens / 16 = 12.5 everywhere (nothing cached, nothing pending)
    # a: decode 18 active + (13 blocks - 10 already active) = 21 -> 33.5
    # b: decode 0 + 13 -> 25.5
    assert rows["a"]["active_prefix"] == 10 and rows["b"]["active_prefix"] == 0
    assert rows["a"]["decode_blocks"] == 21 and rows["a"]["cost"] == pytest.approx(33.5)
    assert rows["b"]["decode_blocks"] == 13 and rows["b"]["cost"] == pytest.approx(25.5)
    assert d.worker_id == "b"
    assert "10 already active" in d._formula(0)
    r.on_finish("r3")
    r.route(pinned("r3", r3, "a"))  # now on a: 2 own + 1 partial are new
    assert decode(r, "a") == 21
    r.on_finish("r1")  # its 3 own blocks go; the prefix stays (r2, r3)
    assert decode(r, "a") == 18
    r.on_finish("r2")  # its 5 own blocks go; r3 still holds the prefix
    assert decode(r, "a") == 13
    r.on_finish("r3")
    assert decode(r, "a") == 0 and decode(r, "b") == 0
    assert r.load.active.chains == 0 and r.load.active.nodes() == 0


def test_flag_off_counts_every_request_in_full():
    r = make_router(workers=("a",), router_assume_kv_reuse=False)
    prefix = tokens(10, 0)
    r.route(pinned("r1", prefix + tokens(3, 10_000), "a"))
    r.route(pinned("r2", prefix + tokens(5, 20_000), "a"))
    assert decode(r, "a") == 13 + 15
    d = r.route(RouteRequest("r3", prefix + tokens(2, 30_000)))
    assert d.candidates[0]["decode_blocks"] == 28 + 12
    assert "active_prefix" not in d.candidates[0]
    for rid in ("r1", "r2", "r3"):
        r.on_finish(rid)
    assert decode(r, "a") == 0 and r.load.active.chains == 0


def test_identical_prompts_and_a_prompt_inside_another():
    r = make_router(workers=("a",))
    long = tokens(8)
    r.route(pinned("x", long, "a"))
    r.route(pinned("y", long, "a"))  # identical: nothing new
    assert decode(r, "a") == 8
    r.route(pinned("z", tokens(5), "a"))  # a prefix of x: ends inside a trie node (split)
    assert decode(r, "a") == 8
    r.on_finish("x")
    r.on_finish("y")
    assert decode(r, "a") == 5  # z still holds its 5
    r.on_finish("z")
    assert decode(r, "a") == 0


def test_endpoints_are_independent_and_dp_ranks_too():
    r = make_router(workers=(Worker("a", dp_size=2), "b"))
    toks = tokens(6)
    r.route(RouteRequest("x", toks, hints=RoutingHints(pinned_worker_id="a", pinned_dp_rank=0)))
    r.route(RouteRequest("y", toks, hints=RoutingHints(pinned_worker_id="a", pinned_dp_rank=1)))
    r.route(pinned("z", toks, "b"))
    load = r.active_load("a")
    assert load[0]["decode_blocks"] == 6 and load[1]["decode_blocks"] == 6
    assert decode(r, "b") == 6


def test_retry_with_the_same_id_and_removed_worker():
    r = make_router(workers=("a", "b"))
    toks = tokens(6)
    r.route(pinned("x", toks, "a"))
    r.route(pinned("x", toks + tokens(2, 9_000), "a"))  # same id again: old attempt released
    assert decode(r, "a") == 8 and r.stats()["load_duplicate_request_ids"] == 1
    r.route(pinned("y", toks, "b"))
    r.remove_worker("a")
    assert r.load.active.chains == 1  # b's
    r.on_finish("y")
    assert r.load.active.chains == 0 and r.load.active.nodes() == 0


def test_precomputed_hashes_are_copied_and_decode_stage_does_not_dedupe():
    r = make_router(workers=("a",))
    toks = tokens(4)
    h = np.array(r.index.request_hashes(np.asarray(toks, dtype=np.uint32)), dtype=np.uint64)
    r.route(pinned("x", [], "a", block_hashes=h))
    h[:] = 0  # the caller reuses its buffer: the tracker kept its own copy
    r.route(pinned("y", toks, "a"))
    assert decode(r, "a") == 4
    # decode stage: no reuse assumption (PROTOCOLS.md §4.6), every block counts
    r.route(pinned("z", toks, "a", stage=Stage.DECODE))
    assert decode(r, "a") == 8
    for rid in "xyz":
        r.on_finish(rid)
    assert decode(r, "a") == 0


def test_resident_credit_on_top_of_the_dedup_and_dynamo_exact():
    from test_router_helpers import store_prefix

    from kvplug.events import Tier

    toks = tokens(8)
    for credit, want_a in ((True, (8 - 4) + (8 - 4)), (False, (8 - 4) + 8)):
        r = make_router(workers=("a", "b"), router_decode_resident_credit=credit)
        store_prefix(r, "a", toks, 4, tier=Tier.DEVICE)
        rows = {c["worker_id"]: c for c in r.route(RouteRequest("x", toks)).candidates}
        assert rows["a"]["cost"] == pytest.approx(want_a)
        assert rows["b"]["cost"] == pytest.approx(8 + 8)
        # in flight on a now: the next identical prompt finds all 8 active (and 4 cached):
        # decode = 8 active + 8 - max(8, 4) either way
        rows = {c["worker_id"]: c for c in r.route(RouteRequest("y", toks)).candidates}
        assert rows["a"]["decode_blocks"] == 8 and rows["a"]["active_prefix"] == 8


def test_output_blocks_on_top_of_shared_prompt():
    r = make_router(workers=("a",), router_track_output_blocks=True)
    toks = tokens(4)
    r.route(pinned("x", toks, "a"))
    r.route(pinned("y", toks, "a"))
    r.on_output_progress("x", 2 * BS)  # two placeholder blocks of x's own
    assert decode(r, "a") == 4 + 2
    r.on_finish("x")
    assert decode(r, "a") == 4
    r.on_finish("y")
    assert decode(r, "a") == 0


# ------------------------------------------------------------------ property: vs. brute force

docs = st.lists(
    st.tuples(
        st.integers(0, 3),  # base document
        st.integers(0, 12),  # blocks of it
        st.integers(0, 3),  # own blocks after it
        st.integers(0, 15),  # trailing partial tokens
        st.integers(0, 2),  # worker to pin (2: unpinned)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=docs, finish_order=st.randoms(use_true_random=False))
def test_decode_blocks_equal_distinct_active_hashes(reqs, finish_order):
    r = make_router(workers=("w0", "w1", "w2"))
    live: dict[str, tuple[str, list[int], int]] = {}
    for i, (doc, n, own, partial, w) in enumerate(reqs):
        toks = tokens(n, 100_000 * doc) + tokens(own, 10_000_000 + 1_000 * i)
        toks += list(range(50_000_000, 50_000_000 + partial))
        if not toks:
            continue
        hashes = [int(x) for x in r.index.request_hashes(np.asarray(toks, dtype=np.uint32))]
        # the probe's decode term on each worker, from brute force before routing it
        want_new = {}
        for wid in ("w0", "w1", "w2"):
            held = {h for (lw, hs, _) in live.values() if lw == wid for h in hs}
            depth = 0
            while depth < len(hashes) and hashes[depth] in held:
                depth += 1
            want_new[wid] = -(-len(toks) // BS) - depth
        before = {wid: decode(r, wid) for wid in ("w0", "w1", "w2")}
        # w 0/1: pinned there (forces sharing on one worker); 2: the router picks
        hints = RoutingHints(pinned_worker_id=f"w{w}") if w < 2 else RoutingHints()
        d = r.route(RouteRequest(f"r{i}", toks, hints=hints))
        for row in d.candidates:
            assert row["decode_blocks"] == before[row["worker_id"]] + want_new[row["worker_id"]]
        live[f"r{i}"] = (d.worker_id, hashes, int(len(toks) % BS > 0))
        check_against_brute_force(r, live)
    order = list(live)
    finish_order.shuffle(order)
    for rid in order:
        r.on_finish(rid)
        del live[rid]
        check_against_brute_force(r, live)
    assert r.load.active.nodes() == 0


def check_against_brute_force(r, live):
    for wid in ("w0", "w1", "w2"):
        distinct = {h for (lw, hs, _) in live.values() if lw == wid for h in hs}
        partials = sum(p for (lw, _, p) in live.values() if lw == wid)
        assert decode(r, wid) == len(distinct) + partials


def test_tracker_depths_and_splits_directly():
    t = ActiveBlocks()
    a = np.arange(1, 11, dtype=np.uint64)  # a chain of 10 (any distinct values will do)
    b = np.concatenate([a[:4], np.arange(100, 103, dtype=np.uint64)])  # shares 4 with a
    tail_a, new_a = t.add(0, a, t.walk(a))
    assert new_a == 10
    tail_b, new_b = t.add(1, b, t.walk(b))
    assert new_b == 7  # other endpoint: nothing shared there
    out = np.zeros(4)
    assert list(t.depths(t.walk(b), out)) == [4, 7, 0, 0]
    tail_b0, new_b0 = t.add(0, b, t.walk(b))
    assert new_b0 == 3
    assert t.nodes() == 3  # a[:4] split from a[4:], b's tail
    assert t.release(0, tail_a) == 6  # a's own suffix; the shared 4 stay for b on 0
    assert t.release(0, tail_b0) == 7
    assert t.release(1, tail_b) == 7
    assert t.nodes() == 0 and t.chains == 0
    assert t.walk(np.zeros(0, dtype=np.uint64)) == []
    assert t.add(0, np.zeros(0, dtype=np.uint64), []) == (None, 0)
