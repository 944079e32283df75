"""vLLM ingestion: the compiled decoder and the msgspec decoder, with removes coalesced across
stores, build exactly the index that applying the engine's events one by one builds."""

from __future__ import annotations

import random

import pytest
from kvplug.integrations.vllm.wire import FAST_PATH, BatchDecoder, coalesce_removes, encode_batch

from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier
from kvplug.index import KvIndex

# versions whose wire form carries the medium (older ones publish the device tier only)
VERSIONS = ["0.10.2", "0.17.0", "0.23.0", "0.24.0", "0.32.0"]


def _engine_batches(seed: int, n_batches: int, block_sizes: tuple[int, ...]):
    """Batches shaped like a vLLM step, over a small hash universe so that orders matter:
    evictions interleaved with stores, removes of hashes a store of the same batch just
    stored or chains to, re-stores of evicted hashes, duplicates, tier copies, clears, and
    stores of another block size (which the decoder drops)."""
    rng = random.Random(seed)
    held: list[int] = []
    out = []
    for _ in range(n_batches):
        evs: list = []
        for _ in range(rng.randrange(1, 9)):
            r = rng.random()
            if r < 0.45:
                nb = rng.randrange(1, 5)
                bs = rng.choice(block_sizes)
                hs = [rng.randrange(1, 300) for _ in range(nb)]
                parent = rng.choice(held) if held and rng.random() < 0.7 else None
                evs.append(
                    BlockStored(
                        worker_id="w",
                        engine_hashes=hs,
                        parent_engine_hash=parent,
                        token_ids=[
                            rng.randrange(0, rng.choice([100, 60000, 200000]))
                            for _ in range(nb * bs)
                        ],
                        block_size=bs,
                        tier=rng.choice([Tier.DEVICE, Tier.DEVICE, Tier.HOST]),
                    )
                )
                held.extend(hs)
            elif r < 0.5 and held:
                evs.append(
                    BlockStored(
                        worker_id="w",
                        engine_hashes=rng.sample(held, min(len(held), rng.randrange(1, 3))),
                        tier_copy=True,
                        tier=Tier.DISK,
                    )
                )
            elif r < 0.99:
                # one event per evicted hash, as vLLM sends them; often a hash just stored
                recent = [h for e in evs if isinstance(e, BlockStored) for h in e.engine_hashes]
                pool = recent if recent and rng.random() < 0.3 else (held or [7])
                h = rng.choice(pool)
                tier = rng.choice([Tier.DEVICE] * 4 + [Tier.HOST])
                evs.append(BlockRemoved(worker_id="w", engine_hashes=[h], tier=tier))
            else:
                evs.append(AllCleared(worker_id="w"))
                held.clear()
        out.append((evs, encode_batch(evs, rng.choice(VERSIONS), ts=1.0, dp_rank=0)))
    return out


def _index(block_size: int) -> KvIndex:
    idx = KvIndex(block_size)
    idx.add_endpoint("w")
    return idx


def _state(idx: KvIndex) -> tuple:
    ep = idx.endpoint_id("w")
    st = idx.stats()
    held = {h: list(c) for h, c in idx.core.holdings(ep).items()}
    return held, st["blocks"], st["entries"], st["engine_mappings"], st["orphan_stores"]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_both_decoders_build_the_index_the_events_build(block_size, seed):
    batches = _engine_batches(seed, 150, (16, 32, 8))
    truth, via_fast, via_slow = _index(block_size), _index(block_size), _index(block_size)
    fast = BatchDecoder("w", block_size=block_size)
    slow = BatchDecoder("w", block_size=block_size)
    slow.use_fast = False
    wire_removes = out_removes = peak = 0
    for evs, payload in batches:
        for e in evs:  # the engine's events, one index call each (other block sizes: dropped)
            truth.apply_many([e])
        a, b = fast.decode(payload), slow.decode(payload)
        assert a is not None and b is not None
        via_fast.apply_many(a.events)
        via_slow.apply_many(b.events)
        wire_removes += sum(isinstance(e, BlockRemoved) for e in evs)
        out_removes += sum(isinstance(e, BlockRemoved) for e in a.events)
        assert _state(via_fast) == _state(truth)
        assert _state(via_slow) == _state(truth)
        peak = max(peak, _state(truth)[1])
    assert peak > 10
    assert out_removes < wire_removes * 0.7  # removes were coalesced across stores
    if FAST_PATH:  # batches with only matching block sizes took the compiled path
        assert 0 < fast.stats.fast_batches < fast.stats.batches
    assert slow.stats.block_size_mismatch > 0  # the other sizes were dropped, counted


def test_coalescing_keeps_order_where_it_matters():
    s1 = BlockStored(worker_id="w", engine_hashes=[5, 6], token_ids=[1] * 64, block_size=32)
    s2 = BlockStored(
        worker_id="w", engine_hashes=[9], parent_engine_hash=6, token_ids=[2] * 32, block_size=32
    )

    def rm(*hs, tier=Tier.DEVICE):
        return BlockRemoved(worker_id="w", engine_hashes=list(hs), tier=tier)

    def shape(evs):
        return [(type(e).__name__, [int(h) for h in getattr(e, "engine_hashes", [])]) for e in evs]

    # independent evictions gather into the first remove
    assert shape(coalesce_removes([rm(1), s1, rm(2), s2, rm(3)])) == [
        ("BlockRemoved", [1, 2, 3]),
        ("BlockStored", [5, 6]),
        ("BlockStored", [9]),
    ]
    # a remove of a hash a store in between holds, or chains to, keeps its place
    assert shape(coalesce_removes([rm(1), s1, rm(5), rm(2)])) == [
        ("BlockRemoved", [1]),
        ("BlockStored", [5, 6]),
        ("BlockRemoved", [5, 2]),
    ]
    assert shape(coalesce_removes([rm(1), s2, rm(6)])) == [
        ("BlockRemoved", [1]),
        ("BlockStored", [9]),
        ("BlockRemoved", [6]),
    ]
    # another tier, or a clear, starts a new event
    assert len(coalesce_removes([rm(1), rm(2, tier=Tier.HOST), rm(3)])) == 3
    cleared = AllCleared(worker_id="w")
    assert len(coalesce_removes([rm(1), cleared, rm(2)])) == 3
    # the compiled decoder applies the same rule
    for evs in ([rm(1), s1, rm(5), rm(2)], [rm(1), s1, rm(2), s2, rm(3)], [rm(1), s2, rm(6)]):
        payload = encode_batch(evs, "0.32.0", ts=1.0)
        dec = BatchDecoder("w", block_size=32)
        got = dec.decode(payload)
        assert got is not None
        assert shape(got.events) == shape(coalesce_removes(evs))
        if FAST_PATH:
            assert dec.stats.fast_batches == 1
