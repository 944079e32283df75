"""TRT-LLM event JSON (1.x and 2026 fixtures) → exact normalised events; stream rules."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from kvplug.integrations.trtllm.events import TrtllmDecoder, _block_extra

from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier

DATA = Path(__file__).parent / "data" / "trtllm"


def _load_builder():
    spec = importlib.util.spec_from_file_location("trtllm_fixture_build", DATA / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _load_builder()
BIG1, BIG2, BIG3 = B.BIG1, B.BIG2, B.BIG3


def _fixture(name: str):
    return json.loads((DATA / name).read_bytes())


@pytest.mark.parametrize("name", sorted(B.FILES))
def test_fixture_files_are_what_the_builder_renders(name):
    assert (DATA / name).read_bytes() == B.FILES[name]()


def test_v1_drain_decodes_to_expected_events():
    dec = TrtllmDecoder("t", tokens_per_block=4)
    out = dec.decode(_fixture("v1_events.json"))
    assert out == [
        AllCleared(worker_id="t", dp_rank=0),  # created: a (re)start of the cache
        BlockStored(
            worker_id="t",
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[101, BIG1],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
        ),
        # the chain stops at the partial block 103 (2 tokens)
        BlockStored(
            worker_id="t",
            tier=Tier.DEVICE,
            parent_engine_hash=BIG1,
            engine_hashes=[BIG2],
            token_ids=[9, 10, 11, 12],
            block_size=4,
        ),
        BlockMoved(worker_id="t", from_tier=Tier.DEVICE, to_tier=Tier.HOST, engine_hashes=[101]),
        # event 4 changes only the priority: nothing; event 5 removes 103 (swallowed) and BIG2
        BlockRemoved(worker_id="t", engine_hashes=[BIG2]),
        BlockStored(
            worker_id="t",
            tier=Tier.HOST,
            parent_engine_hash=None,
            engine_hashes=[BIG3],
            token_ids=[20, 21, 22, 23],
            block_size=4,
        ),
    ]
    assert dec.ranks[0].window == 4096
    assert dec.ranks[0].capacity_blocks == [1024, 4096]
    assert dec.ranks[0].partial == set()
    assert dec.counts["partial_removes_swallowed"] == 1
    assert not dec.drops


def test_2026_vswa_adp_drain_decodes_to_expected_events():
    dec = TrtllmDecoder("t2", tokens_per_block=4, lora_names={3: "sql-lora"})
    out = dec.decode(_fixture("v2026_vswa_adp_events.json"))
    mm_extra = _block_extra(
        [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 0}], [0, 0, 0, 0]
    )
    assert mm_extra != 0
    assert out == [
        AllCleared(worker_id="t2", dp_rank=0),  # one clear per created run, not per window
        AllCleared(worker_id="t2", dp_rank=1),
        # the 512-token window's copy is skipped; the 8192 window's is split by tier
        BlockStored(
            worker_id="t2",
            dp_rank=0,
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[BIG1, 201],
            token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            block_size=4,
            cache_salt="tenant-a",
            lora_name="sql-lora",
        ),
        BlockStored(
            worker_id="t2",
            dp_rank=0,
            tier=Tier.HOST,
            parent_engine_hash=201,
            engine_hashes=[202],
            token_ids=[9, 10, 11, 12],
            block_size=4,
            cache_salt="tenant-a",
            lora_name="sql-lora",
        ),
        # rank 1: the multimodal block carries its extra key; hex token ids stop the chain
        BlockStored(
            worker_id="t2",
            dp_rank=1,
            tier=Tier.DEVICE,
            parent_engine_hash=None,
            engine_hashes=[301],
            token_ids=[7, 7, 7, 7],
            block_size=4,
            block_extra=[mm_extra],
        ),
        BlockRemoved(worker_id="t2", dp_rank=0, engine_hashes=[202]),
    ]
    assert dec.ranks[0].window == 8192 and dec.ranks[1].window == 8192
    assert dec.ranks[0].capacity_blocks == [2048, 8192]
    assert dec.drops == {"hex_token_ids": 1}
    assert dec.counts["other_window_skipped"] == 1
    assert dec.counts["priority_updates_ignored"] == 1
    assert dec.hash_algo == "v1_block_key"


def test_gap_and_restart_clear_and_resync():
    dec = TrtllmDecoder("t", tokens_per_block=4)
    drains = _fixture("gap_restart_drains.json")
    first = dec.decode(drains[0])
    assert [type(e) for e in first] == [AllCleared, BlockStored, BlockStored]
    gap = dec.decode(drains[1])  # ids 3 and 4 never arrived
    assert gap[0] == AllCleared(worker_id="t", dp_rank=0)
    assert gap[1:] == [
        BlockStored(
            worker_id="t",
            parent_engine_hash=None,
            engine_hashes=[14],
            token_ids=[1, 2, 3, 4],
            block_size=4,
        ),
        BlockStored(
            worker_id="t",
            parent_engine_hash=14,
            engine_hashes=[15],
            token_ids=[30, 31, 32, 33],
            block_size=4,
        ),
    ]
    assert dec.counts["gaps"] == 1
    assert dec.decode(drains[2]) == []  # an empty drain: nothing new, not "zero blocks"
    restart = dec.decode(drains[3])  # ids back to 0 with created
    assert restart == [
        AllCleared(worker_id="t", dp_rank=0),
        BlockStored(
            worker_id="t",
            parent_engine_hash=None,
            engine_hashes=[21],
            token_ids=[40, 41, 42, 43],
            block_size=4,
        ),
    ]
    assert dec.counts["gaps"] == 1 and dec.counts["id_regressions"] == 0
    assert dec.decode(drains[4]) == [BlockRemoved(worker_id="t", engine_hashes=[21])]


def test_id_regression_without_created_clears():
    dec = TrtllmDecoder("t", tokens_per_block=1)
    stored = {
        "type": "stored",
        "parent_hash": None,
        "blocks": [{"block_hash": 1, "tokens": [{"token_id": 5}]}],
    }
    dec.decode([{"event_id": 7, "data": stored}])
    out = dec.decode([{"event_id": 3, "data": stored}])
    assert out[0] == AllCleared(worker_id="t", dp_rank=0)
    assert dec.counts["id_regressions"] == 1


def test_late_subscriber_adopts_first_window_and_switches_to_a_larger_one():
    dec = TrtllmDecoder("t", tokens_per_block=1)

    def stored(eid, window, h):
        return {
            "event_id": eid,
            "window_size": window,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [{"block_hash": h, "tokens": [{"token_id": 1}]}],
            },
        }

    assert len(dec.decode([stored(10, 512, 1)])) == 1
    out = dec.decode([stored(11, 4096, 2), stored(12, 512, 3), stored(13, 4096, 4)])
    assert [type(e) for e in out] == [AllCleared, BlockStored, BlockStored]
    assert [e.engine_hashes for e in out[1:]] == [[2], [4]]


def test_events_without_window_or_rank_are_rank_zero_and_indexed():
    dec = TrtllmDecoder("t", tokens_per_block=2)
    out = dec.decode(
        [
            {
                "event_id": 0,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"block_hash": 9, "tokens": [{"token_id": 1}, {"token_id": 2}]}],
                },
            }
        ]
    )
    assert out == [BlockStored(worker_id="t", engine_hashes=[9], token_ids=[1, 2], block_size=2)]


def test_hex_string_hashes_fold_to_u64_and_zero_parent_is_root():
    dec = TrtllmDecoder("t", tokens_per_block=1)
    out = dec.decode(
        [
            {
                "event_id": 0,
                "hash_algo": "v2_sha256",
                "data": {
                    "type": "stored",
                    "parent_hash": "00" * 32,
                    "blocks": [{"block_hash": "11" * 32, "tokens": [{"token_id": 3}]}],
                },
            }
        ]
    )
    assert out == [
        BlockStored(worker_id="t", engine_hashes=[0x1111111111111111], token_ids=[3], block_size=1)
    ]


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        ("not-an-object", "bad_event"),
        ({"event_id": 1}, "bad_event"),
        ({"event_id": -1, "data": {"type": "removed", "block_hashes": []}}, "bad_event"),
        (
            {
                "event_id": 1,
                "attention_dp_rank": "0",
                "data": {"type": "removed", "block_hashes": []},
            },
            "bad_event",
        ),
        ({"event_id": 1, "data": {"type": "exploded"}}, "unknown_event"),
        ({"event_id": 1, "data": {"type": "removed", "block_hashes": [2**64]}}, "bad_hash"),
        ({"event_id": 1, "data": {"type": "removed", "block_hashes": ["zz"]}}, "bad_hash"),
        ({"event_id": 1, "data": {"type": "removed"}}, "bad_event"),
        ({"event_id": 1, "data": {"type": "stored", "parent_hash": None}}, "bad_event"),
        (
            {
                "event_id": 1,
                "data": {
                    "type": "updated",
                    "block_hash": 5,
                    "cache_level": {"old_value": 0, "new_value": 7},
                },
            },
            "bad_cache_level",
        ),
    ],
)
def test_bad_envelopes_are_dropped_and_counted_alone(envelope, reason):
    dec = TrtllmDecoder("t", tokens_per_block=1)
    good = {
        "event_id": 0,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": 1, "tokens": [{"token_id": 1}]}],
        },
    }
    out = dec.decode([good, envelope])
    assert out == [BlockStored(worker_id="t", engine_hashes=[1], token_ids=[1], block_size=1)]
    assert dec.drops == {reason: 1}


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (
            {"block_hash": 2, "tokens": [{"token_id": 1}, {"token_id": 2}, {"token_id": 3}]},
            "block_size_mismatch",
        ),
        ({"block_hash": 2, "tokens": [{"token_id": -4}, {"token_id": 2}]}, "bad_tokens"),
        ({"block_hash": 2, "tokens": [7, 8]}, "bad_tokens"),
        (
            {"block_hash": 2, "tokens": [{"token_id": 1}, {"token_id": 2}], "cache_level": 2},
            "bad_cache_level",
        ),
        ({"block_hash": None, "tokens": []}, "bad_hash"),
        ("block", "bad_block"),
    ],
)
def test_a_bad_block_stops_the_chain_but_keeps_the_blocks_before_it(block, reason):
    dec = TrtllmDecoder("t", tokens_per_block=2)
    good = {"block_hash": 1, "tokens": [{"token_id": 1}, {"token_id": 2}]}
    after = {"block_hash": 3, "tokens": [{"token_id": 5}, {"token_id": 6}]}
    out = dec.decode(
        [
            {
                "event_id": 0,
                "data": {"type": "stored", "parent_hash": None, "blocks": [good, block, after]},
            }
        ]
    )
    assert out == [BlockStored(worker_id="t", engine_hashes=[1], token_ids=[1, 2], block_size=2)]
    assert dec.drops == {reason: 1}


def test_empty_envelopes_are_skipped_without_a_drop_or_a_gap():
    dec = TrtllmDecoder("t", tokens_per_block=1)
    removed = {"type": "removed", "block_hashes": [4]}
    out = dec.decode([{"event_id": 0, "data": removed}, {}, {"event_id": 1, "data": removed}])
    assert out == [BlockRemoved(worker_id="t", engine_hashes=[4])] * 2
    assert not dec.drops and dec.counts["gaps"] == 0 and dec.counts["empty_envelopes"] == 1


def test_event_level_lora_name_and_per_block_salt():
    dec = TrtllmDecoder("t", tokens_per_block=1, lora_names={7: "from-id"})
    blocks = [{"block_hash": 1, "tokens": [{"token_id": 5}], "lora_id": 7, "cache_salt": "s"}]
    out = dec.decode(
        [
            {
                "event_id": 0,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": blocks,
                    "lora_name": "adapter-b",
                },
            },
            {
                "event_id": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [dict(blocks[0], block_hash=2)],
                },
            },
            {
                "event_id": 2,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [dict(blocks[0], block_hash=3, lora_id="x")],
                },
            },
        ]
    )
    assert [(e.lora_name, e.cache_salt) for e in out] == [("adapter-b", "s"), ("from-id", "s")]
    assert dec.drops == {"bad_field": 1}


def test_answer_that_is_not_a_list_is_dropped():
    dec = TrtllmDecoder("t", tokens_per_block=2)
    assert dec.decode({"error": "boom"}) == []
    assert dec.drops == {"bad_batch": 1}


def test_store_chained_on_a_partial_block_is_dropped_and_lost_stream_clears_all_ranks():
    dec = TrtllmDecoder("t", tokens_per_block=2)
    dec.decode(
        [
            {
                "event_id": 0,
                "attention_dp_rank": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"block_hash": 8, "tokens": [{"token_id": 1}]}],
                },
            }
        ]
    )
    out = dec.decode(
        [
            {
                "event_id": 1,
                "attention_dp_rank": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": 8,
                    "blocks": [{"block_hash": 9, "tokens": [{"token_id": 1}, {"token_id": 2}]}],
                },
            }
        ]
    )
    assert out == [] and dec.drops == {"parent_partial": 1}
    assert dec.lost_stream() == [AllCleared(worker_id="t", dp_rank=1)]
    assert dec.ranks[1].last_event_id is None and dec.ranks[1].partial == set()
