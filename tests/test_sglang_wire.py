"""SGLang wire decoding: golden payloads (both encodings) → exact normalised events."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest
from event_helpers import mixed_width_ids, plain
from hypothesis import given, settings
from hypothesis import strategies as st
from kvplug.integrations.common import coalesce_removes
from kvplug.integrations.sglang.wire import MASK64, SglangDecoder, encode_batch

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier

DATA = Path(__file__).parent / "data" / "sglang"


def _load_builder():
    spec = importlib.util.spec_from_file_location("sglang_fixture_build", DATA / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _load_builder()
U = {name: getattr(B, name) & MASK64 for name in ("H1", "H2", "H3", "HP", "H4", "H5", "HPX")}


def _golden(name: str) -> list[bytes]:
    files = sorted(DATA.glob(f"{name}_*.msgpack"))
    assert files, f"no golden payloads for {name}"
    return [f.read_bytes() for f in files]


@pytest.mark.parametrize("name", sorted(B.STREAMS))
def test_golden_payloads_are_byte_exact(name):
    # the committed bytes are what the documented schema encodes to (and what SGLang's own
    # kv_events.py 0.5.15 / 0.5.18 / 0.5.23 produced for the same events when this was written)
    assert B.STREAMS[name]() == _golden(name)


def test_arrays_0_5_15_decode_to_expected_events():
    dec = SglangDecoder("sg-a", page_size=4)
    payloads = _golden("v0_5_15")
    got = [plain(dec.decode(payloads[0], dp_rank=0, seq=0))]
    assert got[0] == [
        BlockStored(
            worker_id="sg-a",
            dp_rank=0,
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[U["H1"], U["H2"]],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
        ),
        BlockStored(
            worker_id="sg-a",
            dp_rank=0,
            tier=Tier.DEVICE,
            parent_engine_hash=U["H2"],
            engine_hashes=[U["H3"]],
            token_ids=[9, 10, 11, 12],
            block_size=4,
        ),
        # the partial tail page [13, 14] is not stored
    ]
    assert dec.partial == {0: {U["HP"]}}
    got += [plain(dec.decode(p, dp_rank=0, seq=i)) for i, p in enumerate(payloads[1:], 1)]
    assert got[1] == [
        BlockStored(
            worker_id="sg-a",
            dp_rank=0,
            tier=Tier.HOST,
            parent_engine_hash=None,
            engine_hashes=[U["H1"], U["H2"]],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
        ),
        # the partial page's removal is swallowed, the full page leaves the device tier
        BlockRemoved(worker_id="sg-a", dp_rank=0, tier=Tier.DEVICE, engine_hashes=[U["H3"]]),
    ]
    assert dec.partial == {}  # emptied by the removal, then the flush
    assert got[2] == [
        BlockStored(
            worker_id="sg-a",
            dp_rank=0,
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[U["H4"]],
            token_ids=[20, 21, 22, 23],
            block_size=4,
        ),
        AllCleared(worker_id="sg-a", dp_rank=0),
    ]
    assert dec.counts["partial_removes_swallowed"] == 1
    assert not dec.drops


def test_maps_0_5_23_decode_to_expected_events():
    dec = SglangDecoder("sg-b", page_size=4)
    got = [plain(dec.decode(p, dp_rank=0, seq=i)) for i, p in enumerate(_golden("v0_5_23"))]
    # the batch's attn_dp_rank (1) wins over the socket's rank (0)
    assert got[0] == [
        BlockStored(
            worker_id="sg-b",
            dp_rank=1,
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[U["H1"], U["H2"]],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
            cache_salt="tenant-a",
            lora_name="sql-lora",
        ),
        # EAGLE3 bigram page: the first element of each pair is the token at that position
        BlockStored(
            worker_id="sg-b",
            dp_rank=1,
            tier=Tier.DEVICE,
            parent_engine_hash=U["H2"],
            engine_hashes=[U["H4"]],
            token_ids=[9, 10, 11, 12],
            block_size=4,
            cache_salt="tenant-a",
            lora_name="sql-lora",
        ),
    ]
    assert got[1] == [
        BlockStored(
            worker_id="sg-b",
            dp_rank=1,
            shared=True,
            parent_engine_hash=None,
            engine_hashes=[U["H5"]],
            token_ids=[40, 41, 42, 43],
            block_size=4,
        ),
        BlockStored(
            worker_id="sg-b",
            dp_rank=1,
            tier=Tier.DISK,
            parent_engine_hash=None,
            engine_hashes=[U["H1"]],
            token_ids=[1, 2, 3, 4],
            block_size=4,
            cache_salt="tenant-a",
            lora_name="sql-lora",
        ),
        BlockRemoved(worker_id="sg-b", dp_rank=1, tier=Tier.DEVICE, engine_hashes=[U["H4"]]),
        BlockRemoved(worker_id="sg-b", dp_rank=1, tier=None, engine_hashes=[U["H5"]], shared=True),
    ]
    # nil rank slot: the socket's rank
    assert got[2] == [AllCleared(worker_id="sg-b", dp_rank=0)]
    assert not dec.drops


def test_int64_hashes_fold_to_u64():
    assert U["H5"] == 1 << 63  # -2**63
    assert U["H3"] == MASK64 - 4  # -5


def _batch(events, rank=0):
    return msgspec.msgpack.encode([1.0, events, rank])


def _stored_map(hashes, parent, tokens, block_size, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        **extra,
    }


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (_stored_map([1], None, [1, 2, 3], 4), "length_mismatch"),
        (_stored_map([1], None, [1, 2, 3, 4, 5, 6, 7, 8], 8), "block_size_mismatch"),
        (_stored_map([1], None, [1, 2, 3, -1], 4), "bad_tokens"),
        (_stored_map([1], None, [1, 2, 3, 1 << 32], 4), "bad_tokens"),
        (_stored_map([1], None, [1, 2, 3, "x"], 4), "bad_tokens"),
        (_stored_map(["1"], None, [1, 2, 3, 4], 4), "bad_hash"),
        (_stored_map([1], None, [1, 2, 3, 4], 0), "bad_block_size"),
        # pages times a block size past 2**64 (a fuzzer's find: it overflowed the id loop's bound)
        (_stored_map([1, 2], None, [1, 2, 3, 4], 2**64 - 1), "length_mismatch"),
        (_stored_map([1], None, [1, 2, 3, 4], 4, medium="NVME"), "unknown_medium"),
        (_stored_map([1], None, [1, 2, 3, 4], 4, cache_salt=7), "bad_field"),
        ({"type": "BlockExploded", "block_hashes": [1]}, "unknown_event"),
        ("BlockStored", "bad_event"),
        (["BlockRemoved", "not-a-list"], "bad_hash"),
    ],
)
def test_bad_events_are_dropped_and_counted_alone(event, reason):
    dec = SglangDecoder("w", page_size=4)
    good = _stored_map([10], None, [1, 2, 3, 4], 4)
    out = plain(dec.decode(_batch([good, event, {"type": "AllBlocksCleared"}]), seq=7))
    assert [type(e) for e in out] == [BlockStored, AllCleared]  # neighbours survive
    assert dec.drops == {reason: 1}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "bad_msgpack"),
        (msgspec.msgpack.encode([1.0]), "bad_batch"),
        (msgspec.msgpack.encode({"ts": 1.0, "events": []}), "bad_batch"),
        (msgspec.msgpack.encode([1.0, [], "rank-one"]), "bad_batch"),
        (msgspec.msgpack.encode([1.0, [], -1]), "bad_batch"),
        (
            msgspec.msgpack.encode([1.0, [_stored_map([1], None, [1, 2, 3, 4], 4)]])[:-3],
            "bad_msgpack",
        ),
    ],
)
def test_bad_batches_are_dropped_and_counted(payload, reason):
    dec = SglangDecoder("w", page_size=4)
    assert dec.decode(payload, seq=3) == []
    assert dec.drops == {reason: 1}


def test_store_chained_onto_a_partial_page_is_dropped():
    dec = SglangDecoder("w", page_size=4)
    dec.decode(_batch([_stored_map([5], None, [1, 2], 2)]))
    out = plain(dec.decode(_batch([_stored_map([6], 5, [3, 4, 5, 6], 4)])))
    assert out == [] and dec.drops == {"parent_partial": 1}


def test_page_size_one_never_has_partial_pages():
    dec = SglangDecoder("w", page_size=1)
    out = plain(dec.decode(_batch([_stored_map([1, 2, 3], None, [7, 8, 9], 1)])))
    assert out[0].engine_hashes == [1, 2, 3] and dec.partial == {}


def test_arrays_0_5_18_with_metadata_decode_to_expected_events():
    dec = SglangDecoder("sg-c", page_size=4)
    assert plain(dec.decode(_golden("v0_5_18")[0])) == [
        BlockStored(
            worker_id="sg-c",
            engine_hashes=[U["H1"], U["H2"]],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
            cache_salt="tenant-b",
        ),
        BlockStored(
            worker_id="sg-c", engine_hashes=[U["H3"]], token_ids=[9, 10, 11, 12], block_size=4
        ),  # nil medium slot: device
        BlockRemoved(worker_id="sg-c", tier=Tier.DEVICE, engine_hashes=[U["H3"]]),
        AllCleared(worker_id="sg-c"),
    ]
    assert not dec.drops


@pytest.mark.parametrize("fast", [True, False])
def test_positional_events_with_unknown_trailing_fields_decode(fast):
    dec = SglangDecoder("w", page_size=2)
    if not fast:
        dec._fast_order = ()
    raw = ["BlockStored", [-1], None, [1, 2], 2, None, "GPU", {"cache_salt": "s", "x": 1}, 9]
    out = plain(dec.decode(_batch([raw])))
    assert out == [
        BlockStored(
            worker_id="w", engine_hashes=[MASK64], token_ids=[1, 2], block_size=2, cache_salt="s"
        )
    ]
    bad = ["BlockStored", [-1], None, [1, 2], 2, None, "GPU", "not-a-map"]
    assert dec.decode(_batch([bad])) == [] and dec.drops == {"bad_field": 1}


def test_all_cleared_forgets_partial_pages_of_that_rank_only():
    dec = SglangDecoder("w", page_size=4)
    dec.decode(_batch([_stored_map([5], None, [1], 1)], rank=0))
    dec.decode(_batch([_stored_map([6], None, [1], 1)], rank=1))
    dec.decode(_batch([{"type": "AllBlocksCleared"}], rank=0))
    assert dec.partial == {1: {6}}


@pytest.mark.parametrize("name", sorted(B.STREAMS))
def test_typed_fast_path_agrees_with_the_checked_slow_path(name):
    fast, slow = SglangDecoder("w", page_size=4), SglangDecoder("w", page_size=4)
    slow._fast_order = ()  # every payload through the generic, per-event-checked decoder
    for payload in _golden(name):
        probe = SglangDecoder("w", page_size=4)
        assert probe._fast_items(payload, 0) is not None  # well-formed: the fast path takes it
        assert plain(fast.decode_items(payload)) == plain(slow.decode_items(payload))
    assert fast.counts == slow.counts and not fast.drops and not slow.drops


# -- encoder round trip ------------------------------------------------------------------------

u64 = st.integers(0, MASK64)


@st.composite
def _sglang_events(draw, worker="w", rank=0, bs=4, salted=True, lora=True):
    events = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        if kind == "cleared":
            events.append(AllCleared(worker_id=worker, dp_rank=rank))
            continue
        n = draw(st.integers(1, 3))
        hashes = draw(st.lists(u64, min_size=n, max_size=n))
        shared = draw(st.booleans())
        tier = Tier.DEVICE if shared else draw(st.sampled_from(list(Tier)))
        if kind == "removed":
            events.append(
                BlockRemoved(
                    worker_id=worker,
                    dp_rank=rank,
                    tier=None if shared else tier,
                    engine_hashes=hashes,
                    shared=shared,
                )
            )
            continue
        events.append(
            BlockStored(
                worker_id=worker,
                dp_rank=rank,
                tier=tier,
                shared=shared,
                parent_engine_hash=draw(st.none() | u64),
                engine_hashes=hashes,
                token_ids=draw(
                    st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)
                ),
                block_size=bs,
                cache_salt=draw(st.none() | st.text(max_size=5)) if salted else None,
                lora_name=draw(st.none() | st.text(min_size=1, max_size=5)) if lora else None,
            )
        )
    return events


@settings(max_examples=60, deadline=None)
@given(_sglang_events(rank=1), st.booleans())
def test_encoder_round_trips_through_the_decoder_0_5_23(events, fast):
    dec = SglangDecoder("w", page_size=4)
    if not fast:
        dec._fast_order = ()
    # the decoder gathers consecutive removes as the vLLM one does (one index call each)
    want = coalesce_removes(events)
    assert plain(dec.decode(encode_batch(events, "0.5.23", attn_dp_rank=1))) == want
    assert not dec.drops


@settings(max_examples=40, deadline=None)
@given(_sglang_events(lora=False), st.sampled_from(["0.5.15", "0.5.18"]))
def test_encoder_round_trips_through_the_decoder_arrays(events, form):
    dec = SglangDecoder("w", page_size=4)
    if form == "0.5.15" and any(getattr(e, "cache_salt", None) is not None for e in events):
        with pytest.raises(ValueError):
            encode_batch(events, form)
        return
    assert plain(dec.decode(encode_batch(events, form))) == coalesce_removes(events)


def test_encoder_refuses_what_sglang_cannot_say():
    with pytest.raises(ValueError):
        encode_batch(
            [BlockMoved(worker_id="w", from_tier=Tier.DEVICE, to_tier=Tier.HOST, engine_hashes=[1])]
        )
    with pytest.raises(ValueError):
        encode_batch([], "0.4.0")


# -- token ids through the vLLM decoder's compiled loop ----------------------------------------

_FASTWIRE = importlib.util.find_spec("kvplug.integrations.vllm._fastwire") is not None


@pytest.mark.skipif(not _FASTWIRE, reason="compiled vLLM decoder not built")
def test_token_ids_come_as_u32_arrays_from_the_compiled_loop():
    """A well-formed store's ids are read by _fastwire's token loop, without a Python int per
    id, into the msgspec path's values; ids of every msgpack width, one decoder reused (the
    loop goes two ids a step after the first 5-byte id)."""
    import random

    import numpy as np

    rng = random.Random(4)
    fast, slow = SglangDecoder("w", page_size=16), SglangDecoder("w", page_size=16)
    slow._fast_order = ()  # the checked, per-event path: lists of Python ints
    for n in range(200):
        events = []
        for _ in range(rng.randrange(1, 4)):
            pages = rng.randrange(1, 4)
            # every third batch uint16 ids only: the per-id loop's four-at-once step
            tokens = mixed_width_ids(rng, 16 * pages, None if n % 3 else [0, 0, 1, 0])
            events.append(
                _stored_map([rng.getrandbits(63) for _ in range(pages)], None, tokens, 16)
            )
        payload = _batch(events)
        got, want = fast.decode(payload), slow.decode(payload)
        assert plain(got) == want, n
        for ev in got:
            assert isinstance(ev.token_ids, np.ndarray) and ev.token_ids.dtype == np.uint32
    assert fast._ids.wide_ids


@pytest.mark.skipif(not _FASTWIRE, reason="compiled vLLM decoder not built")
def test_token_loop_declines_what_it_cannot_read_and_msgspec_decides():
    dec = SglangDecoder("w", page_size=2)
    enc = msgspec.msgpack.encode
    ids = dec._ids
    assert ids.token_array(enc([1, 300, 70000, 2**32 - 1]), 4).tolist() == [
        1,
        300,
        70000,
        2**32 - 1,
    ]
    assert ids.token_array(enc([1, 2, 3]), 2) is None  # more ids than the store's pages hold
    for bad in ([1, -1], [1, 2**32], [1, "x"], [[1, 2], [3, 4]], [1, None], [1.0, 2]):
        assert ids.token_array(enc(bad), 8) is None, bad
    assert ids.token_array(enc([1, 2]) + b"\x01", 8) is None  # bytes after the array
    assert ids.token_array(enc([1, 2])[:-1], 8) is None  # truncated
    # EAGLE3's pairs still decode (msgspec), a bad id is still dropped and counted
    out = dec.decode(_batch([_stored_map([5], None, [[7, 8], [9, 10]], 2)]))
    assert plain(out) == [
        BlockStored(worker_id="w", engine_hashes=[5], token_ids=[7, 9], block_size=2)
    ]
    assert dec.decode(_batch([_stored_map([6], None, [1, -1], 2)])) == []
    assert dec.drops == {"bad_tokens": 1}
