"""Scenario tests of the core contract; every test body runs on the C core and the reference."""

from __future__ import annotations

import array

import numpy as np
import pytest

from kvplug.core import load_backend
from kvplug.errors import InvalidArgument, InvalidTokens

SHARED = 0xFFFFFFFF


@pytest.fixture(params=["c", "reference"])
def be(request):
    return load_backend(request.param)


def ints(xs):
    return [int(x) for x in xs]


def test_compiled_core_is_an_extension():
    core = load_backend("c")
    assert core.__file__.endswith((".so", ".pyd"))


def test_hash_blocks_skips_partial_block_and_chains(be):
    toks = list(range(37))
    local, seq = be.hash_blocks(toks, 16)
    assert len(local) == len(seq) == 2
    assert ints(local)[0] == be.local_hash(toks[:16])
    assert ints(seq)[0] == be.chain_hash(0, ints(local)[0], 0)
    assert ints(seq)[1] == be.chain_hash(ints(seq)[0], ints(local)[1], 0)


def test_hash_inputs_agree(be):
    toks = [5, 0, 2**32 - 1, 17] * 12
    ref = ints(be.hash_blocks(toks, 16, seed=9)[1])
    for form in (
        np.array(toks, np.uint32),
        np.array(toks, np.int64),
        np.array(toks, np.uint64),
        array.array("I", toks),
        np.array(toks, np.uint32).tobytes(),
        memoryview(np.array(toks, np.uint32)),
        tuple(toks),
    ):
        assert ints(be.hash_blocks(form, 16, seed=9)[1]) == ref
    small = [t for t in toks if t < 2**31]
    assert ints(be.hash_blocks(np.array(small, np.int32), 4)[1]) == ints(
        be.hash_blocks(small, 4)[1]
    )


def test_seed_and_extra_change_hashes(be):
    toks = list(range(32))
    base = ints(be.hash_blocks(toks, 16)[1])
    assert ints(be.hash_blocks(toks, 16, seed=1)[1])[0] != base[0]
    with_extra = ints(be.hash_blocks(toks, 16, extra=[0, 7])[1])
    assert with_extra[0] == base[0] and with_extra[1] != base[1]
    with pytest.raises(InvalidArgument):
        be.hash_blocks(toks, 16, extra=[1])


@pytest.mark.parametrize(
    "bad", [[1, -1], [1, 2**32], np.array([3, -2], np.int32), np.array([2**40], np.int64)]
)
def test_bad_tokens_raise_with_position(be, bad):
    with pytest.raises(InvalidTokens, match="position 1|position 0"):
        be.hash_blocks(bad, 1)


def test_float_tokens_rejected(be):
    with pytest.raises(InvalidTokens):
        be.hash_blocks([1.5, 2.0], 1)
    with pytest.raises((InvalidTokens, TypeError)):
        be.hash_blocks(np.array([1.0, 2.0]), 1)


def test_bad_block_size(be):
    with pytest.raises(InvalidArgument):
        be.hash_blocks([1, 2], 0)


def test_store_query_tiers_and_shared(be):
    idx = be.Index()
    idx.store(0, 0, [1, 2, 3], [10, 20, 30])
    idx.store(1, 1, [5, 6], [10, 20])
    idx.store(1, 2, [7], [30])  # not a continuation in device: disk tier
    idx.store(SHARED, 0, [9, 8, 7, 6], [10, 20, 30, 40])
    q = idx.query([10, 20, 30, 40, 50])
    assert q.row(0) == (3, 3, 0, 0, 1)  # shared continues one block beyond
    assert q.row(1) == (3, 0, 2, 1, 1)
    assert q.row(2) == (0, 0, 0, 0, 4)
    assert q.shared_prefix == 4
    assert q.walked == 5


def test_walk_stops_when_nobody_continues(be):
    idx = be.Index()
    idx.store(0, 0, [1, 2], [10, 20])
    q = idx.query([10, 99, 20, 30])
    assert q.row(0) == (1, 1, 0, 0, 0)
    assert q.walked == 2


