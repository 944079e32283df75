"""The 16-token block reader of Python token lists (``seq_hashes`` / ``hash_blocks`` from a list
or tuple): whatever sits at whatever position, it gives exactly the answer, or the error, of the
generic conversion (which a list subclass takes: it never enters the direct reader).

The reader checks each item's type, folds the size words of a block into an or and an and, and
builds token pairs from the digits; a block it turns down is read again by the exact reader (zeros,
two-digit ints) or sends the call to the generic path (anything not an int in [0, 2**32))."""

from __future__ import annotations

import ctypes
import enum
import sys

import numpy as np
import pytest

from kvplug.core import load_backend

C = load_backend("c")
BS = 16


class GenericList(list):
    """A list the direct readers do not take (they want exactly list or tuple): the oracle."""


class Tok(enum.IntEnum):
    A = 42


class IntSub(int):
    pass


# what an item may be: valid tokens the block reader turns down (zero, two-digit ints), values
# out of range, ints that are not exact ints, and non-ints whose memory looks like a one-digit
# int's where an int keeps its size word (a one-character str's length, a one-item list's size)
ITEMS = [
    0,
    1,
    2**30 - 1,
    2**30,
    2**32 - 1,
    2**32,
    2**64,
    2**100,
    -1,
    -(2**40),
    True,
    False,
    Tok.A,
    IntSub(5),
    1.0,
    None,
    "x",
    [7],
    np.int64(3),
]


def _outcome(fn, *args):
    """(result as a list, or the exception's class and text)."""
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - compared whole
        return type(exc), str(exc)
    if isinstance(out, tuple):
        return [None if a is None else a.tolist() for a in out]
    return out.tolist()


def _check_like_generic(toks: list) -> None:
    want_seq = _outcome(C.seq_hashes, GenericList(toks), BS)
    want_both = _outcome(C.hash_blocks, GenericList(toks), BS)
    for form in (toks, tuple(toks)):
        assert _outcome(C.seq_hashes, form, BS) == want_seq, form
        assert _outcome(C.hash_blocks, form, BS) == want_both, form
        assert _outcome(C.seq_hashes, form, BS, 5) == _outcome(
            C.seq_hashes, GenericList(toks), BS, 5
        )


def _base(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 2**30, n).tolist()


def test_every_item_kind_at_every_position_of_every_block_and_the_tail():
    """4 full blocks and a 5-token tail: each kind of item at each position (both halves of a
    pair, every block boundary, the tail) gives the generic path's hashes or error."""
    base = _base(4 * BS + 5, 1)
    for pos in range(len(base)):
        for item in ITEMS:
            toks = list(base)
            toks[pos] = item
            _check_like_generic(toks)


@pytest.mark.parametrize("n", [*range(0, 2 * BS + 2), 5 * BS - 1, 5 * BS])
def test_lists_of_every_short_length_hash_like_arrays(n):
    """Shorter than a block, one block, a block and a tail, several blocks: the list answer is
    the array answer (and the generic one), local hashes included."""
    toks = _base(n, n)
    want = C.hash_blocks(np.array(toks, np.uint32), BS)
    for form in (toks, tuple(toks)):
        lo, seq = C.hash_blocks(form, BS)
        assert lo.tolist() == want[0].tolist() and seq.tolist() == want[1].tolist()
        assert C.seq_hashes(form, BS).tolist() == want[1].tolist()
    _check_like_generic(toks)


def test_two_bad_items_name_the_first_and_every_block_may_fall_back():
    base = _base(6 * BS, 2)
    toks = list(base)
    toks[BS + 3], toks[3 * BS + 1] = 2**32, "x"
    _check_like_generic(toks)
    # every block turned down by the block reader (a zero or a two-digit int in each), read by
    # the exact reader: still the array's hashes
    toks = list(base)
    for b in range(6):
        toks[b * BS + b] = 0 if b % 2 else 2**31 + b
    want = C.hash_blocks(np.array(toks, np.uint32), BS)
    lo, seq = C.hash_blocks(toks, BS)
    assert lo.tolist() == want[0].tolist() and seq.tolist() == want[1].tolist()
    assert C.seq_hashes(toks, BS).tolist() == want[1].tolist()


def _poke_zero(obj: int) -> int:
    """Make a heap int read as 0 by its size word while its first digit keeps the old value (a
    zero CPython's own arithmetic could leave unnormalised); returns the old size word."""
    addr = id(obj) + 16  # ob_size (3.11) / lv_tag (3.12+), right after refcount and type
    old = ctypes.c_ssize_t.from_address(addr).value
    ctypes.c_ssize_t.from_address(addr).value = 0 if sys.version_info < (3, 12) else 1
    return old


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's int layout")
def test_a_zero_with_a_stale_digit_reads_as_zero():
    """The block check needs every size word to be exactly one digit's: a zero whose digit
    memory still holds a value must hash as 0, not as that value."""
    stale = int("123457")  # a heap int of one digit, not a cached small int
    assert stale == 123457
    old = _poke_zero(stale)
    try:
        assert stale == 0
        base = _base(2 * BS, 3)
        for pos in (0, 1, 7, BS + 14, BS + 15):
            toks = list(base)
            toks[pos] = stale
            zeros = list(base)
            zeros[pos] = 0
            want = C.hash_blocks(np.array(zeros, np.uint32), BS)
            lo, seq = C.hash_blocks(toks, BS)
            assert lo.tolist() == want[0].tolist() and seq.tolist() == want[1].tolist()
            assert C.seq_hashes(toks, BS).tolist() == want[1].tolist()
    finally:
        ctypes.c_ssize_t.from_address(id(stale) + 16).value = old
    assert stale == 123457
