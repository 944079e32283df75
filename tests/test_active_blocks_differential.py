"""Differential harness: the compiled active-block trie (``_core.ActiveBlocks``) against the
pure-Python reference (``kvplug.active_blocks.ActiveBlocks``).

A Hypothesis RuleBasedStateMachine adds chains (drawn from a few shared prefixes, so walks
split nodes and stop mid-node) on random endpoints, releases random held chains, and walks
random chains; after every step both tries must give the same walk (node runs and matched
counts), the same per-endpoint depths, the same new / freed block counts, the same node and
chain counts. A deliberately broken trie (release frees nothing) must make the harness fail.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplug.active_blocks import ActiveBlocks as RefActiveBlocks
from kvplug.core import load_backend

core = load_backend("c")
ENDPOINTS = 4

# chains are prefixes of a few documents that share leading blocks (hash values are arbitrary:
# the trie only compares them; a chained hash of block i stands for blocks 0..i)
_TRUNK = np.arange(1, 9, dtype=np.uint64)
DOCS = [
    np.concatenate([_TRUNK[:cut], np.arange(100 * d, 100 * d + 8, dtype=np.uint64)])
    for d, cut in enumerate((0, 2, 2, 5, 8), start=1)
]


def chain_of(doc: int, length: int) -> np.ndarray:
    return DOCS[doc][:length].copy()  # a fresh buffer per request, as the router's


def shape(walk, ref: bool) -> list[tuple[list[int], int]]:
    """A walk as (node's hashes, matched) pairs, from either implementation."""
    return [
        ((node.edge if ref else node.hashes).tolist(), k)
        for node, k in walk  # type: ignore[attr-defined]
    ]


class TrieMachine(RuleBasedStateMachine):
    make_compiled = core.ActiveBlocks

    def __init__(self) -> None:
        super().__init__()
        self.ref = RefActiveBlocks()
        self.new = type(self).make_compiled()
        self.held: list[tuple[int, object, object]] = []  # (endpoint, ref tail, new tail)

    @rule(
        doc=st.integers(0, len(DOCS) - 1),
        length=st.integers(0, 16),
        ep=st.integers(0, ENDPOINTS - 1),
    )
    def add(self, doc: int, length: int, ep: int) -> None:
        a, b = chain_of(doc, length), chain_of(doc, length)
        ref_walk, new_walk = self.ref.walk(a), self.new.walk(b)
        assert shape(ref_walk, True) == shape(new_walk, False)
        ref_tail, ref_new = self.ref.add(ep, a, ref_walk)
        new_tail, new_new = self.new.add(ep, b, new_walk)
        assert ref_new == new_new
        assert (ref_tail is None) == (new_tail is None)
        self.held.append((ep, ref_tail, new_tail))

    @rule(data=st.data())
    def release(self, data) -> None:
        if not self.held:
            return
        ep, ref_tail, new_tail = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        assert self.ref.release(ep, ref_tail) == self.new.release(ep, new_tail)

    @rule(doc=st.integers(0, len(DOCS) - 1), length=st.integers(0, 16))
    def walk(self, doc: int, length: int) -> None:
        a = chain_of(doc, length)
        ref_walk, new_walk = self.ref.walk(a), self.new.walk(a)
        assert shape(ref_walk, True) == shape(new_walk, False)
        ref_depths = self.ref.depths(ref_walk, np.full(ENDPOINTS, 7.0))
        new_depths = self.new.depths(new_walk, np.full(ENDPOINTS, 7.0))
        assert ref_depths.tolist() == new_depths.tolist()

    @invariant()
    def same_size(self) -> None:
        assert self.ref.nodes() == self.new.nodes()
        assert self.ref.chains == self.new.chains


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_compiled_trie_matches_reference() -> None:
    run_state_machine_as_test(TrieMachine, settings=SETTINGS)


class _FreesNothing:
    """The compiled trie with a bug: a release frees no blocks."""

    def __init__(self) -> None:
        self._trie = core.ActiveBlocks()

    def __getattr__(self, name: str):
        return getattr(self._trie, name)

    def release(self, ep, tail) -> int:
        self._trie.release(ep, tail)
        return 0


def test_harness_catches_a_broken_trie() -> None:
    class Broken(TrieMachine):
        make_compiled = _FreesNothing

    with pytest.raises(AssertionError):
        run_state_machine_as_test(Broken, settings=SETTINGS)


def test_compiled_trie_known_answers() -> None:
    """tests/test_router_dedup.py's direct scenario, on the compiled trie."""
    t = core.ActiveBlocks()
    a = np.arange(1, 11, dtype=np.uint64)
    b = np.concatenate([a[:4], np.arange(100, 103, dtype=np.uint64)])  # shares 4 with a
    tail_a, new_a = t.add(0, a, t.walk(a))
    assert new_a == 10
    tail_b, new_b = t.add(1, b, t.walk(b))
    assert new_b == 7
    assert list(t.depths(t.walk(b), np.zeros(4))) == [4, 7, 0, 0]
    tail_b0, new_b0 = t.add(0, b, t.walk(b))
    assert new_b0 == 3
    assert t.nodes() == 3
    assert t.release(0, tail_a) == 6
    assert t.release(0, tail_b0) == 7
    assert t.release(1, tail_b) == 7
    assert t.nodes() == 0 and t.chains == 0
    assert t.walk(np.zeros(0, dtype=np.uint64)) == []
    assert t.add(0, np.zeros(0, dtype=np.uint64), []) == (None, 0)
    # other integer buffers are read as uint64, as the router's hashes are
    tail, new = t.add(2, [5, 6], t.walk([5, 6]))
    assert new == 2 and t.depths(t.walk(np.array([5, 6, 7])), np.zeros(4)).tolist() == [
        0,
        0,
        2,
        0,
    ]
    with pytest.raises(IndexError):
        t.depths(t.walk(np.array([5], dtype=np.uint64)), np.zeros(2))  # endpoint 2 outside


def test_gather_f64_matches_numpy() -> None:
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 1000, 12).astype(np.int32) for _ in range(4)]
    sels = (
        slice(0, 12),
        slice(0, 3),
        slice(None, 5),
        slice(0, 40),  # past the end: stops there, as numpy's
        slice(2, 5),  # the rest take numpy's slicing
        slice(0, -2),
        slice(0, 12, 2),
        np.array([3, 0, 11, 3]),
        np.array([-1, 2]),
        np.array([], dtype=np.int64),
    )
    for sel in sels:
        got = core.gather_f64(sel, *arrays)
        want = [a[sel].astype(np.float64) for a in arrays]
        assert len(got) == 4
        for g, w in zip(got, want, strict=True):
            assert g.dtype == np.float64 and g.tolist() == w.tolist()
    # not int32: numpy's path, same answer
    (g,) = core.gather_f64(np.array([1, 0]), np.array([2.5, 3.5]))
    assert g.tolist() == [3.5, 2.5]
    with pytest.raises(IndexError):
        core.gather_f64(np.array([12]), arrays[0])
