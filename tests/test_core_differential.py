"""Differential harness: random event streams through the C core and the reference.

A Hypothesis RuleBasedStateMachine drives stores (by tokens and by hashes; duplicates,
conflicts, orphans), removes with and without a tier, tier moves, clears, shared-tier stores,
queries and an LRU bound through both indexes and demands identical answers and counters after
every step. A deliberately broken index (ignores removes) must make the harness fail.
"""

from __future__ import annotations

import itertools
import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvplug import _reference as ref
from kvplug.core import load_backend

core = load_backend("c")
SHARED = ref.SHARED
BS = 1  # tokens per block: tiny, so random streams collide and share prefixes often
ALPHABET = [0, 1]

# every block of the alphabet, and the sequence hashes of all chains of up to 3 such blocks
BLOCKS = [list(b) for b in itertools.product(ALPHABET, repeat=BS)]
CHAIN_HASHES = sorted(
    {
        int(h)
        for n in (1, 2)
        for chain in itertools.product(range(len(BLOCKS)), repeat=n)
        for h in ref.hash_blocks([t for b in chain for t in BLOCKS[b]], BS)[1]
    }
)

endpoints = st.sampled_from([0, 1, 2, SHARED])
tiers = st.sampled_from([0, 1, 2])
engine_hashes = st.integers(0, 7)
block_hash = st.one_of(st.sampled_from(CHAIN_HASHES), st.integers(0, 3))
token_chain = st.lists(st.sampled_from(range(len(BLOCKS))), min_size=0, max_size=4)


def flat(chain: list[int]) -> list[int]:
    return [t for b in chain for t in BLOCKS[b]]


def same_outcome(fc, fr):
    """Run one operation on both; demand the same result or the same exception class."""
    try:
        rc = fc()
    except Exception as err:  # noqa: BLE001 - the class is what we compare
        with pytest.raises(type(err)):
            fr()
        return None
    rr = fr()
    return rc, rr


