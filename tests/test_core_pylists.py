"""Python lists into the core: the binding's direct int readers must give exactly the answers
(and errors) of the generic conversions, and ``QueryResult.scores()`` the per-endpoint scores."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from kvplug.core import load_backend
from kvplug.errors import InvalidArgument, InvalidTokens

C = load_backend("c")

# one- and two-digit ints of CPython's 30-bit digits, and the u32 edges
TOKEN_EDGES = [0, 1, 255, 256, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 7, 123_456]
# u64 hashes of one, two and three digits, and the u64 edges
HASH_EDGES = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1, 987_654_321]


class Tok(enum.IntEnum):
    A = 42


@pytest.fixture(params=["c", "reference"])
def be(request):
    return load_backend(request.param)


def test_scores_are_local_blocks_of_matched_endpoints(be):
    idx = be.Index()
    idx.store(0, 0, [1, 2, 3], [10, 20, 30])
    idx.store(1, 0, [4, 5], [10, 20])
    idx.store(2, 1, [6], [10])  # host tier counts as local
    idx.store(3, 0, [7], [99])  # holds nothing of the query
    res = idx.query([10, 20, 30, 40])
    assert res.scores() == {0: 3, 1: 2, 2: 1}
    assert res.scores() == {ep: row[0] for ep, row in res.matched().items()}
    assert idx.query([55]).scores() == {}


def test_scores_follow_the_latest_query():
    idx = C.Index()
    out = C.QueryResult()
    idx.store(0, 0, [1, 2], [10, 20])
    idx.store(5, 0, [3], [10])
    assert idx.query([10, 20], out).scores() == {0: 2, 5: 1}
    assert idx.query([77], out).scores() == {}  # reused buffer: nothing left from before
    assert idx.query(np.array([10], np.uint64), out).scores() == {0: 1, 5: 1}


def test_scores_past_the_shared_small_ints(be):
    """scores() reuses int objects for ids and counts below 4,096: the answer must not depend
    on which side of that edge an id or a count falls."""
    idx = be.Index()
    chain = list(range(1, 5002))  # a 5,001-block prefix: counts past the edge
    eps = [0, 255, 256, 4095, 4096, 4097, 70_000]
    for k, ep in enumerate(eps):
        n = [5001, 4096, 4095, 4097, 3, 1, 4100][k]
        idx.store(ep, 0, [h + 10**6 * k for h in chain[:n]], chain[:n])
    want = {0: 5001, 255: 4096, 256: 4095, 4095: 4097, 4096: 3, 4097: 1, 70_000: 4100}
    got = idx.query(chain).scores()
    assert got == want
    assert all(type(k) is int and type(v) is int for k, v in got.items())
    assert got == {ep: row[0] for ep, row in idx.query(chain).matched().items()}


@pytest.mark.parametrize("n", [0, 16, 17, 480, 8192])
def test_token_lists_hash_like_arrays(n):
    rng = np.random.default_rng(n)
    toks = rng.integers(0, 2**32, n, dtype=np.uint64)
    toks[: min(n, len(TOKEN_EDGES))] = TOKEN_EDGES[: min(n, len(TOKEN_EDGES))]
    want = C.hash_blocks(toks.astype(np.uint32), 16)
    for form in (toks.tolist(), tuple(toks.tolist())):
        got = C.hash_blocks(form, 16)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert C.local_hash(toks[:16].tolist()) == C.local_hash(toks[:16].astype(np.uint32))


@pytest.mark.parametrize("bs", [1, 2, 3, 15, 16, 17, 64, 256, 257])
@pytest.mark.parametrize("n_blocks", [0, 1, 3, 30])
def test_token_lists_hash_block_by_block_like_arrays(bs, n_blocks):
    """Lists of tokens are read and hashed block by block (16-token blocks in registers, others
    through a buffer, over 256 the generic path): every block size, with a tail after the last
    full block, one- and two-digit ints and zeros anywhere, gives the array answer."""
    rng = np.random.default_rng(bs * 100 + n_blocks)
    n = n_blocks * bs + bs // 2
    toks = rng.integers(0, 128_000, n, dtype=np.uint64)
    if n:
        toks[rng.integers(0, n, min(n, 8))] = rng.choice(TOKEN_EDGES, min(n, 8))
    want = C.hash_blocks(toks.astype(np.uint32), bs)
    ref = load_backend("reference").hash_blocks(toks.tolist(), bs)
    for form in (toks.tolist(), tuple(toks.tolist())):
        lo, seq = C.hash_blocks(form, bs)
        assert lo.tolist() == want[0].tolist() == list(ref[0])
        assert seq.tolist() == want[1].tolist() == list(ref[1])
        none, seq_only = C.hash_blocks(form, bs, 7, with_local=False)
        assert none is None
        assert seq_only.tolist() == C.hash_blocks(toks.astype(np.uint32), bs, 7)[1].tolist()


@pytest.mark.parametrize("where", ["first block", "last block", "tail"])
def test_bad_tokens_in_any_block_of_a_list_are_named(where):
    """A bad token found while hashing block by block still raises the generic path's error
    (its position), wherever it is: no partial answer comes back."""
    toks = list(range(1000, 1000 + 16 * 4 + 5))
    pos = {"first block": 3, "last block": 16 * 3 + 2, "tail": 16 * 4 + 1}[where]
    for bad in (-1, 2**32, "x"):
        toks_bad = list(toks)
        toks_bad[pos] = bad
        with pytest.raises(InvalidTokens, match=f"position {pos}"):
            C.hash_blocks(toks_bad, 16)
        with pytest.raises(InvalidTokens, match=f"position {pos}"):
            C.hash_blocks(tuple(toks_bad), 16, with_local=False)


def test_token_lists_with_bools_and_int_subclasses_take_the_general_path():
    plain = [1, 42, 0, 5] * 4
    odd = [True, Tok.A, False, 5] * 4
    assert C.hash_blocks(odd, 16)[1].tolist() == C.hash_blocks(plain, 16)[1].tolist()


@pytest.mark.parametrize(
    ("tokens", "pos"),
    [([1, 2, -1], 2), ([2**32], 0), ([0] * 20 + [2**40], 20), ([3, -(2**31)], 1)],
)
def test_bad_token_lists_still_name_the_position(tokens, pos):
    with pytest.raises(InvalidTokens, match=f"position {pos}"):
        C.hash_blocks(tokens, 4)
    with pytest.raises(InvalidTokens, match=f"position {pos}"):
        C.hash_blocks(tuple(tokens), 4)


def test_non_int_token_lists_raise():
    with pytest.raises(InvalidTokens, match="position 1"):
        C.hash_blocks([1, "x", 3], 1)
    with pytest.raises(InvalidTokens):
        C.hash_blocks([1, 2.0], 1)


def test_store_tokens_from_lists_like_arrays():
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 2**32, 64, dtype=np.uint64)
    toks[:10] = TOKEN_EDGES
    a, b = C.Index(), C.Index()
    a.store_tokens(0, 0, None, [1, 2, 3, 4], toks.tolist(), 16)
    b.store_tokens(0, 0, None, np.array([1, 2, 3, 4], np.uint64), toks.astype(np.uint32), 16)
    assert a.holdings(0) == b.holdings(0)
    blocks, failures = a.store_tokens_many(
        [(1, 0, None, [9], toks[:16].tolist(), 0, None), (1, 0, 9, [10], [1, -1] * 8, 0, None)],
        16,
    )
    assert blocks == 1 and len(failures) == 1
    assert isinstance(failures[0][1], InvalidTokens) and "position 1" in str(failures[0][1])


def test_hash_lists_into_store_and_query_like_arrays():
    edges = HASH_EDGES
    a, b = C.Index(), C.Index()
    a.store(0, 0, list(range(1, len(edges) + 1)), edges)
    b.store(0, 0, np.arange(1, len(edges) + 1, dtype=np.uint64), np.array(edges, np.uint64))
    assert a.holdings(0) == b.holdings(0)
    assert a.query(edges).scores() == {0: len(edges)}
    assert a.query(tuple(edges)).scores() == {0: len(edges)}


def test_hash_lists_outside_u64_fold_like_before():
    """Negative and > 64-bit ints are folded modulo 2**64 (the generic path), bools read as 0/1."""
    idx = C.Index()
    idx.store(0, 0, [1, 2, 3], [2**64 - 5, 7 + 2**64, 1])
    assert idx.query([-5, 7, True]).scores() == {0: 3}
    assert idx.query(np.array([2**64 - 5, 7, 1], np.uint64)).scores() == {0: 3}


@pytest.mark.parametrize("n", [1, 127, 128, 129, 511, 512, 513])
def test_hash_lists_of_any_length_store_and_query_like_arrays(n):
    """Short hash lists are read into a buffer on the stack (store: up to 128, query: up to
    512), longer ones through an array: either way the answers are the arrays'."""
    rng = np.random.default_rng(n)
    hs = rng.integers(0, 2**64, n, dtype=np.uint64)
    hs[: min(n, len(HASH_EDGES))] = HASH_EDGES[: min(n, len(HASH_EDGES))]
    ehs = np.arange(1, n + 1, dtype=np.uint64)
    a, b = C.Index(), C.Index()
    a.store(3, 0, ehs.tolist(), hs.tolist())
    b.store(3, 0, ehs, hs)
    assert a.holdings(3) == b.holdings(3)
    assert a.query(hs.tolist()).scores() == b.query(hs).scores() == {3: n}
    assert a.query(tuple(hs[: n // 2].tolist())).scores() == ({3: n // 2} if n // 2 else {})


def test_hash_lists_that_fail_the_direct_read_keep_their_errors():
    idx = C.Index()
    with pytest.raises(InvalidArgument, match="2 engine hashes but 3 block hashes"):
        idx.store(0, 0, [1, 2], [1, 2, 3])
    with pytest.raises(InvalidArgument, match=r"block_hashes\[1\] must be an integer"):
        idx.store(0, 0, [1, 2], [1, "x"])
    with pytest.raises(InvalidArgument, match=r"block_hashes\[0\] must be an integer"):
        idx.query([None])
    assert idx.stats()["stored_blocks"] == 0


# ---- a query's list read only as far as its walk goes (Index._query_items) ------------------
def _answer(res, cap):
    rows = {ep: res.row(ep) for ep in range(cap)}
    return rows, res.walked, res.shared_prefix, res.scores()


@pytest.mark.parametrize("n", [1, 63, 64, 65, 191, 192, 193, 500, 2000, 3000])
@pytest.mark.parametrize("kind", [list, tuple])
def test_list_queries_in_pieces_answer_like_arrays(n, kind):
    """A list is fed to the walk in pieces of 64, 128, 256, ... (1,024 and up without the GIL):
    every answer, at every piece boundary, is the array's, with endpoints dropping out at
    random depths, a shared tier and a reused result."""
    rng = np.random.default_rng(n)
    chain = rng.integers(0, 2**64, n, dtype=np.uint64)
    idx = C.Index()
    for ep in range(6):
        depth = int(rng.integers(0, n + 1)) if ep else n
        if depth:
            tier = ep % 3
            idx.store(ep, tier, np.arange(1, depth + 1, dtype=np.uint64) + 1000 * ep, chain[:depth])
    shared_depth = int(rng.integers(0, n + 1))
    if shared_depth:
        idx.store(
            0xFFFFFFFF, 1, np.arange(1, shared_depth + 1, dtype=np.uint64), chain[:shared_depth]
        )
    out_list, out_arr = C.QueryResult(), C.QueryResult()
    for cut in sorted({n, n // 2, max(1, n - 1)}):
        q = chain[:cut]
        got = _answer(idx.query(kind(q.tolist()), out_list), 8)
        want = _answer(idx.query(q, out_arr), 8)
        assert got == want
    miss = chain.copy()
    miss[n // 3] ^= np.uint64(1)  # every holder stops there
    assert _answer(idx.query(kind(miss.tolist()), out_list), 8) == _answer(
        idx.query(miss, out_arr), 8
    )


def test_list_items_past_the_walks_end_are_not_read(be):
    """Once no endpoint and no shared block continues the prefix, later items cannot change the
    answer: neither backend reads them (the reference walks item by item), so a bad one there
    raises nothing; inside the walk it raises as before, naming its position, and the index
    answers the next query as if nothing happened."""
    idx = be.Index()
    idx.store(0, 0, list(range(1, 101)), list(range(10, 110)))
    tail = ["x", None, -1.5]
    res = idx.query([*range(10, 80), 5, *tail])
    assert res.scores() == {0: 70}
    assert res.walked == 71
    far = [*range(10, 110), 7, *(["x"] * 300)]  # past the first pieces (64 + 128)
    assert idx.query(far).scores() == {0: 100}
    with pytest.raises(InvalidArgument, match=r"block_hashes\[70\] must be an integer"):
        idx.query([*range(10, 80), "x"])
    with pytest.raises(InvalidArgument, match=r"block_hashes\[99\] must be an integer"):
        idx.query([*range(10, 109), None])
    assert idx.query(list(range(10, 60))).scores() == {0: 50}


def test_list_pieces_that_fail_the_direct_read_convert_like_before():
    """A piece with bools, int subclasses, numpy ints or ints outside u64 takes the general
    conversion (folded modulo 2**64), wherever it falls in the list."""
    idx = C.Index()
    hs = list(range(10, 310))
    idx.store(0, 0, list(range(1, 301)), hs)
    for pos in (0, 63, 64, 200):
        for item in (hs[pos] + 2**64, np.uint64(hs[pos]), np.int64(hs[pos])):
            q = list(hs)
            q[pos] = item
            assert idx.query(q).scores() == {0: 300}
    flags = C.Index()
    flags.store(0, 0, [1, 2, 3], [0, 1, 42])
    assert flags.query([False, True, Tok.A, 5]).scores() == {0: 3}


# ---- seq_hashes: hash_blocks(...)[1] without the tuple, the local array and the keyword ------
def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - compared whole below
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("bs", [1, 3, 16, 17, 256, 257])
@pytest.mark.parametrize("n_blocks", [0, 1, 30])
def test_seq_hashes_are_hash_blocks_sequence_hashes(be, bs, n_blocks):
    """Every input form (the list fast path, tuples, arrays, block sizes past the fused limit),
    seeds and per-block extras: exactly hash_blocks' sequence hashes, on both backends."""
    rng = np.random.default_rng(bs * 1000 + n_blocks)
    n = n_blocks * bs + bs // 2
    toks = rng.integers(0, 128_000, n, dtype=np.uint64)
    if n:
        toks[rng.integers(0, n, min(n, 8))] = rng.choice(TOKEN_EDGES, min(n, 8))
    extra = rng.integers(0, 2**64, n_blocks, dtype=np.uint64).tolist()
    for form in (toks.tolist(), tuple(toks.tolist()), toks.astype(np.uint32)):
        for seed, ex in ((0, None), (2**64 - 3, None), (7, extra)):
            got = be.seq_hashes(form, bs, seed, ex)
            want = be.hash_blocks(form, bs, seed, ex)[1]
            assert list(got) == list(want)
            assert len(got) == n_blocks
            if be is C:
                assert isinstance(got, np.ndarray) and got.dtype == np.uint64


def test_seq_hashes_default_seed_and_positional_forms():
    toks = list(range(5000, 5000 + 16 * 5))
    assert C.seq_hashes(toks, 16).tolist() == C.hash_blocks(toks, 16)[1].tolist()
    assert C.seq_hashes(toks, 16, 0, None).tolist() == C.seq_hashes(toks, block_size=16).tolist()
    ref = load_backend("reference")
    assert C.seq_hashes(toks, 16).tolist() == ref.seq_hashes(toks, 16)


@pytest.mark.parametrize(
    ("tokens", "block_size", "seed", "extra"),
    [
        ([1, 2, -1], 4, 0, None),
        ([0] * 20 + [2**40], 4, 0, None),
        ([1, "x", 3], 1, 0, None),
        ([True, 2, 3, 4] * 4, 16, 0, None),  # bools: the general path, same hashes
        (list(range(32)), 0, 0, None),
        (list(range(32)), -16, 0, None),
        (list(range(32)), "16", 0, None),
        (list(range(32)), 16, "seed", None),
        (list(range(32)), 16, 0, [1]),  # extra shorter than the blocks
        (tuple(range(32)), 2**62, 0, None),
    ],
)
def test_seq_hashes_raise_what_hash_blocks_raises(tokens, block_size, seed, extra):
    """Bad tokens (named by position), block sizes, seeds and extras: the same exception class
    and text as hash_blocks, whichever path the call takes."""
    got = _error_of(C.seq_hashes, tokens, block_size, seed, extra)
    want = _error_of(C.hash_blocks, tokens, block_size, seed, extra)
    assert got == want
    if want is None:
        assert (
            C.seq_hashes(tokens, block_size, seed, extra).tolist()
            == C.hash_blocks(tokens, block_size, seed, extra)[1].tolist()
        )
    else:
        assert issubclass(want[0], (InvalidTokens, InvalidArgument))


# ---- seq_hashes reuses a result array only once nothing else holds it ------------------------
def test_seq_hashes_never_writes_a_result_someone_holds():
    a_toks, b_toks = list(range(100, 100 + 64)), list(range(900, 900 + 64))
    want_a, want_b = C.hash_blocks(a_toks, 16)[1].tolist(), C.hash_blocks(b_toks, 16)[1].tolist()
    held = C.seq_hashes(a_toks, 16)
    other = C.seq_hashes(b_toks, 16)  # same length while `held` is alive
    assert other is not held
    assert held.tolist() == want_a and other.tolist() == want_b
    view = held[1:]  # a view keeps its base alive
    del held
    again = C.seq_hashes(b_toks, 16)
    assert view.tolist() == want_a[1:]
    assert again.tolist() == want_b
    mv = memoryview(again)  # so does a buffer export
    del again
    assert C.seq_hashes(a_toks, 16).tolist() == want_a
    assert list(mv.cast("B").cast("Q")) == want_b


def test_seq_hashes_reuses_a_dropped_result_and_gives_a_fresh_one_after_in_place_changes():
    toks = list(range(5000, 5000 + 16 * 4))
    want = C.hash_blocks(toks, 16)[1].tolist()
    first = C.seq_hashes(toks, 16)
    first_id = id(first)
    del first
    reused = C.seq_hashes(toks, 16)
    assert id(reused) == first_id  # dropped by the caller: handed out again, not reallocated
    # a caller may change a result in place before dropping it: none of that comes back
    for change in ("readonly", "dtype", "shape"):
        if change == "readonly":
            reused.flags.writeable = False
        elif change == "dtype":
            reused.dtype = np.int64
        else:
            reused.shape = (2, 2)
        del reused
        reused = C.seq_hashes(toks, 16)
        assert reused.flags.writeable and reused.dtype == np.uint64 and reused.shape == (4,)
        assert reused.tolist() == want
        reused[0] = 1  # writeable: the caller owns it
        del reused
        reused = C.seq_hashes(toks, 16)
        assert reused.tolist() == want


def test_list_items_that_run_python_code_cannot_break_the_walk(be):
    """Items with their own ``__index__`` run Python code during the conversion: it runs
    outside the index's lock (so it may call the index itself) and before the walk reads the
    list (so clearing the list cannot make the walk read freed items); an exception it raises
    is the query's only if the walk reaches the item."""
    idx = be.Index()
    hs = list(range(10, 2010))
    idx.store(0, 0, list(range(1, 2001)), hs)

    class Reentrant:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            idx.stats()  # the same index, mid-query
            return self.value

    q = [Reentrant(hs[0]), *hs[1:]]
    assert idx.query(q).scores() == {0: 2000}

    class Clearing:
        def __index__(self):
            q.clear()
            return hs[0]

    q = [Clearing(), *hs[1:]]
    res = idx.query(q)  # what it answers depends on when the list emptied; it must not crash
    assert set(res.scores()) <= {0}

    class Refusing:
        def __index__(self):
            raise ValueError("no value")

    assert idx.query([*hs[:5], 3, Refusing()]).scores() == {0: 5}  # the walk ended at 3
    with pytest.raises(ValueError, match="no value"):
        idx.query([*hs[:5], Refusing()])
