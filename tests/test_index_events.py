"""KvIndex: endpoints, normalised events, drops, namespaces; every test on both backends."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvplug.errors import InvalidEvent, UnknownWorker
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier
from kvplug.hashing import namespace_seed
from kvplug.index import KvIndex

BS = 4
TOKS = list(range(100, 116))  # four blocks


@pytest.fixture(params=["c", "reference"])
def kv(request):
    idx = KvIndex(BS, backend=request.param)
    idx.add_endpoint("a")
    idx.add_endpoint("b", 0)
    idx.add_endpoint("b", 1)
    return idx


def stored(worker, ehs, toks, rank=0, **kw):
    return BlockStored(worker_id=worker, dp_rank=rank, engine_hashes=ehs, token_ids=toks, **kw)


def test_endpoint_ids_dense_idempotent_and_reused(kv):
    assert kv.endpoint_id("a") == 0 and kv.endpoint_id("b", 1) == 2
    assert kv.add_endpoint("b", 1) == 2
    assert kv.endpoint_key(1) == ("b", 0)
    kv.remove_worker("b")
    assert kv.endpoint_id("b", 0) is None
    assert kv.add_endpoint("c") == 1  # lowest freed id first
    assert kv.n_endpoint_ids == 3


def test_request_hashes_match_token_events(kv):
    kv.apply(stored("a", [1, 2], TOKS[:8]))
    kv.apply(stored("a", [3], TOKS[8:12], parent_engine_hash=2))
    kv.apply(stored("b", [9], TOKS[:4], rank=1, tier=Tier.HOST))
    ov = kv.query(kv.request_hashes(TOKS + [1, 2]))
    assert ov.row(0) == (3, 3, 0, 0, 0)
    assert ov.row(2) == (1, 0, 1, 0, 0)
    assert ov.row(1) == (0, 0, 0, 0, 0)
    assert ov.walked == 4 and len(ov.local) >= 3
    assert list(ov.endpoints()) == [0, 2]


def test_namespaces_separate_and_match(kv):
    kv.apply(stored("a", [1], TOKS[:4], lora_name="sql", cache_salt="t1"))
    assert kv.query(kv.request_hashes(TOKS[:4])).row(0)[0] == 0
    assert kv.query(kv.request_hashes(TOKS[:4], lora_name="sql")).row(0)[0] == 0
    assert kv.query(kv.request_hashes(TOKS[:4], "sql", "t1")).row(0)[0] == 1
    assert namespace_seed() == 0 and namespace_seed("", "") == 0
    assert len({namespace_seed("x"), namespace_seed(None, "x"), namespace_seed("x", "x")}) == 3


def test_block_extra_changes_match(kv):
    kv.apply(stored("a", [1, 2], TOKS[:8], block_extra=[0, 77]))
    assert kv.query(kv.request_hashes(TOKS[:8])).row(0)[0] == 1
    assert kv.query(kv.request_hashes(TOKS[:8], block_extra=[0, 77])).row(0)[0] == 2


def test_removed_moved_cleared(kv):
    kv.apply(stored("a", [1, 2, 3], TOKS[:12]))
    h = kv.request_hashes(TOKS)
    kv.apply(BlockMoved(worker_id="a", from_tier=Tier.DEVICE, to_tier=Tier.DISK, engine_hashes=[2]))
    assert kv.query(h).row(0) == (3, 2, 0, 1, 0)
    kv.apply(BlockRemoved(worker_id="a", engine_hashes=[3]))
    assert kv.query(h).row(0)[0] == 2
    kv.apply(AllCleared(worker_id="a"))
    assert kv.query(h).row(0)[0] == 0
    assert kv.stats()["blocks"] == 0


def test_tier_copy_and_shared(kv):
    kv.apply(stored("a", [1, 2], TOKS[:8]))
    copy = BlockStored(worker_id="a", engine_hashes=[1, 2, 99], tier=Tier.HOST, tier_copy=True)
    kv.apply(copy)
    assert kv.stats()["unresolved_tier_copies"] == 1
    h = kv.request_hashes(TOKS[:8])
    kv.apply(BlockRemoved(worker_id="a", tier=Tier.DEVICE, engine_hashes=[1, 2]))
    assert kv.query(h).row(0) == (2, 0, 2, 0, 0)
    # a shared-tier copy (e.g. LMCache): every endpoint sees it beyond its local prefix
    kv.apply(BlockStored(worker_id="a", engine_hashes=[1, 2], shared=True, tier_copy=True))
    ov = kv.query(h)
    assert ov.shared_prefix == 2 and ov.row(1) == (0, 0, 0, 0, 2)
    # shared store by tokens whose parent only the worker holds
    kv.apply(stored("a", [3], TOKS[8:12], parent_engine_hash=2))
    kv.apply(stored("a", [3], TOKS[8:12], parent_engine_hash=2, shared=True))
    assert kv.query(kv.request_hashes(TOKS[:12])).shared_prefix == 3
    kv.apply(BlockRemoved(worker_id="a", engine_hashes=[1], shared=True))
    assert kv.query(h).shared_prefix == 0


def test_orphan_store_is_counted_not_raised(kv):
    kv.apply(stored("a", [5], TOKS[:4], parent_engine_hash=12345))
    assert kv.stats()["orphan_stores"] == 1 and kv.stats()["blocks"] == 0


def test_bad_events_raise_and_keep_state(kv):
    kv.apply(stored("a", [1, 2], TOKS[:8]))
    before = kv.stats()
    bad = [
        (stored("ghost", [1], TOKS[:4]), UnknownWorker),
        (stored("a", [7], TOKS[:3]), InvalidEvent),  # short block
        (stored("a", [7, 8], [1, 2, 3, -4, 5, 6, 7, 8]), InvalidEvent),  # negative token
        (stored("a", [7], [1, 2, 3, 2**33]), InvalidEvent),
        (stored("a", [7], TOKS[:4], block_size=16), InvalidEvent),
        (BlockStored(worker_id="a", engine_hashes=[7]), InvalidEvent),  # no tokens, no hashes
        (BlockStored(worker_id="a", engine_hashes=[7], block_hashes=[1, 2]), InvalidEvent),
        (BlockRemoved(worker_id="a", engine_hashes=[1], tier=7), InvalidEvent),
        (BlockMoved(worker_id="a", engine_hashes=[1], from_tier=0, to_tier=5), InvalidEvent),
        ("not an event", InvalidEvent),
    ]
    for ev, err in bad:
        with pytest.raises(err, match="worker|event"):
            kv.apply(ev)
    after = kv.stats()
    assert after == before
    assert kv.query(kv.request_hashes(TOKS[:8])).row(0)[0] == 2


def test_apply_many_counts_and_logs_drops(kv, caplog):
    events = [
        stored("a", [1], TOKS[:4]),
        stored("ghost", [1], TOKS[:4]),
        stored("a", [2], [1, 2, -3, 4], parent_engine_hash=1),
        stored("a", [2], TOKS[4:8], parent_engine_hash=1),
        BlockRemoved(worker_id="b", dp_rank=9, engine_hashes=[1]),
    ]
    with caplog.at_level(logging.WARNING, logger="kvplug.index"):
        rep = kv.apply_many(events)
    assert (rep.applied, rep.dropped, rep.blocks) == (2, 3, 2)
    assert rep.reasons == {"UnknownWorker": 2, "InvalidEvent": 1}
    assert "ghost" in caplog.text and "rank 9" in caplog.text
    assert kv.query(kv.request_hashes(TOKS[:8])).row(0)[0] == 2


def test_numpy_tokens_and_auto_add():
    kv = KvIndex(BS, auto_add=True)
    kv.apply(stored("new", [1, 2], np.array(TOKS[:8], dtype=np.int32)))
    assert kv.endpoint_id("new") == 0
    assert kv.query(kv.request_hashes(np.array(TOKS, dtype=np.int64))).row(0)[0] == 2


def test_overlaps_cover_registered_endpoints_without_blocks(kv):
    for i in range(20):
        kv.add_endpoint(f"w{i}")
    ov = kv.query(kv.request_hashes(TOKS))
    assert len(ov.local) >= kv.n_endpoint_ids and len(ov.shared_beyond) >= kv.n_endpoint_ids


def test_reserve_presizes_the_registered_endpoints(kv):
    """reserve(blocks) pre-sizes the block table, the records and the canonical engine map;
    the index works as before afterwards."""
    before = kv.stats().get("memory_bytes", 0)
    kv.reserve(3000)
    if kv.backend == "c":
        assert kv.stats()["memory_bytes"] >= before + 3000 * (16 + 8 + 6 + 6)
    kv.apply(stored("b", [1, 2, 3, 4], TOKS, rank=1))
    ov = kv.query(kv.request_hashes(TOKS))
    assert ov.local[kv.endpoint_id("b", 1)] == 4
