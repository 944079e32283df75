"""The event decoders' shared contract on hostile input: never raise, count what is dropped.

(The compiled vLLM path against the msgspec path is in ``test_vllm_fastpath_differential.py``;
the long fuzz run is ``benchmarks/fuzz_decoders.py``.)
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
from kvplug.integrations.sglang.subscriber import SglangBatchDecoder
from kvplug.integrations.sglang.wire import SglangDecoder
from kvplug.integrations.sglang.wire import encode_batch as sglang_batch
from kvplug.integrations.vllm.wire import FAST_PATH, BatchDecoder

from kvplug.events import BlockStored

TS = struct.pack(">d", 1.0)
# issue 9's reproducer: [1.0, [[[...nil...]]]] nested 2000 deep
DEEP = b"\x92\xcb" + TS + b"\x91" * 2000 + b"\xc0"
# the same depth inside places a typed decoder descends into
DEEP_INSIDE = [
    DEEP,
    b"\x93\xcb" + TS + b"\x91" + b"\x91" * 2000 + b"\xc0" + b"\x00",
    # a map-form BlockStored whose extra_keys is nested 2000 deep
    b"\x92\xcb"
    + TS
    + b"\x91\x83\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xaaextra_keys"
    + b"\x91" * 2000
    + b"\xc0",
    # an array-form event whose tag slot is the deep value
    b"\x92\xcb" + TS + b"\x91\x92" + b"\x91" * 2000 + b"\xc0\x01",
]


@pytest.mark.parametrize("payload", DEEP_INSIDE, ids=range(len(DEEP_INSIDE)))
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "msgspec"])
def test_vllm_decoder_rejects_deep_nesting_without_raising(payload, fast):
    dec = BatchDecoder("w")
    dec.use_fast = fast
    got = dec.decode(payload)
    assert got is None or got.events == []
    st = dec.stats
    assert st.malformed_batches + st.malformed_events + st.unknown_event_kinds == 1


@pytest.mark.parametrize("payload", DEEP_INSIDE, ids=range(len(DEEP_INSIDE)))
def test_sglang_decoder_rejects_deep_nesting_without_raising(payload):
    dec = SglangDecoder("w", 16)
    got = dec.decode_items(payload)
    assert got is None or got[1] == []
    assert sum(dec.drops.values()) == 1
    # and through the subscriber's adapter: an unreadable batch, not an exception
    assert SglangBatchDecoder("w", 16).decode(DEEP) is None


def test_a_good_batch_after_a_rejected_one_decodes():
    dec = SglangDecoder("w", 4)
    ok = sglang_batch(
        [BlockStored(worker_id="w", engine_hashes=[5], token_ids=[1, 2, 3, 4], block_size=4)]
    )
    assert dec.decode_items(DEEP) is None
    rank, items = dec.decode_items(ok)
    assert [i.engine_hashes for i in items] == [[5]]


def test_vllm_map_encoded_batch_decodes_on_both_paths():
    """Issue 11: vLLM's ``EventBatch`` at vllm-project/vllm 0181ea31
    (vllm/distributed/kv_events.py) is a msgspec Struct without ``array_like``: the batch is
    a map ``{"ts", "events", "data_parallel_rank"}`` (``omit_defaults``: no rank when None)
    around map-form events. Encoded here with structs of that shape."""

    class EventBatch(msgspec.Struct, omit_defaults=True):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):  # noqa: F811 - upstream's wire struct, not kvplug's event
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    stored = BlockStored([11, 12], None, list(range(8)), 4, None, "GPU", None, [("s",), None], 0)
    for rank in (None, 3):
        payload = msgspec.msgpack.encode(
            EventBatch(2.5, [AllBlocksCleared(), stored, BlockRemoved([11], "GPU")], rank)
        )
        assert payload[0] == 0x82 + (rank is not None)  # a map, as upstream sends it
        for fast in (True, False):
            dec = BatchDecoder("w", block_size=4)
            dec.use_fast = fast
            got = dec.decode(payload, dp_rank=1)
            assert (got.ts, got.dp_rank, got.dropped) == (2.5, rank, 0)
            want_rank = 1 if rank is None else rank
            kinds = [(type(e).__name__, e.dp_rank) for e in got.events]
            assert kinds == [
                ("AllCleared", want_rank),
                ("BlockStored", want_rank),
                ("BlockRemoved", want_rank),
            ]
            assert list(got.events[1].engine_hashes) == [11, 12]
            assert got.events[1].cache_salt == "s"
            assert (dec.stats.fast_batches == 1) == (fast and FAST_PATH)


@pytest.mark.parametrize("rank", [-1, -(2**63), 2**31])
def test_vllm_batch_with_an_unusable_rank_is_rejected_on_both_paths(rank):
    """Found by benchmarks/fuzz_decoders.py: the msgspec path took a negative
    data_parallel_rank and emitted events for rank -1 (the fast path declined the batch)."""
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], rank])
    for fast in (True, False):
        dec = BatchDecoder("w")
        dec.use_fast = fast
        assert dec.decode(payload) is None
        assert dec.stats.malformed_batches == 1


def test_vllm_invalid_utf8_in_an_unbuilt_store_is_the_same_on_both_paths():
    """Found by the fuzzer: a store with no blocks but an invalid UTF-8 lora_name (or
    extra_keys string) was skipped by the fast path and dropped as malformed by msgspec."""
    from kvplug.integrations.vllm.wire import compare_paths

    for tail in (b"\xa2\xf1d\xc0", b"\xa2ad\x91\x91\xa1\xcb"):
        payload = b"\x92\xcb" + TS + b"\x91\x99\xabBlockStored\x90\xc0\x90\x04\xc0\xa3GPU" + tail
        assert compare_paths(payload) is None
        dec = BatchDecoder("w")
        assert dec.decode(payload).dropped == 1
