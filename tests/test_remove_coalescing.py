"""Removals gathered hash by hash, and SGLang's block hashes read by the compiled reader.

``coalesce_removes`` moves each removed hash into the batch's open remove unless a store in
between holds it or chains to it; from the first such hash on, the rest of its event starts
the next remove. Deciding per hash makes the result independent of how the removes arrived
grouped: SGLang's typed decode joins adjacent removals before coalescing, the checked path does
not, and both must give ``coalesce_removes`` of the events encoded. Decided per event (the rule
before), an adjacent pair whose second hash a store had touched stayed together and came out
grouped differently (the example below, found by the round-trip property test). vLLM's
compiled decoder splits the same way, so its batches still equal the msgspec path's.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from event_helpers import plain
from hypothesis import given, settings
from hypothesis import strategies as st
from kvplug.integrations.common import MASK64, coalesce_removes, join_hashes
from kvplug.integrations.sglang import wire as sglang_wire
from kvplug.integrations.sglang.wire import SglangDecoder, compare_paths, encode_batch
from kvplug.integrations.vllm import wire as vllm_wire

from kvplug import AllCleared, BlockRemoved, BlockStored, Tier


@pytest.fixture
def fastwire():
    """The compiled decoder module (a skip without a build; a failure under CI=true)."""
    return pytest.importorskip("kvplug.integrations.vllm._fastwire")


def _rm(hashes, tier=Tier.DEVICE, shared=False, rank=0):
    return BlockRemoved(
        worker_id="w", dp_rank=rank, tier=None if shared else tier, engine_hashes=hashes,
        shared=shared,
    )  # fmt: skip


def _st(hashes, parent=None, rank=0, bs=4):
    return BlockStored(
        worker_id="w", dp_rank=rank, tier=Tier.DEVICE, parent_engine_hash=parent,
        engine_hashes=hashes, token_ids=[7] * (len(hashes) * bs), block_size=bs,
    )  # fmt: skip


def _adjacent_joined(events):
    """Adjacent removes of one tier as one event, as SGLang's typed decode gathers them."""
    out = []
    for e in events:
        last = out[-1] if out else None
        if (
            type(e) is BlockRemoved
            and type(last) is BlockRemoved
            and (last.tier, last.shared, last.dp_rank) == (e.tier, e.shared, e.dp_rank)
        ):
            out[-1] = msgspec.structs.replace(
                last, engine_hashes=list(last.engine_hashes) + list(e.engine_hashes)
            )
        else:
            out.append(e)
    return out


def test_the_pair_a_store_split_is_split_hash_by_hash():
    # R[0], a store of 0, then R[1] and R[0] in a row: 1 moves up past the store, 0 cannot
    events = [_rm([0], shared=True), _st([0, 0, 0]), _rm([1], shared=True), _rm([0], shared=True),
              _rm([0])]  # fmt: skip
    want = [_rm([0, 1], shared=True), _st([0, 0, 0]), _rm([0], shared=True), _rm([0])]
    assert coalesce_removes(events) == want
    assert coalesce_removes(_adjacent_joined(events)) == want
    for fast in (True, False):
        dec = SglangDecoder("w", page_size=4)
        if not fast:
            dec._fast_order = ()
        got = plain(dec.decode(encode_batch(events, "0.5.23", attn_dp_rank=0)))
        assert got == want, fast


def test_a_store_chaining_to_a_hash_keeps_it_and_the_rest_of_its_event_after_the_store():
    events = [_rm([1]), _st([9], parent=5), _rm([2, 5, 3]), _rm([4])]
    assert coalesce_removes(events) == [_rm([1, 2]), _st([9], parent=5), _rm([5, 3, 4])]


def test_the_events_given_are_not_changed():
    first, second = _rm([1]), _rm([2])
    out = coalesce_removes([first, second])
    assert out == [_rm([1, 2])] and first.engine_hashes == [1] and second.engine_hashes == [2]


