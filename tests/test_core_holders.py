"""The C core's holder arrays at their boundaries (csrc/index.c): a block held by more than one
endpoint keeps its holders in an array of 8-byte compact holders (an 8-bit count per tier, 6
bits of mappings, a canonical-mapping flag), rewritten with 12-byte wide holders once a
holder's count in a tier would pass 255 or its mappings 63; arrays double from 2 up to 16
holders, then grow by a quarter (rounded down to even; `ext_grown_cap` in csrc/index.c).
Every state is compared with the pure-Python reference (holdings, queries, engine mappings,
counters), bounded (per-holder engine hashes, eviction) and not."""

from __future__ import annotations

import numpy as np
import pytest

from kvplug.core import load_backend

C = load_backend("c")
R = load_backend("reference")
BLOCKS = [77, 78, 79]  # a chain every holder stores, queried as a prefix
SHARED = C.SHARED


def both(c, r, method, *args):
    for idx in (c, r):
        getattr(idx, method)(*args)


def check(c, r, eps, ehs=(), query=True) -> None:
    """Equal holdings, engine mappings and counters; with `query`, equal answers for every
    prefix of BLOCKS (a query touches the blocks it walks: a bounded index keeps them)."""
    for ep in eps:
        assert c.holdings(ep) == r.holdings(ep), ep
    for n in range(1, (len(BLOCKS) + 1) if query else 1):
        assert c.query(BLOCKS[:n]).matched() == r.query(BLOCKS[:n]).matched(), n
    for ep, eh in ehs:
        assert c.resolve(ep, eh) == r.resolve(ep, eh), (ep, eh)
    assert c.stats() == r.stats()
    assert c._verify() == 0  # every table's invariants (csrc/index.c, kvp_index_verify)


def eh_of(ep: int, i: int) -> int:
    return 10_000 * (ep + 1) + i


