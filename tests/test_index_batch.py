"""KvIndex.apply_many (runs of plain token stores batched into one core call) against applying
the same events one by one with KvIndex.apply: identical index state, identical drop reports
and identical log lines, on both backends, with bad events mixed in (wrong lengths, unknown
parents and workers, wrong block sizes, bad tiers and tokens, short extra keys)."""

from __future__ import annotations

import logging
import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvplug.errors import KvplugError
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored
from kvplug.index import ApplyReport, KvIndex

BS = 2
WORKERS = ["a", "b"]
EXAMPLES = int(os.environ.get("KVPLUG_DIFF_EXAMPLES", "1000"))


def apply_each(kv: KvIndex, events) -> ApplyReport:
    """apply_many as it was before batching: one KvIndex.apply per event."""
    report = ApplyReport()
    for ev in events:
        try:
            kv.apply(ev)
        except (KvplugError, ValueError, TypeError, OverflowError) as err:
            kv._drop(report, ev, err)
            continue
        report.applied += 1
        hashes = getattr(ev, "engine_hashes", None)
        if hashes is not None:
            report.blocks += len(hashes)
    return report


@st.composite
def token_store(draw):
    """Mostly well-formed plain token stores (the batched kind), with every way to be bad."""
    n = draw(st.integers(0, 3))
    ehs = draw(st.lists(st.integers(0, 11), min_size=n, max_size=n))
    toks = draw(st.lists(st.integers(0, 1), min_size=n * BS, max_size=n * BS))
    kw: dict = {}
    flaw = draw(st.sampled_from(["none"] * 10 + ["long", "short", "token", "tier", "bs", "extra"]))
    if flaw == "long":
        toks = toks + [1]
    elif flaw == "short" and toks:
        toks = toks[:-1]
    elif flaw == "token" and toks:
        toks = [2**32] + toks[1:]
    elif flaw == "tier":
        kw["tier"] = 7
    elif flaw == "bs":
        kw["block_size"] = BS + 1
    elif flaw == "extra":
        kw["block_extra"] = [5] * max(0, n - 1)
    if flaw != "extra" and draw(st.booleans()):
        kw["block_extra"] = [draw(st.integers(0, 2))] * n
    if flaw != "token":  # (an unknown parent is an orphan whatever its tokens)
        kw["parent_engine_hash"] = draw(st.one_of(st.none(), st.integers(0, 11)))
    ns = draw(st.sampled_from([(None, None)] * 4 + [("lora", None), (None, "salt")]))
    return BlockStored(
        worker_id=draw(st.sampled_from(WORKERS + ["ghost"])),
        dp_rank=draw(st.sampled_from([0, 0, 1])),
        tier=kw.pop("tier", draw(st.sampled_from([0, 0, 1, 2]))),
        engine_hashes=ehs,
        token_ids=toks,
        lora_name=ns[0],
        cache_salt=ns[1],
        shared=draw(st.sampled_from([False] * 5 + [True])),
        **kw,
    )


def other_event(draw_worker, draw_rank, ehs):
    return st.one_of(
        st.builds(
            BlockRemoved,
            worker_id=draw_worker,
            dp_rank=draw_rank,
            engine_hashes=ehs,
            tier=st.one_of(st.none(), st.sampled_from([0, 1, 2])),
        ),
        st.builds(
            BlockMoved,
            worker_id=draw_worker,
            dp_rank=draw_rank,
            engine_hashes=ehs,
            from_tier=st.sampled_from([0, 1]),
            to_tier=st.sampled_from([1, 2]),
        ),
        st.builds(AllCleared, worker_id=draw_worker, dp_rank=draw_rank),
        st.builds(  # a tier copy: the general path between two batched runs
            BlockStored,
            worker_id=draw_worker,
            dp_rank=draw_rank,
            engine_hashes=ehs,
            tier=st.sampled_from([1, 2]),
            tier_copy=st.just(True),
        ),
    )


events = st.lists(
    st.one_of(
        token_store(),
        token_store(),
        token_store(),
        other_event(
            st.sampled_from(WORKERS + ["ghost"]),
            st.sampled_from([0, 1]),
            st.lists(st.integers(0, 11), max_size=3),
        ),
    ),
    max_size=30,
)


def state(kv: KvIndex) -> tuple:
    s = kv.stats()
    s.pop("memory_bytes", None)
    holdings = {ep: kv.core.holdings(ep) for ep in sorted(kv.endpoints().values())}
    return s, holdings, dict(kv.drops)


