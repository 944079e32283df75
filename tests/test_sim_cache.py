"""The simulated paged KV cache: prefix hits, vLLM's eviction order, host tier, atomic admission."""

import json
from pathlib import Path

import pytest

from kvplug.events import Tier
from kvplug.sim.cache import BlockCache, CacheFull


def _recorder():
    log = []
    return log, lambda kind, tier, hashes: log.append((kind, tier, list(hashes)))


def test_prefix_hits_stop_at_first_miss():
    c = BlockCache(8)
    c.reserve(3)
    assert c.commit([1, 2, 3]) == [True, True, True]
    assert c.match_prefix([1, 2, 3, 4]) == (3, 0)
    assert c.match_prefix([1, 9, 3]) == (1, 0)  # a gap ends the prefix even if 3 is cached
    assert c.match_prefix([7, 1]) == (0, 0)


def test_commit_of_a_block_already_cached_returns_the_duplicate():
    c = BlockCache(8)
    c.reserve(2)
    c.commit([1, 2])
    c.reserve(2)
    assert c.commit([1, 3]) == [False, True]  # 1 computed twice: one copy, two references
    assert c.used == 3 and c.reserved == 0
    c.release([1, 2])
    assert c.lru_order() == [2]  # 1 still referenced by the second sequence


def test_eviction_order_is_lru_with_tail_blocks_first():
    log, sink = _recorder()
    c = BlockCache(6, sink=sink)
    c.reserve(3)
    c.commit([1, 2, 3])  # sequence A
    c.reserve(3)
    c.commit([4, 5, 6])  # sequence B
    c.release([1, 2, 3])  # A finishes first: freed tail first -> 3, 2, 1
    c.release([4, 5, 6])
    assert c.lru_order() == [3, 2, 1, 6, 5, 4]
    c.reserve(2)  # needs two blocks: evicts A's tail, keeps A's prefix
    assert log == [("removed", Tier.DEVICE, [3, 2])]
    assert c.match_prefix([1, 2, 3]) == (1, 0)
    c.acquire_cached([4])  # a hit moves a block out of the free queue
    assert c.lru_order() == [1, 6, 5]


def test_referenced_blocks_are_never_evicted():
    c = BlockCache(4)
    c.reserve(4)
    c.commit([1, 2, 3, 4])
    c.release([3, 4])
    assert c.free == 2
    with pytest.raises(CacheFull):
        c.reserve(3)
    assert c.used == 4 and c.match_prefix([1, 2, 3, 4]) == (4, 0)  # failed reserve changed nothing


def test_host_tier_offloads_on_eviction_and_reloads_on_hit():
    log, sink = _recorder()
    c = BlockCache(3, host_capacity=2, sink=sink)
    c.reserve(3)
    c.commit([1, 2, 3])
    c.release([1, 2, 3])  # free order 3, 2, 1
    c.reserve(2)  # evicts 3, 2 -> host
    assert log[-1] == ("moved", (Tier.DEVICE, Tier.HOST), [3, 2])
    assert c.match_prefix([1, 2, 3]) == (1, 2)
    dev, host = c.split_prefix([1, 2, 3])
    assert (dev, host) == ([1], [2, 3])
    c.unreserve(2)
    c.admit(dev, host, 0)  # reload 2 and 3 (device has room after unreserve)
    assert ("moved", (Tier.HOST, Tier.DEVICE), [2, 3]) in log
    assert c.counters["reloaded"] == 2 and not c.on_host(2) and c.on_device(3)


def test_host_tier_is_lru_bounded():
    log, sink = _recorder()
    c = BlockCache(1, host_capacity=2, sink=sink)
    for h in (1, 2, 3):
        c.reserve(1)  # evicts the previous block to host
        c.commit([h])
        c.release([h])
    c.reserve(1)  # 3 offloaded; host holds 1, 2, 3 -> 1 dropped
    assert c.host_blocks() == [2, 3]
    assert ("removed", Tier.HOST, [1]) in log


