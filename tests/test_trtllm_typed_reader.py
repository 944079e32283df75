"""The TRT-LLM decoder's typed reader (stored envelopes read by msgspec into structs, the
common store taken whole) against its checked reader (plain JSON dicts): the same events,
counts, drops and per-rank state for every answer, and the typed way taken where it should be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvplug.integrations.trtllm import events as trt_events
from kvplug.integrations.trtllm.events import TrtllmDecoder
from kvplug.integrations.trtllm.poller import compare_readers, parse_answer

DATA = Path(__file__).parent / "data" / "trtllm"
BS = 4


def _typed_count(body: bytes) -> int:
    envelopes, why = parse_answer(body)
    assert envelopes is not None, why
    return sum(type(e) is trt_events._StoredEnvelope for e in envelopes)


@pytest.mark.parametrize(
    "name", ["v1_events.json", "v2026_vswa_adp_events.json", "gap_restart_drains.json"]
)
def test_fixture_answers_read_typed_give_the_checked_readers_events(name):
    answers = json.loads((DATA / name).read_bytes())
    if name != "gap_restart_drains.json":
        answers = [answers]  # one drain; the gap fixture holds several, in order
    typed, checked = TrtllmDecoder("t", BS), TrtllmDecoder("t", BS)
    typed_reads = 0
    for answer in answers:
        body = json.dumps(answer).encode()
        typed_reads += _typed_count(body)
        events, why = compare_readers(body, typed, checked)
        assert why is None
        assert events is not None
    assert typed_reads > 0  # the fixtures' stores go the typed way


def _tokens(ids, extra=0):
    return [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in ids]


def _block(h, ids=(1, 2, 3, 4), **fields):
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": _tokens(ids),
        "priority": 35,
        **fields,
    }


def _stored(blocks, parent=None, **fields):
    return {"type": "stored", "parent_hash": parent, "blocks": blocks, **fields}


# (store, whether the typed decoder's whole-store step settles it without the per-block step;
# None: not read typed at all): one feature changed from the plain store at a time
STORES = [
    (_stored([_block(10), _block(11, (5, 6, 7, 8))]), True),
    (_stored([_block(2**64 - 1)], parent=11), True),
    (_stored([_block(-5)]), True),  # int64 hashes fold to u64 on both ways
    (_stored([_block(12, (0, 2**32 - 1, 3, 4))]), True),
    (_stored([_block(13, cache_level=1)]), False),
    (_stored([_block(14), _block(15, cache_level=1), _block(16)]), False),
    (_stored([_block(17, cache_salt="s")]), False),
    (_stored([_block(18, lora_id=3)]), False),
    (_stored([_block(19, lora_id=0)]), True),
    (_stored([_block(20)], lora_name="sql"), False),
    (_stored([_block(21, mm_keys=[{"hash": "ab", "start_offset": 0}])]), False),
    (_stored([_block(22, mm_keys=[])]), True),
    (_stored([{**_block(23), "tokens": _tokens((1, 2, 3, 4), extra=9)}]), False),
    (_stored([_block(24), _block(25, (1, 2))]), False),  # a partial tail
    (_stored([_block(26)], parent=25), False),  # chained onto the partial block
    (_stored([_block(27, (1, 2, 3, 4, 5))]), False),
    (_stored([_block("ff" * 32)], parent="00" * 32), False),
    (_stored([_block("zz")]), False),
    (_stored([_block(2**64)]), False),
    (_stored([_block(-(2**63) - 1)]), False),
    (_stored([_block(28, ("0x1f", 2, 3, 4))]), False),
    (_stored([_block(29, (1, -2, 3, 4))]), False),
    (_stored([_block(30, (1, 2, 3, 2**32))]), False),
    (_stored([_block(31)], parent="zz"), True),  # dropped there, as the per-block step would
    (_stored([]), False),
    (_stored([_block(32, cache_level=None)]), None),  # null: not typed, the checked reader's
    (_stored([_block(33, (True, 2, 3, 4))]), None),
    (_stored([_block(34, cache_salt=5)]), None),
    (_stored([_block(35)], lora_name=7), None),
    ({"parent_hash": None, "blocks": [_block(36)]}, None),  # no "type"
    ({"type": "removed", "blocks": [_block(37)], "block_hashes": [10]}, None),
    ({"type": "removed", "block_hashes": [10, 11]}, None),
    ({"type": "updated", "block_hash": 12, "cache_level": {"old_value": 0, "new_value": 1}}, None),
]


def test_every_kind_of_store_gives_the_checked_readers_events_counts_and_state():
    typed, checked = TrtllmDecoder("t", BS), TrtllmDecoder("t", BS)
    per_block_calls = []
    per_block = typed._stored
    typed._stored = lambda *a: per_block_calls.append(a) or per_block(*a)  # type: ignore
    next_id = {0: 0, 1: 0}  # each rank's stream counts from 0, no gaps
    for i, (data, whole) in enumerate(STORES):
        rank = int(i % 4 == 3)  # a second attention-DP rank now and then
        envelope = {"event_id": next_id[rank], "window_size": 64, "data": data}
        next_id[rank] += 1
        if rank:
            envelope["attention_dp_rank"] = rank
        body = json.dumps([envelope]).encode()
        assert _typed_count(body) == (whole is not None), data
        calls = len(per_block_calls)
        events, why = compare_readers(body, typed, checked)
        assert why is None, data
        if whole is not None:  # typed: taken whole, or handed to the per-block step
            assert len(per_block_calls) == calls + (not whole), data
    assert typed.counts["stored_blocks"] > 10 and typed.drops  # both kept and dropped seen
    assert typed.counts["gaps"] == 0 and typed.counts["partial_blocks"] == 1


def test_a_stream_of_mixed_answers_agrees_envelope_by_envelope():
    import random

    rng = random.Random(5)
    typed, checked = TrtllmDecoder("t", BS), TrtllmDecoder("t", BS)
    event_id = 0
    for _ in range(200):
        answer = []
        for _ in range(rng.randrange(0, 6)):
            data, _ = rng.choice(STORES)
            answer.append({"event_id": event_id, "window_size": 64, "data": data})
            event_id += rng.choice([1, 1, 1, 1, 2])  # now and then a gap
        events, why = compare_readers(json.dumps(answer).encode(), typed, checked)
        assert why is None
    assert typed.counts["gaps"] > 0


@pytest.mark.parametrize(
    "body",
    [
        # not UTF-8, in a string of a stored envelope the typed reader skips unread
        json.dumps([{"event_id": 0, "data": _stored([_block(1)])}])
        .encode()
        .replace(b'"stored_block"', b'"stored_block\xff"'),
        b'{"event_id": 0}',  # not a list
        b"[" * 100_000 + b"]" * 100_000,
        b'[{"event_id": 0, "data": ' + json.dumps(_stored([_block(1)])).encode()[:-1] + b"]",
        # out of a float's range in a field the typed reader reads, and in a removed envelope
        json.dumps([{"event_id": 0, "data": _stored([_block(1)])}])
        .encode()
        .replace(b'"block_hash": 1', b'"block_hash": 1e999'),
        b'[{"event_id": 0, "data": {"type": "removed", "block_hashes": [1], "x": 1e999}}]',
    ],
)
def test_answers_a_plain_decode_refuses_are_refused_whole(body):
    envelopes, why = parse_answer(body)
    assert envelopes is None and why
    events, disagreement = compare_readers(body, TrtllmDecoder("t", BS), TrtllmDecoder("t", BS))
    assert events is None and disagreement is None


def test_an_out_of_range_number_in_a_field_kvplug_does_not_read_is_skipped():
    # the one answer parse_answer takes that a plain msgspec decode refuses: documented there
    body = json.dumps([{"event_id": 0, "data": _stored([_block(1)])}]).encode()
    body = body.replace(b'"priority": 35', b'"priority": 1e999')
    envelopes, _ = parse_answer(body)
    assert envelopes is not None
    events, why = compare_readers(body, TrtllmDecoder("t", BS), TrtllmDecoder("t", BS))
    assert why is None and events is not None and len(events) == 1


def test_the_answer_encoder_round_trips_and_joins_removals_as_trtllm_does():
    """``encode_answer`` (benchmarks and test engines use it) renders what the decoder reads
    back; a removal right after a removal is one envelope, as TRT-LLM's event manager makes."""
    from kvplug.integrations.trtllm.events import encode_answer

    from kvplug.events import BlockRemoved, BlockStored

    events = [
        BlockStored(worker_id="t", engine_hashes=[1, 2], token_ids=list(range(8)), block_size=4),
        BlockRemoved(worker_id="t", engine_hashes=[7]),
        BlockRemoved(worker_id="t", engine_hashes=[8, 9]),
        BlockStored(
            worker_id="t", parent_engine_hash=2, engine_hashes=[3], token_ids=[9] * 4, block_size=4
        ),
        BlockRemoved(worker_id="t", engine_hashes=[1]),
    ]
    body, n = encode_answer(events, 5, BS)
    assert n == 4 and [e["event_id"] for e in json.loads(body)] == [5, 6, 7, 8]
    dec = TrtllmDecoder("t", BS)
    got = dec.decode(parse_answer(body)[0])
    assert got == [
        events[0],
        BlockRemoved(worker_id="t", engine_hashes=[7, 8, 9]),
        events[3],
        events[4],
    ]
    assert _typed_count(body) == 2
