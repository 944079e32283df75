"""TRT-LLM load → kvplug worker attributes.

Two sources (PROTOCOLS.md §3.8):

* ``GET /prometheus/metrics`` — non-destructive Prometheus text (``trtllm_*``; the engine needs
  ``return_perf_metrics: true``). Preferred.
* ``GET /metrics`` — a JSON array of iteration stats that every read **drains**
  (``enable_iter_perf_stats: true``). The newest entry (per ``attentionDpRank``) is current;
  an empty array means "no iteration since the last read", not zero load: no attributes.

Attributes: ``running_requests``, ``queue_depth``, ``kv_usage`` (0–1, the fullest rank),
``prefix_cache_hit_rate``, ``kv_max_blocks``, ``kv_used_blocks``; ``tokens_per_block`` is
reported separately for the block-size check.
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
    """(attributes, tokens_per_block or None). Samples of one gauge are summed over label sets,
    except utilisation and hit rate (max). Raises ValueError if no ``trtllm_*`` load gauge."""
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
    """(attributes or None when there is no new iteration, tokens_per_block or None)."""
    if not isinstance(stats, list):
        raise ValueError(f"/metrics answered {type(stats).__name__}, not a list")
    latest: dict[Any, dict] = {}
    for entry in stats:
        if isinstance(entry, dict):
            latest[entry.get("attentionDpRank", 0)] = entry  # later entries are newer
    if not latest:
        return None, None
    out: dict[str, float] = {}
    tpb: int | None = None
    usage: list[float] = []
    hit: list[float] = []
    for entry in latest.values():
        for src, dst in (
            ("numActiveRequests", "running_requests"),
            ("numQueuedRequests", "queue_depth"),
        ):
            v = _num(entry, src)
            if v is not None:
                out[dst] = out.get(dst, 0.0) + v
        kv = entry.get("kvCacheStats")
        if isinstance(kv, dict):
            used, cap = _num(kv, "usedNumBlocks"), _num(kv, "maxNumBlocks")
            if used is not None:
                out["kv_used_blocks"] = out.get("kv_used_blocks", 0.0) + used
            if cap is not None:
                out["kv_max_blocks"] = out.get("kv_max_blocks", 0.0) + cap
            if used is not None and cap:
                usage.append(used / cap)
            if (h := _num(kv, "cacheHitRate")) is not None:
                hit.append(h)
            if (t := _num(kv, "tokensPerBlock")) is not None:
                tpb = int(t)
    if usage:
        out["kv_usage"] = max(usage)
    if hit:
        out["prefix_cache_hit_rate"] = max(hit)
    return (out or None), tpb
