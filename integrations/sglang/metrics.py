"""SGLang load → kvplug worker attributes, and ``/server_info`` KV-event discovery.

Attributes (the names the router's filters and scorers read):

=====================  ========================================================================
``running_requests``   ``num_running_reqs`` summed over DP ranks
``queue_depth``        ``num_waiting_reqs`` (``sglang:num_queue_reqs``) summed over DP ranks
``kv_usage``           ``token_usage`` in [0, 1], the *max* over DP ranks (the fullest rank)
``prefix_cache_hit_rate``  ``cache_hit_rate`` (mean over ranks)
``waiting_uncached_tokens``  ``num_waiting_uncached_tokens`` summed (≥ 0.5.20 ``/v1/loads``)
``kv_used_tokens`` / ``kv_total_tokens``  ``num_used_tokens`` / ``max_total_num_tokens`` summed
=====================  ========================================================================

Sources, best first: ``GET /v1/loads?include=core`` (≥ 0.5.15, per DP rank), else the
Prometheus ``GET /metrics`` (``--enable-metrics``; ``sglang:*`` gauges, labelled ``dp_rank`` on
DP engines; each DP rank counted once: its first pipeline stage's and TP rank's sample, the
``priority=""`` total of the queue counts under priority scheduling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from kvplug import ConfigError

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def attributes_from_loads(payload: Any) -> dict[str, float]:
    """``GET /v1/loads`` JSON → attributes. Raises ValueError when it has no ``loads`` list."""
    loads = payload.get("loads") if isinstance(payload, dict) else None
    if not isinstance(loads, list) or not loads:
        raise ValueError("/v1/loads answered without a non-empty 'loads' list")
    sums: dict[str, float] = {}
    usage: list[float] = []
    hit: list[float] = []
    for entry in loads:
        if not isinstance(entry, dict):
            raise ValueError("/v1/loads entry is not an object")
        for src, dst in (
            ("num_running_reqs", "running_requests"),
            ("num_waiting_reqs", "queue_depth"),
            ("num_waiting_uncached_tokens", "waiting_uncached_tokens"),
            ("num_used_tokens", "kv_used_tokens"),
            ("max_total_num_tokens", "kv_total_tokens"),
        ):
            v = _num(entry.get(src))
            if v is not None:
                sums[dst] = sums.get(dst, 0.0) + v
        if (v := _num(entry.get("token_usage"))) is not None:
            usage.append(v)
        if (v := _num(entry.get("cache_hit_rate"))) is not None:
            hit.append(v)
    out = dict(sums)
    if usage:
        out["kv_usage"] = max(usage)
    if hit:
        out["prefix_cache_hit_rate"] = sum(hit) / len(hit)
    if "running_requests" not in out and "queue_depth" not in out:
        raise ValueError("/v1/loads entries carry neither num_running_reqs nor num_waiting_reqs")
    return out


_PROM = {
    "sglang:num_running_reqs": ("running_requests", "sum"),
    "sglang:num_queue_reqs": ("queue_depth", "sum"),
    "sglang:token_usage": ("kv_usage", "max"),
    "sglang:cache_hit_rate": ("prefix_cache_hit_rate", "mean"),
    "sglang:num_used_tokens": ("kv_used_tokens", "sum"),
}


# Labels of SGLang's scheduler gauges (observability/metrics_collector.py) that do not tell DP
# ranks apart: every pipeline stage's scheduler (and with --enable-metrics-for-all-schedulers
# every TP rank's) reports the same rank's figures, and queue counts add one sample per
# priority to the total, which is the one with priority="" (priority scheduling)
_SCHEDULER_LABELS = ("pp_rank", "tp_rank", "moe_ep_rank")
_PRIORITY = "priority"


def _scheduler(sample: Any) -> tuple[float, ...]:
    """Which scheduler of its DP rank emitted the sample, lowest first (absent label: 0; a
    value that is not a rank number sorts last)."""
    ranks: list[float] = []
    for label in _SCHEDULER_LABELS:
        value = sample.labels.get(label)
        if value is None:
            ranks.append(0)
        else:  # isascii: "²".isdigit() holds but int() refuses it
            ranks.append(int(value) if value.isascii() and value.isdigit() else math.inf)
    return tuple(ranks)


def _one_per_dp_rank(samples: list[Any]) -> list[float]:
    """One value per DP rank: the samples are grouped by their labels other than the
    scheduler's and the priority (``dp_rank``, model, engine type...); in a group, the first
    pipeline stage's first scheduler, its ``priority=""`` total when it has per-priority
    samples (their sum if the total is missing)."""
    groups: dict[tuple, list[Any]] = {}
    for sample in samples:
        key = tuple(
            sorted(
                (k, v)
                for k, v in sample.labels.items()
                if k != _PRIORITY and k not in _SCHEDULER_LABELS
            )
        )
        groups.setdefault(key, []).append(sample)
    values = []
    for group in groups.values():
        first = min(_scheduler(s) for s in group)
        own = [s for s in group if _scheduler(s) == first]
        totals = [s for s in own if not s.labels.get(_PRIORITY)]
        values.append(float(totals[0].value) if totals else sum(float(s.value) for s in own))
    return values


def attributes_from_prometheus(text: str) -> dict[str, float]:
    """SGLang's Prometheus text → attributes: per metric one value per DP rank
    (``_one_per_dp_rank``), combined over the ranks."""
    samples: dict[str, list[Any]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ValueError(f"unparsable Prometheus text: {exc}") from None
    for fam in families:
        for sample in fam.samples:
            if sample.name in _PROM:
                samples.setdefault(sample.name, []).append(sample)
    values = {name: _one_per_dp_rank(group) for name, group in samples.items()}
    out: dict[str, float] = {}
    for name, vals in values.items():
        dst, how = _PROM[name]
        if how == "sum":
            out[dst] = sum(vals)
        elif how == "max":
            out[dst] = max(vals)
        else:
            out[dst] = sum(vals) / len(vals)
    if not out:
        raise ValueError("no sglang:* load gauges in the metrics text (--enable-metrics?)")
    return out


@dataclass(frozen=True)
class KvEventsInfo:
    """Where and how one SGLang worker publishes KV events (from ``/server_info``)."""

    host: str  # what kvplug dials (the worker URL's host when the engine advertised a wildcard)
    port_base: int  # rank r publishes on port_base + r
    dp_size: int
    block_size: int  # the page size events are emitted at: kvplug must hash at this size
    topic: str = ""
    replay_port_base: int | None = None
    load_port_base: int | None = None  # --load-publish-endpoint (>= 0.5.23): pushed load
    load_topic: str = "load"

    def endpoint(self, rank: int) -> str:
        return f"tcp://{_bracket(self.host)}:{self.port_base + rank}"

    def load_endpoint(self, rank: int) -> str | None:
        if self.load_port_base is None:
            return None
        return f"tcp://{_bracket(self.host)}:{self.load_port_base + rank}"

    def replay_endpoint(self, rank: int) -> str | None:
        if self.replay_port_base is None:
            return None
        return f"tcp://{_bracket(self.host)}:{self.replay_port_base + rank}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def kv_events_from_server_info(info: Any, worker_url: str) -> KvEventsInfo | None:
    """The ``kv_events`` descriptor of ``/server_info`` (sglang ≥ 0.5.20), or None if absent.

    SGLang's contract: subscribers dial ``tcp://<worker host>:<endpoint_port_base + rank>``
    for every rank in ``dp_size``; a wildcard ``endpoint_host`` means the worker URL's host.
    """
    if not isinstance(info, dict):
        return None
    desc = info.get("kv_events")
    if not isinstance(desc, dict):
        return None
    try:
        base = int(desc["endpoint_port_base"])
        block_size = int(desc["block_size"])
        dp_size = int(desc.get("dp_size") or 1)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{worker_url}: malformed /server_info kv_events: {exc}") from None
    if not 0 < base <= 65535 or block_size <= 0 or dp_size <= 0:
        raise ConfigError(f"{worker_url}: /server_info kv_events out of range: {desc}")
    host = str(desc.get("endpoint_host") or "")
    if host in WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
    replay = desc.get("replay_endpoint_port_base")
    load = desc.get("load_endpoint_port_base")
    return KvEventsInfo(
        host=host.strip("[]"),
        port_base=base,
        dp_size=dp_size,
        block_size=block_size,
        topic=str(desc.get("topic") or ""),
        replay_port_base=int(replay) if isinstance(replay, int) else None,
        load_port_base=int(load) if isinstance(load, int) and 0 < load <= 65535 else None,
        load_topic=str(desc.get("load_topic") or "load"),
    )


# ``LoadStat`` (sglang >= 0.5.23, ``--load-publish-endpoint``): frames ``[b"load", seq,
# msgpack]`` with the payload ``["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens,
# max_total_num_tokens, attn_dp_rank, num_waiting_uncached_tokens, ...]`` (fields appended
# over time; the first six are fixed).
_LOAD_STAT_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_tokens",
    "max_total_num_tokens",
    "attn_dp_rank",
    "num_waiting_uncached_tokens",
)


def decode_load_stat(payload: bytes) -> dict[str, int]:
    """One pushed ``LoadStat`` → its known fields. Raises ValueError on anything else."""
    import msgspec

    try:
        value = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"LoadStat is not msgpack: {exc}") from None
    if not isinstance(value, list) or not value or value[0] != "LoadStat" or len(value) < 5:
        raise ValueError("not a LoadStat array")
    out: dict[str, int] = {}
    for name, v in zip(_LOAD_STAT_FIELDS, value[1:], strict=False):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"LoadStat {name} = {v!r}")
        out[name] = v
    return out


def rank_capacity_tokens(per_rank: Any) -> int | None:
    """A DP rank's KV capacity in tokens: the largest ``max_total_num_tokens`` of the ranks'
    ``/v1/loads`` entries or pushed ``LoadStat`` s (the ranks of one engine are sized alike);
    None when no rank gives one."""
    sizes = [
        v
        for entry in per_rank
        if isinstance(entry, dict)
        and isinstance(v := entry.get("max_total_num_tokens"), int)
        and not isinstance(v, bool)
        and v > 0
    ]
    return max(sizes) if sizes else None


def attributes_from_load_stats(per_rank: dict[int, dict[str, int]]) -> dict[str, float]:
    """The newest ``LoadStat`` of every rank → attributes (same names as ``/v1/loads``)."""
    out: dict[str, float] = {}
    usage: list[float] = []
    for stat in per_rank.values():
        for src, dst in (
            ("num_running_reqs", "running_requests"),
            ("num_waiting_reqs", "queue_depth"),
            ("num_waiting_uncached_tokens", "waiting_uncached_tokens"),
            ("num_tokens", "kv_used_tokens"),
            ("max_total_num_tokens", "kv_total_tokens"),
        ):
            if src in stat:
                out[dst] = out.get(dst, 0.0) + stat[src]
        if stat.get("max_total_num_tokens"):
            usage.append(stat.get("num_tokens", 0) / stat["max_total_num_tokens"])
    if usage:
        out["kv_usage"] = max(usage)
    return out


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def dp_ranks_from_server_info(info: Any) -> int | None:
    """How many DP ranks (each with its own KV cache and scheduler) the engine runs, from
    ``/server_info``; None when it does not say.

    ``kv_events.dp_size`` first (≥ 0.5.20; SGLang: "it counts DP ranks"), else the echoed
    server args: ``dp_size × attn_dp_size`` (0.5.23 moved attention DP out of ``dp_size``,
    ``num_dp_ranks_of``), ``dp_size`` alone on older builds (what smg's ``--dp-aware`` reads).
    """
    if not isinstance(info, dict):
        return None
    kv = info.get("kv_events")
    if isinstance(kv, dict) and (ranks := _positive_int(kv.get("dp_size"))) is not None:
        return ranks
    ranks = _positive_int(info.get("dp_size"))
    if ranks is None:
        return None
    return ranks * (_positive_int(info.get("attn_dp_size")) or 1)


def page_size_from_server_info(info: Any) -> int | None:
    """``page_size`` from the server args that ``/server_info`` echoes (every 0.4+/0.5 build)."""
    if isinstance(info, dict):
        v = info.get("page_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None
