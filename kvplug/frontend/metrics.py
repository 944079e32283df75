"""Prometheus metrics of the frontend (one registry per app, so several apps can coexist)."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class _StateCollector:
    """Per-worker gauges read at scrape time (health, events, in-flight) - no hot-path cost."""

    def __init__(
        self,
        snapshot: Callable[[], Iterable[dict[str, Any]]],
        router_stats: Callable[[], dict[str, Any]],
        event_drops: Callable[[], Iterable[tuple[str, str, str, int]]] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._router_stats = router_stats
        self._event_drops = event_drops

    def collect(self):
        healthy = GaugeMetricFamily(
            "kvplug_worker_healthy",
            "1 if the worker passes health checks and takes requests",
            labels=["worker"],
        )
        draining = GaugeMetricFamily(
            "kvplug_worker_draining", "1 if the worker is draining", labels=["worker"]
        )
        inflight = GaugeMetricFamily(
            "kvplug_worker_inflight_requests",
            "requests the frontend has in flight on the worker",
            labels=["worker"],
        )
        events = GaugeMetricFamily(
            "kvplug_worker_kv_events",
            "KV events received from the worker since it was added",
            labels=["worker"],
        )
        prefill = GaugeMetricFamily(
            "kvplug_worker_active_prefill_tokens",
            "Router's active prompt tokens not yet past their first token (all DP ranks)",
            labels=["worker"],
        )
        decode = GaugeMetricFamily(
            "kvplug_worker_active_decode_blocks",
            "Router's active decode blocks of the worker (all DP ranks)",
            labels=["worker"],
        )
        ejected = GaugeMetricFamily(
            "kvplug_worker_ejected",
            "1 while outlier detection keeps the worker out of rotation",
            labels=["worker"],
        )
        blocks = GaugeMetricFamily(
            "kvplug_worker_kv_blocks",
            "KV blocks the router's index holds for the worker (all DP ranks, all tiers)",
            labels=["worker"],
        )
        events_ready = GaugeMetricFamily(
            "kvplug_worker_events_ready",
            "1 if the worker's event source (subscriber, poller) is running and connected, "
            "0 if not (absent for engine kinds without events)",
            labels=["worker"],
        )
        for w in self._snapshot():
            wid = w["id"]
            if "blocks" in w:
                blocks.add_metric([wid], float(w["blocks"]))
            if w.get("events_ready") is not None:
                events_ready.add_metric([wid], 1.0 if w["events_ready"] else 0.0)
            healthy.add_metric([wid], 1.0 if w["healthy"] else 0.0)
            ejected.add_metric([wid], 1.0 if w.get("ejected") else 0.0)
            draining.add_metric([wid], 1.0 if w["draining"] else 0.0)
            inflight.add_metric([wid], float(w["inflight"]))
            events.add_metric([wid], float(w["events"]))
            load = w.get("load") or {}
            prefill.add_metric([wid], load.get("prefill_tokens", 0.0))
            decode.add_metric([wid], load.get("decode_blocks", 0.0))
        yield from (
            healthy,
            ejected,
            draining,
            inflight,
            events,
            blocks,
            prefill,
            decode,
            events_ready,
        )
        if self._event_drops is not None:
            drops = CounterMetricFamily(
                "kvplug_event_drops",
                "What event sources dropped or rejected, by engine kind, worker ('' when "
                "none can be named) and reason (docs/frontend.md, Metrics, lists the reasons)",
                labels=["engine", "worker", "reason"],
            )
            for kind, worker, reason, n in self._event_drops():
                drops.add_metric([kind, worker, reason], float(n))
            yield drops
        stats = GaugeMetricFamily(
            "kvplug_router_stat", "Router and KV index counters", labels=["stat"]
        )
        for key, value in _flatten(self._router_stats() or {}):
            stats.add_metric([key], value)
        yield stats


def _flatten(d: dict, prefix: str = ""):
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, float(value)


class _LoopCounter:
    """One labelled series of a counter or gauge that only the event loop's thread changes."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class _LoopHistogram:
    """One labelled series of a histogram that only the event loop's thread changes."""

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopMetric:
    """A counter, gauge or histogram of the request path, changed on the event loop only.

    prometheus_client's own take a lock on every change and re-check the metric's kind on every
    call: ~10 % of ``kvplug serve``'s CPU per request went to the per-request series. These are
    plain fields, read by the registry at scrape time with the same names, help, labels and
    buckets (``le`` bounds as prometheus_client prints them)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        kind: str,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], Any] = {}
        self._unlabelled = None if self.labelnames else self.labels()
        registry.register(self)

    def labels(self, *values: str) -> Any:
        key = tuple(str(v) for v in values)
        series = self._series.get(key)
        if series is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {key}")
            series = _LoopHistogram(self.buckets) if self.kind == "histogram" else _LoopCounter()
            self._series[key] = series
        return series

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled.inc(amount)  # type: ignore[union-attr]

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled.dec(amount)  # type: ignore[union-attr]

    def observe(self, value: float) -> None:
        self._unlabelled.observe(value)  # type: ignore[union-attr]

    def collect(self):
        labels = self.labelnames
        if self.kind == "counter":
            family: Any = CounterMetricFamily(self.name, self.documentation, labels=labels)
            for key, series in list(self._series.items()):
                family.add_metric(list(key), series.value, created=series.created)
        elif self.kind == "gauge":
            family = GaugeMetricFamily(self.name, self.documentation, labels=labels)
            for key, series in list(self._series.items()):
                family.add_metric(list(key), series.value)
        else:
            family = HistogramMetricFamily(self.name, self.documentation, labels=labels)
            for key, series in list(self._series.items()):
                total = 0
                buckets = []
                for bound, count in zip((*self.buckets, math.inf), series.counts, strict=True):
                    total += count
                    buckets.append((floatToGoString(bound), total))
                family.add_metric(list(key), buckets, series.sum)
                named = dict(zip(labels, key, strict=True))
                family.samples.append(Sample(self.name + "_created", named, series.created))
        yield family


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # the series every request changes: LoopMetric (no lock, no per-call checks)
        self.requests = LoopMetric(
            r,
            "counter",
            "kvplug_requests",
            "Client requests by endpoint and HTTP status",
            ["endpoint", "status"],
        )
        self.request_seconds = LoopMetric(
            r,
            "histogram",
            "kvplug_request_duration_seconds",
            "Time from request to last byte",
            ["endpoint", "stream"],
            _LATENCY_BUCKETS,
        )
        self.ttft_seconds = LoopMetric(
            r,
            "histogram",
            "kvplug_time_to_first_token_seconds",
            "Time from request to the first streamed event",
            buckets=_LATENCY_BUCKETS,
        )
        self.route_seconds = LoopMetric(
            r,
            "histogram",
            "kvplug_route_duration_seconds",
            "Router decision time (hash, query, filters, cost, pick)",
            ["stage"],
            _ROUTE_BUCKETS,
        )
        self.rejected = Counter(
            "kvplug_rejected_requests", "Requests refused before routing", ["reason"], registry=r
        )
        self.routing_errors = Counter(
            "kvplug_routing_errors", "Router refusals by class", ["error"], registry=r
        )
        self.hints_ignored = Counter(
            "kvplug_routing_hints_ignored",
            "Client routing hints left unread (--client-routing-hints ignore)",
            ["hint"],
            registry=r,
        )
        self.retries = Counter(
            "kvplug_retries", "Requests retried on another worker", ["stage"], registry=r
        )
        self.upstream_errors = Counter(
            "kvplug_upstream_errors", "Engine failures by phase", ["worker", "phase"], registry=r
        )
        self.ejections = Counter(
            "kvplug_outlier_ejections",
            "Workers ejected after consecutive failures (outlier detection)",
            ["worker"],
            registry=r,
        )
        self.tokenize_refused = Counter(
            "kvplug_engine_tokenize_skipped",
            "Prompts not sent to an engine's /tokenize, by reason",
            ["reason"],
            registry=r,
        )
        self.token_source = LoopMetric(
            r, "counter", "kvplug_token_source", "Where routing token ids came from", ["source"]
        )
        self.disagg = Counter(
            "kvplug_disaggregated_requests",
            "Two-stage (P/D) requests by outcome",
            ["outcome"],
            registry=r,
        )
        self.inflight = LoopMetric(
            r, "gauge", "kvplug_inflight_requests", "Client requests in flight"
        )
        # admission queue (--router-queue-threshold); the depth reads the queue at scrape time
        self.queue_depth = Gauge(
            "kvplug_router_queue_depth", "Requests waiting in the admission queue", registry=r
        )
        self.queue_requests = Counter(
            "kvplug_router_queue_requests",
            "Admission queue: queued, released, timeout, cancelled, rejected_full",
            ["outcome"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "kvplug_router_queue_wait_seconds",
            "Time spent in the admission queue, by how the request left it",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def attach_state(self, snapshot, router_stats, event_drops=None) -> None:
        self.registry.register(_StateCollector(snapshot, router_stats, event_drops))

    def render(self) -> bytes:
        return generate_latest(self.registry)