class IndexMachine(RuleBasedStateMachine):
    make_c = staticmethod(core.Index)

    @initialize(bound=st.sampled_from([0, 0, 1, 2, 3, 5]))
    def init(self, bound):
        self.c = self.make_c(bound)
        self.r = ref.Index(bound)

    @rule(
        ep=endpoints, tier=tiers, pairs=st.lists(st.tuples(engine_hashes, block_hash), max_size=5)
    )
    def store_hashes(self, ep, tier, pairs):
        ehs = [p[0] for p in pairs]
        hs = [p[1] for p in pairs]
        same_outcome(
            lambda: self.c.store(ep, tier, ehs, hs), lambda: self.r.store(ep, tier, ehs, hs)
        )

    @rule(
        ep=endpoints,
        tier=tiers,
        parent=st.one_of(st.none(), engine_hashes),
        ehs=st.lists(engine_hashes, min_size=0, max_size=3),
        chain=token_chain,
        seed=st.sampled_from([0, 0, 0, 1]),
    )
    def store_tokens(self, ep, tier, parent, ehs, chain, seed):
        toks = flat(chain)[: len(ehs) * BS]
        if len(toks) < len(ehs) * BS:
            ehs = ehs[: len(toks) // BS]
        res = same_outcome(
            lambda: self.c.store_tokens(ep, tier, parent, ehs, toks, BS, seed),
            lambda: self.r.store_tokens(ep, tier, parent, ehs, toks, BS, seed),
        )
        if res is not None:
            assert res[0] == res[1]

    @rule(
        rows=st.lists(
            st.tuples(
                endpoints,
                st.sampled_from([0, 1, 2, 7]),  # 7: not a tier
                st.one_of(st.none(), engine_hashes),
                st.lists(engine_hashes, min_size=0, max_size=3),
                token_chain,
                st.sampled_from([0, 0, 0, 1]),
                st.sampled_from(["none", "none", "whole", "short"]),  # per-block extra keys
                st.sampled_from(["ok"] * 6 + ["long", "short", "bad_token"]),
            ),
            max_size=5,
        )
    )
    def store_tokens_many(self, rows):
        batch = []
        for ep, tier, parent, ehs, chain, seed, extra, shape in rows:
            toks = flat(chain)[: len(ehs) * BS]
            ehs = ehs[: len(toks) // BS]
            if shape == "long":
                toks = toks + [0]
            elif shape == "short" and toks:
                toks = toks[:-1]
            elif shape == "bad_token" and toks:
                # (no parent: the reference reads the tokens before it resolves the parent)
                toks, parent = [2**32] + toks[1:], None
            ex = None
            if extra != "none":
                ex = [3] * (len(ehs) if extra == "whole" else max(0, len(ehs) - 1))
            batch.append((ep, tier, parent, ehs, toks, seed, ex))
        blocks_c, fail_c = self.c.store_tokens_many(batch, BS)
        blocks_r, fail_r = self.r.store_tokens_many(batch, BS)
        assert blocks_c == blocks_r
        assert [(i, type(e)) for i, e in fail_c] == [(i, type(e)) for i, e in fail_r]

    @rule(ep=endpoints, ehs=st.lists(engine_hashes, max_size=4), tier=st.one_of(st.none(), tiers))
    def remove(self, ep, ehs, tier):
        same_outcome(lambda: self.c.remove(ep, ehs, tier), lambda: self.r.remove(ep, ehs, tier))

    @rule(ep=endpoints, ehs=st.lists(engine_hashes, max_size=4), src=tiers, dst=tiers)
    def move(self, ep, ehs, src, dst):
        same_outcome(lambda: self.c.move(ep, ehs, src, dst), lambda: self.r.move(ep, ehs, src, dst))

    @precondition(lambda self: hasattr(self, "c"))
    @rule(ep=endpoints)
    def clear(self, ep):
        self.c.clear(ep)
        self.r.clear(ep)

    @rule(
        chain=st.lists(st.sampled_from(range(len(BLOCKS))), max_size=5),
        seed=st.sampled_from([0, 1]),
    )
    def query_tokens(self, chain, seed):
        hs = [int(h) for h in ref.hash_blocks(flat(chain), BS, seed)[1]]
        self._compare_query(hs)

    @rule(hs=st.lists(block_hash, max_size=5))
    def query_hashes(self, hs):
        self._compare_query(hs)

    @rule(ep=st.sampled_from([0, 1, 2, SHARED]), eh=engine_hashes)
    def resolve(self, ep, eh):
        assert self.c.resolve(ep, eh) == self.r.resolve(ep, eh)

    def _compare_query(self, hs):
        qc = self.c.query(hs)
        qr = self.r.query(hs)
        assert qc.matched() == qr.matched(), (hs, qc.matched(), qr.matched())
        assert (qc.shared_prefix, qc.walked) == (qr.shared_prefix, qr.walked)
        for ep in (0, 1, 2, 3):
            assert qc.row(ep) == qr.row(ep)

    @invariant()
    def same_stats_and_holdings(self):
        if not hasattr(self, "c"):
            return
        assert self.c.stats() == self.r.stats()
        for ep in (0, 1, 2, SHARED):
            assert self.c.holdings(ep) == self.r.holdings(ep)
        assert self.c._verify() == 0  # every table's invariants (csrc/index.c)


# KVPLUG_DIFF_EXAMPLES lowers the count only for the (slow) sanitizer run; the default is 1000.
DIFF_EXAMPLES = int(os.environ.get("KVPLUG_DIFF_EXAMPLES", "1000"))
DIFF_SETTINGS = settings(
    max_examples=DIFF_EXAMPLES,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


def test_c_core_matches_reference():
    run_state_machine_as_test(IndexMachine, settings=DIFF_SETTINGS)


class IgnoresRemoves:
    """A wrapper around the C index that silently drops every remove: a planted bug."""

    def __init__(self, bound):
        self._inner = core.Index(bound)

    def remove(self, ep, ehs, tier=None):
        pass

    def __getattr__(self, name):
        return getattr(self._inner, name)


class BrokenMachine(IndexMachine):
    make_c = staticmethod(IgnoresRemoves)


def assert_harness_catches(machine: type, **extra_settings) -> None:
    """The differential machine must fail on an index with a planted bug."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=min(300, DIFF_EXAMPLES),
                stateful_step_count=12,
                deadline=None,
                derandomize=True,
                database=None,
                print_blob=False,
                **extra_settings,
            ),
        )


def test_harness_catches_an_index_that_ignores_removes():
    assert_harness_catches(BrokenMachine)


class BatchStopsAtFirstFailure:
    """A wrapper whose store_tokens_many gives up at the first bad row: a planted bug (the
    rows after a failing one must still be applied)."""

    def __init__(self, bound):
        self._inner = core.Index(bound)

    def store_tokens_many(self, rows, block_size):
        blocks = 0
        for i, (ep, tier, parent, ehs, toks, seed, extra) in enumerate(rows):
            try:
                self._inner.store_tokens(ep, tier, parent, ehs, toks, block_size, seed, extra)
            except Exception as err:  # noqa: BLE001
                return blocks, [(i, err)]
            blocks += len(ehs)
        return blocks, []

    def __getattr__(self, name):
        return getattr(self._inner, name)


class BrokenBatchMachine(IndexMachine):
    make_c = staticmethod(BatchStopsAtFirstFailure)


def test_harness_catches_a_batch_that_stops_at_the_first_failure():
    assert_harness_catches(BrokenBatchMachine, report_multiple_bugs=False)


costs_in = st.lists(st.tuples(*[st.integers(0, 64)] * 6), min_size=1, max_size=8)


weights = st.floats(0, 10, allow_nan=False)


@settings(max_examples=DIFF_EXAMPLES, deadline=None, derandomize=True)
@given(
    rows=costs_in,
    temperature=st.one_of(st.just(0.0), st.floats(0.01, 5.0)),
    u=st.floats(0.0, 1.0, exclude_max=True),
    w=st.tuples(*[weights] * 5),
)
def test_costs_and_select_match_reference(rows, temperature, u, w):
    cols = [list(c) for c in zip(*rows, strict=True)]
    p = ref.CostParams(*w)
    cr = ref.costs(*cols, p)
    cc = core.costs(*cols, p)
    assert [float(x) for x in cc] == cr
    assert core.select(cc, temperature, u) == ref.select(cr, temperature, u)


@pytest.mark.parametrize("seed", range(4))
def test_blocks_with_many_holders_match_reference(seed):
    """Popular blocks held by dozens of endpoints (whose sorted holder lists the core searches
    from a guess at the endpoint's position, then gallops): random stores, removes, moves and
    clears over 70 endpoints and the shared tier, on a handful of blocks, answer as the
    reference does after every step (holdings of every endpoint, queries, counters)."""
    import random

    rnd = random.Random(seed)
    eps = [*range(0, 70), 300, 1000, SHARED]
    hashes = [11, 12, 13, 14]
    c, r = core.Index(), ref.Index()

    def both(method: str, *args) -> None:
        same_outcome(lambda: getattr(c, method)(*args), lambda: getattr(r, method)(*args))

    for step in range(600):
        ep = rnd.choice(eps[:20] if step < 100 else eps)  # ids sparse in the limit at first
        op = rnd.random()
        ehs = [rnd.randrange(4) for _ in range(rnd.randrange(1, 4))]
        if op < 0.6:
            hs = [rnd.choice(hashes) for _ in ehs]
            both("store", ep, rnd.randrange(3), ehs, hs)
        elif op < 0.8:
            both("remove", ep, ehs, rnd.choice([None, 0, 1, 2]))
        elif op < 0.95:
            both("move", ep, ehs, rnd.randrange(3), rnd.randrange(3))
        else:
            c.clear(ep)
            r.clear(ep)
        assert c.stats() == r.stats()
        assert c.holdings(ep) == r.holdings(ep)
        q = [rnd.choice(hashes) for _ in range(3)]
        assert c.query(q).matched() == r.query(q).matched()
    for ep in eps:
        assert c.holdings(ep) == r.holdings(ep)
    assert max(len(c.query([h]).matched()) for h in hashes) >= 16  # the guess path ran
