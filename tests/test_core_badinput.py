"""Bad inputs raise named errors on both backends and never change the index."""

from __future__ import annotations

import numpy as np
import pytest

from kvplug.core import load_backend
from kvplug.errors import InvalidArgument, InvalidTokens, KvplugError

SHARED = 0xFFFFFFFF


@pytest.fixture(params=["c", "reference"])
def be(request):
    return load_backend(request.param)


@pytest.fixture
def idx(be):
    ix = be.Index()
    ix.store(0, 0, [1, 2], [10, 20])
    ix.store(SHARED, 1, [3], [10])
    return ix


def snapshot(ix):
    return ix.stats(), ix.holdings(0), ix.holdings(SHARED), ix.query([10, 20]).matched()


@pytest.mark.parametrize(
    "tokens",
    [
        [0, -1],
        [2**32],
        [2**70],
        [1.0, 2.0],
        ["a", "b"],
        np.array([1, -5], np.int64),
        np.array([0, 2**32], np.uint64),
        np.array([1.5, 2.5]),
        b"\x01\x02\x03",  # not whole u32 tokens
    ],
)
def test_bad_tokens(be, idx, tokens):
    before = snapshot(idx)
    with pytest.raises(InvalidTokens):
        be.hash_blocks(tokens, 1)
    with pytest.raises(KvplugError):
        idx.store_tokens(0, 0, None, [7] * (len(tokens) // 1), tokens, 1)
    assert snapshot(idx) == before


def test_token_error_names_position(be):
    with pytest.raises(InvalidTokens, match="position 5"):
        be.hash_blocks([1, 2, 3, 4, 5, -6, 7, 8], 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda ix: ix.store(0, 0, [1, 2, 3], [1, 2]),  # mismatched lengths
        lambda ix: ix.store(0, 3, [1], [1]),  # bad tier
        lambda ix: ix.store(0, -1, [1], [1]),
        lambda ix: ix.store(2**20, 0, [1], [1]),  # huge endpoint id
        lambda ix: ix.store(2**40, 0, [1], [1]),
        lambda ix: ix.store(-3, 0, [1], [1]),
        lambda ix: ix.store(0, 0, [1.5], [1]),  # float hash
        lambda ix: ix.remove(0, [1], tier=9),
        lambda ix: ix.move(0, [1], 0, 3),
        lambda ix: ix.clear(2**33),
        lambda ix: ix.store_tokens(0, 0, None, [1], [1, 2, 3], 2),  # wrong token count
        lambda ix: ix.store_tokens(0, 0, None, [1], [1, 2], 0),  # bad block size
        lambda ix: ix.store_tokens(0, 0, None, [1, 2], [1, 2, 3, 4], 2, extra=[1]),  # short extra
    ],
)
def test_bad_arguments_leave_index_intact(idx, call):
    before = snapshot(idx)
    with pytest.raises(InvalidArgument):
        call(idx)
    assert snapshot(idx) == before


def test_bad_cost_inputs(be):
    p = be.CostParams()
    with pytest.raises(InvalidArgument):
        be.select([1.0], -1.0, 0.5)
    with pytest.raises(InvalidArgument):
        be.select([1.0], float("nan"), 0.5)
    with pytest.raises(InvalidArgument):
        be.select([1.0], 0.0, -0.1)
    with pytest.raises((InvalidArgument, IndexError)):
        be.costs([1, 2], [0], [0, 0], [0, 0], [0, 0], [0, 0], p)


def test_c_specific_inputs():
    core = load_backend("c")
    with pytest.raises(InvalidTokens):
        core.hash_blocks(np.zeros((2, 2), np.uint32), 1)
    with pytest.raises(InvalidArgument):
        core.Index().query(np.zeros((2, 2), np.uint64))
    with pytest.raises(InvalidArgument):
        core.Index().query(np.array([1.0]))
    # a non-contiguous and a big-endian array are read correctly
    toks = np.arange(64, dtype=np.uint32)
    ref = core.hash_blocks(toks, 16)[1].tolist()
    assert core.hash_blocks(np.arange(128, dtype=np.uint32)[::2] // 2, 16)[1].tolist() == ref
    assert core.hash_blocks(toks.astype(">u4"), 16)[1].tolist() == ref
    # int16 tokens are widened
    assert core.hash_blocks(toks.astype(np.int16), 16)[1].tolist() == ref
