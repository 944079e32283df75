"""The router pre-sizes its index for the fleet's KV capacity (Router._presize_index): filling
the index up to that capacity never grows a table, i.e. never stops the event loop for a
rehash of the whole table, and a capacity learnt later keeps what is indexed."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvplug import router as router_mod
from kvplug.config import RouterConfig
from kvplug.core import load_backend
from kvplug.events import BlockStored
from kvplug.index import KvIndex
from kvplug.router import Router
from kvplug.workers import Worker

BS = 16
load_backend("c")  # the compiled core is required here (the reference never pre-sizes)


def make(capacity: int, workers: int = 4, **cfg) -> Router:
    index = KvIndex(BS, max_entries=cfg.get("router_max_index_entries", 0), backend="c")
    r = Router(RouterConfig(kv_block_size=BS, **cfg), index=index)
    for i in range(workers):
        r.add_worker(Worker(f"w{i}", kv_capacity_blocks=capacity))
    return r


def fill(r: Router, blocks: int, workers: int = 4, start: int = 0) -> list[int]:
    """``blocks`` distinct blocks, 25 per store event, over the workers in turn."""
    rng = np.random.default_rng(start)
    hashes = rng.integers(1, 2**63, size=blocks, dtype=np.int64).astype(np.uint64).tolist()
    for k in range(0, blocks, 25):
        r.apply_event(
            BlockStored(
                worker_id=f"w{(k // 25) % workers}",
                engine_hashes=list(range(start + k, start + min(k + 25, blocks))),
                block_hashes=hashes[k : k + 25],
            )
        )
    return hashes


def memory(r: Router) -> int:
    return r.index.core.memory_bytes()


@pytest.mark.parametrize("capacity", [0, 5_000])
def test_filling_to_the_declared_capacity_never_grows_a_table(capacity):
    r = make(capacity)
    fill(r, 100)  # every worker has stored: per-endpoint scratch exists
    before = memory(r)
    fill(r, 19_900, start=100)
    st = r.index.core.stats()
    assert st["blocks"] == st["engine_mappings"] == 20_000
    assert r.index.core._verify() == 0
    assert r.stats()["index_presized_blocks"] == r._index_presized
    if capacity:
        assert r._index_presized == 4 * capacity
        assert memory(r) == before  # every table, the record pool and the engine map sized
    else:  # unknown capacity: the tables grow as they fill (the control of the check above)
        assert r._index_presized == 0
        assert memory(r) > before + 19_900 * 16


def test_a_capacity_reported_later_keeps_what_is_indexed():
    r = make(0)
    hashes = fill(r, 3_000)
    for i in range(4):  # the engines report num_gpu_blocks once running (re-registration)
        r.add_worker(Worker(f"w{i}", kv_capacity_blocks=10_000))
    assert r._index_presized == 40_000
    for k in range(0, 3_000, 25):  # every stored block still found, on its worker
        scores = r.index.core.query(hashes[k : k + 25]).scores()
        assert scores == {r.index.endpoint_id(f"w{(k // 25) % 4}"): 25}
    grown = memory(r)
    fill(r, 30_000, start=3_000)
    assert memory(r) == grown
    assert r.index.core._verify() == 0


def test_room_only_grows_and_stays_within_the_bounds(monkeypatch):
    r = make(5_000)
    r.remove_worker("w3")  # a worker leaving keeps the room
    r.add_worker(Worker("w3", kv_capacity_blocks=1_000))
    assert r._index_presized == 20_000
    bounded = make(5_000, router_max_index_entries=12_000)  # the LRU bound caps it
    assert bounded._index_presized == 12_000
    monkeypatch.setattr(router_mod, "INDEX_PRESIZE_MAX", 7_000)
    typo = make(10**12, workers=1)  # a capacity typed or reported wrong
    assert typo._index_presized == 7_000


def test_a_failed_reservation_is_logged_and_routing_goes_on(monkeypatch, caplog):
    def no_memory(blocks: int) -> None:
        raise MemoryError(f"{blocks} blocks")

    monkeypatch.setattr(KvIndex, "reserve", lambda self, blocks: no_memory(blocks))
    with caplog.at_level(logging.WARNING, logger="kvplug.router"):
        r = make(5_000)
    assert r._index_presized == 0
    assert "could not pre-size the index for 5000 blocks" in caplog.text
    fill(r, 1_000)
    assert r.index.core.stats()["blocks"] == 1_000


@pytest.mark.parametrize(
    ("capacity", "cap_blocks"), [(0, 1 << 20), (5_000, 1 << 20), (5_000, 8_000)]
)
def test_approximate_mode_side_index_is_presized_too(capacity, cap_blocks):
    """Approximate mode records every routed prompt in a side index, on the same event loop:
    it gets room for the fleet's capacity within its block cap, so recording up to that
    never grows a table (with no capacity known, the control: its tables grow)."""
    from kvplug.request import RouteRequest

    r = make(capacity, router_kv_events=False, router_max_tree_size=cap_blocks)
    side = r._approx
    assert r.stats()["approx"]["presized_blocks"] == min(4 * capacity, cap_blocks)
    rng = np.random.default_rng(7)

    def route(i: int) -> None:  # a 400-token prompt: 25 new blocks for the side index
        toks = rng.integers(0, 50_000, 25 * BS).tolist()
        r.route(RouteRequest(f"r{i}", toks))
        r.on_finish(f"r{i}")

    route(0)
    before = side.index.core.memory_bytes()
    for i in range(1, 300):
        route(i)
    assert side.stats()["blocks"] == 300 * 25 or side.counters["capped"] > 0
    if capacity:
        assert side.index.core.memory_bytes() == before
    else:
        assert side.index.core.memory_bytes() > before
