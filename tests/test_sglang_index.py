"""The golden SGLang and TRT-LLM streams applied to kvplug's KvIndex, step by step: what the
index holds (and in which tier) is what the engine holds, and no event is dropped or counted
as inconsistent (unknown removals, orphans, conflicts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvplug.integrations.sglang.wire import SglangDecoder
from kvplug.integrations.trtllm.events import TrtllmDecoder

index_mod = pytest.importorskip("kvplug.index")
DATA = Path(__file__).parent / "data"


def _golden(name):
    return [p.read_bytes() for p in sorted((DATA / "sglang").glob(f"{name}_*.msgpack"))]


def _index(worker, ranks=(0,), block_size=4):
    index = index_mod.KvIndex(block_size=block_size)
    for r in ranks:
        index.add_endpoint(worker, r)
    return index


def _row(index, worker, rank, tokens, **ns):
    ov = index.query(index.request_hashes(tokens, **ns))
    ep = index.endpoint_id(worker, rank)
    return int(ov.local[ep]), int(ov.device[ep]), int(ov.host[ep]), int(ov.disk[ep])


def _clean(index, report):
    assert report.dropped == 0, report.reasons
    s = index.stats()
    for counter in ("unknown_removes", "orphan_stores", "conflicting_stores", "unknown_moves"):
        assert s.get(counter, 0) == 0, (counter, s)


T12 = list(range(1, 13))


def test_sglang_0_5_15_stream():
    dec, index = SglangDecoder("sg", 4), _index("sg")
    p = _golden("v0_5_15")
    _clean(index, index.apply_many(dec.decode(p[0])))
    assert _row(index, "sg", 0, T12 + [13, 14]) == (3, 3, 0, 0)  # the partial page never counts
    _clean(index, index.apply_many(dec.decode(p[1])))
    # the leaf (page 3) left the GPU; pages 1-2 are on GPU and (written back) on host
    assert _row(index, "sg", 0, T12) == (2, 2, 0, 0)
    _clean(index, index.apply_many(dec.decode(p[2])))
    assert _row(index, "sg", 0, T12) == (0, 0, 0, 0)  # flushed
    assert _row(index, "sg", 0, [20, 21, 22, 23]) == (0, 0, 0, 0)


def test_sglang_0_5_18_salted_stream():
    dec, index = SglangDecoder("sg", 4), _index("sg")
    p = _golden("v0_5_18")[0]
    # apply all but the final flush to look at the state before it
    events = dec.decode(p)
    _clean(index, index.apply_many(events[:-1]))
    assert _row(index, "sg", 0, list(range(1, 9)), cache_salt="tenant-b") == (2, 2, 0, 0)
    assert _row(index, "sg", 0, list(range(1, 9))) == (0, 0, 0, 0)  # other namespace
    assert _row(index, "sg", 0, [9, 10, 11, 12]) == (0, 0, 0, 0)  # stored, then removed
    _clean(index, index.apply_many(events[-1:]))


def test_sglang_0_5_23_stream_tiers_and_shared_pool():
    dec, index = SglangDecoder("sg", 4), _index("sg", ranks=(0, 1))
    p = _golden("v0_5_23")
    ns = {"lora_name": "sql-lora", "cache_salt": "tenant-a"}
    _clean(index, index.apply_many(dec.decode(p[0])))
    assert _row(index, "sg", 1, T12, **ns) == (3, 3, 0, 0)
    events = dec.decode(p[1])
    _clean(index, index.apply_many(events[:2]))  # the EXTERNAL (shared) and DISK stores
    ov = index.query(index.request_hashes([40, 41, 42, 43]))
    assert ov.shared_prefix == 1  # readable by every worker
    # the salted LoRA page is on GPU and (HiCache L3) on disk: the best tier counts
    assert _row(index, "sg", 1, [1, 2, 3, 4], **ns) == (1, 1, 0, 0)
    _clean(index, index.apply_many(events[2:]))
    assert _row(index, "sg", 1, T12, **ns) == (2, 2, 0, 0)  # the bigram page left the GPU
    assert index.query(index.request_hashes([40, 41, 42, 43])).shared_prefix == 0


def test_trtllm_streams():
    index = _index("trt", ranks=(0, 1))
    v1 = json.loads((DATA / "trtllm" / "v1_events.json").read_bytes())
    dec = TrtllmDecoder("trt", 4)
    _clean(index, index.apply_many(dec.decode(v1)))
    assert _row(index, "trt", 0, T12) == (2, 1, 1, 0)  # [1-4] offloaded, [5-8] on GPU
    assert _row(index, "trt", 0, [20, 21, 22, 23]) == (1, 0, 1, 0)  # stored on host

    index = _index("trt2", ranks=(0, 1))
    v26 = json.loads((DATA / "trtllm" / "v2026_vswa_adp_events.json").read_bytes())
    dec = TrtllmDecoder("trt2", 4, lora_names={3: "sql-lora"})
    _clean(index, index.apply_many(dec.decode(v26)))
    ns = {"lora_name": "sql-lora", "cache_salt": "tenant-a"}
    assert _row(index, "trt2", 0, T12, **ns) == (2, 2, 0, 0)  # 202 (host) removed
    assert _row(index, "trt2", 1, [7, 7, 7, 7]) == (0, 0, 0, 0)  # multimodal: no text match