def test_an_inclusive_host_tier_keeps_copies_as_vllms_offloading_connector_does():
    """host_inclusive (vLLM's OffloadingConnector): blocks are copied to the host as stored, a
    device eviction drops the device copy only, a host hit is copied back and stays on the
    host."""
    log, sink = _recorder()
    c = BlockCache(3, host_capacity=4, sink=sink, host_inclusive=True)
    c.reserve(3)
    c.commit([1, 2, 3])
    c.store_host([1, 2, 3])
    assert log == [("host_stored", Tier.HOST, [1, 2, 3])] and c.host_blocks() == [1, 2, 3]
    c.release([1, 2, 3])  # free order 3, 2, 1
    c.reserve(2)  # evicts 3 and 2 from the device: their host copies stay
    assert log[-1] == ("removed", Tier.DEVICE, [3, 2]) and c.host_blocks() == [1, 2, 3]
    dev, host = c.split_prefix([1, 2, 3])
    assert (dev, host) == ([1], [2, 3])
    c.unreserve(2)
    c.admit(dev, host, 0)  # copied back: no event from the cache (the engine reports stores)
    assert log[-1] == ("removed", Tier.DEVICE, [3, 2])
    assert c.on_device(2) and c.on_host(2) and c.counters["reloaded"] == 2
    c.store_host([1, 2, 3, 4, 5])  # 4 and 5 need a copy evicted, and all are offered: no store
    assert c.host_blocks() == [1, 2, 3] and log[-1] == ("removed", Tier.DEVICE, [3, 2])
    c.store_host([4, 5])  # 1 is the oldest copy not offered
    assert log[-2:] == [("removed", Tier.HOST, [1]), ("host_stored", Tier.HOST, [4, 5])]
    assert c.host_blocks() == [2, 3, 4, 5]


def test_the_inclusive_host_tier_evicts_in_the_order_vllms_own_manager_does():
    """tests/data/vllm/offload_lru-0.32.0.json: vLLM 0.32.0's CPUOffloadingManager (LRU), six
    chunks, driven as its offloading connector drives it (make_offload_lru.py): stores, prefix
    hits loaded, request finishes. The inclusive host tier given the same operations evicts the
    same copies and keeps the rest in the same order after every one: a new copy goes in as the
    most recent, a copy offered again or loaded is used again only when its request finishes,
    the last block first (so the prefix's head is evicted last), and what a store offers is
    never evicted to make room for it."""
    doc = json.loads((Path(__file__).parent / "data/vllm/offload_lru-0.32.0.json").read_text())
    assert doc["manager_args"]["cache_policy"] == "lru"
    log, sink = _recorder()
    c = BlockCache(
        1, host_capacity=doc["manager_args"]["num_chunks"], sink=sink, host_inclusive=True
    )
    used: dict[str, list[int]] = {}  # each request's loaded or offered keys, in prefix order
    for op in doc["ops"]:
        before = len(log)
        keys, mine = op["keys"], used.setdefault(op["request"], [])
        if op["op"] == "store":
            c.store_host(keys)
            mine += [k for k in keys if k not in mine]
        elif op["op"] == "load":
            hit = c.match_prefix(keys)[1]  # the device holds none of them
            assert keys[:hit] == op["hit_keys"], op
            mine += [k for k in keys[:hit] if k not in mine]
        elif op["op"] == "finish":
            c.host_finished(mine)
        else:  # complete_store: the simulator's copies complete at once
            assert op["op"] == "complete_store", op
        evicted = [h for kind, tier, hs in log[before:] if kind == "removed" for h in hs]
        assert evicted == op["evicted"], op
        assert c.host_blocks() == op["resident_after"], op


def test_admit_is_atomic():
    c = BlockCache(4)
    c.reserve(2)
    c.commit([1, 2])
    c.release([1, 2])
    with pytest.raises(CacheFull):
        c.admit([1, 2], [], 3)  # hits 2 + new 3 > 4
    assert c.lru_order() == [2, 1] and c.reserved == 0
    c.admit([1, 2], [], 2)
    assert c.used == 4 and c.free == 0


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        BlockCache(0)
    with pytest.raises(ValueError):
        BlockCache(4, host_capacity=-1)


def test_reload_is_not_evicted_by_the_offloads_that_make_its_room():
    """Host tier full, the block to reload is the host's oldest: making device room offloads
    a block, which must not push the block being reloaded out of the host tier."""
    log, sink = _recorder()
    c = BlockCache(2, host_capacity=2, sink=sink)
    for h in (1, 2, 3, 4):  # each evicts the previous ones: host ends up holding 1, 2
        c.reserve(1)
        c.commit([h])
        c.release([h])
    assert c.host_blocks() == [1, 2] and c.lru_order() == [3, 4]
    log.clear()
    c.admit([], [1], 0)  # room comes from offloading 3: the host would overflow if 1 stayed
    assert c.on_device(1) and not c.on_host(1)
    assert c.host_blocks() == [2, 3]
    # every event is consistent with what the tiers held at the time
    assert log == [
        ("moved", (Tier.DEVICE, Tier.HOST), [3]),
        ("moved", (Tier.HOST, Tier.DEVICE), [1]),
    ]
