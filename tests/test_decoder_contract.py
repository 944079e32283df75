"""The event decoders' shared contract on hostile input: never raise, count what is dropped.

(The compiled vLLM path against the msgspec path is in ``test_vllm_fastpath_differential.py``;
the long fuzz run is ``benchmarks/fuzz_decoders.py``.)
"""

from __future__ import annotations

import struct

import pytest
from kvplug.integrations.sglang.subscriber import SglangBatchDecoder
from kvplug.integrations.sglang.wire import SglangDecoder
from kvplug.integrations.sglang.wire import encode_batch as sglang_batch
from kvplug.integrations.vllm.wire import BatchDecoder

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
