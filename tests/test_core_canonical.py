"""The C core's canonical engine map (csrc/index.c, `cm`): one entry per block, keyed on the
engine hash the block was first stored under; an endpoint whose first mapping to a block is
that engine hash keeps the mapping as a flag on its holder, and only mappings where engines
disagree go to the endpoint's own map. Every case is compared with the pure-Python reference
(every engine mapping resolved, holdings, queries, counters): engines that agree, disagree and
collide, ownership passing on when a block is freed, a holder's canonical mapping leaving
while its other mappings stay, clear and holdings of one endpoint among many, eviction, every
resize point of the canonical map with removals, and the memory the layout exists for."""

from __future__ import annotations

import numpy as np
import pytest
from core_tables import resize_points

from kvplug.core import load_backend

C = load_backend("c")
R = load_backend("reference")


def both(c, r, method, *args):
    for idx in (c, r):
        getattr(idx, method)(*args)


def check(c, r, eps, ehs, blocks) -> None:
    """Every (endpoint, engine hash) resolves alike, holdings, one-block queries and counters
    are equal."""
    for ep in eps:
        for eh in ehs:
            assert c.resolve(ep, eh) == r.resolve(ep, eh), (ep, eh)
        assert c.holdings(ep) == r.holdings(ep), ep
    for bh in blocks:
        assert c.query([bh]).matched() == r.query([bh]).matched(), bh
    assert c.stats() == r.stats()
    assert c._verify() == 0


def test_agreeing_engines_share_one_entry_per_block():
    """Three endpoints store a chain under the same engine hashes: each maps them (resolve),
    the blocks are found, and removing one endpoint's mappings leaves the others'."""
    c, r = C.Index(), R.Index()
    ehs, bhs = [11, 12, 13], [101, 102, 103]
    for ep in (0, 1, 2):
        both(c, r, "store", ep, 0, ehs, bhs)
    check(c, r, [0, 1, 2], ehs, bhs)
    assert c.stats()["engine_mappings"] == 9
    both(c, r, "remove", 1, ehs)
    check(c, r, [0, 1, 2], ehs, bhs)
    assert c.resolve(1, 11) is None and c.resolve(0, 11) == 101
    both(c, r, "remove", 0, ehs)
    both(c, r, "remove", 2, ehs[:2])
    check(c, r, [0, 1, 2], ehs, bhs)
    both(c, r, "store", 1, 1, ehs, bhs)  # back, into an index where only block 103 is left
    check(c, r, [0, 1, 2], ehs, bhs)


def test_disagreeing_and_colliding_engine_hashes():
    """Endpoint 0 owns engine hash 7 for block 70; endpoint 1 maps 7 to another block (its own
    map), endpoint 2 maps block 70 under 8 (its own map), endpoint 3 agrees with 0; then the
    owner's block goes, and hash 7 passes to the next block stored under it."""
    c, r = C.Index(), R.Index()
    eps, ehs, bhs = [0, 1, 2, 3], [7, 8, 9], [70, 71, 72]
    both(c, r, "store", 0, 0, [7], [70])
    both(c, r, "store", 1, 0, [7], [71])  # 7 means another block to this engine
    both(c, r, "store", 2, 0, [8], [70])  # block 70 under another engine hash
    both(c, r, "store", 3, 0, [7], [70])  # agrees with endpoint 0
    both(c, r, "store", 1, 0, [7], [72])  # conflicts with its own mapping of 7
    both(c, r, "store", 3, 0, [7], [71])  # conflicts with its canonical mapping of 7
    check(c, r, eps, ehs, bhs)
    assert c.stats()["conflicting_stores"] == 2
    both(c, r, "remove", 0, [7])
    both(c, r, "remove", 3, [7])  # block 70 is now held by endpoint 2 alone (under 8)
    check(c, r, eps, ehs, bhs)
    both(c, r, "store", 0, 0, [7], [70])  # block 70 lives on: 7 is still its canonical hash
    check(c, r, eps, ehs, bhs)
    both(c, r, "remove", 0, [7])
    both(c, r, "remove", 2, [8])  # block 70 is freed, and with it its ownership of 7
    check(c, r, eps, ehs, bhs)
    both(c, r, "store", 2, 1, [7], [72])  # a new owner of 7
    both(c, r, "store", 3, 1, [7], [72])
    check(c, r, eps, ehs, bhs)
    assert c.resolve(1, 7) == 71 and c.resolve(2, 7) == 72 and c.resolve(3, 7) == 72


