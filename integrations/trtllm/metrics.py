"""TRT-LLM load → kvplug worker attributes.

Two sources (PROTOCOLS.md §3.8):

* ``GET /prometheus/metrics`` — non-destructive Prometheus text (``trtllm_*``; the engine needs
  ``return_perf_metrics: true``). Preferred.
* ``GET /metrics`` — a JSON array of iteration stats that every read **drains**
  (``enable_iter_perf_stats: true``). An empty array means "no iteration since the last
  read", not zero load: no attributes.

Attention DP (upstream ``MetricsCollector.log_iteration_stats`` and ``adp_iter_stats``): one
engine is one process with one collector, whose gauges carry only its fixed labels (model
name, engine type), no rank. It logs every iteration-stats row in turn, so each gauge holds
the row written last, not a sum. The rows themselves are not per-rank figures either: the
fan-out that tags rows with ``attentionDpRank`` copies rank 0's ``numActiveRequests`` and
``kvCacheStats`` (its own KV pool: each rank has one) into every rank's row and keeps
``numQueuedRequests`` (the engine's queue, which lives on rank 0) on rank 0's row only, the
others 0 (rows without ``attentionDpRank``, from builds before the tag, are read as rank
0's). Only ``inflightBatchingStats`` is rank-local. So every figure kvplug reads is one value
for the engine: ``kv_max_blocks`` / ``kv_used_blocks`` are ONE rank's KV pool,
``running_requests`` is rank 0's; from the JSON they are read from rank 0's newest row, never
summed over rows. In Prometheus under attention DP ``trtllm_num_requests_waiting`` shows the
last rank's row (0) after each fan-out.

Attributes: ``running_requests``, ``queue_depth``, ``kv_usage`` (0–1), ``prefix_cache_hit_rate``,
``kv_max_blocks``, ``kv_used_blocks``; ``tokens_per_block`` is reported separately for the
block-size check.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_PROM = {
    "trtllm_num_requests_running": "running_requests",
    "trtllm_num_requests_waiting": "queue_depth",
    "trtllm_kv_cache_utilization": "kv_usage",
    "trtllm_kv_cache_hit_rate": "prefix_cache_hit_rate",
    "trtllm_kv_cache_max_blocks": "kv_max_blocks",
}


def parse_prometheus(text: str) -> tuple[dict[str, float], int | None]:
    """(attributes, tokens_per_block or None). TRT-LLM writes one sample per gauge (its fixed
    labels); were there several label sets, counts are summed over them and utilisation and hit
    rate take the max. Raises ValueError if no ``trtllm_*`` load gauge."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ValueError(f"unparsable Prometheus text: {exc}") from None
    out: dict[str, float] = {}
    tpb: int | None = None
    for fam in families:
        for sample in fam.samples:
            if sample.name == "trtllm_kv_cache_tokens_per_block":
                tpb = int(sample.value)
                continue
            dst = _PROM.get(sample.name)
            if dst is None:
                continue
            v = float(sample.value)
            if dst in ("kv_usage", "prefix_cache_hit_rate"):
                out[dst] = max(out.get(dst, v), v)
            else:
                out[dst] = out.get(dst, 0.0) + v
    if not any(k in out for k in ("running_requests", "queue_depth", "kv_usage")):
        raise ValueError("no trtllm_* load gauges in the metrics text (return_perf_metrics?)")
    return out, tpb


def _num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def parse_iteration_stats(stats: Any) -> tuple[dict[str, float] | None, int | None]:
    """(attributes or None when there is no new iteration, tokens_per_block or None), from the
    newest row of rank 0 (``attentionDpRank`` 0 or absent; the lowest rank if the drain holds
    none of rank 0's): its engine-wide and rank-0 figures are the ones every rank's row
    repeats, so no field is summed over rows (see the module docstring)."""
    if not isinstance(stats, list):
        raise ValueError(f"/metrics answered {type(stats).__name__}, not a list")
    latest: dict[int, dict] = {}
    for entry in stats:
        if isinstance(entry, dict):
            rank = _num(entry, "attentionDpRank")
            latest[int(rank) if rank is not None else 0] = entry  # later entries are newer
    if not latest:
        return None, None
    entry = latest[min(latest)]
    out: dict[str, float] = {}
    tpb: int | None = None
    for src, dst in (
        ("numActiveRequests", "running_requests"),
        ("numQueuedRequests", "queue_depth"),
    ):
        v = _num(entry, src)
        if v is not None:
            out[dst] = v
    kv = entry.get("kvCacheStats")
    if isinstance(kv, dict):
        used, cap = _num(kv, "usedNumBlocks"), _num(kv, "maxNumBlocks")
        if used is not None:
            out["kv_used_blocks"] = used
        if cap is not None:
            out["kv_max_blocks"] = cap
        if used is not None and cap:
            out["kv_usage"] = used / cap
        if (h := _num(kv, "cacheHitRate")) is not None:
            out["prefix_cache_hit_rate"] = h
        if (t := _num(kv, "tokensPerBlock")) is not None:
            tpb = int(t)
    return (out or None), tpb
