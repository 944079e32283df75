"""The compiled vLLM decoder and the msgspec decoder follow one contract (issue 9).

The contract (integrations/vllm/wire.py): a field vLLM declares for an event kind must have
vLLM's type, or the event is malformed (dropped, counted); a field vLLM does not declare for
that kind is ignored, whatever it holds (``AllBlocksCleared`` declares none). The fast path may
decline any batch (the msgspec path then decides alone); what it accepts must decode exactly as
the msgspec path decodes it. Hypothesis generates batches near the shapes vLLM sends, with
hostile values in every field, in both event encodings and both batch encodings, plus byte-level
mutations; ``compare_paths`` checks each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvplug.integrations.vllm.wire import FAST_PATH, BatchDecoder, compare_paths

from kvplug.events import AllCleared

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fuzz_decoders import ISSUE_9  # noqa: E402

pytestmark = pytest.mark.skipif(not FAST_PATH, reason="compiled fast path not built")

_enc = msgspec.msgpack.Encoder()
U64 = st.integers(0, 2**64 - 1)
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.sampled_from(["", "x", "GPU", "CPU", "STORAGE", "full_attention", "sliding_window", "é"]),
    st.binary(max_size=33),
    st.lists(st.integers(0, 5), max_size=3),
    st.lists(st.none() | st.lists(st.integers(0, 3) | st.text(max_size=2), max_size=2), max_size=3),
    st.dictionaries(st.sampled_from(["a", "type"]), st.integers(0, 3), max_size=2),
)
STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
ANY_FIELD = st.sampled_from([*STORED_FIELDS, "future_field", "type"])


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    n = draw(st.integers(0, 3))
    bs = draw(st.sampled_from([1, 2, 4]))
    hashes = draw(
        st.lists(
            U64 | st.integers(-(2**63), -1) | st.binary(min_size=8, max_size=32),
            min_size=n,
            max_size=n,
        )
    )
    if kind == "BlockStored":
        fields = {
            "block_hashes": hashes,
            "parent_block_hash": draw(st.none() | U64),
            "token_ids": draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs))
            if draw(st.booleans())
            else [],
            "block_size": bs,
            "lora_id": None,
            "medium": draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
            "lora_name": draw(st.sampled_from([None, "ad"])),
            "extra_keys": draw(st.sampled_from([None, [["s"]] + [None] * (n - 1) if n else None])),
        }
        order = STORED_FIELDS
    elif kind == "BlockRemoved":
        fields = {"block_hashes": hashes, "medium": draw(st.sampled_from([None, "GPU", "CPU"]))}
        order = REMOVED_FIELDS
    else:
        fields, order = {}, []
    for _ in range(draw(st.integers(0, 2))):  # hostile values, removed and unknown fields
        name = draw(ANY_FIELD)
        if draw(st.integers(0, 5)) == 0:
            fields.pop(name, None)
        else:
            fields[name] = draw(HOSTILE)
    if draw(st.booleans()):  # map form (vLLM >= 0.24)
        return {"type": kind, **fields}
    # array form (<= 0.23): positional, extra elements after the known ones
    values = [fields.get(name) for name in order]
    extra = [v for k, v in fields.items() if k not in order]
    return [kind, *values, *extra][: draw(st.integers(1, 20))]


@st.composite
def batches(draw):
    evs = draw(st.lists(events(), max_size=4))
    ts = draw(st.sampled_from([1.0, 0, 2**40]) | st.floats(allow_nan=False))
    rank = draw(st.none() | st.integers(-1, 3))
    if draw(st.integers(0, 3)) == 0:  # the batch as a map (issue 11)
        batch = {"ts": ts, "events": evs}
        if draw(st.booleans()):
            batch["data_parallel_rank"] = rank
        if draw(st.integers(0, 4)) == 0:
            batch[draw(st.sampled_from(["future", "ts"]))] = draw(HOSTILE)
        payload = _enc.encode(batch)
    else:
        payload = _enc.encode([ts, evs, rank][: draw(st.integers(2, 3))])
    if draw(st.integers(0, 4)) == 0:  # a byte-level mutation
        i = draw(st.integers(0, len(payload) - 1))
        payload = payload[:i] + bytes([draw(st.integers(0, 255))]) + payload[i + 1 :]
    return payload


# the four disagreements issue 9 reported: the payloads benchmarks/fuzz_decoders.py replays
# first (its ISSUE_9 list, after the deep-nesting one)
ISSUE_CASES = ISSUE_9[1:]


@pytest.mark.parametrize(
    "payload", ISSUE_CASES, ids=["cleared-medium", "lora_id", "window", "extra_keys"]
)
def test_issue_cases_agree_and_follow_the_contract(payload):
    assert compare_paths(payload) is None
    # the contract's answer for each, on both paths
    for fast in (True, False):
        dec = BatchDecoder("w")
        dec.use_fast = fast
        got = dec.decode(payload)
        if payload is ISSUE_CASES[0]:
            assert got.events == [AllCleared(worker_id="w")] and got.dropped == 0
        else:  # a declared field with the wrong type: the event is malformed
            assert got.events == [] and got.dropped == 1
            assert dec.stats.malformed_events == 1


@settings(
    max_examples=1000,
    derandomize=True,  # seeded: the same inputs on every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batches())
@example(ISSUE_CASES[0])
def test_fast_path_and_msgspec_path_agree(payload):
    assert compare_paths(payload) is None
    assert compare_paths(payload, block_size=2, dp_rank=1) is None