def test_canonical_mapping_leaves_while_further_mappings_stay():
    """An endpoint maps a block under its canonical engine hash and two further ones (side
    refcounts); the canonical mapping leaves first, then comes back (now a further mapping in
    the endpoint's own map), tiers move, and everything unwinds in another order."""
    c, r = C.Index(), R.Index()
    eps, ehs, bhs = [0, 1], [5, 6, 7], [50]
    both(c, r, "store", 1, 0, [5], [50])  # endpoint 1 holds 50 canonically too
    both(c, r, "store", 0, 0, [5, 5], [50, 50])
    both(c, r, "store", 0, 1, [6], [50])
    both(c, r, "store", 0, 2, [7, 7, 7], [50, 50, 50])
    check(c, r, eps, ehs, bhs)
    both(c, r, "remove", 0, [5])  # one of its two refs
    check(c, r, eps, ehs, bhs)
    assert c.resolve(0, 5) == 50
    both(c, r, "remove", 0, [5])  # the last: the canonical mapping goes, the holder stays
    check(c, r, eps, ehs, bhs)
    assert c.resolve(0, 5) is None and c.resolve(0, 6) == 50
    both(c, r, "store", 0, 1, [5], [50])  # back, as a further mapping
    both(c, r, "move", 0, [5, 6], 1, 2)
    check(c, r, eps, ehs, bhs)
    both(c, r, "remove", 0, [7], 2)
    both(c, r, "remove", 0, [6])
    check(c, r, eps, ehs, bhs)
    both(c, r, "remove", 0, [5, 7, 7])
    check(c, r, eps, ehs, bhs)
    assert 50 not in c.holdings(0) and c.resolve(1, 5) == 50


def test_move_of_a_canonical_mapping_keeps_it_exact():
    """Moves between tiers drop and re-add a mapping: a canonical one stays canonical (or
    becomes a further mapping when the endpoint's other mappings keep the holder)."""
    c, r = C.Index(), R.Index()
    eps, ehs, bhs = [0, 1], [1, 2, 3], [10, 20, 30]
    both(c, r, "store", 0, 0, [1, 2, 3], bhs)
    both(c, r, "store", 1, 0, [1, 2, 3], bhs)
    both(c, r, "store", 0, 1, [9], [20])  # a further mapping of endpoint 0 to block 20
    for frm, to in ((0, 1), (1, 2), (2, 0), (0, 2)):
        both(c, r, "move", 0, [1, 2, 3], frm, to)
        check(c, r, eps, ehs + [9], bhs)
    both(c, r, "remove", 0, [9])
    both(c, r, "move", 0, [2], 2, 1)
    check(c, r, eps, ehs + [9], bhs)


@pytest.mark.parametrize("bounded", [0, 40])
def test_clear_and_holdings_of_one_endpoint_among_many(bounded):
    """Eight endpoints hold a shared chain (most agreeing, two with their own engine hashes,
    one with both kinds on one block) and chains of their own; clearing each in turn removes
    exactly its holdings and mappings, the others' stay, and a cleared endpoint stores again."""
    rng = np.random.default_rng(3)
    c, r = C.Index(bounded), R.Index(bounded)
    eps = list(range(8))
    shared = [1000 + i for i in range(12)]
    ehs_all: set[int] = set()
    blocks: set[int] = set(shared)
    for ep in eps:
        ehs = (
            [2000 + i for i in range(12)] if ep not in (3, 5) else [ep * 100 + i for i in range(12)]
        )
        both(c, r, "store", ep, int(rng.integers(3)), ehs, shared)
        own = [5000 + ep * 10 + i for i in range(3)]
        both(c, r, "store", ep, 0, [7000 + ep * 10 + i for i in range(3)], own)
        ehs_all |= set(ehs) | {7000 + ep * 10 + i for i in range(3)}
        blocks |= set(own)
    both(c, r, "store", 6, 1, [6666], [shared[4]])  # endpoint 6: a further mapping too
    ehs_all.add(6666)
    check(c, r, eps, sorted(ehs_all), sorted(blocks))
    for ep in (0, 3, 6, 7, 1):
        both(c, r, "clear", ep)
        check(c, r, eps, sorted(ehs_all), sorted(blocks))
        assert c.holdings(ep) == {}
    both(c, r, "store", 0, 2, [2000 + i for i in range(12)], shared)
    both(c, r, "store", 3, 0, [300 + i for i in range(12)], shared)
    check(c, r, eps, sorted(ehs_all), sorted(blocks))
    for ep in eps:
        both(c, r, "clear", ep)
    check(c, r, eps, sorted(ehs_all), sorted(blocks))
    assert c.stats()["blocks"] == 0 and c.stats()["engine_mappings"] == 0