def grown_cap(cap: int) -> int:
    """csrc/index.c's ext_grown_cap: double below 16 holders, then + 1/4, kept even."""
    return cap * 2 if cap < 16 else (cap + cap // 4 + 1) & ~1


def holder_cap(n: int) -> int:
    """The capacity of a holder array that has held n holders at most (first array: 2)."""
    cap = 2
    while cap < n:
        cap = grown_cap(cap)
    return cap


def ext_bytes(cap: int, wide: bool, bounded: bool) -> int:
    """A holder array's allocation: 24-byte header, then per holder 8 (compact) or 12 (wide)
    bytes, plus its engine hash (8) when the index is bounded."""
    return 24 + cap * ((12 if wide else 8) + (8 if bounded else 0))


def hold_chain(c, r, eps) -> None:
    for ep in eps:
        both(c, r, "store", ep, 0, [eh_of(ep, i) for i in range(3)], BLOCKS)


@pytest.mark.parametrize("n_holders", [2, 40])  # 40: the guessed-position search runs too
@pytest.mark.parametrize("tier", [0, 1, 2])
def test_count_past_255_widens_the_array_exactly_there(n_holders, tier):
    eps = [3 * k for k in range(n_holders)]
    c, r = C.Index(), R.Index()
    hold_chain(c, r, eps)
    ep = eps[n_holders // 2]
    eh = eh_of(ep, 1)  # its mapping to the middle block
    both(c, r, "move", ep, [eh], 0, tier)
    check(c, r, eps, [(ep, eh)])  # (its first query allocates the query scratch)
    mem = c.memory_bytes()
    for count in range(2, 256):  # the compact form holds 255: nothing is reallocated
        both(c, r, "store", ep, tier, [eh], [BLOCKS[1]])
        if count in (2, 254, 255):
            check(c, r, eps, [(ep, eh)])
        assert c.memory_bytes() == mem, count
    both(c, r, "store", ep, tier, [eh], [BLOCKS[1]])  # the 256th: rewritten wide
    assert c.memory_bytes() == mem + (12 - 8) * holder_cap(n_holders)
    assert c.holdings(ep)[BLOCKS[1]][tier] == 256
    check(c, r, eps, [(ep, eh)])
    for _ in range(44):
        both(c, r, "store", ep, tier, [eh], [BLOCKS[1]])
    check(c, r, eps, [(ep, eh)])
    # back down through 256, 255 and 1 (the array stays wide), then the holder leaves
    for left in (256, 255, 1, 0):
        now = c.holdings(ep)[BLOCKS[1]][tier]
        both(c, r, "remove", ep, [eh] * (now - left), tier)
        check(c, r, eps, [(ep, eh)])
    assert BLOCKS[1] not in c.holdings(ep)
    for e in eps:  # everyone leaves: nothing remains
        both(c, r, "clear", e)
    check(c, r, eps)
    assert c.stats()["blocks"] == 0 and c.stats()["entries"] == 0


def test_move_into_a_tier_at_255_widens_first():
    c, r = C.Index(), R.Index()
    eps = [0, 1, 2]
    hold_chain(c, r, eps)
    eh = eh_of(1, 0)
    both(c, r, "store", 1, 1, [eh] * 254, [BLOCKS[0]] * 254)  # tier 1: 254, tier 0: 1
    check(c, r, eps, [(1, eh)])
    both(c, r, "store", 1, 0, [eh], [BLOCKS[0]])  # tier 0: 2
    both(c, r, "move", 1, [eh], 0, 1)  # tier 1: 255 (compact still)
    check(c, r, eps, [(1, eh)])
    both(c, r, "move", 1, [eh], 0, 1)  # tier 1: 256 (wide)
    assert c.holdings(1)[BLOCKS[0]] == [0, 256, 0]
    check(c, r, eps, [(1, eh)])


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("n_maps", [63, 64, 65, 129])
def test_mappings_past_63_widen_and_unwind(n_maps, bounded):
    """One endpoint maps n_maps engine hashes to one shared block (the compact form keeps 63
    mappings); its first mapping, whose refs are the holder's counts less the others', leaves
    first (one ref in tier 0, while the others hold more there), then the rest in random
    order."""
    rng = np.random.default_rng(n_maps)
    c, r = (C.Index(10_000), R.Index(10_000)) if bounded else (C.Index(), R.Index())
    eps = [0, 5, 9]
    hold_chain(c, r, eps)
    ehs = [eh_of(5, 1)]
    for i in range(1, n_maps):
        eh = 900_000 + i
        both(c, r, "store", 5, i % 3, [eh], [BLOCKS[1]])
        ehs.append(eh)
        if len(ehs) >= 62:
            check(c, r, eps, [(5, e) for e in ehs])
    both(c, r, "remove", 5, [ehs[0]], 0)
    check(c, r, eps, [(5, e) for e in ehs])
    assert c.resolve(5, ehs[0]) is None
    both(c, r, "store", 5, 0, [ehs[0]], [BLOCKS[1]])  # back: a further mapping now
    check(c, r, eps, [(5, e) for e in ehs])
    for k, i in enumerate(rng.permutation(len(ehs))):
        eh = ehs[int(i)]
        both(c, r, "remove", 5, [eh])
        if k % 10 == 0 or k > len(ehs) - 4:
            check(c, r, eps, [(5, e) for e in ehs])
    check(c, r, eps, [(5, e) for e in ehs])
    assert BLOCKS[1] not in c.holdings(5)


@pytest.mark.parametrize("bounded", [False, True])
def test_holders_join_and_leave_in_any_order_compact_and_wide(bounded):
    """Holders join in random endpoint order (inserted at every position, the array doubling
    2 -> 4 -> ... -> 64), one holder then passes 255 (the array is rewritten wide, the engine
    hashes of a bounded index with it), more join (a wide array grows) and all leave in random
    order; checked against the reference all along."""
    rng = np.random.default_rng(11)
    c, r = (C.Index(100_000), R.Index(100_000)) if bounded else (C.Index(), R.Index())
    eps = [int(e) for e in rng.permutation(60)]
    first, later = eps[:37], eps[37:]
    for k, ep in enumerate(first):
        hold_chain(c, r, [ep])
        if k in (0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 36):
            check(c, r, first[: k + 1])
    wide_ep = first[20]
    both(c, r, "store", wide_ep, 0, [eh_of(wide_ep, 0)] * 300, [BLOCKS[0]] * 300)
    check(c, r, first, [(e, eh_of(e, 0)) for e in first])
    for k, ep in enumerate(later):
        hold_chain(c, r, [ep])
        if k % 5 == 0:
            check(c, r, first + later[: k + 1])
    for k, i in enumerate(rng.permutation(len(eps))):
        ep = eps[int(i)]
        both(c, r, "remove", ep, [eh_of(ep, j) for j in range(3)] * 2)
        both(c, r, "remove", ep, [eh_of(ep, 0)] * 400)
        if k % 4 == 0:
            check(c, r, eps, [(e, eh_of(e, j)) for e in eps for j in range(3)])
    check(c, r, eps)
    assert c.stats()["blocks"] == 0


def test_eviction_of_compact_and_wide_arrays():
    """A bounded index evicts blocks whose holders are compact, wide and inline: every mapping
    to an evicted block goes with it (the per-holder engine hashes follow the rewrite)."""
    c, r = C.Index(60), R.Index(60)
    eps = list(range(12))
    hold_chain(c, r, eps)  # 36 holdings
    both(c, r, "store", 4, 2, [eh_of(4, 2)] * 299, [BLOCKS[2]] * 299)  # BLOCKS[2] wide
    both(c, r, "store", 7, 0, [eh_of(7, 0)] * 9, [BLOCKS[0]] * 9)  # BLOCKS[0] stays compact
    both(c, r, "store", 3, 0, [600_000], [2_000])  # inline, and older than what follows
    every = [(e, eh_of(e, j)) for e in eps for j in range(3)] + [(3, 600_000)]
    check(c, r, eps, every, query=False)
    # 60 new blocks push the 37 old holdings out, least recently touched block first:
    # BLOCKS[1] (compact), BLOCKS[2] (wide), BLOCKS[0] (compact), then block 2,000 (inline)
    for k in range(60):
        both(c, r, "store", k % 12, 0, [500_000 + k], [1_000 + k])
        if k % 6 == 5:
            check(c, r, eps, every, query=False)
    assert c.stats()["evicted_blocks"] == 4
    assert all(c.resolve(e, eh) is None for e, eh in every)
    check(c, r, eps, every + [(k % 12, 500_000 + k) for k in range(60)])


@pytest.mark.parametrize("seed", range(4))
def test_random_counts_around_the_compact_limits(seed):
    """Random stores, removes and moves on a few shared blocks, with counts driven across 255
    and back, in both bounded and unbounded indexes."""
    rng = np.random.default_rng(seed)
    bounded = seed % 2 == 1
    c, r = (C.Index(5_000), R.Index(5_000)) if bounded else (C.Index(), R.Index())
    eps = [0, 1, 2, 7, 30]
    hold_chain(c, r, eps)
    for step in range(120):
        ep = eps[int(rng.integers(len(eps)))]
        j = int(rng.integers(3))
        eh, bh = eh_of(ep, j), BLOCKS[j]
        op = rng.random()
        tier = int(rng.integers(3))
        if op < 0.5:
            n = int(rng.choice([1, 50, 200, 255]))
            both(c, r, "store", ep, tier, [eh] * n, [bh] * n)
        elif op < 0.8:
            both(c, r, "remove", ep, [eh] * int(rng.integers(1, 300)), tier)
        else:
            both(c, r, "move", ep, [eh] * int(rng.integers(1, 100)), tier, int(rng.integers(3)))
        if step % 8 == 0:
            check(c, r, eps, [(e, eh_of(e, i)) for e in eps for i in range(3)])
    check(c, r, eps, [(e, eh_of(e, i)) for e in eps for i in range(3)])


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("bounded", [False, True])
def test_holder_arrays_grow_exactly_at_each_step_and_shrink_in_any_order(wide, bounded):
    """Up to 160 holders join a shared chain in random endpoint order (inserted at every
    position), so its arrays pass every growth step (2, 4, 8, 16, then by a quarter: 20, 26,
    32, 40, 50, 62, 78, 98, 122, 152, 190); one holder in six leaves again on the way. The
    index's memory grows by exactly three arrays' growth when, and only when, a join passes a
    step, and everything equals the reference at each step, one holder either side of it, and
    while all leave in random order; bounded, the chain is then evicted through its per-holder
    engine hashes (which move when a bounded array grows)."""
    rng = np.random.default_rng(5 + 2 * wide + bounded)
    bound = 800 if bounded else 0  # above the most holdings the joins reach (200 + 3 * 168)
    c, r = C.Index(bound), R.Index(bound)
    eps = [int(e) for e in rng.permutation(200)]
    for ep in eps:  # the query scratch exists first ...
        both(c, r, "store", ep, 0, [900_000 + ep], [50_000 + ep])
    # ... and every endpoint's own engine map: the chain's engine hashes differ per endpoint
    # (eh_of), so only its first holder's are canonical and the others' go to their own maps
    c.reserve(0, 3 * len(eps), endpoints=len(eps))
    hold_chain(c, r, eps[:2])
    if wide:  # a holder past 255 on each block: all three arrays are rewritten wide
        both(c, r, "store", eps[0], 1, [eh_of(eps[0], j) for j in range(3)] * 256, BLOCKS * 256)
    steps, cap = set(), 2
    while cap < 200:
        steps.add(cap)
        cap = grown_cap(cap)

    def leave(ep: int) -> None:  # every ref (eps[0] holds 257 in the wide case)
        both(c, r, "remove", ep, [eh_of(ep, j) for j in range(3)] * (257 if ep == eps[0] else 1))

    held, left, n_max = list(eps[:2]), [], 2  # n_max: most holders at once (arrays never shrink)
    check(c, r, eps)
    for k, ep in enumerate(eps[2:]):
        cap_before = holder_cap(n_max)
        mem = c.memory_bytes()
        hold_chain(c, r, [ep])
        held.append(ep)
        n_max = max(n_max, len(held))
        grew = 3 * (
            ext_bytes(holder_cap(n_max), wide, bounded) - ext_bytes(cap_before, wide, bounded)
        )
        assert c.memory_bytes() - mem == grew, (len(held), cap_before, n_max)
        if {len(held) - 1, len(held), len(held) + 1} & steps:
            check(c, r, eps, [(e, eh_of(e, j)) for e in held for j in range(3)])
        if k % 6 == 5:  # one in six leaves again
            out = held.pop(int(rng.integers(len(held))))
            leave(out)
            left.append(out)
    assert n_max > 152 and holder_cap(n_max) == 190
    check(c, r, eps, [(e, eh_of(e, j)) for e in held + left for j in range(3)])
    if bounded:  # new blocks push the chain out: every holder's mapping found by its eh_first
        for k in range(810):
            both(c, r, "store", eps[k % 200], 0, [700_000 + k], [60_000 + k])
        assert all(c.resolve(e, eh_of(e, 0)) is None for e in held)
        check(c, r, eps, [(e, eh_of(e, j)) for e in held for j in range(3)], query=False)
        return
    for k, i in enumerate(rng.permutation(len(held))):
        leave(held[int(i)])
        if k % 9 == 0 or k >= len(held) - 3:
            check(c, r, eps, [(e, eh_of(e, j)) for e in held for j in range(3)])
    assert all(b not in c.holdings(e) for e in eps for b in BLOCKS)


# Engines that agree on engine hashes (one PYTHONHASHSEED fleet-wide, the usual deployment) take
# the store's fast paths (csrc/index.c, store_fast): a new block, and a new holder joining a
# block several endpoints hold. These pin that state to the reference where it is subtle.


@pytest.mark.parametrize("bounded", [False, True])
def test_agreeing_engines_join_in_any_order_at_mixed_tiers(bounded):
    """40 endpoints store one chain under the same engine hashes, in random order, each at its
    own tier, queried as they join (the walk's cached holder equality must see every join)."""
    rng = np.random.default_rng(5)
    c, r = (C.Index(100_000), R.Index(100_000)) if bounded else (C.Index(), R.Index())
    eps = [int(e) for e in rng.permutation(40)]
    for k, ep in enumerate(eps):
        both(c, r, "store", ep, ep % 3, [500, 501, 502], BLOCKS)
        check(c, r, eps[: k + 1], [(e, 500 + j) for e in eps[: k + 1] for j in range(3)])
    for ep in eps[::3]:
        both(c, r, "remove", ep, [500, 501, 502])
    check(c, r, eps)


def test_a_join_invalidates_the_walks_cached_holder_equality():
    """Two chained blocks held by the same endpoints: a query caches that the second's holders
    equal the first's. A third endpoint then joins the first on the device tier and the second on
    the host tier: the holder counts match again, the tiers do not."""
    c, r = C.Index(), R.Index()
    for ep in (0, 1):
        both(c, r, "store", ep, 0, [500, 501], BLOCKS[:2])
    check(c, r, [0, 1])  # queries every prefix: the cache is set
    both(c, r, "store", 2, 0, [500], BLOCKS[:1])
    both(c, r, "store", 2, 1, [501], BLOCKS[1:2])
    check(c, r, [0, 1, 2])
    assert c.query(BLOCKS[:2]).row(2)[:4] == (2, 1, 1, 0)  # local, device, host, disk


def test_a_joining_holders_engine_hash_is_its_own_when_a_neighbour_disagrees():
    """Bounded: endpoint 2 holds a block under its own engine hash, endpoint 1 then joins it
    between endpoints 0 and 2 under the block's canonical one; endpoint 1 adds a second mapping
    and drops the first. Eviction must still find the second (endpoint 1's per-holder engine
    hash is its own, not its neighbour's)."""
    c, r = C.Index(8), R.Index(8)
    both(c, r, "store", 0, 0, [500], [77])  # owns 500: the canonical engine hash of block 77
    both(c, r, "store", 2, 0, [900], [77])  # disagrees: its own map
    both(c, r, "store", 1, 0, [500], [77])  # joins between them, canonically
    both(c, r, "store", 1, 0, [501], [77])  # a second mapping to the same block
    both(c, r, "remove", 1, [500])
    check(c, r, [0, 1, 2], [(0, 500), (1, 500), (1, 501), (2, 900)], query=False)
    for k in range(12):  # push block 77 out
        both(c, r, "store", 3, 0, [800_000 + k], [90_000 + k])
    assert c.resolve(1, 501) is None
    check(c, r, [0, 1, 2, 3], [(1, 501), (2, 900)], query=False)


@pytest.mark.parametrize("bounded", [False, True])
def test_agreeing_engines_join_a_wide_array_and_the_shared_tier(bounded):
    """Joins into a wide holder array (one holder past 255 refs) under the shared engine hashes,
    and the shared tier joining as a holder too, in any order; checked against the reference."""
    rng = np.random.default_rng(9)
    c, r = (C.Index(100_000), R.Index(100_000)) if bounded else (C.Index(), R.Index())
    eps = [int(e) for e in rng.permutation(24)]
    for ep in eps[:3]:
        both(c, r, "store", ep, 0, [500, 501, 502], BLOCKS)
    both(c, r, "store", eps[1], 0, [500] * 300, [BLOCKS[0]] * 300)  # BLOCKS[0]'s array wide
    both(c, r, "store", SHARED, 1, [500, 501], BLOCKS[:2])
    for k, ep in enumerate(eps[3:]):
        both(c, r, "store", ep, ep % 3, [500, 501, 502], BLOCKS)
        if k % 4 == 0:
            check(c, r, [*eps[: k + 4], SHARED], [(e, 500) for e in eps[: k + 4]])
    check(c, r, [*eps, SHARED], [(e, 500 + j) for e in eps for j in range(3)])
