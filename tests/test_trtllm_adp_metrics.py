"""TRT-LLM load and KV capacity of an attention-DP engine, from the shapes upstream emits.

What the fixtures reproduce (NVIDIA/TensorRT-LLM, read in the search index; each file as the
index stored it):

* ``tensorrt_llm/_torch/pyexecutor/adp_iter_stats.py`` at
  0cedd9a0400c01cc94e01ea59d87bc6a81890cb7 (``ADPIterStatsBuffer._make_rank_iter_stats``):
  under attention DP one iteration becomes one stats row per rank, in rank order. Each row
  copies rank 0's scalar fields (``numActiveRequests``, ``maxNumActiveRequests``, ...) and
  rank 0's ``kvCacheStats`` (rank 0's own KV pool); ``numQueuedRequests`` /
  ``numCompletedRequests`` stay on rank 0's row (0 on the others: the request queue lives on
  rank 0); only ``inflightBatchingStats`` is the rank's own.
* ``tensorrt_llm/executor/base_worker.py`` (``BaseWorker._stats_serializer``, index file id
  55301320707): each row is ``IterationStats.to_json_str()`` plus ``"attentionDpRank"``.
* ``tensorrt_llm/metrics/collector.py`` at 050f80def8df236e326949c8bd9dee10fd896a83
  (``MetricsCollector``): one collector per server, gauges labelled with the collector's
  fixed labels only (``{"model_name": ..., "engine_type": "trtllm"}``, its docstring's
  example); ``log_iteration_stats(row)`` sets each gauge from the row (``_log_gauge``:
  ``gauge.labels(**self.labels).set(value)``). ``openai_server.py``'s collector loop (index
  file id 54820179511) calls it for every drained row, "gauges ... naturally overwritten with
  the latest value", and tees the rows into the buffer ``GET /metrics`` drains.

``UpstreamShapedCollector`` below defines the gauges kvplug reads with upstream's names, help
texts and label names in a private ``prometheus_client`` registry and sets them row by row
the way ``log_iteration_stats`` does; its exposition is prometheus_client's, as upstream's is.
"""

from __future__ import annotations

import copy
import json

import pytest
from kvplug.integrations.trtllm.adapter import TrtllmAdapter, _Run
from kvplug.integrations.trtllm.metrics import parse_iteration_stats, parse_prometheus
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_trtllm_poller import FakeTrtllmWorker, RecordingSink, _until

from kvplug.workers import Worker

LABELS = {"model_name": "llama", "engine_type": "trtllm"}
RANK0_POOL = 4000  # maxNumBlocks of rank 0's KV cache manager (each ADP rank has its own)


class UpstreamShapedCollector:
    """The iteration-stat gauges kvplug reads, as ``MetricsCollector`` defines and sets them."""

    GAUGES = {
        "num_requests_running": "Number of active requests",
        "num_requests_waiting": "Number of queued requests",
        "kv_cache_hit_rate": "KV cache hit rate",
        "kv_cache_utilization": "KV cache utilization",
        "kv_cache_max_blocks": "Maximum number of KV cache blocks",
        "kv_cache_free_blocks": "Number of free KV cache blocks",
        "kv_cache_used_blocks": "Number of used KV cache blocks",
        "kv_cache_tokens_per_block": "Number of tokens per KV cache block",
    }

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge("trtllm_" + name, doc, labelnames=LABELS.keys(), registry=self.registry)
            for name, doc in self.GAUGES.items()
        }

    def _set(self, name: str, value: float) -> None:
        self.gauges[name].labels(**LABELS).set(value)

    def log_iteration_stats(self, row: dict) -> None:
        if "numActiveRequests" in row:
            self._set("num_requests_running", row["numActiveRequests"])
        if "numQueuedRequests" in row:
            self._set("num_requests_waiting", row["numQueuedRequests"])
        kv = row.get("kvCacheStats")
        if kv:
            if kv.get("cacheHitRate") is not None:
                self._set("kv_cache_hit_rate", kv["cacheHitRate"])
            if "usedNumBlocks" in kv and "maxNumBlocks" in kv and kv["maxNumBlocks"]:
                self._set("kv_cache_utilization", kv["usedNumBlocks"] / kv["maxNumBlocks"])
            for key, name in (
                ("maxNumBlocks", "kv_cache_max_blocks"),
                ("freeNumBlocks", "kv_cache_free_blocks"),
                ("usedNumBlocks", "kv_cache_used_blocks"),
                ("tokensPerBlock", "kv_cache_tokens_per_block"),
            ):
                if key in kv:
                    self._set(name, kv[key])

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


def fanned_out_rows(iteration: int, rank0: dict, rank_local: list[dict]) -> list[dict]:
    """One attention-DP iteration as the rows ``get_stats`` yields, ranks in order."""
    rows = []
    for rank, ifb in enumerate(rank_local):
        row = copy.deepcopy(rank0)
        row["iter"] = iteration
        if rank != 0:
            row["numQueuedRequests"] = 0
            row["numCompletedRequests"] = 0
            row["numNewActiveRequests"] = 0
        row["inflightBatchingStats"] = dict(ifb)
        row["attentionDpRank"] = rank
        rows.append(row)
    return rows