def test_duplicate_conflicting_orphan_remove_move(be):
    idx = be.Index()
    idx.store(0, 0, [1], [10])
    idx.store(0, 0, [1], [10])  # duplicate: refcount 2
    idx.store(0, 0, [1], [11])  # conflicting: dropped
    assert idx.store_tokens(0, 0, 12345, [2], [1, 2], 2) is False  # orphan
    s = idx.stats()
    assert (s["duplicate_stores"], s["conflicting_stores"], s["orphan_stores"]) == (1, 1, 1)
    idx.remove(0, [1])
    assert idx.query([10]).row(0)[0] == 1  # one reference left
    idx.move(0, [1], 0, 1)
    assert idx.query([10]).row(0) == (1, 0, 1, 0, 0)
    idx.remove(0, [1], tier=0)  # nothing in device any more
    assert idx.stats()["unknown_removes"] == 1
    idx.remove(0, [1])
    assert idx.query([10]).row(0) == (0, 0, 0, 0, 0)
    assert idx.stats()["blocks"] == 0 and idx.stats()["engine_mappings"] == 0


def test_store_tokens_chains_from_parent(be):
    idx = be.Index()
    toks = list(range(8))
    assert idx.store_tokens(3, 0, None, [100, 101], toks[:4], 2, seed=5)
    assert idx.store_tokens(3, 0, 101, [102, 103], toks[4:], 2)
    seq = ints(be.hash_blocks(toks, 2, seed=5)[1])
    assert idx.query(seq).row(3) == (4, 4, 0, 0, 0)
    assert idx.resolve(3, 103) == seq[3]
    assert idx.resolve(3, 999) is None


def test_clear_and_lru_bound(be):
    idx = be.Index(max_entries=3)
    idx.store(0, 0, [1, 2], [10, 20])
    idx.store(1, 0, [3], [30])
    idx.query([10])  # touch block 10: 20 becomes the oldest
    idx.store(1, 0, [4], [40])
    s = idx.stats()
    assert s["evicted_blocks"] == 1 and s["entries"] == 3
    assert idx.resolve(0, 2) is None and idx.resolve(0, 1) == 10
    idx.clear(0)
    assert idx.stats()["entries"] == 2 and idx.holdings(0) == {}
    assert idx.holdings(1) == {30: [1, 0, 0], 40: [1, 0, 0]}


@pytest.mark.parametrize("ep", [-1, 1 << 20, 2**32, 2**64])
def test_bad_endpoint(be, ep):
    idx = be.Index()
    with pytest.raises(InvalidArgument):
        idx.store(ep, 0, [1], [1])


@pytest.mark.parametrize("tier", [-1, 3, 7])
def test_bad_tier_leaves_index_intact(be, tier):
    idx = be.Index()
    idx.store(0, 0, [1], [10])
    before = idx.stats()
    with pytest.raises(InvalidArgument):
        idx.store(0, tier, [2], [20])
    with pytest.raises(InvalidArgument):
        idx.move(0, [1], 0, tier)
    with pytest.raises(InvalidArgument):
        idx.store(0, 0, [2, 3], [20])
    with pytest.raises(InvalidTokens):
        idx.store_tokens(0, 0, None, [5], [1, -2], 2)
    assert idx.stats() == before
    assert idx.query([10]).row(0) == (1, 1, 0, 0, 0)


def test_costs_and_select(be):
    p = be.CostParams()
    c = list(be.costs([10, 10, 10], [4, 0, 0], [0, 4, 0], [0, 0, 4], [0, 0, 2], [1, 2, 3], p))
    assert c == [7.0, 9.0, 11.0]
    assert be.select([3.0, 1.0, 1.0], 0.0, 0.0) == 1
    assert be.select([3.0, 1.0, 1.0], 0.0, 0.99) == 2
    assert be.select([0.0, 100.0], 0.5, 0.5) == 0
    with pytest.raises(InvalidArgument):
        be.select([], 0.0, 0.5)
    with pytest.raises(InvalidArgument):
        be.select([1.0], 0.0, 1.0)
    with pytest.raises(InvalidArgument):
        be.select([1.0, float("nan")], 1.0, 0.5)


def test_c_refcount_overflow_is_an_error_not_corruption():
    """The C core keeps 16-bit refcounts: the 65536th identical store is refused, unchanged."""
    core = load_backend("c")
    idx = core.Index()
    idx.store(0, 0, [1] * 65535, [10] * 65535)
    before = idx.stats()
    with pytest.raises(InvalidArgument, match="overflow"):
        idx.store(0, 0, [1], [10])
    assert idx.stats() == before
    idx.remove(0, [1])
    idx.store(0, 0, [1], [10])
    assert idx.holdings(0) == {10: [65535, 0, 0]}


def test_c_reserve_and_memory_accounting():
    core = load_backend("c")
    idx = core.Index()
    small = idx.memory_bytes()
    idx.reserve(100_000)
    assert idx.memory_bytes() > small + 100_000 * 16
    idx.store(0, 0, list(range(1000)), list(range(1000)))
    assert idx.stats()["blocks"] == 1000