def test_arrays_stay_arrays_and_mixed_parts_become_one_list():
    a, b = np.array([1, 2], dtype=np.uint64), np.array([MASK64], dtype=np.uint64)
    joined = join_hashes([a, b])
    assert isinstance(joined, np.ndarray) and joined.dtype == np.uint64
    assert joined.tolist() == [1, 2, MASK64]
    assert join_hashes([a, [5]]) == [1, 2, 5]
    out = coalesce_removes([_rm(a), _st(np.array([7], dtype=np.uint64)), _rm(b)])
    assert plain(out) == [_rm([1, 2, MASK64]), _st([7])]


_hash = st.integers(0, 3)  # few values: stores and removes collide often
_TIERS = [(Tier.DEVICE, False)] * 4 + [(Tier.HOST, False), (Tier.DEVICE, True)]


@st.composite
def _batches(draw):
    events = []
    for _ in range(draw(st.integers(0, 10))):
        kind = draw(st.sampled_from(["stored", "removed", "removed", "cleared"]))
        if kind == "cleared":
            events.append(AllCleared(worker_id="w", dp_rank=0))
        elif kind == "stored":
            events.append(_st(draw(st.lists(_hash, min_size=1, max_size=3)),
                              draw(st.none() | _hash)))  # fmt: skip
        else:  # mostly one tier, so removes meet others they may join
            tier, shared = draw(st.sampled_from(_TIERS))
            events.append(_rm(draw(st.lists(_hash, min_size=1, max_size=3)), tier, shared))
    return events


def _replay(events):
    """What a batch leaves held, per (tier, shared) and hash: a store adds one, a remove of a
    hash held clears it (the order matters only between a store and a remove of one hash)."""
    held: set[tuple] = set()
    for e in events:
        if type(e) is BlockStored:
            held.update((e.tier, False, h) for h in e.engine_hashes)
        elif type(e) is BlockRemoved:
            for h in e.engine_hashes:
                held = {k for k in held if not (k[2] == h and (e.tier is None or k[0] == e.tier))}
        else:
            held = set()
    return held


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_the_grouping_does_not_depend_on_adjacent_removes_arriving_joined(events):
    want = coalesce_removes(events)
    assert coalesce_removes(_adjacent_joined(events)) == want
    assert coalesce_removes(want) == want  # already gathered: nothing moves again
    assert _replay(want) == _replay(events)  # the same end state
    for fast in (True, False):
        dec = SglangDecoder("w", page_size=4)
        if not fast:
            dec._fast_order = ()
        assert plain(dec.decode(encode_batch(events, "0.5.23", attn_dp_rank=0))) == want


def _vllm_batch(events):
    return vllm_wire.encode_batch(events, "0.32.0", ts=1.0)


def test_vllm_compiled_decoder_splits_as_the_msgspec_path(fastwire):
    events = [_rm([1]), _st([9], parent=5), _rm([2, 5, 3]), _rm([4])]
    payload = _vllm_batch(events)
    assert vllm_wire.compare_paths(payload, block_size=4) is None
    dec = vllm_wire.BatchDecoder("w", block_size=4)
    got = plain(dec.decode(payload).events)
    assert dec.stats.fast_batches == 1
    assert [list(e.engine_hashes) for e in got] == [[1, 2], [9], [5, 3, 4]]


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_vllm_paths_agree_on_colliding_removes(events):
    events = [e for e in events if not (type(e) is BlockRemoved and e.shared)]  # vLLM has none
    assert vllm_wire.compare_paths(_vllm_batch(events), block_size=4) is None


# -- SGLang's block hashes by the compiled reader -------------------------------------------

# every msgpack integer form: fixints, uint8-64, int8-64 (negatives fold to u64)
_INT_FORMS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, MASK64]
_INT_FORMS += [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]


def test_hash_array_reads_every_msgpack_integer_form_and_folds_as_the_mask_does(fastwire):
    raw = msgspec.msgpack.encode(_INT_FORMS)
    got = fastwire.hash_array(raw, 100)
    assert got.dtype == np.uint64 and got.tolist() == [h & MASK64 for h in _INT_FORMS]
    assert fastwire.hash_array(msgspec.msgpack.encode([]), 0).tolist() == []
    rng = random.Random(3)
    values = [rng.randrange(-(2**63), 2**64) for _ in range(70000)]  # array32 header
    got = fastwire.hash_array(msgspec.msgpack.encode(values), 1 << 20)
    assert got.tolist() == [h & MASK64 for h in values]


