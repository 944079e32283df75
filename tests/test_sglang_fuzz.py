"""Hostile input never crashes the SGLang or TRT-LLM decoders and never yields a malformed
event: mutated golden payloads, random msgpack/JSON values, truncations."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kvplug.integrations.sglang.wire import MASK64, SglangDecoder
from kvplug.integrations.trtllm.events import TrtllmDecoder

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored

DATA = Path(__file__).parent / "data"
SG = [p.read_bytes() for p in sorted((DATA / "sglang").glob("*.msgpack"))]
TRT = json.loads((DATA / "trtllm" / "v2026_vswa_adp_events.json").read_bytes()) + json.loads(
    (DATA / "trtllm" / "v1_events.json").read_bytes()
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _well_formed(events, block_size):
    for e in events:
        assert isinstance(e, (BlockStored, BlockRemoved, BlockMoved, AllCleared))
        if isinstance(e, AllCleared):
            continue
        hashes = list(e.engine_hashes)  # a list, or a uint64 array from the compiled reader
        assert hashes and all(0 <= int(h) <= MASK64 for h in hashes)
        if isinstance(e, BlockStored):
            assert e.block_size == block_size
            assert len(e.token_ids) == len(e.engine_hashes) * block_size
            assert all(0 <= t < 2**32 for t in e.token_ids)
            assert e.parent_engine_hash is None or 0 <= e.parent_engine_hash <= MASK64


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "block_hashes",
                    "token_ids",
                    "parent_block_hash",
                    "block_size",
                    "medium",
                    "data",
                    "event_id",
                    "blocks",
                    "tokens",
                    "token_id",
                    "block_hash",
                    "parent_hash",
                    "cache_level",
                    "window_size",
                    "attention_dp_rank",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@FAST
@given(st.sampled_from(SG), st.integers(0, 400), st.binary(min_size=1, max_size=4))
def test_sglang_mutated_and_truncated_payloads(payload, pos, junk):
    dec = SglangDecoder("w", page_size=4)
    pos %= len(payload)
    for mutated in (payload[:pos], payload[:pos] + junk + payload[pos + len(junk) :]):
        _well_formed(dec.decode(mutated, seq=1), 4)


@FAST
@given(json_values)
def test_sglang_random_values(value):
    dec = SglangDecoder("w", page_size=4)
    try:
        payloads = (msgspec.msgpack.encode([1.0, [value], 0]), msgspec.msgpack.encode(value))
    except OverflowError:
        assume(False)  # msgpack has no integers beyond int64/uint64: not a possible payload
    for payload in payloads:
        _well_formed(dec.decode(payload), 4)


@FAST
@given(st.lists(st.one_of(st.sampled_from(TRT), json_values), max_size=8))
def test_trtllm_random_and_mixed_envelopes(envelopes):
    dec = TrtllmDecoder("t", tokens_per_block=4)
    _well_formed(dec.decode(envelopes), 4)
    _well_formed(dec.decode(TRT), 4)  # and the decoder still works afterwards
