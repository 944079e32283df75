"""The C core's hash tables across their growth boundaries: the block table and an endpoint's
engine map grow 1.5x once a store would pass 85 % load (csrc/index.c, grown_cap). Every stored
block must stay findable (query walks the block table, resolve probes the engine map) just
before, at and just after each resize, with removals (backward-shift deletion) between growths,
and the counters must match the pure-Python reference throughout."""

from __future__ import annotations

import numpy as np
import pytest
from core_tables import resize_points

from kvplug.core import load_backend

C = load_backend("c")
R = load_backend("reference")


POINTS = resize_points(5000)
CHECK_AT = sorted({n + d for n in POINTS for d in (-1, 0, 1)} | {0, 1, 2})


def check_all(c, r, ep: int, live: dict[int, int]) -> None:
    """Every live (engine hash -> block hash) of ep is found in C by resolve and query."""
    for eh, bh in live.items():
        assert c.resolve(ep, eh) == bh, (ep, eh)
    for bh in live.values():  # independent blocks: one query each walks the block table
        assert c.query([bh]).scores().get(ep) == 1, (ep, bh)
    cs, rs = c.stats(), r.stats()
    for k in ("blocks", "entries", "engine_mappings", "stored_blocks", "removed_blocks"):
        assert cs[k] == rs[k], (k, cs[k], rs[k])
    assert c._verify() == 0  # every table's invariants (csrc/index.c, kvp_index_verify)


def test_resize_points_are_where_memory_grows():
    """The test's model of the growth rule matches the core: the table memory changes exactly
    when an entry count crosses a resize point (so the checks below sit on the boundaries)."""
    c = C.Index()
    rng = np.random.default_rng(0)
    seen = []
    before = c.memory_bytes()
    for n in range(1, 400):
        c.store(0, 0, [n], [int(rng.integers(1, 2**63))])
        after = c.memory_bytes()
        if after > before:
            seen.append(n)
        before = after
    # the record pool grows on its own schedule too: every table resize is among the growths
    assert set(p for p in POINTS if p < 400) <= set(seen)


def test_empty_and_one_entry():
    for be in (C, R):
        idx = be.Index()
        assert idx.query([5]).scores() == {}
        assert idx.resolve(0, 1) is None
        idx.store(0, 0, [1], [5])
        assert idx.resolve(0, 1) == 5
        idx.remove(0, [1])
        assert idx.resolve(0, 1) is None
        idx.store(0, 0, [1], [5])
        assert idx.resolve(0, 1) == 5
        assert idx.query([5]).scores() == {0: 1}
        assert idx.stats()["blocks"] == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_stores_one_by_one_across_every_resize_with_removals(seed):
    """Two endpoints: ep 0 stores new blocks one call at a time (block table and its engine map
    grow together), ep 1 stores a subset of the same blocks under other engine hashes (its map
    grows while the block table does not). After each resize point a quarter of ep 0's blocks
    are removed, so deletions shift clusters between growths."""
    rng = np.random.default_rng(seed)
    c, r = C.Index(), R.Index()
    live0: dict[int, int] = {}
    live1: dict[int, int] = {}
    limit = 2600
    check_at = {n for n in CHECK_AT if n <= limit}
    stored = 0
    next_eh = 1
    while stored < limit:
        bh = int(rng.integers(1, 2**64, dtype=np.uint64))
        eh = next_eh
        next_eh += 1
        for idx in (c, r):
            idx.store(0, 0, [eh], [bh])
        live0[eh] = bh
        stored += 1
        if stored % 3 == 0:
            for idx in (c, r):
                idx.store(1, 0, [eh + 10**9], [bh])
            live1[eh + 10**9] = bh
        if stored in check_at:
            check_all(c, r, 0, live0)
            check_all(c, r, 1, live1)
        if stored in POINTS:  # just grown: remove a quarter of ep 0's blocks, check, go on
            gone = [k for k in list(live0) if rng.random() < 0.25]
            for idx in (c, r):
                idx.remove(0, gone)
            for k in gone:
                del live0[k]
            check_all(c, r, 0, live0)
            check_all(c, r, 1, live1)
    check_all(c, r, 0, live0)
    check_all(c, r, 1, live1)


def test_batched_store_crossing_several_resizes_at_once():
    """One store call reserves room for all its blocks first: a call that passes several
    resize points at once (the table grows by more than one step) keeps every block."""
    rng = np.random.default_rng(7)
    c, r = C.Index(), R.Index()
    for lo, hi in ((0, 13), (13, 14), (14, 700), (700, 701), (701, 3000)):
        ehs = list(range(lo + 1, hi + 1))
        bhs = [int(x) for x in rng.integers(1, 2**64, hi - lo, dtype=np.uint64)]
        for idx in (c, r):
            idx.store(2, 0, ehs, bhs)
        live = {e: c.resolve(2, e) for e in range(1, hi + 1)}
        assert None not in live.values()
        assert {e: r.resolve(2, e) for e in range(1, hi + 1)} == live
    cs, rs = c.stats(), r.stats()
    assert cs["blocks"] == rs["blocks"] == 3000