def rank0_stats(active: int, queued: int, used: int) -> dict:
    return {
        "iterLatencyMS": 20.0,
        "numActiveRequests": active,
        "numQueuedRequests": queued,
        "numCompletedRequests": 1,
        "numNewActiveRequests": 1,
        "maxNumActiveRequests": 256,
        "gpuMemUsage": 70_000_000_000,
        "cpuMemUsage": 0,
        "pinnedMemUsage": 0,
        "kvCacheStats": {
            "maxNumBlocks": RANK0_POOL,
            "freeNumBlocks": RANK0_POOL - used,
            "usedNumBlocks": used,
            "tokensPerBlock": 32,
            "allocTotalBlocks": used,
            "allocNewBlocks": 4,
            "reusedBlocks": 100,
            "missedBlocks": 50,
            "cacheHitRate": 0.5,
        },
    }


def ifb(ctx: int, gen: int) -> dict:
    return {
        "numScheduledRequests": ctx + gen,
        "numContextRequests": ctx,
        "numGenRequests": gen,
        "numPausedRequests": 0,
        "numCtxTokens": 512 * ctx,
        "microBatchId": 0,
        "avgNumDecodedTokensPerIter": 1.0,
    }


TWO_ITERATIONS = fanned_out_rows(
    7, rank0_stats(active=6, queued=3, used=900), [ifb(1, 5), ifb(2, 7)]
)
TWO_ITERATIONS += fanned_out_rows(
    8, rank0_stats(active=5, queued=2, used=1000), [ifb(0, 5), ifb(1, 8)]
)


def test_the_upstream_exposition_holds_one_rank_0_value_per_gauge_not_a_sum():
    collector = UpstreamShapedCollector()
    for row in TWO_ITERATIONS:  # the collector loop logs every drained row in turn
        collector.log_iteration_stats(row)
    text = collector.exposition()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("trtllm_"):
            assert len(family.samples) == 1, family  # no rank label: one series per gauge
            assert family.samples[0].labels == LABELS
    attrs, tpb = parse_prometheus(text)
    assert tpb == 32
    assert attrs == {
        "running_requests": 5.0,  # rank 0's, as every row repeats it
        "queue_depth": 0.0,  # the last row written is rank 1's, whose queue field is 0
        "kv_usage": 0.25,
        "prefix_cache_hit_rate": 0.5,
        "kv_max_blocks": float(RANK0_POOL),  # one rank's pool
    }
    # the capacity per rank is that pool, for a worker of any dp_size
    sink = RecordingSink("trt-adp", 32)
    run = _Run(Worker("trt-adp", engine="trtllm", dp_size=2), sink, poller=None)  # type: ignore[arg-type]
    TrtllmAdapter._report_capacity(run, attrs["kv_max_blocks"])
    assert sink.capacity == [RANK0_POOL]


def test_the_drained_rows_are_read_once_from_rank_0s_newest_row():
    # the JSON GET /metrics answers: what upstream's JSONResponse renders
    drained = json.loads(json.dumps(TWO_ITERATIONS))
    attrs, tpb = parse_iteration_stats(drained)
    assert tpb == 32
    assert attrs == {
        "running_requests": 5.0,  # not 10: rank 1's row repeats rank 0's count
        "queue_depth": 2.0,  # the engine's queue, on rank 0's row
        "kv_used_blocks": 1000.0,
        "kv_max_blocks": float(RANK0_POOL),  # not 8000: both rows carry rank 0's pool
        "kv_usage": 0.25,
        "prefix_cache_hit_rate": 0.5,
    }
    # a drain that ends inside an iteration: rank 1's newest row alone is still read once
    attrs, _ = parse_iteration_stats(json.loads(json.dumps(TWO_ITERATIONS[1:2])))
    assert attrs is not None and attrs["kv_max_blocks"] == RANK0_POOL
    assert attrs["running_requests"] == 6.0 and attrs["queue_depth"] == 0.0
    # rows without attentionDpRank (builds before the tag) are rank 0's
    untagged = [{k: v for k, v in row.items() if k != "attentionDpRank"} for row in drained[:1]]
    attrs, _ = parse_iteration_stats(untagged)
    assert attrs is not None and attrs["running_requests"] == 6.0 and attrs["queue_depth"] == 3.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["prometheus", "iteration_stats"])
async def test_an_attention_dp_worker_reports_one_ranks_pool_as_its_capacity_per_rank(source):
    collector = UpstreamShapedCollector()
    for row in TWO_ITERATIONS:
        collector.log_iteration_stats(row)
    exposition = collector.exposition() if source == "prometheus" else None
    fake = await FakeTrtllmWorker(prometheus=exposition).start()
    if source == "iteration_stats":  # no /prometheus/metrics: the drained JSON
        fake.iter_stats = json.loads(json.dumps(TWO_ITERATIONS))
    sink = RecordingSink("trt-adp", 32)
    adapter = TrtllmAdapter(load_period=0.02)
    try:
        await adapter.start_worker(
            Worker("trt-adp", url=fake.url, engine="trtllm", dp_size=2), sink
        )
        await _until(lambda: sink.attributes and sink.capacity)
        assert sink.attributes[-1]["kv_max_blocks"] == RANK0_POOL
        assert sink.attributes[-1]["running_requests"] == 5.0
        assert sink.capacity == [RANK0_POOL]
    finally:
        await adapter.close()
        await fake.stop()