@pytest.mark.parametrize("bounded", [0, 5000])
@pytest.mark.parametrize("mode", ["agree", "disagree"])
def test_clear_of_a_large_and_a_small_endpoint_keeps_both_tables_exact(mode, bounded):
    """`clear` of an endpoint holding a sixteenth of the blocks or more drops its blocks without
    the block table's and canonical map's per-block deletions and refills both tables once; a
    smaller one deletes block by block. 24 endpoints, endpoint 0 holding ~40 % of ~2,500 blocks
    (the bulk path), the others ~3 % each (block by block), with blocks shared between them:
    after each clear every engine mapping resolves, every block answers a query, and the
    survivors' blocks are found again by later stores (through the refilled tables)."""
    rng = np.random.default_rng(17)
    c, r = C.Index(bounded), R.Index(bounded)
    eps = list(range(24))

    def eh_of(ep: int, bh: int) -> int:
        return bh * 3 + 1 if mode == "agree" else (bh * 3 + 1) ^ (ep + 1) << 40

    chains = {ep: [] for ep in eps}
    next_bh = 1
    for _ in range(160):
        ep = 0 if rng.random() < 0.4 else int(rng.integers(1, 24))
        n = int(rng.integers(4, 24))
        prefix = chains[int(rng.integers(24))][: int(rng.integers(0, 8))]
        bhs = prefix + list(range(next_bh, next_bh + n))
        next_bh += n
        chains[ep] = bhs
        both(c, r, "store", ep, int(rng.integers(3)), [eh_of(ep, b) for b in bhs], bhs)
    blocks = list(range(1, next_bh))
    ehs = sorted({eh_of(ep, b) for ep in eps for b in blocks[::7]})
    assert len(c.holdings(0)) * 16 >= c.stats()["blocks"]  # endpoint 0 takes the bulk path
    assert len(c.holdings(5)) * 16 < c.stats()["blocks"]  # endpoint 5 the per-block one
    check(c, r, eps, ehs, blocks[::7])
    for ep in (0, 5, 9):
        both(c, r, "clear", ep)
        check(c, r, eps, ehs, blocks[::7])
        for bh in blocks:
            assert c.query([bh]).matched() == r.query([bh]).matched(), bh
        # the others store their chains again: found through the refilled tables (duplicates)
        for other in (1, 2, 3):
            bhs = chains[other]
            both(c, r, "store", other, 0, [eh_of(other, b) for b in bhs], bhs)
        both(c, r, "store", ep, 1, [eh_of(ep, b) for b in chains[ep]], chains[ep])
        check(c, r, eps, ehs, blocks[::7])


def test_eviction_drops_canonical_and_own_mappings():
    """A bounded index evicts whole blocks: their canonical mappings (holder flags), further
    mappings and own-map mappings all go, and ownership of the engine hashes with them."""
    c, r = C.Index(30), R.Index(30)
    eps = [0, 1, 2]
    ehs_all: set[int] = set()
    blocks: set[int] = set()
    for step in range(40):
        bhs = [step * 10 + i for i in range(4)]
        for ep in eps:
            ehs = (
                [step * 10 + i for i in range(4)]
                if ep != 2
                else [90_000 + step * 10 + i for i in range(4)]
            )
            both(c, r, "store", ep, step % 3, ehs, bhs)
            ehs_all |= set(ehs)
        if step % 4 == 0:
            both(c, r, "store", 1, 0, [80_000 + step], [bhs[0]])  # a further mapping
            ehs_all.add(80_000 + step)
        blocks |= set(bhs)
        check(c, r, eps, sorted(ehs_all), sorted(blocks))
    assert c.stats()["evicted_blocks"] > 0


@pytest.mark.parametrize("bounded", [0, 25])
@pytest.mark.parametrize("mode", ["agree", "disagree", "collide"])
def test_random_operations_against_the_reference(mode, bounded):
    """Random stores, removes, moves and clears over 6 endpoints and 10 blocks: engine hashes
    that agree (one per block), disagree (one per endpoint and block) or collide (5 engine
    hashes for 10 blocks, so the same hash means different blocks to different endpoints)."""
    rng = np.random.default_rng(hash((mode, bounded)) % 2**32)
    c, r = C.Index(bounded), R.Index(bounded)
    eps, blocks = list(range(6)), [100 + b for b in range(10)]

    def eh_of(ep: int, b: int) -> int:
        if mode == "agree":
            return 1 + b
        if mode == "disagree":
            return 1 + b + 100 * ep
        return 1 + int(rng.integers(5))

    universe = sorted({1 + b + 100 * ep for ep in eps for b in range(10)} | set(range(1, 11)))
    for step in range(600):
        ep, op = int(rng.choice(eps)), rng.random()
        k = int(rng.integers(1, 5))
        picks = [int(x) for x in rng.integers(10, size=k)]
        ehs = [eh_of(ep, b) for b in picks]
        tier = int(rng.integers(3))
        if op < 0.5:
            both(c, r, "store", ep, tier, ehs, [blocks[b] for b in picks])
        elif op < 0.75:
            both(c, r, "remove", ep, ehs, tier if rng.random() < 0.5 else None)
        elif op < 0.93:
            both(c, r, "move", ep, ehs, tier, int(rng.integers(3)))
        else:
            both(c, r, "clear", ep)
        if step % 5 == 0:
            check(c, r, eps, universe, blocks)
    check(c, r, eps, universe, blocks)