def test_repeated_holder_lists_follow_every_change(be):
    """Blocks held by the same endpoints are walked in bulk; any change must still show."""
    idx = be.Index()
    hs = [10, 20, 30, 40]
    for ep in (0, 1, 2):
        idx.store(ep, 0, [ep * 10 + k for k in range(4)], hs)
    for _ in range(2):  # the second walk may reuse what the first verified
        assert idx.query(hs).matched() == {e: (4, 4, 0, 0, 0) for e in (0, 1, 2)}
    idx.move(1, [12], 0, 1)  # endpoint 1's third block goes to host
    assert idx.query(hs).row(1) == (4, 3, 1, 0, 0)
    idx.remove(2, [21])  # endpoint 2 loses its second block
    assert idx.query(hs).row(2) == (1, 1, 0, 0, 0)
    idx.store(2, 0, [21], [20])
    assert idx.query(hs).row(2) == (4, 4, 0, 0, 0)
    idx.clear(0)
    q = idx.query(hs)
    assert q.row(0) == (0, 0, 0, 0, 0) and q.row(1) == (4, 3, 1, 0, 0)
    idx.store(SHARED, 2, [7, 8, 9, 6], hs)
    assert idx.query(hs + [50]).row(2) == (4, 4, 0, 0, 0) and idx.query(hs).shared_prefix == 4


def test_missing_compiled_core_is_a_loud_import_error():
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['kvplug._core'] = None\n"
        "try:\n    import kvplug\nexcept ImportError as e:\n    print('ERR', e)\n"
        "else:\n    print('OK', kvplug.backend)\n"
    )
    env_c = {"KVPLUG_CORE": "c"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env_c},
    ).stdout
    assert out.startswith("ERR") and "pip install -e ." in out and "KVPLUG_CORE=reference" in out
    env_r = {"KVPLUG_CORE": "reference"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env_r},
    ).stdout
    assert out.strip() == "OK reference"


def test_c_index_is_safe_under_concurrent_threads():
    """Big calls release the GIL; the per-index lock must still serialise them."""
    import threading

    core = load_backend("c")
    idx = core.Index()
    n = 4096  # above the GIL-release thresholds
    rng = np.random.default_rng(0)
    chains = [rng.integers(0, 2**63, n, dtype=np.uint64) for _ in range(4)]
    errors = []

    def writer(ep):
        try:
            for _ in range(20):
                idx.store(ep, 0, chains[ep], chains[ep])
                idx.remove(ep, chains[ep])
            idx.store(ep, 0, chains[ep], chains[ep])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def reader():
        out = core.QueryResult()
        try:
            for i in range(40):
                idx.query(chains[i % 4], out)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(ep,)) for ep in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = idx.stats()
    assert s["entries"] == 4 * n and s["engine_mappings"] == 4 * n
    for ep in range(4):
        assert idx.query(chains[ep]).row(ep) == (n, n, 0, 0, 0)


def test_many_duplicate_stores_keep_exact_refcounts():
    """Many references per mapping, and a second engine hash of a held block (C: side-table
    refcounts), on an endpoint and the shared tier: every reference still counts, removes and
    moves stay exact, nothing errors."""
    c, r = load_backend("c").Index(), load_backend("reference").Index()
    for idx in (c, r):
        for tier in (0, 1, 2):
            idx.store(3, tier, [7] * (20 + tier), [70] * (20 + tier))
        idx.store(3, 0, [8] * 9, [70] * 9)  # a second engine hash of the same block
        idx.store(0xFFFFFFFF, 1, [7] * 12, [70] * 12)  # same engine hash on the shared tier
        idx.move(3, [7] * 5, 1, 2)
        idx.remove(3, [7] * 18, 0)
    assert c.holdings(3) == r.holdings(3) == {70: [2 + 9, 16, 27]}
    assert c.stats() == r.stats()
    for idx in (c, r):
        idx.remove(3, [7] * 60)  # tier=None: one reference from every tier per remove
        idx.remove(3, [8] * 9)
        idx.remove(0xFFFFFFFF, [7] * 12, 1)
    assert c.stats() == r.stats()
    assert c.holdings(3) == r.holdings(3) == {}
    assert c.stats()["blocks"] == 0 and c.stats()["engine_mappings"] == 0


