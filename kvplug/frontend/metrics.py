"""Prometheus metrics of the frontend (one registry per app, so several apps can coexist)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvplug_requests",
            "Client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvplug_request_duration_seconds",
            "Time from request to last byte",
            ["endpoint", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvplug_time_to_first_token_seconds",
            "Time from request to the first streamed event",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_seconds = Histogram(
            "kvplug_route_duration_seconds",
            "Router decision time (hash, query, filters, cost, pick)",
            ["stage"],
            buckets=_ROUTE_BUCKETS,
            registry=r,
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
        self.token_source = Counter(
            "kvplug_token_source", "Where routing token ids came from", ["source"], registry=r
        )
        self.disagg = Counter(
            "kvplug_disaggregated_requests",
            "Two-stage (P/D) requests by outcome",
            ["outcome"],
            registry=r,
        )
        self.inflight = Gauge("kvplug_inflight_requests", "Client requests in flight", registry=r)
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