def test_canonical_map_across_every_resize_point_with_removals():
    """Blocks owned by a first endpoint and mapped canonically by a second pass every resize
    point of the canonical map up to ~3,000 entries, beside blocks a third endpoint stores
    under engine hashes other blocks own (records that own nothing, which a rehash must leave
    out); after each, a third of the blocks are removed by both (their entries deleted,
    clusters shifted back) and a few by one only (the entry stays for the other); every
    mapping resolves and every block answers throughout."""
    rng = np.random.default_rng(9)
    c, r = C.Index(), R.Index()
    points = set(resize_points(3000))
    live: dict[int, int] = {}  # engine hash -> block, held by endpoints 0 and 1
    only1: dict[int, int] = {}  # held by endpoint 1 alone
    other2: dict[int, int] = {}  # endpoint 2: another block under an owned engine hash
    next_eh = 1

    def check_live() -> None:
        for eh, bh in live.items():
            assert c.resolve(0, eh) == bh and c.resolve(1, eh) == bh, eh
        for eh, bh in only1.items():
            assert c.resolve(0, eh) is None and c.resolve(1, eh) == bh, eh
        for eh, bh in other2.items():
            assert c.resolve(2, eh) == bh, eh
        assert c.query(list(live.values())[:1]).scores().get(1, 0) == min(1, len(live))
        cs, rs = c.stats(), r.stats()
        for k in ("blocks", "entries", "engine_mappings", "removed_blocks"):
            assert cs[k] == rs[k], k
        assert c._verify() == 0

    for n in range(1, 3001):
        eh, bh = next_eh, int(rng.integers(1, 2**63))
        next_eh += 1
        both(c, r, "store", 0, 0, [eh], [bh])
        both(c, r, "store", 1, 0, [eh], [bh])
        live[eh] = bh
        if n % 5 == 0:  # a block whose engine hash another owns: a record owning nothing
            both(c, r, "store", 2, 0, [eh], [bh ^ 1])
            other2[eh] = bh ^ 1
        if n in points or n in {p + 1 for p in points}:
            check_live()
            gone = [e for e in live if rng.random() < 0.33]
            both(c, r, "remove", 0, gone)
            half = gone[: len(gone) // 8]
            both(c, r, "remove", 1, gone[len(gone) // 8 :])
            for e in gone:
                bh_gone = live.pop(e)
                if e in half:
                    only1[e] = bh_gone
            gone2 = [e for e in other2 if rng.random() < 0.2]
            both(c, r, "remove", 2, gone2)
            for e in gone2:
                del other2[e]
            check_live()
    check_live()
    for e in sorted(live):  # every block of this index answers a query alone
        assert c.query([live[e]]).scores() == {0: 1, 1: 1}


def test_agreeing_engines_cost_no_mapping_slot_per_holder():
    """What the canonical map is for: 64 endpoints storing the same 1,000-block chain under the
    same engine hashes add their holders (8 bytes each in the blocks' holder arrays) and no
    engine-map slot per holder; the first endpoint's stores paid one 5-byte slot per block.
    Under their own engine hashes (engines that disagree), each endpoint's map grows instead."""
    n, eps = 1000, 64
    ehs, bhs = list(range(1, n + 1)), list(range(10**6, 10**6 + n))

    def grown(disagree: bool) -> int:
        idx = C.Index()
        for ep in range(eps):  # query scratch for every endpoint first
            idx.store(ep, 0, [10**7 + ep], [10**8 + ep])
        idx.store(0, 0, ehs, bhs)
        before = idx.memory_bytes()
        for ep in range(1, eps):
            idx.store(ep, 0, [e + (10**5 * ep if disagree else 0) for e in ehs], bhs)
        assert idx.stats()["engine_mappings"] == eps * (n + 1)
        return idx.memory_bytes() - before

    cap = 2
    while cap < eps:
        cap = cap * 2 if cap < 16 else (cap + cap // 4 + 1) & ~1
    holders = n * (24 + cap * 8)  # one holder array per block (header + compact holders)
    ext_ids = 4 * 1024 * (8 + 4)  # the holder arrays' id table (doubling from 16)
    agree = grown(False)
    assert holders <= agree <= holders + ext_ids, agree
    assert grown(True) >= agree + (eps - 1) * n * 12  # a 12-byte own-map slot per mapping
