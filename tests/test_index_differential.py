"""KvIndex on the C core vs KvIndex on the reference: random normalised event streams.

Covers what the core-level harness does not: endpoint registration and removal (id reuse),
event dispatch (tokens with parents and namespaces, precomputed hashes, tier copies, the shared
tier), drops of bad events, and the dense Overlaps the router reads.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored
from kvplug.index import KvIndex

BS = 2
WORKERS = ["a", "b", "c"]
workers = st.sampled_from(WORKERS + ["ghost"])
ranks = st.sampled_from([0, 0, 1])
tiers = st.sampled_from([0, 1, 2])
ehashes = st.lists(st.integers(0, 9), max_size=3)
chain = st.lists(st.sampled_from([0, 1]), max_size=3 * BS)
namespace = st.sampled_from([(None, None), (None, None), ("lora", None), (None, "salt")])


def outcome(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the class is compared
        return type(err)
    return None


class KvIndexMachine(RuleBasedStateMachine):
    @initialize(bound=st.sampled_from([0, 0, 3, 6]))
    def init(self, bound):
        self.c = KvIndex(BS, bound, backend="c")
        self.r = KvIndex(BS, bound, backend="reference")

    def both(self, fn):
        assert outcome(lambda: fn(self.c)) == outcome(lambda: fn(self.r))

    @rule(w=workers, rank=ranks)
    def add(self, w, rank):
        self.both(lambda kv: kv.add_endpoint(w, rank))
        assert self.c.endpoint_id(w, rank) == self.r.endpoint_id(w, rank)

    @rule(w=workers)
    def remove_worker(self, w):
        self.both(lambda kv: kv.remove_worker(w))

    @rule(
        w=workers,
        rank=ranks,
        tier=tiers,
        ehs=ehashes,
        toks=chain,
        parent=st.one_of(st.none(), st.integers(0, 9)),
        ns=namespace,
        shared=st.booleans(),
        bad_len=st.sampled_from([False] * 9 + [True]),
    )
    def stored_tokens(self, w, rank, tier, ehs, toks, parent, ns, shared, bad_len):
        if not bad_len:  # mostly whole blocks, one per engine hash
            toks = (toks + [0] * (len(ehs) * BS))[: len(ehs) * BS]
        ev = BlockStored(
            worker_id=w,
            dp_rank=rank,
            tier=tier,
            engine_hashes=ehs,
            token_ids=toks,
            parent_engine_hash=parent,
            lora_name=ns[0],
            cache_salt=ns[1],
            shared=shared,
        )
        self.both(lambda kv: kv.apply(ev))

    @rule(
        w=workers,
        rank=ranks,
        tier=tiers,
        pairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=3),
        shared=st.booleans(),
        copy=st.booleans(),
    )
    def stored_other(self, w, rank, tier, pairs, shared, copy):
        ehs = [p[0] for p in pairs]
        if copy:
            ev = BlockStored(
                worker_id=w,
                dp_rank=rank,
                tier=tier,
                engine_hashes=ehs,
                tier_copy=True,
                shared=shared,
            )
        else:
            ev = BlockStored(
                worker_id=w,
                dp_rank=rank,
                tier=tier,
                engine_hashes=ehs,
                block_hashes=[p[1] for p in pairs],
                shared=shared,
            )
        self.both(lambda kv: kv.apply(ev))

    @rule(
        w=workers, rank=ranks, ehs=ehashes, tier=st.one_of(st.none(), tiers), shared=st.booleans()
    )
    def removed(self, w, rank, ehs, tier, shared):
        ev = BlockRemoved(worker_id=w, dp_rank=rank, engine_hashes=ehs, tier=tier, shared=shared)
        self.both(lambda kv: kv.apply(ev))

    @rule(w=workers, rank=ranks, ehs=ehashes, src=tiers, dst=tiers)
    def moved(self, w, rank, ehs, src, dst):
        ev = BlockMoved(worker_id=w, dp_rank=rank, engine_hashes=ehs, from_tier=src, to_tier=dst)
        self.both(lambda kv: kv.apply(ev))

    @rule(w=workers, rank=ranks)
    def cleared(self, w, rank):
        self.both(lambda kv: kv.apply(AllCleared(worker_id=w, dp_rank=rank)))

    @rule(
        toks=chain, ns=namespace, raw=st.lists(st.integers(0, 5), max_size=3), use_raw=st.booleans()
    )
    def query(self, toks, ns, raw, use_raw):
        hs_c = raw if use_raw else self.c.request_hashes(toks, *ns)
        hs_r = raw if use_raw else self.r.request_hashes(toks, *ns)
        assert list(map(int, hs_c)) == list(map(int, hs_r))
        oc, orr = self.c.query(hs_c), self.r.query(hs_r)
        n = self.c.n_endpoint_ids
        assert n == self.r.n_endpoint_ids
        assert len(oc.local) >= n and len(orr.local) >= n
        for ep in range(n):
            assert oc.row(ep) == orr.row(ep), ep
        assert (oc.shared_prefix, oc.walked) == (orr.shared_prefix, orr.walked)

    @invariant()
    def same_state(self):
        if not hasattr(self, "c"):
            return
        sc, sr = self.c.stats(), self.r.stats()
        sc.pop("memory_bytes")
        assert sc == sr
        assert self.c.endpoints() == self.r.endpoints()


def test_kvindex_c_matches_reference():
    run_state_machine_as_test(
        KvIndexMachine,
        settings=settings(
            max_examples=int(os.environ.get("KVPLUG_DIFF_EXAMPLES", "1000")),
            stateful_step_count=15,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_drops_are_identical(backend):
    kv = KvIndex(BS, backend=backend)
    kv.add_endpoint("a")
    rep = kv.apply_many(
        [
            BlockStored(worker_id="a", engine_hashes=[1], token_ids=[1]),  # short block
            BlockStored(worker_id="x", engine_hashes=[1], token_ids=[1, 2]),  # unknown worker
            BlockStored(worker_id="a", engine_hashes=[1], token_ids=[1, 2]),
        ]
    )
    assert (rep.applied, rep.dropped, dict(rep.reasons)) == (
        1,
        2,
        {"InvalidEvent": 1, "UnknownWorker": 1},
    )