def build(backend: str, bound: int) -> KvIndex:
    kv = KvIndex(BS, bound, backend=backend)
    for w in WORKERS:
        kv.add_endpoint(w, 0)
    kv.add_endpoint("a", 1)
    return kv


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_apply_many_equals_apply_one_by_one(backend, caplog):
    @settings(
        max_examples=EXAMPLES if backend == "c" else max(1, EXAMPLES // 4),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(evs=events, bound=st.sampled_from([0, 0, 4]), split=st.integers(0, 30))
    def check(evs, bound, split):
        batched, single = build(backend, bound), build(backend, bound)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvplug.index"):
            # two apply_many calls: a run may start in one batch and end in the next
            got = [batched.apply_many(evs[:split]), batched.apply_many(evs[split:])]
            logs_batched = [r.getMessage() for r in caplog.records]
            caplog.clear()
            want = [apply_each(single, evs[:split]), apply_each(single, evs[split:])]
            logs_single = [r.getMessage() for r in caplog.records]
        assert got == want
        assert logs_batched == logs_single
        assert state(batched) == state(single)

    check()


def test_a_bad_store_in_a_run_does_not_stop_the_others():
    kv = build("c", 0)
    evs = [
        BlockStored(worker_id="a", engine_hashes=[1], token_ids=[1, 2]),
        BlockStored(worker_id="a", engine_hashes=[2], token_ids=[1, 2, 3]),  # 3 tokens, 1 block
        BlockStored(worker_id="a", parent_engine_hash=1, engine_hashes=[3], token_ids=[3, 4]),
        BlockStored(worker_id="a", engine_hashes=[4], token_ids=[2**32, 1]),  # bad token
        BlockStored(worker_id="a", parent_engine_hash=99, engine_hashes=[5], token_ids=[1, 1]),
        BlockStored(worker_id="b", engine_hashes=[6, 7], token_ids=[1, 2, 3, 4]),
    ]
    before = {"a": kv.endpoint_id("a"), "b": kv.endpoint_id("b")}
    rep = kv.apply_many(evs)
    assert (rep.applied, rep.dropped, rep.blocks, dict(rep.reasons)) == (
        4,
        2,
        5,  # the orphan (parent 99) counts as applied, as with apply()
        {"InvalidEvent": 2},
    )
    s = kv.stats()
    assert (s["stored_blocks"], s["orphan_stores"], s["dropped_events"]) == (4, 1, 2)
    assert kv.core.resolve(before["a"], 3) is not None  # chained from event 0 in the same run
    assert kv.core.resolve(before["b"], 7) is not None


def test_store_tokens_many_reports_what_store_tokens_raises():
    """Row by row, the batch call reports the exception (class and text) the single call
    raises, on both backends."""
    from kvplug.core import load_backend

    rows = [
        (0, 0, None, [1], [1, 2], 0, None),
        (0, 5, None, [2], [1, 2], 0, None),  # bad tier
        (0, 0, None, [3], [1, 2, 3], 0, None),  # 3 tokens for 1 block
        (0, 0, None, [4], [1, 2**32], 0, None),  # bad token, in block 0
        (0, 0, None, [5, 6], [1, 2, 3, 4], 0, [7]),  # extra too short
        (0, 0, "x", [7], [1, 2], 0, None),  # parent not an integer
        (2**20 + 5, 0, None, [8], [1, 2], 0, None),  # endpoint out of range
        (1, 0, 1, [9], [1, 2], 0, None),  # orphan: not a failure
        (0, 0, 1, [10], [5, 6], 0, None),  # chained from row 0
    ]
    for backend in ("c", "reference"):
        impl = load_backend(backend)
        batch = impl.Index(0)
        blocks, failures = batch.store_tokens_many(rows, 2)
        single = impl.Index(0)
        want = []
        for i, row in enumerate(rows):
            ep, tier, parent, ehs, toks, seed, extra = row
            try:
                single.store_tokens(ep, tier, parent, ehs, toks, 2, seed, extra)
            except Exception as err:  # noqa: BLE001 - compared below
                want.append((i, type(err), str(err)))
        assert [(i, type(e), str(e)) for i, e in failures] == want, backend
        assert [i for i, *_ in want] == [1, 2, 3, 4, 5, 6]
        assert blocks == 3
        assert batch.stats() == single.stats()
        assert batch.holdings(0) == single.holdings(0)
        assert batch.stats()["orphan_stores"] == 1


def test_store_tokens_many_rejects_a_malformed_batch():
    from kvplug.core import load_backend
    from kvplug.errors import InvalidArgument

    for backend in ("c", "reference"):
        ix = load_backend(backend).Index(0)
        with pytest.raises(InvalidArgument):
            ix.store_tokens_many([(0, 0, None, [1], [1, 2], 0)], 2)  # 6-tuple
        with pytest.raises(InvalidArgument):
            ix.store_tokens_many([(0, 0, None, [1], [1, 2], 0, None)], 0)
        assert ix.stats()["stored_blocks"] == 0
        assert ix.store_tokens_many([], 2) == (0, [])


def test_a_large_batch_uses_the_heap_and_releases_the_gil_path():
    """More rows than the binding's stack arrays hold, and enough tokens to run without the
    GIL: same answers as the reference."""
    from kvplug.core import load_backend

    rows = [
        (i % 3, i % 2, None if i % 5 else None, [i], list(range(i, i + 1024)), 0, None)
        for i in range(40)
    ]
    rows[17] = (0, 0, None, [17], [1, 2, 3], 0, None)  # bad length in the middle
    out = {}
    for backend in ("c", "reference"):
        ix = load_backend(backend).Index(0)
        blocks, failures = ix.store_tokens_many(rows, 1024)
        out[backend] = (blocks, [(i, type(e)) for i, e in failures], ix.stats())
    assert out["c"] == out["reference"]
    assert out["c"][0] == 39 and [i for i, _ in out["c"][1]] == [17]