def test_bounded_eviction_with_many_holders_matches_reference():
    """Bounded C index: blocks held by many endpoints (holder arrays grown several times, each
    holder's first engine hash kept for eviction) evict exactly like the reference."""
    import random

    rng = random.Random(7)
    c = load_backend("c").Index(max_entries=300)
    r = load_backend("reference").Index(max_entries=300)
    for step in range(600):
        ep = rng.randrange(40)
        start = rng.randrange(30)
        n = rng.randrange(1, 12)
        blocks = list(range(start, start + n))
        ehs = [b * 1000 + ep * 7 + rng.randrange(2) for b in blocks]  # some endpoints remap
        for idx in (c, r):
            if step % 7 == 3:
                idx.remove(ep, ehs[: n // 2])
            elif step % 11 == 5:
                idx.move(ep, ehs, 0, 1)
            else:
                idx.store(ep, step % 3, ehs, blocks)
            if step % 13 == 0:
                idx.query(list(range(0, 40)))
        assert c.stats() == r.stats()
    for ep in range(40):
        assert c.holdings(ep) == r.holdings(ep)
    assert c.stats()["evicted_blocks"] > 0


@pytest.mark.parametrize("bound", [0, 1, 3, 50])
def test_large_counts_and_many_engine_hashes_per_block_match_reference(bound):
    """C records keep a lone holder inline with 8-bit counts and a 6-bit mapping count, and an
    endpoint's further engine hashes of a block it holds keep their refcounts in a side table:
    counts past 255, more than 63 engine hashes of one block, and every remove / move / clear
    order must still match the reference exactly (bounded or not)."""
    import random

    rng = random.Random(bound + 11)
    most = 0  # the largest count seen: the run must pass the inline limit
    c = load_backend("c").Index(max_entries=bound)
    r = load_backend("reference").Index(max_entries=bound)
    for step in range(1500):
        ep = rng.choice([0, 1, SHARED])
        blk = rng.randrange(3)
        op = rng.random()
        if op < 0.55:  # many references: a few engine hashes stored again and again, or many
            eh = blk * 1000 + (rng.randrange(2) if rng.random() < 0.7 else rng.randrange(200))
            n = rng.randrange(1, 60)
            args = (ep, rng.randrange(3), [eh] * n, [blk] * n)
            for idx in (c, r):
                idx.store(*args)
        elif op < 0.75:
            ehs = [blk * 1000 + rng.randrange(200) for _ in range(rng.randrange(1, 30))]
            tier = rng.choice([None, 0, 1, 2])
            for idx in (c, r):
                idx.remove(ep, ehs, tier)
        elif op < 0.95:
            ehs = [blk * 1000 + rng.randrange(2)] * rng.randrange(1, 20)
            src, dst = rng.randrange(3), rng.randrange(3)
            for idx in (c, r):
                idx.move(ep, ehs, src, dst)
        elif op < 0.955:
            for idx in (c, r):
                idx.clear(ep)
        else:
            assert c.query([0, 1, 2]).matched() == r.query([0, 1, 2]).matched()
        if step % 25 == 0 or step > 1450:
            assert c.stats() == r.stats(), step
            for e in (0, 1, SHARED):
                assert c.holdings(e) == r.holdings(e), (step, e)
                assert c.held_count(e) == r.held_count(e) == len(c.holdings(e)), (step, e)
                for eh in (0, 1, 1000, 1001, 2000, 2001, 7, 1150):
                    assert c.resolve(e, eh) == r.resolve(e, eh)
                most = max([most] + [max(v) for v in c.holdings(e).values()])
            assert list(c.held_counts(3)) == list(r.held_counts(3)), step
            assert [int(x) for x in c.held_counts(2)] == [len(c.holdings(e)) for e in (0, 1)]
    if bound == 0:
        assert most > 255


def test_c_inline_holder_limits_are_invisible():
    """300 references in one tier and 200 engine hashes of one block on one endpoint: the
    C record outgrows its inline holder without losing a count."""
    c, r = load_backend("c").Index(), load_backend("reference").Index()
    for idx in (c, r):
        idx.store(4, 2, [9] * 300, [77] * 300)
        idx.store(4, 0, list(range(100, 300)), [77] * 200)
        idx.move(4, [9] * 10, 2, 1)
    assert c.holdings(4) == r.holdings(4) == {77: [200, 10, 290]}
    assert c.stats() == r.stats()
    for idx in (c, r):
        idx.remove(4, list(range(100, 300)))
        idx.remove(4, [9] * 290, 2)
    assert c.holdings(4) == r.holdings(4) == {77: [0, 10, 0]}
    for idx in (c, r):
        idx.remove(4, [9] * 10)
    assert c.stats() == r.stats()
    assert c.stats()["blocks"] == 0 and c.stats()["engine_mappings"] == 0


def test_c_reserve_spreads_mappings_over_endpoints():
    core = load_backend("c")
    idx = core.Index()
    base = idx.memory_bytes()
    idx.reserve(36_000, 36_000, endpoints=4)  # engine maps are per endpoint
    assert idx.memory_bytes() >= base + 36_000 * (12 + 16 + 6)
    grown = idx.memory_bytes()
    for ep in range(4):
        blocks = list(range(ep * 9000, (ep + 1) * 9000))
        idx.store(ep, 0, blocks, blocks)
    assert idx.memory_bytes() == grown  # nothing grew
    assert idx.stats()["engine_mappings"] == 36_000
    idx2 = core.Index()
    idx2.store(3, 0, [1], [1])
    before = idx2.memory_bytes()
    idx2.reserve(10, 8000)  # spread over the endpoint ids that have stored (0..3)
    assert idx2.memory_bytes() >= before + 8000 * 12
    with pytest.raises(InvalidArgument):
        idx2.reserve(10, 10, endpoints=-1)


def test_a_missing_dependency_is_not_reported_as_an_unbuilt_core():
    # e.g. `python benchmarks/bench_router.py` with a Python outside the venv: the core is
    # built, numpy is what is missing (the hint used to say "not built")
    import subprocess
    import sys

    code = "import sys; sys.modules['numpy'] = None\nimport kvplug\n"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    last = err.strip().splitlines()[-1]
    assert "kvplug needs 'numpy'" in last and sys.executable in last, last
    assert "not built" not in last


def test_a_root_store_of_held_blocks_reannounces_them(be):
    """vLLM's kv_cache_report_mode "full" sends a request's cache hits as a root store again
    (parent None) but one removal per block when they go: the leading blocks the endpoint
    already holds in that tier are not counted again, so one removal takes them out; the rest
    of the store chains from them. A parented duplicate stays a refcounted copy."""
    idx = be.Index()
    toks = list(range(64))  # 4 blocks of 16
    idx.store_tokens(1, 0, None, [11, 12, 13], toks[:48], 16)
    seq = ints(be.hash_blocks(toks, 16)[1])
    # the cache hits re-announced, plus one new block chained after them
    assert idx.store_tokens(1, 0, None, [11, 12, 13, 14], toks, 16)
    s = idx.stats()
    assert s["reannounced_blocks"] == 3 and s["duplicate_stores"] == 0
    assert idx.holdings(1) == {h: [1, 0, 0] for h in seq}
    idx.remove(1, [11, 12, 13, 14], 0)  # one removal each: nothing left behind
    assert idx.holdings(1) == {} and idx.stats()["blocks"] == 0
    # another tier or another endpoint is a new holding, not a re-announcement
    idx.store_tokens(1, 0, None, [11, 12], toks[:32], 16)
    idx.store_tokens(1, 1, None, [11, 12], toks[:32], 16)
    idx.store_tokens(2, 0, None, [11, 12], toks[:32], 16)
    assert idx.holdings(1) == {seq[0]: [1, 1, 0], seq[1]: [1, 1, 0]}
    assert idx.stats()["reannounced_blocks"] == 3
    # only the leading held blocks: a store chained to a parent is a copy, refcounted
    assert idx.store_tokens(1, 0, 11, [12], toks[16:32], 16)
    assert idx.holdings(1)[seq[1]] == [2, 1, 0] and idx.stats()["duplicate_stores"] == 1
    # a different block under a held engine hash is still a conflict, not a re-announcement
    idx.store_tokens(1, 0, None, [11], list(range(100, 116)), 16)
    assert idx.stats()["conflicting_stores"] == 1 and idx.stats()["reannounced_blocks"] == 3


def test_reannouncement_agrees_with_the_reference_and_refreshes_the_lru():
    """Bounded index: a re-announced block counts as used (the engine just hit it), so the
    LRU keeps it over a block stored earlier and not used since; C and reference agree."""
    c, r = load_backend("c").Index(max_entries=3), load_backend("reference").Index(max_entries=3)
    a, b = list(range(16)), list(range(100, 116))
    for idx in (c, r):
        idx.store_tokens(1, 0, None, [1], a, 16)
        idx.store_tokens(1, 0, None, [2], b, 16)
        idx.store_tokens(1, 0, None, [1], a, 16)  # a re-announced: now the most recent
        idx.store_tokens(2, 0, None, [3, 4], list(range(200, 232)), 16)  # evicts one block
    assert c.holdings(1) == r.holdings(1)
    assert list(c.holdings(1)) == [ints(load_backend("c").hash_blocks(a, 16)[1])[0]]
    assert c.stats() == r.stats()