@pytest.mark.parametrize(
    "raw",
    [
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode([True]),
        msgspec.msgpack.encode([None]),
        msgspec.msgpack.encode([b"\x00" * 8]),
        msgspec.msgpack.encode(["x"]),
        msgspec.msgpack.encode([[1]]),
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode([1, 2]) + b"\x00",  # bytes after the array
        msgspec.msgpack.encode([1, 2**40])[:-1],  # truncated
        b"\xdc\xff\xff",  # an array16 header claiming 65,535 hashes, none there
        b"",
    ],
)
def test_hash_array_declines_what_is_not_an_array_of_integers(fastwire, raw):
    assert fastwire.hash_array(raw, 100) is None


def test_hash_array_declines_more_than_the_limit_and_the_decoder_then_goes_the_checked_way(
    fastwire,
):
    raw = msgspec.msgpack.encode([1, 2, 3])
    assert fastwire.hash_array(raw, 2) is None and fastwire.hash_array(raw, 3) is not None


def test_sglang_stores_and_removals_come_with_uint64_arrays(fastwire):
    events = [_st([1, MASK64], parent=2**63), _rm([3, 2**63 + 5])]
    out = SglangDecoder("w", page_size=4).decode(encode_batch(events, "0.5.23"))
    assert all(type(e.engine_hashes) is np.ndarray for e in out)
    assert plain(out) == events


@settings(max_examples=200, deadline=None)
@given(_batches(), st.sampled_from(["0.5.15", "0.5.23"]))
def test_sglang_typed_path_agrees_with_the_checked_path(events, form):
    typed, checked = SglangDecoder("w", page_size=4), SglangDecoder("w", page_size=4)
    payload = encode_batch(events, form)
    got, disagree = compare_paths(payload, typed, checked)
    assert disagree is None
    assert plain(got) == coalesce_removes(events)


def test_compare_paths_sees_a_hash_reader_that_reads_wrong(fastwire, monkeypatch):
    payload = encode_batch([_st([1, 2]), _rm([3])], "0.5.23")
    assert compare_paths(payload, SglangDecoder("w", 4), SglangDecoder("w", 4))[1] is None

    real = fastwire.hash_array

    def off_by_one(raw, max_n):
        arr = real(raw, max_n)
        return None if arr is None else arr + np.uint64(1)

    monkeypatch.setattr(sglang_wire._fastwire, "hash_array", off_by_one, raising=True)
    disagree = compare_paths(payload, SglangDecoder("w", 4), SglangDecoder("w", 4))[1]
    assert disagree is not None and "events differ" in disagree


def test_an_empty_store_with_bad_token_ids_is_dropped_on_both_paths():
    # the typed path skipped a store without hashes before reading its ids; the checked one
    # reads them first and drops the event (the fuzzer's first disagreement once it compared)
    bad = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": 1.5, "block_size": 4}], 0]
    )
    typed, checked = SglangDecoder("w", 4), SglangDecoder("w", 4)
    assert compare_paths(bad, typed, checked) == ([], None)
    assert typed.drops == {"bad_tokens": 1}
    fine = bad.replace(b"\xcb\x3f\xf8" + b"\x00" * 6, b"\x90")  # token_ids: []
    assert fine != bad and SglangDecoder("w", 4)._fast_items(fine, 0) is not None


def test_an_unknown_key_is_ignored_whatever_it_holds_on_the_typed_path():
    # the kept difference: the checked path decodes the batch generically first, so a key
    # that is not valid UTF-8 drops the whole batch there; compare_paths re-aligns the two
    event = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "x": 1}
    payload = msgspec.msgpack.encode([0.0, [event], 0]).replace(b"\xa1x", b"\xa1\xff")
    typed, checked = SglangDecoder("w", 4), SglangDecoder("w", 4)
    got, disagree = compare_paths(payload, typed, checked)
    assert disagree is None and plain(got) == [_rm([5])]
    assert checked.drops == {"bad_msgpack": 1} and typed.counts == checked.counts
    payload2 = encode_batch([_rm([6])], "0.5.23")
    assert compare_paths(payload2, typed, checked)[1] is None  # the streams stay aligned
